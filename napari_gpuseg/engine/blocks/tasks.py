"""The two tasks of a block run, as plain functions of picklable arguments so that dask
workers run them as they are (:mod:`.run` sends them there or runs them in-process).

``segment_block``: the method on the block's extended region; the core goes to the work
array (local ids), the seam zones and the per-object partial table to a record file
written last (its presence means the block is done: resume). ``write_block``: local ids
-> image ids into the labels image, then a marker. GUI-free.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...io import label_files, tables
from ...io.zarr_labels import LabelsTarget
from .plan import Block, Seam
from .stitch import zone_of


@dataclass(frozen=True)
class BlockTask:
    """What every block task of one run needs (picklable)."""

    source: object  # .read(region) -> ndarray: a ZarrImage, or an in-memory ArraySource
    work: str  # work folder of the run
    target: LabelsTarget
    method: str
    options_json: str
    precision: str
    device: str | None
    stats: tuple  # sorted (key, value) pairs of the global intensity scale

    @property
    def local_path(self) -> str:
        return str(Path(self.work) / "local.zarr")

    def record(self, k: int) -> Path:
        return Path(self.work) / f"block{k:06d}.npz"

    def marker(self, k: int) -> Path:
        return Path(self.work) / "written" / f"{k:06d}"


class ArraySource:
    """An in-memory or dask array as a block source (in-process runs)."""

    def __init__(self, array):
        self.array = array
        self.shape = tuple(int(s) for s in array.shape)
        self.dtype = str(np.dtype(array.dtype))

    def read(self, region):
        return np.asarray(self.array[tuple(region)])

    def identity(self) -> dict:
        """The array's dask token (a numpy array's hashes its pixels)."""
        from dask.base import tokenize

        return {"array": tokenize(self.array), "dtype": self.dtype}


def _method(task: BlockTask, methods: dict | None):
    from ..jobs.worker_cache import cached_method, worker_device
    from ..runtime.device import make_policy
    from .block_method import BlockMethod

    def make():
        m = BlockMethod(task.method, json.loads(task.options_json))
        m.load(make_policy(worker_device(task.device), task.precision))
        return m

    key = ("blocks", task.method, task.options_json, task.device, task.precision)
    if methods is not None:
        if key not in methods:
            methods[key] = make()
        return methods[key]
    return cached_method(key, make)


def read_record(path: Path, prefix: str = "") -> dict | None:
    """The arrays of a block record whose name starts with ``prefix`` (None: no record)."""
    try:
        with np.load(path) as z:
            return {k: z[k] for k in z.files if k.startswith(prefix) or k == "n"}
    except (OSError, ValueError, KeyError, EOFError):
        return None


def _partial_table(core: np.ndarray, scores, start) -> dict:
    t = tables.object_table(core, scores)
    nd = core.ndim
    axes = [k[len("centroid_"):] for k in t if k.startswith("centroid_")]
    area = t["area"].astype(np.float64)
    out = {"ids": t["label"].astype(np.int64), "area": t["area"].astype(np.int64),
           "lo": np.stack([t[f"bbox_{a}0"] + start[i] for i, a in enumerate(axes)], 1).reshape(-1, nd),
           "hi": np.stack([t[f"bbox_{a}1"] + start[i] for i, a in enumerate(axes)], 1).reshape(-1, nd),
           "csum": np.stack([(t[f"centroid_{a}"] + start[i]) * area for i, a in enumerate(axes)], 1).reshape(-1, nd)}
    out["ssum"] = (np.nan_to_num(t["score"]) * area) if "score" in t else np.zeros(len(area))
    out["sarea"] = np.where(np.isfinite(t["score"]), area, 0) if "score" in t else np.zeros(len(area))
    return out


def segment_block(task: BlockTask, block: Block, seams: list[tuple[int, Seam]],
                  methods: dict | None = None) -> int:
    """Segment one block (skipped when its record exists); returns its largest local id."""
    import zarr

    rec_path = task.record(block.index)
    done = read_record(rec_path, "n")
    if done is not None:
        return int(done["n"])
    method = _method(task, methods)
    from .block_method import clean

    stats = dict(task.stats)
    x = clean(task.source.read(block.ext_slices()), stats)  # NaN/inf: the image minimum
    res = method.labels(x, stats, z0=block.ext[0][0] if x.ndim == 3 else 0)
    labels = np.asarray(res.labels)
    if labels.shape != x.shape:
        raise RuntimeError(f"method returned labels of shape {labels.shape} for a block of shape {x.shape}")
    labels = labels.astype(np.uint32, copy=False)
    core = labels[block.core_in_ext()]
    zarr.open_array(task.local_path, mode="r+")[block.core_slices()] = core
    rec = {"n": np.int64(labels.max() if labels.size else 0)}
    for i, seam in seams:
        rec[f"zone{i}"] = zone_of(labels, block, seam)
    for key, val in _partial_table(core, res.scores, [c0 for c0, _ in block.core]).items():
        rec[f"t_{key}"] = val
    import io as _io

    buf = _io.BytesIO()
    np.savez_compressed(buf, **rec)
    label_files.atomic_write_bytes(rec_path, buf.getvalue())  # last: the block is done
    return int(rec["n"])


def write_block(task: BlockTask, block: Block, lut: np.ndarray) -> int:
    """Local ids -> image ids of one block into the labels image (skipped when done)."""
    import zarr

    marker = task.marker(block.index)
    if marker.exists():
        return block.index
    local = zarr.open_array(task.local_path, mode="r")[block.core_slices()]
    task.target.open("r+")[block.core_slices()] = lut[local]
    label_files.atomic_write_bytes(marker, b"")
    return block.index


def check_worker(task: BlockTask) -> str:
    """Run on each worker before any block: the work folder and the labels store must be
    writable there and the method must load. Returns "" or a one-line reason."""
    try:
        label_files.check_writable_dir(task.work)
        label_files.check_writable_dir(os.path.dirname(task.target.store) or ".")
    except OSError as exc:
        return str(exc.strerror or exc)
    try:
        _method(task, None)
    except Exception as exc:  # noqa: BLE001 - e.g. the model file is not on this worker
        return f"the {task.method} method cannot load: {type(exc).__name__}: {exc}"
    return ""
