# Derived from segment-anything (Meta Platforms, Inc. and affiliates, Apache-2.0).
# Licence texts: LICENSES/; details: NOTICE. Modifications: BSD-3-Clause, see LICENSE.
"""SAM's two-way transformer (mask decoder core), official key names.

Attention runs through ``F.scaled_dot_product_attention`` (exact softmax attention, fp32
accumulation inside the kernel on every device) unless ``USE_SDPA`` is switched off,
in which case the explicit matmul/softmax path is used (softmax in fp32 for fp16).
"""
from __future__ import annotations

from typing import Tuple, Type

import torch.nn.functional as F
from torch import Tensor, nn

from .common import MLPBlock, layer_norm, softmax_lastdim

USE_SDPA = True


class Attention(nn.Module):
    """Attention with optional down-projection of the embedding (``downsample_rate``)."""

    def __init__(self, embedding_dim: int, num_heads: int, downsample_rate: int = 1) -> None:
        super().__init__()
        self.embedding_dim = embedding_dim
        self.internal_dim = embedding_dim // downsample_rate
        self.num_heads = num_heads
        if self.internal_dim % num_heads:
            raise ValueError("num_heads must divide embedding_dim // downsample_rate")
        self.q_proj = nn.Linear(embedding_dim, self.internal_dim)
        self.k_proj = nn.Linear(embedding_dim, self.internal_dim)
        self.v_proj = nn.Linear(embedding_dim, self.internal_dim)
        self.out_proj = nn.Linear(self.internal_dim, embedding_dim)

    def _heads(self, x: Tensor) -> Tensor:
        b, n, c = x.shape
        return x.reshape(b, n, self.num_heads, c // self.num_heads).transpose(1, 2)

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        q = self._heads(self.q_proj(q))
        k = self._heads(self.k_proj(k))
        v = self._heads(self.v_proj(v))
        if USE_SDPA:
            out = F.scaled_dot_product_attention(q, k, v)
        else:
            attn = (q @ k.transpose(-2, -1)) / (q.shape[-1] ** 0.5)
            out = softmax_lastdim(attn).to(v.dtype) @ v
        b, h, n, c = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(b, n, h * c))


class TwoWayAttentionBlock(nn.Module):
    """Self-attn on tokens, tokens->image, MLP on tokens, image->tokens."""

    def __init__(
        self,
        embedding_dim: int,
        num_heads: int,
        mlp_dim: int = 2048,
        activation: Type[nn.Module] = nn.ReLU,
        attention_downsample_rate: int = 2,
        skip_first_layer_pe: bool = False,
    ) -> None:
        super().__init__()
        self.self_attn = Attention(embedding_dim, num_heads)
        self.norm1 = nn.LayerNorm(embedding_dim)
        self.cross_attn_token_to_image = Attention(embedding_dim, num_heads, attention_downsample_rate)
        self.norm2 = nn.LayerNorm(embedding_dim)
        self.mlp = MLPBlock(embedding_dim, mlp_dim, activation)
        self.norm3 = nn.LayerNorm(embedding_dim)
        self.norm4 = nn.LayerNorm(embedding_dim)
        self.cross_attn_image_to_token = Attention(embedding_dim, num_heads, attention_downsample_rate)
        self.skip_first_layer_pe = skip_first_layer_pe

    def forward(self, queries: Tensor, keys: Tensor, query_pe: Tensor, key_pe: Tensor) -> Tuple[Tensor, Tensor]:
        if self.skip_first_layer_pe:
            queries = self.self_attn(q=queries, k=queries, v=queries)
        else:
            q = queries + query_pe
            queries = queries + self.self_attn(q=q, k=q, v=queries)
        queries = layer_norm(queries, self.norm1)

        q = queries + query_pe
        k = keys + key_pe
        queries = layer_norm(queries + self.cross_attn_token_to_image(q=q, k=k, v=keys), self.norm2)
        queries = layer_norm(queries + self.mlp(queries), self.norm3)

        q = queries + query_pe
        keys = layer_norm(keys + self.cross_attn_image_to_token(q=k, k=q, v=queries), self.norm4)
        return queries, keys


class TwoWayTransformer(nn.Module):
    def __init__(
        self,
        depth: int,
        embedding_dim: int,
        num_heads: int,
        mlp_dim: int,
        activation: Type[nn.Module] = nn.ReLU,
        attention_downsample_rate: int = 2,
    ) -> None:
        super().__init__()
        self.depth = depth
        self.embedding_dim = embedding_dim
        self.num_heads = num_heads
        self.mlp_dim = mlp_dim
        self.layers = nn.ModuleList(
            TwoWayAttentionBlock(
                embedding_dim=embedding_dim,
                num_heads=num_heads,
                mlp_dim=mlp_dim,
                activation=activation,
                attention_downsample_rate=attention_downsample_rate,
                skip_first_layer_pe=(i == 0),
            )
            for i in range(depth)
        )
        self.final_attn_token_to_image = Attention(embedding_dim, num_heads, attention_downsample_rate)
        self.norm_final_attn = nn.LayerNorm(embedding_dim)

    def forward(self, image_embedding: Tensor, image_pe: Tensor, point_embedding: Tensor) -> Tuple[Tensor, Tensor]:
        """image_embedding ``B x C x h x w``, image_pe ``B|1 x C x h x w``, point_embedding
        ``B x N x C`` -> (processed tokens ``B x N x C``, processed image ``B x h*w x C``)."""
        keys = image_embedding.flatten(2).transpose(1, 2)
        key_pe = image_pe.flatten(2).transpose(1, 2)
        queries = point_embedding
        for layer in self.layers:
            queries, keys = layer(queries=queries, keys=keys, query_pe=point_embedding, key_pe=key_pe)
        q = queries + point_embedding
        k = keys + key_pe
        queries = layer_norm(queries + self.final_attn_token_to_image(q=q, k=k, v=keys), self.norm_final_attn)
        return queries, keys
