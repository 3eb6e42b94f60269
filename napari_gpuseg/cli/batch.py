"""``napari-gpuseg batch IN_DIR OUT_DIR``: segment a folder from a terminal or a cluster job.

Exit codes: 0 every file ok or skipped, 1 at least one file failed (or the outputs could
not all be written, e.g. a full disk), 2 the run could not start (bad arguments or method
options, unknown method, no device, an output folder that cannot be written, OUT == IN
with outputs that would replace other files, model failed to load), 130 interrupted
(Ctrl-C).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from ..engine.runtime.allocator import configure_allocator
from ..engine.runtime.device import PRECISIONS
from ..io import DEFAULT_PATTERN
from ..engine.jobs.block_jobs import run_blocks, run_stores, stores_in
from ..engine.jobs.method_registry import DEFAULT_FOLDER_METHOD, default_sam_model
from ..engine.jobs.pipeline import run_folder
from ..io.zarr_images import is_zarr
from ._cluster import EPILOG as CLUSTER_EPILOG
from ._cluster import add_cluster_arguments, cluster_spec

EPILOG = """\
examples:
  napari-gpuseg batch images/ labels/                      # the bundled U-Net
  napari-gpuseg batch images/ labels/ --method threshold --set channel=1
  napari-gpuseg batch images/ labels/ --devices cuda:0,cuda:1 --image-batch 8
  # SLURM job array: each task takes its share (SLURM_ARRAY_TASK_ID / _COUNT are read)
  sbatch --array=0-7 --wrap "napari-gpuseg batch images/ labels/ --method unet"

Outputs: OUT/<name>_labels.tif (compressed TIFF), OUT/<name>_objects.csv, OUT/report.csv and
OUT/report.json. A rerun skips files whose output is complete (use --overwrite to redo) and
keeps the earlier rows of the report; files this program did not write are never replaced.
"""


def _batch_size(text: str) -> int | None:
    if text.lower() == "auto":
        return None
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("batch size must be >= 1 or 'auto'")
    return value


def _positive_gb(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError("must be a positive number of GiB")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value


def add_batch_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``batch`` subcommand to an ``argparse`` subparsers object."""
    p = subparsers.add_parser(
        "batch", help="segment every image in a folder",
        description=__doc__, epilog=EPILOG + CLUSTER_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("in_dir", nargs="?", help="folder of input images")
    p.add_argument("out_dir", nargs="?", help="folder for label images, object tables and the report")
    p.add_argument("--method", default=DEFAULT_FOLDER_METHOD,
                   help=f"segmentation method (see --list-methods); default: {DEFAULT_FOLDER_METHOD} "
                        "(the bundled nuclei U-Net)")
    p.add_argument("--model", default=None,
                   help="model name or checkpoint file for the method; default: the bundled U-Net for unet, "
                        f"the annotator's SAM model ({default_sam_model()}) for the SAM methods")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="options",
                   help="method option, repeatable (e.g. --set detector=unet --set min_size=20)")
    p.add_argument("--pattern", default=DEFAULT_PATTERN,
                   help=f"file name glob(s), comma-separated (default: {DEFAULT_PATTERN})")
    p.add_argument("--recursive", action="store_true", help="also scan subfolders")
    p.add_argument("--shard", default=None, metavar="I/N",
                   help="process shard I of N (0-based); default: SLURM_ARRAY_TASK_ID/COUNT if set")
    p.add_argument("--devices", default=None,
                   help="comma-separated devices, one worker each (e.g. cuda:0,cuda:1); default: best")
    p.add_argument("--io-workers", type=_positive, default=None,
                   help="reader and writer threads each (default 2; runs in this process only)")
    p.add_argument("--image-batch", type=_positive, default=None,
                   help="images per device call (default 4; runs in this process only)")
    p.add_argument("--batch-size", type=_batch_size, default=None, metavar="auto|N",
                   help="prompts/tiles per device call inside the method (default: auto)")
    p.add_argument("--precision", default="auto", choices=PRECISIONS)
    p.add_argument("--overwrite", action="store_true", help="redo files that already have output")
    p.add_argument("--max-image-gb", type=_positive_gb, default=None,
                   help="refuse images whose segmentation needs more memory than this (GiB; "
                        "estimated per method; default: half the available RAM)")
    p.add_argument("--plugin", action="append", default=[], metavar="MODULE|FILE.py",
                   help="import a module that registers extra methods (repeatable)")
    p.add_argument("--list-methods", action="store_true", help="list methods and exit")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_cluster_arguments(p)
    p.set_defaults(func=run_batch)
    return p


