import pytest
import torch

from napari_gpuseg.engine.runtime import device as dev


@pytest.fixture
def fake_cuda(monkeypatch):
    def install(cc, name="Fake GPU"):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: cc)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: name)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    return install


@pytest.mark.parametrize("cc, expected", [((9, 0), "bf16"), ((8, 0), "bf16"), ((8, 6), "bf16"),
                                          ((7, 5), "fp16"), ((7, 0), "fp16"), ((6, 1), "fp32")])
def test_cuda_precision_by_capability(fake_cuda, monkeypatch, cc, expected):
    fake_cuda(cc)
    monkeypatch.delenv("NAPARI_GPUSEG_PRECISION", raising=False)
    policy = dev.make_policy("auto", "auto")
    assert policy.device.type == "cuda"
    assert policy.precision == expected


def test_cuda_preferred_over_mps_and_cpu(fake_cuda, monkeypatch):
    fake_cuda((8, 0))
    monkeypatch.setattr(dev, "mps_available", lambda: True)
    assert dev.pick_device("auto").type == "cuda"


def test_mps_then_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(dev, "mps_available", lambda: True)
    assert dev.pick_device("auto").type == "mps"
    monkeypatch.setattr(dev, "mps_available", lambda: False)
    assert dev.pick_device("auto").type == "cpu"


@pytest.mark.parametrize("fast, expected", [(True, "bf16"), (False, "fp32")])
def test_cpu_precision_follows_bf16_support(monkeypatch, fast, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(dev, "cpu_has_fast_bf16", lambda: fast)
    monkeypatch.delenv("NAPARI_GPUSEG_PRECISION", raising=False)
    assert dev.make_policy("cpu", "auto").precision == expected


def test_a_torch_that_cannot_tell_gets_fp32_on_any_cpu(monkeypatch):
    """torch 2.3 (the oldest supported) has no query for AVX512-BF16 or AMX; its bf16 on such
    a CPU failed in oneDNN part-way through a test run, so the policy keeps fp32 there.
    Where torch has the query, its answer stands."""
    from napari_gpuseg.models import cpu_bf16

    for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"):
        monkeypatch.delattr(torch.cpu, name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("NAPARI_GPUSEG_PRECISION", raising=False)
    assert not cpu_bf16.cpu_has_fast_bf16() and dev.make_policy("cpu", "auto").precision == "fp32"
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True, raising=False)
    assert cpu_bf16.cpu_has_fast_bf16()


def test_user_overrides(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert dev.make_policy("cpu", "fp32").precision == "fp32"
    monkeypatch.setenv("NAPARI_GPUSEG_PRECISION", "fp32")
    assert dev.make_policy("cpu", None).precision == "fp32"
    with pytest.raises(ValueError, match="fp16 is not supported on CPU"):
        dev.make_policy("cpu", "fp16")
    with pytest.raises(ValueError):
        dev.make_policy("cpu", "int4")


def test_requesting_missing_gpu_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="no CUDA GPU is available"):
        dev.pick_device("cuda")


def test_global_policy_override_and_autocast():
    try:
        p = dev.set_policy("cpu", "bf16")
        assert dev.get_policy() is p
        with p.autocast():
            a = torch.randn(4, 4)
            assert (a @ a).dtype == torch.bfloat16
        p32 = dev.set_policy("cpu", "fp32")
        with p32.autocast():
            assert (a @ a).dtype == torch.float32
    finally:
        dev.reset_policy()


def test_environment_variables_are_read_and_checked(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(dev, "cpu_has_fast_bf16", lambda: False)
    monkeypatch.setenv("NAPARI_GPUSEG_PRECISION", "bf16")
    monkeypatch.setenv("NAPARI_GPUSEG_DEVICE", "cpu")
    for policy in (dev.make_policy(), dev.make_policy("auto", "auto"), dev.make_policy(None, None)):
        assert policy.device.type == "cpu" and policy.precision == "bf16"  # was fp32 (env ignored)
    assert dev.make_policy("cpu", "fp32").precision == "fp32"  # an explicit choice wins
    monkeypatch.setenv("NAPARI_GPUSEG_DEVICE", "gpu0")
    with pytest.raises(ValueError, match="NAPARI_GPUSEG_DEVICE='gpu0' is not a device"):
        dev.make_policy()
    monkeypatch.setenv("NAPARI_GPUSEG_DEVICE", "cpu")
    monkeypatch.setenv("NAPARI_GPUSEG_PRECISION", "half")
    with pytest.raises(ValueError, match="NAPARI_GPUSEG_PRECISION='half' is not a precision"):
        dev.make_policy("auto", "auto")
    try:
        with pytest.raises(ValueError, match="NAPARI_GPUSEG_PRECISION"):
            dev.get_policy()
    finally:
        dev.reset_policy()


def test_missing_gpu_index_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(RuntimeError, match="only 1 CUDA GPU"):
        dev.pick_device("cuda:3")


def test_cli_refuses_a_precision_the_device_cannot_run(monkeypatch, capsys):
    from napari_gpuseg.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["info", "--device", "cpu", "--precision", "fp16"]) == 2
    assert "fp16 is not supported on CPU" in capsys.readouterr().err
    monkeypatch.setenv("NAPARI_GPUSEG_DEVICE", "tpu")
    assert main(["info"]) == 2
    assert "NAPARI_GPUSEG_DEVICE='tpu'" in capsys.readouterr().err


def test_the_cpu_is_named_by_its_model(tmp_path, monkeypatch):
    """The device line names the CPU model (benchmark numbers and the docks say which CPU),
    from ``/proc/cpuinfo`` on Linux; without it, what ``platform`` knows."""
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\n"
                    "model name\t: AMD EPYC  7B13 64-Core Processor\nflags\t\t: fpu avx2\n")
    assert dev.cpu_model_name(str(info)) == "AMD EPYC 7B13 64-Core Processor"
    import platform

    monkeypatch.setattr(platform, "processor", lambda: "")
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert dev.cpu_model_name(str(tmp_path / "missing")) == "aarch64"
    monkeypatch.setattr(dev, "cpu_model_name", lambda: "Test CPU 9000")
    assert dev.device_name(torch.device("cpu")) == f"CPU (Test CPU 9000, {torch.get_num_threads()} threads)"
