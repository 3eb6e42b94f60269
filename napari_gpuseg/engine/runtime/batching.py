"""Adaptive batching: split work into batches, back off on out-of-memory, keep order.

``run_batched(fn, items)`` calls ``fn`` on consecutive slices of ``items`` (a list or a
tensor whose first dimension indexes items) and returns the per-item results in input
order. On ``torch.cuda.OutOfMemoryError`` (or any ``torch.OutOfMemoryError``) the batch
size is halved and the failed batch retried, so no item is lost. CUBLAS/cuDNN allocation
failures count as out-of-memory too. The size that worked is remembered per ``key`` (for
example ``(model_name, input_shape, device)``: include the device, two GPUs differ) for
the next call.

On the CPU, for a keyed run with no size given and none remembered, the size is measured
instead, then remembered like any other: one item per call first, then twice as many while
that is at least 10 % faster per item (:class:`CpuSizeProbe`). A bigger batch is often
slower per item on a CPU (its activations leave the caches), so the probe settles where this
CPU is fastest. A run that ends before the probe settles remembers nothing.
"""
from __future__ import annotations

import math
import threading
import time
from typing import Any, Callable, Hashable, Iterator, Sequence

import torch

from .cancel import CancelToken, ProgressFn, check, report
from .memory import empty_cache, free_bytes

_OOM_TYPES: tuple[type[BaseException], ...] = tuple(
    t for t in (getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None)) if t
)

DEFAULT_CPU_BATCH = 4
MAX_BATCH = 256
PROBE_GAIN = 0.9  # a doubled CPU batch is kept when it costs at most this much per item

_memory: dict[Hashable, int] = {}
_memory_lock = threading.Lock()


# allocation failures inside CUDA libraries surface as plain RuntimeErrors with these texts
_OOM_TEXTS = ("out of memory", "cublas_status_alloc_failed", "cudnn_status_alloc_failed",
              "cudnn_status_not_enough_workspace", "cusolver_status_alloc_failed",
              "cufft_alloc_failed")


def is_oom(exc: BaseException) -> bool:
    if _OOM_TYPES and isinstance(exc, _OOM_TYPES):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(t in text for t in _OOM_TEXTS)


def remembered_batch_size(key: Hashable) -> int | None:
    with _memory_lock:
        return _memory.get(key)


def remember_batch_size(key: Hashable, size: int) -> None:
    with _memory_lock:
        _memory[key] = int(size)


def forget_batch_sizes() -> None:
    with _memory_lock:
        _memory.clear()


