"""One call of SAM's prompt encoder and mask decoder for prompts that share a view and a
shape (:meth:`SamEngine._decode` calls these): the prompts as tensors in the view's model
input, the decoder module's outputs, the candidate kept per prompt, and the masks rendered
at the view's native resolution. Nothing here imports Qt or napari."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from .fast_decoder import mask_region
from .inputs import logits_to_view_mask
from .prompt_types import Prompt
from .views import View


def prompt_tensors(view: View, prompts: Sequence[Prompt], device, input_size: int, emb_side: int,
                   near_box: bool = False):
    """(points, boxes, masks, roi) for the prompt encoder; each None where the prompts have
    none. ``roi``: the region near each box (``near_box``, see :func:`fast_decoder.mask_region`)."""
    points = boxes = masks = roi = None
    if prompts[0].points is not None:
        coords = np.stack([view.to_input(p.points) for p in prompts])
        labels = np.stack([p.labels for p in prompts])
        points = (torch.as_tensor(coords, dtype=torch.float32, device=device),
                  torch.as_tensor(labels, dtype=torch.int64, device=device))
    if prompts[0].box is not None:
        boxes_in = np.stack([view.to_input(p.box) for p in prompts])
        boxes = torch.as_tensor(boxes_in, dtype=torch.float32, device=device)
        if near_box:
            roi = torch.as_tensor(mask_region(boxes_in, input_size, emb_side), device=device)
    if prompts[0].mask_input is not None:
        # fp32 before the stack: box batches keep fp16 logits, and torch refuses to stack
        # fp16 inside a bf16 autocast (a worker job on a CPU whose policy picks bf16)
        masks = torch.stack([p.mask_input.low_res.to(device, torch.float32) for p in prompts])[:, None]
    return points, boxes, masks, roi


def module_outputs(sam, device, emb: torch.Tensor, sparse, dense, outputs: str,
                   side: int | None = None):
    """The mask decoder module's (low-res logits, IoU) for ``outputs``: ``"single"``,
    ``"multi"`` (SAM's three) or ``"all"`` (the single-mask output first, then the three).
    ``side``: an embedding smaller than the model's (a crop at the input's top left,
    ``crop_look``) reads the top-left ``side x side`` of the position grid."""
    pe = sam.prompt_encoder.get_dense_pe()
    if side is not None:
        pe = pe[..., :side, :side]

    def run(multi: bool):
        return sam.mask_decoder(image_embeddings=emb[None].to(device), image_pe=pe,
                                sparse_prompt_embeddings=sparse, dense_prompt_embeddings=dense,
                                multimask_output=multi)
    if outputs != "all":
        return run(outputs == "multi")
    (one, iou1), (three, iou3) = run(False), run(True)
    return torch.cat([one, three], 1), torch.cat([iou1, iou3], 1)


def keep_best(low_res: torch.Tensor, iou: torch.Tensor, multimask: bool, output: int | None = None):
    """(logits (N, L, L), scores (N,)): per prompt the candidate with the highest predicted
    IoU when ``multimask`` (candidate ``output`` instead when given: a decoder's measured
    :attr:`~.predictor.SamEngine.click_output`), else the first (the only) output."""
    if not multimask:
        return low_res[:, 0], iou[:, 0]
    if output is not None:
        k = min(int(output), low_res.shape[1] - 1)
        return low_res[:, k], iou[:, k]
    best = iou.argmax(dim=1)
    ar = torch.arange(low_res.shape[0], device=low_res.device)
    return low_res[ar, best], iou[ar, best]


def render_masks(low_res: torch.Tensor, view: View, max_bytes: int) -> np.ndarray:
    """Native-resolution bool masks (N, h, w) of ``low_res`` logits (N, L, L), rendered a
    block of prompts at a time (``max_bytes`` of full-size logits) and copied to the host
    block by block, so many prompts never hold all their full-size logits on the device at
    once."""
    per = max(1, max_bytes // (4 * view.input_size ** 2))
    out = np.empty((low_res.shape[0], view.h, view.w), dtype=bool)
    for a in range(0, low_res.shape[0], per):
        out[a:a + per] = (logits_to_view_mask(low_res[a:a + per], view) > 0).cpu().numpy()
    return out
