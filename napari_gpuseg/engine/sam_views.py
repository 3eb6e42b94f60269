"""Geometry of SAM "views": square-ish crops of an image that are embedded separately.

A model with a small input (LiteMedSAM: 256 px) loses small objects when a whole field is
shrunk into it, so images larger than the input are embedded as native-resolution tiles
with overlap, and each prompt is routed to the view that holds it best (a box near a tile
border gets a view centred on it). Images no larger than the input are one view, resized
up to the input as the official predictor does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, order=True)
class View:
    """A crop ``[y0:y0+h, x0:x0+w]`` of the image, resized by ``scale`` into the model input."""

    y0: int
    x0: int
    h: int
    w: int
    input_size: int

    @property
    def scale(self) -> float:
        return self.input_size / max(self.h, self.w)

    @property
    def resized_hw(self) -> tuple[int, int]:
        """Size inside the model input before padding (official ResizeLongestSide rounding)."""
        s = self.scale
        return int(self.h * s + 0.5), int(self.w * s + 0.5)

    @property
    def y1(self) -> int:
        return self.y0 + self.h

    @property
    def x1(self) -> int:
        return self.x0 + self.w

    def contains_box(self, box: np.ndarray, margin: float = 0.0) -> bool:
        x0, y0, x1, y1 = box
        return (x0 - margin >= self.x0 and y0 - margin >= self.y0
                and x1 + margin <= self.x1 and y1 + margin <= self.y1)

    def centrality(self, box: np.ndarray) -> float:
        """Distance from the box centre to the nearest view edge, in image pixels."""
        cx, cy = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
        return min(cx - self.x0, self.x1 - cx, cy - self.y0, self.y1 - cy)

    def to_input(self, xy: np.ndarray) -> np.ndarray:
        """Image (x, y) coordinates -> model input coordinates (same array layout)."""
        out = np.asarray(xy, dtype=np.float64).copy()
        out[..., 0::2] = (out[..., 0::2] - self.x0) * (self.resized_hw[1] / self.w)
        out[..., 1::2] = (out[..., 1::2] - self.y0) * (self.resized_hw[0] / self.h)
        return out


def _starts(length: int, tile: int, overlap: int) -> list[int]:
    if length <= tile:
        return [0]
    stride = max(1, tile - overlap)
    n = math.ceil((length - tile) / stride) + 1
    starts = [min(i * stride, length - tile) for i in range(n)]
    return sorted(set(starts))


def grid_views(shape: tuple[int, int], input_size: int, overlap: int | None = None,
               tile: int | None = None) -> list[View]:
    """Views covering an image of ``shape`` (H, W).

    If the image fits the input, one view of the whole image. Otherwise tiles of ``tile``
    px (default: the input size, i.e. native resolution) overlapping by ``overlap`` px
    (default: a quarter of the tile).
    """
    h, w = int(shape[0]), int(shape[1])
    if max(h, w) <= input_size and tile is None:
        return [View(0, 0, h, w, input_size)]
    tile = tile or input_size
    overlap = tile // 4 if overlap is None else overlap
    th, tw = min(tile, h), min(tile, w)
    return [View(y, x, th, tw, input_size)
            for y in _starts(h, th, overlap) for x in _starts(w, tw, overlap)]


def centred_view(box: np.ndarray, shape: tuple[int, int], input_size: int,
                 context: float = 1.25) -> View:
    """A view centred on ``box`` (x0, y0, x1, y1): native size if the box fits, larger otherwise."""
    h, w = int(shape[0]), int(shape[1])
    bw, bh = box[2] - box[0], box[3] - box[1]
    size = max(input_size, int(math.ceil(max(bw, bh) * context)))
    vh, vw = min(size, h), min(size, w)
    cx, cy = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
    x0 = int(round(min(max(cx - vw / 2, 0), w - vw)))
    y0 = int(round(min(max(cy - vh / 2, 0), h - vh)))
    return View(y0, x0, vh, vw, input_size)


def route_box(box: np.ndarray, views: list[View], shape: tuple[int, int], input_size: int,
              margin: float = 4.0) -> View:
    """The best view for a box: the most central grid view holding it with ``margin``,
    or a new view centred on it."""
    holding = [v for v in views if v.contains_box(box, margin) or (
        v.h == shape[0] and v.w == shape[1])]
    if holding:
        # prefer the finest scale, then the most central
        return max(holding, key=lambda v: (v.scale, v.centrality(box)))
    return centred_view(box, shape, input_size)


def prompt_box(points: np.ndarray | None, box: np.ndarray | None) -> np.ndarray:
    """The (x0, y0, x1, y1) extent of a prompt (points and/or a box) used for routing."""
    parts = []
    if box is not None:
        parts.append(np.asarray(box, float).reshape(2, 2))
    if points is not None and len(points):
        parts.append(np.asarray(points, float).reshape(-1, 2))
    pts = np.concatenate(parts, 0)
    return np.array([pts[:, 0].min(), pts[:, 1].min(), pts[:, 0].max(), pts[:, 1].max()])
