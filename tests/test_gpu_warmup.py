"""The GPU warm-up at model load: what it runs, and that it leaves CPUs alone."""
import torch

from napari_gpuseg.engine import load_engine
from napari_gpuseg.engine.runtime.device import Policy
from napari_gpuseg.engine.sam.interactive import gpu_warmup
from napari_gpuseg.engine.sam.interactive.cache import EmbeddingCache
from napari_gpuseg.engine.sam.interactive.predictor import GPU_EMBED_STEP

from sam_fixtures import require_lite_medsam


def _spy(engine, monkeypatch):
    calls = {"encode": [], "predict": []}
    encode, predict = engine.encode, engine.predict

    def spy_encode(x):
        calls["encode"].append(x.shape[0])
        return encode(x)

    def spy_predict(image, prompts, **kw):
        calls["predict"].append((prompts[0], kw))
        return predict(image, prompts, **kw)

    monkeypatch.setattr(engine, "encode", spy_encode)
    monkeypatch.setattr(engine, "predict", spy_predict)
    return calls


def test_warm_runs_each_encoder_batch_and_each_kind_of_decoder_call(monkeypatch):
    require_lite_medsam()
    engine = load_engine("nuclei_sam", Policy(torch.device("cpu"), "fp32"), cache=EmbeddingCache())
    calls = _spy(engine, monkeypatch)
    assert gpu_warmup.warm(engine) > 0
    # the two batch shapes the dock's encoder calls use on a GPU, then the prompts' own views
    assert calls["encode"][:2] == [1, GPU_EMBED_STEP]
    assert all(b == 1 for b in calls["encode"][2:])
    (box, kw_box), (click, kw_click), (fix, _kw) = calls["predict"]
    assert box.box is not None and kw_box.get("near_box")
    assert click.points is not None and click.mask_input is None and kw_click.get("multimask")
    assert fix.mask_input is not None and list(fix.labels) == [1, 0]


def test_warm_gpu_leaves_a_cpu_engine_alone(monkeypatch):
    require_lite_medsam()
    engine = load_engine("lite_medsam", Policy(torch.device("cpu"), "fp32"), cache=EmbeddingCache())
    calls = _spy(engine, monkeypatch)
    assert gpu_warmup.warm_gpu(engine) == 0.0
    assert calls == {"encode": [], "predict": []} and len(engine.cache) == 0


def test_warm_gpu_runs_on_a_cuda_engine(monkeypatch):
    """A CUDA engine is warmed (the device is only read: the work itself is stubbed)."""
    engine = type("E", (), {"policy": Policy(torch.device("cuda"), "fp16")})()
    seen = []
    monkeypatch.setattr(gpu_warmup, "warm", lambda e, b=None: seen.append(e) or 1.5)
    assert gpu_warmup.warm_gpu(engine) == 1.5 and seen == [engine]
    assert gpu_warmup.warm_gpu(type("E", (), {"policy": Policy(torch.device("cpu"))})()) == 0.0 and len(seen) == 1
