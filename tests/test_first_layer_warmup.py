"""The annotator pays napari's first-layer work (imports, pint's unit registry, vispy's
visuals, a garbage-collector pass) when it opens, before the first drop, rather than after it."""
import threading

import numpy as np
import pint
import pytest

from napari_gpuseg.widgets import _first_layer

from sam_fixtures import require_lite_medsam

WAIT = 120_000


def test_the_unit_registry_is_built_ahead(monkeypatch):
    # an application registry of the test's own, as a newly started process has it: the
    # process's own one (napari's layers and their units use it) is never swapped
    fresh = pint.registry.ApplicationRegistry(pint.registry.LazyRegistry())
    monkeypatch.setattr(pint, "get_application_registry", lambda: fresh)
    assert type(fresh.get()) is pint.registry.LazyRegistry
    _first_layer.build_unit_registry()
    assert type(fresh.get()) is pint.UnitRegistry
    assert fresh.get().pixel == fresh.get().Unit("pixel")


def test_layer_modules_import_and_a_missing_one_is_skipped(monkeypatch):
    import sys

    monkeypatch.setattr(_first_layer, "LAYER_MODULES", ("scipy.ndimage", "no_such_module_here"))
    _first_layer.import_layer_modules()  # no ImportError for the missing one
    assert "scipy.ndimage" in sys.modules and "no_such_module_here" not in sys.modules


def test_visuals_are_built_once_and_a_failing_one_is_skipped(monkeypatch):
    from vispy.scene import visuals
    from vispy.visuals.line import dash_atlas

    monkeypatch.setattr(_first_layer, "_visuals_built", False)
    made = []
    real_line = visuals.Line

    def line(*args, **kwargs):
        made.append(kwargs.get("method"))
        return real_line(*args, **kwargs)

    monkeypatch.setattr(visuals, "Line", line)
    monkeypatch.setattr(visuals, "Ellipse", lambda *a, **k: 1 / 0)  # a vispy that lacks one
    dash_atlas._make_pattern.cache_clear()
    assert _first_layer.build_visuals() > 0
    assert "agg" in made and "gl" in made
    # the one-off work napari's first anti-aliased line would do is done: its dash patterns
    assert dash_atlas._make_pattern.cache_info().currsize >= 10
    made.clear()
    assert _first_layer.build_visuals() == 0.0 and made == []  # once per process


@pytest.fixture
def warm_steps(monkeypatch):
    """The warm-up's four steps replaced by recorders: (calls in order, thread of each)."""
    calls, threads = [], {}

    def record(what):
        calls.append(what)
        threads[what] = threading.current_thread()
        return 0.0

    monkeypatch.setattr(_first_layer, "build_unit_registry", lambda: record("units"))
    monkeypatch.setattr(_first_layer, "import_layer_modules", lambda: record("imports"))
    monkeypatch.setattr(_first_layer, "build_visuals", lambda: record("visuals"))
    monkeypatch.setattr(_first_layer, "collect_garbage", lambda: record("gc"))
    return calls, threads


@pytest.mark.parametrize("with_image", [False, True])
def test_the_dock_warms_up_in_its_worker_and_builds_units_only_before_any_layer(
        make_napari_viewer, qtbot, warm_steps, with_image):
    require_lite_medsam()
    calls, threads = warm_steps
    viewer = make_napari_viewer()
    if with_image:
        viewer.add_image(np.zeros((64, 64), np.uint16), name="there")
    _dock, w = viewer.window.add_plugin_dock_widget("napari-gpuseg", "SAM annotator")
    qtbot.waitUntil(lambda: "imports" in calls, timeout=WAIT)  # a worker job
    qtbot.wait(50)  # the event loop runs a zero-delay timer by now
    assert calls.count("units") == (0 if with_image else 1)
    assert calls.count("imports") == 1
    assert calls.count("visuals") == 1 and threads["visuals"] is threading.main_thread()
    # imports, then the collector pass, in the dock's worker; pint's registry (built lazily,
    # without a lock) on the GUI thread
    assert threads["imports"] is not threading.main_thread()
    if with_image:  # the first drop is past, and a pass over a full process costs more
        assert "gc" not in calls
    else:
        assert calls.count("gc") == 1 and threads["gc"] is threads["imports"]
        assert calls.index("gc") > calls.index("imports")
    if not with_image:
        assert threads["units"] is threading.main_thread()


@pytest.mark.parametrize("dock_name", ["SAM automatic", "U-Net predict", "Batch folder"])
def test_docks_that_add_a_labels_layer_at_the_end_warm_up_when_they_open(
        make_napari_viewer, qtbot, warm_steps, dock_name):
    """Without it the first labels layer of a process paid napari's imports and visuals when
    the result came in: the window froze 0.7 s at the end of a run (benchmarks/result_stall.py)."""
    calls, threads = warm_steps
    viewer = make_napari_viewer()
    viewer.add_image(np.zeros((64, 64), np.uint16), name="there")  # the usual order: image, then dock
    viewer.window.add_plugin_dock_widget("napari-gpuseg", dock_name)
    qtbot.waitUntil(lambda: "imports" in calls, timeout=WAIT)
    qtbot.wait(50)
    assert calls.count("imports") == 1 and threads["imports"] is not threading.main_thread()
    assert calls.count("visuals") == 1 and threads["visuals"] is threading.main_thread()
    assert "gc" not in calls and "units" not in calls  # past the first drop: nothing else
