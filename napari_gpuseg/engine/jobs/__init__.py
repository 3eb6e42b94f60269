"""Folder jobs: the pipeline, segmentation methods by name, reports, output files, sharding."""
