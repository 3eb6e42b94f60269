"""GPU correctness without a GPU: the CUDA/MPS surface is mocked (capability, name, NVML,
CUDA_VISIBLE_DEVICES) and errors are injected (NaN, OOM, CUBLAS allocation failures)."""
import gc
import sys
import types
import warnings
import weakref

import numpy as np
import pytest
import torch

from napari_gpuseg.engine.runtime import batching, device as dev, memory
from napari_gpuseg.engine.runtime.device import Policy

FP32 = Policy(torch.device("cpu"), "fp32")
BF16 = Policy(torch.device("cpu"), "bf16")


@pytest.fixture(autouse=True)
def _clean_pins():
    dev.unpin_all()
    batching.forget_batch_sizes()
    yield
    dev.unpin_all()


@pytest.fixture(scope="module")
def lite_sam():
    """A LiteMedSAM (random weights) whose image encoder is replaced by a cheap stand-in
    with the same output shape (the real encoder costs seconds per tile on a busy CPU)."""
    from napari_gpuseg.models.sam.build import build_sam

    torch.manual_seed(0)
    sam = build_sam("lite_medsam", image_size=256).eval().requires_grad_(False)
    proj = torch.nn.Conv2d(3, 256, 1).requires_grad_(False)

    def encode(x):  # (B, 3, 256, 256) -> (B, 256, 64, 64)
        return proj(torch.nn.functional.avg_pool2d(x, 4))

    sam.image_encoder.forward = encode
    return sam


def _image(seed=0, shape=(200, 240)):
    rng = np.random.default_rng(seed)
    img = rng.normal(100, 10, shape)
    img[60:120, 80:150] += 80
    return img.astype(np.float32)


# ------------------------------------------------------------------ 2: MPS, torch < 2.5
def test_mps_without_autocast_support_never_calls_autocast(monkeypatch):
    monkeypatch.setattr(dev, "torch_version", lambda: (2, 4))

    def boom(*a, **k):
        raise RuntimeError("User specified an unsupported autocast device_type 'mps'")

    monkeypatch.setattr(torch, "autocast", boom)
    mps = torch.device("mps")
    with dev.autocast_off(mps):  # the decoder's fp32 sections
        pass
    monkeypatch.setattr(dev, "mps_available", lambda: True)
    assert dev.pick_precision(mps, "auto") == "fp32"
    with pytest.raises(ValueError, match="torch >= 2.5"):
        dev.check_precision(mps, "fp16")
    assert dev.wide_float(mps) == torch.float32 and dev.wide_float("cpu") == torch.float64
    monkeypatch.setattr(dev, "torch_version", lambda: (2, 5))
    assert dev.pick_precision(mps, "auto") == "fp16"


# ------------------------------------------------------------------ 3: GPU memory given back
def test_embedding_cache_keeps_host_tensors():
    from napari_gpuseg.engine.sam.interactive.cache import EmbeddingCache

    moved = []

    class DeviceTensor:  # what a CUDA tensor looks like to the cache
        device = torch.device("cuda", 0)

        def detach(self):
            return self

        def to(self, where):
            moved.append(where)
            return torch.zeros(4)

    cache = EmbeddingCache(max_bytes=1 << 20)
    cache.put("k", DeviceTensor())
    assert moved == ["cpu"] and cache.get("k").device.type == "cpu"


def test_embed_peak_memory_is_close_to_its_outputs(lite_sam):
    """Live bytes of encoder outputs plus cached embeddings, sampled at every cache write:
    at most the embeddings plus one batch (before: every batch output and its clone)."""
    from napari_gpuseg.engine.sam.interactive.predictor import SamEngine, SamModelInfo

    eng = SamEngine(lite_sam, SamModelInfo("lite", 256, "minmax"), FP32)
    outputs: list = []
    encoder = eng.sam.image_encoder
    real_forward = encoder.forward

    def tracked(x):  # the output lives in a numpy buffer: a weakref to it follows the storage
        res = real_forward(x)
        buf = np.empty(tuple(res.shape), np.float32)
        outputs.append(weakref.ref(buf))
        return torch.from_numpy(buf).copy_(res)

    encoder.forward = tracked
    peak = [0]
    real_put = eng.cache.put

    def put(key, value, persist=True):
        real_put(key, value, persist)
        live = sum(o().nbytes for o in outputs if o() is not None)
        peak[0] = max(peak[0], live + eng.cache.nbytes)

    eng.cache.put = put
    try:
        img = _image(shape=(700, 700))  # 9 tiles of 256
        eng.embed([img], batch_size=2)
    finally:
        encoder.forward = real_forward
    n = len(eng.views(eng.prepare(img)))
    one = 256 * 64 * 64 * 4
    assert n >= 8 and eng.cache.nbytes == n * one
    assert peak[0] <= (n + 2) * one  # outputs + one batch of 2 (was about 2 n)


