# Derived from MobileSAM (Apache-2.0); TinyViT (Microsoft Corporation, MIT); LiteMedSAM (Apache-2.0).
# Licence texts: LICENSES/; details: NOTICE. Modifications: BSD-3-Clause, see LICENSE.
"""TinyViT image encoders: MobileSAM's ``vit_t`` and LiteMedSAM's variant.

Both share one network (TinyViT-5M: dims 64/128/160/320, depths 2/2/6/2, heads
2/4/5/10, windows 7/7/14/7, MBConv stage first, conv neck to 256 channels) and the
official key names (``patch_embed.seq.*``, ``layers.*``, ``neck.*``). They differ in:

============  ===============================  ==========================
              MobileSAM (``vit_t``)            LiteMedSAM
============  ===============================  ==========================
input         1024 px                          256 px
patch embed   two 3x3 stride-2 convs (/4)      two 1x1 stride-1 convs (/1)
classifier    ``norm_head`` + ``head`` (1000)  none
              (in the checkpoint, unused)
============  ===============================  ==========================

Both produce a ``B x 256 x 64 x 64`` embedding at their native input size. Unlike the
reference code the token grid is taken from the input at run time (no hard-coded 64),
and the cached attention bias of the reference (``ab``, stale if weights are loaded after
``.eval()``) is recomputed from the parameters on every call.
"""
from __future__ import annotations

from typing import Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_fused
from .common import LayerNorm2d, layer_norm, softmax_lastdim


ATTENTION_CHUNK_BYTES = 1 << 20  # CPU inference: windows whose attention matrices fill about this


