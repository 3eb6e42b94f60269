"""Folder jobs on a Dask cluster: one task per file, the client keeps the report.

``run_folder_dask(client, in_dir, out_dir, "unet")`` does what
:func:`~napari_gpuseg.engine.jobs.pipeline.run_folder` does, with the files spread over
the cluster's workers (:mod:`.dask_tasks`): the same output names, atomic writes, skipped
complete outputs (resume), report rows, progress events and cancel. Each worker loads the
method once. A task whose worker dies is run again on another worker (dask reschedules
it); a file the lost worker had already written is not written again. Before any file,
every worker must see a writable output folder and load the method, else the run stops
with one line naming the worker. GUI-free and print-free.
"""
from __future__ import annotations

import json
import os
import secrets
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

from ...io import DEFAULT_PATTERN, label_files
from ..runtime.cancel import CancelToken
from .dask_tasks import FileJob, check_worker, process_file
from .outputs import foreign_output, list_inputs, no_input_note, output_paths, read_earlier, rel_name, skipped_row
from .pipeline import PipelineError
from .methods import method_factory
from .report import ImageStatus, Progress, RunReport, report_names, write_report
from .rows import RowCounter, close_report
from .sharding import resolve_shard, shard_files


def _cancel_watch(client, futures, cancel: CancelToken, finished: threading.Event) -> None:
    """Cancel the run's tasks as soon as ``cancel`` is set (the loop over finished tasks
    then ends), not only when the next file finishes."""
    while not finished.wait(0.1):
        if cancel.cancelled:
            client.cancel(futures)
            return


def run_folder_on_cluster(address: str | None, in_dir, out_dir, *, n_workers: int | None = None,
                          on_dashboard: Callable[[str], None] | None = None, **kwargs) -> RunReport:
    """:func:`run_folder_dask` on the scheduler at ``address`` (None or "": a LocalCluster
    started for this run and closed after it). ``on_dashboard(link)`` gets the cluster's
    dashboard address. Keywords of ``run_folder`` that do not apply (devices, I/O threads,
    images per call) are ignored."""
    from .clusters import connect

    for key in ("devices", "io_workers", "image_batch"):
        kwargs.pop(key, None)
    handle = connect(scheduler=address) if address else connect("local", n_workers=n_workers)
    with handle:
        if on_dashboard is not None:
            on_dashboard(handle.dashboard)
        return run_folder_dask(handle.client, in_dir, out_dir, **kwargs)


def _plan(in_dir: Path, out_dir: Path, found, report: RunReport, overwrite, header, earlier, current):
    """(tasks to submit, other-method counts): skipped and refused files get their row here."""
    todo, seen, other_method = [], {}, {}
    listed = {r.labels for r in earlier.values() if r.labels}
    for f in found:
        rel = rel_name(f, in_dir)
        lp, tp = output_paths(in_dir, out_dir, f)
        labels_rel = lp.relative_to(out_dir).as_posix()
        if lp in seen:
            report.rows.append(ImageStatus(rel, status="error", error=f"output name {lp.name} already used by {seen[lp]}"))
            continue
        seen[lp] = rel
        other = foreign_output(lp, tp, labels_rel, listed)
        if other is not None:
            report.rows.append(ImageStatus(rel, status="error", error=(
                f"not overwritten: {other.name} exists and was not written by napari-gpuseg "
                "(move it away or choose another output folder)")))
            continue
        done = None if overwrite else label_files.read_output(lp)
        if done is not None:
            row, other_m = skipped_row(rel, labels_rel, *done, tp, earlier.get(rel), header, current)
            if other_m is not None:
                other_method[other_m] = other_method.get(other_m, 0) + 1
            report.rows.append(row)
            continue
        todo.append((str(f), rel, str(lp), str(tp), labels_rel))
    return todo, other_method


