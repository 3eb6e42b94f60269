"""Box mode's field map: native views cut from one embedding of the whole image.

Geometry and block assembly run on stand-in encoders (an exactly local convolution stack
that, like TinyViT, takes any input size); quality and encoder work run the real
LiteMedSAM on a real BBBC039 validation field (skipped without the checkpoint).
"""
from __future__ import annotations

import logging

import numpy as np
import pytest
import tifffile
import torch
from torch import nn

from napari_gpuseg.engine.detect import boxes_from_labels
from napari_gpuseg.engine.metrics import pooled_stats
from napari_gpuseg.engine.runtime.device import Policy
from napari_gpuseg.engine.sam.interactive import field_map as fieldmap
from napari_gpuseg.engine.sam.automatic.boxes import choose_views, prepare_boxes, segment_boxes
from napari_gpuseg.engine.sam.interactive.inputs import view_input
from napari_gpuseg.engine.sam.interactive.predictor import SamEngine, SamModelInfo
from napari_gpuseg.engine.sam.interactive.views import View

S, STRIDE = 64, 4
FP32 = Policy(torch.device("cpu"), "fp32")


class LocalEncoder(nn.Module):
    """Stride-4 convolutions, receptive field 3 embedding cells: any input size embeds."""

    size_agnostic = True

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.down = nn.Conv2d(3, 8, 4, stride=4)
        self.mix = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        return self.mix(torch.tanh(self.down(x)))


