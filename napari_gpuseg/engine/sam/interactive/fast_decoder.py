"""Decoding many point prompts against one image embedding, cheaply.

Segment-everything decodes hundreds of single-point prompts on the *same* embedding
(and box mode dozens of boxes per view).
SAM's decoder copies the (h*w, 256) image tokens once per prompt and runs every
projection on every copy. But a prompt only touches the image tokens through attention
to its 7 tokens, so each prompt's image tokens are the shared tokens plus a low-rank
update. :func:`decode_points` keeps them factored::

    X[i, p] = alpha[i, p] * S[p] + U[i, p] @ V[i]       (S shared, rank R ~ 60-120)

(LayerNorm only rescales and shifts per position, which the factors absorb exactly), so
projections, attention and LayerNorm statistics cost O(h*w*R) per prompt instead of
O(h*w*256*128). The IoU head runs on all prompts; the mask head (the expensive
upscaling) only on prompts with a mask that passes ``iou_thresh``. The result equals
the plain decoder up to float rounding (tested). Runs in float32 (autocast off).
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from ...runtime.device import autocast_off

__all__ = ["decode_points", "decode_sparse", "mask_region", "point_sparse", "supports_factored"]

MASK_HEAD_BYTES = 128 * 2**20  # activations of the mask upscaling computed at once (GPU)
CPU_BLOCK_BYTES = 4 * 2**20  # on a CPU: small blocks, so the chain of per-pixel ops runs in cache
CPU_PROMPT_CHUNK = 8  # prompts decoded together on a CPU (see decode_sparse)


def point_sparse(sam, coords: torch.Tensor) -> torch.Tensor:
    """Sparse embeddings (N, 2, C) of single positive points (input-frame xy), padded as
    the official predictor does for point-only prompts."""
    labels = torch.ones(coords.shape[0], 1, dtype=torch.int64, device=coords.device)
    sparse, _ = sam.prompt_encoder(points=(coords[:, None, :].float(), labels), boxes=None, masks=None)
    return sparse


def supports_factored(sam) -> bool:
    dec = getattr(sam, "mask_decoder", None)
    tr = getattr(dec, "transformer", None)
    return (tr is not None and hasattr(tr, "layers") and hasattr(tr, "final_attn_token_to_image")
            and hasattr(dec, "output_upscaling") and hasattr(sam.prompt_encoder, "no_mask_embed"))


def _heads(x: torch.Tensor, h: int) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], h, x.shape[-1] // h)


class _Factored:
    """Per-prompt image features ``alpha * S + U @ V`` with ``S`` (P, C) shared."""

    def __init__(self, S: torch.Tensor, n: int, memo: dict | None = None):
        self.S = S
        self.alpha = S.new_ones(n, S.shape[0])
        self.U = S.new_zeros(n, S.shape[0], 0)
        self.V = S.new_zeros(n, 0, S.shape[1])
        self.stage = 0  # how many layer norms S went through
        self.memo = {} if memo is None else memo

    def shared(self, key, fn):
        """``fn()``, a function of the shared features alone, computed once per embedding
        when the caller keeps ``memo`` (interactive prompts on one image)."""
        k = (self.stage, key)
        v = self.memo.get(k)
        if v is None:
            v = self.memo[k] = fn()
        return v

    def proj_parts(self, lin: torch.nn.Linear):
        """``lin(X)`` as (shared W S (P, D), per-prompt V W^T (n, R, D)); bias not included."""
        return self.shared(id(lin), lambda: self.S @ lin.weight.T), self.V @ lin.weight.T

    def add_low_rank(self, U: torch.Tensor, V: torch.Tensor) -> None:
        self.U = torch.cat([self.U, U], dim=2)
        self.V = torch.cat([self.V, V], dim=1)

    def layer_norm(self, norm: torch.nn.LayerNorm) -> None:
        """X <- LayerNorm(X) over channels, exactly, in factored form."""
        S, a, U, V = self.S, self.alpha, self.U, self.V
        c = S.shape[1]
        mean = a * self.shared("sum", lambda: S.sum(1))
        if V.shape[1]:
            mean = mean + (U @ V.sum(2)[..., None]).squeeze(-1)
        mean = mean / c
        sq = a * a * self.shared("sumsq", lambda: (S * S).sum(1))
        if V.shape[1]:
            sv = torch.einsum("pc,nrc->npr", S, V)
            sq = sq + 2 * a * (U * sv).sum(2) + ((U @ (V @ V.transpose(1, 2))) * U).sum(2)
        var = (sq / c - mean * mean).clamp_min(0)
        inv = torch.rsqrt(var + norm.eps)
        g, b = norm.weight, norm.bias
        n = a.shape[0]
        ones = torch.ones_like(inv)[..., None]
        self.S = self.shared("next", lambda: S * g)
        self.stage += 1
        self.alpha = a * inv
        self.U = torch.cat([U * inv[..., None], (-mean * inv)[..., None], ones], dim=2)
        self.V = torch.cat([V * g, g.expand(n, 1, -1), b.expand(n, 1, -1)], dim=1)

    def materialize(self, idx: torch.Tensor) -> torch.Tensor:
        """(k, P, C) features of the prompts ``idx``."""
        return self.alpha[idx, :, None] * self.S + self.U[idx] @ self.V[idx]


def _token_to_image(attn, q_tok: torch.Tensor, X: _Factored, pe_proj_k: torch.Tensor) -> torch.Tensor:
    """``attn(q=q_tok, k=X + pe, v=X)`` for tokens (n, T, C) against factored image features."""
    h = attn.num_heads
    q = _heads(attn.q_proj(q_tok), h)  # n T h d
    q = q * (1.0 / math.sqrt(q.shape[-1]))
    ks, kv = X.proj_parts(attn.k_proj)
    ks = _heads(ks, h)  # P h d
    kpe = _heads(pe_proj_k, h)  # P h d   (W_k pe + b_k)
    kv = _heads(kv, h)  # n R h d
    logits = torch.addcmul(torch.einsum("nthd,phd->nhtp", q, kpe), torch.einsum("nthd,phd->nhtp", q, ks),
                           X.alpha[:, None, None, :])
    if X.V.shape[1]:
        b = torch.einsum("nthd,nrhd->nhtr", q, kv)
        logits = logits + torch.einsum("nhtr,npr->nhtp", b, X.U)
    w = torch.softmax(logits, dim=-1)  # n h T P
    vs, vv = X.proj_parts(attn.v_proj)
    out = torch.einsum("nhtp,phd->nthd", w * X.alpha[:, None, None, :], _heads(vs, h))
    if X.V.shape[1]:
        wu = torch.einsum("nhtp,npr->nhtr", w, X.U)
        out = out + torch.einsum("nhtr,nrhd->nthd", wu, _heads(vv, h))
    out = out.reshape(*out.shape[:2], -1) + attn.v_proj.bias
    return attn.out_proj(out)


def _image_to_token(attn, X: _Factored, pe_proj_q: torch.Tensor, k_tok: torch.Tensor,
                    v_tok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``attn(q=X + pe, k=k_tok, v=v_tok)`` as a low-rank update (U (n, P, h*T), V (n, h*T, C)),
    the out-projection bias included as one more rank."""
    h = attn.num_heads
    k = _heads(attn.k_proj(k_tok), h)  # n T h d
    v = _heads(attn.v_proj(v_tok), h)  # n T h d
    k = k * (1.0 / math.sqrt(k.shape[-1]))
    qs, qv = X.proj_parts(attn.q_proj)
    # logits laid out (n, h, T, P): the softmax runs over the few tokens along a long, contiguous P
    logits = torch.addcmul(torch.einsum("nthd,phd->nhtp", k, _heads(pe_proj_q, h)),
                           torch.einsum("nthd,phd->nhtp", k, _heads(qs, h)), X.alpha[:, None, None, :])
    if X.V.shape[1]:
        b = torch.einsum("nrhd,nthd->nhtr", _heads(qv, h), k)
        logits = logits + torch.einsum("nhtr,npr->nhtp", b, X.U)
    w = torch.softmax(logits, dim=2)  # n h T P
    n, hh, t, p = w.shape
    wo = attn.out_proj.weight  # C x (h d)
    m = torch.einsum("nthd,chd->nhtc", v, _heads(wo, h))  # n h T C
    U = torch.cat([w.permute(0, 3, 1, 2).reshape(n, p, hh * t), w.new_ones(n, p, 1)], dim=2)
    V = torch.cat([m.reshape(n, hh * t, -1), attn.out_proj.bias.expand(n, 1, -1)], dim=1)
    return U, V


