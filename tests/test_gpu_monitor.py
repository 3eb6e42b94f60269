import sys
import types

import numpy as np
import pytest
import torch

from napari_gpuseg.engine.runtime import memory
from napari_gpuseg.engine.runtime.device import Policy
from napari_gpuseg.widgets import gpu_monitor
from napari_gpuseg.widgets.gpu_monitor import GpuMonitorWidget

MiB = 2**20


@pytest.fixture
def on_cpu(monkeypatch):
    """The monitor's device is the CPU, whatever this machine has."""
    monkeypatch.setattr(gpu_monitor, "get_policy", lambda: Policy(torch.device("cpu"), "fp32", "test CPU"))


def no_device_properties(index):
    raise RuntimeError("mocked CUDA: no device properties")


@pytest.fixture
def fake_cuda(monkeypatch):
    """One mocked CUDA card (no GPU needed): fixed memory numbers, an NVML that answers,
    and counters for the calls the monitor makes."""
    calls = {"snapshot": 0, "nvml_init": 0, "reset_peak": 0, "empty_cache": 0}
    c = torch.cuda
    monkeypatch.setattr(gpu_monitor, "get_policy", lambda: Policy(torch.device("cuda:0"), "bf16", "test"))
    monkeypatch.setattr(c, "is_available", lambda: True)
    monkeypatch.setattr(c, "current_device", lambda: 0)
    monkeypatch.setattr(c, "get_device_name", lambda d=None: "Test GPU 80GB")
    monkeypatch.setattr(c, "memory_allocated", lambda i=None: 100 * MiB)
    monkeypatch.setattr(c, "memory_reserved", lambda i=None: 300 * MiB)
    monkeypatch.setattr(c, "max_memory_allocated", lambda i=None: 200 * MiB)
    monkeypatch.setattr(c, "mem_get_info", lambda i=None: (1024 * MiB, 4096 * MiB))
    monkeypatch.setattr(c, "get_device_properties", no_device_properties)  # NVML handle by index
    monkeypatch.setattr(c, "reset_peak_memory_stats",
                        lambda d=None: calls.__setitem__("reset_peak", calls["reset_peak"] + 1))
    monkeypatch.setattr(c, "empty_cache", lambda: calls.__setitem__("empty_cache", calls["empty_cache"] + 1))
    nv = types.SimpleNamespace(
        NVML_TEMPERATURE_GPU=0,
        nvmlInit=lambda: calls.__setitem__("nvml_init", calls["nvml_init"] + 1),
        nvmlDeviceGetHandleByIndex=lambda i: ("handle", i),
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=37),
        nvmlDeviceGetTemperature=lambda h, sensor: 55,
        nvmlDeviceGetPowerUsage=lambda h: 120_000,
    )
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(memory, "_nvml", memory._Nvml())
    real_snapshot = memory.snapshot

    def counted(device=None):
        calls["snapshot"] += 1
        return real_snapshot(device)

    monkeypatch.setattr(memory, "snapshot", counted)
    return calls


def test_monitor_dock_on_real_viewer(make_napari_viewer, qtbot, on_cpu):
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
    dock.destroyOnClose()  # the dock's close button: napari keeps the widget, it stops polling
    assert widget.parent() is None and not widget.timer.isActive()


def test_monitor_on_a_mocked_gpu(qtbot, fake_cuda):
    w = GpuMonitorWidget(interval_ms=60_000)
    qtbot.addWidget(w)
    assert "Test GPU 80GB" in w.device_label.text() and "bf16" in w.precision_label.text()
    assert w.fields["allocated"].text() == "100.0 MiB" and w.fields["peak"].text() == "200.0 MiB"
    assert w.fields["free"].text() == "1.0 GiB / 4.0 GiB"
    assert w.fields["util"].text() == "37 %" and w.fields["temp"].text() == "55 °C / 120 W"
    assert list(w.plot.series["allocated MiB"]) == [100.0]
    assert w.reset_button.isEnabled() and w.empty_button.isEnabled()
    w.reset_button.click()
    w.empty_button.click()
    assert fake_cuda["reset_peak"] == 1 and fake_cuda["empty_cache"] == 1


def test_refresh_is_cheap(qtbot, fake_cuda):
    """One probe per refresh, NVML started once, a bounded history (no timing: counted calls)."""
    w = GpuMonitorWidget(interval_ms=60_000)  # the timer never fires during the test
    qtbot.addWidget(w)
    before = fake_cuda["snapshot"]
    for _ in range(200):
        w.refresh()
    assert fake_cuda["snapshot"] - before == 200
    assert fake_cuda["nvml_init"] == 1
    assert len(w.plot.series["allocated MiB"]) == w.plot.series["allocated MiB"].maxlen < 200


def test_annotator_and_automatic_docks_release_the_old_sam_engine(monkeypatch):
    """Switching the SAM model in a dock drops the previous engine (and its GPU memory)."""
    import gc
    import types
    import weakref

    import torch

    from napari_gpuseg.engine.runtime.device import Policy
    from napari_gpuseg.engine.runtime.worker import InferenceWorker
    from napari_gpuseg.engine.annotate.session import AnnotationSession
    from napari_gpuseg.engine.sam import loader
    from napari_gpuseg.widgets import sam_automatic

    class Engine:
        def __init__(self, model, policy, cache=None):
            self.model = model

    monkeypatch.setattr(loader, "load_engine", Engine)
    monkeypatch.setattr(sam_automatic, "load_engine", Engine)
    monkeypatch.setattr(sam_automatic, "segment_everything_batch", lambda *a, **k: None)
    worker = InferenceWorker(Policy(torch.device("cpu"), "fp32"))
    dock = types.SimpleNamespace(worker=worker, _cache=None)
    try:
        ref = weakref.ref(AnnotationSession("model-a", worker=worker).engine())  # the annotator's
        sam_automatic.SamAutomaticWidget._job_run(dock, "model-b", "everything", [], None, None, 0, 0, None, None)
        gc.collect()
        assert ref() is None and len(worker.loaded_models()) == 1
    finally:
        worker.shutdown()
