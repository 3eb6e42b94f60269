# Derived from segment-anything (Meta Platforms, Inc. and affiliates, Apache-2.0).
# Licence texts: LICENSES/; details: NOTICE. Modifications: BSD-3-Clause, see LICENSE.
"""SAM's prompt encoder: points, boxes and low-res masks -> sparse and dense embeddings.

Same interface, keys and math as the official ``PromptEncoder``. The random-Fourier
positional encoding is always evaluated in float32 with autocast disabled: under bf16
autocast the official code computes ``sin(2*pi*coords @ G)`` from bf16 products, which
shifts point positions by up to a few pixels.
"""
from __future__ import annotations

import contextlib
import math
from typing import Optional, Tuple, Type

import torch
from torch import nn

from .common import LayerNorm2d


def _no_autocast(device: torch.device):
    try:
        return torch.autocast(device_type=device.type, enabled=False)
    except RuntimeError:  # a device type autocast does not know (e.g. meta)
        return contextlib.nullcontext()


class PositionEmbeddingRandom(nn.Module):
    """Positional encoding with random spatial frequencies (``2 x num_pos_feats`` matrix)."""

    def __init__(self, num_pos_feats: int = 64, scale: Optional[float] = None) -> None:
        super().__init__()
        if scale is None or scale <= 0.0:
            scale = 1.0
        self.register_buffer("positional_encoding_gaussian_matrix", scale * torch.randn((2, num_pos_feats)))

    def _pe_encoding(self, coords: torch.Tensor) -> torch.Tensor:
        """Encode points normalised to [0, 1]: ``... x 2`` -> ``... x 2*num_pos_feats``."""
        g = self.positional_encoding_gaussian_matrix
        with _no_autocast(g.device):
            coords = (2 * coords.float() - 1) @ g.float()
            coords = (2 * math.pi) * coords
            return torch.cat([torch.sin(coords), torch.cos(coords)], dim=-1)

    def forward(self, size: Tuple[int, int]) -> torch.Tensor:
        """Encoding of a dense ``h x w`` grid of pixel centres: ``C x h x w``."""
        h, w = size
        device = self.positional_encoding_gaussian_matrix.device
        y = (torch.arange(h, device=device, dtype=torch.float32) + 0.5) / h
        x = (torch.arange(w, device=device, dtype=torch.float32) + 0.5) / w
        grid = torch.stack([x[None, :].expand(h, w), y[:, None].expand(h, w)], dim=-1)
        return self._pe_encoding(grid).permute(2, 0, 1)

    def forward_with_coords(self, coords_input: torch.Tensor, image_size: Tuple[int, int]) -> torch.Tensor:
        """Encode pixel coordinates (``B x N x 2``, x then y) of an ``image_size`` (H, W) input."""
        coords = coords_input.float()
        size = coords.new_tensor([float(image_size[1]), float(image_size[0])])
        return self._pe_encoding(coords / size)


class PromptEncoder(nn.Module):
    def __init__(
        self,
        embed_dim: int,
        image_embedding_size: Tuple[int, int],
        input_image_size: Tuple[int, int],
        mask_in_chans: int,
        activation: Type[nn.Module] = nn.GELU,
    ) -> None:
        """
        embed_dim: prompt embedding width (256); image_embedding_size: (H, W) of the image
        embedding; input_image_size: (H, W) of the padded encoder input; mask_in_chans:
        hidden channels of the mask downscaler.
        """
        super().__init__()
        self.embed_dim = embed_dim
        self.input_image_size = tuple(input_image_size)
        self.image_embedding_size = tuple(image_embedding_size)
        self.pe_layer = PositionEmbeddingRandom(embed_dim // 2)
        self.num_point_embeddings = 4  # neg/pos point + 2 box corners
        self.point_embeddings = nn.ModuleList(nn.Embedding(1, embed_dim) for _ in range(4))
        self.not_a_point_embed = nn.Embedding(1, embed_dim)
        self.mask_input_size = (4 * image_embedding_size[0], 4 * image_embedding_size[1])
        self.mask_downscaling = nn.Sequential(
            nn.Conv2d(1, mask_in_chans // 4, kernel_size=2, stride=2),
            LayerNorm2d(mask_in_chans // 4),
            activation(),
            nn.Conv2d(mask_in_chans // 4, mask_in_chans, kernel_size=2, stride=2),
            LayerNorm2d(mask_in_chans),
            activation(),
            nn.Conv2d(mask_in_chans, embed_dim, kernel_size=1),
        )
        self.no_mask_embed = nn.Embedding(1, embed_dim)

    def get_dense_pe(self) -> torch.Tensor:
        """Positional encoding of the image-embedding grid: ``1 x C x h x w``."""
        return self.pe_layer(self.image_embedding_size).unsqueeze(0)

    def _embed_points(self, points: torch.Tensor, labels: torch.Tensor, pad: bool) -> torch.Tensor:
        points = points.float() + 0.5  # pixel centres
        if pad:
            points = torch.cat([points, points.new_zeros(points.shape[0], 1, 2)], dim=1)
            labels = torch.cat([labels, -labels.new_ones(labels.shape[0], 1)], dim=1)
        emb = self.pe_layer.forward_with_coords(points, self.input_image_size)
        lab = labels[..., None]
        emb = torch.where(lab == -1, self.not_a_point_embed.weight.to(emb.dtype), emb)
        emb = emb + (lab == 0) * self.point_embeddings[0].weight + (lab == 1) * self.point_embeddings[1].weight
        return emb

    def _embed_boxes(self, boxes: torch.Tensor) -> torch.Tensor:
        coords = (boxes.float() + 0.5).reshape(-1, 2, 2)
        emb = self.pe_layer.forward_with_coords(coords, self.input_image_size)
        corners = torch.cat([self.point_embeddings[2].weight, self.point_embeddings[3].weight], dim=0)
        return emb + corners

    def _embed_masks(self, masks: torch.Tensor) -> torch.Tensor:
        return self.mask_downscaling(masks)

    def _get_batch_size(self, points, boxes, masks) -> int:
        if points is not None:
            return points[0].shape[0]
        if boxes is not None:
            return boxes.shape[0]
        if masks is not None:
            return masks.shape[0]
        return 1

    def _get_device(self) -> torch.device:
        return self.point_embeddings[0].weight.device

    def forward(
        self,
        points: Optional[Tuple[torch.Tensor, torch.Tensor]],
        boxes: Optional[torch.Tensor],
        masks: Optional[torch.Tensor],
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Sparse ``B x N x C`` and dense ``B x C x h x w`` prompt embeddings.

        points: (coords ``B x N x 2`` in input pixels (x, y), labels ``B x N``: 1 positive,
        0 negative, -1 padding); boxes: ``B x 4`` (x0, y0, x1, y1); masks: ``B x 1 x 4h x 4w``
        low-res logits.
        """
        bs = self._get_batch_size(points, boxes, masks)
        parts = []
        if points is not None:
            coords, labels = points
            parts.append(self._embed_points(coords, labels, pad=boxes is None))
        if boxes is not None:
            parts.append(self._embed_boxes(boxes))
        if parts:
            sparse = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        else:
            sparse = torch.empty((bs, 0, self.embed_dim), device=self._get_device())
        if masks is not None:
            dense = self._embed_masks(masks)
        else:
            dense = self.no_mask_embed.weight.reshape(1, -1, 1, 1).expand(
                bs, -1, self.image_embedding_size[0], self.image_embedding_size[1]
            )
        return sparse, dense
