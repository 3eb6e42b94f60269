"""Getting a Dask cluster: a LocalCluster on this machine, an existing scheduler, or SLURM
through dask-jobqueue with the options of a config file. Everything binds to 127.0.0.1
locally. Connection problems become :class:`ClusterError` with a one-line reason.
GUI-free and print-free.

A cluster config file (YAML) for ``--cluster slurm``::

    cores: 8            # CPU cores per job
    memory: 32GB        # memory per job
    gpus: 1             # GPUs per job (--gres=gpu:N)
    walltime: "02:00:00"
    queue: gpu          # the SLURM partition
    jobs: 4             # how many jobs (one dask worker each) to start
    account: mylab      # optional; any other key goes to dask_jobqueue.SLURMCluster
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

OUR_KEYS = ("gpus", "jobs")
CONNECT_TIMEOUT_S = 20.0  # how long to try reaching a scheduler address


class ClusterError(RuntimeError):
    """The cluster could not be started or reached (one-line message)."""


@dataclass
class ClusterHandle:
    """A connected client and what to close when the run ends."""

    client: object
    cluster: object | None = None
    owned: list = field(default_factory=list)

    @property
    def dashboard(self) -> str:
        return str(getattr(self.client, "dashboard_link", "") or "")

    @property
    def n_workers(self) -> int:
        return len(self.client.scheduler_info().get("workers", {}))

    def close(self) -> None:
        import logging

        # workers busy in a C library take a few seconds to stop; the nanny then ends them,
        # which is what closing asks for: no warning about it
        logging.getLogger("distributed.nanny").setLevel(logging.ERROR)
        for obj in reversed(self.owned):
            try:
                obj.close()
            except Exception:  # noqa: BLE001 - closing what may already be gone
                pass
        self.owned.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def load_cluster_config(path: str | os.PathLike) -> dict:
    """The options of a cluster config file (YAML or JSON mapping)."""
    import yaml

    p = Path(path)
    try:
        doc = yaml.safe_load(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ClusterError(f"cluster config {p}: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        raise ClusterError(f"cluster config {p}: not valid YAML ({str(exc).splitlines()[0]})") from exc
    if not isinstance(doc, dict):
        raise ClusterError(f"cluster config {p}: expected a mapping of options, got {type(doc).__name__}")
    return doc


def slurm_options(config: dict) -> tuple[dict, int]:
    """(``SLURMCluster`` keyword arguments, number of jobs) from a config mapping."""
    opts = {k: v for k, v in config.items() if k not in OUR_KEYS}
    opts.setdefault("cores", 1)
    opts.setdefault("memory", "4GB")
    opts.setdefault("processes", 1)
    gpus = int(config.get("gpus") or 0)
    if gpus:
        extra = list(opts.get("job_extra_directives") or [])
        extra.append(f"--gres=gpu:{gpus}")
        opts["job_extra_directives"] = extra
    return opts, int(config.get("jobs") or 1)


def slurm_cluster(config: dict):
    """A ``dask_jobqueue.SLURMCluster`` (no job submitted yet) and the number of jobs."""
    try:
        from dask_jobqueue import SLURMCluster
    except ImportError as exc:
        raise ClusterError("--cluster slurm needs the dask-jobqueue package") from exc
    opts, jobs = slurm_options(config)
    try:
        return SLURMCluster(**opts), jobs
    except (TypeError, ValueError) as exc:
        raise ClusterError(f"cluster config: {exc}") from exc


def local_cluster(n_workers: int | None = None, threads_per_worker: int = 1, gpus: int | None = None):
    """A LocalCluster of worker processes on 127.0.0.1: one per GPU when there are GPUs,
    else ``n_workers`` (default: the CPU count / threads per worker)."""
    from distributed import LocalCluster

    if gpus is None:
        try:
            import torch

            gpus = torch.cuda.device_count()
        except ImportError:
            gpus = 0
    if n_workers is None:
        n_workers = gpus or max(1, (os.cpu_count() or 1) // max(1, threads_per_worker))
    env = {"OMP_NUM_THREADS": str(threads_per_worker), "MKL_NUM_THREADS": str(threads_per_worker)}
    return LocalCluster(n_workers=n_workers, threads_per_worker=threads_per_worker, processes=True,
                        host="127.0.0.1", dashboard_address="127.0.0.1:0", env=env)


def connect(cluster: str | None = None, scheduler: str | None = None, config: str | None = None,
            n_workers: int | None = None, threads_per_worker: int = 1, timeout: float | None = None,
            wait_workers: float = 300.0) -> ClusterHandle:
    """A client on ``scheduler`` (an address such as ``tcp://host:8786``), or on a new
    ``cluster`` ("local" or "slurm", with ``config``)."""
    from distributed import Client

    timeout = CONNECT_TIMEOUT_S if timeout is None else timeout
    if scheduler:
        try:
            client = Client(scheduler, timeout=f"{timeout:g}s")
        except (OSError, TimeoutError) as exc:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ClusterError(f"cannot reach the Dask scheduler at {scheduler}: {reason}") from exc
        handle = ClusterHandle(client, None, [client])
    elif cluster == "local":
        lc = local_cluster(n_workers, threads_per_worker)
        handle = ClusterHandle(Client(lc), lc, [lc])
        handle.owned.append(handle.client)
    elif cluster == "slurm":
        sc, jobs = slurm_cluster(load_cluster_config(config) if config else {})
        sc.scale(jobs=jobs)
        handle = ClusterHandle(Client(sc), sc, [sc])
        handle.owned.append(handle.client)
    else:
        raise ClusterError(f"unknown cluster {cluster!r} (use local or slurm, or give --scheduler)")
    try:
        handle.client.wait_for_workers(1, timeout=wait_workers)
    except (OSError, TimeoutError) as exc:
        handle.close()
        raise ClusterError(f"no Dask worker joined within {wait_workers:g} s") from exc
    return handle
