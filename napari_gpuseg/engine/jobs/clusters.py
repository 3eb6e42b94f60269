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

from ..runtime.cancel import Cancelled

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


def _count(config: dict, key: str, lo: int, source: str) -> int:
    """``config[key]`` as an integer >= ``lo`` (absent or null: ``lo``), else a ClusterError
    naming the file and the key."""
    value = config.get(key)
    if value is None:
        return lo
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ClusterError(f"cluster config {source}: {key}: {value!r} must be a whole number >= {lo}")
    return value


def slurm_options(config: dict, source: str = "") -> tuple[dict, int]:
    """(``SLURMCluster`` keyword arguments, number of jobs) from a config mapping (``source``:
    the file it came from, for messages). The dashboard binds 127.0.0.1 unless the config
    says otherwise (reach it through an SSH tunnel)."""
    source = source or "(mapping)"
    opts = {k: v for k, v in config.items() if k not in OUR_KEYS}
    opts.setdefault("cores", 1)
    opts.setdefault("memory", "4GB")
    opts.setdefault("processes", 1)
    sched = opts.get("scheduler_options")
    if sched is not None and not isinstance(sched, dict):
        raise ClusterError(f"cluster config {source}: scheduler_options: expected a mapping, got {sched!r}")
    opts["scheduler_options"] = {"dashboard_address": "127.0.0.1:0", **(sched or {})}
    gpus = _count(config, "gpus", 0, source)
    if gpus:
        extra = list(opts.get("job_extra_directives") or [])
        extra.append(f"--gres=gpu:{gpus}")
        opts["job_extra_directives"] = extra
    return opts, _count(config, "jobs", 1, source)


def slurm_cluster(config: dict, source: str = ""):
    """A ``dask_jobqueue.SLURMCluster`` (no job submitted yet) and the number of jobs."""
    opts, jobs = slurm_options(config, source)  # the config's values first: one line each
    try:
        from dask_jobqueue import SLURMCluster
    except ImportError as exc:
        raise ClusterError("--cluster slurm needs the dask-jobqueue package") from exc
    try:
        return SLURMCluster(**opts), jobs
    except (TypeError, ValueError) as exc:
        where = f" {source}" if source else ""
        raise ClusterError(f"cluster config{where}: {exc}") from exc


def check_sbatch() -> None:
    """SLURM jobs are submitted with ``sbatch``: without it, say so before anything listens."""
    import shutil

    if shutil.which("sbatch") is None:
        raise ClusterError("--cluster slurm needs SLURM's sbatch command, which is not on this machine's "
                           "PATH: run it on the cluster's login node (or use --cluster local / --scheduler)")


def local_cluster(n_workers: int | None = None, threads_per_worker: int = 1, gpus: int | None = None):
    """A LocalCluster of worker processes on 127.0.0.1: one per GPU when there are GPUs,
    else ``n_workers`` (default: the CPU count / threads per worker)."""
    from distributed import LocalCluster

    check_counts(n_workers, threads_per_worker)
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


