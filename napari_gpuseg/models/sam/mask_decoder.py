# Derived from segment-anything (Meta Platforms, Inc. and affiliates, Apache-2.0).
# Licence texts: LICENSES/; details: NOTICE. Modifications: BSD-3-Clause, see LICENSE.
"""SAM's mask decoder, official key names and call signature.

Batch rule (a superset of the official one, which assumes a single image): with
``B`` image embeddings and ``N`` prompt sets,

* ``B == N``: prompt set ``i`` belongs to image ``i`` (batched images, one prompt each);
* ``B == 1``: every prompt set uses the one image (the official behaviour);
* ``N % B == 0``: prompts are grouped per image, ``N // B`` consecutive ones each.

The image embedding is broadcast rather than copied ``N`` times before the dense prompt
embedding is added, and the positional encoding is never repeated.
"""
from __future__ import annotations

from typing import List, Tuple, Type

import torch
import torch.nn.functional as F
from torch import nn

from .common import LayerNorm2d


def expand_to_prompts(image_embeddings: torch.Tensor, n: int) -> torch.Tensor:
    """Per-prompt view/copy of ``B x C x h x w`` embeddings for ``n`` prompt sets."""
    b = image_embeddings.shape[0]
    if b == n:
        return image_embeddings
    if b == 1:
        return image_embeddings.expand(n, -1, -1, -1)
    if n % b == 0:
        return torch.repeat_interleave(image_embeddings, n // b, dim=0)
    raise ValueError(f"{n} prompt sets cannot be matched to {b} image embeddings")


class MLP(nn.Module):
    def __init__(self, input_dim: int, hidden_dim: int, output_dim: int, num_layers: int, sigmoid_output: bool = False):
        super().__init__()
        self.num_layers = num_layers
        h = [hidden_dim] * (num_layers - 1)
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip([input_dim] + h, h + [output_dim]))
        self.sigmoid_output = sigmoid_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = F.relu(layer(x)) if i < self.num_layers - 1 else layer(x)
        return torch.sigmoid(x) if self.sigmoid_output else x


class MaskDecoder(nn.Module):
    def __init__(
        self,
        *,
        transformer_dim: int,
        transformer: nn.Module,
        num_multimask_outputs: int = 3,
        activation: Type[nn.Module] = nn.GELU,
        iou_head_depth: int = 3,
        iou_head_hidden_dim: int = 256,
    ) -> None:
        super().__init__()
        self.transformer_dim = transformer_dim
        self.transformer = transformer
        self.num_multimask_outputs = num_multimask_outputs
        self.iou_token = nn.Embedding(1, transformer_dim)
        self.num_mask_tokens = num_multimask_outputs + 1
        self.mask_tokens = nn.Embedding(self.num_mask_tokens, transformer_dim)
        self.output_upscaling = nn.Sequential(
            nn.ConvTranspose2d(transformer_dim, transformer_dim // 4, kernel_size=2, stride=2),
            LayerNorm2d(transformer_dim // 4),
            activation(),
            nn.ConvTranspose2d(transformer_dim // 4, transformer_dim // 8, kernel_size=2, stride=2),
            activation(),
        )
        self.output_hypernetworks_mlps = nn.ModuleList(
            MLP(transformer_dim, transformer_dim, transformer_dim // 8, 3) for _ in range(self.num_mask_tokens)
        )
        self.iou_prediction_head = MLP(transformer_dim, iou_head_hidden_dim, self.num_mask_tokens, iou_head_depth)

    def forward(
        self,
        image_embeddings: torch.Tensor,
        image_pe: torch.Tensor,
        sparse_prompt_embeddings: torch.Tensor,
        dense_prompt_embeddings: torch.Tensor,
        multimask_output: bool,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Low-res mask logits ``N x M x 4h x 4w`` and predicted IoUs ``N x M``
        (M = 3 with ``multimask_output``, else 1)."""
        masks, iou_pred = self.predict_masks(
            image_embeddings, image_pe, sparse_prompt_embeddings, dense_prompt_embeddings
        )
        sl = slice(1, None) if multimask_output else slice(0, 1)
        return masks[:, sl], iou_pred[:, sl]

    def predict_masks(
        self,
        image_embeddings: torch.Tensor,
        image_pe: torch.Tensor,
        sparse_prompt_embeddings: torch.Tensor,
        dense_prompt_embeddings: torch.Tensor,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """All ``num_mask_tokens`` masks and IoU predictions (see ``forward``)."""
        n = sparse_prompt_embeddings.shape[0]
        output_tokens = torch.cat([self.iou_token.weight, self.mask_tokens.weight], dim=0)
        output_tokens = output_tokens.unsqueeze(0).expand(n, -1, -1).to(sparse_prompt_embeddings.dtype)
        tokens = torch.cat((output_tokens, sparse_prompt_embeddings), dim=1)

        src = expand_to_prompts(image_embeddings, n) + dense_prompt_embeddings
        pos_src = image_pe if image_pe.shape[0] in (1, n) else expand_to_prompts(image_pe, n)
        b, c, h, w = src.shape

        hs, src = self.transformer(src, pos_src, tokens)
        iou_token_out = hs[:, 0, :]
        mask_tokens_out = hs[:, 1 : 1 + self.num_mask_tokens, :]

        src = src.transpose(1, 2).reshape(b, c, h, w)
        upscaled = self.output_upscaling(src)
        hyper_in_list: List[torch.Tensor] = [
            mlp(mask_tokens_out[:, i, :]) for i, mlp in enumerate(self.output_hypernetworks_mlps)
        ]
        hyper_in = torch.stack(hyper_in_list, dim=1)
        b, c, h, w = upscaled.shape
        masks = (hyper_in @ upscaled.reshape(b, c, h * w)).view(b, -1, h, w)
        iou_pred = self.iou_prediction_head(iou_token_out)
        return masks, iou_pred
