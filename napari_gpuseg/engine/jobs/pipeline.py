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

The stage threads are in :mod:`.stages`. GUI-free and print-free; progress goes to the
``progress`` callback.
"""
from __future__ import annotations

import os
import queue
import time
from pathlib import Path
from typing import Callable, Sequence

from ...io import DEFAULT_PATTERN, label_files
from ..runtime.cancel import Cancelled, CancelToken
from .method_registry import DEFAULT_FOLDER_METHOD, Segmenter, method_factory
from .outputs import list_inputs, no_input_note, output_paths, read_earlier, rel_name  # noqa: F401 - output_paths re-exported
from .report import ImageStatus, Progress, RunReport, report_names, safe_row, safe_text, write_report  # noqa: F401 - re-exported
from .rows import RowCounter, close_report
from .sharding import resolve_shard, shard_files  # noqa: F401 - re-exported
from .file_step import Item
from .stages import POLL_S, FolderRun
from .folder_plan import PipelineError, parse_devices, plan_items  # noqa: F401 - PipelineError re-exported


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
    method: str | Segmenter | Callable[[], Segmenter] = DEFAULT_FOLDER_METHOD,
    pattern: str = DEFAULT_PATTERN,
    recursive: bool = False,
    shard: str | tuple[int, int] | None = None,
    devices: str | Sequence[str] | None = None,
    io_workers: int | None = None,
    image_batch: int | None = None,
    overwrite: bool = False,
    progress: Callable[[Progress], None] | None = None,
    cancel: CancelToken | None = None,
    method_options: dict | None = None,
    precision: str = "auto",
    max_image_bytes: int | None = None,
    files: Sequence[str | os.PathLike] | None = None,
    env: dict | None = None,
    cluster=None,
    on_dashboard: Callable[[str], None] | None = None,
    notify: Callable[[str], None] | None = None,
) -> RunReport:
    """Segment every image of ``in_dir`` matching ``pattern`` into ``out_dir``: here (reader,
    device and writer threads) or, with ``cluster``, one task per file on a Dask cluster.

    ``cluster``: None (this process), ``"local"`` (a LocalCluster on 127.0.0.1, closed after
    the run), ``"slurm"``, a scheduler address ``"tcp://HOST:PORT"``, a
    :class:`~napari_gpuseg.engine.jobs.clusters.ClusterSpec` or a ``distributed.Client``.
    Every file goes through the same step either way (:mod:`.file_step`), so the labels and
    report rows are the same. On a cluster ``devices`` may name one device (every worker's),
    and ``io_workers`` / ``image_batch`` are refused (:func:`.dask_runner.cluster_options`);
    ``on_dashboard(link)`` gets its dashboard, ``notify(text)`` news of its start-up.

    ``method``: a registered name (``method_options`` go to its factory: ``model``,
    ``batch_size``, ...), a :class:`Segmenter` (single device) or a zero-argument factory.
    ``shard``: ``"I/N"`` or ``(I, N)``; None reads ``SLURM_ARRAY_TASK_ID`` /
    ``SLURM_ARRAY_TASK_COUNT`` from ``env`` (default ``os.environ``) when set.
    ``devices``: e.g. ``"cuda:0,cuda:1"``: one worker per device (None = the best one).
    ``files``: an explicit file list instead of scanning (paths under ``in_dir``).
    ``max_image_bytes``: images needing more memory get an error row (default: half the
    RAM available at the start).
    """
    if cluster is not None:
        from .dask_runner import run_folder_on_cluster

        return run_folder_on_cluster(
            cluster, in_dir, out_dir, method, devices=devices, io_workers=io_workers, image_batch=image_batch,
            cancel=cancel, on_dashboard=on_dashboard, notify=notify, method_options=method_options,
            pattern=pattern, recursive=recursive, shard=shard, overwrite=overwrite, progress=progress,
            precision=precision, max_image_bytes=max_image_bytes, files=files, env=env)
    io_workers = 2 if io_workers is None else io_workers
    image_batch = 4 if image_batch is None else image_batch
    t_start = time.perf_counter()
    in_dir, out_dir = Path(in_dir), Path(out_dir)
    factory, method_name, prep = _make_method(method, method_options)
    run_info = {"method": method_name, "model": str(prep.model or "")}
    dev_names = parse_devices(devices)
    if isinstance(method, Segmenter) and len(dev_names) > 1:
        raise ValueError("one Segmenter instance cannot serve several devices; pass a name or factory")
    if max_image_bytes is not None and max_image_bytes <= 0:
        raise ValueError(f"the memory limit per image must be positive, got {max_image_bytes} bytes")
    policies = _policies(dev_names, precision)
    found, shard_t = _inputs(in_dir, out_dir, pattern, recursive, files, shard, env)
    try:  # before any work: results that cannot be written must not be computed
        label_files.check_writable_dir(out_dir)
    except OSError as exc:
        raise PipelineError(exc.strerror or str(exc)) from exc
    if max_image_bytes is None:  # refuse what cannot fit instead of swapping or dying
        import psutil

        max_image_bytes = psutil.virtual_memory().available // 2

    report = RunReport(str(in_dir), str(out_dir), method_name, len(found), model=run_info["model"],
                       shard=f"{shard_t[0]}/{shard_t[1]}" if shard_t else "")
    if files is None and not found and shard_t is None:
        report.warnings.append(no_input_note(in_dir, out_dir, pattern, recursive))
    header, earlier = read_earlier(out_dir, shard_t)
    items = plan_items(found, in_dir, out_dir, report, earlier)
    this_run = {safe_text(rel_name(x, in_dir)) for x in found}
    report.kept = [r for f, r in sorted(earlier.items()) if f not in this_run]

    ours = [p for it in items for p in (it.labels_path, it.table_path)]
    ours += [out_dir / n for n in report_names(shard_t)]
    label_files.remove_temp_files(out_dir, targets=ours)  # left over from a killed run of these files
    run = FolderRun(items, factory, prep, policies, io_workers, image_batch, overwrite, max_image_bytes,
                    cancel or CancelToken(), run_info, (header, earlier))
    try:
        aborted = _collect_rows(run, report, progress, t_start)
    finally:
        label_files.remove_temp_files(out_dir, targets=ours)
        report.seconds = time.perf_counter() - t_start
    if run.fatal is not None:
        raise PipelineError(f"method {method_name!r} could not start: "
                            f"{type(run.fatal).__name__}: {run.fatal}") from run.fatal
    _complete_report(report, run, items, method_name, run_info["model"])
    try:
        write_report(report, out_dir, shard_t)
    except OSError as exc:  # e.g. the disk filled up: the outputs written stay; say why
        report.report_error = f"report not written to {out_dir}: {exc.strerror or exc}"
    if aborted:
        raise KeyboardInterrupt
    return report


def _make_method(method, method_options) -> tuple[Callable[[], Segmenter], str, Segmenter]:
    """The method's factory, its name and one unloaded instance (its ``prepare()`` and
    ``finish()`` run in the I/O threads); creating it checks the options before any work."""
    factory, method_name = _make_factory(method, method_options)
    try:
        return factory, method_name, factory()
    except Exception as exc:  # noqa: BLE001 - e.g. an option the method does not take
        raise PipelineError(f"method {method_name!r} could not be created: "
                            f"{type(exc).__name__}: {exc}") from exc


def _inputs(in_dir: Path, out_dir: Path, pattern, recursive, files, shard, env) -> tuple[list[Path], tuple | None]:
    """The input files (listed, or given) and this shard's part of them."""
    found = [Path(f) for f in files] if files is not None else list_inputs(in_dir, out_dir, pattern, recursive)
    shard_t = resolve_shard(shard, os.environ if env is None else env)
    if shard_t is not None:
        found = shard_files(found, *shard_t, root=in_dir)
    return found, shard_t


