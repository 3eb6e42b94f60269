"""Folder jobs: reader threads -> one worker per device -> writer threads.

``run_folder(in_dir, out_dir, "threshold")`` segments every matching image and writes,
for ``a/b.tif``, ``OUT/a/b_labels.tif`` (compressed TIFF) and ``OUT/a/b_objects.csv``,
plus ``OUT/report.csv`` and ``OUT/report.json`` (one row per file: file, shape, objects,
seconds, status ok|skipped|error, error).

- Bounded queues join the stages, so reading and writing overlap with device work and
  at most a few batches of images are in memory.
- Each device worker creates its own segmenter and loads it once, in its own thread;
  images of the same shape are segmented together (``image_batch`` per call).
- Resumable: an existing valid label file is skipped (``overwrite`` forces a rerun).
  Every file is written to a temp file and renamed, object table first and label image
  last, so a killed run never leaves a truncated file that looks finished.
- One bad file never stops the run: it gets an error row. A method that cannot load
  stops the run with :class:`PipelineError`.
- ``cancel.cancel()`` stops within about a second; temp files are removed.

GUI-free and print-free; progress goes to the ``progress`` callback.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ... import io as gio
from ..runtime.cancel import Cancelled, CancelToken
from .registry import SegResult, Segmenter, method_factory
from .outputs import DISK_ERRNOS, LABELS_SUFFIX, TABLE_SUFFIX, describe_method, foreign_output, list_inputs, output_paths, read_earlier, rel_name, same_folder, skipped_row
from .report import ImageStatus, Progress, RunReport, report_names, write_report  # noqa: F401 - re-exported
from .sharding import resolve_shard, shard_files  # noqa: F401 - re-exported

logger = logging.getLogger(__name__)

_POLL = 0.05
_STOP = object()


class PipelineError(RuntimeError):
    """The run as a whole failed (for example the model could not be loaded)."""


@dataclass
class _Item:
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


def _parse_devices(devices) -> list[str]:
    """``None`` -> ``["auto"]``; ``"cuda:0,cuda:1"`` -> a list. A list that names no
    device (``","``, ``" "``, ``[]``) is a ValueError: it would start no worker."""
    if devices is None:
        return ["auto"]
    parts = devices.split(",") if isinstance(devices, str) else list(devices)
    names = [str(d).strip() for d in parts if str(d).strip()]
    if not names:
        raise ValueError(f"the device list {devices!r} names no device "
                         "(give e.g. cpu, cuda:0 or cuda:0,cuda:1, or leave it out for the best one)")
    return names


def _shape_str(a: np.ndarray) -> str:
    return "x".join(str(s) for s in a.shape) + f" {a.dtype}"


class _Run:
    """The threads and queues of one :func:`run_folder` call."""

    def __init__(self, items, factory, prep, policies, io_workers, image_batch, overwrite,
                 max_image_bytes, cancel, run_info, earlier=({}, {})):
        self.items = items
        self.run_info = run_info  # {"method", "model"}: stored in every label file
        self.header, self.earlier = earlier  # the report an earlier run left in OUT
        self.other_method: dict[tuple[str, str], int] = {}  # skipped outputs of another method
        self.disk_error: OSError | None = None
        self.factory = factory
        self.policies = policies
        self.image_batch = max(1, int(image_batch))
        self.overwrite = overwrite
        self.max_image_bytes = max_image_bytes
        self.cancel = cancel
        self.stop = threading.Event()
        self.fatal: BaseException | None = None
        n_dev = len(policies)
        depth = max(2, 2 * self.image_batch * n_dev)
        self.tasks: queue.Queue = queue.Queue()
        for it in items:
            self.tasks.put(it)
        self.in_q: queue.Queue = queue.Queue(maxsize=depth)
        self.out_q: queue.Queue = queue.Queue(maxsize=depth)
        self.rows: queue.Queue = queue.Queue()
        self.n_readers = max(1, int(io_workers))
        self.n_writers = max(1, int(io_workers))
        self._alive = {"readers": self.n_readers, "workers": n_dev}
        self._alive_lock = threading.Lock()
        self.prep = prep  # unloaded instance: prepare() runs in the reader threads
        self.threads: list[threading.Thread] = []

    # -- plumbing ---------------------------------------------------------------------
    def _put(self, q: queue.Queue, obj) -> bool:
        while not self.stop.is_set():
            try:
                q.put(obj, timeout=_POLL)
                return True
            except queue.Full:
                continue
        return False

    def _get(self, q: queue.Queue):
        while not self.stop.is_set():
            try:
                return q.get(timeout=_POLL)
            except queue.Empty:
                continue
        return _STOP

    def _last_out(self, stage: str, q: queue.Queue, n_next: int) -> None:
        with self._alive_lock:
            self._alive[stage] -= 1
            last = self._alive[stage] == 0
        if last:
            for _ in range(n_next):
                self._put(q, _STOP)

    def _error(self, item: _Item, exc: BaseException, shape: str = "") -> None:
        msg = exc.message if isinstance(exc, gio.ImageReadError) else f"{type(exc).__name__}: {exc}"
        self.rows.put(ImageStatus(item.rel, shape, None, round(item.seconds, 4), "error", msg,
                                  notes=item.notes, device=item.device))

    # -- stages -----------------------------------------------------------------------
    def reader(self) -> None:
        try:
            while not self.stop.is_set():
                try:
                    item: _Item = self.tasks.get_nowait()
                except queue.Empty:
                    break
                t0 = time.perf_counter()
                done = None if self.overwrite else gio.read_output(item.labels_path)
                if done is not None:
                    self._skip(item, *done)
                    continue
                try:
                    loaded = gio.load_image(item.path, max_bytes=self.max_image_bytes,
                                            bytes_per_value=self.prep.bytes_per_value)
                    item.notes = "; ".join(loaded.notes)
                    item.data = self.prep.prepare(loaded.data, loaded.rgb)
                    file_inputs = getattr(self.prep, "file_inputs", None)  # e.g. sam-boxes boxes=DIR
                    if file_inputs is not None:
                        item.inputs = file_inputs(item.path, item.rel, item.data)
                except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
                    item.seconds = time.perf_counter() - t0
                    if isinstance(exc, gio.ImageReadError) and exc.path == "image":
                        exc = type(exc)(item.path, exc.message)
                    self._error(item, exc)
                    continue
                item.seconds = time.perf_counter() - t0
                if not self._put(self.in_q, item):
                    return
        finally:
            self._last_out("readers", self.in_q, len(self.policies))

    def _skip(self, item: _Item, labels, info) -> None:
        current = (self.run_info["method"], self.run_info["model"])
        row, other = skipped_row(item.rel, item.labels_rel, labels, info, item.table_path,
                                 self.earlier.get(item.rel), self.header, current)
        if other is not None:
            with self._alive_lock:
                self.other_method[other] = self.other_method.get(other, 0) + 1
        self.rows.put(row)

    def worker(self, policy) -> None:
        seg: Segmenter | None = None
        try:
            seg = self.factory()
            seg.cancel = self.cancel
            seg.load(policy)
        except BaseException as exc:  # noqa: BLE001 - the whole run fails
            self.fatal = exc
            self.stop.set()
            self._last_out("workers", self.out_q, self.n_writers)
            return
        device = str(getattr(policy, "device", policy))
        try:
            finished = False
            while not finished and not self.stop.is_set():
                first = self._get(self.in_q)
                if first is _STOP:
                    break
                batch = [first]
                while len(batch) < self.image_batch:
                    try:
                        nxt = self.in_q.get_nowait()
                    except queue.Empty:
                        break
                    if nxt is _STOP:
                        finished = True
                        break
                    batch.append(nxt)
                groups: dict[tuple, list[_Item]] = {}
                for it in batch:
                    groups.setdefault((it.data.shape, it.data.dtype.str), []).append(it)
                for group in groups.values():
                    if self.stop.is_set():
                        return
                    self._segment(seg, group, device)
        except Cancelled:
            self.stop.set()
        finally:
            try:
                seg.unload()
            except Exception as exc:  # noqa: BLE001 - the results are written; only memory stays held
                logger.warning("unloading the %s method failed: %s: %s", seg.name, type(exc).__name__, exc)
            self._last_out("workers", self.out_q, self.n_writers)

    def _segment(self, seg: Segmenter, group: list[_Item], device: str) -> None:
        t0 = time.perf_counter()
        try:
            images = [it.data for it in group]
            inputs = [it.inputs for it in group]
            results = (seg.segment(images) if all(x is None for x in inputs)
                       else seg.segment(images, inputs=inputs))
            if len(results) != len(group):
                raise RuntimeError(f"method returned {len(results)} results for {len(group)} images")
        except Cancelled:
            raise
        except Exception as exc:  # noqa: BLE001
            if len(group) > 1:  # find the culprit: retry one by one
                for it in group:
                    self._segment(seg, [it], device)
                return
            group[0].device = device
            group[0].seconds += time.perf_counter() - t0
            self._error(group[0], exc, _shape_str(group[0].data))
            return
        share = (time.perf_counter() - t0) / len(group)
        for it, res in zip(group, results):
            it.result, it.device = res, device
            it.seconds += share
            if not self._put(self.out_q, it):
                return

    def writer(self) -> None:
        while True:
            item = self._get(self.out_q)
            if item is _STOP:
                return
            t0 = time.perf_counter()
            shape = _shape_str(item.data)
            try:
                res = item.result
                if not isinstance(res, SegResult):
                    res = self.prep.finish(res)  # CPU post-processing, off the device thread
                labels = np.asarray(res.labels)
                if labels.shape != item.data.shape[: labels.ndim] or labels.dtype.kind not in "uib":
                    raise RuntimeError(f"method returned labels of shape {labels.shape} "
                                       f"dtype {labels.dtype} for an image of shape {item.data.shape}")
                table = gio.object_table(labels, res.scores)
                n_obj = int(len(table["label"]))
                gio.atomic_write_text(item.table_path, gio.table_to_csv(table))
                gio.write_labels(item.labels_path, labels, self.run_info)  # last: means done
            except Exception as exc:  # noqa: BLE001
                item.seconds += time.perf_counter() - t0
                self._error(item, exc, shape)
                if isinstance(exc, OSError) and exc.errno in DISK_ERRNOS:
                    self.disk_error = exc  # every later write fails too: stop, keep what is done
                    self.stop.set()
                continue
            item.seconds += time.perf_counter() - t0
            notes = "; ".join(n for n in (item.notes, getattr(res, "notes", "")) if n)
            self.rows.put(ImageStatus(item.rel, shape, n_obj, round(item.seconds, 4), "ok",
                                      labels=item.labels_rel, notes=notes,
                                      device=item.device))
            item.data = item.result = None

    def start(self) -> None:
        specs = [(self.reader, ()) for _ in range(self.n_readers)]
        specs += [(self.worker, (p,)) for p in self.policies]
        specs += [(self.writer, ()) for _ in range(self.n_writers)]
        for i, (fn, args) in enumerate(specs):
            t = threading.Thread(target=fn, args=args, daemon=True,
                                 name=f"gpuseg-{fn.__name__}-{i}")
            t.start()
            self.threads.append(t)

    def alive(self) -> bool:
        return any(t.is_alive() for t in self.threads)

    def join(self, timeout: float | None = None) -> None:
        """Wait for every stage thread (``None``: until they end; each ends after its
        current step once ``stop`` is set). A thread left running inside torch or a C
        library when the interpreter exits aborts the process (SIGABRT), so the run
        never returns while one is alive, unless interrupted again."""
        end = None if timeout is None else time.monotonic() + timeout
        for t in self.threads:
            while t.is_alive():
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return
                t.join(_POLL if left is None else min(_POLL, left))  # signals stay responsive

    def drain(self) -> list[ImageStatus]:
        out = []
        while True:
            try:
                out.append(self.rows.get_nowait())
            except queue.Empty:
                return out


def _make_factory(method, method_options) -> tuple[Callable[[], Segmenter], str]:
    if isinstance(method, str):
        return method_factory(method, **(method_options or {})), method
    if isinstance(method, Segmenter):
        return (lambda: method), method.name
    if callable(method):
        return method, getattr(method, "__name__", "custom")
    raise TypeError(f"method must be a name, a Segmenter or a factory, not {type(method).__name__}")


def run_folder(
    in_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    method: str | Segmenter | Callable[[], Segmenter] = "threshold",
    pattern: str = "*.tif*",
    recursive: bool = False,
    shard: str | tuple[int, int] | None = None,
    devices: str | Sequence[str] | None = None,
    io_workers: int = 2,
    image_batch: int = 4,
    overwrite: bool = False,
    progress: Callable[[Progress], None] | None = None,
    cancel: CancelToken | None = None,
    method_options: dict | None = None,
    precision: str = "auto",
    max_image_bytes: int | None = None,
    files: Sequence[str | os.PathLike] | None = None,
    env: dict | None = None,
) -> RunReport:
    """Segment every image of ``in_dir`` matching ``pattern`` into ``out_dir``.

    ``method``: a registered name (``method_options`` go to its factory: ``model``,
    ``batch_size``, ...), a :class:`Segmenter` (single device) or a zero-argument factory.
    ``shard``: ``"I/N"`` or ``(I, N)``; None reads ``SLURM_ARRAY_TASK_ID`` /
    ``SLURM_ARRAY_TASK_COUNT`` from ``env`` (default ``os.environ``) when set.
    ``devices``: e.g. ``"cuda:0,cuda:1"``: one worker per device (None = the best one).
    ``files``: an explicit file list instead of scanning (paths under ``in_dir``).
    ``max_image_bytes``: images needing more memory get an error row (default: half the
    RAM available at the start).
    """
    from ..runtime.device import get_policy, make_policy

    t_start = time.perf_counter()
    in_dir, out_dir = Path(in_dir), Path(out_dir)
    factory, method_name = _make_factory(method, method_options)
    try:  # checks the method's options before any work
        prep = factory()  # unloaded instance: prepare() and finish() run in the I/O threads
    except Exception as exc:  # noqa: BLE001 - e.g. an option the method does not take
        raise PipelineError(f"method {method_name!r} could not be created: "
                            f"{type(exc).__name__}: {exc}") from exc
    run_info = {"method": method_name, "model": str(prep.model or "")}
    dev_names = _parse_devices(devices)
    if isinstance(method, Segmenter) and len(dev_names) > 1:
        raise ValueError("one Segmenter instance cannot serve several devices; pass a name or factory")
    if max_image_bytes is not None and max_image_bytes <= 0:
        raise ValueError(f"the memory limit per image must be positive, got {max_image_bytes} bytes")
    if dev_names == ["auto"] and precision in (None, "auto"):
        policies = [get_policy()]  # what the user chose for the session (set_policy)
    elif dev_names == ["auto"]:
        policies = [make_policy(str(get_policy().device), precision)]
    else:
        policies = [make_policy(d, precision) for d in dev_names]
    found = [Path(f) for f in files] if files is not None else list_inputs(in_dir, out_dir, pattern, recursive)
    shard_t = resolve_shard(shard, os.environ if env is None else env)
    if shard_t is not None:
        found = shard_files(found, *shard_t, root=in_dir)
    try:  # before any work: results that cannot be written must not be computed
        gio.check_writable_dir(out_dir)
    except OSError as exc:
        raise PipelineError(exc.strerror or str(exc)) from exc
    if max_image_bytes is None:  # refuse what cannot fit instead of swapping or dying
        import psutil

        max_image_bytes = psutil.virtual_memory().available // 2

    report = RunReport(str(in_dir), str(out_dir), method_name, len(found), model=run_info["model"],
                       shard=f"{shard_t[0]}/{shard_t[1]}" if shard_t else "")
    header, earlier = read_earlier(out_dir, shard_t)
    same_dir = same_folder(in_dir, out_dir)
    items, seen, foreign = [], {}, []
    listed = {r.labels for r in earlier.values() if r.labels}
    for i, f in enumerate(found):
        rel = rel_name(f, in_dir)
        lp, tp = output_paths(in_dir, out_dir, f)
        item = _Item(i, Path(f), rel, lp, tp, lp.relative_to(out_dir).as_posix())
        if lp in seen:
            report.rows.append(ImageStatus(rel, status="error",
                                           error=f"output name {lp.name} already used by {seen[lp]}"))
            continue
        seen[lp] = rel
        other = foreign_output(lp, tp, item.labels_rel, listed)
        if other is not None:  # never replace a file this program did not write
            foreign.append(other)
            report.rows.append(ImageStatus(rel, status="error", error=(
                f"not overwritten: {other.name} exists and was not written by napari-gpuseg "
                "(move it away or choose another output folder)")))
            continue
        items.append(item)
    if same_dir and foreign:
        raise PipelineError(
            f"the output folder is the input folder and {len(foreign)} output name(s) are taken by "
            f"files napari-gpuseg did not write (e.g. {foreign[0].name}); choose another output folder")
    this_run = {rel_name(x, in_dir) for x in found}
    report.kept = [r for f, r in sorted(earlier.items()) if f not in this_run]

    ours = [p for it in items for p in (it.labels_path, it.table_path)]
    ours += [out_dir / n for n in report_names(shard_t)]
    gio.remove_temp_files(out_dir, targets=ours)  # left over from a killed run of these files
    run = _Run(items, factory, prep, policies, io_workers, image_batch, overwrite, max_image_bytes,
               cancel or CancelToken(), run_info, (header, earlier))
    counts = {"ok": 0, "skipped": 0, "error": 0}
    for r in report.rows:
        counts[r.status] += 1

    def _emit(row: ImageStatus | None) -> None:
        now = time.perf_counter()
        processed = counts["ok"] + counts["error"]
        rate = processed / (now - t_start) if now > t_start else 0.0
        remaining = report.total - len(report.rows)
        eta = remaining / rate if rate > 0 else None
        if progress is not None:
            progress(Progress(len(report.rows), report.total, rate, eta, counts["ok"],
                              counts["skipped"], counts["error"], now - t_start, row))

    aborted = False
    run.start()
    try:
        _emit(None)
        while len(report.rows) < report.total:
            if run.cancel.cancelled:
                report.cancelled = True
                break
            if run.fatal is not None or run.disk_error is not None:
                break
            try:
                row = run.rows.get(timeout=_POLL)
            except queue.Empty:
                if not run.alive() and run.rows.empty():
                    break
                continue
            report.rows.append(row)
            counts[row.status] += 1
            _emit(row)
    except (Cancelled, KeyboardInterrupt):
        report.cancelled = True
    finally:
        report.cancelled = report.cancelled or (run.cancel.cancelled and run.fatal is None)
        run.stop.set()
        if report.cancelled:
            run.cancel.cancel()  # a method checking the token stops mid-batch
        try:
            run.join()  # every stage ends after its current step; no thread outlives the run
        except KeyboardInterrupt:  # interrupted again while waiting: report what is known
            report.cancelled = aborted = True
        for row in run.drain():  # rows of files finished while stopping: every output has one
            report.rows.append(row)
            counts[row.status] += 1
        gio.remove_temp_files(out_dir, targets=ours)
        report.seconds = time.perf_counter() - t_start
    if run.fatal is not None:
        raise PipelineError(f"method {method_name!r} could not start: "
                            f"{type(run.fatal).__name__}: {run.fatal}") from run.fatal
    if run.disk_error is not None:
        err = run.disk_error
        report.disk_error = f"writing the outputs failed: {err.strerror or err}"
    if not report.cancelled:  # every file gets a row, whatever happened
        done = {r.file for r in report.rows}
        why = (f"not processed: the run stopped ({report.disk_error})" if report.disk_error
               else "not processed (internal error)")
        report.rows += [ImageStatus(it.rel, status="error", error=why)
                        for it in items if it.rel not in done]
    for (m, model), n in sorted(run.other_method.items()):
        report.warnings.append(
            f"{n} existing output(s) were written by method {describe_method(m, model)}, not "
            f"{describe_method(method_name, run_info['model'])}; they were skipped as they are "
            "(use --overwrite to redo them)")
    report.rows.sort(key=lambda r: r.file)
    try:
        write_report(report, out_dir, shard_t)
    except OSError as exc:  # e.g. the disk filled up: the outputs written stay; say why
        report.report_error = f"report not written to {out_dir}: {exc.strerror or exc}"
    if aborted:
        raise KeyboardInterrupt
    return report
