"""The per-object table of a block run: the partial tables of the blocks (in their
records) joined under the image ids, with the same columns as a folder job's table
(:func:`napari_gpuseg.io.tables.object_table`). GUI-free."""
from __future__ import annotations

from typing import Sequence

import numpy as np

_AXES = {2: ("y", "x"), 3: ("z", "y", "x")}


def joined_table(parts: Sequence[dict], luts: Sequence[np.ndarray], n_objects: int, ndim: int) -> dict:
    """``parts[k]``: the ``t_*`` arrays of block k's record; ``luts[k]``: its local -> image
    ids. Area and centroid sum over the pieces, the box spans them, the score is the
    area-weighted mean of the pieces' scores."""
    area = np.zeros(n_objects + 1, np.int64)
    lo = np.full((n_objects + 1, ndim), np.iinfo(np.int64).max, np.int64)
    hi = np.zeros((n_objects + 1, ndim), np.int64)
    csum = np.zeros((n_objects + 1, ndim))
    ssum = np.zeros(n_objects + 1)
    sarea = np.zeros(n_objects + 1)
    for part, lut in zip(parts, luts):
        ids = np.asarray(lut)[part["t_ids"]].astype(np.int64)
        np.add.at(area, ids, part["t_area"])
        np.minimum.at(lo, ids, part["t_lo"])
        np.maximum.at(hi, ids, part["t_hi"])
        np.add.at(csum, ids, part["t_csum"])
        np.add.at(ssum, ids, part["t_ssum"])
        np.add.at(sarea, ids, part["t_sarea"])
    keep = np.arange(1, n_objects + 1)
    keep = keep[area[keep] > 0]
    axes = _AXES.get(ndim, tuple(f"d{i}" for i in range(ndim)))
    table = {"label": keep, "area": area[keep]}
    for i, ax in enumerate(axes):
        table[f"bbox_{ax}0"] = lo[keep, i]
    for i, ax in enumerate(axes):
        table[f"bbox_{ax}1"] = hi[keep, i]
    for i, ax in enumerate(axes):
        table[f"centroid_{ax}"] = csum[keep, i] / area[keep]
    if sarea.any():
        table["score"] = np.where(sarea[keep] > 0, ssum[keep] / np.maximum(sarea[keep], 1), np.nan)
    return table