def test_inference_weights_do_not_require_grad(tmp_path, lite_sam):
    from napari_gpuseg.engine.unet.unet_checkpoint import model_from_checkpoint
    from napari_gpuseg.models.sam.build import load_sam
    from napari_gpuseg.models.unet import UNetConfig, build_unet

    sam = load_sam("lite_medsam", dict(lite_sam.state_dict()), image_size=256)  # real modules
    assert not any(p.requires_grad for p in sam.parameters())
    cfg = UNetConfig(spatial_dims=2, depth=2, base=8)
    net = build_unet(cfg)
    ckpt = {"config": cfg.to_dict(), "state_dict": net.state_dict()}
    assert not any(p.requires_grad for p in model_from_checkpoint(ckpt).parameters())


def test_unet_softmax_runs_inside_the_backoff(monkeypatch):
    from napari_gpuseg.engine.unet import predict as unet

    logits = torch.randn(5, 3, 16, 16)
    calls = []
    real = torch.softmax

    def softmax(x, dim):
        calls.append(x.shape[0])
        if len(calls) == 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(x, dim=dim)

    monkeypatch.setattr(torch, "softmax", softmax)
    out = unet._softmax_to_host(logits)
    np.testing.assert_array_equal(out, real(logits, dim=1).numpy())
    assert calls[0] > calls[1]  # retried with fewer images


def test_switching_models_releases_the_old_engine():
    from napari_gpuseg.engine.runtime.worker import InferenceWorker

    class Engine:
        pass

    w = InferenceWorker(FP32)
    try:
        first = w.model(("sam", "a", FP32), Engine, replace=True)
        ref = weakref.ref(first)
        del first
        w.model(("unet", "x"), Engine)
        w.model(("sam", "b", FP32), Engine, replace=True)
        gc.collect()
        assert ref() is None
        assert ("unet", "x") in w.loaded_models() and len(w.loaded_models()) == 2
    finally:
        w.shutdown()


# ------------------------------------------------------------------ 4: torch.compile fails
def test_training_falls_back_to_eager_when_compile_fails(monkeypatch):
    from napari_gpuseg.engine.unet.training import TrainConfig, train_unet
    from napari_gpuseg.models.unet import UNetConfig

    def broken_compile(model, *a, **k):
        def fwd(x):
            raise RuntimeError("backend='inductor' raised: CompilationError: no C compiler")
        return fwd

    monkeypatch.setattr(torch, "compile", broken_compile)
    img, lab = _train_pair()
    cfg = TrainConfig(model=UNetConfig(spatial_dims=2, depth=2, base=8).to_dict(), crop_size=32, batch_size=2,
                      epochs=1, iters_per_epoch=2, val_fraction=0.0, compile=True)
    with pytest.warns(RuntimeWarning, match="torch.compile failed"):
        res = train_unet([img], [lab], cfg, policy=FP32)
    assert res.stopped == "completed" and np.isfinite(res.history[-1]["train_loss"])


def _train_pair():
    img = _image(3, (64, 64))
    lab = np.zeros((64, 64), np.int32)
    lab[10:30, 10:30] = 1
    lab[35:55, 30:60] = 2
    img[lab > 0] += 100
    return img, lab


