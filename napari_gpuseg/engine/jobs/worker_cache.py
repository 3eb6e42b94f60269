"""One loaded method per worker process: dask workers (and the in-process runner) keep
each method they load, so a model loads once per worker, not once per task (the check
that runs on every worker before a job loads it, and the tasks reuse it).

GUI-free. Used by the Dask folder runner and by blocks of big images.
"""
from __future__ import annotations

import threading
from typing import Callable

_lock = threading.Lock()
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


def clear() -> None:
    """Forget the methods of this process (tests)."""
    with _lock:
        _local.clear()
