"""Turning user images into SAM encoder inputs: contrast, channels, per-model preprocessing."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from .cache import image_digest
from ...normalize import normalize_percentile
from .views import View

SAM_PIXEL_MEAN = (123.675, 116.28, 103.53)
SAM_PIXEL_STD = (58.395, 57.12, 57.375)


@dataclass
class PreparedImage:
    """An image normalised once to float [0, 1], (3, H, W), with its content digest."""

    tensor: torch.Tensor  # (3, H, W) float32 on CPU
    digest: str

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.tensor.shape[1]), int(self.tensor.shape[2])


def to_rgb01(image: np.ndarray, contrast: tuple[float, float] = (0.0, 100.0)) -> np.ndarray:
    """Any gray (YX) or colour (YXC, C in 1/3/4) image of any dtype -> float32 (H, W, 3) in [0, 1].

    uint8 images are divided by 255 (as the official predictor sees them); every other
    dtype is mapped by the ``contrast`` percentiles over the whole image (default 0-100:
    min-max, which measured best with LiteMedSAM on BBBC039 against 1-99.8 % clipping on
    native-resolution crops; docs/benchmarks.md). NaNs become 0.
    """
    a = np.asarray(image)
    if a.ndim == 3 and a.shape[-1] in (1, 3, 4):
        a = a[..., :3]
    elif a.ndim != 2:
        raise ValueError(
            f"SAM expects a 2D gray (Y, X) or colour (Y, X, C) image, got shape {a.shape}; "
            "pass one slice of a stack at a time"
        )
    if a.size == 0:
        raise ValueError(f"image is empty (shape {a.shape})")
    if a.dtype.kind in "fc" and not np.isfinite(a).any():
        raise ValueError("image has no finite pixels (all NaN or infinite)")
    if a.dtype == np.uint8:
        out = a.astype(np.float32) / 255.0
    elif a.dtype == bool:
        out = a.astype(np.float32)
    elif np.issubdtype(a.dtype, np.number) and not np.iscomplexobj(a):
        out = normalize_percentile(a, *contrast, clip=True)
    else:
        raise ValueError(f"unsupported image dtype {a.dtype}")
    if out.ndim == 2:
        out = np.repeat(out[..., None], 3, axis=-1)
    elif out.shape[-1] == 1:
        out = np.repeat(out, 3, axis=-1)
    return np.ascontiguousarray(out, dtype=np.float32)


def prepare_image(image: np.ndarray, contrast: tuple[float, float] = (0.0, 100.0)) -> PreparedImage:
    rgb = to_rgb01(image, contrast)
    digest = image_digest(np.asarray(image)) + f"|c{contrast[0]:g}-{contrast[1]:g}"
    return PreparedImage(torch.from_numpy(rgb).permute(2, 0, 1).contiguous(), digest)


def normalize_input(crop: torch.Tensor, normalization: str) -> torch.Tensor:
    """A model's pixel normalisation of a (3, h, w) crop in [0, 1] (before padding)."""
    if normalization == "minmax":  # LiteMedSAM: min-max to [0, 1], no mean/std
        lo, hi = crop.amin(), crop.amax()
        return (crop - lo) / torch.clamp(hi - lo, min=1e-8)
    if normalization == "sam":  # official SAM: 0..255 then ImageNet-style mean/std
        mean = torch.tensor(SAM_PIXEL_MEAN).view(3, 1, 1)
        std = torch.tensor(SAM_PIXEL_STD).view(3, 1, 1)
        return (crop * 255.0 - mean) / std
    if normalization != "none":
        raise ValueError(f"unknown SAM normalisation {normalization!r}")
    return crop


def view_input(prepared: PreparedImage, view: View, normalization: str) -> torch.Tensor:
    """The (3, S, S) encoder input for one view: crop, resize longest side, normalise, pad."""
    crop = prepared.tensor[:, view.y0:view.y1, view.x0:view.x1]
    rh, rw = view.resized_hw
    if (rh, rw) != (view.h, view.w):
        crop = F.interpolate(crop[None], size=(rh, rw), mode="bilinear", align_corners=False,
                             antialias=rh < view.h)[0]
    crop = normalize_input(crop, normalization)
    s = view.input_size
    return F.pad(crop, (0, s - rw, 0, s - rh))


def logits_to_view_mask(low_res: torch.Tensor, view: View) -> torch.Tensor:
    """(N, L, L) low-res logits -> (N, h, w) logits at the view's native resolution."""
    s = view.input_size
    x = F.interpolate(low_res[:, None].float(), size=(s, s), mode="bilinear", align_corners=False)
    rh, rw = view.resized_hw
    x = x[..., :rh, :rw]
    if (rh, rw) != (view.h, view.w):
        x = F.interpolate(x, size=(view.h, view.w), mode="bilinear", align_corners=False)
    return x[:, 0]


def view_logits_to_low_res(logits: torch.Tensor, view: View, low_res: torch.Tensor) -> torch.Tensor:
    """(h, w) logits at the view's native resolution -> (L, L) low-res logits of the view, the
    inverse of :func:`logits_to_view_mask`; the model input's padding keeps ``low_res``'s."""
    s = view.input_size
    side = low_res.shape[-1]
    canvas = F.interpolate(low_res[None, None].float(), size=(s, s), mode="bilinear", align_corners=False)
    rh, rw = view.resized_hw
    x = logits[None, None].float()
    if (rh, rw) != (view.h, view.w):
        x = F.interpolate(x, size=(rh, rw), mode="bilinear", align_corners=False)
    canvas[..., :rh, :rw] = x
    return F.interpolate(canvas, size=(side, side), mode="bilinear", align_corners=False, antialias=True)[0, 0]
