# Derived from segment-anything (Meta Platforms, Inc. and affiliates, Apache-2.0).
# Licence texts: LICENSES/; details: NOTICE. Modifications: BSD-3-Clause, see LICENSE.
"""Small building blocks shared by the SAM encoders and decoder.

Precision rules used across ``models/sam`` (we only ever run under ``torch.autocast``,
never ``.half()``):

* bf16 has float32's exponent range, so nothing overflows; ops may stay in bf16.
* fp16 tops out at 65504: LayerNorm statistics, attention logits plus relative-position
  terms and softmax are computed in float32 when the tensor is fp16
  (:func:`needs_fp32`). CUDA autocast already does this for ``layer_norm`` and
  ``softmax``; doing it explicitly keeps MPS and the ``math`` attention path safe too.
"""
from __future__ import annotations

from typing import Type

import torch
import torch.nn.functional as F
from torch import nn


def needs_fp32(t: torch.Tensor) -> bool:
    """True for dtypes whose range is too small for logits and statistics (fp16)."""
    return t.dtype == torch.float16


def layer_norm(x: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
    """``norm(x)`` computed in float32 when ``x`` is fp16 (the result stays float32)."""
    if needs_fp32(x):
        x = x.float()
    return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)


def softmax_lastdim(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim; fp16 input is upcast to float32 first."""
    if needs_fp32(x):
        return torch.softmax(x, dim=-1, dtype=torch.float32)
    return torch.softmax(x, dim=-1)


class MLPBlock(nn.Module):
    """Linear -> activation -> Linear (official key names ``lin1`` / ``lin2``)."""

    def __init__(self, embedding_dim: int, mlp_dim: int, act: Type[nn.Module] = nn.GELU) -> None:
        super().__init__()
        self.lin1 = nn.Linear(embedding_dim, mlp_dim)
        self.lin2 = nn.Linear(mlp_dim, embedding_dim)
        self.act = act()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(self.act(self.lin1(x)))


class LayerNorm2d(nn.Module):
    """LayerNorm over the channel dim of a ``B x C x H x W`` tensor.

    Statistics are always taken in float32 (under autocast the input may be bf16/fp16);
    the normalised output is returned in the input dtype, which cannot overflow.
    """

    def __init__(self, num_channels: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(num_channels))
        self.bias = nn.Parameter(torch.zeros(num_channels))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype != torch.float32 and dtype != torch.float64:
            x = x.float()
        u = x.mean(1, keepdim=True)
        xc = x - u
        s = xc.pow(2).mean(1, keepdim=True)
        y = xc * torch.rsqrt(s + self.eps)
        w = self.weight.to(y.dtype)[:, None, None]
        b = self.bias.to(y.dtype)[:, None, None]
        return torch.addcmul(b, y, w).to(dtype)
