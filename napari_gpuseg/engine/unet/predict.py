"""U-Net prediction: normalisation, tiled probabilities, instance labels (checkpoints:
:mod:`.checkpoint`).

Images enter as numpy arrays of any dtype. A 2D model takes YX, a stack or time series
(..., Y, X) as a batch of slices, or YXC / RGB with ``rgb=True``; a 3D model takes ZYX or
a batch (..., Z, Y, X). A 1-channel model sees every image through the one input
conversion, :func:`~napari_gpuseg.engine.normalize.model_input` (RGB -> luminance, bright
backgrounds inverted), as in training and folder jobs. Probabilities are (3, *spatial) per
image: background, interior, boundary. Labels come from connected interior components grown
by watershed into the foreground.
"""
from __future__ import annotations

import numpy as np
import torch
from scipy import ndimage as ndi
from skimage.segmentation import watershed

from ...models.unet import UNet, UNetConfig
from ..classical import relabel_small
from ..runtime.device import Policy, resolve_policy
from ..runtime.cancel import CancelToken, ProgressFn, check
from ..normalize import apply_normalization, image_input, model_input, to_gray
from ..stacks import stack_labels
from .unet_checkpoint import LoadedModel
from .tiling import sliding_window_inference

STACK_CHUNK_BYTES = 512 * 2**20  # stitched output per engine call


# -- prediction -----------------------------------------------------------------------
def _window(size: int, candidates, whole_max: int, overlap: float) -> int:
    """The window edge that computes the fewest pixels along one dimension (ties: larger)."""
    from .tiling import scan_intervals, window_starts

    options = [c for c in candidates if c < size] + ([size] if size <= whole_max else [])
    if not options:
        return min(candidates)
    cost = {}
    for c in options:
        step = scan_intervals((size,), (c,), overlap)[0]
        cost[c] = len(window_starts(size, c, step)) * c
    return min(options, key=lambda c: (cost[c], -c))


def default_roi(config: UNetConfig, spatial_shape, tile: int | None = None,
                overlap: float = 0.25) -> tuple[int, ...]:
    """Window size. With ``tile``: ``min(tile, dimension)``. Otherwise, per dimension, the
    whole dimension when it is at most 768 (2D) / 128 (3D) pixels, or the tile among
    256/384/512 (2D) or 64/96 (3D) that computes the fewest redundant pixels; on a CPU
    activations of much larger windows no longer fit in cache and run slower."""
    if tile:
        return tuple(min(int(tile), int(s)) for s in spatial_shape)
    if config.spatial_dims == 2:
        candidates, whole_max = (256, 384, 512), 768
    else:
        candidates, whole_max = (64, 96), 128
    return tuple(_window(int(s), candidates, whole_max, overlap) for s in spatial_shape)


def _as_batch(image: np.ndarray, config: UNetConfig, rgb: bool,
              convert: bool = True) -> tuple[np.ndarray, tuple]:
    """-> (B, C, *spatial) float array and the leading batch shape."""
    img = np.asarray(image)
    d = config.spatial_dims
    if config.in_channels == 1 and convert:
        img = model_input(img, rgb=rgb, axis=tuple(range(-d, 0)))
    elif config.in_channels == 1 and rgb:
        img = to_gray(img)
    elif rgb:
        img = np.moveaxis(img, -1, -d - 1)
    if config.in_channels == 1:
        if img.ndim < d:
            raise ValueError(f"a {d}D model needs at least {d} dimensions, got shape {image.shape}")
        img = np.expand_dims(img, -d - 1)
    if img.ndim < d + 1:
        raise ValueError(f"a {d}D model needs at least {d} dimensions, got shape {image.shape}")
    lead = img.shape[: -(d + 1)]
    if img.shape[-d - 1] != config.in_channels:
        raise ValueError(f"model expects {config.in_channels} channels, image gives {img.shape[-d - 1]}")
    return img.reshape((-1, config.in_channels) + img.shape[-d:]), lead


