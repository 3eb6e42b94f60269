"""What the benchmarks that drive a real napari window share."""
from __future__ import annotations

import time
import weakref


def pump(app, until, timeout: float = 900.0) -> None:
    """Process Qt events until ``until()`` is true (TimeoutError after ``timeout`` s)."""
    t0 = time.perf_counter()
    while not until():
        app.processEvents()
        time.sleep(0.001)
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError
    app.processEvents()


def window_wide_hold(dock):
    """``(start, finish)`` for ``dock.joint_repaint`` as the dock's joint repaint used to work (the
    baseline): the whole window's updates switched off, so that Qt repaints every widget
    of the window when they come back on."""
    from napari_gpuseg.widgets._joint_repaint import napari_window

    redraw = dock.joint_repaint

    def hold():
        if redraw._window is None:
            window = napari_window(dock)
            if window is None or not window.updatesEnabled():
                return
            window.setUpdatesEnabled(False)
            redraw._window = weakref.ref(window)
            redraw.starts += 1
        redraw._timer.start()

    def release():
        ref, redraw._window = redraw._window, None
        redraw._timer.stop()
        window = None if ref is None else ref()
        if window is not None:
            window.setUpdatesEnabled(True)

    return hold, release


def drag(app, viewer, start, end, seconds: float = 0.4, moves: int = 8) -> float:
    """Drag with the left mouse button across the canvas of ``viewer`` from world point
    ``start`` to ``end`` ((row, col) of a 2D view) as a hand does: Qt mouse events into the
    canvas widget (press, ``moves`` moves spread over ``seconds`` while the window's events
    are processed, release), through vispy and napari's own mouse bindings of the active
    layer. Returns ``time.perf_counter()`` just before the release is sent: when the user
    lets go."""
    from qtpy.QtCore import QEvent, QPointF, Qt
    from qtpy.QtGui import QMouseEvent

    canvas = viewer.window._qt_viewer.canvas
    native = canvas._scene_canvas.native
    to_canvas = canvas.view.transform * canvas.view.scene.transform

    def pixel(rc):
        p = to_canvas.map([float(rc[1]), float(rc[0])])
        return QPointF(float(p[0] / p[3]), float(p[1] / p[3]))

    def send(kind, pos, button, buttons):
        app.sendEvent(native, QMouseEvent(kind, pos, native.mapToGlobal(pos), button, buttons,
                                          Qt.KeyboardModifier.NoModifier))

    left, none = Qt.MouseButton.LeftButton, Qt.MouseButton.NoButton
    a, b = pixel(start), pixel(end)
    send(QEvent.Type.MouseButtonPress, a, left, left)
    for k in range(1, moves + 1):
        t_next = time.perf_counter() + seconds / moves
        f = k / moves
        send(QEvent.Type.MouseMove, QPointF(a.x() + f * (b.x() - a.x()), a.y() + f * (b.y() - a.y())), none, left)
        while time.perf_counter() < t_next:
            app.processEvents()
            time.sleep(0.001)
    t_release = time.perf_counter()
    send(QEvent.Type.MouseButtonRelease, b, left, none)
    return t_release
