"""Propagate objects through a stack (ZYX volume or TYX time-lapse) with a SAM engine.

From an object's mask (or box) on one slice, each next slice in both directions is
prompted from its neighbour slice's result: the neighbour mask's box, plus its low-res
logits as mask input when asked (the models here take a mask input), plus a positive
point at the mask's most interior pixel for point-capable models. A direction stops
where the object ends: the new mask is empty, smaller than ``min_area``, too unlike its
neighbour (IoU below ``min_iou`` or area ratio below ``min_area_ratio``), or the object has
faded out of the image: its contrast against a thin ring around it (mean inside minus mean
of the ring) falls below ``min_contrast`` times the contrast on the start slice. SAM keeps
finding a plausible blob inside the neighbour's box past an object's end; the image itself
says the object is gone.

Work is batched: the slices the fronts will need next are embedded a few at a time in
one encoder call (the slices nearest the start first), and every front that lands on the
same slice (both of an object's directions never do, but many objects of
:func:`propagate_all` do) is decoded in one :meth:`SamEngine.predict` call. A cancel
keeps every slice done so far (``Propagation.cancelled`` says it stopped early).

    result = propagate(engine, volume, start_slice=15, start=[x0, y0, x1, y1])
    result.volume(volume.shape)    # bool (Z, Y, X) mask of the object
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from ...runtime.cancel import CancelToken, Cancelled, check
from ..interactive.predictor import MaskResult, Prompt, SamEngine

SliceFn = Callable[[int, int, np.ndarray], None]  # (object index, slice, mask)


@dataclass
class PropagateOptions:
    """When to stop and how to prompt. Defaults were chosen on ``shared/data/synthetic3d``."""

    min_area: int = 8  # pixels; a smaller mask ends the object
    min_iou: float = 0.5  # IoU with the neighbour slice's mask
    min_area_ratio: float = 0.5  # smaller / larger area of the two slices
    min_contrast: float = 0.5  # contrast vs its surround, as a share of the start slice's; 0: off
    mask_input: bool = False  # feed the neighbour's low-res logits as mask input
    points: bool | None = None  # a centre point; None: only for point-capable models
    margin: int = 1  # pixels added around the neighbour mask's box
    embed_batch: int = 4  # slices per encoder call (1: one slice at a time)
    max_slices: int | None = None  # per direction; None: to the end of the stack

    def __post_init__(self):
        if self.min_area < 1:
            raise ValueError(f"min_area must be at least 1 pixel, got {self.min_area}")
        for name in ("min_iou", "min_area_ratio", "min_contrast"):
            v = getattr(self, name)
            if not 0 <= v <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {v}")
        if self.embed_batch < 1:
            raise ValueError(f"embed_batch must be at least 1, got {self.embed_batch}")


@dataclass
class Propagation:
    """One object's masks by slice (full-size bool planes) and why each direction ended."""

    start_slice: int
    masks: dict[int, np.ndarray] = field(default_factory=dict)
    stopped: dict[int, str] = field(default_factory=dict)  # -1 / +1 -> reason
    cancelled: bool = False

    @property
    def extent(self) -> tuple[int, int] | None:
        """(first, last) slice holding the object, or None when it has none."""
        return (min(self.masks), max(self.masks)) if self.masks else None

    def volume(self, shape: tuple[int, int, int]) -> np.ndarray:
        out = np.zeros(shape, dtype=bool)
        for z, m in self.masks.items():
            out[z] = m
        return out


def mask_box(mask: np.ndarray, margin: int = 0) -> np.ndarray | None:
    """(x0, y0, x1, y1) of a bool mask's pixels (x1, y1 exclusive), grown by ``margin``."""
    ys, xs = np.nonzero(mask)
    if len(ys) == 0:
        return None
    h, w = mask.shape
    return np.array([max(0, xs.min() - margin), max(0, ys.min() - margin),
                     min(w, xs.max() + 1 + margin), min(h, ys.max() + 1 + margin)], dtype=np.float64)


def inner_point(mask: np.ndarray) -> np.ndarray:
    """(1, 2) xy of the mask pixel farthest from its border (a safe positive click)."""
    from scipy import ndimage

    dist = ndimage.distance_transform_edt(np.pad(mask, 1))[1:-1, 1:-1]
    y, x = np.unravel_index(int(np.argmax(dist)), dist.shape)
    return np.array([[x, y]], dtype=np.float64)


RING_PX = 3  # width of the surround the contrast is measured against


