"""Simulated interaction for SAM decoder training and validation: one episode is a first
prompt (a click, multimask, or a box) then corrective clicks with the previous low-res
logits as mask input (:mod:`.simulated_prompts` places the clicks); the loss is BCE + Dice on
the masks plus MSE of the IoU head against the true IoU. Used by :mod:`.finetune`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .simulated_prompts import corrective_point, interior_point, jitter_box, tight_box
from .train_views import TrainView

if TYPE_CHECKING:
    from .tune_config import SamTuneConfig


def _decode(sam, emb, points=None, labels=None, boxes=None, masks=None, multimask=False):
    """Low-res logits and predicted IoUs: ``multimask`` False (the single-mask output),
    True (the three multimask outputs) or ``"all"`` (the single one, then the three)."""
    sparse, dense = sam.prompt_encoder(points=None if points is None else (points, labels),
                                       boxes=boxes, masks=masks)
    pe = sam.prompt_encoder.get_dense_pe()
    if multimask == "all":
        return sam.mask_decoder.predict_masks(emb, pe, sparse, dense)
    return sam.mask_decoder(emb, pe, sparse, dense, bool(multimask))


def _iou(logits: torch.Tensor, gt: torch.Tensor) -> torch.Tensor:
    pred = logits > 0
    inter = (pred & gt).flatten(-2).sum(-1).float()
    union = (pred | gt).flatten(-2).sum(-1).float()
    return torch.where(union > 0, inter / union.clamp(min=1), torch.ones_like(union))


def _mask_loss(logits: torch.Tensor, iou_pred: torch.Tensor, gt: torch.Tensor,
               keep: int | None = None) -> torch.Tensor:
    """(N, M, S, S) logits against (N, S, S) truth: BCE + Dice of the best candidate per
    object (of candidate ``keep`` when given), plus MSE of the predicted IoUs (all
    candidates) against the true ones; with four candidates the IoU head learns to rank the
    single-mask output beside the three."""
    logits = logits.float()
    g = gt[:, None].expand_as(logits).float()
    bce = F.binary_cross_entropy_with_logits(logits, g, reduction="none").flatten(-2).mean(-1)
    p = torch.sigmoid(logits)
    dice = 1 - (2 * (p * g).flatten(-2).sum(-1) + 1) / ((p + g).flatten(-2).sum(-1) + 1)
    per = (bce + dice)[:, keep] if keep is not None else (bce + dice).min(dim=1).values
    true_iou = _iou(logits.detach(), gt[:, None].expand_as(logits))
    return per.mean() + F.mse_loss(iou_pred.float(), true_iou)


def _best(logits: torch.Tensor, iou_pred: torch.Tensor) -> torch.Tensor:
    """The candidate with the highest predicted IoU per object, as the annotator picks."""
    k = iou_pred.argmax(dim=1)
    return logits[torch.arange(len(k)), k]


@dataclass
class FirstPrompts:
    """Every random draw of one episode, made before any decode: the first prompt of each
    object (``boxes`` (N, 4) or ``points`` (N, 1, 2) with ``labels``) and the number of
    corrective rounds. The decodes themselves draw nothing (corrective clicks follow the
    masks), so an episode run object group by object group (:func:`episode` with
    ``prompts``) is the same episode as one run on all objects at once."""

    boxes: np.ndarray | None
    points: np.ndarray | None
    labels: np.ndarray | None
    n_corr: int

    def take(self, sel) -> "FirstPrompts":
        """The prompts of the objects ``sel`` (an index array or slice)."""
        pick = (lambda a: None if a is None else a[sel])
        return FirstPrompts(pick(self.boxes), pick(self.points), pick(self.labels), self.n_corr)


def first_prompts(gt: np.ndarray, use_box: bool, rng: np.random.Generator, cfg: "SamTuneConfig",
                  train: bool = True, n_corr: int | None = None) -> FirstPrompts:
    """Draw an episode's first prompts for the (N, S, S) masks ``gt`` (a jittered box or a
    click near the deepest interior point; exact ones when not ``train``) and, unless given,
    its number of corrective rounds (1..``cfg.corrections``), in that order."""
    s = gt.shape[-1]
    spread = cfg.click_spread if train else 0.0
    boxes = pts = labs = None
    if use_box:
        b = [tight_box(m) for m in gt]
        b = [jitter_box(x, rng, cfg.box_jitter, (s, s)) if train else x for x in b]
        boxes = np.stack(b).astype(np.float32)
    else:
        pts = np.stack([interior_point(m, rng, spread)[None] for m in gt])
        labs = np.ones((len(gt), 1), dtype=np.int64)
    if n_corr is None:
        n_corr = int(rng.integers(1, cfg.corrections + 1)) if cfg.corrections > 0 else 0
    return FirstPrompts(boxes, pts, labs, n_corr)


def episode(sam, emb: torch.Tensor, gt: np.ndarray, use_box: bool, rng: np.random.Generator,
            cfg: "SamTuneConfig", device, train: bool = True, n_corr: int | None = None,
            record: list | None = None, prompts: FirstPrompts | None = None) -> torch.Tensor:
    """Loss of one simulated interaction for N objects sharing a prompt kind.

    ``emb`` (N, C, h, w) each object's view embedding; ``gt`` (N, S, S) bool masks at the
    model input. ``record`` (evaluation) receives the true IoU after each round.
    ``prompts`` (:func:`first_prompts`, drawn for these N objects or a larger group they
    belong to) replaces the draws from ``rng``: training decodes a step's objects a few at
    a time with the prompts drawn for all of them."""
    n = len(gt)
    gt_t = torch.from_numpy(gt).to(device)
    if prompts is None:
        prompts = first_prompts(gt, use_box, rng, cfg, train, n_corr)
    boxes = None if prompts.boxes is None else torch.as_tensor(prompts.boxes, dtype=torch.float32, device=device)
    pts, labs, n_corr = prompts.points, prompts.labels, prompts.n_corr
    if len(boxes if boxes is not None else pts) != n:
        raise ValueError(f"prompts for {len(boxes if boxes is not None else pts)} objects, masks for {n}")
    # a first click: the 3 multimask outputs, or with the single-mask one ("all")
    first = False if use_box else ("all" if cfg.first_candidates == "all" else True)
    # the candidate the engine keeps for a first click, when the schedule names one
    keep = None if use_box or cfg.first_output is None else cfg.first_output - (0 if first == "all" else 1)
    with torch.set_grad_enabled(train):
        logits, iou = _decode(sam, emb, None if pts is None else torch.as_tensor(pts, dtype=torch.float32, device=device),
                              None if labs is None else torch.as_tensor(labs, device=device),
                              boxes, None, multimask=first)
        loss = _mask_loss(logits, iou, gt_t, keep)
    prev = (_best(logits, iou) if keep is None else logits[:, keep]).detach().float()
    del logits, iou
    if record is not None:
        record.append(_iou(prev, gt_t).cpu().numpy())
    terms = 1
    for r in range(n_corr):
        pred = (prev > 0).cpu().numpy()
        new_p, new_l = [], []
        for m, g in zip(pred, gt):
            c = corrective_point(m, g)
            p, lab = c if c is not None else (interior_point(g), 1)
            new_p.append(p)
            new_l.append(lab)
        new_p = np.stack(new_p)[:, None]
        new_l = np.asarray(new_l, dtype=np.int64)[:, None]
        pts = new_p if pts is None else np.concatenate([pts, new_p], 1)
        labs = new_l if labs is None else np.concatenate([labs, new_l], 1)
        grad = train and r == n_corr - 1
        with torch.set_grad_enabled(grad):
            logits, iou = _decode(sam, emb, torch.as_tensor(pts, dtype=torch.float32, device=device),
                                  torch.as_tensor(labs, device=device), boxes, prev[:, None], False)
            if grad:
                loss = loss + _mask_loss(logits, iou, gt_t)
                terms += 1
        prev = logits[:, 0].detach().float()
        del logits, iou
        if record is not None:
            record.append(_iou(prev, gt_t).cpu().numpy())
    return loss / terms


def sample_objects(views: Sequence[TrainView], idx: Sequence[int], k: int, rng, device):
    """Up to ``k`` random whole objects of each view in ``idx``: ``(embeddings, owner, gt)``
    with the views' embeddings once, (V, C, h, w) fp32 on ``device``, ``owner`` (N,) the
    row of each object's view in it and ``gt`` (N, S, S) bool masks. An object's embedding
    is ``embeddings[owner[i]]``, taken only for the objects being decoded (each copy is
    C x h x w floats: 4 MiB for SAM's 256 x 64 x 64)."""
    owner, gts = [], []
    stack = []
    for j, vi in enumerate(idx):
        tv = views[vi]
        ids = rng.choice(tv.ids, size=min(k, len(tv.ids)), replace=False)
        stack.append(tv.embedding)
        for oid in ids:
            owner.append(j)
            gts.append(tv.labels == oid)
    return stack_fp32(stack, device), torch.as_tensor(owner, device=device), np.stack(gts)


def stack_fp32(embeddings: Sequence[torch.Tensor], device) -> torch.Tensor:
    """The views' fp16 embeddings as one fp32 batch on ``device``. Cast before stacking: a
    stack of fp16 tensors inside a bf16 autocast (validation on a CPU whose policy picks
    bf16) is refused by torch ("Unexpected floating ScalarType")."""
    return torch.stack([e.to(device, torch.float32) for e in embeddings])


def evaluate(sam, views: Sequence[TrainView], pairs: Sequence[tuple[int, int]], cfg: "SamTuneConfig",
             device, batch: int = 16) -> dict:
    """Mean IoU on fixed (view, object) pairs at the model input: 1 click, 3 clicks
    (two corrective), a tight box; ``score`` is their mean."""
    out = {"iou_1click": [], "iou_3click": [], "iou_box": []}
    rng = np.random.default_rng(0)
    for start in range(0, len(pairs), batch):
        chunk = pairs[start:start + batch]
        e = stack_fp32([views[v].embedding for v, _ in chunk], device)
        gt = np.stack([views[v].labels == o for v, o in chunk])
        rec: list = []
        episode(sam, e, gt, False, rng, cfg, device, train=False, n_corr=2, record=rec)
        out["iou_1click"].append(rec[0])
        out["iou_3click"].append(rec[2])
        rec = []
        episode(sam, e, gt, True, rng, cfg, device, train=False, n_corr=0, record=rec)
        out["iou_box"].append(rec[0])
    res = {k: float(np.concatenate(v).mean()) if v else float("nan") for k, v in out.items()}
    res["score"] = float(np.mean([res["iou_1click"], res["iou_3click"], res["iou_box"]]))
    return res
