import os
import warnings
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402

from napari_gpuseg.engine.runtime.allocator import configure_allocator  # noqa: E402

# The tests run the engine in this process, as a script does. Give it the allocator set-up
# the CLI and the plugin's workers use on a CPU (README, *Use from Python*); otherwise a test's
# speed depends on whether a worker ran earlier in the session. The allocator tests keep
# their own state. The encoder-heavy files ran 13 % faster (114 -> 99 s, 2-core AVX2 EPYC).
configure_allocator()


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# pytest-xdist workers share the machine's cores: each gets its part, at most OMP_NUM_THREADS.
# Two workers with two torch threads each on 2 cores spend their time waiting for each other
# (OpenMP threads spin at every barrier): the encoder-heavy files took 140-172 s that way and
# 83 s with one thread per worker (test_box_field, test_click_decoding, test_crop_look; -n 2,
# 2-core AVX2 EPYC).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
if _WORKERS > 1:  # this process's torch, and the environment its subprocesses inherit
    import torch  # noqa: E402

    _threads = max(1, min(int(os.environ["OMP_NUM_THREADS"]), _cores() // _WORKERS))
    os.environ["OMP_NUM_THREADS"] = str(_threads)
    torch.set_num_threads(_threads)

# Full garbage-collector passes are frequent in this suite: napari 0.9 runs one for every layer
# it removes (a Windows OpenGL workaround in ``VispyCanvas._clean_and_update_scenegraph``; a
# viewer's tear-down removes each layer), the annotator dock runs one when it opens on an empty
# viewer (its first-layer warm-up) and one when it switches models, and the viewer tests run
# one before each viewer. Each pass walks every object the process holds: with torch, napari,
# Qt and the test modules imported, about 0.2 s. Once the tests are collected, the modules a
# viewer test imports are imported too and everything alive is frozen (``gc.freeze``): those
# objects live as long as the process anyway, and later passes walk only what the tests made.
# Before this, about 200 s of the suite's test time went to these passes (py-spy, 2-core AVX2
# EPYC). No viewer exists yet at that point, so napari's check that each test's viewers are
# collected still sees every one of them.
_FROZEN_MODULES = ("napari._qt.qt_main_window", "napari._qt.qt_viewer", "napari._vispy.canvas",
                   "napari.layers", "napari.viewer", "vispy.scene")


def pytest_collection_finish(session):
    import gc
    import importlib
    import pkgutil

    try:
        for name in _FROZEN_MODULES:
            importlib.import_module(name)
        import napari_gpuseg.widgets as widgets

        for info in pkgutil.iter_modules(widgets.__path__, widgets.__name__ + "."):
            importlib.import_module(info.name)
    except ImportError:  # the GUI-free run at the lowest torch has no napari or Qt
        pass
    gc.collect()
    gc.freeze()


SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
if not SHARED_DATA.exists():  # CI clones next to ../shared as well; allow an override
    SHARED_DATA = Path(os.environ.get("NAPARI_GPUSEG_SHARED_DATA", SHARED_DATA))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.exists():
        pytest.fail(f"real test data not found at {SHARED_DATA} (set NAPARI_GPUSEG_SHARED_DATA)")
    return SHARED_DATA


@pytest.fixture
def reuse_embeddings(tmp_path_factory):
    """The test's encoder outputs shared with the other opted-in tests of the run
    (``tests/encoder_memo.py`` says which tests opt in and why)."""
    import encoder_memo

    folder = os.environ.get("GPUSEG_TEST_ENCODER_MEMO")  # a folder kept between runs (a test must
    if folder == "off":                                 # pass with every output read back), or off
        yield
        return
    if not folder:
        root = tmp_path_factory.getbasetemp()
        if os.environ.get("PYTEST_XDIST_WORKER"):  # one folder for every test process of the run
            root = root.parent
        folder = root / "encoder_memo"
    encoder_memo.use(Path(folder))
    yield
    encoder_memo.use(None)


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
    """napari's OpenGL facts asked once per process, before its first viewer, and kept only
    when they are real answers (tests/_gl_facts.py says why)."""
    global _gl_facts_asked
    if _gl_facts_asked:
        return
    _gl_facts_asked = True
    request.getfixturevalue("qapp")  # pytest-qt's application, the one the viewers use
    from qtpy.QtWidgets import QApplication

    from _gl_facts import ask_gl_facts

    ask_gl_facts(process_events=QApplication.processEvents)


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

