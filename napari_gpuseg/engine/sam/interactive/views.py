"""Geometry of SAM "views": square-ish crops of an image that are embedded separately.

A model with a small input (LiteMedSAM: 256 px) loses small objects when a whole field is
shrunk into it, so images larger than the input are embedded as native-resolution tiles
with overlap, and each prompt is routed to the view that holds it best (a box near a tile's
cut edge gets a view centred on it; on the image's own border no margin is needed, so a box
there stays in a tile however it is nudged). Images no larger than the input are one view,
resized up to the input as the official predictor does, unless the caller caps that scale
(the clicks of a decoder tuned here: ``view_selection.py``), which pads it instead.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, order=True)
class View:
    """A crop ``[y0:y0+h, x0:x0+w]`` of the image, resized by ``scale`` into the model input:
    its longest side to the input (``zoom`` 0, the official rule), else by ``zoom`` (smaller:
    the rest of the input is padding)."""

    y0: int
    x0: int
    h: int
    w: int
    input_size: int
    zoom: float = 0.0

    @property
    def scale(self) -> float:
        return self.zoom or self.input_size / max(self.h, self.w)

    @property
    def resized_hw(self) -> tuple[int, int]:
        """Size inside the model input before padding (official ResizeLongestSide rounding),
        at least one pixel a side (a strip 1000x longer than wide would round to none)."""
        s = self.scale
        return max(1, int(self.h * s + 0.5)), max(1, int(self.w * s + 0.5))

    @property
    def y1(self) -> int:
        return self.y0 + self.h

    @property
    def x1(self) -> int:
        return self.x0 + self.w

    def _on_border(self, shape: tuple[int, int] | None) -> tuple[bool, bool, bool, bool]:
        """Which sides (left, top, right, bottom) lie on the border of an image of ``shape``
        (none when the shape is not given)."""
        if shape is None:
            return False, False, False, False
        return self.x0 <= 0, self.y0 <= 0, self.x1 >= shape[1], self.y1 >= shape[0]

    def contains_box(self, box: np.ndarray, margin: float = 0.0, shape: tuple[int, int] | None = None) -> bool:
        """Whether the box (x0, y0, x1, y1) lies inside the view with ``margin`` px to spare.
        Given the image's ``shape``, a side of the view on the image's border needs no
        margin (nothing lies beyond it; a box drawn past the border is cut there)."""
        x0, y0, x1, y1 = box
        left, top, right, bottom = self._on_border(shape)
        return ((left or x0 - margin >= self.x0) and (top or y0 - margin >= self.y0)
                and (right or x1 + margin <= self.x1) and (bottom or y1 + margin <= self.y1))

    def centrality(self, box: np.ndarray, shape: tuple[int, int] | None = None) -> float:
        """Distance from the box centre to the nearest view edge, in image pixels; given the
        image's ``shape``, edges on the image's border do not count (every view reaching
        that border is as close to it)."""
        cx, cy = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
        room = (cx - self.x0, cy - self.y0, self.x1 - cx, self.y1 - cy)
        inner = [d for d, border in zip(room, self._on_border(shape)) if not border]
        return min(inner) if inner else float("inf")

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


def _capped(h: int, w: int, input_size: int, max_scale: float | None) -> float:
    """The ``zoom`` of a view of (h, w): 0 (fill the input) unless that would scale it up by
    more than ``max_scale``."""
    return float(max_scale) if max_scale and input_size / max(h, w) > max_scale else 0.0


def grid_views(shape: tuple[int, int], input_size: int, overlap: int | None = None,
               tile: int | None = None, max_scale: float | None = None) -> list[View]:
    """Views covering an image of ``shape`` (H, W).

    If the image fits the input, one view of the whole image. Otherwise tiles of ``tile``
    px (default: the input size, i.e. native resolution) overlapping by ``overlap`` px
    (default: a quarter of the tile). ``max_scale``: a view smaller than its tile (an image
    smaller than the input) is scaled by at most this much and padded.
    """
    h, w = int(shape[0]), int(shape[1])
    if max(h, w) <= input_size and tile is None:
        return [View(0, 0, h, w, input_size, _capped(h, w, input_size, max_scale))]
    tile = tile or input_size
    overlap = tile // 4 if overlap is None else overlap
    th, tw = min(tile, h), min(tile, w)
    zoom = _capped(th, tw, input_size, max_scale)
    return [View(y, x, th, tw, input_size, zoom)
            for y in _starts(h, th, overlap) for x in _starts(w, tw, overlap)]


def zoom_grid(shape: tuple[int, int], input_size: int, zoom: float, capped: bool = False) -> list[View]:
    """Views ``zoom`` times finer than native: tiles ``input_size / zoom`` px a side,
    overlapping by a quarter, each upscaled to the model input (``zoom`` 1: the native grid).
    ``capped``: an image smaller than a tile is scaled by ``zoom`` and padded, not stretched
    to the input."""
    cap = zoom if capped else None
    if zoom <= 1.0:
        return grid_views(shape, input_size, max_scale=cap)
    return grid_views(shape, input_size, tile=max(8, int(round(input_size / zoom))), max_scale=cap)


def route_click(points: np.ndarray, views: list[View]) -> View | None:
    """The view of ``views`` that holds every (x, y) of ``points`` most centrally (the
    object clicked on is the most likely to lie whole inside it); None if none holds them."""
    pts = np.asarray(points, float).reshape(-1, 2)
    box = np.r_[pts.min(0), pts.max(0)]
    holding = [v for v in views if v.contains_box(box)]
    return max(holding, key=lambda v: v.centrality(box)) if holding else None


def touches_cut(mask: np.ndarray, view: View, shape: tuple[int, int]) -> bool:
    """Whether a view's (h, w) ``mask`` reaches an edge of the view that cuts the image (not
    the image's own border): the object may go on outside the view."""
    m = np.asarray(mask, bool)
    return bool((view.y0 > 0 and m[0].any()) or (view.x0 > 0 and m[:, 0].any())
                or (view.y1 < shape[0] and m[-1].any()) or (view.x1 < shape[1] and m[:, -1].any()))


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


