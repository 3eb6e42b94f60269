"""Per-object tables (area, bounding box, centroid, score) and their CSV files."""
from __future__ import annotations

import csv
import io as _io
import os
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from .label_files import atomic_write_text

_AXES = {2: ("y", "x"), 3: ("z", "y", "x"), 4: ("t", "z", "y", "x")}


def object_table(
    labels: np.ndarray, scores: Mapping[int, float] | np.ndarray | None = None
) -> dict[str, np.ndarray]:
    """Per-object area, bounding box (end exclusive) and centroid, and the score when
    given, one row per label id present (the same numbers as skimage's
    ``regionprops_table``, computed in a few vectorised passes).

    ``scores`` maps label id -> score, or is an array with ``scores[id - 1]``.
    """
    from scipy import ndimage as ndi

    labels = np.asarray(labels)
    if labels.dtype.kind not in "ui":
        labels = labels.astype(np.int64)
    nd = labels.ndim
    axes = _AXES.get(nd, tuple(f"d{i}" for i in range(nd)))
    flat = labels.ravel()
    counts = np.bincount(flat) if flat.size else np.zeros(1, np.int64)
    ids = np.nonzero(counts)[0]
    ids = ids[ids > 0]
    area = counts[ids]
    slices = ndi.find_objects(labels) if ids.size else []
    table: dict[str, np.ndarray] = {"label": ids, "area": area}
    for i, ax in enumerate(axes):
        table[f"bbox_{ax}0"] = np.array([slices[k - 1][i].start for k in ids], dtype=np.int64)
    for i, ax in enumerate(axes):
        table[f"bbox_{ax}1"] = np.array([slices[k - 1][i].stop for k in ids], dtype=np.int64)
    for i, ax in enumerate(axes):
        shape = [1] * nd
        shape[i] = labels.shape[i]
        coord = np.broadcast_to(np.arange(labels.shape[i], dtype=np.float64).reshape(shape), labels.shape)
        sums = np.bincount(flat, weights=coord.ravel(), minlength=counts.size)
        table[f"centroid_{ax}"] = sums[ids] / np.maximum(area, 1)
    if scores is not None:
        if isinstance(scores, Mapping):
            table["score"] = np.array([float(scores.get(int(i), np.nan)) for i in ids])
        else:
            arr = np.asarray(scores, dtype=float)
            table["score"] = np.array([arr[i - 1] if 0 < i <= arr.size else np.nan for i in ids])
    return table


def table_to_csv(table: Mapping[str, Sequence]) -> str:
    """CSV text of a column table (floats with 6 significant digits)."""
    buf = _io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    cols = list(table)
    writer.writerow(cols)
    columns = []
    for c in cols:
        values = table[c].tolist() if isinstance(table[c], np.ndarray) else list(table[c])
        columns.append([f"{v:.6g}" if isinstance(v, float) else v for v in values])
    writer.writerows(zip(*columns))
    return buf.getvalue()


def write_object_table(
    path: str | os.PathLike,
    labels: np.ndarray,
    scores: Mapping[int, float] | np.ndarray | None = None,
) -> Path:
    """Write :func:`object_table` as CSV, atomically."""
    return atomic_write_text(path, table_to_csv(object_table(labels, scores)))


def read_csv(path: str | os.PathLike) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))
