"""Decoding many point prompts against one image embedding, cheaply.

Segment-everything decodes hundreds of single-point prompts on the *same* embedding.
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

import torch
import torch.nn.functional as F

__all__ = ["decode_points", "point_sparse", "supports_factored"]


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

    def __init__(self, S: torch.Tensor, n: int):
        self.S = S
        self.alpha = S.new_ones(n, S.shape[0])
        self.U = S.new_zeros(n, S.shape[0], 0)
        self.V = S.new_zeros(n, 0, S.shape[1])

    def proj_parts(self, lin: torch.nn.Linear):
        """``lin(X)`` as (shared W S (P, D), per-prompt V W^T (n, R, D)); bias not included."""
        return self.S @ lin.weight.T, self.V @ lin.weight.T

    def add_low_rank(self, U: torch.Tensor, V: torch.Tensor) -> None:
        self.U = torch.cat([self.U, U], dim=2)
        self.V = torch.cat([self.V, V], dim=1)

    def layer_norm(self, norm: torch.nn.LayerNorm) -> None:
        """X <- LayerNorm(X) over channels, exactly, in factored form."""
        S, a, U, V = self.S, self.alpha, self.U, self.V
        c = S.shape[1]
        mean = a * S.sum(1)
        if V.shape[1]:
            mean = mean + (U @ V.sum(2)[..., None]).squeeze(-1)
        mean = mean / c
        sq = a * a * (S * S).sum(1)
        if V.shape[1]:
            sv = torch.einsum("pc,nrc->npr", S, V)
            sq = sq + 2 * a * (U * sv).sum(2) + ((U @ (V @ V.transpose(1, 2))) * U).sum(2)
        var = (sq / c - mean * mean).clamp_min(0)
        inv = torch.rsqrt(var + norm.eps)
        g, b = norm.weight, norm.bias
        n = a.shape[0]
        ones = torch.ones_like(inv)[..., None]
        self.S = S * g
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
    scale = 1.0 / math.sqrt(q.shape[-1])
    ks, kv = X.proj_parts(attn.k_proj)
    ks = _heads(ks, h)  # P h d
    kpe = _heads(pe_proj_k, h)  # P h d   (W_k pe + b_k)
    kv = _heads(kv, h)  # n R h d
    logits = torch.einsum("nthd,phd->nhtp", q, ks) * X.alpha[:, None, None, :]
    logits = logits + torch.einsum("nthd,phd->nhtp", q, kpe)
    if X.V.shape[1]:
        b = torch.einsum("nthd,nrhd->nhtr", q, kv)
        logits = logits + torch.einsum("nhtr,npr->nhtp", b, X.U)
    w = torch.softmax(logits * scale, dim=-1)  # n h T P
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
    scale = 1.0 / math.sqrt(k.shape[-1])
    qs, qv = X.proj_parts(attn.q_proj)
    logits = torch.einsum("phd,nthd->nhpt", _heads(qs, h), k) * X.alpha[:, None, :, None]
    logits = logits + torch.einsum("phd,nthd->nhpt", _heads(pe_proj_q, h), k)
    if X.V.shape[1]:
        b = torch.einsum("nrhd,nthd->nhrt", _heads(qv, h), k)
        logits = logits + torch.einsum("npr,nhrt->nhpt", X.U, b)
    w = torch.softmax(logits * scale, dim=-1)  # n h P T
    n, hh, p, t = w.shape
    wo = attn.out_proj.weight  # C x (h d)
    m = torch.einsum("nthd,chd->nhtc", v, _heads(wo, h))  # n h T C
    U = torch.cat([w.permute(0, 2, 1, 3).reshape(n, p, hh * t), w.new_ones(n, p, 1)], dim=2)
    V = torch.cat([m.reshape(n, hh * t, -1), attn.out_proj.bias.expand(n, 1, -1)], dim=1)
    return U, V


def _is_up2(m) -> bool:
    return (isinstance(m, torch.nn.ConvTranspose2d) and m.kernel_size == (2, 2) and m.stride == (2, 2)
            and m.padding == (0, 0) and m.groups == 1 and m.output_padding == (0, 0)
            and m.dilation == (1, 1))


def _up2_weight(conv) -> torch.Tensor:
    """(Cin, Cout*4) matrix of a 2x2/stride-2 transposed convolution (outputs o, i, j)."""
    return conv.weight.reshape(conv.weight.shape[0], -1)


def _masks(dec, X: _Factored, idx: torch.Tensor, hyper: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Mask logits (k, M, 4h, 4w) of prompts ``idx`` from their mask-token hypernetwork
    outputs ``hyper`` (k, M, C/8).

    SAM's upscaling is ConvT(2x2, s2) -> LayerNorm2d -> act -> ConvT(2x2, s2) -> act.
    A 2x2/stride-2 transposed convolution is a per-pixel linear map, so the first one
    runs on the factors (never materialising the features), and everything after it
    runs channels-last as matrix products with a fused LayerNorm; the result is the
    same numbers in a different order. Other upscaling stacks fall back to the module.
    """
    seq = list(dec.output_upscaling)
    k = len(idx)
    fast = (len(seq) == 5 and _is_up2(seq[0]) and _is_up2(seq[3])
            and hasattr(seq[1], "weight") and hasattr(seq[1], "eps"))
    if not fast:
        feats = X.materialize(idx)
        up = dec.output_upscaling(feats.transpose(1, 2).reshape(k, -1, h, w))
        b, cu, uh, uw = up.shape
        return (hyper @ up.reshape(b, cu, uh * uw)).view(b, -1, uh, uw)
    c1, c2 = seq[0].weight.shape[1], seq[3].weight.shape[1]
    w1 = _up2_weight(seq[0])
    y = X.alpha[idx, :, None] * (X.S @ w1) + X.U[idx] @ (X.V[idx] @ w1)  # k, (h w), (c1 i j)
    if seq[0].bias is not None:
        y = y + seq[0].bias.repeat_interleave(4)
    # -> channels-last image (k, 2h, 2w, c1)
    y = y.reshape(k, h, w, c1, 2, 2).permute(0, 1, 4, 2, 5, 3).reshape(k, 2 * h, 2 * w, c1)
    y = seq[2](F.layer_norm(y, (c1,), seq[1].weight, seq[1].bias, seq[1].eps))
    z = y @ _up2_weight(seq[3])  # k, 2h, 2w, (c2 i j)
    if seq[3].bias is not None:
        z = z + seq[3].bias.repeat_interleave(4)
    z = seq[4](z).reshape(k, 2 * h, 2 * w, c2, 4)
    m = torch.einsum("kmc,kyxcq->kmyxq", hyper, z)  # q = (i, j)
    m = m.reshape(k, -1, 2 * h, 2 * w, 2, 2).permute(0, 1, 2, 4, 3, 5)
    return m.reshape(k, -1, 4 * h, 4 * w)


