"""The annotator's side of images too big to annotate whole (a mosaic, a whole slide): the
part of such an image on the canvas (``engine/annotate/region.py`` sets the limits) becomes an
image layer of its own, placed exactly over the big one (same pixel size, offset by the
region's corner), and the annotator follows it like any image; its ``SAM labels`` layer lies
over the big image too. A lazily read image stays lazy.
"""
from __future__ import annotations

import numpy as np

from ..engine.annotate import region as regions
from ._annotation_layers import spatial_shape

REGION_BUTTON = "Annotate the region in view"


def plane_pixels(layer) -> int:
    h, w = spatial_shape(layer)[-2:]
    return int(h) * int(w)


def too_big(layer) -> bool:
    return regions.too_big(spatial_shape(layer))


def region_in_view(viewer, layer) -> tuple[int, int, int, int]:
    """``(y0, y1, x0, x1)``: the pixels of ``layer`` on the canvas, in its own pixels."""
    h, w = spatial_shape(layer)[-2:]
    world = np.array(viewer.dims.point, dtype=float)
    shown = list(viewer.dims.displayed)[-2:]
    cy, cx = np.asarray(viewer.camera.center, float)[-2:]
    ch, cw = np.asarray(viewer.canvas.size, float)[-2:] / max(viewer.camera.zoom, 1e-9)  # (height, width)
    corners = []
    for y in (cy - ch / 2, cy + ch / 2):
        for x in (cx - cw / 2, cx + cw / 2):
            world[shown] = (y, x)
            corners.append(np.asarray(layer.world_to_data(world), float)[-2:])
    (y_lo, x_lo), (y_hi, x_hi) = np.min(corners, 0), np.max(corners, 0)
    y0, y1 = regions.span(max(y_lo, 0.0), min(y_hi, h), int(h))
    x0, x1 = regions.span(max(x_lo, 0.0), min(x_hi, w), int(w))
    return y0, y1, x0, x1


def add_region(viewer, layer, region: tuple[int, int, int, int]):
    """An image layer of ``layer``'s pixels in ``region``, over them on the canvas."""
    y0, y1, x0, x1 = region
    data = layer.data[0] if getattr(layer, "multiscale", False) else layer.data
    tail = (slice(None),) if layer.rgb else ()
    part = regions.lazy(data)[(Ellipsis, slice(y0, y1), slice(x0, x1)) + tail]
    scale = np.asarray(layer.scale, float)
    translate = np.asarray(layer.translate, float).copy()
    translate[-2:] += scale[-2:] * (y0, x0)
    kw = {} if layer.rgb else {"colormap": layer.colormap.name, "contrast_limits": layer.contrast_limits}
    return viewer.add_image(part, name=f"{layer.name} [{y0}:{y1}, {x0}:{x1}]", rgb=layer.rgb,
                            scale=scale, translate=translate, **kw)
