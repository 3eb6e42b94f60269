# Derived from segment-anything (Meta Platforms, Inc. and affiliates, Apache-2.0).
# Licence texts: LICENSES/; details: NOTICE. Modifications: BSD-3-Clause, see LICENSE.
"""SAM's ViT image encoder (ViT-B/L/H), official state-dict key names.

Same architecture and math as the official ``ImageEncoderViT`` (ViTDet backbone:
windowed attention with a few global blocks, decomposed relative positions, conv neck),
with three differences that matter for speed and safety:

* batched input (``B x 3 x H x W``, any B) with no per-image loops;
* the attention kernel is selectable (``attn_impl``, see :mod:`.attention`);
* LayerNorm statistics, rel-pos sums and softmax stay float32 under fp16 autocast, and
  the residual stream stays float32 under any autocast.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .attention import ATTN_IMPLS, attention, resolve_attn_impl
from .common import LayerNorm2d, MLPBlock, layer_norm


class PatchEmbed(nn.Module):
    """Non-overlapping patch projection; returns ``B x H x W x C`` tokens."""

    def __init__(self, patch_size: int = 16, in_chans: int = 3, embed_dim: int = 768) -> None:
        super().__init__()
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).permute(0, 2, 3, 1)


class Attention(nn.Module):
    """Multi-head self-attention over a ``B x H x W x C`` grid with relative positions."""

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        qkv_bias: bool = True,
        use_rel_pos: bool = False,
        input_size: Optional[Tuple[int, int]] = None,
        attn_impl: str = "auto",
    ) -> None:
        super().__init__()
        if attn_impl not in ATTN_IMPLS:
            raise ValueError(f"attn_impl must be one of {ATTN_IMPLS}, got {attn_impl!r}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.attn_impl = attn_impl
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.use_rel_pos = use_rel_pos
        if use_rel_pos:
            if input_size is None:
                raise ValueError("input_size is required for relative positional encoding")
            self.rel_pos_h = nn.Parameter(torch.zeros(2 * input_size[0] - 1, self.head_dim))
            self.rel_pos_w = nn.Parameter(torch.zeros(2 * input_size[1] - 1, self.head_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, h, w, c = x.shape
        n = h * w
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # B x heads x N x hd
        rel = (self.rel_pos_h, self.rel_pos_w) if self.use_rel_pos else None
        impl = resolve_attn_impl(self.attn_impl, x.device)
        out = attention(q, k, v, impl, rel=rel, hw=(h, w))
        out = out.view(b, self.num_heads, h, w, self.head_dim).permute(0, 2, 3, 1, 4)
        return self.proj(out.reshape(b, h, w, c))


def window_partition(x: torch.Tensor, window_size: int) -> Tuple[torch.Tensor, Tuple[int, int]]:
    """``B x H x W x C`` -> ``B*nWin x ws x ws x C`` (zero-padded), plus the padded size."""
    b, h, w, c = x.shape
    pad_h = (window_size - h % window_size) % window_size
    pad_w = (window_size - w % window_size) % window_size
    if pad_h or pad_w:
        x = F.pad(x, (0, 0, 0, pad_w, 0, pad_h))
    hp, wp = h + pad_h, w + pad_w
    x = x.view(b, hp // window_size, window_size, wp // window_size, window_size, c)
    windows = x.permute(0, 1, 3, 2, 4, 5).reshape(-1, window_size, window_size, c)
    return windows, (hp, wp)


def window_unpartition(
    windows: torch.Tensor, window_size: int, pad_hw: Tuple[int, int], hw: Tuple[int, int]
) -> torch.Tensor:
    """Inverse of :func:`window_partition` (drops the padding)."""
    hp, wp = pad_hw
    h, w = hw
    b = windows.shape[0] // ((hp // window_size) * (wp // window_size))
    x = windows.view(b, hp // window_size, wp // window_size, window_size, window_size, -1)
    x = x.permute(0, 1, 3, 2, 4, 5).reshape(b, hp, wp, -1)
    if hp > h or wp > w:
        x = x[:, :h, :w, :]
    return x


class Block(nn.Module):
    """Transformer block with windowed (``window_size > 0``) or global attention."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        use_rel_pos: bool = False,
        window_size: int = 0,
        input_size: Optional[Tuple[int, int]] = None,
        attn_impl: str = "auto",
        norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps)
        self.attn = Attention(
            dim,
            num_heads=num_heads,
            qkv_bias=qkv_bias,
            use_rel_pos=use_rel_pos,
            input_size=input_size if window_size == 0 else (window_size, window_size),
            attn_impl=attn_impl,
        )
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps)
        self.mlp = MLPBlock(embedding_dim=dim, mlp_dim=int(dim * mlp_ratio), act=nn.GELU)
        self.window_size = window_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x
        x = layer_norm(x, self.norm1)
        if self.window_size > 0:
            h, w = x.shape[1], x.shape[2]
            x, pad_hw = window_partition(x, self.window_size)
            x = self.attn(x)
            x = window_unpartition(x, self.window_size, pad_hw, (h, w))
        else:
            x = self.attn(x)
        x = shortcut + x
        return x + self.mlp(layer_norm(x, self.norm2))


class ImageEncoderViT(nn.Module):
    """ViT-B/L/H image encoder of SAM: ``B x 3 x S x S`` -> ``B x out_chans x S/16 x S/16``."""

    def __init__(
        self,
        img_size: int = 1024,
        patch_size: int = 16,
        in_chans: int = 3,
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        mlp_ratio: float = 4.0,
        out_chans: int = 256,
        qkv_bias: bool = True,
        use_abs_pos: bool = True,
        use_rel_pos: bool = True,
        window_size: int = 14,
        global_attn_indexes: Tuple[int, ...] = (),
        attn_impl: str = "auto",
    ) -> None:
        super().__init__()
        self.img_size = img_size
        self.patch_size = patch_size
        self.embed_dim = embed_dim
        self.out_chans = out_chans
        grid = img_size // patch_size
        self.patch_embed = PatchEmbed(patch_size, in_chans, embed_dim)
        self.pos_embed: Optional[nn.Parameter] = None
        if use_abs_pos:
            self.pos_embed = nn.Parameter(torch.zeros(1, grid, grid, embed_dim))
        self.blocks = nn.ModuleList(
            Block(
                dim=embed_dim,
                num_heads=num_heads,
                mlp_ratio=mlp_ratio,
                qkv_bias=qkv_bias,
                use_rel_pos=use_rel_pos,
                window_size=0 if i in global_attn_indexes else window_size,
                input_size=(grid, grid),
                attn_impl=attn_impl,
            )
            for i in range(depth)
        )
        self.neck = nn.Sequential(
            nn.Conv2d(embed_dim, out_chans, kernel_size=1, bias=False),
            LayerNorm2d(out_chans),
            nn.Conv2d(out_chans, out_chans, kernel_size=3, padding=1, bias=False),
            LayerNorm2d(out_chans),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x)
        if self.pos_embed is not None:
            pos = self.pos_embed
            if pos.shape[1:3] != x.shape[1:3]:
                pos = F.interpolate(
                    pos.permute(0, 3, 1, 2), size=x.shape[1:3], mode="bicubic", align_corners=False
                ).permute(0, 2, 3, 1)
            x = x + pos
        for blk in self.blocks:
            x = blk(x)
        return self.neck(x.permute(0, 3, 1, 2))
