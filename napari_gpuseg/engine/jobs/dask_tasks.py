"""What a dask worker does for a folder job: one file per task, read -> segment -> write
(object table first, label image last, both atomic), with the method loaded once per
worker (:mod:`.worker_cache`). Plain functions of picklable arguments. GUI-free.

A task that ran on a worker which died after writing is run again elsewhere; it finds
the label file this run wrote (the run id is in its metadata) and returns its row without
writing anything a second time.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from ...io import label_files
from .file_step import FileStep, Item, shape_str
from .report import ImageStatus
from .worker_cache import cached_method, shared_sam_engine, worker_device


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


def worker_method(job: FileJob):
    """The loaded method of this worker for ``job`` (created and loaded on first use)."""
    from ..runtime.device import make_policy
    from .method_registry import method_factory

    def make():
        try:
            seg = method_factory(job.method, **json.loads(job.options_json))()
            if hasattr(seg, "engine_source"):  # SAM methods: one engine per model in this worker
                seg.engine_source = shared_sam_engine
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


def process_file(job: FileJob, item: Item) -> ImageStatus:
    """Segment one file and write its outputs (:class:`.file_step.FileStep`, as in-process
    runs do); every file-level problem is an error row."""
    seg = worker_method(job)
    item.device = str(getattr(seg.policy, "device", "") or "")
    mine = label_files.output_info(item.labels_path)
    if mine is not None and mine.get("run") == job.run_id:  # written by this run before a retry
        done = label_files.read_output(item.labels_path)
        if done is not None:
            n_obj = int(np.count_nonzero(np.unique(done[0]) > 0))
            return ImageStatus(item.rel, shape_str(done[0]), n_obj, 0.0, "ok", labels=item.labels_rel,
                               notes="written before the worker was lost", device=item.device)
    limit = job.max_image_bytes
    if limit is None:  # as in-process: half the memory this worker has free
        import psutil

        limit = psutil.virtual_memory().available // 2
    return FileStep(seg, dict(job.run_info), limit).run(seg, item)