ZOOM_FACTOR, ZOOM_MIN = 3.0, 32  # a small box's own zoomed view: 3x its size, at least 32 px


def zoomed_view(box: np.ndarray, shape: tuple[int, int], input_size: int) -> View:
    """A view centred on a small ``box`` (x0, y0, x1, y1), 3x its size (at least 32 px),
    upscaled to the model input."""
    h, w = int(shape[0]), int(shape[1])
    side = float(max(box[2] - box[0], box[3] - box[1])) + 1
    size = int(min(max(ZOOM_MIN, math.ceil(ZOOM_FACTOR * side)), input_size))
    vh, vw = min(size, h), min(size, w)
    cx, cy = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
    x0 = int(round(min(max(cx - vw / 2, 0), w - vw)))
    y0 = int(round(min(max(cy - vh / 2, 0), h - vh)))
    return View(y0, x0, vh, vw, input_size)


def route_box(box: np.ndarray, views: list[View], shape: tuple[int, int], input_size: int,
              margin: float = 4.0, zoom_below: float | None = None, side: float | None = None) -> View:
    """The view one box is decoded in, on its own (no sharing; see ``boxes.plan_views``):
    the most central of ``views`` (the finest scale first) holding it with ``margin`` (model
    input px; none needed on the image's border), or a new view centred on it. With
    ``zoom_below``, a box whose ``side`` (px, default: the box's own longest side) is smaller
    gets :func:`zoomed_view` instead: objects a few pixels across are otherwise segmented
    far too large (BBBC039, LiteMedSAM; docs/benchmarks.md)."""
    if side is None:
        side = float(max(box[2] - box[0], box[3] - box[1])) + 1
    if zoom_below and side < zoom_below:
        return zoomed_view(box, shape, input_size)
    # a box at the image's border needs no margin there: otherwise no view would hold an
    # object the border cuts, and each nudge of its box would make (and embed) a new view.
    # The margin is in model input px: a shrunk view (scale < 1) keeps more image px.
    holding = [v for v in views if v.contains_box(box, margin / min(1.0, v.scale), shape) or (
        v.h == shape[0] and v.w == shape[1])]
    if holding:
        # prefer the finest scale, then the most central
        return max(holding, key=lambda v: (v.scale, v.centrality(box, shape)))
    return centred_view(box, shape, input_size)


def route_native(extent: np.ndarray, grid: list[View], made: list[View], shape: tuple[int, int],
                 input_size: int, click: bool = False) -> View:
    """The native-scale view of a prompt whose ``extent`` is (x0, y0, x1, y1): the most
    central grid tile holding it, a view in ``made`` (views made earlier for other
    prompts of the image, reused) or a new one centred on it, appended to ``made``
    (bounded). A ``click`` (no box) takes a grid tile whenever one holds it, so its view
    never depends on the prompts made before it."""
    if click:
        view = route_box(extent, grid, shape, input_size)
        if view in grid:
            return view
        # no grid tile holds it (none covers the whole image either): the views made before
    view = route_box(extent, made if click else grid + made, shape, input_size)
    if view not in made and view not in grid:
        made.append(view)
        del made[:-256]
    return view


def prompt_box(points: np.ndarray | None, box: np.ndarray | None) -> np.ndarray:
    """The (x0, y0, x1, y1) extent of a prompt (points and/or a box) used for routing."""
    parts = []
    if box is not None:
        parts.append(np.asarray(box, float).reshape(2, 2))
    if points is not None and len(points):
        parts.append(np.asarray(points, float).reshape(-1, 2))
    pts = np.concatenate(parts, 0)
    return np.array([pts[:, 0].min(), pts[:, 1].min(), pts[:, 0].max(), pts[:, 1].max()])


MAX_COVER_WORK = 2 * 10**7  # candidate positions x boxes looked at by a cover


