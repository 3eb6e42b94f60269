"""What a dask worker does for a folder job: one file per task, read -> segment -> write
(object table first, label image last, both atomic), with the method loaded once per
worker (:mod:`.worker_cache`). Plain functions of picklable arguments. GUI-free.

A task that ran on a worker which died after writing is run again elsewhere; it finds
the label file this run wrote (the run id is in its metadata) and returns its row without
writing anything a second time.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ... import io as gio
from ...io import label_files, tables
from .methods import SegResult
from .report import ImageStatus
from .worker_cache import cached_method, worker_device


@dataclass(frozen=True)
class FileJob:
    """What every file task of one run needs (picklable)."""

    method: str
    options_json: str
    precision: str
    device: str | None
    run_info: tuple  # (key, value) pairs stored in every label file, with the run id
    max_image_bytes: int | None

    @property
    def run_id(self) -> str:
        return dict(self.run_info)["run"]


class MethodLoadError(RuntimeError):
    """The method could not be created or loaded on a worker."""


def _shape_str(a: np.ndarray) -> str:
    return "x".join(str(s) for s in a.shape) + f" {a.dtype}"


def worker_method(job: FileJob):
    """The loaded method of this worker for ``job`` (created and loaded on first use)."""
    from ..runtime.device import make_policy
    from .methods import method_factory

    def make():
        try:
            seg = method_factory(job.method, **json.loads(job.options_json))()
            seg.load(make_policy(worker_device(job.device), job.precision))
        except Exception as exc:  # noqa: BLE001 - e.g. the model file is not on this worker
            raise MethodLoadError(f"the {job.method} method cannot load: {type(exc).__name__}: {exc}") from exc
        return seg

    return cached_method(("files", job.method, job.options_json, job.device, job.precision), make)


def check_worker(job: FileJob, out_dir: str) -> str:
    """Before any file: the output folder must be writable from this worker and the method
    must load here. Returns "" or a one-line reason."""
    try:
        label_files.check_writable_dir(out_dir)
    except OSError as exc:
        return str(exc.strerror or exc)
    try:
        worker_method(job)
    except MethodLoadError as exc:
        return str(exc)
    return ""


def process_file(job: FileJob, path: str, rel: str, labels_path: str, table_path: str,
                 labels_rel: str) -> ImageStatus:
    """Segment one file and write its outputs; every file-level problem is an error row."""
    t0 = time.perf_counter()
    lp, tp = Path(labels_path), Path(table_path)
    seg = worker_method(job)
    device = str(getattr(seg.policy, "device", "") or "")
    mine = label_files.output_info(lp)
    if mine is not None and mine.get("run") == job.run_id:  # written by this run before a retry
        done = label_files.read_output(lp)
        if done is not None:
            n_obj = int(np.count_nonzero(np.unique(done[0]) > 0))
            return ImageStatus(rel, _shape_str(done[0]), n_obj, 0.0, "ok", labels=labels_rel,
                               notes="written before the worker was lost", device=device)
    shape = ""
    try:
        loaded = gio.load_image(path, max_bytes=job.max_image_bytes, bytes_per_value=seg.bytes_per_value)
        data = seg.prepare(loaded.data, loaded.rgb)
        shape = _shape_str(data)
        file_inputs = getattr(seg, "file_inputs", None)
        inputs = file_inputs(Path(path), rel, data) if file_inputs is not None else None
        raw = seg.segment([data]) if inputs is None else seg.segment([data], inputs=[inputs])
        res = raw[0] if isinstance(raw[0], SegResult) else seg.finish(raw[0])
        labels = np.asarray(res.labels)
        if labels.shape != data.shape[: labels.ndim] or labels.dtype.kind not in "uib":
            raise RuntimeError(f"method returned labels of shape {labels.shape} dtype {labels.dtype} "
                               f"for an image of shape {data.shape}")
        table = tables.object_table(labels, res.scores)
        label_files.atomic_write_text(tp, tables.table_to_csv(table))
        label_files.write_labels(lp, labels, dict(job.run_info))  # last: means done
    except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
        msg = exc.message if isinstance(exc, gio.ImageReadError) else f"{type(exc).__name__}: {exc}"
        return ImageStatus(rel, shape, None, round(time.perf_counter() - t0, 4), "error", msg, device=device)
    notes = "; ".join(n for n in ("; ".join(loaded.notes), res.notes) if n)
    return ImageStatus(rel, shape, int(len(table["label"])), round(time.perf_counter() - t0, 4), "ok",
                       labels=labels_rel, notes=notes, device=device)
