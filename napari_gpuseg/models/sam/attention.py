# Derived from segment-anything (Meta Platforms, Inc. and affiliates, Apache-2.0).
# Licence texts: LICENSES/; details: NOTICE. Modifications: BSD-3-Clause, see LICENSE.
"""Multi-head attention with SAM's decomposed relative-position term, three kernels.

The ViT image encoder adds ``rel_h[q, k_row] + rel_w[q, k_col]`` to the attention logits.
How that is computed is a measured choice (docs/benchmarks.md), selected per module or globally:

``"math"``
    explicit ``(q*scale) @ k^T``, the two rel-pos terms added in place, softmax, ``@ v``.
    The CPU default (SDPA with a dense bias measured slower there). Large attention
    maps (global blocks, batches) are processed in head chunks to bound peak memory.
``"sdpa"``
    ``F.scaled_dot_product_attention`` with the rel-pos term materialised as a dense
    additive ``attn_mask`` (memory-efficient kernel on CUDA).
``"sdpa_decomposed"``
    no dense bias at all: the rel-pos term is folded into the dot product by appending
    ``[rel_h, rel_w]`` to the queries and the matching one-hot row/column indicators to
    the keys, so any SDPA kernel (flash included) can run it.
``"auto"``
    ``"sdpa_decomposed"`` on CUDA, ``"math"`` elsewhere. On an H200 (ViT-B, 1024 px, bf16,
    batch 8) it ran 153 images/s against 99 for ``"sdpa"`` and 54 for ``"math"``, with 1.0 GiB
    of peak memory against 6.4 GiB (``benchmarks/sam.py``, docs/benchmarks.md): the dense
    bias keeps SDPA off its flash kernel, the folded term does not.

All three agree within float32 rounding (tested). fp16 logits are summed and
soft-maxed in float32.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from .common import needs_fp32, softmax_lastdim

ATTN_IMPLS = ("auto", "math", "sdpa", "sdpa_decomposed")
_DEFAULT_IMPL = "auto"
# upper bound for one chunk of attention logits in the math path (bytes)
MATH_CHUNK_BYTES = 256 * 1024**2


def set_default_attn_impl(impl: str) -> None:
    """Change what ``"auto"`` means for every module that did not pick a kernel itself.

    Pass ``"auto"`` to restore the device-based choice (sdpa_decomposed on CUDA, math elsewhere).
    """
    global _DEFAULT_IMPL
    if impl not in ATTN_IMPLS:
        raise ValueError(f"attn_impl must be one of {ATTN_IMPLS}, got {impl!r}")
    _DEFAULT_IMPL = impl


def get_default_attn_impl() -> str:
    return _DEFAULT_IMPL


def set_attn_impl(module: torch.nn.Module, impl: str) -> torch.nn.Module:
    """Set the kernel of every attention layer inside ``module`` (e.g. a whole Sam)."""
    if impl not in ATTN_IMPLS:
        raise ValueError(f"attn_impl must be one of {ATTN_IMPLS}, got {impl!r}")
    for m in module.modules():
        if hasattr(m, "attn_impl"):
            m.attn_impl = impl
    return module


def resolve_attn_impl(impl: str, device: torch.device) -> str:
    """Concrete kernel name for ``impl`` on ``device``."""
    if impl == "auto":
        impl = _DEFAULT_IMPL
    if impl == "auto":
        return "sdpa_decomposed" if device.type == "cuda" else "math"
    if impl not in ATTN_IMPLS:
        raise ValueError(f"attn_impl must be one of {ATTN_IMPLS}, got {impl!r}")
    return impl


def get_rel_pos(q_size: int, k_size: int, rel_pos: torch.Tensor) -> torch.Tensor:
    """Relative-position embeddings for every (query, key) offset: ``q_size x k_size x C``.

    Interpolates the table linearly when its length differs from ``2*max(q,k)-1``
    (same rule as the official implementation).
    """
    max_rel_dist = int(2 * max(q_size, k_size) - 1)
    if rel_pos.shape[0] != max_rel_dist:
        resized = F.interpolate(
            rel_pos.reshape(1, rel_pos.shape[0], -1).permute(0, 2, 1),
            size=max_rel_dist,
            mode="linear",
        )
        rel_pos = resized.reshape(-1, max_rel_dist).permute(1, 0)
    q_coords = torch.arange(q_size, device=rel_pos.device)[:, None] * max(k_size / q_size, 1.0)
    k_coords = torch.arange(k_size, device=rel_pos.device)[None, :] * max(q_size / k_size, 1.0)
    relative = (q_coords - k_coords) + (k_size - 1) * max(q_size / k_size, 1.0)
    return rel_pos[relative.long()]


def rel_pos_terms(
    q: torch.Tensor, rel_pos_h: torch.Tensor, rel_pos_w: torch.Tensor, hw: Tuple[int, int]
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The two decomposed terms for queries ``q`` (``... x H*W x C``, unscaled).

    Returns ``rel_h`` (``... x H x W x H``) and ``rel_w`` (``... x H x W x W``).
    """
    h, w = hw
    rh = get_rel_pos(h, h, rel_pos_h).to(q.dtype)
    rw = get_rel_pos(w, w, rel_pos_w).to(q.dtype)
    r_q = q.reshape(*q.shape[:-2], h, w, q.shape[-1])
    rel_h = torch.einsum("...hwc,hkc->...hwk", r_q, rh)
    rel_w = torch.einsum("...hwc,wkc->...hwk", r_q, rw)
    return rel_h, rel_w


