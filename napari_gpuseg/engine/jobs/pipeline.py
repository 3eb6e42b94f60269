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

from ...io import label_files
from ..runtime.cancel import Cancelled, CancelToken
from .methods import Segmenter, method_factory
from .outputs import describe_method, foreign_output, list_inputs, output_paths, read_earlier, rel_name, same_folder
from .report import ImageStatus, Progress, RunReport, report_names, safe_row, safe_text, write_report  # noqa: F401 - re-exported
from .sharding import resolve_shard, shard_files  # noqa: F401 - re-exported
from .stages import POLL_S, FolderRun, Item


class PipelineError(RuntimeError):
    """The run as a whole failed (for example the model could not be loaded)."""


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
        label_files.check_writable_dir(out_dir)
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
        src_rel = rel_name(f, in_dir)
        rel = safe_text(src_rel)  # a name that is not valid UTF-8 is escaped in the report
        lp, tp = output_paths(in_dir, out_dir, f)
        item = Item(i, Path(f), rel, lp, tp, safe_text(lp.relative_to(out_dir).as_posix()), src_rel=src_rel)
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
    this_run = {safe_text(rel_name(x, in_dir)) for x in found}
    report.kept = [r for f, r in sorted(earlier.items()) if f not in this_run]

    ours = [p for it in items for p in (it.labels_path, it.table_path)]
    ours += [out_dir / n for n in report_names(shard_t)]
    label_files.remove_temp_files(out_dir, targets=ours)  # left over from a killed run of these files
    run = FolderRun(items, factory, prep, policies, io_workers, image_batch, overwrite, max_image_bytes,
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
                row = safe_row(run.rows.get(timeout=POLL_S))
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
        for row in map(safe_row, run.drain()):  # rows of files finished while stopping: every output has one
            report.rows.append(row)
            counts[row.status] += 1
        label_files.remove_temp_files(out_dir, targets=ours)
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
    report.rows = sorted(map(safe_row, report.rows), key=lambda r: r.file)
    try:
        write_report(report, out_dir, shard_t)
    except OSError as exc:  # e.g. the disk filled up: the outputs written stay; say why
        report.report_error = f"report not written to {out_dir}: {exc.strerror or exc}"
    if aborted:
        raise KeyboardInterrupt
    return report