def _is_up2(m) -> bool:
    return (isinstance(m, torch.nn.ConvTranspose2d) and m.kernel_size == (2, 2) and m.stride == (2, 2)
            and m.padding == (0, 0) and m.groups == 1 and m.output_padding == (0, 0)
            and m.dilation == (1, 1))


def _up2(conv) -> tuple[torch.Tensor, torch.Tensor]:
    """A 2x2/stride-2 transposed convolution as a (Cin, 4*Cout) matrix and bias, output
    columns ordered (i, j, Cout): each input pixel becomes its 2x2 output pixels."""
    cin, cout = conv.weight.shape[:2]
    w = conv.weight.reshape(cin, cout, 4).transpose(1, 2).reshape(cin, 4 * cout)
    b = conv.bias.repeat(4) if conv.bias is not None else w.new_zeros(4 * cout)
    return w, b


def _fast_upscaling(dec) -> bool:
    seq = list(dec.output_upscaling)
    return (len(seq) == 5 and _is_up2(seq[0]) and _is_up2(seq[3])
            and hasattr(seq[1], "weight") and hasattr(seq[1], "eps"))


def _masks(dec, X: _Factored, idx: torch.Tensor, hyper: torch.Tensor, h: int, w: int,
           shared: torch.Tensor | None, roi: torch.Tensor | None = None) -> torch.Tensor:
    """Mask logits (k, M, 4h, 4w) of prompts ``idx`` from their mask-token hypernetwork
    outputs ``hyper`` (k, M, C/8).

    SAM's upscaling is ConvT(2x2, s2) -> LayerNorm2d -> act -> ConvT(2x2, s2) -> act, then
    a product with ``hyper``. Every step acts on each pixel on its own (a 2x2/stride-2
    transposed convolution maps one pixel to its 2x2 children), so the features stay a
    flat list of pixels in "sub-pixel" order (y, x, i, j, i2, j2) and only the small
    final mask tensor is rearranged into an image. The first convolution runs on the
    factors (``shared`` = ``S @ W1``, computed once per call). Same numbers as the module.
    Other upscaling stacks fall back to the module. ``roi`` (k, 4) ``r0, c0, r1, c1`` in
    embedding cells: each prompt's logits only there (the same numbers), ``ROI_FILL`` elsewhere.
    """
    seq = list(dec.output_upscaling)
    k = len(idx)
    if shared is None:
        feats = X.materialize(idx)
        up = dec.output_upscaling(feats.transpose(1, 2).reshape(k, -1, h, w))
        b, cu, uh, uw = up.shape
        return (hyper @ up.reshape(b, cu, uh * uw)).view(b, -1, uh, uw)
    w1, b1 = _up2(seq[0])
    w2, b2 = _up2(seq[3])
    c1, c2 = w1.shape[1] // 4, w2.shape[1] // 4
    vw1 = X.V[idx] @ w1  # k, R, (i j c1)
    if roi is not None:
        return _masks_roi(seq, X, idx, hyper, h, w, shared, roi, vw1, (b1, w2, b2, c1, c2))
    out = hyper.new_empty(k, hyper.shape[1], 4 * h, 4 * w)
    # blocks of prompts x grid rows small enough for the activations to stay in cache on a CPU
    budget = (MASK_HEAD_BYTES if X.S.device.type != "cpu" else CPU_BLOCK_BYTES) // 4
    per_row = w * 16 * c2  # second-upscaling activations of one grid row of one prompt
    kk = max(1, min(k, budget // (per_row * h)))
    rows = h if kk > 1 else max(1, min(h, budget // per_row))
    for a in range(0, k, kk):
        ii, ka = idx[a:a + kk], min(kk, k - a)
        for r0 in range(0, h, rows):
            r1 = min(h, r0 + rows)
            px = slice(r0 * w, r1 * w)
            y = torch.baddbmm(torch.addcmul(b1, X.alpha[ii, px, None], shared[px]), X.U[ii, px], vw1[a:a + kk])
            y = seq[2](F.layer_norm(y.view(ka, -1, c1), (c1,), seq[1].weight, seq[1].bias, seq[1].eps))
            z = seq[4](torch.addmm(b2, y.view(-1, c1), w2)).view(ka, -1, c2)  # (px i j i2 j2), c2
            m = torch.bmm(z, hyper[a:a + kk].transpose(1, 2)).view(ka, r1 - r0, w, 2, 2, 2, 2, -1)
            out[a:a + kk, :, 4 * r0:4 * r1] = m.permute(0, 7, 1, 3, 5, 2, 4, 6).reshape(ka, -1, 4 * (r1 - r0), 4 * w)
    return out


ROI_FILL = -1e4  # mask logits outside a prompt's region of interest (no mask there)
ROI_CONTEXT = 0.5  # mask logits computed over the box grown by half its size per side (mask_region)


def mask_region(boxes_in: np.ndarray, input_size: int, grid: int,
                context: float = ROI_CONTEXT) -> np.ndarray:
    """Per box (N, 4) in model input px: the rectangle of embedding cells (``r0, c0, r1,
    c1``, end exclusive, on a ``grid`` x ``grid`` embedding) its mask is computed in: the
    box grown by ``context`` times its size (at least 8 input px) on every side. A mask
    that reaches further is cut there (box mode wants the object in the box)."""
    b = np.asarray(boxes_in, dtype=np.float64).reshape(-1, 4)
    grow = np.maximum(context * (b[:, 2:] - b[:, :2]), 8.0)
    cell = input_size / grid
    lo = np.floor((b[:, :2] - grow) / cell).astype(np.int64)
    hi = np.ceil((b[:, 2:] + 1 + grow) / cell).astype(np.int64)
    return np.clip(np.stack([lo[:, 1], lo[:, 0], hi[:, 1], hi[:, 0]], 1), 0, grid)


def _masks_roi(seq, X: _Factored, idx, hyper, h: int, w: int, shared, roi, vw1, consts) -> torch.Tensor:
    """:func:`_masks` of each prompt in its own rectangle of embedding cells only."""
    b1, w2, b2, c1, c2 = consts
    out = hyper.new_full((len(idx), hyper.shape[1], 4 * h, 4 * w), ROI_FILL)
    ar_w = torch.arange(w, device=shared.device)
    for a, (i, (r0, c0, r1, c1_)) in enumerate(zip(idx.tolist(), roi.tolist())):
        r0, c0, r1, c1_ = max(0, r0), max(0, c0), min(h, r1), min(w, c1_)
        if r1 <= r0 or c1_ <= c0:
            continue
        px = (torch.arange(r0, r1, device=shared.device)[:, None] * w + ar_w[c0:c1_]).flatten()
        y = torch.addmm(torch.addcmul(b1, X.alpha[i, px, None], shared[px]), X.U[i, px], vw1[a])
        y = seq[2](F.layer_norm(y.view(-1, c1), (c1,), seq[1].weight, seq[1].bias, seq[1].eps))
        z = seq[4](torch.addmm(b2, y.view(-1, c1), w2)).view(-1, c2)
        m = (z @ hyper[a].T).view(r1 - r0, c1_ - c0, 2, 2, 2, 2, -1)
        out[a, :, 4 * r0:4 * r1, 4 * c0:4 * c1_] = m.permute(6, 0, 2, 4, 1, 3, 5).reshape(
            -1, 4 * (r1 - r0), 4 * (c1_ - c0))
    return out


def _factored(sam, emb: torch.Tensor, sparse: torch.Tensor, sl: slice, iou_thresh: float,
              memo: dict | None = None, roi: torch.Tensor | None = None):
    dec = sam.mask_decoder
    tr = dec.transformer
    c, hh, ww = emb.shape
    n = sparse.shape[0]
    memo = {} if memo is None else memo
    if "src" not in memo or "pe" not in memo:
        # to the device (and a bf16 embedding to fp32) once per memo, not per call
        emb = emb.to(sparse.device).float()
        src = (emb + sam.prompt_encoder.no_mask_embed.weight.reshape(c, 1, 1)).flatten(1).T  # P C
        pe = sam.prompt_encoder.get_dense_pe()[0].flatten(1).T.float()  # P C
        memo.update(src=src, pe=pe)  # both or neither: an OOM above leaves the memo empty
    src, pe = memo["src"], memo["pe"]

    def pe_proj(lin):  # W pe + b: the same for every prompt
        key = ("pe", id(lin))
        if key not in memo:
            memo[key] = pe @ lin.weight.T + lin.bias
        return memo[key]

    out_tok = torch.cat([dec.iou_token.weight, dec.mask_tokens.weight], dim=0)
    tokens = torch.cat([out_tok.unsqueeze(0).expand(n, -1, -1), sparse.float()], dim=1)
    X = _Factored(src.float(), n, memo)
    queries, qpe = tokens, tokens
    for layer in tr.layers:
        if layer.skip_first_layer_pe:
            queries = layer.self_attn(q=queries, k=queries, v=queries)
        else:
            q = queries + qpe
            queries = queries + layer.self_attn(q=q, k=q, v=queries)
        queries = layer.norm1(queries)
        a = layer.cross_attn_token_to_image
        queries = layer.norm2(queries + _token_to_image(a, queries + qpe, X, pe_proj(a.k_proj)))
        queries = layer.norm3(queries + layer.mlp(queries))
        a = layer.cross_attn_image_to_token
        X.add_low_rank(*_image_to_token(a, X, pe_proj(a.q_proj), queries + qpe, queries))
        X.layer_norm(layer.norm4)
    a = tr.final_attn_token_to_image
    queries = tr.norm_final_attn(queries + _token_to_image(a, queries + qpe, X, pe_proj(a.k_proj)))
    iou = dec.iou_prediction_head(queries[:, 0, :])[:, sl]
    sel = torch.nonzero((iou > iou_thresh).any(1)).flatten()
    if sel.numel() == 0:
        side = 4 * hh
        return iou, sel, iou.new_zeros(0, iou.shape[1], side, side)
    nt = dec.num_mask_tokens
    mask_tok = queries[sel, 1:1 + nt, :]
    hyper = torch.stack([dec.output_hypernetworks_mlps[i](mask_tok[:, i, :]) for i in range(nt)[sl]], dim=1)
    if not _fast_upscaling(dec):  # the module, a few prompts at a time
        chunk = max(1, MASK_HEAD_BYTES // (16 * hh * ww * c // 2 * 4))
        return iou, sel, torch.cat([_masks(dec, X, sel[k:k + chunk], hyper[k:k + chunk], hh, ww, None)
                                    for k in range(0, len(sel), chunk)])
    shared = X.shared("up", lambda: X.S @ _up2(dec.output_upscaling[0])[0])
    return iou, sel, _masks(dec, X, sel, hyper, hh, ww, shared, None if roi is None else roi[sel])


_OUTPUTS = {"multi": slice(1, None), "single": slice(0, 1), "all": slice(0, None)}


def decode_sparse(sam, emb: torch.Tensor, sparse: torch.Tensor, outputs: str = "multi",
                  iou_thresh: float = float("-inf"), factored: bool | None = None,
                  memo: dict | None = None, roi: torch.Tensor | None = None,
                  device: torch.device | str | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decode N prompts (sparse embeddings (N, T, C), no mask input) against one embedding.

    emb: (C, h, w) on the model's device. ``outputs``: ``"multi"`` (the 3 multimask
    outputs), ``"single"`` (the single-mask output) or ``"all"`` (single, then the 3).
    Returns ``(iou (N, M), sel (K,), low_res (K, M, 4h, 4w))``: predicted IoUs of every
    prompt and the low-res logits of the prompts ``sel`` with at least one output whose
    predicted IoU exceeds ``iou_thresh``, all float32. ``factored``: None uses the
    factored decoder whenever the model supports it. ``memo``: a dict the caller keeps
    for this one embedding (and model); the factored decoder stores there what depends on
    the embedding alone (about 75 % of a single prompt's work), so later calls with the
    same dict skip it. Never share one dict between embeddings. ``roi`` (N, 4) int
    ``r0, c0, r1, c1`` (rows, columns of the embedding grid, end exclusive): the factored
    decoder computes each prompt's mask logits in that rectangle only (the same numbers
    there; ``ROI_FILL`` outside), which a box prompt needs near its box alone.
    ``device``: where the decoder runs (default: ``emb``'s device); the factored decoder
    copies a host ``emb`` there only when ``memo`` does not hold its products yet.
    """
    sl = _OUTPUTS[outputs]
    if factored is None:
        factored = supports_factored(sam)
    dev = emb.device if device is None else torch.device(device)
    if not factored:
        emb = emb.to(dev)
    if factored:
        memo = {} if memo is None else memo
        # on a CPU, a few prompts at a time keep the attention maps in cache (measured
        # faster than 64 at once: docs/benchmarks.md); the shared products are computed once (memo)
        step = CPU_PROMPT_CHUNK if dev.type == "cpu" else max(1, sparse.shape[0])
        parts = []
        with autocast_off(dev):
            for a in range(0, max(1, sparse.shape[0]), step):
                iou, sel, low = _factored(sam, emb, sparse[a:a + step].float().to(dev), sl, iou_thresh, memo,
                                          None if roi is None else roi[a:a + step])
                parts.append((iou, sel + a, low))
        if len(parts) == 1:
            return parts[0]
        return tuple(torch.cat(t) for t in zip(*parts))  # type: ignore[return-value]
    dense = sam.prompt_encoder.no_mask_embed.weight.reshape(1, -1, 1, 1).expand(
        sparse.shape[0], -1, emb.shape[1], emb.shape[2])
    low, iou = sam.mask_decoder.predict_masks(emb[None], sam.prompt_encoder.get_dense_pe(), sparse, dense)
    low, iou = low[:, sl].float(), iou[:, sl].float()
    sel = torch.nonzero((iou > iou_thresh).any(1)).flatten()
    return iou, sel, low[sel]


def decode_points(sam, emb: torch.Tensor, coords: torch.Tensor, multimask: bool = True,
                  iou_thresh: float = float("-inf"), factored: bool | None = None,
                  memo: dict | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`decode_sparse` for one positive point per prompt; coords: (N, 2) input-frame xy."""
    with autocast_off(emb.device):
        sparse = point_sparse(sam, coords)
    return decode_sparse(sam, emb, sparse, "multi" if multimask else "single", iou_thresh, factored, memo)