@dataclass
class ViewSize:
    """One kind of view a cover may use: ``size`` px of the image (clipped to it) resized to
    the model input; ``margin`` (N,) px each box keeps from its edges; ``allowed`` (N,)
    the boxes it may serve; ``prefer``: views of this kind (e.g. the grid tiles, which the
    annotator and the cache share) that win ties over new positions; ``free``: views already
    embedded, taken before anything else; ``new_positions``: False tries ``prefer`` only;
    ``align``: new positions are multiples of it (views cut from a field map)."""

    size: int
    margin: np.ndarray
    allowed: np.ndarray
    prefer: list = field(default_factory=list)
    free: list = field(default_factory=list)
    new_positions: bool = True
    align: int = 1


def plan_cover(boxes: np.ndarray, shape: tuple[int, int], input_size: int,
               kinds: list[ViewSize]) -> tuple[list[View], np.ndarray]:
    """Few views, of the given kinds, that together hold every box.

    ``boxes`` (N, 4) inclusive corners. A view of a kind holds a box that kind allows with
    the box's margin inside it. Greedy set cover over every kind at once (all views cost one
    encoder pass): the view holding the most boxes not yet held is taken first. A view that
    holds a set of boxes can always slide right/down until its left/top edge touches one of
    them, so new positions are tried at every (box left, box top) pair. Each box then goes
    to the finest-scale chosen view holding it: an already embedded one, else the most
    central. Returns the views
    and, per box, the index of its view (-1 for a box that no kind can hold).
    """
    b = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    n = len(b)
    if n == 0:
        return [], np.zeros(0, dtype=np.int64)
    h, w = int(shape[0]), int(shape[1])
    cands, holds, bonus, free = [], [], [], []
    for kind in kinds:
        m = np.broadcast_to(np.asarray(kind.margin, dtype=np.float64), (n,))
        ok = np.broadcast_to(np.asarray(kind.allowed, dtype=bool), (n,))
        lo = np.maximum(np.floor(b[:, :2] - m[:, None]), 0)  # (x, y) that must be inside
        hi = np.minimum(np.ceil(b[:, 2:] + m[:, None]), [w - 1, h - 1])
        vh, vw = min(kind.size, h), min(kind.size, w)
        xs = ys = np.zeros(0, dtype=np.int64)
        if kind.new_positions and ok.any():
            xs = np.unique(np.clip(lo[ok, 0], 0, w - vw)).astype(np.int64)
            ys = np.unique(np.clip(lo[ok, 1], 0, h - vh)).astype(np.int64)
            if kind.align > 1:  # rounded down: a view that held its box may now miss it (checked below)
                xs, ys = np.unique(xs // kind.align * kind.align), np.unique(ys // kind.align * kind.align)
            step = 1
            while len(xs) * len(ys) * n > MAX_COVER_WORK:  # many boxes: coarser positions
                step *= 2
                xs, ys = np.unique(xs // step * step), np.unique(ys // step * step)
        fixed = list(kind.free) + [v for v in kind.prefer if v not in kind.free]
        c = np.asarray([(v.y0, v.x0, v.h, v.w) for v in fixed]
                       + [(y, x, vh, vw) for y in ys for x in xs], dtype=np.int64).reshape(-1, 4)
        hold = (ok[None] & (lo[None, :, 0] >= c[:, None, 1]) & (lo[None, :, 1] >= c[:, None, 0])
                & (hi[None, :, 0] < c[:, None, 1] + c[:, None, 3])
                & (hi[None, :, 1] < c[:, None, 0] + c[:, None, 2]))
        bn = np.zeros(len(c))
        bn[len(kind.free):len(fixed)] = 0.5  # a preferred view wins a tie
        fr = np.zeros(len(c), bool)
        fr[:len(kind.free)] = True
        cands += [View(int(y), int(x), int(ch), int(cw), input_size) for y, x, ch, cw in c]
        holds.append(hold)
        bonus.append(bn)
        free.append(fr)
    hold = np.concatenate(holds)
    bonus, free = np.concatenate(bonus), np.concatenate(free)
    left = hold.any(0)
    chosen: list[int] = [k for k in np.nonzero(free)[0] if (hold[k] & left).any()]  # already embedded
    for k in chosen:
        left &= ~hold[k]
    counts = hold[:, left].sum(1) + bonus
    while left.any():
        k = int(np.argmax(counts))
        got = hold[k] & left
        counts -= hold[:, got].sum(1)
        chosen.append(k)
        left &= ~got
    views = [cands[k] for k in chosen]
    assign = np.full(n, -1, dtype=np.int64)
    for i in np.nonzero(hold[chosen].any(0) if chosen else np.zeros(n, bool))[0]:
        fits = [j for j, k in enumerate(chosen) if hold[k, i]]
        assign[i] = max(fits, key=lambda j: (views[j].scale, free[chosen[j]], views[j].centrality(b[i])))
    return views, assign


def cover_boxes(boxes: np.ndarray, shape: tuple[int, int], size: int, input_size: int,
                margin: np.ndarray | float = 4.0, prefer: list[View] | tuple = ()) -> tuple[list[View], np.ndarray]:
    """:func:`plan_cover` with one kind of view: ``size`` px, every box held with its
    ``margin`` (px, scalar or per box), ``prefer`` views winning ties."""
    n = len(np.asarray(boxes).reshape(-1, 4))
    return plan_cover(boxes, shape, input_size, [ViewSize(size, margin, np.ones(n, bool), list(prefer))])
