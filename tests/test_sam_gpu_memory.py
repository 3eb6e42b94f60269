"""GPU and platform correctness, second pass, on the SAM side, without a GPU: non-finite
embeddings in worker jobs, low-res logits and full-size masks not held on the device,
embeddings not copied again, short background steps, field blocks (no autotuning, OOM
handled outside ``except``) and the shape of box arrays. Device surfaces are mocked."""
from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from napari_gpuseg.engine.runtime import batching, device as dev
from napari_gpuseg.engine.runtime.device import Policy
from napari_gpuseg.engine.runtime.worker import InferenceWorker

from gpu_fixtures import BF16, FP32, blob_image as _image, cpu_autocast as _cpu_autocast, stub_lite_sam
from gpu_fixtures import _clean_pins, worker_bf16  # noqa: F401 - fixtures




@pytest.fixture(scope="module")
def lite_sam():
    return stub_lite_sam()


def _engine(sam, policy=FP32):
    from napari_gpuseg.engine.sam.interactive.predictor import SamEngine, SamModelInfo

    return SamEngine(sam, SamModelInfo("lite", 256, "minmax"), policy)


# ------------------------------------------------------------------ 1: non-finite embeddings
def test_nan_embedding_in_a_worker_job_is_recomputed_in_fp32_and_cached_finite(lite_sam, worker_bf16):
    img = _image()
    ref_eng = _engine(lite_sam)
    prepared = ref_eng.embed([img])[0]
    view = ref_eng.views(prepared)[0]
    ref = ref_eng.embedding(prepared, view)
    encoder = lite_sam.image_encoder
    real = encoder.forward
    encoder.forward = lambda x: real(x) * float("nan") if _cpu_autocast() else real(x)
    try:
        eng = _engine(lite_sam, BF16)
        with pytest.warns(RuntimeWarning, match="non-finite image embedding in bf16"):
            worker_bf16.submit(eng.embed, [img]).result(timeout=60)
        got = eng.cache.get(eng._key(eng.prepare(img), view))
        assert got is not None and torch.isfinite(got).all()
        torch.testing.assert_close(got, ref, atol=0, rtol=0)
    finally:
        encoder.forward = real


def test_a_non_finite_embedding_is_never_cached(lite_sam, worker_bf16):
    encoder = lite_sam.image_encoder
    real = encoder.forward
    encoder.forward = lambda x: real(x) * float("nan")  # NaN in fp32 too
    try:
        eng = _engine(lite_sam, BF16)
        img = eng.prepare(_image())
        view = eng.views(img)[0]
        with pytest.warns(RuntimeWarning, match="re-ran in fp32"):
            worker_bf16.submit(eng.embed, [img]).result(timeout=60)
        assert eng._key(img, view) not in eng.cache
        with pytest.raises(FloatingPointError, match="not finite"):
            worker_bf16.submit(eng.embedding, img, view).result(timeout=60)
    finally:
        encoder.forward = real
    # the image's next embedding is computed again, and finite now
    assert torch.isfinite(worker_bf16.submit(eng.embedding, img, view).result(timeout=60)).all()


# ------------------------------------------------------------------ 6: low-res logits not held
def test_stack_results_hold_no_low_res_logits(lite_sam):
    from napari_gpuseg.engine.sam.automatic.box_stack import segment_box_planes
    from napari_gpuseg.engine.sam.automatic.everything import AutomaticParams, segment_everything_batch

    eng = _engine(lite_sam)
    planes = [_image(0), _image(1)]
    boxes = [np.array([[80.0, 60, 150, 120], [10, 10, 40, 40]]), np.array([[80.0, 60, 150, 120]])]
    results = segment_box_planes(eng, planes, boxes, min_area=0)
    assert sum(len(r.masks) for r in results) == 3
    assert all(m.low_res is None for r in results for m in r.masks)
    params = AutomaticParams(points_per_side=4, pred_iou_thresh=0.0, stability_score_thresh=0.0)
    every = segment_everything_batch(eng, planes, params, keep_logits=False)
    assert sum(len(r.masks) for r in every) > 0
    assert all(m.low_res is None for r in every for m in r.masks)


def test_kept_box_logits_are_host_fp32(lite_sam):
    from napari_gpuseg.engine.sam.automatic.boxes import segment_boxes

    res = segment_boxes(_engine(lite_sam), _image(), np.array([[80.0, 60, 150, 120]]))
    low = res.masks[0].low_res
    assert low.device.type == "cpu" and low.dtype == torch.float32 and low.shape == (256, 256)


# ------------------------------------------------------------------ 8: GPU memory held by prompts
def test_predict_renders_full_size_masks_a_block_at_a_time(lite_sam, monkeypatch):
    from napari_gpuseg.engine.sam.interactive import decode_call, predictor

    eng = _engine(lite_sam)
    img = eng.embed([_image()])[0]
    prompts = [predictor.Prompt(box=[80 + i, 60, 150, 120 - i]) for i in range(10)]
    whole = eng.predict(img, prompts)
    sizes = []
    real = decode_call.logits_to_view_mask
    monkeypatch.setattr(decode_call, "logits_to_view_mask", lambda low, v: sizes.append(len(low)) or real(low, v))
    monkeypatch.setattr(eng, "MASK_RENDER_BYTES", 3 * 4 * 256 * 256, raising=False)  # 3 prompts' logits
    blocks = eng.predict(img, prompts)
    assert sizes and max(sizes) <= 3 and sum(sizes) == 10
    for a, b in zip(whole, blocks):
        assert np.array_equal(a.mask, b.mask)


