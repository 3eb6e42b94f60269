"""A whole field embedded at native scale in one encoder pass, for encoders that take any size.

TinyViT (LiteMedSAM, MobileSAM) is built from convolutions and windowed attention with
relative position biases: it has no absolute position embedding, so an input of any
``H x W`` (sides divisible by its stride r) embeds to an ``H/r x W/r`` map. Embedding a
520 x 696 field this way costs the area of the field, not the area of the 12 overlapping
256 px tiles that cover it, and the embedding of every native, full-size view whose corner
lies on the stride's grid is then a crop of the map (:func:`view_embedding`). Box mode
cuts its native views from the map where that needs fewer encoder passes (the default;
``segment_boxes(..., field=False)`` embeds every view on its own); prompts in the
annotator keep per-view embeddings, since a first prompt needs one tile, not the field.

A crop is close to, not equal to, the view's own embedding: the encoder sees the view's
neighbourhood instead of zero padding at its edges. A min-max normalising model (LiteMedSAM)
stretches each view to its own darkest and brightest pixel; a field normalised once over its
brightest nuclei has less contrast than most of its views, and its masks came out ragged and
in pieces (BBBC039; ``docs/benchmarks.md``). So such a field is normalised locally
(:func:`local_minmax`): each pixel by the minimum and maximum of the view-sized window
around it, smoothed, which is what the view around it would have used. Large fields are
embedded in blocks of at most :data:`BLOCK` px with :data:`HALO_CELLS` embedding cells of
context around each block's kept part, so the activation memory stays bounded.
"""
from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F
from scipy import ndimage as ndi

from ...runtime.batching import is_oom
from ...runtime.cancel import CancelToken, check
from ...runtime.device import all_finite
from ...runtime.memory import empty_cache
from .inputs import PreparedImage, normalize_input
from .views import View

__all__ = ["BLOCK", "HALO_CELLS", "field_stride", "local_minmax", "holds", "spans", "is_embedded", "passes", "embed_field",
           "view_embedding"]

log = logging.getLogger(__name__)

BLOCK = 768  # input px per side of one encoder pass (TinyViT-5M at stride 4: about 0.6 GB fp32)
HALO_CELLS = 16  # embedding cells of context around the kept part of a block
SMOOTH = 1 / 8  # local_minmax: Gaussian sigma of the window's minimum and maximum, in windows


def field_stride(engine) -> int | None:
    """Input px per embedding cell when ``engine``'s encoder embeds any input size
    (``size_agnostic``), else None."""
    encoder = getattr(engine.sam, "image_encoder", None)
    if not getattr(encoder, "size_agnostic", False):
        return None
    grid = int(engine.sam.prompt_encoder.image_embedding_size[0])
    stride = engine.input_size // grid
    return stride if stride * grid == engine.input_size else None


def holds(view: View, stride: int | None) -> bool:
    """Whether ``view``'s embedding can be cut from a field map: native scale, full size,
    its corner on the stride's grid."""
    return (stride is not None and view.h == view.w == view.input_size
            and view.y0 % stride == 0 and view.x0 % stride == 0)


