# Derived from segment-anything (Meta Platforms, Inc. and affiliates, Apache-2.0); LiteMedSAM (Apache-2.0).
# Licence texts: LICENSES/; details: NOTICE. Modifications: BSD-3-Clause, see LICENSE.
"""The SAM container: image encoder + prompt encoder + mask decoder.

Attribute names match the official ``Sam`` (``image_encoder``, ``prompt_encoder``,
``mask_decoder``, non-persistent ``pixel_mean`` / ``pixel_std`` buffers), so official
state dicts load unchanged. Extra read-only facts for the engine: ``arch``,
``image_size`` (encoder input, px), ``embedding_size`` (token grid) and
``normalization`` (``"sam"``: RGB in 0..255, minus ``pixel_mean``, over ``pixel_std``;
``"minmax"``: image scaled to 0..1 by its own min/max, no mean/std -- LiteMedSAM).
"""
from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

SAM_PIXEL_MEAN = (123.675, 116.28, 103.53)
SAM_PIXEL_STD = (58.395, 57.12, 57.375)


class Sam(nn.Module):
    mask_threshold: float = 0.0
    image_format: str = "RGB"

    def __init__(
        self,
        image_encoder: nn.Module,
        prompt_encoder: nn.Module,
        mask_decoder: nn.Module,
        pixel_mean: Sequence[float] = SAM_PIXEL_MEAN,
        pixel_std: Sequence[float] = SAM_PIXEL_STD,
        arch: str = "custom",
        normalization: str = "sam",
    ) -> None:
        super().__init__()
        self.image_encoder = image_encoder
        self.prompt_encoder = prompt_encoder
        self.mask_decoder = mask_decoder
        self.arch = arch
        self.normalization = normalization
        # explicitly on the CPU: not in a checkpoint, so also real when built on "meta" (build.py)
        self.register_buffer("pixel_mean", torch.tensor(pixel_mean, dtype=torch.float32, device="cpu").view(-1, 1, 1),
                             False)
        self.register_buffer("pixel_std", torch.tensor(pixel_std, dtype=torch.float32, device="cpu").view(-1, 1, 1),
                             False)

    @property
    def device(self) -> torch.device:
        return self.pixel_mean.device

    @property
    def image_size(self) -> int:
        """Side of the square encoder input in pixels (1024 for SAM/MobileSAM, 256 LiteMedSAM)."""
        return int(self.image_encoder.img_size)

    @property
    def embedding_size(self) -> Tuple[int, int]:
        """``(h, w)`` of the image embedding grid (64 x 64 for every stock model)."""
        return tuple(self.prompt_encoder.image_embedding_size)

    def preprocess(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise with ``pixel_mean``/``pixel_std`` and zero-pad (bottom/right) to
        ``image_size``. ``x``: ``C x H x W`` or ``B x C x H x W``, already resized so the
        long side is ``image_size`` (and, for ``"minmax"`` models, scaled to 0..1)."""
        x = (x - self.pixel_mean) / self.pixel_std
        h, w = x.shape[-2:]
        return F.pad(x, (0, self.image_size - w, 0, self.image_size - h))

    def postprocess_masks(
        self, masks: torch.Tensor, input_size: Tuple[int, ...], original_size: Tuple[int, ...]
    ) -> torch.Tensor:
        """Low-res logits -> logits at ``original_size`` (crop the padding of ``input_size``)."""
        masks = F.interpolate(masks, (self.image_size, self.image_size), mode="bilinear", align_corners=False)
        masks = masks[..., : input_size[0], : input_size[1]]
        return F.interpolate(masks, tuple(original_size), mode="bilinear", align_corners=False)

    @torch.no_grad()
    def forward(self, batched_input: List[Dict[str, Any]], multimask_output: bool) -> List[Dict[str, torch.Tensor]]:
        """The official end-to-end call (list of dicts with ``image`` and optional prompts);
        all images go through the encoder in one batch."""
        images = torch.stack([self.preprocess(r["image"]) for r in batched_input], dim=0)
        embeddings = self.image_encoder(images)
        outputs = []
        for record, emb in zip(batched_input, embeddings):
            points = (record["point_coords"], record["point_labels"]) if "point_coords" in record else None
            sparse, dense = self.prompt_encoder(
                points=points, boxes=record.get("boxes"), masks=record.get("mask_inputs")
            )
            low_res, iou = self.mask_decoder(
                image_embeddings=emb.unsqueeze(0),
                image_pe=self.prompt_encoder.get_dense_pe(),
                sparse_prompt_embeddings=sparse,
                dense_prompt_embeddings=dense,
                multimask_output=multimask_output,
            )
            masks = self.postprocess_masks(low_res, record["image"].shape[-2:], record["original_size"])
            outputs.append(
                {"masks": masks > self.mask_threshold, "iou_predictions": iou, "low_res_logits": low_res}
            )
        return outputs
