"""Show a prompt and its preview mask in one repaint of the napari window.

A prompt edit makes napari repaint at once (the new box, the layer list's thumbnails),
and the preview mask arrives a few tens of milliseconds later and needs a second repaint.
Where the window is drawn in software (no GPU-backed display: remote desktops, VMs,
Xvfb), each repaint costs tens of ms on the GUI thread. PyQt keeps the GIL through Qt's
own painting, so the decoder in the worker thread stalls meanwhile and the mask shows
late. :class:`JointRepaint` gathers the window's repaints from the edit
(:meth:`~JointRepaint.start`) until the preview is shown (:meth:`~JointRepaint.finish`), or at
most ``max_ms``, and then one repaint shows everything. Events are still processed
meanwhile (nothing is lost, only drawn later), and a slow decoder never hides the user's
prompt for longer than ``max_ms``.

It keeps back the window's update requests (the event Qt's repaint manager posts to a
top-level window to paint what is dirty) rather than switching the window's updates off:
Qt keeps the dirty regions meanwhile, so the one repaint covers the canvas and the few
widgets that changed, not every widget of the window. (The worker's *background hold*,
:meth:`~napari_gpuseg.engine.runtime.worker.InferenceWorker.hold_background`, is another
thing: background embedding waiting while a prompt is decoded.)
"""
from __future__ import annotations

import logging
import weakref

from qtpy.QtCore import QCoreApplication, QEvent, QObject, Qt, QTimer
from qtpy.QtWidgets import QMainWindow, QWidget

logger = logging.getLogger(__name__)

JOINT_REPAINT_MAX_MS = 120  # the longest a prompt edit waits to be painted


def napari_window(dock: QWidget) -> QMainWindow | None:
    """The main window ``dock`` is docked in (floating or not) when it holds a vispy
    canvas (napari's), else None: not docked yet, closed, or no napari window."""
    try:
        top = dock
        while top.parentWidget() is not None:
            top = top.parentWidget()
        if not isinstance(top, QMainWindow) or top.centralWidget() is None:
            return None
        if not any(hasattr(w, "_vispy_canvas") for w in top.centralWidget().findChildren(QWidget)):
            return None
    except RuntimeError:  # the C++ side was deleted
        return None
    return top


class _KeepUpdateRequests(QObject):
    """Event filter that keeps a window's update requests back while installed."""

    def __init__(self) -> None:
        super().__init__()
        self.kept = 0

    def eventFilter(self, obj, event) -> bool:  # noqa: N802 (Qt's name)
        if event.type() == QEvent.Type.UpdateRequest:
            self.kept += 1
            return True
        return False


class JointRepaint:
    """Gathers the repaints of the napari window that ``dock`` is docked in into one."""

    def __init__(self, dock: QWidget, max_ms: int = JOINT_REPAINT_MAX_MS) -> None:
        self._dock = weakref.ref(dock)
        self._window: weakref.ref | None = None  # never keeps a closed viewer alive
        self._timer = QTimer()
        self._timer.setSingleShot(True)
        self._timer.setInterval(max_ms)
        self._timer.timeout.connect(self._on_timeout)
        self._filter = _KeepUpdateRequests()
        self.enabled = True
        self.starts = self.timeouts = 0  # for tests and benchmarks

    @property
    def gathering(self) -> bool:
        return self._window is not None

    def start(self) -> None:
        """Keep the window's repaints back (again) for at most ``max_ms`` from now."""
        if not self.enabled:
            return
        if self._window is None:
            dock = self._dock()
            window = None if dock is None else napari_window(dock)
            if window is None or not window.updatesEnabled():
                return
            self._filter.kept = 0
            window.installEventFilter(self._filter)
            self._window = weakref.ref(window)
            self.starts += 1
        self._timer.start()

    def finish(self) -> None:
        """Repaint what changed since :meth:`start`: one update request for the window, posted at
        Qt's own (low) priority, so input and timers queued before it still come first."""
        ref, self._window = self._window, None
        try:
            self._timer.stop()
            window = None if ref is None else ref()
            if window is not None:
                window.removeEventFilter(self._filter)
                if self._filter.kept:  # Qt sends no new request until this one is served
                    QCoreApplication.postEvent(window, QEvent(QEvent.Type.UpdateRequest),
                                               _LOW_PRIORITY)
        except RuntimeError:  # the viewer was closed meanwhile
            logger.debug("joint repaint finished after its window was deleted")

    def _on_timeout(self) -> None:
        self.timeouts += 1
        self.finish()


class PostedCall(QObject):
    """Calls ``fn`` from the GUI thread's event queue: posted at ``priority``, so after what
    is queued before it at that priority or higher. With ``coalesce``, posts made before
    the call runs are served by one call."""

    def __init__(self, fn, parent=None, priority: int | None = None, coalesce: bool = True) -> None:
        super().__init__(parent)
        self._fn = fn
        self._priority = _NORMAL_PRIORITY if priority is None else priority
        self._coalesce = coalesce
        self._pending = False

    def post(self) -> None:
        if not (self._coalesce and self._pending):
            self._pending = True
            QCoreApplication.postEvent(self, QEvent(QEvent.Type.User), self._priority)

    def event(self, ev) -> bool:
        if ev.type() == QEvent.Type.User:
            self._pending = False
            self._fn()
            return True
        return super().event(ev)


class AfterRepaint(PostedCall):
    """Calls ``fn`` once the GUI thread has processed what is queued before it, the
    window's pending repaint included: Qt posts a repaint at low priority, and a low
    priority event posted after it comes after it (a zero-delay timer comes before)."""

    def __init__(self, fn, parent=None) -> None:
        super().__init__(fn, parent, _LOW_PRIORITY, coalesce=False)  # one call per repaint


_LOW_PRIORITY = getattr(Qt.EventPriority.LowEventPriority, "value", Qt.EventPriority.LowEventPriority)
_NORMAL_PRIORITY = getattr(Qt.EventPriority.NormalEventPriority, "value", Qt.EventPriority.NormalEventPriority)
