"""Methods on blocks: one intensity scale for the whole image, then the folder-job method
(:mod:`napari_gpuseg.engine.jobs.method_registry`) on each block's extended region.

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

from ..jobs.method_registry import SegResult, method_factory
from .plan import BlockPlan

SAMPLE_VALUES = 4_000_000  # values of the strided sample the global scale is measured on
MAX_SLICE_HISTOGRAMS = 128  # exact per-slice percentiles up to this many slices (0.5 MB each)


def sample_stride(shape, values: int = SAMPLE_VALUES) -> int:
    n = int(np.prod(shape))
    return max(1, math.ceil((n / values) ** (1.0 / len(shape))))


def _percentiles_from_counts(counts: np.ndarray, qs) -> list[float]:
    """``np.percentile`` (linear) of the values whose histogram is ``counts`` (value i
    counted ``counts[i]`` times): exact for integer images."""
    cum = np.cumsum(counts)
    n = int(cum[-1])
    out = []
    for q in qs:
        rank = q / 100.0 * (n - 1)
        lo, hi = int(np.floor(rank)), int(np.ceil(rank))
        v_lo = float(np.searchsorted(cum, lo, side="right"))
        v_hi = float(np.searchsorted(cum, hi, side="right"))
        out.append(v_lo + (rank - lo) * (v_hi - v_lo))
    return out


class NothingToSegment(ValueError):
    """Every pixel of the image is NaN or infinite."""


def clean(x: np.ndarray, stats: dict) -> np.ndarray:
    """``x`` with its NaN/inf pixels replaced by the image's finite minimum (``stats["fill"]``,
    set when the image has any), as folder jobs replace them in a whole image."""
    if "fill" not in stats or np.asarray(x).dtype.kind != "f":
        return x
    x = np.asarray(x)
    return np.where(np.isfinite(x), x, x.dtype.type(stats["fill"]))


def image_stats(source, plan: BlockPlan, sigma: float = 2.0, lo: float = 1.0, hi: float = 99.8,
                otsu: bool = False, per_slice: bool = False, cancel=None) -> dict:
    """Global scale of ``source`` (``.read(region)``), read block by block: the ``lo``/``hi``
    percentiles (exact for unsigned images up to 16 bits, from their histogram; else from a
    strided sample) and, with ``otsu``, the Otsu threshold of the blurred image as the whole
    image would give it (a second pass: the blur per extended block, 256 bins over the
    blurred range, in raw units). ``per_slice`` (ZYX): also the percentiles of every
    z-slice (``slice_lo``, ``slice_hi``), as a 2D model normalises a volume slice by slice.
    A float image's NaN/inf pixels count as its finite minimum (``fill``; ``nonfinite``:
    how many), as :func:`clean` gives them to the method; all of them: :class:`NothingToSegment`."""
    from skimage.filters import gaussian, threshold_otsu

    dtype = np.dtype(getattr(source, "dtype", "float32"))
    exact = dtype.kind == "u" and dtype.itemsize <= 2
    floating = dtype.kind == "f"
    counts = np.zeros(2 ** (8 * dtype.itemsize), np.int64) if exact else None
    s = sample_stride(plan.shape)
    parts, b_min, b_max = [], np.inf, -np.inf
    n_bad, f_min, dirty = 0, np.inf, False
    n_z = plan.shape[0] if per_slice and len(plan.shape) == 3 else 0
    z_counts = np.zeros((n_z, counts.size), np.int64) if n_z and exact and n_z <= MAX_SLICE_HISTOGRAMS else None
    z_parts: list[list] = [[] for _ in range(n_z)]
    z_stride = max(1, math.ceil((int(np.prod(plan.shape[1:])) / SAMPLE_VALUES) ** 0.5))

    def blocks(fill=None):
        for b in plan.blocks:
            if cancel is not None:
                cancel.check()
            x = np.asarray(source.read(b.ext_slices()))
            if fill is not None:
                x = clean(x, fill)
            core = tuple(slice(c0 - e0, c1 - e0) for (c0, c1), (e0, _) in zip(b.core, b.ext))
            yield b, x, core

    def blurred(x, core):
        return gaussian(x.astype(np.float32), sigma=sigma, preserve_range=True)[core] if sigma else x[core]

    for b, x, core in blocks():
        c = x[core]
        if floating:
            finite = np.isfinite(c)
            n_fin = int(np.count_nonzero(finite))
            n_bad += c.size - n_fin
            if n_fin:
                f_min = min(f_min, float(c[finite].min()))
            dirty = dirty or n_bad > 0 or not np.isfinite(x).all()
        if n_z:
            zg = b.core[0][0]
            for k in range(c.shape[0]):
                if z_counts is not None:
                    z_counts[zg + k] += np.bincount(c[k].ravel(), minlength=counts.size)
                else:
                    z_parts[zg + k].append(c[k, ::z_stride, ::z_stride].astype(np.float32).ravel())
        if exact:
            counts += np.bincount(c.ravel(), minlength=counts.size)
        else:
            parts.append(c[tuple(slice((-sl.start) % s, None, s) for sl in core)].astype(np.float32).ravel())
        if otsu and not dirty:
            bl = blurred(x, core)
            b_min, b_max = min(b_min, float(bl.min())), max(b_max, float(bl.max()))
    fill = {}
    if n_bad:
        if not np.isfinite(f_min):
            raise NothingToSegment("every pixel is NaN or infinite: nothing to segment")
        fill = {"fill": f_min, "nonfinite": n_bad}

    def sample(values):
        v = np.concatenate(values)
        return np.where(np.isfinite(v), v, np.float32(f_min)) if n_bad else v

    p_lo, p_hi = (_percentiles_from_counts(counts, [lo, hi]) if exact
                  else [float(v) for v in np.percentile(sample(parts), [lo, hi])])
    stats = {"lo": p_lo, "hi": p_hi, "stride": 1 if exact else s, **fill}
    if n_z:
        pairs = [(_percentiles_from_counts(z_counts[z], [lo, hi]) if z_counts is not None
                  else [float(v) for v in np.percentile(sample(z_parts[z]), [lo, hi])]) for z in range(n_z)]
        stats["slice_lo"], stats["slice_hi"] = [p[0] for p in pairs], [p[1] for p in pairs]
    if otsu:
        if dirty:  # the blurred range of the cleaned image (a NaN/inf pixel was seen)
            b_min, b_max = np.inf, -np.inf
            for _b, x, core in blocks(fill):
                bl = blurred(x, core)
                b_min, b_max = min(b_min, float(bl.min())), max(b_max, float(bl.max()))
        if b_max - b_min <= 1e-6:
            stats["otsu"] = b_max
        else:
            hist = np.zeros(256, np.int64)
            for _b, x, core in blocks(fill):
                hist += np.histogram(blurred(x, core), bins=256, range=(b_min, b_max))[0]
            edges = np.linspace(b_min, b_max, 257)
            stats["otsu"] = float(threshold_otsu(hist=(hist, (edges[:-1] + edges[1:]) / 2)))
    return stats


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

    def labels(self, block: np.ndarray, stats: dict, z0: int = 0) -> SegResult:
        """Instance labels (ids 1..n) of one block's extended region (``z0``: its first
        slice in the image, for a 2D model's slice-by-slice scale on a volume)."""
        seg = self.seg
        if self.name == "threshold":
            return self._threshold(block, stats)
        if block.ndim == 3 and getattr(seg, "dims", None) == 2 and "slice_lo" in stats:
            x = self._per_slice(block, stats, z0)
        else:
            x = self._global(block, stats)
        if self.name == "unet":
            seg.options["normalization"] = {"kind": "none"}
        x = seg.prepare(x, False)
        raw = seg.segment([x])[0]  # a SegResult, or raw output finish() turns into one
        res = raw if isinstance(raw, SegResult) else seg.finish(raw)
        return res if isinstance(res, SegResult) else SegResult(np.asarray(res))

    def _per_slice(self, x: np.ndarray, stats: dict, z0: int) -> np.ndarray:
        """Each slice on its own whole-slice 1-99.8 % scale (what the 2D U-Net does to a
        volume in one piece)."""
        lo = np.asarray(stats["slice_lo"][z0:z0 + x.shape[0]], np.float32)[:, None, None]
        scale = np.asarray(stats["slice_hi"][z0:z0 + x.shape[0]], np.float32)[:, None, None] - lo
        out = (np.asarray(x, np.float32) - lo) / np.maximum(scale, 1e-6)
        return np.where(scale > 1e-6, out, 0).astype(np.float32)

    def _threshold(self, block: np.ndarray, stats: dict) -> SegResult:
        """The global threshold in this block's own 1-99.8 % scale (the classical method
        normalises each image), so the mask equals the whole image's."""
        user_t = self.options.get("threshold")
        raw_t = (stats["lo"] + float(user_t) * (stats["hi"] - stats["lo"]) if user_t is not None
                 else stats["otsu"])  # measured by image_stats(..., otsu=True)
        b_lo, b_hi = (float(v) for v in np.percentile(np.asarray(block, np.float32), [1.0, 99.8]))
        if b_hi - b_lo <= 1e-6:  # a flat block: nothing or everything is above the threshold
            return SegResult(np.zeros(block.shape, np.int32))
        self.seg.options["threshold"] = (raw_t - b_lo) / (b_hi - b_lo)
        x = self.seg.prepare(np.asarray(block), False)
        return self.seg.segment([x])[0]