def check_counts(n_workers: int | None, threads_per_worker: int | None) -> None:
    """Worker and thread counts of a local cluster: whole numbers >= 1 (None: the default)."""
    for name, value in (("workers", n_workers), ("threads per worker", threads_per_worker)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ClusterError(f"the number of {name} must be a whole number >= 1, got {value!r}")


def _client(address: str, timeout: float, cancel):
    """A client on the scheduler at ``address`` within ``timeout`` seconds. Something that
    listens there but is no Dask scheduler (a dashboard port, a web server) may never answer:
    the attempt runs in a thread, so the wait is bounded and Ctrl-C / ``cancel`` end it."""
    import threading
    import time

    from distributed import Client

    box: dict = {}
    given_up = threading.Event()

    def make():
        try:  # not the process's default client: an attempt given up must not become dask's scheduler
            client = Client(address, timeout=f"{timeout:g}s", set_as_default=False)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc
            return
        box["client"] = client
        if given_up.is_set():  # answered after the caller gave up
            client.close()

    t = threading.Thread(target=make, name="dask-connect", daemon=True)
    t.start()
    end = time.monotonic() + timeout + 2.0
    while t.is_alive() and time.monotonic() < end:
        if cancel is not None and cancel.cancelled:
            given_up.set()
            raise Cancelled("cancelled while connecting")
        t.join(0.1)
    if t.is_alive():
        given_up.set()
        raise ClusterError(f"no Dask scheduler answered at {address} within {timeout:g} s: something else "
                           "listens there (a dashboard or web server?); a scheduler's address looks like "
                           "tcp://HOST:8786")
    exc = box.get("error")
    if isinstance(exc, (OSError, TimeoutError)):
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ClusterError(f"cannot reach the Dask scheduler at {address}: {reason}") from exc
    if exc is not None:
        raise ClusterError(f"cannot use {address} as a Dask scheduler: {type(exc).__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc
    return box["client"]


def connect(cluster: str | None = None, scheduler: str | None = None, config: str | None = None,
            n_workers: int | None = None, threads_per_worker: int = 1, timeout: float | None = None,
            wait_workers: float = 300.0, cancel=None, notify=None) -> ClusterHandle:
    """A client on ``scheduler`` (an address such as ``tcp://host:8786``), or on a new
    ``cluster`` ("local" or "slurm", with ``config``). ``cancel`` (a CancelToken) set during
    the start-up raises :class:`~napari_gpuseg.engine.runtime.cancel.Cancelled`, whatever the
    start-up then raised; ``notify(text)`` hears when the wait for a first worker begins."""
    from distributed import Client

    timeout = CONNECT_TIMEOUT_S if timeout is None else timeout
    if scheduler and cluster:
        raise ClusterError(f"give either a cluster to start ({cluster}) or a scheduler address, not both")
    if cluster == "local":
        check_counts(n_workers, threads_per_worker)
    handle = None
    try:
        if scheduler:
            client = _client(scheduler, timeout, cancel)
            handle = ClusterHandle(client, None, [client])
        elif cluster == "local":
            lc = local_cluster(n_workers, threads_per_worker)
            handle = ClusterHandle(None, lc, [lc])
            handle.client = Client(lc)
            handle.owned.append(handle.client)
        elif cluster == "slurm":
            conf = load_cluster_config(config) if config else {}
            slurm_options(conf, str(config or ""))  # bad values: one line, before anything starts
            check_sbatch()
            sc, jobs = slurm_cluster(conf, str(config or ""))
            handle = ClusterHandle(None, sc, [sc])
            sc.scale(jobs=jobs)
            handle.client = Client(sc)
            handle.owned.append(handle.client)
        else:
            raise ClusterError(f"unknown cluster {cluster!r} (use local or slurm, or give --scheduler)")
    except BaseException as exc:
        if handle is not None:  # what started is stopped again
            handle.close()
        if isinstance(exc, Exception) and cancel is not None and cancel.cancelled:
            raise Cancelled("cancelled while the cluster started") from exc  # e.g. Ctrl-C reached the workers
        raise
    _wait_for_workers(handle, wait_workers, cancel, notify, scheduler or cluster)
    return handle


def _wait_for_workers(handle: ClusterHandle, wait_s: float, cancel, notify, where) -> None:
    import time

    end = time.monotonic() + wait_s
    told = False
    try:
        while True:
            if cancel is not None and cancel.cancelled:
                raise Cancelled("cancelled while waiting for workers")
            try:
                handle.client.wait_for_workers(1, timeout=min(1.0, max(0.01, end - time.monotonic())))
                return
            except (OSError, TimeoutError) as exc:
                if time.monotonic() >= end:
                    raise ClusterError(f"no Dask worker joined {where} within {wait_s:g} s") from exc
            if not told and notify is not None:
                told = True
                notify(f"waiting for a Dask worker to join {where} (up to {wait_s:g} s; Ctrl-C stops)")
    except BaseException:
        handle.close()
        raise


@dataclass(frozen=True)
class ClusterSpec:
    """Where a job runs on Dask: a cluster to start (``kind`` "local" or "slurm", with
    ``config``, ``workers``, ``threads_per_worker``) or a scheduler ``address``."""

    kind: str | None = None
    address: str | None = None
    config: str | None = None
    workers: int | None = None
    threads_per_worker: int = 1

    @classmethod
    def of(cls, cluster) -> "ClusterSpec":
        """``"local"``, ``"slurm"``, ``""`` (local) or an address such as ``tcp://host:8786``."""
        if isinstance(cluster, ClusterSpec):
            return cluster
        text = str(cluster).strip()
        if text in ("", "local", "slurm"):
            return cls(kind=text or "local")
        return cls(address=text)


def open_cluster(cluster, cancel=None, notify=None) -> ClusterHandle:
    """A connected :class:`ClusterHandle` for ``cluster``: a ``ClusterSpec``, a text
    (:meth:`ClusterSpec.of`), a ``distributed.Client`` or a ``ClusterHandle`` (neither of the
    last two is closed when the handle is: their owner closes them)."""
    if isinstance(cluster, ClusterHandle):
        return ClusterHandle(cluster.client, cluster.cluster, [])
    if hasattr(cluster, "submit") and hasattr(cluster, "scheduler_info"):  # a distributed.Client
        return ClusterHandle(cluster, None, [])
    spec = ClusterSpec.of(cluster)
    return connect(spec.kind, spec.address, spec.config, spec.workers, spec.threads_per_worker,
                   cancel=cancel, notify=notify)