def _factored(sam, emb: torch.Tensor, sparse: torch.Tensor, multimask: bool, iou_thresh: float):
    dec = sam.mask_decoder
    tr = dec.transformer
    c, hh, ww = emb.shape
    n = sparse.shape[0]
    src = (emb + sam.prompt_encoder.no_mask_embed.weight.reshape(c, 1, 1)).flatten(1).T  # P C
    pe = sam.prompt_encoder.get_dense_pe()[0].flatten(1).T.float()  # P C
    out_tok = torch.cat([dec.iou_token.weight, dec.mask_tokens.weight], dim=0)
    tokens = torch.cat([out_tok.unsqueeze(0).expand(n, -1, -1), sparse.float()], dim=1)
    X = _Factored(src.float(), n)
    queries, qpe = tokens, tokens
    for layer in tr.layers:
        if layer.skip_first_layer_pe:
            queries = layer.self_attn(q=queries, k=queries, v=queries)
        else:
            q = queries + qpe
            queries = queries + layer.self_attn(q=q, k=q, v=queries)
        queries = layer.norm1(queries)
        a = layer.cross_attn_token_to_image
        kpe = pe @ a.k_proj.weight.T + a.k_proj.bias
        queries = layer.norm2(queries + _token_to_image(a, queries + qpe, X, kpe))
        queries = layer.norm3(queries + layer.mlp(queries))
        a = layer.cross_attn_image_to_token
        qpe_img = pe @ a.q_proj.weight.T + a.q_proj.bias
        X.add_low_rank(*_image_to_token(a, X, qpe_img, queries + qpe, queries))
        X.layer_norm(layer.norm4)
    a = tr.final_attn_token_to_image
    kpe = pe @ a.k_proj.weight.T + a.k_proj.bias
    queries = tr.norm_final_attn(queries + _token_to_image(a, queries + qpe, X, kpe))
    iou = dec.iou_prediction_head(queries[:, 0, :])
    sl = slice(1, None) if multimask else slice(0, 1)
    iou = iou[:, sl]
    sel = torch.nonzero((iou > iou_thresh).any(1)).flatten()
    if sel.numel() == 0:
        side = 4 * hh
        return iou, sel, iou.new_zeros(0, iou.shape[1], side, side)
    nt = dec.num_mask_tokens
    mask_tok = queries[sel, 1:1 + nt, :]
    hyper = torch.stack([dec.output_hypernetworks_mlps[i](mask_tok[:, i, :]) for i in range(nt)[sl]], dim=1)
    return iou, sel, _masks(dec, X, sel, hyper, hh, ww)


def decode_points(sam, emb: torch.Tensor, coords: torch.Tensor, multimask: bool = True,
                  iou_thresh: float = float("-inf"), factored: bool | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decode one positive point per prompt against one embedding.

    emb: (C, h, w) on the model's device; coords: (N, 2) input-frame xy.
    Returns ``(iou (N, M), sel (K,), low_res (K, M, 4h, 4w))``: predicted IoUs of every
    prompt and the low-res logits of the prompts ``sel`` with at least one mask whose
    predicted IoU exceeds ``iou_thresh`` (M = 3 with ``multimask``, else 1), all float32.
    ``factored``: None picks the factored decoder whenever the model supports it.
    """
    if factored is None:
        factored = supports_factored(sam)
    dev = emb.device
    with torch.autocast(dev.type, enabled=False):
        sparse = point_sparse(sam, coords)
        if factored:
            return _factored(sam, emb.float(), sparse.float(), multimask, iou_thresh)
    dense = sam.prompt_encoder.no_mask_embed.weight.reshape(1, -1, 1, 1).expand(
        sparse.shape[0], -1, emb.shape[1], emb.shape[2])
    low, iou = sam.mask_decoder(image_embeddings=emb[None], image_pe=sam.prompt_encoder.get_dense_pe(),
                                sparse_prompt_embeddings=sparse, dense_prompt_embeddings=dense,
                                multimask_output=multimask)
    low, iou = low.float(), iou.float()
    sel = torch.nonzero((iou > iou_thresh).any(1)).flatten()
    return iou, sel, low[sel]
