"""N-D sliding-window inference with constant or Gaussian importance blending.

MONAI's ``sliding_window_inference`` arguments in MONAI's order and with its defaults, and
the same window placement, padding and importance map (so results agree to float
rounding), plus what an
interactive app needs: adaptive window batches (:func:`engine.batching.run_batched`,
halving on OOM), precision from the :class:`~engine.device.Policy` entered in the calling
thread, channels_last for 2D, stitching in host memory when the output would not fit on
the device, progress and cancellation.
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable, Hashable, Sequence

import torch
import torch.nn.functional as F

from ..runtime.batching import run_batched, to_device
from ..runtime.device import Policy, guard_finite
from ..runtime.memory import free_bytes
from ..runtime.cancel import CancelToken, ProgressFn, check

MODES = ("gaussian", "constant")


def _tuple(value, n: int) -> tuple:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"expected {n} values, got {value!r}")
        return tuple(value)
    return (value,) * n


def resolve_roi(roi_size, image_size: Sequence[int]) -> tuple[int, ...]:
    """Window size per dimension; ``None`` or non-positive components take the image size."""
    roi = _tuple(roi_size, len(image_size))
    return tuple(int(s) if r is None or r <= 0 else int(r) for r, s in zip(roi, image_size))


def scan_intervals(image_size: Sequence[int], roi: Sequence[int], overlap) -> tuple[int, ...]:
    """Step between window starts: ``int(roi * (1 - overlap))`` (at least 1), or the roi
    itself when the window spans the whole dimension."""
    out = []
    for size, r, o in zip(image_size, roi, _tuple(overlap, len(roi))):
        if not 0 <= o < 1:
            raise ValueError(f"overlap must be in [0, 1), got {o}")
        out.append(int(r) if r == size else max(1, int(r * (1 - o))))
    return tuple(out)


def window_starts(size: int, roi: int, interval: int) -> list[int]:
    """Starts along one dimension: a regular grid, the last window shifted back to end at
    the border (the image is at least ``roi`` long here)."""
    roi = min(roi, size)
    n = 1
    while (n - 1) * interval + roi < size:
        n += 1
    return [i * interval - max(i * interval + roi - size, 0) for i in range(n)]


def window_slices(image_size: Sequence[int], roi: Sequence[int], overlap) -> list[tuple[slice, ...]]:
    """All windows over ``image_size`` (first dimension slowest, as MONAI orders them)."""
    steps = scan_intervals(image_size, roi, overlap)
    per_dim = [window_starts(s, r, i) for s, r, i in zip(image_size, roi, steps)]
    out = [()]
    for starts, r, s in zip(per_dim, roi, image_size):
        r = min(r, s)
        out = [prev + (slice(a, a + r),) for prev in out for a in starts]
    return out


def importance_map(
    roi: Sequence[int],
    mode: str = "gaussian",
    sigma_scale=0.125,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Window weights: a separable Gaussian centred on the window with
    ``sigma = sigma_scale * roi`` (peak 1, floored at its minimum or 1e-3), or ones."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "constant":
        return torch.ones(tuple(roi), device=device, dtype=dtype)
    weights = None
    for n, s in zip(roi, _tuple(sigma_scale, len(roi))):
        half = (n - 1) / 2.0
        x = torch.arange(-half, half + 1, dtype=torch.float32, device=device)[:n]
        g = torch.exp(x**2 / (-2 * (n * s) ** 2))
        weights = g if weights is None else weights.unsqueeze(-1) * g
    floor = max(float(weights.min()), 1e-3)
    return weights.clamp_(min=floor).to(dtype)


def _pad_amounts(image_size, roi) -> list[tuple[int, int]]:
    """(before, after) padding per spatial dimension so each is at least ``roi``."""
    out = []
    for s, r in zip(image_size, roi):
        diff = max(r - s, 0)
        out.append((diff // 2, diff - diff // 2))
    return out


def output_fits(nbytes: int, device: torch.device, fraction: float = 0.5) -> bool:
    """Whether an output buffer of ``nbytes`` may live on ``device``."""
    if device.type != "cuda":
        return True
    return nbytes <= fraction * free_bytes(device)  # torch's unused cache counts as free


def sliding_window_inference(  # over 80 lines: MONAI's signature and its documentation; the body is 55
    inputs: torch.Tensor,
    roi_size,
    sw_batch_size: int | None,
    predictor: Callable[[torch.Tensor], torch.Tensor],
    overlap=0.25,
    mode: str = "constant",
    sigma_scale=0.125,
    padding_mode: str = "constant",
    cval: float = 0.0,
    sw_device: torch.device | str | None = None,
    device: torch.device | str | None = None,
    *,
    policy: Policy | None = None,
    channels_last: bool = False,
    progress: ProgressFn = None,
    cancel: CancelToken | None = None,
    batch_key: Hashable | None = None,
    item_bytes: int | None = None,
) -> torch.Tensor:
    """Predict ``inputs`` (N, C, *spatial) window by window and blend the windows.

    The arguments up to ``device`` are MONAI's, in MONAI's order and with its defaults
    (``monai.inferers.sliding_window_inference(inputs, roi_size, sw_batch_size, predictor,
    overlap=0.25, mode="constant", ...)``); the rest are keyword-only.

    roi_size: window size (int or per dimension; None/<=0 = whole dimension).
    sw_batch_size: windows per network call; None = adaptive (start from free memory,
        halve on OOM, remember per ``batch_key``).
    overlap: fraction of a window shared with its neighbour, per dimension or one value.
    mode / sigma_scale: "constant" (plain average) or "gaussian" importance
        (sigma = sigma_scale * roi).
    padding_mode / cval: how images smaller than the window are padded (F.pad modes).
    sw_device: where windows are computed (default: the input's device).
    device: where the output is stitched (default: ``sw_device``, or host memory when the
        output would take more than half the free device memory).
    policy: precision; its ``autocast()`` is entered here, in the calling thread.
    channels_last: give 2D windows to the predictor in channels_last memory format.
    progress(done, total) counts windows (a callback, where MONAI's ``progress`` is a
    bool for a progress bar); ``cancel`` is checked between batches.

    Returns float32 logits/probabilities (N, C_out, *spatial) on ``device``.
    """
    if inputs.ndim < 3:
        raise ValueError(f"inputs must be (N, C, *spatial), got shape {tuple(inputs.shape)}")
    nd = inputs.ndim - 2
    n_img = inputs.shape[0]
    image_size_in = tuple(inputs.shape[2:])
    roi = resolve_roi(roi_size, image_size_in)
    sw_device = torch.device(sw_device) if sw_device is not None else inputs.device

    pads = _pad_amounts(image_size_in, roi)
    if any(a or b for a, b in pads):
        flat = [v for pair in reversed(pads) for v in pair]
        kw = {"value": cval} if padding_mode == "constant" else {}
        inputs = F.pad(inputs, flat, mode=padding_mode, **kw)
    image_size = tuple(inputs.shape[2:])
    slices = window_slices(image_size, roi, overlap)
    windows = [(b, s) for b in range(n_img) for s in slices]
    weight = importance_map(roi, mode, sigma_scale, device=sw_device)
    state: dict = {}

    def run(batch: list) -> list:
        check(cancel)
        data = torch.cat([inputs[(slice(b, b + 1), slice(None)) + s] for b, s in batch])
        data = to_device(data, sw_device)
        if channels_last and nd == 2:
            data = data.contiguous(memory_format=torch.channels_last)
        def predict():
            with policy.autocast() if policy is not None else contextlib.nullcontext():
                return predictor(data)

        # a non-finite window under autocast (fp16 on cards without tensor cores) re-runs in fp32
        pred = guard_finite(policy, predict, "U-Net output") if policy is not None else predict()
        if tuple(pred.shape[2:]) != roi or pred.shape[0] != len(batch):
            raise ValueError(f"predictor returned {tuple(pred.shape)} for windows {tuple(data.shape)}")
        pred = pred.float() * weight
        if "out" not in state:
            _allocate(state, pred.shape[1], n_img, image_size, slices, weight, sw_device, device)
        out = state["out"]
        pred = pred.to(out.device, non_blocking=out.device.type == "cuda")
        for p, (b, s) in zip(pred, batch):
            out[(b, slice(None)) + s] += p
        return [None] * len(batch)

    key = batch_key if batch_key is not None else ("sliding_window", roi, id(predictor))
    if item_bytes is None:
        item_bytes = int(math.prod(roi)) * 4 * 256  # rough activation footprint per window
    run_batched(run, windows, batch_size=sw_batch_size, key=key, device=sw_device,
                item_bytes=item_bytes, progress=progress, cancel=cancel)
    out = state["out"]
    out /= state["count"]
    if any(a or b for a, b in pads):
        crop = tuple(slice(a, a + s) for (a, _), s in zip(pads, image_size_in))
        out = out[(slice(None), slice(None)) + crop]
    return out


def _allocate(state, channels, n_img, image_size, slices, weight, sw_device, device) -> None:
    """Output and weight-sum buffers, on ``device`` or host memory when it would not fit."""
    n_vox = int(math.prod(image_size))
    nbytes = 4 * n_vox * (n_img * channels + 1)
    if device is None:
        device = sw_device if output_fits(nbytes, sw_device) else torch.device("cpu")
    device = torch.device(device)
    count = torch.zeros((1, 1) + tuple(image_size), dtype=torch.float32, device=device)
    w = weight.to(device)
    for s in slices:
        count[(slice(None), slice(None)) + s] += w
    state["out"] = torch.zeros((n_img, channels) + tuple(image_size), dtype=torch.float32, device=device)
    state["count"] = count