def initial_batch_size(
    n_items: int,
    device: torch.device | str = "cpu",
    item_bytes: int | None = None,
    headroom: float = 0.7,
    max_batch: int = MAX_BATCH,
) -> int:
    """A starting batch size from free device memory and the per-item footprint."""
    device = torch.device(device)
    if device.type == "cuda" and item_bytes:
        size = int(free_bytes(device) * headroom // max(1, item_bytes))
    elif device.type == "cuda":
        size = 16
    else:
        size = DEFAULT_CPU_BATCH
    return max(1, min(size, max_batch, max(1, n_items)))


def _take(items: Any, start: int, stop: int) -> Any:
    return items[start:stop]


def _split(result: Any, n: int) -> list:
    """Turn one batch result into a list of ``n`` per-item results."""
    if isinstance(result, torch.Tensor):
        return list(result.unbind(0)) if n else []
    if isinstance(result, tuple) and result and all(isinstance(r, torch.Tensor) for r in result):
        parts = [r.unbind(0) for r in result]
        return [tuple(p[i] for p in parts) for i in range(n)]
    result = list(result)
    if len(result) != n:
        raise ValueError(f"batch function returned {len(result)} results for {n} items")
    return result


def to_device(batch: Any, device: torch.device, pin: bool = True) -> Any:
    """Copy a CPU tensor to ``device``: pinned host memory and non_blocking on CUDA."""
    if not isinstance(batch, torch.Tensor) or batch.device == device:
        return batch
    if device.type == "cuda":
        if pin and batch.device.type == "cpu" and not batch.is_pinned():
            batch = batch.pin_memory()
        return batch.to(device, non_blocking=True)
    return batch.to(device)


class CpuSizeProbe:
    """Picks a CPU batch size from the time per item of the calls that do the work.

    Size 1 is timed twice (a first call pays one-time setup), then each doubling once; it
    doubles while the new size costs at most ``PROBE_GAIN`` times the best time per item so
    far, and otherwise settles at the best size. No call is made for the measurement alone.
    """

    def __init__(self, limit: int):
        self.limit = max(1, limit)
        self.best: tuple[float, int] | None = None  # (seconds per item, size)
        self.size, self.ones, self.done = 1, 0, False

    def record(self, size: int, seconds: float) -> int:
        """The time of one call of ``size`` items; returns the size for the next call."""
        if self.done:
            return self.size
        per_item = seconds / max(1, size)
        if size == 1:
            self.ones += 1
            if self.best is None or per_item < self.best[0]:
                self.best = (per_item, 1)
            if self.ones < 2:
                return 1  # size 1 once more, past the first call's setup
        elif per_item <= PROBE_GAIN * self.best[0]:
            self.best = (per_item, size)
        else:
            return self._settle()
        nxt = min(self.limit, 2 * size)
        if nxt == size:
            return self._settle()
        self.size = nxt
        return nxt

    def _settle(self) -> int:
        self.done, self.size = True, self.best[1]
        return self.size


class BatchRunner:
    """Runs ``fn`` over items in adaptive batches. See module docstring."""

    def __init__(
        self,
        batch_size: int | None = None,
        key: Hashable | None = None,
        device: torch.device | str = "cpu",
        item_bytes: int | None = None,
        max_batch: int = MAX_BATCH,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.user_batch_size = batch_size
        self.clock = clock
        self.probe: CpuSizeProbe | None = None
        self.key = key
        self.device = torch.device(device)
        self.item_bytes = item_bytes
        self.max_batch = max_batch
        self.oom_events = 0
        self.batch_size: int | None = None

    def _start_size(self, n: int) -> int:
        if self.user_batch_size:
            return max(1, int(self.user_batch_size))
        if self.key is not None:
            known = remembered_batch_size(self.key)
            if known:
                return known
        if self.device.type == "cpu" and self.key is not None and n > 2:
            self.probe = CpuSizeProbe(min(n, self.max_batch))
            return 1
        return initial_batch_size(n, self.device, self.item_bytes, max_batch=self.max_batch)

    def iter(
        self,
        fn: Callable[[Any], Any],
        items: Sequence | torch.Tensor,
        progress: ProgressFn = None,
        cancel: CancelToken | None = None,
    ) -> Iterator[Any]:
        """Yield per-item results in input order."""
        n = len(items)
        size = self._start_size(n)
        self.batch_size = size
        done = 0
        report(progress, 0, n)
        while done < n:
            check(cancel)
            stop = min(n, done + size)
            oom = False
            started = self.clock()
            try:
                out = fn(_take(items, done, stop))
                results = _split(out, stop - done)
            except Exception as exc:  # noqa: BLE001 - re-raised unless OOM
                if not is_oom(exc) or size == 1:
                    raise
                oom = True
            if oom:  # outside the except block: the traceback (and the failed batch) is gone
                out = results = None
                self.oom_events += 1
                empty_cache(self.device)
                size = max(1, size // 2)
                self.batch_size = size
                self.probe = None  # memory decides from here
                continue  # retry the same items with a smaller batch
            if self.probe is not None:
                size = self.probe.record(stop - done, self.clock() - started)
                self.batch_size = size
                if self.probe.done:
                    self.probe = None
                    if self.key is not None:
                        remember_batch_size(self.key, size)
            elif self.key is not None:
                remember_batch_size(self.key, size)
            yield from results
            done = stop
            report(progress, done, n)

    def run(self, fn, items, progress: ProgressFn = None, cancel: CancelToken | None = None) -> list:
        return list(self.iter(fn, items, progress=progress, cancel=cancel))


def run_batched(
    fn: Callable[[Any], Any],
    items: Sequence | torch.Tensor,
    batch_size: int | None = None,
    key: Hashable | None = None,
    device: torch.device | str = "cpu",
    item_bytes: int | None = None,
    progress: ProgressFn = None,
    cancel: CancelToken | None = None,
) -> list:
    """Functional form of :class:`BatchRunner`; returns a list in input order."""
    runner = BatchRunner(batch_size=batch_size, key=key, device=device, item_bytes=item_bytes)
    return runner.run(fn, items, progress=progress, cancel=cancel)


def n_batches(n: int, size: int) -> int:
    return math.ceil(n / max(1, size))