# ------------------------------------------------------------------ 5: fp16 NaN, guard
@pytest.fixture
def fake_cuda(monkeypatch):
    def install(cc, name="NVIDIA GeForce RTX 3080"):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: cc)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: name)
    monkeypatch.delenv("NAPARI_GPUSEG_DEVICE", raising=False)
    monkeypatch.delenv("NAPARI_GPUSEG_PRECISION", raising=False)
    return install


@pytest.mark.parametrize("cc, name, expected", [
    ((7, 5), "NVIDIA GeForce GTX 1660 Ti", "fp32"), ((7, 5), "NVIDIA GeForce GTX 1650", "fp32"),
    ((7, 5), "NVIDIA GeForce RTX 2080", "fp16"), ((7, 0), "Tesla V100-SXM2-16GB", "fp16"),
    ((8, 6), "NVIDIA GeForce RTX 3060", "bf16")])
def test_no_fp16_on_cards_without_tensor_cores(fake_cuda, cc, name, expected):
    fake_cuda(cc, name)
    policy = dev.make_policy()
    assert policy.precision == expected
    assert expected != "fp32" or "no tensor cores" in policy.reason


def _cpu_autocast() -> bool:
    try:
        return torch.is_autocast_enabled("cpu")
    except TypeError:  # torch < 2.4
        return torch.is_autocast_cpu_enabled()


def _nan_under_autocast(module):
    real = module.forward

    def forward(x):
        out = real(x)
        return out * float("nan") if _cpu_autocast() else out

    module.forward = forward
    return real


def test_nan_embedding_reruns_in_fp32_identical_to_fp32(lite_sam):
    from napari_gpuseg.engine.sam.interactive.predictor import SamEngine, SamModelInfo

    info = SamModelInfo("lite", 256, "minmax")
    img = _image()
    ref_eng = SamEngine(lite_sam, info, FP32)
    prepared = ref_eng.embed([img])[0]
    view = ref_eng.views(prepared)[0]
    ref = ref_eng.embedding(prepared, view)
    encoder = lite_sam.image_encoder
    real_forward = _nan_under_autocast(encoder)
    try:
        eng = SamEngine(lite_sam, info, BF16)
        with pytest.warns(RuntimeWarning, match="non-finite image embedding in bf16"):
            eng.embed([img])
        got = eng.embedding(eng.prepare(img), view)
        torch.testing.assert_close(got, ref, atol=0, rtol=0)
        assert dev.fp32_pinned("cpu") and not BF16.uses_autocast
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # said once
            eng.cache.clear()
            eng.embed([img])
    finally:
        encoder.forward = real_forward


def test_nan_unet_window_reruns_in_fp32_identical_to_fp32():
    from napari_gpuseg.engine.unet.tiling import sliding_window_inference
    from napari_gpuseg.models.unet import UNetConfig, build_unet

    torch.manual_seed(0)
    net = build_unet(UNetConfig(spatial_dims=2, depth=2, base=8)).eval()
    x = torch.from_numpy(_image(1, (1, 1, 96, 80)))
    with torch.inference_mode():
        ref = sliding_window_inference(x, (64, 64), 2, net, mode="gaussian", policy=FP32)
        _nan_under_autocast(net)
        with pytest.warns(RuntimeWarning, match="non-finite U-Net output"):
            got = sliding_window_inference(x, (64, 64), 2, net, mode="gaussian", policy=BF16)
    torch.testing.assert_close(got, ref, atol=0, rtol=0)


def test_nan_training_loss_pins_fp32_and_training_goes_on():
    from napari_gpuseg.engine.unet import training
    from napari_gpuseg.models.unet import UNetConfig

    img, lab = _train_pair()
    cfg = training.TrainConfig(model=UNetConfig(spatial_dims=2, depth=2, base=8).to_dict(), crop_size=32,
                               batch_size=2, epochs=1, iters_per_epoch=3, val_fraction=0.0)
    real = training.build_unet

    def build(c):
        net = real(c)
        _nan_under_autocast(net)
        return net

    training.build_unet = build
    try:
        with pytest.warns(RuntimeWarning, match="non-finite training loss in bf16"):
            res = training.train_unet([img], [lab], cfg, policy=BF16)
    finally:
        training.build_unet = real
    assert np.isfinite(res.history[-1]["train_loss"])
    assert all(torch.isfinite(p).all() for p in res.model.parameters())


