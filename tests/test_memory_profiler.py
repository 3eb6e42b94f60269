import sys
import types

import pytest
import torch

from napari_gpuseg.engine.runtime import memory, profiler


def test_cpu_snapshot_reports_host_memory():
    snap = memory.snapshot("cpu")
    assert snap.process_rss > 0 and snap.system_total >= snap.system_used > 0
    assert snap.allocated is None and not snap.is_gpu


def test_nvml_missing_is_handled(monkeypatch):
    """Here the NVML library is absent: nvmlInit raises; the probe records why."""
    fake = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    def init():
        raise NVMLError("NVML Shared Library Not Found")

    fake.nvmlInit = init
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    probe = memory._Nvml()
    assert probe.query(0) == (None, None, None)
    assert "NVML Shared Library Not Found" in probe.error


def fake_nvml(temperature_error: Exception | None = None) -> types.ModuleType:
    """An NVML that answers for one GPU (index 0): 37 % busy, 55 C, 120 W."""
    nv = types.ModuleType("pynvml")
    nv.NVML_TEMPERATURE_GPU = 0
    nv.calls = []
    nv.nvmlInit = lambda: nv.calls.append("init")
    nv.nvmlDeviceGetHandleByIndex = lambda i: ("handle", i)
    nv.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=37, memory=5)

    def temperature(handle, sensor):
        if temperature_error is not None:
            raise temperature_error
        return 55

    nv.nvmlDeviceGetTemperature = temperature
    nv.nvmlDeviceGetPowerUsage = lambda h: 120_000  # mW
    return nv


def no_device_properties(index):
    raise RuntimeError("no CUDA device properties")  # nvml_handle falls back to the index


def test_nvml_query_reads_a_gpu(monkeypatch):
    """A working NVML (mocked: no GPU needed): values come back, NVML starts once."""
    nv = fake_nvml()
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_properties", no_device_properties)
    probe = memory._Nvml()
    assert probe.query(0) == (37.0, 55.0, 120.0)
    assert probe.query(0) == (37.0, 55.0, 120.0)
    assert probe.error is None and nv.calls == ["init"]


def test_nvml_query_keeps_the_values_it_could_read(monkeypatch, caplog):
    """A field NVML cannot read is None, and why is logged (debug), not swallowed."""
    nv = fake_nvml(temperature_error=RuntimeError("NVML_ERROR_NOT_SUPPORTED"))
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_properties", no_device_properties)
    with caplog.at_level("DEBUG", logger=memory.__name__):
        assert memory._Nvml().query(0) == (37.0, None, 120.0)
    logged = [r.getMessage() for r in caplog.records if r.name == memory.__name__]
    assert any("temperature" in m and "NVML_ERROR_NOT_SUPPORTED" in m for m in logged)
    assert any("no CUDA device properties" in m for m in logged)


def test_cuda_snapshot_with_nvml_missing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda i=None: 100)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda i=None: 200)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda i=None: 150)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i=None: (1000, 4000))
    broken = memory._Nvml()
    broken._ready, broken.error = False, "NVML unavailable: test"
    monkeypatch.setattr(memory, "_nvml", broken)
    snap = memory.snapshot("cuda:0")
    assert (snap.allocated, snap.reserved, snap.peak, snap.free, snap.total) == (100, 200, 150, 1000, 4000)
    assert snap.utilization is None and snap.nvml_error == "NVML unavailable: test"


def test_format_bytes():
    assert memory.format_bytes(None) == "n/a"
    assert memory.format_bytes(512) == "512 B"
    assert memory.format_bytes(3 * 2**30) == "3.0 GiB"


def test_profiler_stops_at_first_oom_and_recommends_fastest_fitting():
    calls = []

    def step(batch):
        calls.append(len(batch))
        if len(batch) >= 16:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return torch.nn.functional.conv2d(batch, torch.ones(4, 3, 3, 3))

    res = profiler.profile_batch_sizes(step, lambda n: torch.randn(n, 3, 32, 32),
                                       sizes=(1, 2, 4, 8, 16, 32), repeats=1, key="conv")
    assert [p.batch_size for p in res.points] == [1, 2, 4, 8]
    assert res.oom_at == 16 and 32 not in calls
    best = max(res.points, key=lambda p: p.items_per_s).batch_size
    assert res.recommended == best
    from napari_gpuseg.engine.runtime.batching import remembered_batch_size

    assert remembered_batch_size("conv") == best
    assert "recommended" in res.table()


def test_profiler_propagates_real_errors():
    with pytest.raises(ValueError):
        profiler.profile_batch_sizes(lambda b: (_ for _ in ()).throw(ValueError("x")),
                                     lambda n: torch.ones(n), sizes=(1,))
