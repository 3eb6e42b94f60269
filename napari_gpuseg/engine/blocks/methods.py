"""Methods on blocks: one intensity scale for the whole image, then the folder-job method
(:mod:`napari_gpuseg.engine.jobs.registry`) on each block's extended region.

Per-image percentile normalisation would give every block its own scale and objects
would change at seams, so the 1 / 99.8 % percentiles (and, for the threshold method, the
Otsu threshold) are measured once on a strided sample of the whole image, and each block
is mapped with them: the U-Net gets the globally normalised block (its own normalisation
off); the threshold method gets the global threshold expressed in the block's own scale,
which gives the same mask as thresholding the whole image. GUI-free.
"""
from __future__ import annotations

import math

import numpy as np

from ..jobs.registry import SegResult, method_factory
from .plan import BlockPlan

SAMPLE_VALUES = 4_000_000  # values of the strided sample the global scale is measured on


def sample_stride(shape, values: int = SAMPLE_VALUES) -> int:
    n = int(np.prod(shape))
    return max(1, math.ceil((n / values) ** (1.0 / len(shape))))


def image_stats(source, plan: BlockPlan, sigma: float = 2.0, lo: float = 1.0, hi: float = 99.8,
                cancel=None) -> dict:
    """Global scale of ``source`` (``.read(region)``) from a strided sample read block by
    block: percentiles ``lo``/``hi`` and the Otsu threshold of the blurred image (raw
    units; blurred per extended block, sampled in the cores)."""
    from skimage.filters import gaussian, threshold_otsu

    s = sample_stride(plan.shape)
    parts, blurred = [], []
    for b in plan.blocks:
        if cancel is not None:
            cancel.check()
        x = np.asarray(source.read(b.ext_slices()), dtype=np.float32)
        core = tuple(slice(c0 - e0 + (-c0) % s, c1 - e0, s) for (c0, c1), (e0, _) in zip(b.core, b.ext))
        parts.append(x[core].ravel())
        if sigma:  # blurred with the halo's context, as the whole image would be
            x = gaussian(x, sigma=sigma, preserve_range=True)
        blurred.append(x[core].ravel())
        del x
    sample = np.concatenate(parts)
    p_lo, p_hi = (float(v) for v in np.percentile(sample, [lo, hi]))
    smooth = np.concatenate(blurred)
    otsu = float(threshold_otsu(smooth)) if float(smooth.max() - smooth.min()) > 1e-6 else p_hi
    return {"lo": p_lo, "hi": p_hi, "otsu": otsu, "stride": s}


class BlockMethod:
    """A folder-job method applied to blocks with one global intensity scale."""

    def __init__(self, method: str, options: dict | None = None):
        self.method = method
        self.options = dict(options or {})
        self.seg = method_factory(method, **self.options)()
        self.name = self.seg.name

    def load(self, policy) -> None:
        self.seg.load(policy)

    def _global(self, x: np.ndarray, stats: dict) -> np.ndarray:
        scale = max(stats["hi"] - stats["lo"], 1e-6)
        return ((np.asarray(x, np.float32) - stats["lo"]) / scale).astype(np.float32)

    def labels(self, block: np.ndarray, stats: dict) -> SegResult:
        """Instance labels (ids 1..n) of one block's extended region."""
        seg = self.seg
        if self.name == "threshold":
            return self._threshold(block, stats)
        x = self._global(block, stats)
        if self.name == "unet":
            seg.options["normalization"] = {"kind": "none"}
        x = seg.prepare(x, False)
        raw = seg.segment([x])[0]  # a SegResult, or raw output finish() turns into one
        res = raw if isinstance(raw, SegResult) else seg.finish(raw)
        return res if isinstance(res, SegResult) else SegResult(np.asarray(res))

    def _threshold(self, block: np.ndarray, stats: dict) -> SegResult:
        """The global threshold in this block's own 1-99.8 % scale (the classical method
        normalises each image), so the mask equals the whole image's."""
        user_t = self.options.get("threshold")
        raw_t = (stats["lo"] + float(user_t) * (stats["hi"] - stats["lo"]) if user_t is not None
                 else stats["otsu"])
        b_lo, b_hi = (float(v) for v in np.percentile(np.asarray(block, np.float32), [1.0, 99.8]))
        if b_hi - b_lo <= 1e-6:  # a flat block: nothing or everything is above the threshold
            return SegResult(np.zeros(block.shape, np.int32))
        self.seg.options["threshold"] = (raw_t - b_lo) / (b_hi - b_lo)
        x = self.seg.prepare(np.asarray(block), False)
        return self.seg.segment([x])[0]