def spans(length: int, stride: int, block: int | None = None, halo_cells: int = HALO_CELLS,
          ) -> list[tuple[int, int, int, int]]:
    """Blocks along one axis of ``length`` px (a multiple of ``stride``): ``(start, stop,
    keep_start, keep_stop)`` in px, all multiples of ``stride``; the kept parts tile
    ``[0, length)`` and each block (at most ``block`` px, default :data:`BLOCK`) holds its
    kept part plus up to ``halo_cells`` embedding cells of context on each side."""
    block = max(4 * stride, (BLOCK if block is None else block) // stride * stride)
    if length <= block:
        return [(0, length, 0, length)]
    halo = min(halo_cells * stride, block // 4 // stride * stride)
    step = block - 2 * halo
    out = []
    for k0 in range(0, length, step):
        k1 = min(length, k0 + step)
        out.append((max(0, k0 - halo), min(length, k1 + halo), k0, k1))
    return out


def local_minmax(x: torch.Tensor, window: int, smooth: float = SMOOTH) -> torch.Tensor:
    """(3, H, W) in [0, 1] -> min-max normalised per pixel over the ``window`` x ``window``
    neighbourhood centred on it (what a view of that size there is normalised by), the
    local minimum and maximum smoothed (Gaussian, sigma ``smooth * window``) so the
    stretch varies slowly; values above the smoothed maximum stay above 1, as in a view
    whose maximum lies outside it."""
    a = x.detach().cpu().numpy()
    sigma = max(1.0, smooth * window)
    hi = ndi.gaussian_filter(ndi.maximum_filter(a.max(0), size=window, mode="nearest"), sigma, mode="nearest")
    lo = ndi.gaussian_filter(ndi.minimum_filter(a.min(0), size=window, mode="nearest"), sigma, mode="nearest")
    out = (a - lo) / np.maximum(hi - lo, 1e-8)
    return torch.from_numpy(np.clip(out, 0, None, out=out).astype(np.float32, copy=False))


def field_input(engine, image: PreparedImage) -> torch.Tensor:
    """The (3, H, W) encoder input of ``image``'s field: the model's normalisation, min-max
    per view-sized neighbourhood for a min-max model (:func:`local_minmax`)."""
    if engine.info.normalization == "minmax":
        return local_minmax(image.tensor, engine.input_size)
    return normalize_input(image.tensor, engine.info.normalization)


def _key(engine, image: PreparedImage) -> tuple:
    return (image.digest, engine.info.name, engine.policy.precision, str(engine.policy.device), "field-local")


def is_embedded(engine, image: PreparedImage) -> bool:
    return _key(engine, image) in engine.cache


def passes(engine, image: PreparedImage) -> float:
    """The encoder work of embedding ``image``'s field, in passes of one model input."""
    stride, s = field_stride(engine) or 1, engine.input_size
    h, w = image.shape
    return (-(-h // stride) * stride) * (-(-w // stride) * stride) / (s * s)


def embed_field(engine, image: PreparedImage, cancel: CancelToken | None = None) -> torch.Tensor | None:
    """The native-scale embedding map (C, ceil(H/r), ceil(W/r)) of the whole ``image``, on
    the CPU, from the engine's cache when it holds it. None when the encoder cannot embed
    fields, or when a block runs out of memory (the caller embeds views one by one)."""
    stride = field_stride(engine)
    if stride is None:
        return None
    key = _key(engine, image)
    cached = engine.cache.get(key)
    if cached is not None:
        return cached
    x = field_input(engine, image)
    h, w = image.shape
    x = F.pad(x, (0, -w % stride, 0, -h % stride))  # zeros after normalisation, as a view's padding
    hp, wp = x.shape[1:]
    out = None
    oom = None
    try:
        for ys, ye, yk0, yk1 in spans(hp, stride):
            for xs, xe, xk0, xk1 in spans(wp, stride):
                check(cancel)
                e = engine.encode(x[None, :, ys:ye, xs:xe].contiguous())[0]  # not autotuned: see encode
                if out is None:
                    out = torch.empty(e.shape[0], hp // stride, wp // stride, dtype=e.dtype)
                out[:, yk0 // stride:yk1 // stride, xk0 // stride:xk1 // stride] = e[
                    :, (yk0 - ys) // stride:(yk1 - ys) // stride, (xk0 - xs) // stride:(xk1 - xs) // stride].cpu()
                del e
    except RuntimeError as exc:
        if not is_oom(exc):
            raise
        oom = str(exc)
    if oom is not None:  # outside the except block: the traceback (and the failed block) is gone
        out = e = None
        log.warning("field embedding ran out of memory (%s); embedding views one by one", oom)
        empty_cache(engine.policy.device)
        return None
    if not all_finite(out):  # never cached (as view embeddings): the views are embedded one by one
        log.warning("field embedding is not finite (NaN or inf); embedding views one by one")
        return None
    engine.cache.put(key, out)
    return out


def view_embedding(field: torch.Tensor, view: View, stride: int) -> torch.Tensor:
    """The (C, S/r, S/r) embedding of a view that :func:`holds`, cut from ``field``."""
    g = view.input_size // stride
    y, x = view.y0 // stride, view.x0 // stride
    return field[:, y:y + g, x:x + g]
