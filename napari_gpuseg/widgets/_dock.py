"""The parts every dock shares: a status line, a progress bar (with an optional Cancel
button), a batch-size spin box whose 0 reads "Auto", error reporting and the glue to the
inference worker.

Errors are reported three ways at once: in the dock's status line, as a napari
notification, and through :mod:`logging` (with the traceback when there is one).
"""
from __future__ import annotations

import logging
from typing import Callable

from qtpy.QtCore import QEvent, QObject, QSize, Qt, QTimer
from qtpy.QtWidgets import (QHBoxLayout, QLabel, QMainWindow, QProgressBar, QPushButton, QScrollArea, QSpinBox,
                            QWidget)

from . import _bridge

logger = logging.getLogger("napari_gpuseg.widgets")

AUTO = "Auto"
"""What a batch-size (or tile-size) spin box shows at 0: the engine picks the value."""


def auto_spin(tooltip: str, maximum: int = 256, minimum: int = 0, step: int = 1) -> QSpinBox:
    """A spin box whose lowest value reads "Auto" (0 or ``minimum``: the engine decides)."""
    spin = QSpinBox()
    spin.setRange(minimum, maximum)
    spin.setSingleStep(step)
    spin.setSpecialValueText(AUTO)
    spin.setToolTip(tooltip)
    return spin


def let_go_of_key(viewer, key: str, ours) -> None:
    """Unbind ``key`` from ``viewer`` when it is still bound to ``ours`` (a closed dock's
    binding); a binding another dock made since is kept."""
    current = viewer.bind_key(key, None)
    if current is not None and current is not ours:
        viewer.bind_key(key, current, overwrite=True)


def short_name(name: str, limit: int = 24) -> str:
    """A layer name for a status line: at most ``limit`` characters (a long file name is cut
    in the middle, its start and end kept), so the message keeps to the line's two lines."""
    if len(name) <= limit:
        return name
    head = (limit - 1) // 2
    return f"{name[:head]}…{name[len(name) - (limit - 1 - head):]}"


def notify_error(message: str) -> None:
    """A napari error notification; logged when napari cannot show one."""
    try:
        from napari.utils.notifications import show_error

        show_error(message)
    except Exception:  # noqa: BLE001 - no notification manager: the log keeps the message
        logger.exception("could not show the napari notification %r", message)


class _VerticalScroll(QScrollArea):
    """Scrolls vertically only: as wide as its content plus the scroll bar. When the
    content's layout changes (a longer status text, a row shown), the dock asks for the new
    width at once: Qt's scroll area keeps its old size hint otherwise, and a shown scroll bar
    then covered the right edge of the rows (2-11 px, seen at napari's default window size)."""

    def eventFilter(self, obj, event) -> bool:  # noqa: N802 - Qt name
        if obj is self.widget() and event.type() == QEvent.Type.LayoutRequest:
            self.updateGeometry()
        return super().eventFilter(obj, event)

    def minimumSizeHint(self) -> QSize:  # noqa: N802 - Qt name
        hint = super().minimumSizeHint()
        inner = self.widget()
        if inner is None:
            return hint
        width = inner.minimumSizeHint().width() + self.verticalScrollBar().sizeHint().width() \
            + 2 * self.frameWidth()
        return QSize(max(hint.width(), width), hint.height())


def scrollable(content: QWidget) -> QScrollArea:
    """``content`` in a frameless vertical scroll area, so that a dock sharing the window's
    height with others scrolls instead of squeezing (clipping) its rows."""
    area = _VerticalScroll()
    area.setWidgetResizable(True)
    area.setFrameShape(QScrollArea.Shape.NoFrame)
    area.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
    area.setWidget(content)
    return area


class StatusLabel(QLabel):
    """A word-wrapped status line that keeps the height of two lines of its current font
    (napari's style sheet sets the font after the dock is made), so a message that wraps never
    moves what is under it."""

    LINES = 2

    def __init__(self, text: str = "") -> None:
        super().__init__(text)
        self.setWordWrap(True)
        self.setAlignment(Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignTop)
        self._reserved_for: tuple[str, int] = ("", 0)  # (font, height of LINES lines in it)

    def _reserved(self) -> int:
        """The height this label takes for a text of exactly :attr:`LINES` lines in its
        current font and style, measured on itself (font metrics and margins alone fell 8 px
        short of what a word-wrapped label lays out, so every two-line message moved the bar
        under it)."""
        self.ensurePolished()
        font = self.font().toString()
        if self._reserved_for[0] != font:
            text = self.text()
            super().setText("\n".join(["Ag"] * self.LINES))
            height = QLabel.heightForWidth(self, 10_000)
            super().setText(text)
            self._reserved_for = (font, height)
        return self._reserved_for[1]

    def heightForWidth(self, width: int) -> int:
        return max(super().heightForWidth(width), self._reserved())

    def minimumSizeHint(self) -> QSize:
        hint = super().minimumSizeHint()
        return QSize(hint.width(), max(hint.height(), self._reserved()))

    def sizeHint(self) -> QSize:
        hint = super().sizeHint()
        return QSize(hint.width(), max(hint.height(), self._reserved()))


