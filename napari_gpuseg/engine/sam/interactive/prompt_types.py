"""What goes into and comes out of :class:`~.predictor.SamEngine`: a :class:`Prompt` per
object (points, a box, a prior mask) and a :class:`MaskResult` per mask, with
:func:`paste_labels` to paint results into one instance label image. Coordinates follow
SAM: (x, y) in image pixels."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from .views import View


MAX_POINTS = 256  # points in one prompt: the decoder's attention over them grows with their square


@dataclass
class Prompt:
    """One object: points (K, 2) xy with labels (1 positive, 0 negative), a box, a prior mask.
    ``ValueError`` (one line) for other labels or more than :data:`MAX_POINTS` points."""

    points: np.ndarray | None = None
    labels: np.ndarray | None = None
    box: np.ndarray | None = None
    mask_input: "MaskResult | None" = None  # previous result to refine

    def __post_init__(self):
        if self.points is not None:
            self.points = prompt_coords(self.points, "points", (-1, 2))
            if len(self.points) > MAX_POINTS:
                raise ValueError(f"a prompt takes at most {MAX_POINTS} points, got {len(self.points)} "
                                 "(SAM decodes a few clicks per object; its decoder's memory grows with "
                                 "the square of the points)")
            if self.labels is None:
                self.labels = np.ones(len(self.points), dtype=np.int64)
            self.labels = point_labels(self.labels)
            if len(self.labels) != len(self.points):
                raise ValueError("points and labels must have the same length")
            if len(self.points) == 0:
                self.points = self.labels = None
        if self.box is not None:
            b = prompt_coords(self.box, "box", (4,))
            self.box = np.array([min(b[0], b[2]), min(b[1], b[3]), max(b[0], b[2]), max(b[1], b[3])])
        if self.points is None and self.box is None:
            raise ValueError("a prompt needs at least one point or a box")

    def check_inside(self, shape: tuple[int, int]) -> None:
        """``ValueError`` naming the box when it has zero width or height or does not
        overlap an image of ``shape`` (H, W); checked by the public :meth:`SamEngine.predict`
        and :meth:`SamEngine.predict_boxes` (internal box decoding keeps one-pixel corner
        boxes of one-pixel objects). A positive point must lie on the image (x in
        [-0.5, W], y in [-0.5, H]: napari's and SAM's pixel conventions both); negative
        points may lie outside (a negative point beside an object at the border is a
        normal prompt)."""
        h, w = shape
        if self.points is not None:
            pos = self.points[self.labels == 1]
            off = (pos[:, 0] < -0.5) | (pos[:, 0] > w) | (pos[:, 1] < -0.5) | (pos[:, 1] > h)
            if off.any():
                x, y = pos[off][0]
                raise ValueError(f"positive point ({x:g}, {y:g}) (x, y in pixels) lies outside the {w} x {h} "
                                 "image; a click must be on the object")
        if self.box is None:
            return
        x0, y0, x1, y1 = self.box
        if x1 <= x0 or y1 <= y0:
            raise ValueError(f"box {self.box.tolist()} has zero width or height (x0, y0, x1, y1 in pixels)")
        if x0 >= w or y0 >= h or x1 <= 0 or y1 <= 0:
            raise ValueError(f"box {self.box.tolist()} (x0, y0, x1, y1) lies outside the {w} x {h} image")


def point_labels(value) -> np.ndarray:
    """Point labels as int64 (K,); ``ValueError`` unless each is 1 (positive) or 0 (negative)."""
    try:
        raw = np.asarray(value, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"point labels must be 1 (positive) or 0 (negative), got {value!r:.80}") from exc
    bad = raw[(raw != 0) & (raw != 1)]
    if len(bad):
        raise ValueError(f"point labels must be 1 (positive) or 0 (negative), got {bad[0]:g}")
    return raw.astype(np.int64)


def prompt_coords(value, name: str, shape: tuple) -> np.ndarray:
    """Prompt coordinates as float64 of ``shape``; ``ValueError`` naming ``name`` when they
    are not numbers, have the wrong size or are NaN/inf."""
    try:
        a = np.asarray(value, dtype=np.float64).reshape(shape)
    except (TypeError, ValueError) as exc:
        want = "(x0, y0, x1, y1)" if name == "box" else "(N, 2) x, y pairs"
        raise ValueError(f"{name} must be {want} numbers, got {value!r:.80}") from exc
    if not np.isfinite(a).all():
        raise ValueError(f"{name} has NaN or infinite coordinates: {a.tolist()!r:.120}")
    return a


@dataclass
class MaskResult:
    """A mask at native resolution for the region of its view; paste with :meth:`full`."""

    mask: np.ndarray  # (h, w) bool over the view's region
    y0: int
    x0: int
    score: float  # predicted IoU
    low_res: torch.Tensor | None = field(repr=False)  # (L, L) logits, for refinement (None: not kept)
    view: View = field(repr=False)
    all_scores: np.ndarray | None = None

    def full(self, shape: tuple[int, int]) -> np.ndarray:
        out = np.zeros(shape, dtype=bool)
        out[self.y0:self.y0 + self.mask.shape[0], self.x0:self.x0 + self.mask.shape[1]] = self.mask
        return out

    @property
    def area(self) -> int:
        return int(self.mask.sum())

    @property
    def predicted_iou(self) -> float:
        """:attr:`score` as the user is shown it (:func:`shown_iou`)."""
        return shown_iou(self.score)


def shown_iou(score: float) -> float:
    """A predicted IoU clamped to [0, 1] (SAM's IoU head is a plain regression: its output
    can exceed 1, or fall under 0); a non-finite one as it is."""
    s = float(score)
    return min(1.0, max(0.0, s)) if np.isfinite(s) else s


def paste_labels(results: Sequence[MaskResult], shape: tuple[int, int],
                 start_id: int = 1, order: str = "score", out: np.ndarray | None = None) -> np.ndarray:
    """Instance labels from masks; overlaps go to the higher-scoring (or smaller) object."""
    labels = np.zeros(shape, dtype=np.int32) if out is None else out
    idx = list(range(len(results)))
    if order == "score":  # paint low scores first so high scores win overlaps
        idx.sort(key=lambda i: results[i].score)
    elif order == "area":  # paint large first so small objects stay visible
        idx.sort(key=lambda i: -results[i].area)
    for rank, i in enumerate(idx):
        r = results[i]
        region = labels[r.y0:r.y0 + r.mask.shape[0], r.x0:r.x0 + r.mask.shape[1]]
        region[r.mask] = start_id + i
    return labels