class _Bar:
    """tqdm progress bar fed from pipeline Progress events (stderr)."""

    def __init__(self, quiet: bool) -> None:
        self.bar = None
        self.quiet = quiet

    def __call__(self, p) -> None:
        if self.quiet:
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=p.total, unit="img", dynamic_ncols=True, file=sys.stderr)
        self.bar.n = p.done
        self.bar.set_postfix(ok=p.ok, skip=p.skipped, err=p.errors,
                             rate=f"{p.images_per_s:.2f}/s", refresh=False)
        self.bar.refresh()
        if p.row is not None and p.row.status == "error":
            self.bar.write(f"error: {p.row.file}: {p.row.error}", file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def block_options(args) -> dict:
    """The keywords of a block run from the options."""
    return dict(block=args.block_size, halo=args.halo, into_input=args.labels_to == "input",
                precision=args.precision, overwrite=args.overwrite, devices=args.devices)


class BlockBars:
    """tqdm bars per phase of a block run (stderr), fed from its progress events."""

    def __init__(self, quiet: bool):
        self.quiet, self.bars = quiet, {}

    def __call__(self, phase, done, total):
        if self.quiet:
            return
        if phase not in self.bars:
            from tqdm import tqdm

            self.bars[phase] = tqdm(total=total, unit="block", desc=phase, file=sys.stderr, dynamic_ncols=True)
        self.bars[phase].n = done
        self.bars[phase].refresh()

    def close(self):
        for b in self.bars.values():
            b.close()
        self.bars = {}


def print_blocks(rep) -> int:
    """The summary lines of a block run; its exit code (130 when cancelled)."""
    if rep.cancelled:
        print("cancelled: finished blocks are kept; rerun to resume", file=sys.stderr)
        return 130
    print(f"done: {rep.objects} objects in {rep.blocks} blocks ({rep.resumed} resumed, "
          f"{rep.seam_merges} seam matches) in {rep.seconds:.1f} s")
    for note in getattr(rep, "notes", None) or []:
        print(f"note: {note}")
    print(f"labels: {rep.labels}")
    print(f"objects: {rep.table}")
    return 0


def _list_methods() -> int:
    from ..engine.jobs.method_registry import available_methods, method_description

    for name in available_methods():
        print(f"{name:16s} {method_description(name)}")
    return 0


def _exit_if_threads_left(code: int) -> None:
    """After a hard abort (Ctrl-C twice) a stage thread may still be inside torch or a C
    library; letting the interpreter finalise around it aborts with SIGABRT (exit 134).
    End the process here instead, with ``code``."""
    if any(t.is_alive() and t.name.startswith("gpuseg-") for t in threading.enumerate()):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _check_in(in_dir: str) -> None:
    """IN must be a folder of images or a zarr store: a single file is said in one line."""
    from pathlib import Path

    from ..io.zarr_images import is_zarr

    p = Path(in_dir)
    if p.is_file() and not is_zarr(p):
        raise ValueError(f"IN must be a folder of images or a zarr store; {in_dir} is a file "
                         "(put it in a folder of its own and give that folder)")


def run_batch(args: argparse.Namespace) -> int:
    """Run the ``batch`` subcommand; returns the process exit code. It parses and prints:
    where and how the job runs is the engine's (``run_folder``, ``run_blocks``)."""
    configure_allocator()
    from ..engine.runtime.cancel import Cancelled, CancelToken
    from ..engine.jobs.method_registry import MethodUnavailable, load_plugin, method_factory, parse_options
    from ..engine.jobs.pipeline import PipelineError
    from ..engine.jobs.sharding import resolve_shard

    try:
        for plugin in args.plugin:
            load_plugin(plugin)
        if args.list_methods:
            return _list_methods()
        if not args.in_dir or not args.out_dir:
            raise ValueError("IN_DIR and OUT_DIR are required")
        _check_in(args.in_dir)
        shard = resolve_shard(args.shard)
        options = {**parse_options(args.options), "model": args.model, "batch_size": args.batch_size}
        method_factory(args.method, **options)()  # fail fast: unknown method, bad option
        cluster = cluster_spec(args)
        blocks = block_options(args)
    except (MethodUnavailable, ValueError, TypeError, ImportError, OSError, RuntimeError) as exc:
        print(f"napari-gpuseg batch: {exc}", file=sys.stderr)
        return 2

    cancel = CancelToken()
    interrupted = threading.Event()

    def on_sigint(signum, frame):  # first Ctrl-C: stop cleanly; second: hard stop
        if interrupted.is_set():
            raise KeyboardInterrupt
        interrupted.set()
        cancel.cancel()
        print("\ninterrupted: stopping (Ctrl-C again to abort)", file=sys.stderr)

    old = None
    if threading.current_thread() is threading.main_thread():
        old = signal.signal(signal.SIGINT, on_sigint)
    bar = _Bar(args.quiet)
    news = dict(cluster=cluster, cancel=cancel, notify=_say, on_dashboard=lambda link: _say(f"dask: dashboard {link}"))
    stores, files_too = ([], True) if is_zarr(args.in_dir) else stores_in(
        args.in_dir, args.out_dir, args.pattern, args.recursive)
    try:
        if is_zarr(args.in_dir):
            return _one_store(args, options, {**blocks, **news})
        if stores and not files_too:  # a folder of zarr stores: each in blocks
            return _stores(args, options, stores, {**blocks, **news})
        report = run_folder(
            args.in_dir, args.out_dir, args.method,
            method_options=options, pattern=args.pattern, recursive=args.recursive,
            shard=shard, devices=args.devices, io_workers=args.io_workers,
            image_batch=args.image_batch, overwrite=args.overwrite, progress=bar,
            precision=args.precision, max_image_bytes=_max_bytes(args), **news,
        )
    except (KeyboardInterrupt, Cancelled):
        bar.close()
        print("aborted", file=sys.stderr)
        _exit_if_threads_left(130)
        return 130
    except (PipelineError, MethodUnavailable, NotADirectoryError, ValueError, RuntimeError) as exc:
        bar.close()
        print(f"napari-gpuseg batch: {exc}", file=sys.stderr)
        return 2
    finally:
        if old is not None:
            signal.signal(signal.SIGINT, old)
    bar.close()
    code = _print_report(report)
    if report.cancelled or interrupted.is_set():
        return 130
    if stores:  # the folder's zarr stores after its files
        code = max(code, _stores(args, options, stores, {**blocks, **news}))
    return code


def _say(text: str) -> None:
    print(text, file=sys.stderr)


def _max_bytes(args) -> int | None:
    return int(args.max_image_gb * 2**30) if args.max_image_gb else None


def _print_report(report) -> int:
    """The summary of a folder run; its exit code (1 when a file failed or the report
    could not be written)."""
    print(f"{report.summary()}{' (shard ' + report.shard + ')' if report.shard else ''}")
    for row in [r for r in report.rows if r.status == "error"][:20]:
        print(f"  error  {row.file}: {row.error}")
    if report.errors > 20:
        print(f"  ... {report.errors - 20} more errors")
    for text in report.warnings:
        print(f"warning: {text}", file=sys.stderr)
    if report.disk_error:
        print(f"napari-gpuseg batch: stopped: {report.disk_error}; the {report.ok} outputs "
              "written are complete", file=sys.stderr)
    if report.report_error:
        print(f"napari-gpuseg batch: {report.report_error}", file=sys.stderr)
    else:
        print(f"report: {report.report_csv}")
    return 1 if (report.failed or report.report_error) else 0


def _one_store(args, options: dict, news: dict) -> int:
    """A zarr store IN, in blocks (``news``: where and how, from the options)."""
    bars = BlockBars(args.quiet)
    try:
        rep = run_blocks(args.in_dir, args.out_dir, args.method, options, progress=bars, **news)
    finally:
        bars.close()
    return print_blocks(rep)


def _stores(args, options: dict, stores: list, news: dict) -> int:
    """The zarr stores found in the folder IN, each in blocks: the summary lines of each, or
    one error line for a store that cannot be segmented. 0, 1 when a store failed, 130."""
    bars = BlockBars(args.quiet)

    def on_store(k, n, rel, result):
        bars.close()
        print(f"store {k}/{n}: {rel}")
        if isinstance(result, Exception):
            print(f"napari-gpuseg batch: {result}", file=sys.stderr)
        else:
            print_blocks(result)

    failed, cancelled = run_stores(stores, args.in_dir, args.out_dir, args.method, options, progress=bars,
                                   on_store=on_store, **news)
    bars.close()
    return 130 if cancelled else (1 if failed else 0)


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point (``python -m napari_gpuseg.cli.batch IN OUT ...``)."""
    parser = argparse.ArgumentParser(prog="napari-gpuseg")
    add_batch_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["batch", *(sys.argv[1:] if argv is None else argv)])
    return run_batch(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