# ------------------------------------------------------------------ 6: NVML device matching
def _fake_pynvml(monkeypatch, uuids):
    nv = types.SimpleNamespace(NVML_TEMPERATURE_GPU=0)
    nv.nvmlInit = lambda: None
    nv.nvmlDeviceGetHandleByIndex = lambda i: i
    nv.nvmlDeviceGetHandleByUUID = lambda u: uuids.index(u)
    nv.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=10 * h)
    nv.nvmlDeviceGetTemperature = lambda h, kind: 40 + h
    nv.nvmlDeviceGetPowerUsage = lambda h: 1000 * (100 + h)
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    return nv


def test_nvml_matches_the_torch_device_by_uuid(monkeypatch):
    uuids = [f"GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd" for i in range(4)]
    _fake_pynvml(monkeypatch, uuids)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")  # torch's cuda:0 is the machine's GPU 2
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(uuid=uuids[2 + i][4:]))
    util, temp, power = memory._Nvml().query(0)
    assert (util, temp, power) == (20.0, 42.0, 102.0)


def test_nvml_falls_back_to_cuda_visible_devices(monkeypatch):
    uuids = [f"GPU-{i}" for i in range(4)]
    _fake_pynvml(monkeypatch, uuids)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert memory._Nvml().query(1)[0] == 10.0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-2")
    assert memory._Nvml().query(0)[0] == 20.0
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert memory._Nvml().query(1)[0] == 10.0


# ------------------------------------------------------------------ 7: TF32 / cudnn.benchmark scoped
def test_tf32_and_benchmark_are_scoped_to_our_calls(fake_cuda, monkeypatch):
    fake_cuda((8, 0), "NVIDIA A100-SXM4-80GB")
    entered = []

    class FakeDevice:
        def __init__(self, d):
            self.d = d

        def __enter__(self):
            entered.append(str(self.d))

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "device", FakeDevice)
    mm, cd = torch.backends.cuda.matmul, torch.backends.cudnn
    before = (mm.allow_tf32, cd.allow_tf32, cd.benchmark)
    policy = dev.make_policy("cuda:1", "fp32")
    assert (mm.allow_tf32, cd.allow_tf32, cd.benchmark) == before  # nothing process-wide
    cd.allow_tf32 = True  # another plugin's choice
    try:
        with policy.autocast(benchmark=True):
            assert (mm.allow_tf32, cd.allow_tf32, cd.benchmark) == (False, False, True)
        with policy.autocast():
            assert cd.benchmark is False and cd.allow_tf32 is False
        assert cd.allow_tf32 is True and cd.benchmark == before[2]
    finally:
        mm.allow_tf32, cd.allow_tf32, cd.benchmark = before
    assert entered == ["cuda:1", "cuda:1"]  # 10: the calling thread runs on the policy's GPU


# ------------------------------------------------------------------ 8: decoder memo atomic
def test_oom_between_memo_steps_leaves_a_usable_memo(lite_sam):
    from napari_gpuseg.engine.sam.interactive.predictor import Prompt, SamEngine, SamModelInfo

    eng = SamEngine(lite_sam, SamModelInfo("lite", 256, "minmax"), FP32)
    img = eng.embed([_image()])[0]
    prompt = Prompt(box=[80, 60, 150, 120])
    cold = eng.predict(img, [prompt])[0]
    eng._memos.clear()
    pe = eng.sam.prompt_encoder
    real = pe.get_dense_pe
    state = {"n": 0}

    def failing():
        state["n"] += 1
        if state["n"] == 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")
        return real()

    pe.get_dense_pe = failing
    try:
        with pytest.raises(torch.cuda.OutOfMemoryError):
            eng.predict(img, [prompt])
        again = eng.predict(img, [prompt])[0]  # was KeyError: 'pe'
    finally:
        del pe.get_dense_pe
    torch.testing.assert_close(again.low_res, cold.low_res, atol=0, rtol=0)