def _collect(client, futures: list, rel_of: dict, counter: RowCounter, cancel: CancelToken) -> None:
    """One row per finished task, in the order they finish (a task that failed on every
    retry is an error row); Cancel (or Ctrl-C) cancels the tasks not yet done."""
    from distributed import as_completed

    report = counter.report
    finished = threading.Event()
    watcher = threading.Thread(target=_cancel_watch, args=(client, futures, cancel, finished), daemon=True,
                               name="gpuseg-dask-cancel")
    watcher.start()
    try:
        for fut in as_completed(futures):
            if cancel.cancelled:
                report.cancelled = True
                break
            try:
                row = fut.result()
            except Exception as exc:  # noqa: BLE001 - e.g. the task failed on every retry
                if cancel.cancelled:
                    report.cancelled = True
                    break
                row = ImageStatus(rel_of[fut.key], status="error", error=f"{type(exc).__name__}: {exc}")
            counter.add(row)
    except KeyboardInterrupt:
        report.cancelled = True
    finally:
        finished.set()
        if report.cancelled:
            client.cancel(futures)


def run_folder_dask(
    client,
    in_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    method: str = "threshold",
    method_options: dict | None = None,
    pattern: str = DEFAULT_PATTERN,
    recursive: bool = False,
    shard: str | tuple[int, int] | None = None,
    overwrite: bool = False,
    progress: Callable[[Progress], None] | None = None,
    cancel: CancelToken | None = None,
    precision: str = "auto",
    device: str | None = None,
    max_image_bytes: int | None = None,
    files: Sequence[str | os.PathLike] | None = None,
    retries: int = 2,
) -> RunReport:
    """Segment every image of ``in_dir`` on the cluster of ``client`` (a
    ``distributed.Client``); see the module docstring. ``retries``: how often a task that
    raised is tried again (a worker lost mid-task is handled by dask itself)."""
    t_start = time.perf_counter()
    in_dir, out_dir = Path(in_dir), Path(out_dir)
    options = {k: v for k, v in (method_options or {}).items() if v is not None}
    try:
        prep = method_factory(method, **options)()
    except Exception as exc:  # noqa: BLE001
        raise PipelineError(f"method {method!r} could not be created: {type(exc).__name__}: {exc}") from exc
    model = str(prep.model or "")
    try:
        label_files.check_writable_dir(out_dir)
    except OSError as exc:
        raise PipelineError(exc.strerror or str(exc)) from exc
    found = [Path(f) for f in files] if files is not None else list_inputs(in_dir, out_dir, pattern, recursive)
    shard_t = resolve_shard(shard, os.environ)
    if shard_t is not None:
        found = shard_files(found, *shard_t, root=in_dir)
    report = RunReport(str(in_dir), str(out_dir), method, len(found), model=model,
                       shard=f"{shard_t[0]}/{shard_t[1]}" if shard_t else "")
    if files is None and not found and shard_t is None:
        report.warnings.append(no_input_note(in_dir, out_dir, pattern, recursive))
    header, earlier = read_earlier(out_dir, shard_t)
    this_run = {rel_name(x, in_dir) for x in found}
    report.kept = [r for f, r in sorted(earlier.items()) if f not in this_run]
    todo, other_method = _plan(in_dir, out_dir, found, report, overwrite, header, earlier, (method, model))
    job = FileJob(method, json.dumps(options, sort_keys=True), precision, device,
                  (("method", method), ("model", model), ("run", secrets.token_hex(8))), max_image_bytes)
    ours = [Path(t[3]) for t in todo] + [Path(t[2]) for t in todo] + [out_dir / n for n in report_names(shard_t)]
    label_files.remove_temp_files(out_dir, targets=ours)
    if todo:
        for worker, why in sorted(client.run(check_worker, job, str(out_dir)).items()):
            if why:
                raise PipelineError(f"worker {worker}: {why}")
    cancel = cancel or CancelToken()
    counter = RowCounter(report, progress, t_start)
    counter.emit(None)
    futures = [client.submit(process_file, job, *t, key=f"gpuseg-file-{job.run_id}-{i}", retries=retries,
                             pure=False) for i, t in enumerate(todo)]
    try:
        _collect(client, futures, {f.key: t[1] for f, t in zip(futures, todo)}, counter, cancel)
    finally:  # a worker killed mid-write leaves its temp file; its task ran again elsewhere
        label_files.remove_temp_files(out_dir, targets=ours)
    close_report(report, [t[1] for t in todo], "not processed (internal error)", other_method, method, model)
    report.seconds = time.perf_counter() - t_start
    try:
        write_report(report, out_dir, shard_t)
    except OSError as exc:
        report.report_error = f"report not written to {out_dir}: {exc.strerror or exc}"
    return report
