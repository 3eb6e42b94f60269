"""Batch-size profiler: sweep sizes, measure items/s and peak memory, recommend one.

Works for any model step: ``step(batch)`` runs the network on a batch made by
``make_batch(size)``. The sweep stops at the first out-of-memory error; the
recommendation is the fastest size whose peak memory leaves ``headroom`` of the card free.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import psutil
import torch

from .batching import is_oom, remember_batch_size
from .cancel import CancelToken, ProgressFn, check, report
from .memory import empty_cache


@dataclass
class ProfilePoint:
    batch_size: int
    items_per_s: float
    peak_bytes: int
    seconds: float


@dataclass
class ProfileResult:
    points: list[ProfilePoint] = field(default_factory=list)
    oom_at: int | None = None
    recommended: int = 1
    limit_bytes: int | None = None

    def table(self) -> str:
        rows = ["batch  items/s   peak MiB"]
        for p in self.points:
            rows.append(f"{p.batch_size:5d}  {p.items_per_s:7.2f}  {p.peak_bytes / 2**20:9.1f}")
        if self.oom_at:
            rows.append(f"{self.oom_at:5d}  out of memory")
        rows.append(f"recommended: {self.recommended}")
        return "\n".join(rows)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_batch_sizes(
    step: Callable[[Any], Any],
    make_batch: Callable[[int], Any],
    sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
    device: torch.device | str = "cpu",
    repeats: int = 2,
    warmup: int = 1,
    headroom: float = 0.15,
    key: Any = None,
    progress: ProgressFn = None,
    cancel: CancelToken | None = None,
) -> ProfileResult:
    """Sweep ``sizes``; return measurements and the recommended batch size.

    ``headroom`` is the fraction of device memory (GPU) or system RAM (CPU) that the
    recommended size must leave free. When ``key`` is given, the recommendation is stored
    as the remembered batch size for that key (what the batch runner starts from).
    """
    device = torch.device(device)
    if device.type == "cuda":
        _free, limit = torch.cuda.mem_get_info(device)  # the card's total
    else:
        limit = psutil.virtual_memory().total
    result = ProfileResult(limit_bytes=limit)
    for i, size in enumerate(sizes):
        check(cancel)
        try:
            batch = make_batch(size)
            with torch.inference_mode():
                for _ in range(warmup):
                    step(batch)
                _sync(device)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                    base = 0
                else:
                    base = psutil.Process().memory_info().rss
                t0 = time.perf_counter()
                for _ in range(repeats):
                    step(batch)
                _sync(device)
                dt = (time.perf_counter() - t0) / repeats
            if device.type == "cuda":
                peak = torch.cuda.max_memory_allocated(device)
            else:
                peak = max(0, psutil.Process().memory_info().rss - base) + _nbytes(batch)
            result.points.append(ProfilePoint(size, size / dt, int(peak), dt))
        except Exception as exc:  # noqa: BLE001
            if not is_oom(exc):
                raise
            result.oom_at = size
        finally:
            report(progress, i + 1, len(sizes))
        if result.oom_at is not None:  # outside the except block: the failed batch is freed
            batch = None
            empty_cache(device)
            break
    fitting = [p for p in result.points if p.peak_bytes <= (1 - headroom) * limit]
    if fitting:
        result.recommended = max(fitting, key=lambda p: p.items_per_s).batch_size
    if key is not None:
        remember_batch_size(key, result.recommended)
    return result


def _nbytes(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.numel() * batch.element_size()
    return 0
