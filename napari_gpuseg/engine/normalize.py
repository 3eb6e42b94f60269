"""Intensity normalisation shared by every model and widget."""
from __future__ import annotations

import numpy as np

from .. import io as gio


def normalize_percentile(
    img,
    lo: float = 1.0,
    hi: float = 99.8,
    axis=None,
    clip: bool = False,
    eps: float = 1e-6,
    dtype=np.float32,
) -> np.ndarray:
    """Map the ``lo``/``hi`` percentiles of ``img`` to 0/1 (NaN-safe, any dtype).

    ``axis``: axes over which percentiles are taken (None = whole array, e.g. ``(-2, -1)``
    for per-slice normalisation of a stack). NaNs are ignored for the percentiles and
    become 0 in the output. A constant image maps to zeros. ``clip`` clips to [0, 1].
    """
    x = np.asarray(img)
    if x.dtype == bool:
        x = x.astype(np.uint8)
    x = x.astype(dtype, copy=False)
    finite = np.isfinite(x)
    has_nan = not finite.all()
    if has_nan:
        work = np.where(finite, x, np.nan)
        p_lo, p_hi = np.nanpercentile(work, [lo, hi], axis=axis, keepdims=True)
        p_lo = np.nan_to_num(p_lo, nan=0.0)
        p_hi = np.nan_to_num(p_hi, nan=0.0)
    else:
        p_lo, p_hi = np.percentile(x, [lo, hi], axis=axis, keepdims=True)
    p_lo = p_lo.astype(dtype)
    scale = (p_hi - p_lo).astype(dtype)
    out = (x - p_lo) / np.maximum(scale, eps)
    out = np.where(scale > eps, out, 0).astype(dtype, copy=False)
    if has_nan:
        out[~finite] = 0
    if clip:
        np.clip(out, 0, 1, out=out)
    return out


def normalization_spec(lo: float = 1.0, hi: float = 99.8) -> dict:
    """The dict stored in checkpoints to describe :func:`normalize_percentile`."""
    return {"kind": "percentile", "lo": float(lo), "hi": float(hi)}


def apply_normalization(img, spec: dict | None, axis=None) -> np.ndarray:
    """Apply a normalisation described by ``spec`` (see :func:`normalization_spec`)."""
    spec = spec or normalization_spec()
    kind = spec.get("kind", "percentile")
    if kind == "percentile":
        return normalize_percentile(img, spec.get("lo", 1.0), spec.get("hi", 99.8), axis=axis)
    if kind == "none":
        return np.nan_to_num(np.asarray(img, dtype=np.float32))
    raise ValueError(f"unknown normalisation {kind!r}")


# -- the model's 1-channel input ---------------------------------------------------------
BRIGHT_BACKGROUND = 0.5  # median above this fraction of the 1-99.8 % range: dark objects


def is_color(image, labels_shape=None) -> bool:
    """Whether the last axis of ``image`` holds RGB(A) channels: 3 or 4 values and, when
    ``labels_shape`` is given, one more axis than the labels."""
    image = np.asarray(image)
    if labels_shape is not None and image.ndim != len(labels_shape) + 1:
        return False
    return image.ndim >= 3 and image.shape[-1] in (3, 4)


def to_gray(image) -> np.ndarray:
    """Luminance (ITU-R BT.601) of a (..., 3|4) RGB(A) image as float32; alpha is ignored
    (:func:`napari_gpuseg.io.luminance`: files and arrays are converted alike)."""
    return gio.luminance(image)


def bright_background(gray, axis=(-2, -1), lo: float = 0.1, hi: float = 99.9) -> np.ndarray:
    """True where a plane's median lies above the middle of its ``lo``-``hi`` percentile
    range: a bright background (brightfield, H&E), whose nuclei are darker than it.
    Symmetric percentiles make the inversion of :func:`model_input` final: an inverted
    plane's median lies below the middle, so a second pass leaves it alone.

    Far percentiles keep a sparse fluorescence field (a few nuclei on noise) dark: its
    nuclei set the top of the range. Fluorescence with nuclei puts its median near the
    dark end (all BBBC039 and DSB2018 fluorescence fields here: at most 0.30 of the
    range), every stained or brightfield DSB2018 field near the bright end (at least
    0.61); noise-only fields fall near the middle, either way (nothing to find in them).
    See ``weights/MODEL_CARD.md``."""
    x = np.asarray(gray, dtype=np.float32)
    p_lo, med, p_hi = np.percentile(x, [lo, 50.0, hi], axis=axis, keepdims=True)
    span = p_hi - p_lo
    return (span > 0) & (med - p_lo > BRIGHT_BACKGROUND * span)


def model_input(image, rgb: bool | None = None, axis=(-2, -1)) -> np.ndarray:
    """The one conversion of any image to a 1-channel model input (float32).

    RGB(A) (``rgb``, or detected by :func:`is_color` when None) becomes luminance
    (:func:`to_gray`). Then every plane over ``axis`` whose background is bright
    (:func:`bright_background`) is inverted within its own range, so that nuclei are
    bright on a dark background as in fluorescence; other planes pass unchanged.
    Percentile normalisation (:func:`apply_normalization`) comes after this step.
    Used by U-Net prediction, folder jobs, training and the training docks alike.
    """
    x = np.asarray(image)
    if is_color(x) if rgb is None else rgb:
        x = to_gray(x)
    x = x.astype(np.float32, copy=False)
    if x.ndim < len(axis) or x.size == 0 or not np.isfinite(x).all():
        return x
    flip = bright_background(x, axis)
    if not flip.any():
        return x
    top = x.max(axis=axis, keepdims=True) + x.min(axis=axis, keepdims=True)
    return np.where(flip, top - x, x).astype(np.float32, copy=False)


def image_input(image, channel: int | None = None, rgb: bool | None = None) -> tuple[np.ndarray, bool]:
    """(image, rgb): an in-memory image as folder jobs take an image file, before the method's
    own conversion. A last axis of 3 or 4 values is colour (``rgb`` None; a constant alpha is
    dropped), of 2 values channels; ``channel`` picks one channel of a multichannel (or
    colour) image as a gray image, and a multichannel image without it is refused with the
    folder jobs' message (:func:`napari_gpuseg.io.select_channel`)."""
    x = np.asarray(image)
    rgb = is_color(x) if rgb is None else bool(rgb)
    notes: list[str] = []
    if rgb and x.shape[-1] == 4 and x[..., 3].min() == x[..., 3].max():
        x = x[..., :3]
    elif rgb and x.shape[-1] == 4:
        rgb = False  # a varying 4th "alpha" is data, as for files
    multi = not rgb and x.ndim >= 3 and (x.shape[-1] in (2, 4) or channel is not None)
    loaded = gio.LoadedImage(x, "image", rgb, notes, int(x.shape[-1]) if multi else 0)
    out = gio.select_channel(loaded, channel)
    return out.data, out.rgb
