"""Simulated user prompts for one object: the first click or box, then corrective clicks.

Shared by decoder fine-tuning (:mod:`finetune`) and the click evaluation
(:mod:`click_eval`), so a model is trained on the prompts it is measured with. A first
click is the object's most interior pixel (the maximum of its distance transform); a
corrective click goes to the most interior pixel of the larger error: positive inside the
largest missed part, negative inside the largest false part (as micro-sam evaluates
interactive segmentation). Coordinates are (x, y) pixels. No Qt, no napari, no torch.
"""
from __future__ import annotations

import numpy as np
from scipy import ndimage as ndi


def interior_point(mask: np.ndarray, rng: np.random.Generator | None = None,
                   spread: float = 0.0) -> np.ndarray | None:
    """(x, y) of the most interior pixel of ``mask``; with ``rng`` and ``spread`` > 0, a
    random pixel whose distance to the edge is at least ``(1 - spread)`` of the maximum
    (a user does not always hit the centre). ``None`` for an empty mask."""
    m = np.asarray(mask, bool)
    if not m.any():
        return None
    dist = ndi.distance_transform_edt(np.pad(m, 1))[1:-1, 1:-1]
    if rng is None or spread <= 0:
        y, x = np.unravel_index(int(np.argmax(dist)), dist.shape)
        return np.array([x, y], dtype=np.float64)
    ys, xs = np.nonzero(dist >= (1.0 - spread) * dist.max())
    i = int(rng.integers(len(ys)))
    return np.array([xs[i], ys[i]], dtype=np.float64)


def tight_box(mask: np.ndarray) -> np.ndarray | None:
    """(x0, y0, x1, y1) of ``mask``'s pixels (inclusive corners), ``None`` when empty."""
    ys, xs = np.nonzero(np.asarray(mask, bool))
    if len(ys) == 0:
        return None
    return np.array([xs.min(), ys.min(), xs.max(), ys.max()], dtype=np.float64)


def jitter_box(box: np.ndarray, rng: np.random.Generator, frac: float = 0.1,
               limit: tuple[int, int] | None = None) -> np.ndarray:
    """``box`` with each side moved by up to ``frac`` of the box size (at least 1 px), as a
    user draws it; clipped to ``limit`` (H, W) when given."""
    b = np.asarray(box, np.float64).copy()
    w, h = b[2] - b[0] + 1, b[3] - b[1] + 1
    d = rng.uniform(-1, 1, 4) * np.array([w, h, w, h]) * frac
    b += np.round(d)
    b[[0, 2]] = np.sort(b[[0, 2]])
    b[[1, 3]] = np.sort(b[[1, 3]])
    if limit is not None:
        b[[0, 2]] = np.clip(b[[0, 2]], 0, limit[1] - 1)
        b[[1, 3]] = np.clip(b[[1, 3]], 0, limit[0] - 1)
    return b


def corrective_point(pred: np.ndarray, truth: np.ndarray) -> tuple[np.ndarray, int] | None:
    """The next click for a mask ``pred`` of object ``truth``: ((x, y), 1) inside the most
    interior missed pixel, or ((x, y), 0) inside the most interior false one, whichever
    error lies deeper. ``None`` when the mask is exact."""
    pred = np.asarray(pred, bool)
    truth = np.asarray(truth, bool)
    best = None
    for err, label in ((truth & ~pred, 1), (pred & ~truth, 0)):
        if not err.any():
            continue
        dist = ndi.distance_transform_edt(np.pad(err, 1))[1:-1, 1:-1]
        k = int(np.argmax(dist))
        if best is None or dist.flat[k] > best[0]:
            y, x = np.unravel_index(k, dist.shape)
            best = (dist.flat[k], np.array([x, y], dtype=np.float64), label)
    return None if best is None else (best[1], best[2])


def mask_iou(a: np.ndarray, b: np.ndarray) -> float:
    """Intersection over union of two boolean masks (1.0 when both are empty)."""
    a, b = np.asarray(a, bool), np.asarray(b, bool)
    union = np.count_nonzero(a | b)
    return 1.0 if union == 0 else np.count_nonzero(a & b) / union
