"""One loaded method per worker process: dask workers (and the in-process runner) keep
each method they load, so a model loads once per worker, not once per task (the check
that runs on every worker before a job loads it, and the tasks reuse it).

GUI-free. Used by the Dask folder runner and by blocks of big images.
"""
from __future__ import annotations

import threading
from typing import Callable

_lock = threading.RLock()  # a method's load may ask for a shared engine (shared_sam_engine)
_local: dict = {}


def worker_device(preferred: str | None = None) -> str:
    """The device of this worker: ``preferred`` when given (not "auto"); else, inside a
    dask worker on a machine with GPUs, GPU ``name % count`` (one LocalCluster worker per
    GPU); else the best device of the process."""
    if preferred and preferred != "auto":
        return preferred
    import torch

    if torch.cuda.is_available():
        try:
            from distributed import get_worker

            name = get_worker().name
            index = int(name) if str(name).isdigit() else 0
        except (ImportError, ValueError):
            index = 0
        return f"cuda:{index % torch.cuda.device_count()}"
    from ..runtime.device import get_policy

    return str(get_policy().device)


def cached_method(key: tuple, make: Callable[[], object]):
    """The object ``make()`` built for ``key`` in this process (built on first use)."""
    with _lock:
        if key not in _local:
            _local[key] = make()
        return _local[key]


def shared_sam_engine(model, policy):
    """One SAM engine per model, device and precision in this worker process: every SAM
    method and option set the worker serves shares its weights and embeddings (each used to
    load its own copy and keep it)."""
    from ..sam.loader import load_engine

    key = ("sam-engine", str(model), str(policy.device), policy.precision)
    return cached_method(key, lambda: load_engine(model, policy=policy))


def loaded_keys() -> list:
    """The keys of what this process keeps (tests, diagnostics)."""
    with _lock:
        return list(_local)


def clear() -> None:
    """Forget the methods of this process (tests)."""
    with _lock:
        _local.clear()