class StubSam(nn.Module):
    def __init__(self, encoder: nn.Module):
        super().__init__()
        self.image_encoder = encoder
        self.prompt_encoder = nn.Module()
        self.prompt_encoder.image_embedding_size = (S // STRIDE, S // STRIDE)


def _engine(encoder=None) -> SamEngine:
    return SamEngine(StubSam(encoder or LocalEncoder()), SamModelInfo("stub", S, "none"), FP32)


def test_spans_tile_the_axis_with_bounded_blocks_and_context():
    for length in (4, 64, 256, 260, 1000, 2048):
        for block in (16, 64, 100, 768):
            parts = fieldmap.spans(length, STRIDE, block)
            kept = [k for _s, _e, k0, k1 in parts for k in range(k0, k1)]
            assert kept == list(range(length))
            for s, e, k0, k1 in parts:
                assert all(v % STRIDE == 0 for v in (s, k0, k1)) and s <= k0 < k1 <= e <= length
                assert e - s <= max(4 * STRIDE, block // STRIDE * STRIDE)
                assert k0 - s == min(k0, k0 - s) and (s == 0 or k0 - s >= STRIDE)  # context before
                assert e == length or e - k1 >= STRIDE  # and after, inside the image


def test_field_in_blocks_equals_one_pass(monkeypatch):
    eng = _engine()
    img = eng.prepare(np.random.default_rng(1).random((300, 520)).astype(np.float32))
    one = fieldmap.embed_field(eng, img)
    assert one.shape == (8, 75, 130)
    eng.cache.clear()
    monkeypatch.setattr(fieldmap, "BLOCK", 96)  # 300 x 520 in 24 blocks
    calls = []
    real = eng.encode
    monkeypatch.setattr(eng, "encode", lambda x: calls.append(x.shape) or real(x))
    blocks = fieldmap.embed_field(eng, img)
    assert len(calls) > 4 and max(max(c[2:]) for c in calls) <= 96
    torch.testing.assert_close(blocks, one, atol=1e-5, rtol=1e-5)
    assert fieldmap.embed_field(eng, img) is blocks  # from the cache the second time


def test_a_cut_view_matches_the_views_own_embedding_away_from_its_edges():
    eng = _engine()
    img = eng.prepare(np.random.default_rng(2).random((200, 260)).astype(np.float32))
    fmap = fieldmap.embed_field(eng, img)
    for v in (View(0, 0, S, S, S), View(40, 72, S, S, S), View(136, 196, S, S, S)):
        assert fieldmap.holds(v, STRIDE)
        cut = fieldmap.view_embedding(fmap, v, STRIDE)
        own = eng.encode(view_input(img, v, "none")[None])[0]
        assert cut.shape == own.shape == (8, 16, 16)
        # a 3x3 mix sees one cell past the view's edge: the field has the neighbour there, the view zeros
        torch.testing.assert_close(cut[:, 1:-1, 1:-1], own[:, 1:-1, 1:-1], atol=1e-5, rtol=1e-5)
    assert not fieldmap.holds(View(41, 72, S, S, S), STRIDE)  # off the stride's grid
    assert not fieldmap.holds(View(0, 0, 60, S, S), STRIDE)  # not a full native view
    assert fieldmap.field_stride(SamEngine(StubSam(nn.Conv2d(3, 8, 4, 4)), SamModelInfo("vit", S, "none"),
                                           FP32)) is None  # no size_agnostic flag: no field map


@pytest.mark.parametrize("shape", [(520, 696), (524, 700)])
def test_field_plan_holds_every_box_on_the_strides_grid(shared_data, shape):
    """The 520 x 696 BBBC039 field's boxes (also in a larger image): every native view is
    cut from the map, every box is held with its margin, and the plan needs fewer encoder
    passes than the tile plan."""
    from napari_gpuseg.engine.sam.automatic.boxes import encoder_passes

    eng = SamEngine(StubSam(LocalEncoder()), SamModelInfo("stub", 256, "none"), FP32)
    eng.sam.prompt_encoder.image_embedding_size = (64, 64)
    gt = tifffile.imread(sorted((shared_data / "bbbc039" / "masks").glob("*.tif"))[-1])
    labels = np.zeros(shape, gt.dtype)
    labels[:520, :696] = gt
    img = eng.prepare(np.zeros(shape, np.float32))
    boxes = boxes_from_labels(labels)
    raw, padded = prepare_boxes(boxes, shape, 0.0), prepare_boxes(boxes, shape, 2.0)
    views, stride = choose_views(eng, img, padded, raw, 16.0, STRIDE)
    assert stride == STRIDE
    native = [v for v in set(views) if v.scale == 1.0]
    assert native and all(fieldmap.holds(v, STRIDE) for v in native)
    side = (raw[:, 2:] - raw[:, :2]).max(1) + 1
    for v, b, s in zip(views, padded, side):
        margin = 4.0 if v.scale <= 1 else 0.0
        grown = np.clip(b + [-margin, -margin, margin, margin], 0, [shape[1] - 1, shape[0] - 1] * 2)
        assert v.contains_box(grown) or s < 16
    tiles, none = choose_views(eng, img, padded, raw, 16.0, None)
    assert none is None
    assert encoder_passes(eng, img, views, STRIDE) < encoder_passes(eng, img, tiles) - 3


def test_sides_off_the_strides_grid_still_hold_every_box(shared_data):
    """521 x 699: aligned views cannot reach the last pixels, so boxes there get views of
    their own (or the whole plan stays on tiles); every box is still held."""
    eng = SamEngine(StubSam(LocalEncoder()), SamModelInfo("stub", 256, "none"), FP32)
    eng.sam.prompt_encoder.image_embedding_size = (64, 64)
    shape = (521, 699)
    boxes = np.array([[600, 480, 699, 521], [0, 0, 40, 40], [300, 200, 340, 250], [690, 10, 699, 60]], float)
    img = eng.prepare(np.zeros(shape, np.float32))
    raw, padded = prepare_boxes(boxes, shape, 0.0), prepare_boxes(boxes, shape, 2.0)
    for stride in (STRIDE, None):
        views, _ = choose_views(eng, img, padded, raw, 16.0, stride)
        assert len(views) == len(padded) == 4  # one view per box, so the zip below sees them all
        assert all(v.contains_box(b) for v, b in zip(views, padded))


def test_small_images_and_one_sided_ones_keep_their_own_views():
    eng = SamEngine(StubSam(LocalEncoder()), SamModelInfo("stub", 256, "none"), FP32)
    eng.sam.prompt_encoder.image_embedding_size = (64, 64)
    for shape in ((200, 1000), (180, 240)):
        img = eng.prepare(np.zeros(shape, np.float32))
        boxes = np.array([[10, 10, 60, 60], [150, 20, 190, 70]], float)
        raw, padded = prepare_boxes(boxes, shape, 0.0), prepare_boxes(boxes, shape, 2.0)
        assert choose_views(eng, img, padded, raw, 16.0, STRIDE)[1] is None


# -- the real model ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def lite_engine():
    from sam_fixtures import require_lite_medsam

    require_lite_medsam()
    from napari_gpuseg.engine.sam.loader import load_engine

    return load_engine("lite_medsam", FP32)


@pytest.fixture(scope="module")
def corner_runs(lite_engine, shared_data):
    """Box mode on a 300 x 400 corner of a held-out BBBC039 field with its ground-truth boxes,
    native views only, run once with ``field=False`` and once with the default: per run the
    encoder's input shapes, the pixels it encoded, and the labels (the two tests below read
    the same two runs)."""
    f = sorted((shared_data / "bbbc039" / "images").glob("*.tif"))[-2]
    image = tifffile.imread(f)[:300, :400]
    gt = tifffile.imread(shared_data / "bbbc039" / "masks" / f.name)[:300, :400]
    boxes = boxes_from_labels(gt)
    shapes = []
    real = lite_engine.encode
    runs = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lite_engine, "encode", lambda x: shapes.append(tuple(x.shape)) or real(x))
        for field in (False, None):
            lite_engine.cache.clear()
            shapes.clear()
            kw = {} if field is None else {"field": field}
            res = segment_boxes(lite_engine, image, boxes, padding=2, zoom_small=False, **kw)
            runs[field] = (list(shapes), res.labels)
    lite_engine.cache.clear()
    return gt, runs


@pytest.mark.usefixtures("reuse_embeddings")
@pytest.mark.slow
def test_field_box_mode_on_a_real_field_is_as_good_with_fewer_encoder_passes(corner_runs):
    """A 300 x 400 corner of a held-out BBBC039 field (4 tiles or a field map 1.8 inputs
    large), ground-truth boxes, native views only: the field map (box mode's default for
    this model; the next test checks that it is the field map) gives the same F1 as the
    tiles with about half the encoder work (counted in encoded pixels)."""
    gt, runs = corner_runs
    scores, work = {}, {}
    for field, use in ((False, False), (None, True)):
        shapes, labels = runs[field]
        m = pooled_stats([gt], [labels], 0.5)
        scores[use], work[use] = 2 * m.tp / (2 * m.tp + m.fp + m.fn), sum(b * h * w for b, _c, h, w in shapes)
    print(f"\nF1@0.5 tiles {scores[False]:.3f}, field map {scores[True]:.3f}")
    assert work[True] == 300 * 400 and work[False] == 4 * 256 * 256
    assert scores[True] >= 0.9 and scores[True] >= scores[False] - 0.02, scores


def test_box_mode_cuts_native_views_from_the_field_unless_told_not_to(corner_runs):
    _gt, runs = corner_runs
    for field, expected in ((False, {(256, 256)}), (None, {(300, 400)})):
        shapes, _labels = runs[field]
        assert {s[2:] for s in shapes} == expected, (field, shapes)


def test_local_minmax_stretches_each_neighbourhood_to_its_own_range():
    """A dim object far from a bright one is stretched as a view around it would be
    (nearly to 1), not to its share of the field's maximum; a flat image stays finite."""
    x = torch.full((3, 64, 256), 0.1)
    x[:, 28:36, 20:28] = 0.3  # dim object
    x[:, 28:36, 228:236] = 1.0  # bright object, 200 px away
    out = fieldmap.local_minmax(x, window=64)
    assert out.shape == x.shape and out.dtype == torch.float32
    assert out[0, 32, 24] > 0.9 and out[0, 32, 232] > 0.9  # both objects near their window's top
    assert out[0, 5, 5] < 0.1 and out[0, 5, 250] < 0.1  # background near 0 on both sides
    plain = fieldmap.normalize_input(x, "minmax")
    assert plain[0, 32, 24] < 0.3  # a global stretch leaves the dim object dim
    flat = fieldmap.local_minmax(torch.full((3, 32, 32), 0.5), window=16)
    assert torch.isfinite(flat).all() and float(flat.abs().max()) == 0.0


def test_field_input_normalises_locally_for_min_max_models_only():
    """Two checkerboards 200 px apart, (0.2, 0.4) on the left and (0.6, 1.0) on the right: a
    min-max model's field stretches each to [0, 1] on its own (a global stretch would give
    0, 0.25 on the left); the others get their own normalisation, the same everywhere."""
    yy, xx = np.mgrid[:40, :400]
    odd = (yy + xx) % 2 == 1
    left = xx < 200
    lo = np.where(left, 0.2, 0.6)
    hi = np.where(left, 0.4, 1.0)
    img = torch.from_numpy(np.where(odd, hi, lo).astype(np.float32)).expand(3, 40, 400).contiguous()
    prepared = type("P", (), {"tensor": img})()
    checker = torch.from_numpy(odd.astype(np.float32)).expand(3, 40, 400)
    mean = torch.tensor([123.675, 116.28, 103.53]).view(3, 1, 1)
    std = torch.tensor([58.395, 57.12, 57.375]).view(3, 1, 1)
    far = np.r_[0:100, 300:400]  # columns more than a window and 4 sigma from the seam
    for norm, want in (("minmax", checker), ("sam", (img * 255 - mean) / std), ("none", img)):
        eng = SamEngine(StubSam(LocalEncoder()), SamModelInfo("stub", S, norm), FP32)
        got = fieldmap.field_input(eng, prepared)
        assert got.shape == img.shape
        torch.testing.assert_close(got[..., far], want[..., far], atol=1e-4, rtol=1e-4)


@pytest.mark.usefixtures("reuse_embeddings")
def test_field_out_of_memory_falls_back_to_views(lite_engine, shared_data, monkeypatch, caplog):
    f = sorted((shared_data / "bbbc039" / "images").glob("*.tif"))[-2]
    image = tifffile.imread(f)[:300, :400]
    gt = tifffile.imread(shared_data / "bbbc039" / "masks" / f.name)[:300, :400]
    boxes = boxes_from_labels(gt)[:10]
    real = lite_engine.encode

    def encode(x):
        if x.shape[2:] != (256, 256):
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(x)

    monkeypatch.setattr(lite_engine, "encode", encode)
    lite_engine.cache.clear()
    with caplog.at_level(logging.WARNING):
        res = segment_boxes(lite_engine, image, boxes, padding=2, zoom_small=False, field=True)
    assert "out of memory" in caplog.text
    assert len(np.unique(res.labels)) > 5


@pytest.mark.usefixtures("reuse_embeddings")
def test_a_stack_whose_field_maps_do_not_fit_the_cache_gives_the_same_labels(lite_engine, shared_data,
                                                                             monkeypatch):
    """Three 260 x 260 planes, a cache that holds one field map: every plane's map is made
    again where it was evicted (at most twice per plane) and the labels are those of a
    cache that holds them all."""
    from napari_gpuseg.engine.sam.automatic.boxes import segment_boxes_batch
    from napari_gpuseg.engine.sam.interactive.cache import EmbeddingCache

    f = sorted((shared_data / "bbbc039" / "images").glob("*.tif"))[-3]
    image = tifffile.imread(f)
    gt = tifffile.imread(shared_data / "bbbc039" / "masks" / f.name)
    cuts = [(slice(0, 260), slice(0, 260)), (slice(200, 460), slice(300, 560)), (slice(260, 520), slice(436, 696))]
    planes, boxes = [image[c] for c in cuts], [boxes_from_labels(gt[c]) for c in cuts]
    calls = []
    real = lite_engine.encode
    monkeypatch.setattr(lite_engine, "encode", lambda x: calls.append(tuple(x.shape[2:])) or real(x))
    results = {}
    for size in (1 << 30, 5 << 20):
        monkeypatch.setattr(lite_engine, "cache", EmbeddingCache(size))
        calls.clear()
        results[size] = segment_boxes_batch(lite_engine, planes, boxes, padding=2, zoom_small=False, field=True)
        assert all(c == (260, 260) for c in calls), calls  # field maps only
        if size == 1 << 30:
            assert len(calls) == 3  # one map per plane
        else:
            assert 3 < len(calls) <= 6  # evicted maps made again, each at most once more
    for a, b in zip(results[1 << 30], results[5 << 20]):
        np.testing.assert_array_equal(a.labels, b.labels)
        assert len(np.unique(a.labels)) > 3
