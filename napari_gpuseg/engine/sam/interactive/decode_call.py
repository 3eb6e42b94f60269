"""One call of SAM's prompt encoder and mask decoder for prompts that share a view and a
shape (:meth:`SamEngine._decode` calls these): the prompts as tensors in the view's model
input, the decoder module's outputs, the candidate kept per prompt, and the masks rendered
at the view's native resolution. Nothing here imports Qt or napari."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from .fast_decoder import mask_region
from .inputs import logits_to_view_mask, view_logits_to_low_res
from .prompt_types import MaskResult, Prompt
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


def keep_best(low_res: torch.Tensor, iou: torch.Tensor, multimask: bool, output: int | None = None,
              blend: float | None = None):
    """(logits (N, L, L), scores (N,)): per prompt the candidate with the highest predicted
    IoU when ``multimask`` (candidate ``output`` instead when given: a decoder's measured
    :attr:`~.predictor.SamEngine.click_output`), else the first (the only) output.
    ``blend`` (a decoder's measured :attr:`~.predictor.SamEngine.click_blend`, used when no
    ``output`` is named): the candidates' logits averaged with weights softmax(``blend`` x
    predicted IoU) instead of the best one alone; the score is still the highest predicted
    IoU (:func:`blend_views` joins the blends of a click's two views)."""
    if not multimask:
        return low_res[:, 0], iou[:, 0]
    if output is not None:
        k = min(int(output), low_res.shape[1] - 1)
        return low_res[:, k], iou[:, k]
    if blend is not None:
        weights = torch.softmax(float(blend) * iou, dim=1)
        return (weights[:, :, None, None] * low_res).sum(1), iou.max(dim=1).values
    best = iou.argmax(dim=1)
    ar = torch.arange(low_res.shape[0], device=low_res.device)
    return low_res[ar, best], iou[ar, best]


def blend_views(finer: MaskResult, native: MaskResult, blend: float) -> MaskResult:
    """A first click decoded in its click view (``finer``) and its native view, each as the
    blend of its candidates (:func:`keep_best`), joined in the native view: where both views
    see a pixel, their logits averaged with weights softmax over the views of
    logsumexp(``blend`` x the view's predicted IoUs), so that the whole is the blend of all
    candidates of both views (a pixel only the click view sees is left out). Its low-res
    logits, the mask input of a corrective click, are the joined logits in the native view;
    the score (and ``all_scores``) are those of the view whose best predicted IoU is higher."""
    def mass(res: MaskResult) -> float:
        return float(torch.logsumexp(float(blend) * torch.as_tensor(res.all_scores, dtype=torch.float64), 0))
    a, b = mass(finer), mass(native)
    top = max(a, b)
    w_fine, w_nat = np.exp(a - top), np.exp(b - top)
    nv, fv = native.view, finer.view
    num = w_nat * logits_to_view_mask(native.low_res[None].float(), nv)[0].cpu().numpy().astype(np.float64)
    den = np.full(num.shape, w_nat)
    y0, y1 = max(nv.y0, fv.y0), min(nv.y0 + nv.h, fv.y0 + fv.h)
    x0, x1 = max(nv.x0, fv.x0), min(nv.x0 + nv.w, fv.x0 + fv.w)
    low_res = native.low_res
    if y1 > y0 and x1 > x0:
        fine = logits_to_view_mask(finer.low_res[None].float(), fv)[0].cpu().numpy()
        num[y0 - nv.y0:y1 - nv.y0, x0 - nv.x0:x1 - nv.x0] += w_fine * fine[y0 - fv.y0:y1 - fv.y0, x0 - fv.x0:x1 - fv.x0]
        den[y0 - nv.y0:y1 - nv.y0, x0 - nv.x0:x1 - nv.x0] += w_fine
        joined = torch.as_tensor(num / den, dtype=torch.float32)
        low_res = view_logits_to_low_res(joined, nv, native.low_res.float().cpu()).to(native.low_res.device)
    top_view = finer if finer.score > native.score else native
    return MaskResult(num / den > 0, nv.y0, nv.x0, top_view.score, low_res, nv, top_view.all_scores)


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
