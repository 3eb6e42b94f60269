"""Images too big to annotate whole (a mosaic, a whole slide, a big plane of a stack).

The annotator prepares and embeds the whole plane it follows: for a 16384 x 16384 image that
is 3 GiB of normalised pixels, about 23,000 tiles, and 42 s before a first mask on a
2-core CPU (``benchmarks/big_image.py``). Above :data:`MAX_PLANE_PX` it does not start that.
It says so and offers
**Annotate the region in view**: the part of the image on the canvas (at most
:data:`REGION_SIDE` pixels a side, at least :data:`MIN_REGION_SIDE`) becomes an image layer of
its own, placed exactly over the big one (same pixel size, offset by the region's corner), and
the annotator follows it like any image; its ``SAM labels`` layer lies over the big image too.
A lazily read image (dask, zarr, a multiscale pyramid's full-resolution level) stays lazy:
the region is read a plane at a time when the annotator needs it.
"""
from __future__ import annotations

import numpy as np
from qtpy.QtWidgets import QPushButton

from ._annotation_layers import spatial_shape

MAX_PLANE_PX = 8192 * 8192
REGION_SIDE = 4096
MIN_REGION_SIDE = 512
REGION_BUTTON = "Annotate the region in view"


def plane_pixels(layer) -> int:
    h, w = spatial_shape(layer)[-2:]
    return int(h) * int(w)


def too_big(layer) -> bool:
    return plane_pixels(layer) > MAX_PLANE_PX


def _span(lo: float, hi: float, size: int) -> tuple[int, int]:
    """``[lo, hi)`` as whole pixels inside ``[0, size)``, at most :data:`REGION_SIDE` long
    (kept around its centre) and at least :data:`MIN_REGION_SIDE` (or the whole axis)."""
    centre = (lo + hi) / 2
    side = int(np.clip(np.ceil(hi - lo), min(MIN_REGION_SIDE, size), min(REGION_SIDE, size)))
    start = int(np.clip(round(centre - side / 2), 0, size - side))
    return start, start + side


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
    y0, y1 = _span(max(y_lo, 0.0), min(y_hi, h), int(h))
    x0, x1 = _span(max(x_lo, 0.0), min(x_hi, w), int(w))
    return y0, y1, x0, x1


def _lazy(data):
    """Slicing ``data`` must not read more than the region: numpy slices are views, dask
    stays lazy, anything else (zarr, a pyramid level) is wrapped in dask first."""
    if isinstance(data, np.ndarray) or type(data).__module__.startswith("dask"):
        return data
    import dask.array as da

    return da.from_array(data, chunks=getattr(data, "chunks", "auto"))


def add_region(viewer, layer, region: tuple[int, int, int, int]):
    """An image layer of ``layer``'s pixels in ``region``, over them on the canvas."""
    y0, y1, x0, x1 = region
    data = layer.data[0] if getattr(layer, "multiscale", False) else layer.data
    tail = (slice(None),) if layer.rgb else ()
    part = _lazy(data)[(Ellipsis, slice(y0, y1), slice(x0, x1)) + tail]
    scale = np.asarray(layer.scale, float)
    translate = np.asarray(layer.translate, float).copy()
    translate[-2:] += scale[-2:] * (y0, x0)
    kw = {} if layer.rgb else {"colormap": layer.colormap.name, "contrast_limits": layer.contrast_limits}
    return viewer.add_image(part, name=f"{layer.name} [{y0}:{y1}, {x0}:{x1}]", rgb=layer.rgb,
                            scale=scale, translate=translate, **kw)


class RegionActions:
    """The annotator's part for images too big to annotate whole. Host: ``viewer``,
    ``image_layer``, ``hint_label``, ``_set_status``, ``_update_hint``."""

    _region_only = False  # the followed image is too big: no work is started for it

    def _make_region_button(self) -> QPushButton:
        self.region_btn = QPushButton(REGION_BUTTON)
        self.region_btn.setToolTip("Annotate the part of this image on the canvas as an image layer of its own, "
                                   "placed over it (at most %d px a side)" % REGION_SIDE)
        self.region_btn.clicked.connect(self.annotate_region)
        self.region_btn.setVisible(False)
        return self.region_btn

    def _offer_region(self, layer) -> bool:
        """True (and the offer made) when ``layer`` is too big to annotate whole."""
        self._region_only = too_big(layer)
        self.region_btn.setVisible(self._region_only)
        if not self._region_only:
            self._update_hint()
            return False
        h, w = spatial_shape(layer)[-2:]
        self.hint_label.setText(
            f"{h} x {w} px is more than the annotator embeds whole ({MAX_PLANE_PX / 2**20:.0f} Mpx). Pan and "
            f"zoom to the part to annotate, then press '{REGION_BUTTON}' (at most {REGION_SIDE} px a side). "
            "SAM automatic and U-Net predict run the whole image in blocks.")
        self._set_status(f"{layer.name}: {h} x {w} px, too big to annotate whole")
        return True

    def annotate_region(self):
        """Add the region in view as an image layer; the annotator follows it (it is active)."""
        layer = self.image_layer
        if layer is None or layer not in self.viewer.layers or not too_big(layer):
            return None
        return add_region(self.viewer, layer, region_in_view(self.viewer, layer))