class _WindowCloseWatch(QObject):
    """Stops a dock when napari's window it sits in closes (the window's close button,
    ``viewer.close()``): napari keeps the dock's widget until Qt deletes the window, and its
    background work (an image's tiles, a folder's next image) would go on until then.

    It watches the dock's outermost holder: napari's window once the dock is in it, and until
    then the holder napari moves into the window (followed when it moves, with no wait for
    Qt's event loop). A shown window's Close counts once the window hides right after it:
    napari's confirm dialog may refuse it, and then the window stays shown. A window never
    shown (``show=False``) closes when told to: napari asks for no confirmation there. A window
    hidden or minimised without a Close stops nothing."""

    def __init__(self, dock: "DockWidget") -> None:
        super().__init__(dock)  # goes with the dock
        self._dock = dock
        self._closing = False
        self.follow()

    def follow(self):
        """Watch the dock's outermost holder now (it moved, or the dock did) and return it.
        Installing the filter again is a no-op. No reference to the window is kept: a closed
        viewer must be free to go."""
        top = self._dock
        while top.parentWidget() is not None:
            top = top.parentWidget()
        if top is not self._dock:
            top.installEventFilter(self)
        return top

    def eventFilter(self, obj, ev) -> bool:  # noqa: N802 - Qt name
        kind = ev.type()
        if kind == QEvent.Type.ParentChange:
            if self.follow() is not obj:  # the holder went into the window: only the window counts now
                obj.removeEventFilter(self)
        elif not isinstance(obj, QMainWindow):
            pass
        elif kind == QEvent.Type.Close and not obj.isVisible():
            self._closed(obj)
        elif kind == QEvent.Type.Close:
            self._closing = True
            QTimer.singleShot(0, self._refused)  # no hide right after it: it was refused
        elif kind == QEvent.Type.Hide and self._closing and not ev.spontaneous():
            self._closed(obj)
        return False

    def _closed(self, window) -> None:
        self._closing = False
        window.removeEventFilter(self)
        self._dock.on_closed()

    def _refused(self) -> None:
        self._closing = False


class DockWidget(QWidget):
    """Base of the docks. Call :meth:`_make_status_parts` (and :meth:`_make_run_buttons`)
    while building the UI and put the widgets they make in the layout."""

    TITLE = "napari-gpuseg"
    """Prefix of the dock's error messages."""

    worker = None  # the docks that submit jobs set their InferenceWorker here
    _docked = False  # in a dock of napari's window (set on the first parent change)
    _window_watch = None  # stops the dock when napari's window closes (made when first docked)

    def event(self, ev) -> bool:  # noqa: N802 - Qt name
        # napari takes a closed dock's widget out of its QDockWidget (parent None) and keeps it
        # until the window closes (its key bindings still refer to it): the dock stops here
        if ev.type() == QEvent.Type.ParentChange:
            if self.parent() is not None:
                self._docked = True
                if self._window_watch is None:
                    self._window_watch = _WindowCloseWatch(self)
                else:
                    self._window_watch.follow()
            elif self._docked:
                self._docked = False
                self.on_closed()
        return super().event(ev)

    def on_closed(self) -> None:
        """The dock was closed (its widget taken out of the window), or napari's window it sat
        in closed: its run is cancelled (:meth:`cancel`: what a run saved so far stays saved).
        Docks with more in the background or keys bound in the viewer stop and let go of them
        here too. Called again when both happen: idempotent."""
        self.cancel()

    def cancel(self) -> None:
        """Cancel the dock's running job, if any (its Cancel button)."""

    def _make_status_parts(self, idle: str = "idle") -> None:
        """``self.status`` (word-wrapped, two lines high) and ``self.progress`` (a bar).

        The status keeps the height of two lines, so a message that wraps (a long image name,
        the tile count added) never moves the bar and the buttons under it."""
        self.status = StatusLabel(idle)
        self.progress = QProgressBar()
        self.progress.setRange(0, 1)

    def _make_run_buttons(self, text: str, run: Callable, cancel: Callable,
                          cancel_enabled: bool = False) -> tuple[QPushButton, QHBoxLayout]:
        """A run button and ``self.cancel_button`` side by side; :meth:`_set_busy` toggles them."""
        self._run_button = QPushButton(text)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setEnabled(cancel_enabled)
        self._run_button.clicked.connect(run)
        self.cancel_button.clicked.connect(cancel)
        row = QHBoxLayout()
        row.addWidget(self._run_button)
        row.addWidget(self.cancel_button)
        return self._run_button, row

    def _set_busy(self, busy: bool, toggle_cancel: bool = True) -> None:
        self._run_button.setEnabled(not busy)
        if toggle_cancel:
            self.cancel_button.setEnabled(busy)

    def _set_status(self, text: str) -> None:
        self.status.setText(text)

    def _on_progress(self, done: int, total: int) -> None:
        total = max(1, total)
        self.progress.setRange(0, total)
        self.progress.setValue(min(done, total))

    def _report_error(self, error: BaseException | str) -> str:
        """Show ``error`` in the status line and as a notification, and log it."""
        if isinstance(error, BaseException):
            msg = f"{self.TITLE}: {error.__class__.__name__}: {error}"
            logger.error(msg, exc_info=(type(error), error, error.__traceback__))
        else:
            msg = f"{self.TITLE}: {error}"
            logger.error(msg)
        self._set_status(msg)
        notify_error(msg)
        return msg

    def _on_error(self, exc: BaseException) -> None:
        self._report_error(exc)

    def _submit_job(self, fn: Callable, *args, **kwargs):
        """Submit to this dock's worker; callbacks run on the GUI thread while the dock exists."""
        return _bridge.submit(fn, *args, worker=self.worker, owner=self, **kwargs)
