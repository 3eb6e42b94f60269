"""Progress and cancellation shared by every long engine operation."""
from __future__ import annotations

import threading
from typing import Callable, Optional

ProgressFn = Optional[Callable[[int, int], None]]


class Cancelled(Exception):
    """Raised inside a job when its :class:`CancelToken` was cancelled."""


class CancelToken:
    """A thread-safe flag; engine loops call :meth:`check` between steps."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def cancel(self) -> None:
        self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def check(self) -> None:
        if self._event.is_set():
            raise Cancelled("cancelled")


def check(cancel: CancelToken | None) -> None:
    if cancel is not None:
        cancel.check()


def report(progress: ProgressFn, done: int, total: int) -> None:
    if progress is not None:
        progress(done, total)