class Conv2d_BN(nn.Sequential):  # noqa: N801 - official name
    """Conv (no bias) + BatchNorm, keys ``c`` and ``bn``; ``forward(x, act="gelu")`` adds
    the GELU that follows it (one fused pass on CPU, see :mod:`.cpu_fused`)."""

    def __init__(self, a, b, ks=1, stride=1, pad=0, groups=1, bn_weight_init=1.0):
        super().__init__()
        self.add_module("c", nn.Conv2d(a, b, ks, stride, pad, groups=groups, bias=False))
        bn = nn.BatchNorm2d(b)
        nn.init.constant_(bn.weight, bn_weight_init)
        nn.init.constant_(bn.bias, 0)
        self.add_module("bn", bn)

    def foldable(self) -> bool:
        bn = self.bn
        return not self.training and bn.track_running_stats and bn.running_var is not None

    def folded(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """The convolution's weight and bias with the BatchNorm folded in (eval); folded from
        the current parameters on every call, so never stale."""
        c, bn = self.c, self.bn
        scale = bn.weight * torch.rsqrt(bn.running_var + bn.eps)
        return c.weight * scale[:, None, None, None], bn.bias - bn.running_mean * scale

    def forward(self, x: torch.Tensor, act: str | None = None) -> torch.Tensor:
        c, bn = self.c, self.bn
        if not self.foldable():
            y = bn(c(x))
            return F.gelu(y) if act == "gelu" else y
        # eval: one pass over the activations instead of two
        weight, bias = self.folded()
        return cpu_fused.conv2d(x, weight, bias, c.stride, c.padding, c.dilation, c.groups, act)


class Linear(nn.Linear):
    """``nn.Linear`` whose ``forward(x, act="gelu")`` adds the GELU that follows it."""

    def forward(self, x: torch.Tensor, act: str | None = None) -> torch.Tensor:
        return cpu_fused.linear(x, self.weight, self.bias, act)


class PatchEmbed(nn.Module):
    def __init__(self, in_chans: int, embed_dim: int, kernel: int, stride: int):
        super().__init__()
        self.reduction = stride * stride  # input px per token along each axis
        pad = kernel // 2
        self.seq = nn.Sequential(
            Conv2d_BN(in_chans, embed_dim // 2, kernel, stride, pad),
            nn.GELU(),
            Conv2d_BN(embed_dim // 2, embed_dim, kernel, stride, pad),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # seq.1 is the GELU between the convs (a module for the official layout)
        return self.seq[2](self.seq[0](x, act="gelu"))


class BandMark(nn.Module):
    """Called before each band of rows of a banded MBConv (no weights, does nothing): the
    place where forward pre-hooks, the engine's pause points among them, run between bands."""

    def forward(self) -> None:
        return None


class MBConv(nn.Module):
    def __init__(self, in_chans: int, out_chans: int, expand_ratio: float):
        super().__init__()
        hidden = int(in_chans * expand_ratio)
        self.conv1 = Conv2d_BN(in_chans, hidden, ks=1)  # + GELU
        self.conv2 = Conv2d_BN(hidden, hidden, ks=3, stride=1, pad=1, groups=hidden)  # + GELU
        self.conv3 = Conv2d_BN(hidden, out_chans, ks=1, bn_weight_init=0.0)
        self.act3 = nn.GELU()
        self.rows = BandMark()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        convs = (self.conv1, self.conv2, self.conv3)
        if cpu_fused.rows_active(x) and all(c.foldable() for c in convs) and self.conv2.c.stride == (1, 1):
            # same maths band of rows by band, in the cache (conv1-3 and act3 are not called)
            out = cpu_fused.inverted_residual_rows(x, *(c.folded() for c in convs), before_band=self.rows)
            if out is not None:
                return out  # None: the build lacks an op, the fused path is off; the plain ops below
        y = self.conv1(x, act="gelu")
        y = self.conv2(y, act="gelu")
        y = self.conv3(y)
        return self.act3(y + x)


class PatchMerging(nn.Module):
    """1x1 conv, depthwise 3x3 conv (stride ``stride``), 1x1 conv; tokens out."""

    def __init__(self, dim: int, out_dim: int, stride: int):
        super().__init__()
        self.conv1 = Conv2d_BN(dim, out_dim, 1, 1, 0)  # + GELU
        self.conv2 = Conv2d_BN(out_dim, out_dim, 3, stride, 1, groups=out_dim)  # + GELU
        self.conv3 = Conv2d_BN(out_dim, out_dim, 1, 1, 0)

    def forward(self, x: torch.Tensor, hw: Tuple[int, int]):
        if x.ndim == 3:  # B x L x C tokens -> B x C x H x W
            x = x.transpose(1, 2).reshape(x.shape[0], -1, hw[0], hw[1])
        x = self.conv1(x, act="gelu")
        x = self.conv2(x, act="gelu")
        x = self.conv3(x)
        new_hw = (x.shape[2], x.shape[3])
        return x.flatten(2).transpose(1, 2), new_hw


class ConvLayer(nn.Module):
    def __init__(self, dim: int, depth: int, out_dim: int, expand_ratio: float, merge_stride: int):
        super().__init__()
        self.blocks = nn.ModuleList(MBConv(dim, dim, expand_ratio) for _ in range(depth))
        self.downsample = PatchMerging(dim, out_dim, merge_stride)

    def forward(self, x: torch.Tensor, hw: Tuple[int, int]):
        for blk in self.blocks:
            x = blk(x)
        return self.downsample(x, hw)


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = Linear(dim, hidden)  # + GELU
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(layer_norm(x, self.norm), act="gelu"))


class Attention(nn.Module):
    """Window attention with a learned bias per (|dy|, |dx|) offset and head."""

    def __init__(self, dim: int, key_dim: int, num_heads: int, resolution: Tuple[int, int]):
        super().__init__()
        self.num_heads = num_heads
        self.key_dim = key_dim
        self.scale = key_dim**-0.5
        self.d = key_dim  # attn_ratio = 1 in every TinyViT-SAM block
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, (2 * key_dim + self.d) * num_heads)
        self.proj = nn.Linear(self.d * num_heads, dim)
        # Offsets (|dy|, |dx|) are numbered in order of first appearance when both
        # points run row-major over the window (the reference's loop); the first query
        # point (0, 0) meets every offset, so the number of (dy, dx) is dy * rw + dx.
        rh, rw = resolution
        # on the CPU also while the model is built on the meta device (build.load_sam): a
        # non-persistent buffer is not in the checkpoint that replaces the weights
        ys = torch.arange(rh, device="cpu").repeat_interleave(rw)
        xs = torch.arange(rw, device="cpu").repeat(rh)
        idxs = (ys[:, None] - ys[None, :]).abs() * rw + (xs[:, None] - xs[None, :]).abs()
        self.attention_biases = nn.Parameter(torch.zeros(num_heads, rh * rw))
        self.register_buffer("attention_bias_idxs", idxs, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # B x N x C
        b, n, _ = x.shape
        qkv = self.qkv(layer_norm(x, self.norm)).view(b, n, self.num_heads, -1)
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.d], dim=3)
        q, k, v = q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
        bias = self.attention_biases[:, self.attention_bias_idxs]
        if x.device.type == "cpu" and not torch.is_grad_enabled() and b > 1:
            # CPU inference: a few windows at a time, so that each attention matrix (5 heads
            # x 196 x 196 in the 14 px windows) is scaled, biased and normalised while it is
            # in the cache rather than in four passes over all windows' matrices at once
            step = max(1, ATTENTION_CHUNK_BYTES // (self.num_heads * n * n * 4))
            parts = [self._attend(q[i:i + step], k[i:i + step], v[i:i + step], bias)
                     for i in range(0, b, step)]
            out = parts[0] if len(parts) == 1 else torch.cat(parts)
        else:
            out = self._attend(q, k, v, bias)
        return self.proj(out.transpose(1, 2).reshape(b, n, -1))

    def _attend(self, q, k, v, bias):
        """``softmax(q k^T * scale + bias) v`` for ``B x heads x N x d`` q, k, v."""
        attn = (q @ k.transpose(-2, -1)) * self.scale
        attn = attn + bias.to(torch.float32 if attn.dtype == torch.float16 else attn.dtype)
        attn = softmax_lastdim(attn)
        return attn.to(v.dtype) @ v


class TinyViTBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, window_size: int, mlp_ratio: float, local_conv_size: int):
        super().__init__()
        self.window_size = window_size
        self.attn = Attention(dim, dim // num_heads, num_heads, (window_size, window_size))
        self.mlp = Mlp(dim, int(dim * mlp_ratio))
        self.local_conv = Conv2d_BN(
            dim, dim, ks=local_conv_size, stride=1, pad=local_conv_size // 2, groups=dim
        )

    def forward(self, x: torch.Tensor, hw: Tuple[int, int]) -> torch.Tensor:
        h, w = hw
        b, l, c = x.shape
        ws = self.window_size
        res = x
        if h == ws and w == ws:
            x = self.attn(x)
        else:
            x = x.view(b, h, w, c)
            pad_b, pad_r = (ws - h % ws) % ws, (ws - w % ws) % ws
            if pad_b or pad_r:  # zero tokens join the windows (same as the reference)
                x = F.pad(x, (0, 0, 0, pad_r, 0, pad_b))
            ph, pw = h + pad_b, w + pad_r
            nh, nw = ph // ws, pw // ws
            x = x.view(b, nh, ws, nw, ws, c).transpose(2, 3).reshape(b * nh * nw, ws * ws, c)
            x = self.attn(x)
            x = x.view(b, nh, nw, ws, ws, c).transpose(2, 3).reshape(b, ph, pw, c)
            if pad_b or pad_r:
                x = x[:, :h, :w]
            x = x.reshape(b, l, c)
        x = res + x
        x = self.local_conv(x.transpose(1, 2).reshape(b, c, h, w))
        x = x.view(b, c, l).transpose(1, 2)
        return x + self.mlp(x)


class BasicLayer(nn.Module):
    def __init__(self, dim, depth, num_heads, window_size, mlp_ratio, local_conv_size, out_dim, merge_stride):
        super().__init__()
        self.blocks = nn.ModuleList(
            TinyViTBlock(dim, num_heads, window_size, mlp_ratio, local_conv_size) for _ in range(depth)
        )
        self.downsample = PatchMerging(dim, out_dim, merge_stride) if out_dim is not None else None

    def forward(self, x: torch.Tensor, hw: Tuple[int, int]):
        for blk in self.blocks:
            x = blk(x, hw)
        if self.downsample is not None:
            x, hw = self.downsample(x, hw)
        return x, hw


class TinyViT(nn.Module):
    """TinyViT encoder for SAM: ``B x 3 x S x S`` -> ``B x 256 x S/r x S/r``.

    ``patch_embed="conv3x3"`` (MobileSAM, r = 16) or ``"conv1x1"`` (LiteMedSAM, r = 4).
    ``num_classes > 0`` adds the unused classifier head that MobileSAM's checkpoint holds.

    Convolutions and windowed attention with relative position biases, no absolute
    position embedding: any ``H x W`` input with sides divisible by r embeds to
    ``H/r x W/r`` (``size_agnostic``; box mode embeds whole fields this way).
    """

    size_agnostic = True

    def __init__(
        self,
        img_size: int = 1024,
        in_chans: int = 3,
        embed_dims: Sequence[int] = (64, 128, 160, 320),
        depths: Sequence[int] = (2, 2, 6, 2),
        num_heads: Sequence[int] = (2, 4, 5, 10),
        window_sizes: Sequence[int] = (7, 7, 14, 7),
        mlp_ratio: float = 4.0,
        mbconv_expand_ratio: float = 4.0,
        local_conv_size: int = 3,
        patch_embed: str = "conv3x3",
        num_classes: int = 1000,
        out_chans: int = 256,
    ) -> None:
        super().__init__()
        if patch_embed not in ("conv3x3", "conv1x1"):
            raise ValueError(f"patch_embed must be 'conv3x3' or 'conv1x1', got {patch_embed!r}")
        self.img_size = img_size
        self.out_chans = out_chans
        kernel, stride = (3, 2) if patch_embed == "conv3x3" else (1, 1)
        self.patch_embed = PatchEmbed(in_chans, embed_dims[0], kernel, stride)
        n = len(depths)
        layers = []
        for i in range(n):
            out_dim = embed_dims[i + 1] if i < n - 1 else None
            merge_stride = 1 if i == n - 2 else 2  # the last merge keeps the resolution
            if i == 0:
                layers.append(
                    ConvLayer(embed_dims[0], depths[0], out_dim, mbconv_expand_ratio, merge_stride)
                )
            else:
                layers.append(
                    BasicLayer(
                        embed_dims[i], depths[i], num_heads[i], window_sizes[i], mlp_ratio,
                        local_conv_size, out_dim, merge_stride,
                    )
                )
        self.layers = nn.ModuleList(layers)
        if num_classes > 0:
            self.norm_head = nn.LayerNorm(embed_dims[-1])
            self.head = nn.Linear(embed_dims[-1], num_classes)
        self.neck = nn.Sequential(
            nn.Conv2d(embed_dims[-1], out_chans, kernel_size=1, bias=False),
            LayerNorm2d(out_chans),
            nn.Conv2d(out_chans, out_chans, kernel_size=3, padding=1, bias=False),
            LayerNorm2d(out_chans),
        )
        self._init_weights()

    def _init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last_stages(*self.trunk(x))

    # The encoder in two parts, for training its last stages on cached trunk outputs
    # (``SamTuneConfig.encoder_lr`` and ``encoder_stages``):
    # forward(x) == last_stages(*trunk(x, n), n) for n in 1 .. len(layers) - 1.
    def trunk(self, x: torch.Tensor, stages: int = 1) -> Tuple[torch.Tensor, Tuple[int, int]]:
        """Every stage but the last ``stages``: ``B x 3 x H x W`` -> (``B x L x C`` tokens,
        their ``(h, w)``)."""
        self._check_stages(stages)
        if cpu_fused.channels_last_input(x):  # oneDNN's channels-last convolutions (fp32 fused, bf16)
            x = x.contiguous(memory_format=torch.channels_last)
        x = self.patch_embed(x)
        hw = (x.shape[2], x.shape[3])
        for layer in self.layers[:len(self.layers) - stages]:
            x, hw = layer(x, hw)
        return x, hw

    def last_stages(self, x: torch.Tensor, hw: Tuple[int, int], stages: int = 1) -> torch.Tensor:
        """The last ``stages`` stages and the neck: trunk tokens -> ``B x 256 x h x w`` embedding."""
        self._check_stages(stages)
        for layer in self.layers[len(self.layers) - stages:]:
            x, hw = layer(x, hw)
        b, _, c = x.shape
        x = x.transpose(1, 2).reshape(b, c, hw[0], hw[1])
        return self.neck(x).contiguous()

    def last_stages_parts(self, stages: int = 1) -> Tuple[str, ...]:
        """State-dict name prefixes of :meth:`last_stages`' parameters."""
        self._check_stages(stages)
        n = len(self.layers)
        return tuple(f"layers.{i}." for i in range(n - stages, n)) + ("neck.",)

    def _check_stages(self, stages: int) -> None:
        if not 1 <= stages < len(self.layers):  # the first stage is convolutions over pixels
            raise ValueError(f"encoder stages to train must be 1-{len(self.layers) - 1}, got {stages}")
