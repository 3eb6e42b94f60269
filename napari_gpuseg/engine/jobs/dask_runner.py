"""Folder jobs on a Dask cluster: one task per file, the client keeps the report.

``run_folder(in_dir, out_dir, cluster=...)`` comes here (:func:`run_folder_on_cluster`);
``run_folder_dask(client, in_dir, out_dir, "unet")`` does what the in-process run does, with
the files spread over the cluster's workers (:mod:`.dask_tasks`), each through the same
per-file step (:mod:`.file_step`): the same output names, atomic writes, skipped
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
from .outputs import list_inputs, no_input_note, read_earlier, rel_name, skipped_row
from .folder_plan import PipelineError, parse_devices, plan_items
from .method_registry import DEFAULT_FOLDER_METHOD, method_factory
from .report import ImageStatus, Progress, RunReport, report_names, safe_row, safe_text, write_report
from .rows import RowCounter, close_report
from .sharding import resolve_shard, shard_files


def _cancel_watch(client, futures, cancel: CancelToken, finished: threading.Event) -> None:
    """Cancel the run's tasks as soon as ``cancel`` is set (the loop over finished tasks
    then ends), not only when the next file finishes."""
    while not finished.wait(0.1):
        if cancel.cancelled:
            client.cancel(futures)
            return


def cluster_options(method, devices, io_workers, image_batch) -> str | None:
    """What the options of an in-process run mean on a cluster: the one device every worker
    uses (None: each worker its own, one GPU each on a LocalCluster). An option a cluster
    cannot honour is refused with one line saying why and what to use instead, before
    anything starts."""
    if not isinstance(method, str):
        raise PipelineError("a cluster run takes a method by name (each worker creates it), not a "
                            "Segmenter object or factory; register it and give its name")
    if io_workers is not None:
        raise PipelineError("io_workers (--io-workers: reader and writer threads) applies to runs in this "
                            "process; on a cluster each file is one task on a worker: leave it out and "
                            "set the workers instead (--workers, --threads-per-worker)")
    if image_batch is not None:
        raise PipelineError("image_batch (--image-batch: images per device call) applies to runs in this "
                            "process; on a cluster each file is one task, one image per call: leave it out")
    if devices is None:
        return None
    names = parse_devices(devices)
    if len(names) > 1:
        raise PipelineError(f"devices {','.join(names)}: one worker per device is how a run in this process "
                            "uses several GPUs; on a cluster every worker takes its own GPU (--cluster local "
                            "starts one worker per GPU): leave devices out, or name one device for all workers")
    return None if names == ["auto"] else names[0]


def run_folder_on_cluster(cluster, in_dir, out_dir, method: str = "unet", *, devices=None, io_workers=None,
                          image_batch=None, cancel: CancelToken | None = None,
                          on_dashboard: Callable[[str], None] | None = None,
                          notify: Callable[[str], None] | None = None, **kwargs) -> RunReport:
    """:func:`run_folder_dask` on ``cluster`` (see :func:`.clusters.open_cluster`: "local",
    "slurm", "" for local, an address, a ``ClusterSpec``, a client); a cluster started here is
    closed after the run. ``on_dashboard(link)`` gets the dashboard address, ``notify(text)``
    news of the start-up. Options of in-process runs: :func:`cluster_options`."""
    from .clusters import open_cluster

    device = cluster_options(method, devices, io_workers, image_batch)
    if device is not None and kwargs.get("device") not in (None, device):
        raise PipelineError(f"two devices given: {device} and {kwargs['device']}")
    kwargs["device"] = device or kwargs.get("device")
    cancel = cancel or CancelToken()
    with open_cluster(cluster, cancel=cancel, notify=notify) as handle:
        if on_dashboard is not None:
            on_dashboard(handle.dashboard)
        return run_folder_dask(handle.client, in_dir, out_dir, method, cancel=cancel, **kwargs)


def _plan(items, report: RunReport, overwrite, header, earlier, current):
    """(items to submit, other-method counts): files whose output is complete get their
    skipped row here (refused names got theirs from ``plan_items``)."""
    todo, other_method = [], {}
    for it in items:
        done = None if overwrite else label_files.read_output(it.labels_path)
        if done is None:
            todo.append(it)
            continue
        row, other = skipped_row(it.rel, it.labels_rel, *done, it.table_path, earlier.get(it.rel), header,
                                 current, it.path)
        if other is not None:
            other_method[other] = other_method.get(other, 0) + 1
        report.rows.append(row)
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
            counter.add(safe_row(row))
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
    method: str = DEFAULT_FOLDER_METHOD,
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
    env: dict | None = None,
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
    shard_t = resolve_shard(shard, os.environ if env is None else env)
    if shard_t is not None:
        found = shard_files(found, *shard_t, root=in_dir)
    report = RunReport(str(in_dir), str(out_dir), method, len(found), model=model,
                       shard=f"{shard_t[0]}/{shard_t[1]}" if shard_t else "")
    if files is None and not found and shard_t is None:
        report.warnings.append(no_input_note(in_dir, out_dir, pattern, recursive))
    header, earlier = read_earlier(out_dir, shard_t)
    this_run = {safe_text(rel_name(x, in_dir)) for x in found}
    report.kept = [r for f, r in sorted(earlier.items()) if f not in this_run]
    items = plan_items(found, in_dir, out_dir, report, earlier)  # names checked as in-process runs do
    todo, other_method = _plan(items, report, overwrite, header, earlier, (method, model))
    job = FileJob(method, json.dumps(options, sort_keys=True), precision, device,
                  (("method", method), ("model", model), ("run", secrets.token_hex(8))), max_image_bytes)
    ours = [p for it in todo for p in (it.table_path, it.labels_path)] + [out_dir / n for n in report_names(shard_t)]
    label_files.remove_temp_files(out_dir, targets=ours)
    if todo:
        for worker, why in sorted(client.run(check_worker, job, str(out_dir)).items()):
            if why:
                raise PipelineError(f"worker {worker}: {why}")
    cancel = cancel or CancelToken()
    counter = RowCounter(report, progress, t_start)
    counter.emit(None)
    futures = [client.submit(process_file, job, it, key=f"gpuseg-file-{job.run_id}-{i}", retries=retries,
                             pure=False) for i, it in enumerate(todo)]
    try:
        _collect(client, futures, {f.key: it.rel for f, it in zip(futures, todo)}, counter, cancel)
    finally:  # a worker killed mid-write leaves its temp file; its task ran again elsewhere
        label_files.remove_temp_files(out_dir, targets=ours)
    close_report(report, [it.rel for it in todo], "not processed (internal error)", other_method, method, model)
    report.seconds = time.perf_counter() - t_start
    try:
        write_report(report, out_dir, shard_t)
    except OSError as exc:
        report.report_error = f"report not written to {out_dir}: {exc.strerror or exc}"
    return report
