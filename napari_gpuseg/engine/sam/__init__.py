"""Segment Anything on top of :mod:`napari_gpuseg.models.sam`: the predictor (embeddings, views,
cache, prompts -> masks), the fast decoder, segment-everything, boxes -> masks, label commits."""
