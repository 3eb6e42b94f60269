"""Deliver :class:`~napari_gpuseg.engine.runtime.worker.InferenceWorker` callbacks on the Qt thread."""
from __future__ import annotations

from typing import Any, Callable

from qtpy.QtCore import QObject, Qt, Signal

from ..engine.runtime.worker import InferenceWorker, Job, default_worker


class _Relay(QObject):
    call = Signal(object, tuple)

    def __init__(self) -> None:
        super().__init__()
        self.call.connect(self._run, Qt.ConnectionType.QueuedConnection)

    def _run(self, fn: Callable, args: tuple) -> None:
        fn(*args)


_relay: _Relay | None = None


def relay() -> _Relay:
    """Created on first use, which must be on the GUI thread."""
    global _relay
    if _relay is None:
        _relay = _Relay()
    return _relay


def alive(obj: QObject | None) -> bool:
    """False once the C++ side of a Qt object was deleted (a closed dock, say)."""
    if obj is None:
        return True
    try:
        obj.objectName()
    except RuntimeError:
        return False
    return True


def _on_gui(fn: Callable | None, owner: QObject | None) -> Callable | None:
    if fn is None:
        return None
    r = relay()

    def guarded(*args: Any) -> None:
        if alive(owner):
            fn(*args)

    def forward(*args: Any) -> None:
        r.call.emit(guarded, args)

    return forward


def on_gui(fn: Callable, owner: QObject | None = None) -> Callable:
    """``fn`` called from any thread runs on the GUI thread, and only while ``owner`` exists
    (a training job's per-step events, say)."""
    return _on_gui(fn, owner)


def submit(fn: Callable, *args, worker: InferenceWorker | None = None, owner: QObject | None = None,
           on_result=None, on_error=None, on_progress=None, on_cancelled=None, **kwargs) -> Job:
    """Submit to the worker; every callback runs on the GUI thread, and only while ``owner``
    (the dock that asked) still exists."""
    worker = worker or default_worker()
    return worker.submit(
        fn, *args,
        on_result=_on_gui(on_result, owner), on_error=_on_gui(on_error, owner),
        on_progress=_on_gui(on_progress, owner), on_cancelled=_on_gui(on_cancelled, owner),
        **kwargs,
    )
