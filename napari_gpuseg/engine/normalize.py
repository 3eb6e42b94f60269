"""Intensity normalisation shared by every model and widget."""
from __future__ import annotations

import numpy as np


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
