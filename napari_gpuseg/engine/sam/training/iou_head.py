"""Refit a decoder's IoU head on first clicks, so that an object's first click keeps the
candidate mask that fits best.

A first click asks the decoder for all its candidates (the single-mask output and SAM's
three) and keeps the one with the highest predicted IoU, in the click's zoomed view and at
native scale (:meth:`SamEngine.predict`). The masks can be good while the choice is poor:
on whole cells in transmitted light the shipped decoder's IoU head rated its smallest
candidate highest (0.68 predicted, 0.46 true on the training frames), so one click gave
half a cell although a larger candidate was there. The masks come from the decoder's
transformer and upscaling; the choice only from the IoU head, a small MLP on the IoU
token. This module measures, for the first click of each object of labelled training
images, every candidate's true IoU in every view the predictor decodes it in, with the
IoU head's input (:func:`first_click_samples`), and refits that MLP by least squares on
them, early-stopped on held-out objects (:func:`fit_iou_head`). The masks do not change;
which one a first click keeps, and the predicted IoU shown, do.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ..interactive.decode_call import module_outputs, prompt_tensors, render_masks
from ..interactive.prompt_types import Prompt
from .click_eval import pick_objects
from .simulated_prompts import interior_point, mask_iou


def first_click_views(engine, image, prompt: Prompt) -> list:
    """The views :meth:`SamEngine.predict` decodes an object's first click in: its click
    view, and the native-scale view too when the click view is zoomed."""
    views = [engine.route(image, prompt)]
    native = engine.route(image, prompt, zoom=False)
    if native not in views:
        views.append(native)
    return views


def first_click_samples(engine, image: np.ndarray, labels: np.ndarray, max_objects: int | None = None,
                        seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """For the first click (most interior pixel) on each object of ``labels`` (at most
    ``max_objects``, drawn with ``seed``) and each view it is decoded in: the IoU head's
    input (``features``: (K, C)) and every candidate's IoU against the object at native
    resolution (``ious``: (K, M), the decoder's outputs in its own order)."""
    labels = np.asarray(labels)
    prepared = engine.prepare(image)
    head = engine.sam.mask_decoder.iou_prediction_head
    seen: list[torch.Tensor] = []
    hook = head.register_forward_hook(lambda _m, args, _out: seen.append(args[0].detach().float().cpu()))
    feats, ious = [], []
    dev = engine.policy.device
    try:
        for oid, s in pick_objects(labels, max_objects, seed):
            truth = labels == oid
            x, y = interior_point(truth[s]) + [s[1].start, s[0].start]
            prompt = Prompt(points=np.array([[x, y]], dtype=float), labels=np.array([1]))
            for view in first_click_views(engine, prepared, prompt):
                emb = engine.embedding(prepared, view)
                points, boxes, masks, _roi = prompt_tensors(view, [prompt], dev, engine.input_size,
                                                            emb.shape[-1], False)
                seen.clear()
                with torch.inference_mode(), engine.policy.autocast():
                    sparse, dense = engine.sam.prompt_encoder(points=points, boxes=boxes, masks=masks)
                    low_res, _iou = module_outputs(engine.sam, dev, emb, sparse, dense, "all")
                cand = render_masks(low_res[0].float(), view, 64 << 20)
                full = np.zeros((len(cand),) + truth.shape, dtype=bool)
                full[:, view.y0:view.y0 + view.h, view.x0:view.x0 + view.w] = cand
                feats.append(seen[-1][0].numpy())
                ious.append([mask_iou(m, truth) for m in full])
    finally:
        hook.remove()
    width, outputs = head.layers[0].in_features, head.layers[-1].out_features
    return (np.asarray(feats, dtype=np.float32).reshape(-1, width),
            np.asarray(ious, dtype=np.float32).reshape(-1, outputs))


@dataclass
class HeadFit:
    """What :func:`fit_iou_head` did: the held-out squared error before and after, the
    epoch kept, and how many samples it fitted and held out."""

    held_out_mse_before: float
    held_out_mse_after: float
    epoch: int
    fitted: int
    held_out: int


def fit_iou_head(head: nn.Module, features: np.ndarray, ious: np.ndarray, holdout: float = 0.2,
                 epochs: int = 400, lr: float = 3e-4, seed: int = 0, bias_only: bool = False) -> HeadFit:
    """Refit ``head`` (in place, on the CPU in fp32) to predict ``ious`` from ``features``
    by mean squared error with Adam, full batch; a ``holdout`` fraction of the samples
    (drawn with ``seed``) picks the epoch kept (the lowest held-out error, the starting
    weights included, so the head never gets worse on them). ``bias_only``: only the last
    layer's bias moves (one offset per candidate: the smallest change that reorders them)."""
    x = torch.as_tensor(features, dtype=torch.float32)
    y = torch.as_tensor(ious, dtype=torch.float32)
    if len(x) < 5:
        raise ValueError(f"{len(x)} samples are too few to refit the IoU head (5 or more)")
    order = np.random.default_rng(seed).permutation(len(x))
    n_hold = max(1, int(round(len(x) * holdout)))
    hold, fit = order[:n_hold], order[n_hold:]
    head.float().cpu()
    for p in head.parameters():
        p.requires_grad_(False)
    params = [head.layers[-1].bias] if bias_only else list(head.parameters())
    for p in params:
        p.requires_grad_(True)
    loss_fn = nn.functional.mse_loss

    def held_out() -> float:
        with torch.no_grad():
            return float(loss_fn(head(x[hold]), y[hold]))

    before = best = held_out()
    best_state, best_epoch = copy.deepcopy(head.state_dict()), 0
    opt = torch.optim.Adam(params, lr=lr)
    with torch.enable_grad():
        for epoch in range(1, epochs + 1):
            opt.zero_grad()
            loss_fn(head(x[fit]), y[fit]).backward()
            opt.step()
            err = held_out()
            if err < best:
                best, best_state, best_epoch = err, copy.deepcopy(head.state_dict()), epoch
    head.load_state_dict(best_state)
    for p in head.parameters():
        p.requires_grad_(False)
    return HeadFit(before, best, best_epoch, len(fit), len(hold))