def _policies(dev_names: list[str], precision: str | None) -> list:
    """One device policy per worker: the session's policy (``set_policy``) when nothing is
    named, else one per named device at ``precision``."""
    from ..runtime.device import get_policy, make_policy

    if dev_names == ["auto"] and precision in (None, "auto"):
        return [get_policy()]
    if dev_names == ["auto"]:
        return [make_policy(str(get_policy().device), precision)]
    return [make_policy(d, precision) for d in dev_names]


def _collect_rows(run: FolderRun, report: RunReport, progress, t_start: float) -> bool:
    """Run the stages and gather one row per file into ``report`` until every file has one,
    the run is cancelled or fails; stop every stage thread before returning. True when
    Ctrl-C came again while stopping (the caller re-raises it after writing the report)."""
    counter = RowCounter(report, progress, t_start)
    aborted = False
    run.start()
    try:
        counter.emit(None)
        while len(report.rows) < report.total:
            if run.cancel.cancelled:
                report.cancelled = True
                break
            if run.fatal is not None or run.disk_error is not None:
                break
            try:
                row = safe_row(run.rows.get(timeout=POLL_S))
            except queue.Empty:
                if not run.alive() and run.rows.empty():
                    break
                continue
            counter.add(row)
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
        for row in map(safe_row, run.drain()):  # rows of files finished while stopping: every output has one
            counter.add(row, emit=False)
    return aborted


def _complete_report(report: RunReport, run: FolderRun, items: list[Item], method_name: str, model: str) -> None:
    """The disk error, a row for every file not processed (unless cancelled), warnings about
    outputs another method wrote, rows sorted by file."""
    if run.disk_error is not None:
        err = run.disk_error
        report.disk_error = f"writing the outputs failed: {err.strerror or err}"
    why = (f"not processed: the run stopped ({report.disk_error})" if report.disk_error
           else "not processed (internal error)")
    report.rows = [safe_row(r) for r in report.rows]
    close_report(report, [it.rel for it in items], why, run.other_method, method_name, model)  # sorts the rows
