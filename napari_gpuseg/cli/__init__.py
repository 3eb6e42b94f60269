"""The ``napari-gpuseg`` command: the GUI, ``batch`` (folder jobs), ``train`` and ``info``."""
from .main import main

__all__ = ["main"]
