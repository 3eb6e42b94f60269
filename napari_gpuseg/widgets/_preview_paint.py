"""Painting the current object into the SAM preview layer, changed pixels only."""
from __future__ import annotations

import numpy as np


def _union(a: tuple | None, b: tuple | None) -> tuple | None:
    if a is None:
        return b
    if b is None:
        return a
    return (min(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), max(a[3], b[3]))


class PreviewPaint:
    """Writes a mask into a labels layer through ``Labels.data_setitem`` with only the
    pixels that differ from what is shown, inside the rectangle of the mask shown before and
    the new one: napari then uploads that rectangle to the canvas, not the whole plane (a
    ``refresh()`` re-slices and uploads the plane, whose cost grows with the image while a
    box edit's change does not). It remembers where it painted (layer, plane, rectangle);
    anything it did not paint itself (a new layer, a plane it did not draw) gets one whole
    clear and refresh first."""

    def __init__(self) -> None:
        self._layer = None
        self._plane: tuple | None = None
        self._rect: tuple | None = None  # (y0, y1, x0, x1) holding every pixel painted, None: none

    def show(self, layer, index: tuple, mask: np.ndarray, y0: int = 0, x0: int = 0) -> None:
        """Show ``mask`` (bool, placed at ``y0, x0`` of plane ``index``) as label 1, and
        nothing else on the layer."""
        data = layer.data
        plane_shape = data.shape[len(index):]
        if layer is not self._layer:
            self._restart(layer)
        elif self._plane != index:
            self._write(layer, self._plane, None, 0, 0, self._rect)  # the old plane's mask goes
            self._rect = None
        h, w = mask.shape
        ya, yb = max(y0, 0), min(y0 + h, plane_shape[0])
        xa, xb = max(x0, 0), min(x0 + w, plane_shape[1])
        new = (ya, yb, xa, xb) if ya < yb and xa < xb else None
        self._write(layer, index, mask, y0, x0, _union(self._rect, new))
        self._plane, self._rect = index, new

    def clear(self, layer) -> None:
        """Nothing shown on ``layer``."""
        if layer is not self._layer:
            self._restart(layer)
            return
        if self._rect is not None:
            self._write(layer, self._plane, None, 0, 0, self._rect)
        self._rect = None

    def _restart(self, layer) -> None:
        if layer.data.any():
            layer.data[...] = 0
            layer.refresh()
        self._layer, self._plane, self._rect = layer, None, None

    @staticmethod
    def _write(layer, index: tuple, mask, y0: int, x0: int, rect: tuple | None) -> None:
        """Make ``rect`` of plane ``index`` equal to ``mask`` there (None: zeros)."""
        if rect is None or index is None:
            return
        data = layer.data
        plane_shape = data.shape[len(index):]
        ya, yb = max(rect[0], 0), min(rect[1], plane_shape[0])
        xa, xb = max(rect[2], 0), min(rect[3], plane_shape[1])
        if ya >= yb or xa >= xb:
            return
        want = np.zeros((yb - ya, xb - xa), bool)
        if mask is not None:  # the mask's part inside the rectangle
            h, w = mask.shape
            sy, sx = max(ya, y0), max(xa, x0)
            ey, ex = min(yb, y0 + h), min(xb, x0 + w)
            if sy < ey and sx < ex:
                want[sy - ya:ey - ya, sx - xa:ex - xa] = mask[sy - y0:ey - y0, sx - x0:ex - x0]
        shown = data[index + (slice(ya, yb), slice(xa, xb))] != 0
        ys, xs = np.nonzero(shown != want)
        if ys.size == 0:
            return
        lead = tuple(np.full(ys.size, i, dtype=np.intp) for i in index)
        layer.data_setitem(lead + (ys + ya, xs + xa), want[ys, xs].astype(data.dtype))
