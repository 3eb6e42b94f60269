"""Checks of a block run against the whole image segmented in one piece: objects split at
a seam (the failure stitching prevents), for the tests and benchmarks. GUI-free."""
from __future__ import annotations

import numpy as np

from .plan import BlockPlan


def seam_splits(whole: np.ndarray, blocks: np.ndarray, plan: BlockPlan, min_part: float = 0.1) -> int:
    """How many objects of ``whole`` that cross a block seam are covered by two or more
    objects of ``blocks``, each holding at least ``min_part`` of it: objects a seam split."""
    whole = np.asarray(whole).astype(np.int64)
    blocks = np.asarray(blocks).astype(np.int64)
    crossing = set()
    for s in plan.seams(width=[1] * len(plan.shape)):
        a = [slice(c0, c1) for c0, c1 in s.zone]
        a[s.axis] = slice(s.at - 1, s.at)
        b = list(a)
        b[s.axis] = slice(s.at, s.at + 1)
        lo, hi = whole[tuple(a)], whole[tuple(b)]
        crossing |= set(np.unique(lo[(lo > 0) & (lo == hi)]).tolist())
    if not crossing:
        return 0
    ids = np.array(sorted(crossing))
    mask = np.isin(whole, ids) & (blocks > 0)
    nb = int(blocks.max()) + 1
    pairs, counts = np.unique(whole[mask] * nb + blocks[mask], return_counts=True)
    area = np.bincount(whole.ravel())
    obj = pairs // nb
    big = counts >= min_part * area[obj]
    per_obj = np.bincount(obj[big], minlength=area.size)
    return int(np.count_nonzero(per_obj >= 2))
