"""Interactive segmentation measured as a user works: clicks, corrections, a box.

For each object of a labelled image, through the public :meth:`SamEngine.predict`: one
positive click at the object's most interior pixel (the best of the candidate masks,
as the annotator's first click), then corrective clicks at the most interior pixel of
the larger error (positive in a missed part, negative in a false one) with the previous
mask's logits as mask input (as the annotator's later clicks); separately, one tight box.
The mean IoU per object after each click and with the box is what
``benchmarks/clicks.py`` reports. All objects of one round go in one ``predict`` call.
"""
from __future__ import annotations

import numpy as np
from scipy import ndimage as ndi

from ...runtime.cancel import CancelToken, check
from .simulated_prompts import corrective_point, interior_point, mask_iou, tight_box
from ..interactive.predictor import Prompt

MIN_OBJECT_AREA = 10  # px: smaller label fragments are not clicked


def _window(slices, result, shape, pad: int = 2):
    """A window holding an object's box and its current mask's region."""
    y0 = min(slices[0].start, result.y0) - pad
    x0 = min(slices[1].start, result.x0) - pad
    y1 = max(slices[0].stop, result.y0 + result.mask.shape[0]) + pad
    x1 = max(slices[1].stop, result.x0 + result.mask.shape[1]) + pad
    return slice(max(0, y0), min(shape[0], y1)), slice(max(0, x0), min(shape[1], x1))


def _local(result, win) -> np.ndarray:
    """``result``'s mask inside the window ``win`` (image coordinates)."""
    h, w = win[0].stop - win[0].start, win[1].stop - win[1].start
    out = np.zeros((h, w), bool)
    ry0, rx0 = result.y0 - win[0].start, result.x0 - win[1].start
    m = result.mask
    ys, xs = max(0, -ry0), max(0, -rx0)
    ye, xe = min(m.shape[0], h - ry0), min(m.shape[1], w - rx0)
    if ye > ys and xe > xs:
        out[ry0 + ys:ry0 + ye, rx0 + xs:rx0 + xe] = m[ys:ye, xs:xe]
    return out


def pick_objects(labels: np.ndarray, max_objects: int | None = None, seed: int = 0) -> list[tuple]:
    """``(id, slices)`` of the objects of ``labels`` that are clicked: every one of at least
    :data:`MIN_OBJECT_AREA` px, at most ``max_objects`` of them drawn with ``seed``."""
    slices = ndi.find_objects(labels.astype(np.int64) if labels.dtype.kind != "i" else labels)
    objs = [(i + 1, s) for i, s in enumerate(slices)
            if s is not None and np.count_nonzero(labels[s] == i + 1) >= MIN_OBJECT_AREA]
    if max_objects is not None and len(objs) > max_objects:
        pick = np.random.default_rng(seed).choice(len(objs), max_objects, replace=False)
        objs = [objs[k] for k in sorted(pick)]
    return objs


def window(slices, result, shape, pad: int = 2):
    """A window holding an object's box and its current mask's region (image coordinates)."""
    return _window(slices, result, shape, pad)


def local_mask(result, win) -> np.ndarray:
    """``result``'s mask inside the window ``win``."""
    return _local(result, win)


def click_ious(engine, image: np.ndarray, labels: np.ndarray, clicks: int = 5,
               max_objects: int | None = None, seed: int = 0, box: bool = True,
               cancel: CancelToken | None = None) -> dict:
    """Per-object IoUs after 1..``clicks`` clicks (``"clicks"``: (N, clicks)) and with a
    tight box (``"box"``: (N,)), for the objects of ``labels`` (at most ``max_objects``,
    drawn with ``seed``; objects under :data:`MIN_OBJECT_AREA` px are skipped)."""
    labels = np.asarray(labels)
    prepared = engine.prepare(image)
    objs = pick_objects(labels, max_objects, seed)
    n = len(objs)
    out = {"clicks": np.zeros((n, clicks)), "box": np.zeros(n) if box else None, "n": n}
    if n == 0:
        return out
    if max_objects is None:  # every object: every view, in one batch; else only the views used (lazily)
        engine.embed([prepared], [engine.prompt_views(prepared)], cancel=cancel)
    shape = labels.shape
    pts = [interior_point(labels[s] == oid) + [s[1].start, s[0].start] for oid, s in objs]
    points = [p[None] for p in pts]
    labs = [np.ones(1, np.int64) for _ in objs]
    results = engine.predict(prepared, [Prompt(points=p, labels=l) for p, l in zip(points, labs)],
                             multimask=True, cancel=cancel)
    for c in range(clicks):
        check(cancel)
        nxt = []
        for k, ((oid, s), res) in enumerate(zip(objs, results)):
            win = _window(s, res, shape)
            truth, pred = labels[win] == oid, _local(res, win)
            out["clicks"][k, c] = mask_iou(pred, truth)
            if c + 1 < clicks:
                p, lab = next_click(pred, truth)
                points[k] = np.concatenate([points[k], (p + [win[1].start, win[0].start])[None]])
                labs[k] = np.append(labs[k], lab)
                nxt.append(Prompt(points=points[k], labels=labs[k], mask_input=res))
        if nxt:
            results = engine.predict(prepared, nxt, cancel=cancel)
    if box:
        boxes = [tight_box(labels[s] == oid) + [s[1].start, s[0].start] * 2 for oid, s in objs]
        results = engine.predict(prepared, [Prompt(box=b) for b in boxes], cancel=cancel)
        for k, ((oid, s), res) in enumerate(zip(objs, results)):
            win = _window(s, res, shape)
            out["box"][k] = mask_iou(_local(res, win), labels[win] == oid)
    return out


def next_click(pred: np.ndarray, truth: np.ndarray) -> tuple[np.ndarray, int]:
    """The simulated user's next click, (x, y) and its label: at the most interior pixel of
    the larger error (positive in a missed part, negative in a false one); on an exact mask,
    a positive click inside the object (it changes nothing)."""
    corr = corrective_point(pred, truth)
    return corr if corr is not None else (interior_point(truth), 1)