def contrast(plane: np.ndarray, mask: np.ndarray) -> float:
    """Mean intensity inside ``mask`` minus the mean of a ``RING_PX`` ring around it (gray
    luminance for RGB planes); 0.0 for an empty mask or one that fills the plane."""
    from scipy import ndimage

    from ....io import to_gray

    ys, xs = np.nonzero(mask)
    if len(ys) == 0:
        return 0.0
    h, w = mask.shape
    y0, y1 = max(0, ys.min() - RING_PX), min(h, ys.max() + 1 + RING_PX)
    x0, x1 = max(0, xs.min() - RING_PX), min(w, xs.max() + 1 + RING_PX)
    m = mask[y0:y1, x0:x1]
    ring = ndimage.binary_dilation(m, iterations=RING_PX) & ~m
    if not ring.any():
        return 0.0
    crop = np.asarray(to_gray(np.asarray(plane)[y0:y1, x0:x1]), dtype=np.float64)
    return float(crop[m].mean() - crop[ring].mean())


def reference_contrast(plane: np.ndarray, mask: np.ndarray) -> float | None:
    """The start slice's contrast, or None when the object hardly stands out there (under
    5 % of the plane's standard deviation): the contrast rule is then left out."""
    c = contrast(plane, mask)
    spread = float(np.std(np.asarray(plane, dtype=np.float64)))
    return c if abs(c) > 0.05 * spread and spread > 0 else None


def _iou(a: np.ndarray, b: np.ndarray) -> float:
    union = np.logical_or(a, b).sum()
    return float(np.logical_and(a, b).sum() / union) if union else 0.0


@dataclass
class _Front:
    obj: int
    step: int  # -1 or +1
    z: int  # slice of the last accepted mask
    mask: np.ndarray
    result: MaskResult | None
    done: int = 0
    ref_contrast: float | None = None  # the start slice's; None: the contrast rule is off


class _Slices:
    """Prepared slices, made once each."""

    def __init__(self, engine: SamEngine, volume: np.ndarray):
        self.engine, self.volume, self._prep = engine, volume, {}

    def __getitem__(self, z: int):
        if z not in self._prep:
            self._prep[z] = self.engine.prepare(np.asarray(self.volume[z]))
        return self._prep[z]


def _use_points(engine: SamEngine, opts: PropagateOptions) -> bool:
    return (not engine.info.box_trained) if opts.points is None else bool(opts.points)


def _prompt(engine: SamEngine, front: _Front, opts: PropagateOptions, shape) -> Prompt:
    box = mask_box(front.mask, opts.margin)
    pts = inner_point(front.mask) if _use_points(engine, opts) else None
    prompt = Prompt(points=pts, box=box)
    if opts.mask_input and front.result is not None:
        prompt.mask_input = front.result  # decoded in the neighbour's view geometry
    return prompt


def _start_masks(engine, slices, start_slice, starts, cancel) -> list[tuple[np.ndarray, MaskResult | None]]:
    """Each start (bool mask or box) -> its mask on the start slice (boxes decoded in one call)."""
    image = slices[start_slice]
    shape = image.shape
    out: list = [None] * len(starts)
    boxes, where = [], []
    for i, s in enumerate(starts):
        a = np.asarray(s)
        if a.shape == tuple(shape):
            out[i] = (a.astype(bool), None)
        elif a.size == 4:
            boxes.append(a.reshape(4))
            where.append(i)
        else:
            raise ValueError(f"start {i} must be a {shape[0]}x{shape[1]} mask or an (x0, y0, x1, y1) "
                             f"box, got shape {a.shape}")
    if boxes:
        for i, r in zip(where, engine.predict_boxes(image, np.stack(boxes), cancel=cancel)):
            out[i] = (r.full(shape), r)
    return out


