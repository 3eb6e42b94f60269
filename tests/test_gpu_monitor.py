import numpy as np

from napari_gpuseg.widgets.gpu_monitor import GpuMonitorWidget


def test_monitor_dock_on_real_viewer(make_napari_viewer, qtbot):
    viewer = make_napari_viewer()
    viewer.add_image(np.zeros((8, 8)))
    dock, widget = viewer.window.add_plugin_dock_widget("napari-gpuseg", "GPU monitor")
    assert isinstance(widget, GpuMonitorWidget)
    assert "CPU" in widget.device_label.text()
    first = len(widget.plot.series["process RSS MiB"])
    qtbot.waitUntil(lambda: len(widget.plot.series["process RSS MiB"]) >= first + 2, timeout=3000)
    assert "MiB" in widget.fields["rss"].text() or "GiB" in widget.fields["rss"].text()
    assert widget.last.process_rss > 0
    assert not widget.reset_button.isEnabled()  # nothing to reset on CPU
    widget.close()
    assert not widget.timer.isActive()


def test_refresh_is_cheap(qtbot):
    import time

    w = GpuMonitorWidget()
    qtbot.addWidget(w)
    t0 = time.perf_counter()
    for _ in range(50):
        w.refresh()
    assert (time.perf_counter() - t0) / 50 < 0.02


def test_annotator_and_automatic_docks_release_the_old_sam_engine(monkeypatch):
    """Switching the SAM model in a dock drops the previous engine (and its GPU memory)."""
    import gc
    import types
    import weakref

    import torch

    from napari_gpuseg.engine.runtime.device import Policy
    from napari_gpuseg.engine.runtime.worker import InferenceWorker
    from napari_gpuseg.widgets import sam_annotator, sam_automatic

    class Engine:
        def __init__(self, model, policy):
            self.model = model

    monkeypatch.setattr(sam_annotator, "load_engine", Engine)
    monkeypatch.setattr(sam_automatic, "load_engine", Engine)
    monkeypatch.setattr(sam_automatic, "segment_everything_batch", lambda *a, **k: None)
    worker = InferenceWorker(Policy(torch.device("cpu"), "fp32"))
    dock = types.SimpleNamespace(worker=worker)
    try:
        ref = weakref.ref(sam_annotator.SamAnnotatorWidget._engine(dock, "model-a"))
        sam_automatic.SamAutomaticWidget._job_run(dock, "model-b", "everything", [], None, None, 0, 0, None, None)
        gc.collect()
        assert ref() is None and len(worker.loaded_models()) == 1
    finally:
        worker.shutdown()
