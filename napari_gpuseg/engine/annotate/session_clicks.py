"""Clicks, corrections and a box measured through an :class:`AnnotationSession`, as the
SAM annotator dock makes them.

:func:`session_click_ious` asks for the same prompts as
:func:`~napari_gpuseg.engine.sam.training.click_eval.click_ious` (a first click at an object's most
interior pixel, corrective clicks at the most interior pixel of the larger error, a tight
box on its own) but one object at a time through the session's public calls:
``click`` (the first one keeps the best of the candidate masks; each later one refines
the shown mask, its logits going back as mask input), ``click(positive=False)`` for a
click in a false part, and ``box``. ``benchmarks/clicks.py`` reports these numbers.
"""
from __future__ import annotations

import numpy as np

from ..runtime.cancel import CancelToken, check
from ..sam.training.click_eval import local_mask, next_click, pick_objects, window
from ..sam.training.simulated_prompts import interior_point, mask_iou, tight_box


def session_click_ious(session, image: np.ndarray, labels: np.ndarray, clicks: int = 5,
                       max_objects: int | None = None, seed: int = 0, box: bool = True,
                       cancel: CancelToken | None = None) -> dict:
    """Per-object IoUs after 1..``clicks`` clicks (``"clicks"``: (N, clicks)), the predicted
    IoU the model gave the first click's mask (``"score"``: (N,), as decoded: SAM's IoU head
    can exceed 1) and with a tight box (``"box"``: (N,)) for the objects of ``labels`` (at most ``max_objects``, drawn
    with ``seed``), each object annotated in ``session`` (its image set to ``image``; nothing
    is committed). With every object measured, the image's views are embedded first
    (``session.embed``); else each prompt embeds the views it needs."""
    labels = np.asarray(labels)
    session.set_image(image)
    objs = pick_objects(labels, max_objects, seed)
    n = len(objs)
    out = {"clicks": np.zeros((n, clicks)), "score": np.zeros(n), "box": np.zeros(n) if box else None, "n": n}
    if n == 0:
        return out
    if max_objects is None:
        session.embed()
    shape = labels.shape
    for k, (oid, s) in enumerate(objs):
        check(cancel)
        session.clear()
        x, y = interior_point(labels[s] == oid) + [s[1].start, s[0].start]
        session.click(x, y)
        out["score"][k] = float(session.result.score)
        for c in range(clicks):
            res = session.result
            win = window(s, res, shape)
            truth, pred = labels[win] == oid, local_mask(res, win)
            out["clicks"][k, c] = mask_iou(pred, truth)
            if c + 1 < clicks:
                p, lab = next_click(pred, truth)
                px, py = p + [win[1].start, win[0].start]
                session.click(px, py, positive=bool(lab))
        if box:
            session.box(*(tight_box(labels[s] == oid) + [s[1].start, s[0].start] * 2))
            win = window(s, session.result, shape)
            out["box"][k] = mask_iou(local_mask(session.result, win), labels[win] == oid)
    session.clear()
    return out
