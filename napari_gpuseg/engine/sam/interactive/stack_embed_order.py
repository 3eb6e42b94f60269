"""The order in which the views of a stack are embedded in the background.

Both functions are generators for :class:`~napari_gpuseg.engine.runtime.worker.InferenceWorker`
jobs: each step is one encoder batch, and the worker serves prompts between steps.
"""
from __future__ import annotations

from typing import Callable, Hashable, Iterator, Mapping

import numpy as np

from ...runtime.cancel import CancelToken, ProgressFn


def outward(indices, center: tuple) -> list[tuple]:
    """Plane indices ordered from ``center`` outwards: the displayed slice, then its
    neighbours (the nearer first, the lower of two at the same distance first)."""
    center = tuple(center)
    return sorted(indices, key=lambda i: (sum(abs(a - b) for a, b in zip(i, center)), tuple(i)))


def stack_steps(engine, planes: Mapping[tuple, np.ndarray], center: Callable[[], tuple],
                step: int | None = None, done: Callable[[tuple], None] | None = None,
                progress: ProgressFn = None, cancel: CancelToken | None = None,
                ) -> Iterator[int]:
    """Embed every plane of ``planes`` (index -> 2D image) with ``engine``, the plane nearest
    ``center()`` first; ``center`` is asked again after each plane, so moving through the
    stack re-orders what is left. Returns {index: prepared image}; ``done(index)`` after each."""
    out: dict[Hashable, object] = {}
    left = list(planes)
    while left:
        i = outward(left, center() or ())[0]
        left.remove(i)
        out[i] = yield from engine.embed_steps(planes[i], step=step, cancel=cancel)
        if done is not None:
            done(i)
        if progress:
            progress(len(out), len(planes))
    return out
