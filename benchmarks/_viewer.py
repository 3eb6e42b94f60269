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
