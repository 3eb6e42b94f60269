"""GPU and platform code paths checked without a GPU: device policy, backend flags,
the worker, training and platform code. The CUDA/MPS surface is mocked (capability, name, SM
count) and errors are injected (NaN, OOM); worker items are checked through
:class:`InferenceWorker`. The SAM side is ``test_sam_gpu_memory.py``."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

from napari_gpuseg.engine.runtime import allocator, batching, device as dev
from napari_gpuseg.engine.runtime.device import Policy
from napari_gpuseg.engine.runtime.worker import FAILED, InferenceWorker

from gpu_fixtures import BF16, FP32, blob_image as _image, cpu_autocast as _cpu_autocast
from gpu_fixtures import _clean_pins, worker_bf16  # noqa: F401 - fixtures

ROOT = Path(__file__).resolve().parents[1]




# ------------------------------------------------------------------ 1: fp32 re-run inside the worker
def test_fp32_rerun_inside_a_worker_job_really_runs_in_fp32(worker_bf16):
    def compute():
        with BF16.autocast():
            x = torch.ones(4)
            return x * float("nan") if _cpu_autocast() else x

    with pytest.warns(RuntimeWarning, match="re-ran in fp32"):
        out = worker_bf16.submit(dev.guard_finite, BF16, compute, "network output").result(timeout=30)
    assert torch.isfinite(out).all()  # the worker's outer bf16 autocast is off for the re-run


def test_nan_unet_window_in_a_worker_job_reruns_in_fp32(worker_bf16):
    from napari_gpuseg.engine.unet.tiling import sliding_window_inference
    from napari_gpuseg.models.unet import UNetConfig, build_unet

    torch.manual_seed(0)
    net = build_unet(UNetConfig(spatial_dims=2, depth=2, base=8)).eval()
    x = torch.from_numpy(_image(1, (1, 1, 96, 80)))
    with torch.inference_mode():
        ref = sliding_window_inference(x, (64, 64), 2, net, mode="gaussian", policy=FP32)
    real = net.forward
    net.forward = lambda t: real(t) * float("nan") if _cpu_autocast() else real(t)
    with pytest.warns(RuntimeWarning, match="non-finite U-Net output"):
        got = worker_bf16.submit(sliding_window_inference, x, (64, 64), 2, net, mode="gaussian",
                                 policy=BF16).result(timeout=60)
    torch.testing.assert_close(got, ref, atol=0, rtol=0)


# ------------------------------------------------------------------ 2: TU117 cards
@pytest.fixture
def fake_cuda(monkeypatch):
    def install(cc, name, sms=40):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: cc)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: name)
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda d=None: type("Props", (), {"multi_processor_count": sms, "name": name})())
    monkeypatch.delenv("NAPARI_GPUSEG_DEVICE", raising=False)
    monkeypatch.delenv("NAPARI_GPUSEG_PRECISION", raising=False)
    return install


@pytest.mark.parametrize("name, sms, expected", [
    ("NVIDIA T400", 6, "fp32"), ("NVIDIA T400 4GB", 6, "fp32"), ("NVIDIA T600", 14, "fp32"),
    ("NVIDIA T1000", 14, "fp32"), ("NVIDIA T1000 8GB", 14, "fp32"), ("Quadro T1000", 14, "fp32"),
    ("NVIDIA T1200 Laptop GPU", 16, "fp32"), ("Quadro T2000", 16, "fp32"),
    ("NVIDIA GeForce MX450", 14, "fp32"), ("NVIDIA GeForce MX550", 16, "fp32"),
    ("NVIDIA GeForce GTX 1650", 14, "fp32"), ("NVIDIA GeForce GTX 1630", 8, "fp32"),
    ("Some future TU117 board", 14, "fp32"),  # not named: decided by capability and SM count
    ("Tesla T4", 40, "fp16"), ("NVIDIA GeForce RTX 2060", 30, "fp16"), ("Quadro RTX 4000", 36, "fp16"),
    ("NVIDIA GeForce RTX 2080 Ti", 68, "fp16")])
def test_turing_cards_without_tensor_cores_get_fp32(fake_cuda, name, sms, expected):
    fake_cuda((7, 5), name, sms)
    policy = dev.make_policy()
    assert policy.precision == expected, name
    if expected == "fp32":
        assert "no tensor cores" in policy.reason
        with pytest.raises(ValueError, match="no tensor"):
            dev.make_policy("cuda", "fp16")


# ------------------------------------------------------------------ 3: thread-safe backend flags
def test_overlapping_backend_scopes_in_two_threads_restore_the_process_flags():
    mm, cd = torch.backends.cuda.matmul, torch.backends.cudnn
    before = (mm.allow_tf32, cd.allow_tf32, cd.benchmark)
    mm.allow_tf32, cd.allow_tf32, cd.benchmark = False, True, False  # torch's defaults, set
    cuda = torch.device("cuda", 0)
    a_in, b_in, a_out, b_out = (threading.Event() for _ in range(4))
    seen = {}

    def a():  # the SAM encoder in the inference worker: autotuned
        with dev.scoped_backends(cuda, benchmark=True):
            a_in.set()
            b_in.wait(5)
            seen["both"] = (mm.allow_tf32, cd.allow_tf32, cd.benchmark)
        a_out.set()

    def b():  # a U-Net window in the train worker: not autotuned
        a_in.wait(5)
        with dev.scoped_backends(cuda, benchmark=False):
            b_in.set()
            a_out.wait(5)
            seen["b alone"] = (mm.allow_tf32, cd.allow_tf32, cd.benchmark)
        b_out.set()

    try:
        threads = [threading.Thread(target=a), threading.Thread(target=b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert seen["both"] == (False, False, False)  # no autotuning while one scope refuses it
        assert seen["b alone"] == (False, False, False)
        assert (mm.allow_tf32, cd.allow_tf32, cd.benchmark) == (False, True, False)  # as before
        # nested scopes of one thread: the innermost decides, the outer one's comes back
        with dev.scoped_backends(cuda):
            with dev.scoped_backends(cuda, benchmark=True):
                with dev.scoped_backends(cuda):
                    assert cd.benchmark is False
                assert cd.benchmark is True
            assert cd.benchmark is False and cd.allow_tf32 is False
        assert (mm.allow_tf32, cd.allow_tf32, cd.benchmark) == (False, True, False)
    finally:
        mm.allow_tf32, cd.allow_tf32, cd.benchmark = before


# ------------------------------------------------------------------ 4: training on Apple silicon
def test_a_training_step_on_mps_runs_in_fp32_without_autocast_or_loss_scaling(monkeypatch):
    """One optimiser step of the U-Net trainer under an MPS fp16 policy, run on CPU tensors:
    no autocast is entered, the network computes in fp32, no gradient scaler acts, and the
    step equals an fp32 step exactly (the MPS scaler's ``unscale_`` fails on torch 2.5-2.7 and
    fp16 without one loses small gradients). Under the CPU's bf16 policy the same step does
    run in autocast (bf16 activations), so the check can see it."""
    from napari_gpuseg.engine.unet import training
    from napari_gpuseg.models.unet import UNetConfig, build_unet

    mcfg = UNetConfig(spatial_dims=2, depth=2, base=8)
    cfg = training.TrainConfig(model=mcfg.to_dict(), crop_size=32, batch_size=2, epochs=1, iters_per_epoch=1,
                               val_fraction=0.0)
    x = torch.from_numpy(_image(5, (2, 1, 32, 32)))
    y = torch.zeros(2, 32, 32, dtype=torch.long)
    y[:, 8:20, 8:20] = 1
    entered = []
    real_autocast = torch.autocast
    monkeypatch.setattr(torch, "autocast", lambda *a, **k: entered.append(a[0]) or real_autocast(*a, **k))

    def step(policy):
        torch.manual_seed(0)
        net = build_unet(mcfg)
        dtypes = []
        net.register_forward_hook(lambda _m, _i, out: dtypes.append(out.dtype))
        stepper = training._Stepper(net, torch.optim.SGD(net.parameters(), lr=0.1), policy, cfg, False, {})
        loss = stepper.step(x, y)
        return stepper, loss.detach(), dtypes, [p.detach().clone() for p in net.parameters()]

    mps, loss, dtypes, params = step(Policy(torch.device("mps"), "fp16"))
    assert not mps.use_amp and not mps.scaler.is_enabled()
    assert entered == [] and dtypes == [torch.float32]
    _, ref_loss, _, ref_params = step(FP32)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
    torch.manual_seed(0)
    assert any(not torch.equal(a, b) for a, b in zip(params, build_unet(mcfg).parameters()))  # it stepped

    cpu, _, dtypes, _ = step(BF16)  # CPU: autocast, never a scaler
    assert cpu.use_amp and not cpu.scaler.is_enabled()
    assert entered == ["cpu"] and dtypes == [torch.bfloat16]


# ------------------------------------------------------------------ 5: every worker stopped at exit
def test_closing_the_app_during_training_stops_the_train_worker(tmp_path):
    flag = tmp_path / "ended.txt"
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from napari_gpuseg.widgets._unet_jobs import train_worker

        def train(cancel=None):
            while not cancel.cancelled:
                time.sleep(0.01)
            open({str(flag)!r}, "w").write("cancelled")

        train_worker().submit(train, inference=False)
        time.sleep(0.3)  # training runs; the interpreter exits now
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert flag.exists() and flag.read_text() == "cancelled"  # stopped before teardown


# ------------------------------------------------------------------ 7: a failed job frees its memory
def test_a_failed_job_keeps_no_tensor_of_its_frames(worker_bf16):
    refs = []

    def train_step():
        weights = torch.zeros(1000, 1000)  # stands for weights, optimizer state, activations
        refs.append(weakref.ref(weights))
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    job = worker_bf16.submit(train_step, inference=False)
    job.wait(30)
    worker_bf16.submit(lambda: None).result(timeout=30)  # the worker is past the failed job
    assert job.status == FAILED and isinstance(job.error, torch.cuda.OutOfMemoryError)
    assert job.error.__traceback__ is not None  # where it failed is still known
    assert refs[0]() is None  # ... but the frames no longer hold the tensors
    with pytest.raises(torch.cuda.OutOfMemoryError):
        job.result()


# ------------------------------------------------------------------ 11: no host sync per step
def test_training_steps_on_a_gpu_read_nothing_back_per_step(monkeypatch):
    from napari_gpuseg.engine.unet import training
    from napari_gpuseg.models.unet import UNetConfig

    # the CPU taken for an asynchronous device (a GPU): a read-back there waits for the kernels
    monkeypatch.setattr(training, "SYNC_FREE_DEVICES", (), raising=False)
    img = _image(3, (64, 64))
    lab = np.zeros((64, 64), np.int32)
    lab[10:30, 10:30] = 1
    img[lab > 0] += 100
    n_iter = 2 * training.LOSS_SYNC_EVERY
    cfg = training.TrainConfig(model=UNetConfig(spatial_dims=2, depth=2, base=8).to_dict(), crop_size=32,
                               batch_size=2, epochs=1, iters_per_epoch=n_iter, val_fraction=0.0)
    reads = []  # truth tests of tensors: how a loss check reads a value back
    real = torch.Tensor.__bool__
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda self: reads.append(tuple(self.shape)) or real(self))
    events = []
    training.train_unet([img], [lab], cfg, policy=BF16, on_event=events.append)
    monkeypatch.undo()
    assert len([e for e in events if e.kind == "iter"]) == n_iter
    assert len(reads) < n_iter // 2, reads  # was one or more per step


# ------------------------------------------------------------------ 12: Windows: no os.kill(pid, 0)
def test_temp_file_owners_are_checked_without_signals(tmp_path, monkeypatch):
    from napari_gpuseg.io import label_files

    class WindowsOs:  # the module's ``os`` as on Windows: signal 0 is CTRL_C_EVENT
        def __getattr__(self, name):
            return getattr(os, name)

        @staticmethod
        def kill(*_a):
            raise AssertionError("os.kill(pid, 0) would send CTRL_C_EVENT on Windows")

    monkeypatch.setattr(label_files, "os", WindowsOs())
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(done.stdout)
    stale = tmp_path / f"{label_files.TEMP_PREFIX}a.tif.{dead}-1.tmp"
    mine = tmp_path / f"{label_files.TEMP_PREFIX}b.tif.{os.getpid()}-1.tmp"
    for p in (stale, mine):
        p.write_bytes(b"x")
    assert label_files.temp_owner(stale) == dead and label_files.temp_owner(mine) == os.getpid()
    assert label_files.remove_temp_files(tmp_path) == 1
    assert not stale.exists() and mine.exists()


# ------------------------------------------------------------------ 13: allocator set-up scoped
def test_importing_the_package_changes_no_allocator_setting():
    code = ("import napari_gpuseg; from napari_gpuseg.engine.runtime import allocator; "
            "print(sorted(allocator._state))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"  # nothing decided, nothing set


class _FakeLibc:
    def __init__(self):
        self.calls = []

    def mallopt(self, param, value):
        self.calls.append(("mallopt", param))
        return 1

    def malloc_trim(self, pad):
        self.calls.append(("trim",))
        return 1


def test_a_cpu_worker_sets_the_allocator_up_and_trims_when_idle(monkeypatch):
    for var in [k for k in os.environ if k.startswith("MALLOC_")]:
        monkeypatch.delenv(var)  # e.g. MALLOC_TRIM_THRESHOLD_, left by a Dask nanny earlier in the session
    monkeypatch.setattr(allocator, "_state", {})
    libc = _FakeLibc()
    monkeypatch.setattr(allocator, "_glibc", lambda: libc)
    w = InferenceWorker(FP32, name="test-cpu-worker")
    try:
        gate = threading.Event()
        first = w.submit(gate.wait, 10)
        second = w.submit(lambda: None)
        time.sleep(0.1)
        assert allocator._state.get("result") == "configured"  # set up for the CPU worker
        assert ("trim",) not in libc.calls  # not between queued jobs
        gate.set()
        first.result(timeout=10), second.result(timeout=10)
        deadline = time.monotonic() + 5
        while ("trim",) not in libc.calls and time.monotonic() < deadline:
            time.sleep(0.01)
        assert libc.calls.count(("trim",)) == 1  # once, when the worker went idle
    finally:
        w.shutdown()


def test_a_gpu_worker_leaves_the_allocator_alone(monkeypatch):
    monkeypatch.setattr(allocator, "_state", {})
    libc = _FakeLibc()
    monkeypatch.setattr(allocator, "_glibc", lambda: libc)
    w = InferenceWorker(Policy(torch.device("meta"), "fp32"), name="test-gpu-worker")  # not the CPU
    try:
        w.submit(lambda: None, inference=False).result(timeout=10)
        w.submit(lambda: None, inference=False).result(timeout=10)
        time.sleep(0.05)
    finally:
        w.shutdown()
    assert libc.calls == [] and allocator._state == {}


def test_the_viewer_command_leaves_the_allocator_to_the_worker(monkeypatch, capsys):
    from napari_gpuseg.cli.main import main as napari_gpuseg_command

    monkeypatch.setattr(allocator, "_state", {})
    libc = _FakeLibc()
    monkeypatch.setattr(allocator, "_glibc", lambda: libc)
    assert napari_gpuseg_command(["info", "--device", "cpu"]) == 0  # napari-gpuseg without batch / train
    assert libc.calls == [] and allocator._state == {}


# ------------------------------------------------------------------ 14: no spawned DataLoader workers
@pytest.mark.parametrize("platform, expected", [("darwin", 0), ("win32", 0), ("linux", None)])
def test_no_dataloader_workers_on_spawn_platforms(monkeypatch, platform, expected):
    from napari_gpuseg.engine.unet import training

    monkeypatch.setattr(sys, "platform", platform)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    n = training._workers(training.TrainConfig(), torch.device("cuda"))
    assert n == (4 if expected is None else expected)
    assert training._workers(training.TrainConfig(num_workers=2), torch.device("cuda")) == 2  # asked for


# ------------------------------------------------------------------ the worker's per-job device
def test_every_job_runs_on_the_policys_gpu(monkeypatch):
    entered = []

    class FakeDevice:
        def __init__(self, d):
            self.d = torch.device(d)

        def __enter__(self):
            entered.append(str(self.d))

        def __exit__(self, *exc):
            entered.append("exit")
            return False

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device", FakeDevice)
    w = InferenceWorker(Policy(torch.device("cuda", 1), "fp32"), name="test-cuda1-worker")
    try:
        inside = w.submit(lambda: list(entered), inference=False).result(timeout=10)
    finally:
        w.shutdown()
    assert inside and inside[-1] == "cuda:1" and "exit" not in inside  # entered for the job's whole run


# ------------------------------------------------------------------ issue 28, 3 and 8
def test_submit_after_shutdown_raises():
    w = InferenceWorker(FP32, name="test-shutdown-worker")
    w.submit(lambda: 1).result(timeout=10)
    w.shutdown()
    with pytest.raises(RuntimeError, match="worker is shut down"):
        w.submit(lambda: 2)
