"""The SAM entry points of the Python API, taking images as folder jobs take image files.

``segment_everything(engine, image, channel=None)`` and ``segment_boxes(engine, image,
boxes, channel=None)`` first pass ``image`` through
:func:`~napari_gpuseg.engine.normalize.image_input` (colour detected, ``channel`` of a
multichannel image chosen, a multichannel image without it refused with the folder jobs'
message), then run :func:`napari_gpuseg.engine.sam.automatic.everything.segment_everything` /
:func:`napari_gpuseg.engine.sam.automatic.boxes.segment_boxes` on it, as the ``sam-everything`` and
``sam-boxes`` methods do. GUI-free.
"""
from __future__ import annotations

import numpy as np

from .normalize import image_input


def _plane(image, channel, rgb):
    """A 2D gray or colour image (a ``PreparedImage`` passes as it is)."""
    from ..io import UnsupportedDimensionsError
    from .sam.interactive.inputs import PreparedImage

    if isinstance(image, PreparedImage):
        return image

    x, rgb = image_input(image, channel, rgb)
    if x.ndim - (1 if rgb else 0) != 2:
        raise UnsupportedDimensionsError(
            "image", f"takes a 2D gray (YX) or colour (YXC) image, got shape {tuple(np.shape(image))} "
                     "(give one plane of a stack, or channel=N for a multichannel image)")
    return x


def segment_everything(engine, image, params=None, *, channel: int | None = None, rgb: bool | None = None,
                       **kwargs):
    """Instance labels of everything SAM finds (see the module docstring)."""
    from .sam.automatic.everything import segment_everything as run

    return run(engine, _plane(image, channel, rgb), params, **kwargs)


def segment_boxes(engine, image, boxes, *, channel: int | None = None, rgb: bool | None = None, **kwargs):
    """Masks for box prompts (see the module docstring)."""
    from .sam.automatic.boxes import segment_boxes as run

    return run(engine, _plane(image, channel, rgb), boxes, **kwargs)
