"""Segment Anything on top of :mod:`napari_gpuseg.models.sam`, by job:

- :mod:`.loader`: a model by registry name or file -> a :class:`~.interactive.predictor.SamEngine`;
- :mod:`.interactive`: prompts -> masks (the predictor, its views, cache and decoder calls);
- :mod:`.automatic`: segment-everything and boxes -> masks;
- :mod:`.training`: decoder fine-tuning and adaptation with simulated prompts, click evaluation;
- :mod:`.propagation`: objects carried through a stack.

Dependencies go one way: automatic, training and propagation use interactive; interactive
uses none of them."""
