import os
import warnings
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
# the annotator's second encoder process (a CPU's first tile after a drop) is started by the
# tests of it (test_encoder_process.py), not by every dock a test opens
os.environ.setdefault("NAPARI_GPUSEG_ENCODER_PROCESS", "0")

import pytest  # noqa: E402

from napari_gpuseg.engine.runtime.allocator import configure_allocator  # noqa: E402

# The tests run the engine in this process, as a script does. Give it the allocator set-up
# the CLI and the plugin's workers use on a CPU (README, *Use from Python*); otherwise a test's
# speed depends on whether a worker ran earlier in the session. The allocator tests keep
# their own state. The encoder-heavy files ran 13 % faster (114 -> 99 s, 2-core AVX2 EPYC).
configure_allocator()

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
if not SHARED_DATA.exists():  # CI clones next to ../shared as well; allow an override
    SHARED_DATA = Path(os.environ.get("NAPARI_GPUSEG_SHARED_DATA", SHARED_DATA))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.exists():
        pytest.fail(f"real test data not found at {SHARED_DATA} (set NAPARI_GPUSEG_SHARED_DATA)")
    return SHARED_DATA


@pytest.fixture
def cpu_policy():
    from napari_gpuseg.engine.runtime.device import Policy
    import torch

    return Policy(torch.device("cpu"), "fp32")


def _close_leaked_viewers() -> int:
    """Close the napari viewers an earlier test's teardown left open; returns how many."""
    import gc
    import sys

    if "napari._qt.qt_viewer" not in sys.modules:
        return 0
    from napari._qt.qt_viewer import QtViewer
    from qtpy.QtWidgets import QApplication

    leaked = list(QtViewer._instances)
    for qt_viewer in leaked:
        try:
            qt_viewer.viewer.window.close()
        except Exception:  # noqa: BLE001 - its own test has reported why it broke
            pass
    QApplication.processEvents()
    gc.collect()
    QtViewer._instances.clear()
    return len(leaked)


_gl_facts_asked = False


def _ask_gl_facts_once(request) -> None:
    """Have napari ask OpenGL for its extensions and texture sizes once per process, before
    the first viewer.

    napari asks the first time a process makes an image layer and caches only an answer. Under
    the offscreen Qt platform the question sometimes met no current context: between tests (a
    closed viewer's canvas still listed as vispy's current one) and, in some pytest-xdist
    workers, from the process's start (no try in that process ever got an answer).
    ``glGetString`` then returned nothing, and every image layer of that worker failed (the
    layer never reached the canvas, the viewer could not be closed: 18 failed tests and 35
    errors in one CI run). So: napari's own question first (it makes a hidden canvas when
    none exists), then tries with a hidden vispy canvas of our own (vispy makes its offscreen
    context current). A process where every try fails has no OpenGL to draw with anyway
    (offscreen draws nothing): its image layers get napari's answer for a GPU without float
    textures, with a warning, instead of failing."""
    global _gl_facts_asked
    if _gl_facts_asked:
        return
    _gl_facts_asked = True
    request.getfixturevalue("qapp")  # pytest-qt's application, the one the viewers use
    import time

    from napari._vispy.layers import image as napari_image
    from napari._vispy.utils import gl as napari_gl
    from qtpy.QtWidgets import QApplication
    from vispy.app import Canvas

    error = None
    for attempt in range(4):
        canvas = Canvas(show=False) if attempt else None  # napari's own path first
        try:
            napari_gl.get_gl_extensions()
            napari_gl.get_max_texture_sizes()
            return
        except Exception as exc:  # noqa: BLE001 - asked again below
            error = exc
        finally:
            if canvas is not None:
                canvas.close()
        QApplication.processEvents()
        time.sleep(0.2)
    napari_image.get_gl_extensions = lambda: ""  # before the warning: `-W error` raises there
    warnings.warn(f"no OpenGL context in this test process ({error!r}): image layers are made "
                  "as for a GPU without float textures", stacklevel=1)


@pytest.fixture(autouse=True)
def _no_viewer_left_behind(request):
    """Before a viewer test: napari's OpenGL facts asked once (:func:`_ask_gl_facts_once`),
    and a viewer whose test's teardown failed (that test reports it) closed, so that one
    broken teardown fails one test, not every viewer test after it in that worker (napari's
    fixture refuses to start while one is left)."""
    if "make_napari_viewer" in request.fixturenames:
        _ask_gl_facts_once(request)
        n = _close_leaked_viewers()
        if n:
            warnings.warn(f"{n} napari viewer(s) left open by an earlier test were closed", stacklevel=1)
    yield