# ------------------------------------------------------------------ 9: back-off
def test_cublas_allocation_failure_backs_off_and_frees_the_batch_first(monkeypatch):
    inputs = []
    alive_at_empty = []

    def fn(batch):
        t = torch.tensor(batch, dtype=torch.float32)
        inputs.append(weakref.ref(t))
        if len(batch) > 2:
            raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
        return t * 2

    def empty_cache(device=None):
        gc.collect()
        alive_at_empty.append(inputs[-1]() is not None)

    monkeypatch.setattr(batching, "empty_cache", empty_cache)
    runner = batching.BatchRunner(batch_size=8)
    out = runner.run(fn, list(range(7)))
    assert [float(o) for o in out] == [2.0 * i for i in range(7)]
    assert runner.oom_events == 2 and runner.batch_size == 2
    assert alive_at_empty == [False, False]  # the failed batch was gone when the cache was emptied
    assert batching.is_oom(RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"))
    assert not batching.is_oom(RuntimeError("CUDA error: an illegal memory access was encountered"))


def test_free_memory_counts_torch_reserved_cache(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (1 * 2**30, 8 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 5 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: 1 * 2**30)
    assert memory.free_bytes("cuda:0") == 5 * 2**30
    assert batching.initial_batch_size(100, "cuda:0", item_bytes=2**30, headroom=1.0) == 5
    from napari_gpuseg.engine.unet.tiling import output_fits

    assert output_fits(2 * 2**30, torch.device("cuda:0"))  # was False: 2 GiB > 0.5 x 1 GiB


# ------------------------------------------------------------------ 10: two GPUs
def test_oom_empties_only_the_failing_gpu(monkeypatch):
    calls = []

    class FakeDevice:
        def __init__(self, d):
            self.d = torch.device(d)

        def __enter__(self):
            calls.append(("enter", str(self.d)))

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device", FakeDevice)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty"))
    memory.empty_cache("cuda:1")
    assert calls == [("enter", "cuda:1"), "empty"]


def test_remembered_encoder_batch_is_per_device(lite_sam):
    from napari_gpuseg.engine.sam.interactive.predictor import SamEngine, SamModelInfo

    eng = SamEngine(lite_sam, SamModelInfo("lite", 256, "minmax"), FP32)
    eng.embed([_image()], batch_size=None)
    encoder_keys = [k for k in batching._memory if k[0] == "sam-encoder"]
    assert encoder_keys and all("cpu" in k for k in encoder_keys)  # never vacuously true


# ------------------------------------------------------------------ 11: precision vs device
@pytest.mark.parametrize("cc, name, precision, reason", [
    ((7, 5), "NVIDIA GeForce RTX 2080", "bf16", "compute capability >= 8.0"),
    ((6, 1), "NVIDIA GeForce GTX 1080", "fp16", "no tensor"),
    ((7, 5), "NVIDIA GeForce GTX 1660", "fp16", "NaN")])
def test_precision_not_supported_by_the_card_is_refused(fake_cuda, cc, name, precision, reason):
    fake_cuda(cc, name)
    with pytest.raises(ValueError, match=reason):
        dev.make_policy("cuda", precision)
    assert dev.make_policy("cuda", "fp32").precision == "fp32"


# ------------------------------------------------------------------ 12: one sync per batch
def test_automatic_result_reads_scores_back_once(monkeypatch):
    from napari_gpuseg.engine.sam.automatic.everything import _Masks, _result
    from napari_gpuseg.engine.sam.interactive.views import View

    n = 50
    view = View(0, 0, 32, 32, 256)
    masks = _Masks([(np.ones((2, 2), bool), 0, 0)] * n, [torch.zeros(4, 4)] * n, torch.rand(n),
                   torch.rand(n), torch.zeros((n, 4), dtype=torch.int64), torch.zeros((n, 2)),
                   torch.zeros(n, dtype=torch.int64))
    crop = types.SimpleNamespace(view=view)
    floats = []
    real = torch.Tensor.__float__
    monkeypatch.setattr(torch.Tensor, "__float__", lambda t: floats.append(1) or real(t))
    res = _result(masks, [crop], None, np.arange(n), n, 0.0)
    assert len(res.masks) == n and not floats  # was one per mask