def test_a_memoised_embedding_is_not_copied_to_the_device_again(lite_sam, monkeypatch):
    from napari_gpuseg.engine.sam.interactive.predictor import Prompt

    eng = _engine(lite_sam)
    img = eng.embed([_image()])[0]
    prompt = Prompt(box=[80, 60, 150, 120])
    first = eng.predict(img, [prompt])[0]
    view = eng.route(img, prompt)
    key = eng._key(img, view)
    emb = eng.cache.get(key)
    # the cached embedding replaced by one that cannot be copied anywhere: the decoder memo
    # holds everything the next prompt needs, so nothing may read or copy it
    meta = torch.empty(emb.shape, dtype=emb.dtype, device="meta")
    real_get = eng.cache.get
    monkeypatch.setattr(eng.cache, "get", lambda k: meta if k == key else real_get(k))
    again = eng.predict(img, [prompt])[0]
    assert np.array_equal(again.mask, first.mask)


def test_box_mode_does_not_copy_a_memoised_embedding_again(lite_sam, monkeypatch):
    from napari_gpuseg.engine.sam.automatic.boxes import segment_boxes

    eng = _engine(lite_sam)
    boxes = np.array([[80.0, 60, 150, 120], [20, 20, 60, 50]])
    first = segment_boxes(eng, _image(), boxes)
    real_get = eng.cache.get

    def meta_get(key):  # every embedding: one that cannot be read or copied
        emb = real_get(key)
        return None if emb is None else torch.empty(emb.shape, dtype=emb.dtype, device="meta")

    monkeypatch.setattr(eng.cache, "get", meta_get)
    again = segment_boxes(eng, _image(), boxes)
    assert np.array_equal(again.labels, first.labels)


# ------------------------------------------------------------------ 9: short background steps on a GPU
def test_background_embedding_steps_are_one_or_two_views_on_a_gpu(lite_sam, monkeypatch):
    eng = _engine(lite_sam)
    eng.policy = Policy(torch.device("cuda", 0), "fp32")  # as on a GPU with 40 GB free
    monkeypatch.setattr(batching, "free_bytes", lambda d: 40 * 2**30)
    img = eng.prepare(_image(0, (600, 760)))
    views = eng.views(img)
    assert len(views) >= 6
    steps = []

    def fake_embed(images, views, batch_size=None, cancel=None, progress=None):
        steps.append(len(views[0]))
        for v in views[0]:
            eng.cache.put(eng._key(images[0], v), torch.zeros(1))

    monkeypatch.setattr(eng, "embed", fake_embed)
    assert list(eng.embed_steps(img))
    assert sum(steps) == len(views) and max(steps) <= 2


# ------------------------------------------------------------------ 10, 15: field blocks
def _field_engine():
    from test_box_field import _engine as field_engine

    return field_engine()


def test_field_blocks_are_encoded_without_cudnn_autotuning(monkeypatch):
    from napari_gpuseg.engine.sam.interactive import field_map as fieldmap

    eng = _field_engine()
    asked = []
    real = Policy.autocast
    monkeypatch.setattr(Policy, "autocast", lambda self, benchmark=False: asked.append(benchmark) or real(self))
    img = eng.prepare(np.random.default_rng(1).random((300, 520)).astype(np.float32))
    assert fieldmap.embed_field(eng, img) is not None
    assert asked and not any(asked)
    asked.clear()
    eng.embed([img], [eng.views(img)[:1]])  # a view has the model's one input size: tuned
    assert asked == [True]


def test_field_oom_empties_the_cache_outside_the_except_block(monkeypatch):
    from napari_gpuseg.engine.sam.interactive import field_map as fieldmap

    eng = _field_engine()
    img = eng.prepare(np.random.default_rng(1).random((100, 120)).astype(np.float32))

    def oom(_x):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")

    monkeypatch.setattr(eng, "encode", oom)
    handling = []
    monkeypatch.setattr(fieldmap, "empty_cache", lambda d=None: handling.append(sys.exc_info()[0]))
    assert fieldmap.embed_field(eng, img) is None
    assert handling == [None]  # called once no exception (and no traceback) is held


def test_segment_boxes_takes_one_1d_box(lite_sam):
    from napari_gpuseg.engine.sam.automatic.boxes import segment_boxes

    eng = _engine(lite_sam)
    one = segment_boxes(eng, _image(), np.array([80, 60, 150, 120]))
    two = segment_boxes(eng, _image(), np.array([[80, 60, 150, 120]]))
    assert len(one.masks) == 1 and np.array_equal(one.labels, two.labels) and one.labels.max() == 1


@pytest.mark.parametrize("boxes", [np.array([10, 10, 40]), np.zeros((2, 5)), np.zeros((1, 2, 4)), "abc"])
def test_segment_boxes_refuses_other_shapes_before_any_work(lite_sam, monkeypatch, boxes):
    from napari_gpuseg.engine.sam.automatic.boxes import segment_boxes

    eng = _engine(lite_sam)

    def no_work(*_a, **_k):
        raise AssertionError("the image was prepared or embedded before the boxes were checked")

    monkeypatch.setattr(eng, "prepare", no_work)
    monkeypatch.setattr(eng, "embed", no_work)
    with pytest.raises(ValueError, match=r"boxes must be \(N, 4\)"):
        segment_boxes(eng, _image(), boxes)
