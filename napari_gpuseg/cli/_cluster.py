"""The ``batch`` options for Dask clusters and big images in blocks, and where they say to
run (a ``ClusterSpec`` for the engine's ``run_folder`` / ``run_blocks``, or None: here).

``--cluster local|slurm`` / ``--scheduler ADDRESS`` spread a folder's files over a Dask
cluster; an IN that is a zarr / OME-Zarr store is segmented in blocks (on the cluster
when one is given, else here).
"""
from __future__ import annotations

import argparse

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


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Dask cluster and big images")
    g.add_argument("--cluster", choices=("local", "slurm"), default=None,
                   help="run on a Dask cluster: local (worker processes here: one per GPU, or --workers) "
                        "or slurm (dask-jobqueue, options from --cluster-config)")
    g.add_argument("--scheduler", default=None, metavar="tcp://HOST:PORT",
                   help="run on an existing Dask cluster at this scheduler address")
    g.add_argument("--cluster-config", default=None, metavar="FILE",
                   help="YAML options of the SLURM jobs: cores, memory, gpus, walltime, queue, jobs")
    g.add_argument("--workers", type=_positive, default=None, help="worker processes of --cluster local")
    g.add_argument("--threads-per-worker", type=_positive, default=1,
                   help="threads of each local worker (default 1)")
    g.add_argument("--block-size", type=_size, default=None, metavar="N|Z,Y,X",
                   help="block edge for zarr inputs (default 1024 in 2D, 128 in 3D)")
    g.add_argument("--halo", type=_size, default=None, metavar="N|Z,Y,X",
                   help="context around each block (default 64 in 2D, 16 in 3D)")
    g.add_argument("--labels-to", choices=("input", "out"), default="input",
                   help="OME-Zarr input: labels into its labels/ group (default) or into OUT")


def cluster_spec(args):
    """Where the options say to run: None (here) or a ``ClusterSpec``."""
    from ..engine.jobs.clusters import ClusterError, ClusterSpec

    if args.cluster and args.scheduler:
        raise ClusterError("give either --cluster or --scheduler, not both")
    if not (args.cluster or args.scheduler):
        if args.cluster_config or args.workers is not None:
            raise ClusterError("--cluster-config and --workers need --cluster")
        return None
    return ClusterSpec(args.cluster, args.scheduler, args.cluster_config, args.workers, args.threads_per_worker)
