"""The ``batch`` options for Dask clusters and big images in blocks, and their runs.

``--cluster local|slurm`` / ``--scheduler ADDRESS`` spread a folder's files over a Dask
cluster; an IN that is a zarr / OME-Zarr store is segmented in blocks (on the cluster
when one is given, else here).
"""
from __future__ import annotations

import argparse
import sys

EPILOG = """\
bigger than one machine:
  napari-gpuseg batch images/ labels/ --method unet --cluster local --workers 2
  napari-gpuseg batch images/ labels/ --scheduler tcp://10.0.0.5:8786
  napari-gpuseg batch images/ labels/ --cluster slurm --cluster-config slurm.yaml
  napari-gpuseg batch mosaic.ome.zarr labels/ --method unet --block-size 1024 --halo 64
"""


def _size(text: str):
    try:
        vals = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer or a comma-separated list: {text!r}") from None
    if any(v < 0 for v in vals):
        raise argparse.ArgumentTypeError("must be >= 0")
    return vals[0] if len(vals) == 1 else tuple(vals)


def add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Dask cluster and big images")
    g.add_argument("--cluster", choices=("local", "slurm"), default=None,
                   help="run on a Dask cluster: local (worker processes here: one per GPU, or --workers) "
                        "or slurm (dask-jobqueue, options from --cluster-config)")
    g.add_argument("--scheduler", default=None, metavar="tcp://HOST:PORT",
                   help="run on an existing Dask cluster at this scheduler address")
    g.add_argument("--cluster-config", default=None, metavar="FILE",
                   help="YAML options of the SLURM jobs: cores, memory, gpus, walltime, queue, jobs")
    g.add_argument("--workers", type=int, default=None, help="worker processes of --cluster local")
    g.add_argument("--threads-per-worker", type=int, default=1, help="threads of each local worker (default 1)")
    g.add_argument("--block-size", type=_size, default=None, metavar="N|Z,Y,X",
                   help="block edge for zarr inputs (default 1024 in 2D, 128 in 3D)")
    g.add_argument("--halo", type=_size, default=None, metavar="N|Z,Y,X",
                   help="context around each block (default 64 in 2D, 16 in 3D)")
    g.add_argument("--labels-to", choices=("input", "out"), default="input",
                   help="OME-Zarr input: labels into its labels/ group (default) or into OUT")


def folder_runner(args, run_folder):
    """``run_folder`` itself, or a function with its arguments that runs on the Dask cluster
    the options ask for, or segments a zarr IN in blocks."""
    from ..io.zarr_images import is_zarr

    if not (args.cluster or args.scheduler or (args.in_dir and is_zarr(args.in_dir))):
        return run_folder

    def run(in_dir, out_dir, method, *, method_options, shard, progress, cancel, max_image_bytes, **_):
        return run_distributed(args, method_options, shard, progress, cancel, max_image_bytes)

    return run


def run_distributed(args, options: dict, shard, bar, cancel, max_bytes):
    """A RunReport for a folder on a cluster, or an exit code for a zarr image in blocks."""
    from ..engine.jobs.clusters import ClusterError, connect
    from ..io.zarr_images import is_zarr

    if args.cluster == "slurm" and args.scheduler:
        raise ClusterError("give either --cluster or --scheduler, not both")
    handle = None
    if args.cluster or args.scheduler:
        handle = connect(args.cluster, args.scheduler, args.cluster_config, args.workers,
                         args.threads_per_worker)
        print(f"dask: {handle.n_workers} worker(s), dashboard {handle.dashboard}", file=sys.stderr)
    try:
        if is_zarr(args.in_dir):
            return _blocks(args, options, handle, cancel)
        from ..engine.jobs.dask_runner import run_folder_dask

        return run_folder_dask(handle.client, args.in_dir, args.out_dir, args.method, method_options=options,
                               pattern=args.pattern, recursive=args.recursive, shard=shard,
                               overwrite=args.overwrite, progress=bar, cancel=cancel,
                               precision=args.precision, device=_one_device(args), max_image_bytes=max_bytes)
    finally:
        if handle is not None:
            handle.close()


def _blocks(args, options: dict, handle, cancel) -> int:
    from ..engine.blocks import run_blocks
    from ..io.zarr_images import open_zarr

    options = dict(options)
    image = open_zarr(args.in_dir, channel=options.pop("channel", None))
    bars = {}

    def progress(phase, done, total):
        if args.quiet:
            return
        if phase not in bars:
            from tqdm import tqdm

            bars[phase] = tqdm(total=total, unit="block", desc=phase, file=sys.stderr, dynamic_ncols=True)
        bars[phase].n = done
        bars[phase].refresh()

    try:
        rep = run_blocks(image, args.out_dir, args.method, {k: v for k, v in options.items() if v is not None},
                         block=args.block_size, halo=args.halo, into_input=args.labels_to == "input",
                         client=None if handle is None else handle.client, precision=args.precision,
                         device=_one_device(args), progress=progress, cancel=cancel, overwrite=args.overwrite)
    finally:
        for b in bars.values():
            b.close()
    if rep.cancelled:
        print("cancelled: finished blocks are kept; rerun to resume", file=sys.stderr)
        return 130
    print(f"done: {rep.objects} objects in {rep.blocks} blocks ({rep.resumed} resumed, "
          f"{rep.seam_merges} seam matches) in {rep.seconds:.1f} s")
    print(f"labels: {rep.labels}")
    print(f"objects: {rep.table}")
    return 0


def run_stores(args, options: dict, stores: list, cancel) -> int:
    """Each zarr store found in the folder IN, in blocks, one after another (on the cluster
    the options name, if any): the summary lines of each, or one error line for a store that
    cannot be segmented, and the next one runs. Exit code: 0, 1 when a store failed, 130 when
    cancelled."""
    import copy
    from pathlib import Path

    from ..engine.jobs.clusters import connect

    handle = None
    if args.cluster or args.scheduler:
        handle = connect(args.cluster, args.scheduler, args.cluster_config, args.workers,
                         args.threads_per_worker)
    failed = 0
    try:
        for k, store in enumerate(stores, 1):
            one = copy.copy(args)
            one.in_dir = str(store)
            one.out_dir = str(Path(args.out_dir) / Path(store).parent.relative_to(args.in_dir))
            print(f"store {k}/{len(stores)}: {Path(store).relative_to(args.in_dir)}")
            try:
                code = _blocks(one, options, handle, cancel)
            except (ValueError, RuntimeError, OSError) as exc:  # one line; the next store runs
                print(f"napari-gpuseg batch: {exc}", file=sys.stderr)
                failed += 1
                continue
            if code == 130:
                return 130
            failed += code != 0
    finally:
        if handle is not None:
            handle.close()
    return 1 if failed else 0


def _one_device(args) -> str | None:
    """``--devices`` names the device of every worker when it names one (else each worker
    takes its own: one GPU each on a LocalCluster)."""
    return args.devices if args.devices and "," not in args.devices else None