def predict_probabilities(
    model: UNet | LoadedModel,
    image,
    *,
    rgb: bool | None = None,
    channel: int | None = None,
    normalization: dict | None = None,
    roi_size=None,
    tile: int | None = None,
    overlap: float = 0.25,
    sw_batch_size: int | None = None,
    policy: Policy | None = None,
    channels_last: bool | None = None,
    output_device=None,
    progress: ProgressFn = None,
    cancel: CancelToken | None = None,
    convert: bool = True,
) -> np.ndarray:
    """Softmax probabilities, shape (*lead, 3, *spatial), float32.

    The image is taken as folder jobs take an image file
    (:func:`~napari_gpuseg.engine.normalize.image_input`): ``rgb`` None detects colour (a last
    axis of 3 or 4 values), ``channel`` picks one channel of a multichannel image, and a
    multichannel image without it is refused. ``convert=False`` skips the input conversion
    (inputs already converted and normalised, as in training's validation).

    ``lead`` is the stack/time shape (empty for a single image). Normalisation follows
    the checkpoint (percentile 1-99.8 per image or slice) unless ``normalization`` is given.
    Windows: ``roi_size`` if given, else :func:`default_roi` (``tile`` caps the window).
    """
    if isinstance(model, LoadedModel):
        normalization = normalization or model.normalization
        model = model.model
    config = model.config
    d = config.spatial_dims
    policy = resolve_policy(policy)
    if convert or channel is not None:
        image, rgb = image_input(image, channel, rgb)
    batch, lead = _as_batch(image, config, bool(rgb), convert)
    axis = tuple(range(-d, 0))
    norm = apply_normalization(batch, normalization, axis=axis)
    device = next(model.parameters()).device
    if channels_last is None:  # faster on CUDA and on CPU (oneDNN) alike; same results
        channels_last = d == 2
    if channels_last and d == 2:
        model = model.to(memory_format=torch.channels_last)
    roi = roi_size or default_roi(config, batch.shape[2:], tile, overlap)
    x = torch.from_numpy(np.ascontiguousarray(norm))
    n = x.shape[0]
    # images of a stack share window batches; chunks keep the stitched output bounded
    per_image = config.out_channels * int(np.prod(x.shape[2:])) * 4
    chunk = max(1, min(n, STACK_CHUNK_BYTES // max(1, per_image)))
    outs = []
    done = [0]

    def sub_progress(k: int, total: int, m: int) -> None:
        if progress is not None:
            per = max(1, total // m)  # windows per image
            progress(done[0] * per + k, n * per)

    model.eval()
    with torch.inference_mode():
        for start in range(0, n, chunk):
            check(cancel)
            part = x[start : start + chunk]
            logits = sliding_window_inference(
                part, roi, sw_batch_size, model, overlap=overlap, mode="gaussian",
                sw_device=device, device=output_device, policy=policy, channels_last=channels_last,
                progress=lambda k, t, m=part.shape[0]: sub_progress(k, t, m),
                cancel=cancel, batch_key=("unet", id(model), tuple(roi)),
            )
            outs.append(_softmax_to_host(logits, cancel))
            done[0] += part.shape[0]
            del logits
    probs = np.concatenate(outs)
    return probs.reshape(tuple(lead) + probs.shape[1:])


def _softmax_to_host(logits: torch.Tensor, cancel: CancelToken | None = None) -> np.ndarray:
    """Channel softmax of stitched logits (N, C, ...) as a host array, a few images at a
    time inside the out-of-memory back-off (a whole 3D chunk at once can exceed the card)."""
    from ..runtime.batching import run_batched

    per_image = int(logits[0].numel()) * 4 * 2
    parts = run_batched(lambda b: torch.softmax(b, dim=1).cpu(), logits, device=logits.device,
                        item_bytes=per_image, cancel=cancel)
    return torch.stack(parts).numpy() if parts else np.zeros(tuple(logits.shape), np.float32)


def probabilities_to_labels(
    probs: np.ndarray,
    interior_threshold: float = 0.5,
    foreground_threshold: float = 0.5,
    min_size: int = 12,
    min_seed: int = 3,
    spatial_dims: int | None = None,
) -> np.ndarray:
    """Instance labels (int32) from (..., 3, *spatial) probabilities.

    Seeds: connected components of ``p_interior > interior_threshold`` (>= ``min_seed``
    pixels). They grow by watershed on ``-p_interior`` into the foreground
    ``p_interior + p_boundary > foreground_threshold``; foreground blobs without a seed
    become objects of their own; objects under ``min_size`` pixels are dropped. Stacks
    are labelled slice by slice with ids unique across the stack.
    """
    probs = np.asarray(probs)
    if spatial_dims is None:
        spatial_dims = probs.ndim - 1 if probs.shape[0] == 3 else probs.ndim - 2
    if probs.ndim > spatial_dims + 1:
        lead = probs.shape[: -(spatial_dims + 1)]
        flat = probs.reshape((-1,) + probs.shape[-(spatial_dims + 1):])
        return stack_labels([probabilities_to_labels(p, interior_threshold, foreground_threshold,
                                                     min_size, min_seed, spatial_dims)
                             for p in flat], tuple(lead))
    interior = probs[1]
    fg = (probs[1] + probs[2]) > foreground_threshold
    seeds, n = ndi.label(interior > interior_threshold)
    if n:
        seeds = relabel_small(seeds, min_seed)
    labels = watershed(-interior, seeds, mask=fg) if seeds.max() else np.zeros(fg.shape, np.int32)
    orphans = fg & (labels == 0)
    if orphans.any():
        extra, _ = ndi.label(orphans)
        labels = np.where(orphans, extra + labels.max(), labels)
    return relabel_small(labels, min_size)


def predict_labels(model, image, *, return_probabilities: bool = False, postprocess: dict | None = None,
                   **kwargs):
    """Instance labels (and optionally the probabilities) for ``image``; see
    :func:`predict_probabilities` for the keyword arguments."""
    if isinstance(model, LoadedModel):
        d = model.config.spatial_dims
        postprocess = {**model.meta.get("postprocess", {}), **(postprocess or {})}
    else:
        d = model.config.spatial_dims
    probs = predict_probabilities(model, image, **kwargs)
    labels = probabilities_to_labels(probs, spatial_dims=d, **(postprocess or {}))
    return (labels, probs) if return_probabilities else labels