def propagate_all(engine: SamEngine, volume: np.ndarray, start_slice: int,
                  starts: Sequence[np.ndarray], options: PropagateOptions | None = None,
                  on_slice: SliceFn | None = None, progress: Callable[[int, int], None] | None = None,
                  cancel: CancelToken | None = None) -> list[Propagation]:
    """Propagate every object of ``starts`` (bool masks or boxes on ``start_slice``) at once.

    ``on_slice(i, z, mask)`` is called for every accepted mask (the start slice's too),
    in the order they are found: objects grow outwards from the start slice.
    """
    opts = options or PropagateOptions()
    vol = np.asarray(volume) if not hasattr(volume, "shape") else volume
    if len(vol.shape) not in (3, 4):
        raise ValueError(f"propagation needs a stack (Z, Y, X[, C]), got shape {tuple(vol.shape)}")
    nz = int(vol.shape[0])
    if not 0 <= start_slice < nz:
        raise ValueError(f"start slice {start_slice} is outside the stack (0..{nz - 1})")
    slices = _Slices(engine, vol)
    results = [Propagation(start_slice) for _ in starts]
    limit = opts.max_slices if opts.max_slices is not None else nz
    total = max(1, len(starts) * (nz - 1))
    visited = 0
    fronts: list[_Front] = []
    try:
        for i, (mask, res) in enumerate(_start_masks(engine, slices, start_slice, starts, cancel)):
            if mask.sum() < opts.min_area:
                results[i].stopped = {-1: "start mask empty", 1: "start mask empty"}
                continue
            results[i].masks[start_slice] = mask
            if on_slice:
                on_slice(i, start_slice, mask)
            ref = reference_contrast(vol[start_slice], mask) if opts.min_contrast > 0 else None
            for step in (-1, 1):
                fronts.append(_Front(i, step, start_slice, mask, res, ref_contrast=ref))
        while fronts:
            check(cancel)
            # retire fronts at the stack's end or the slice limit
            for f in list(fronts):
                if not 0 <= f.z + f.step < nz or f.done >= limit:
                    results[f.obj].stopped[f.step] = "end of stack" if f.done < limit else "slice limit"
                    fronts.remove(f)
            if not fronts:
                break
            _embed_ahead(engine, slices, fronts, opts, nz, cancel)
            by_slice: dict[int, list[_Front]] = {}
            for f in fronts:
                by_slice.setdefault(f.z + f.step, []).append(f)
            for z in sorted(by_slice, key=lambda z: abs(z - start_slice)):
                group = by_slice[z]
                image = slices[z]
                prompts = [_prompt(engine, f, opts, image.shape) for f in group]
                decoded = engine.predict(image, prompts, cancel=cancel)
                for f, r in zip(group, decoded):
                    visited += 1
                    mask = r.full(image.shape)
                    reason = _reject(mask, f.mask, opts) or _faded(vol[z], mask, f.ref_contrast, opts)
                    if reason:
                        results[f.obj].stopped[f.step] = reason
                        fronts.remove(f)
                        continue
                    f.z, f.mask, f.result, f.done = z, mask, r, f.done + 1
                    results[f.obj].masks[z] = mask
                    if on_slice:
                        on_slice(f.obj, z, mask)
            if progress:
                progress(min(visited, total), total)
    except Cancelled:
        for r in results:
            r.cancelled = True
    if progress:
        progress(total, total)
    return results


def propagate(engine: SamEngine, volume: np.ndarray, start_slice: int, start: np.ndarray,
              options: PropagateOptions | None = None, on_slice: Callable[[int, np.ndarray], None] | None = None,
              progress: Callable[[int, int], None] | None = None,
              cancel: CancelToken | None = None) -> Propagation:
    """One object from ``start`` (a bool mask or an (x0, y0, x1, y1) box on ``start_slice``)."""
    cb = (lambda _i, z, m: on_slice(z, m)) if on_slice else None
    return propagate_all(engine, volume, start_slice, [start], options, cb, progress, cancel)[0]


def _reject(mask: np.ndarray, prev: np.ndarray, opts: PropagateOptions) -> str | None:
    area = int(mask.sum())
    if area == 0:
        return "mask empty"
    if area < opts.min_area:
        return f"mask smaller than {opts.min_area} px"
    prev_area = int(prev.sum())
    if min(area, prev_area) / max(area, prev_area) < opts.min_area_ratio:
        return f"area ratio below {opts.min_area_ratio}"
    if _iou(mask, prev) < opts.min_iou:
        return f"IoU with neighbour below {opts.min_iou}"
    return None


def _faded(plane: np.ndarray, mask: np.ndarray, ref: float | None, opts: PropagateOptions) -> str | None:
    if ref is None or opts.min_contrast <= 0:
        return None
    share = contrast(plane, mask) / ref
    if share < opts.min_contrast:
        return f"faded out (contrast {share:.2f} of the start slice's, below {opts.min_contrast})"
    return None


def _embed_ahead(engine: SamEngine, slices: _Slices, fronts: list[_Front], opts: PropagateOptions,
                 nz: int, cancel: CancelToken | None) -> None:
    """Embed the views the fronts need next, and the next few slices ahead, in one call
    (``embed_batch`` slices at most; the nearest first). Views are routed by each front's
    current box, which the next slices' boxes are close to."""
    wanted: list[tuple[int, object]] = []
    seen = set()
    for ahead in range(1, opts.embed_batch + 1):
        for f in fronts:
            z = f.z + f.step * ahead
            if not 0 <= z < nz or (z, id(f)) in seen:
                continue
            image = slices[z]
            view = engine.route(image, Prompt(box=mask_box(f.mask, opts.margin)))
            if (z, view) not in seen and not engine.is_embedded(image, [view]):
                seen.add((z, view))
                wanted.append((z, view))
        if len({z for z, _ in wanted}) >= opts.embed_batch:
            break
    if not wanted:
        return
    zs = sorted({z for z, _ in wanted}, key=lambda z: min(abs(z - f.z) for f in fronts))
    # the first front slices always; further ones up to embed_batch images in this call
    need = {f.z + f.step for f in fronts}
    keep = [z for z in zs if z in need] + [z for z in zs if z not in need]
    keep = keep[:max(opts.embed_batch, len(need))]
    images = [slices[z] for z in keep]
    views = [[v for zz, v in wanted if zz == z] for z in keep]
    engine.embed(images, views, batch_size=max(1, min(opts.embed_batch, sum(map(len, views)))),
                 cancel=cancel)
