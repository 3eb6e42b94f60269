"""Big images in blocks: plan, segment each block with a halo, stitch the seams, write the
labels block by block, join the per-object table.

``run_blocks(image, out_dir, "unet")`` takes a :class:`~napari_gpuseg.io.zarr_images.ZarrImage`
(or any array via :class:`.tasks.ArraySource`) and writes an OME-Zarr labels image (into
the input's ``labels/`` group when the input is OME-Zarr) and ``OUT/<stem>_objects.csv``.
Peak memory follows the block size, not the image size. With a dask ``client`` the
blocks are tasks on the cluster (each worker loads the method once); without one they run
here, one after the other. A rerun resumes: blocks whose record or marker exists in the
work folder are not redone. GUI-free and print-free.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from ...io import label_files, tables
from ...io.zarr_labels import create_labels, foreign_labels, labels_target, set_info, store_stem
from ..runtime.cancel import CancelToken
from .claim import ClaimError, OutputClaim
from .block_method import NothingToSegment, image_stats
from .plan import BlockPlan, plan_blocks
from .stitch import global_ids, match_objects
from .table import joined_table
from .tasks import BlockTask, read_record, segment_block, write_block

DEFAULT_BLOCK = {2: 1024, 3: 128}
DEFAULT_HALO = {2: 64, 3: 16}
WORK_PREFIX = ".gpuseg-blocks-"


class BlockRunError(RuntimeError):
    """A block run that cannot start or go on (the message is one line)."""


@dataclass
class BlockReport:
    labels: str  # where the labels image is (store/group)
    table: str
    shape: tuple
    blocks: int
    objects: int = 0
    seam_merges: int = 0
    resumed: int = 0
    seconds: float = 0.0
    cancelled: bool = False
    store: str = ""  # the zarr store and the labels array in it
    array_path: str = ""
    notes: list = field(default_factory=list)  # what was changed on the way (NaN/inf pixels)

    def open_labels(self):
        """The labels array (read-only zarr; ``dask.array.from_zarr`` reads it lazily)."""
        import zarr

        return zarr.open_array(self.store, path=self.array_path, mode="r")


def _name(image) -> str:
    return Path(str(getattr(image, "path", "image"))).name or "image"


def _stem(image) -> str:
    return store_stem(getattr(image, "path", None))


def _identity(image) -> dict:
    """What identifies the input for a resume (its store, array, channel and files; an
    in-memory array's token): blocks of another input, or of pixels since rewritten, are
    never reused. A source that cannot say gets a fresh key (no resume)."""
    ident = getattr(image, "identity", None)
    if callable(ident):
        return ident()
    import uuid

    return {"unknown": uuid.uuid4().hex}


def _run(tasks, client, fn_args, progress, cancel, label):
    """Run ``fn(*args)`` for each args in ``fn_args``: on ``client`` as tasks, or here."""
    total = len(fn_args)
    results = [None] * total
    if client is None:
        for i, (fn, args) in enumerate(fn_args):
            if cancel.cancelled:
                return None
            results[i] = fn(*args)
            if progress:
                progress(label, i + 1, total)
        return results
    from distributed import as_completed

    futures = [client.submit(fn, *args, pure=False, retries=2) for fn, args in fn_args]
    index = {f.key: i for i, f in enumerate(futures)}
    done = 0
    try:
        for fut in as_completed(futures):
            if cancel.cancelled:
                client.cancel(futures)
                return None
            results[index[fut.key]] = fut.result()
            done += 1
            if progress:
                progress(label, done, total)
    except BaseException:
        client.cancel(futures)
        raise
    return results


def run_blocks(image, out_dir, method: str = "unet", method_options: dict | None = None,
               block=None, halo=None, name: str | None = None, into_input: bool = True,
               client=None, precision: str = "auto", device: str | None = None,
               progress: Callable[[str, int, int], None] | None = None,
               cancel: CancelToken | None = None, overwrite: bool = False,
               methods: dict | None = None) -> BlockReport:
    """Segment ``image`` block by block (see the module docstring). ``block``/``halo``:
    an int or one per axis (default 1024/64 in 2D, 128/16 in 3D); ``name``: the labels
    image name (default the method); ``progress(phase, done, total)``; ``methods``: a dict
    keeping loaded methods between in-process runs."""
    t0 = time.perf_counter()
    cancel = cancel or CancelToken()
    nd = len(image.shape)
    if nd not in (2, 3):
        raise BlockRunError(f"blocks take YX or ZYX images, got shape {tuple(image.shape)}")
    try:
        plan = plan_blocks(image.shape, DEFAULT_BLOCK[nd] if block is None else block,
                           DEFAULT_HALO[nd] if halo is None else halo)
    except (ValueError, TypeError) as exc:  # block 0, too small, halo too big: one line
        raise BlockRunError(str(exc)) from exc
    out_dir = Path(out_dir)
    name = name or method
    options = dict(method_options or {})
    try:
        label_files.check_writable_dir(out_dir)
    except OSError as exc:
        raise BlockRunError(str(exc.strerror or exc)) from exc
    target = labels_target(image, out_dir, name, plan.block, into_input)
    foreign = foreign_labels(target)
    if foreign:  # hand annotations or another tool's labels: never replaced
        raise BlockRunError(foreign)
    source = getattr(image, "path", None)
    claim = OutputClaim(out_dir, _stem(image), str(Path(source).resolve()) if source else None,
                        str(Path(target.store) / "labels") if target.group else None, overwrite)
    try:
        claim.acquire()
    except OSError as exc:
        raise BlockRunError(f"labels cannot be written to {target.location()}: {exc.strerror or exc}") from exc
    except ClaimError as exc:
        raise BlockRunError(str(exc)) from exc
    try:
        return _run_claimed(image, plan, out_dir, target, method, options, client, precision, device,
                            progress, cancel, overwrite, methods, t0)
    finally:
        claim.release()


def _run_claimed(image, plan, out_dir, target, method, options, client, precision, device, progress,
                 cancel, overwrite, methods, t0) -> BlockReport:
    nd = len(plan.shape)
    table_path = out_dir / f"{_stem(image)}_objects.csv"
    key = json.dumps({"shape": plan.shape, "block": plan.block, "halo": plan.halo, "method": method,
                      "options": options, "labels": target.location(), "source": _identity(image)},
                     sort_keys=True, default=str)
    work = out_dir / f"{WORK_PREFIX}{_stem(image)}-{hashlib.sha1(key.encode()).hexdigest()[:10]}"
    if overwrite and work.exists():
        shutil.rmtree(work)
    stats = _stats(image, plan, work, cancel, otsu=method == "threshold", per_slice=method == "unet" and nd == 3)
    if stats is None:
        return BlockReport(target.location(), str(table_path), plan.shape, len(plan.blocks), cancelled=True)
    notes = ([f"{stats['nonfinite']} NaN/inf pixels replaced by the image minimum ({stats['fill']:g})"]
             if stats.get("nonfinite") else [])
    info = {"method": method, "model": str(options.get("model") or ""), "block": list(plan.block),
            "halo": list(plan.halo), **({"notes": notes} if notes else {})}
    try:
        create_labels(target, info, resume=not overwrite)
        _create_work(work, plan)
    except OSError as exc:
        raise BlockRunError(f"labels cannot be written to {target.location()}: {exc.strerror or exc}") from exc
    task = BlockTask(image, str(work), target, method, json.dumps(options, sort_keys=True), precision, device,
                     tuple(sorted(stats.items())))
    if client is not None:
        _check_workers(client, task)
    seams = plan.seams()
    by_block: dict[int, list] = {b.index: [] for b in plan.blocks}
    for i, s in enumerate(seams):
        by_block[s.lower].append((i, s))
        by_block[s.upper].append((i, s))
    resumed = sum(task.record(b.index).exists() for b in plan.blocks)
    report = BlockReport(target.location(), str(table_path), plan.shape, len(plan.blocks), resumed=resumed,
                         store=target.store, array_path=target.array_path, notes=notes)
    calls = [(segment_block, (task, b, by_block[b.index]) + ((methods,) if client is None else ()))
             for b in plan.blocks]
    counts = _run(task, client, calls, progress, cancel, "segment")
    if counts is None:
        report.cancelled = True
        report.seconds = time.perf_counter() - t0
        return report
    luts, n_obj, merges = _stitch(task, plan, seams, counts)
    report.objects, report.seam_merges = n_obj, merges
    calls = [(write_block, (task, b, luts[b.index])) for b in plan.blocks]
    if _run(task, client, calls, progress, cancel, "write") is None:
        report.cancelled = True
        report.seconds = time.perf_counter() - t0
        return report
    parts = (read_record(task.record(b.index), "t_") for b in plan.blocks)
    table = joined_table(parts, luts, n_obj, nd)
    label_files.atomic_write_text(table_path, tables.table_to_csv(table))
    set_info(target.open("r+"), {"complete": True, "objects": n_obj})
    shutil.rmtree(work, ignore_errors=True)
    report.seconds = time.perf_counter() - t0
    return report


def _stats(image, plan: BlockPlan, work: Path, cancel, otsu: bool, per_slice: bool) -> dict | None:
    """The global intensity scale, kept in the work folder so a resumed run uses the same."""
    path = work / "stats.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    try:
        stats = image_stats(image, plan, otsu=otsu, per_slice=per_slice, cancel=cancel)
    except NothingToSegment as exc:
        raise BlockRunError(f"{_name(image)}: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - Cancelled or a read error
        if cancel.cancelled:
            return None
        raise BlockRunError(f"{getattr(image, 'path', 'image')}: cannot be read: {type(exc).__name__}: {exc}") from exc
    work.mkdir(parents=True, exist_ok=True)
    label_files.atomic_write_text(path, json.dumps(stats))
    return stats


def _create_work(work: Path, plan: BlockPlan) -> None:
    import zarr

    (work / "written").mkdir(parents=True, exist_ok=True)
    local = work / "local.zarr"
    if not local.exists():
        zarr.create_array(str(local), shape=plan.shape, chunks=plan.block, dtype=np.uint32, fill_value=0,
                          zarr_format=2)


def _check_workers(client, task: BlockTask) -> None:
    """Every worker must see the folders and load the method: else one line, no work."""
    from .tasks import check_worker

    answers = client.run(check_worker, task)
    for worker, why in sorted(answers.items()):
        if why:
            raise BlockRunError(f"worker {worker}: {why}")


def _stitch(task: BlockTask, plan: BlockPlan, seams, counts):
    """Match objects across every seam, reading two zones at a time from the records."""
    pairs, merges = [], 0
    for i, s in enumerate(seams):
        key = f"zone{i}"
        m = match_objects(_record(task, s.lower, key)[key], _record(task, s.upper, key)[key])
        merges += len(m)
        pairs.append((s.lower, s.upper, m))
    in_core = [_record(task, b.index, "t_ids")["t_ids"] for b in plan.blocks]
    luts, n = global_ids(counts, in_core, pairs)
    return luts, n, merges


def _record(task: BlockTask, k: int, prefix: str) -> dict:
    rec = read_record(task.record(k), prefix)
    if rec is None:
        raise BlockRunError(f"the record of block {k} is gone from {task.work} (the work folder was removed "
                            "during the run): run again")
    return rec
