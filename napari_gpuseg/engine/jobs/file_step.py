"""One file of a folder job, the same wherever it runs: read -> image series and channel ->
the method's conversion -> the method -> outputs (object table first, label image last,
both atomic) -> the report row, with its notes and errors.

The in-process pipeline runs the three parts in its reader, device and writer threads
(:mod:`.stages`); a Dask task runs them one after the other (:mod:`.dask_tasks`). Either
way a file gives the same labels and the same row (timing aside). GUI-free and print-free.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ... import io as gio
from ...io import label_files, tables
from .method_registry import SegResult, Segmenter
from .report import ImageStatus


@dataclass
class Item:
    """One input file on its way through the step."""

    idx: int
    path: Path
    rel: str
    labels_path: Path
    table_path: Path
    labels_rel: str = ""  # labels path relative to out_dir, for the report
    data: np.ndarray | None = None
    notes: str = ""
    seconds: float = 0.0
    result: object = None
    device: str = ""
    inputs: object = None  # per-image inputs the method reads beside the image (box files)
    src_rel: str = ""  # ``rel`` as the file system spells it (``rel`` is the report's text)


def shape_str(a: np.ndarray) -> str:
    return "x".join(str(s) for s in a.shape) + f" {a.dtype}"


def _join(*notes: str) -> str:
    return "; ".join(n for n in notes if n)


class FileStep:
    """The per-file work of one run. ``prep``: an instance of the run's method (its
    ``prepare``/``finish``/``file_inputs`` do not need the weights); ``run_info``: what every
    label file stores (method, model, ...)."""

    def __init__(self, prep: Segmenter, run_info: dict, max_image_bytes: int | None):
        self.prep = prep
        self.run_info = dict(run_info)
        self.max_image_bytes = max_image_bytes

    def read(self, item: Item) -> None:
        """Read the file, take its channel, convert it for the method and read the inputs the
        method takes beside it (box files); raises on a file-level problem."""
        t0 = time.perf_counter()
        try:
            loaded = gio.load_image(item.path, max_bytes=self.max_image_bytes,
                                    bytes_per_value=self.prep.bytes_per_value)
            loaded = gio.select_channel(loaded, getattr(self.prep, "channel", None))
            item.notes = "; ".join(loaded.notes)
            item.data = self.prep.prepare(loaded.data, loaded.rgb)
            file_inputs = getattr(self.prep, "file_inputs", None)  # e.g. sam-boxes boxes=DIR
            if file_inputs is not None:
                item.inputs = file_inputs(item.path, item.src_rel or item.rel, item.data)
                item.notes = _join(item.notes, getattr(item.inputs, "notes", ""))  # e.g. duplicates dropped
        except gio.ImageReadError as exc:
            if exc.path == "image":  # raised by prepare(): name the file
                raise type(exc)(item.path, exc.message) from exc
            raise
        finally:
            item.seconds += time.perf_counter() - t0

    @staticmethod
    def segment(seg: Segmenter, items: list[Item]) -> list:
        """The method on same-shape images (one call); one raw result per item."""
        images = [it.data for it in items]
        inputs = [it.inputs for it in items]
        results = (seg.segment(images) if all(x is None for x in inputs)
                   else seg.segment(images, inputs=inputs))
        if len(results) != len(items):
            raise RuntimeError(f"method returned {len(results)} results for {len(items)} images")
        return results

    def write(self, item: Item) -> ImageStatus:
        """Finish the method's result, write the object table and then the label image
        (last: it means done); the file's ok row."""
        t0 = time.perf_counter()
        try:
            res = item.result
            if not isinstance(res, SegResult):
                res = self.prep.finish(res)  # CPU post-processing, off the device thread
            labels = np.asarray(res.labels)
            if labels.shape != item.data.shape[: labels.ndim] or labels.dtype.kind not in "uib":
                raise RuntimeError(f"method returned labels of shape {labels.shape} "
                                   f"dtype {labels.dtype} for an image of shape {item.data.shape}")
            table = tables.object_table(labels, res.scores)
            label_files.atomic_write_text(item.table_path, tables.table_to_csv(table))
            label_files.write_labels(item.labels_path, labels, self.run_info)  # last: means done
        finally:
            item.seconds += time.perf_counter() - t0
        return ImageStatus(item.rel, shape_str(item.data), int(len(table["label"])), round(item.seconds, 4),
                           "ok", labels=item.labels_rel, notes=_join(item.notes, getattr(res, "notes", "")),
                           device=item.device)

    @staticmethod
    def error_row(item: Item, exc: BaseException) -> ImageStatus:
        msg = exc.message if isinstance(exc, gio.ImageReadError) else f"{type(exc).__name__}: {exc}"
        shape = shape_str(item.data) if item.data is not None else ""
        return ImageStatus(item.rel, shape, None, round(item.seconds, 4), "error", msg,
                           notes=item.notes, device=item.device)

    def run(self, seg: Segmenter, item: Item) -> ImageStatus:
        """All of it for one file (a Dask task): every file-level problem is an error row."""
        try:
            self.read(item)
            t0 = time.perf_counter()
            try:
                item.result = self.segment(seg, [item])[0]
            finally:
                item.seconds += time.perf_counter() - t0
            return self.write(item)
        except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
            return self.error_row(item, exc)
