"""A queued call of the inference worker (:mod:`.worker`): its priority, state, result and
callbacks. Thread-safe: ``cancel()``, ``wait()``, ``result()`` from any thread."""
from __future__ import annotations

import inspect
import itertools
import threading
import traceback
from typing import Any, Callable

from .cancel import Cancelled, CancelToken

PENDING, RUNNING, DONE, FAILED, CANCELLED = "pending", "running", "done", "failed", "cancelled"


INTERACTIVE, NORMAL, BACKGROUND, IDLE = 0, 10, 20, 30
"""Priorities (lower runs first): a prompt's decode (and the one embedding it needs),
user-started work, the rest of an image's views and decoder warm-ups, stack precompute."""


class Job:
    """A queued call. Thread-safe: ``cancel()``, ``wait()``, ``result()`` from any thread.

    A function that returns a generator runs one step (up to its next ``yield``) at a time:
    between steps the worker serves queued jobs of higher priority first."""

    _ids = itertools.count(1)

    def __init__(self, fn, args, kwargs, tag=None, inference=True,
                 on_result=None, on_error=None, on_progress=None, on_cancelled=None,
                 priority: int = NORMAL, hold_after: float = 0.0, defer=None):
        self.id = next(Job._ids)
        self.hold_after = hold_after  # seconds of background hold once it ends
        # asked at a pause point (worker thread): True leaves the job queued until the
        # interrupted work reaches its next step or ends (the job waits for its result)
        self.defer = defer
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.tag = tag
        self.inference = inference
        self.priority = priority
        self.token = CancelToken()
        self.status = PENDING
        self.value: Any = None
        self.error: BaseException | None = None
        self.seconds: float | None = None
        self.on_result, self.on_error = on_result, on_error
        self.on_progress, self.on_cancelled = on_progress, on_cancelled
        self._gen = None  # the running generator of a stepped job
        self._seq = 0
        self._done = threading.Event()

    def cancel(self) -> None:
        self.token.cancel()

    @property
    def cancelled(self) -> bool:
        return self.token.cancelled

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def result(self, timeout: float | None = None) -> Any:
        if not self._done.wait(timeout):
            raise TimeoutError(f"job {self.id} did not finish in {timeout} s")
        if self.status == CANCELLED:
            raise Cancelled(f"job {self.id} was cancelled")
        if self.error is not None:
            raise self.error
        return self.value

    def _progress(self, done: int, total: int) -> None:
        self.token.check()
        if self.on_progress is not None:
            self.on_progress(done, total)


def accepts_keyword(fn: Callable, name: str) -> bool:
    """Whether ``fn`` takes the keyword argument ``name`` (or any keyword)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def release_frames(exc: BaseException) -> None:
    """Drop the local variables of the finished frames in ``exc``'s traceback (and in those
    of the exceptions it was raised from). A failed job keeps its exception for
    :meth:`Job.result` and the docks keep the job; without this its frames would keep the
    job's tensors (weights, optimizer state, activations: GPU memory after an OOM) alive,
    and a retry would run out of memory too. File, line and function names stay."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if exc.__traceback__ is not None:
            traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__
