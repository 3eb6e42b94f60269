"""Prompts -> masks on one image: the predictor (:class:`~.predictor.SamEngine`), its views,
embedding cache, inputs, decoder calls, the first look from a small crop, the whole-field
embedding map, and the background embedding of a stack."""