def _math_chunk(q, k, v, scale, rel, hw):
    attn = (q * scale) @ k.transpose(-2, -1)
    if rel is not None:
        h, w = hw
        rel_h, rel_w = rel_pos_terms(q, rel[0], rel[1], hw)
        if needs_fp32(attn):
            attn = attn.float()
        view = attn.view(-1, h, w, h, w)
        view.add_(rel_h.to(attn.dtype)[..., None]).add_(rel_w.to(attn.dtype)[..., None, :])
    attn = softmax_lastdim(attn)
    return attn.to(v.dtype) @ v


def _math_attention(q, k, v, scale, rel, hw):
    """``q, k, v``: ``G x N x C`` (G = batch*heads), processed in chunks of G."""
    g, n, _ = q.shape
    elem = 4 if q.dtype in (torch.float32, torch.float16) else q.element_size()
    step = max(1, int(MATH_CHUNK_BYTES // max(1, n * n * elem)))
    if step >= g:
        return _math_chunk(q, k, v, scale, rel, hw)
    out = None
    for s in range(0, g, step):
        res = _math_chunk(q[s : s + step], k[s : s + step], v[s : s + step], scale, rel, hw)
        if out is None:
            out = res.new_empty((g,) + tuple(res.shape[1:]))
        out[s : s + step] = res
    return out


def _sdpa_dense(q, k, v, scale, rel, hw):
    """``q, k, v``: ``B x heads x N x C``."""
    mask = None
    if rel is not None:
        h, w = hw
        rel_h, rel_w = rel_pos_terms(q, rel[0], rel[1], hw)
        mask = (rel_h[..., None] + rel_w[..., None, :]).reshape(*q.shape[:-1], h * w)
        mask = mask.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _sdpa_decomposed(q, k, v, scale, rel, hw):
    """Fold the rel-pos term into the dot product: no ``N x N`` bias is ever built."""
    if rel is None:
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    h, w = hw
    c = q.shape[-1]
    rel_h, rel_w = rel_pos_terms(q, rel[0], rel[1], hw)
    lead = q.shape[:-1]
    # queries: [q*scale | rel_h | rel_w]; keys: [k | onehot(row) | onehot(col)]
    rows = torch.arange(h, device=q.device).repeat_interleave(w)
    cols = torch.arange(w, device=q.device).repeat(h)
    eye_h = torch.eye(h, device=q.device, dtype=k.dtype)[rows]
    eye_w = torch.eye(w, device=q.device, dtype=k.dtype)[cols]
    e = c + h + w
    pad = (-e) % 8
    q2 = torch.cat(
        [q * scale, rel_h.reshape(*lead, h).to(q.dtype), rel_w.reshape(*lead, w).to(q.dtype)],
        -1,
    )
    k2 = torch.cat([k, eye_h.expand(*k.shape[:-1], h), eye_w.expand(*k.shape[:-1], w)], -1)
    v2 = v
    if pad or q.device.type == "cuda":
        q2 = F.pad(q2, (0, pad))
        k2 = F.pad(k2, (0, pad))
        v2 = F.pad(v, (0, e + pad - c))  # flash kernels want equal head dims
    out = F.scaled_dot_product_attention(q2, k2, v2, scale=1.0)
    return out[..., :c]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    impl: str,
    rel: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
    hw: Optional[Tuple[int, int]] = None,
) -> torch.Tensor:
    """Attention for ``q, k, v`` of shape ``B x heads x N x C`` -> ``B x heads x N x C``.

    ``rel`` = ``(rel_pos_h, rel_pos_w)`` tables and ``hw`` the token grid enable SAM's
    decomposed relative-position term. ``impl`` must already be resolved (not "auto").
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    if impl == "math":
        b, nh, n, c = q.shape
        out = _math_attention(
            q.reshape(b * nh, n, c), k.reshape(b * nh, n, c), v.reshape(b * nh, n, c), scale, rel, hw
        )
        return out.view(b, nh, n, c)
    if impl == "sdpa":
        return _sdpa_dense(q, k, v, scale, rel, hw)
    if impl == "sdpa_decomposed":
        return _sdpa_decomposed(q, k, v, scale, rel, hw)
    raise ValueError(f"unknown attention kernel {impl!r}")
