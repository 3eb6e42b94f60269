"""napari-gpuseg: fast interactive and batch segmentation for napari."""

__version__ = "0.1.0"
