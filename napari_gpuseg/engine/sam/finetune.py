"""Fine-tune a SAM decoder to your images: frozen image encoder, simulated interaction.

    result = finetune_sam(images, labels, model="nuclei_sam", out_path="my_decoder.pt")
    engine = load_engine(result.path)          # the tuned decoder on the same encoder

Every training view is embedded once (:mod:`train_views`; with ``cache_dir`` the
embeddings persist on disk and a rerun skips the encoder). The prompt encoder and mask
decoder then learn from simulated users (:mod:`interaction`): each object starts with one
positive click (multimask output, the best of the three candidates counts, as SAM trains)
or a jittered box, then one or more corrective clicks with the previous low-res logits as
mask input. Loss: BCE + Dice on the masks, MSE of the IoU head against the true IoU. AdamW
with warm-up and cosine decay over steps or the time budget, a validation split of whole
images with early stopping, a loss callback, Cancel. CPU fp32 by default; on CUDA the
precision policy's autocast (a GradScaler for fp16) and a halved batch on out-of-memory.
The checkpoint holds only the decoder (:mod:`...models.sam.decoder_checkpoint`).
"""
from __future__ import annotations

import copy
import dataclasses
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..runtime.batching import is_oom
from ..runtime.cancel import CancelToken, Cancelled, ProgressFn, check
from ..runtime.memory import empty_cache
from .interaction import corrective_point, interior_point, jitter_box, tight_box
from .train_views import TrainView, collect_views


@dataclass
class SamTuneConfig:
    max_steps: int = 300
    views_per_step: int = 4
    objects_per_view: int = 6
    lr: float = 2e-4
    weight_decay: float = 1e-4
    warmup: int = 10
    box_fraction: float = 0.3  # objects whose first prompt is a box (else one click)
    corrections: int = 2  # corrective rounds per object: 1..corrections, the last one trained
    click_spread: float = 0.3  # first click anywhere within 30 % of the deepest interior
    box_jitter: float = 0.1
    views_per_image: int | list | None = 4  # None = all; a list: one number per image
    val_fraction: float = 0.1  # of the images, for early stopping
    val_objects: int = 96
    eval_every: int = 25
    patience: int = 4  # evaluations without improvement
    max_time: float | None = None  # seconds of training (embedding not counted)
    seed: int = 0

    def check(self) -> None:
        for name in ("max_steps", "views_per_step", "objects_per_view", "eval_every", "val_objects"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not 0 < self.lr < 1:
            raise ValueError(f"lr must be between 0 and 1, got {self.lr}")
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.max_time is not None and self.max_time <= 0:
            raise ValueError(f"max_time must be positive, got {self.max_time}")


@dataclass
class SamTuneEvent:
    """Sent to ``on_event`` after every step (``val`` set after an evaluation)."""

    step: int
    total: int
    loss: float
    seconds: float
    val: dict | None = None


@dataclass
class SamTuneResult:
    engine: object  # the SamEngine with the best decoder loaded
    path: str | None
    best_score: float | None
    best_step: int
    history: list = field(default_factory=list)
    stopped: str = "done"  # "done" | "early" | "time" | "cancelled"
    seconds: float = 0.0
    n_train_views: int = 0
    n_val_views: int = 0


# -- one interactive episode -------------------------------------------------------------------

def _decode(sam, emb, points=None, labels=None, boxes=None, masks=None, multimask=False):
    sparse, dense = sam.prompt_encoder(points=None if points is None else (points, labels),
                                       boxes=boxes, masks=masks)
    return sam.mask_decoder(emb, sam.prompt_encoder.get_dense_pe(), sparse, dense, multimask)


def _iou(logits: torch.Tensor, gt: torch.Tensor) -> torch.Tensor:
    pred = logits > 0
    inter = (pred & gt).flatten(-2).sum(-1).float()
    union = (pred | gt).flatten(-2).sum(-1).float()
    return torch.where(union > 0, inter / union.clamp(min=1), torch.ones_like(union))


def _mask_loss(logits: torch.Tensor, iou_pred: torch.Tensor, gt: torch.Tensor) -> torch.Tensor:
    """(N, M, S, S) logits against (N, S, S) truth: BCE + Dice of the best candidate per
    object, plus MSE of the predicted IoUs (all candidates) against the true ones."""
    logits = logits.float()
    g = gt[:, None].expand_as(logits).float()
    bce = F.binary_cross_entropy_with_logits(logits, g, reduction="none").flatten(-2).mean(-1)
    p = torch.sigmoid(logits)
    dice = 1 - (2 * (p * g).flatten(-2).sum(-1) + 1) / ((p + g).flatten(-2).sum(-1) + 1)
    per = (bce + dice).min(dim=1).values
    true_iou = _iou(logits.detach(), gt[:, None].expand_as(logits))
    return per.mean() + F.mse_loss(iou_pred.float(), true_iou)


def _best(logits: torch.Tensor, iou_pred: torch.Tensor) -> torch.Tensor:
    """The candidate with the highest predicted IoU per object, as the annotator picks."""
    k = iou_pred.argmax(dim=1)
    return logits[torch.arange(len(k)), k]


def episode(sam, emb: torch.Tensor, gt: np.ndarray, use_box: bool, rng: np.random.Generator,
            cfg: SamTuneConfig, device, train: bool = True, n_corr: int | None = None,
            record: list | None = None) -> torch.Tensor:
    """Loss of one simulated interaction for N objects sharing a prompt kind.

    ``emb`` (N, C, h, w) each object's view embedding; ``gt`` (N, S, S) bool masks at the
    model input. ``record`` (evaluation) receives the true IoU after each round."""
    n, s = len(gt), gt.shape[-1]
    gt_t = torch.from_numpy(gt).to(device)
    spread = cfg.click_spread if train else 0.0
    boxes = pts = labs = None
    if use_box:
        b = [tight_box(m) for m in gt]
        b = [jitter_box(x, rng, cfg.box_jitter, (s, s)) if train else x for x in b]
        boxes = torch.as_tensor(np.stack(b), dtype=torch.float32, device=device)
    else:
        pts = np.stack([interior_point(m, rng, spread)[None] for m in gt])
        labs = np.ones((n, 1), dtype=np.int64)
    with torch.set_grad_enabled(train):
        logits, iou = _decode(sam, emb, None if pts is None else torch.as_tensor(pts, dtype=torch.float32, device=device),
                              None if labs is None else torch.as_tensor(labs, device=device),
                              boxes, None, multimask=not use_box)
        loss = _mask_loss(logits, iou, gt_t)
    prev = _best(logits, iou).detach().float()
    if record is not None:
        record.append(_iou(prev, gt_t).cpu().numpy())
    if n_corr is None:
        n_corr = int(rng.integers(1, cfg.corrections + 1)) if cfg.corrections > 0 else 0
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
        if record is not None:
            record.append(_iou(prev, gt_t).cpu().numpy())
    return loss / terms


def _sample(views: Sequence[TrainView], idx: Sequence[int], k: int, rng, device):
    embs, gts = [], []
    stack = []
    for j, vi in enumerate(idx):
        tv = views[vi]
        ids = rng.choice(tv.ids, size=min(k, len(tv.ids)), replace=False)
        stack.append(tv.embedding)
        for oid in ids:
            embs.append(j)
            gts.append(tv.labels == oid)
    e = torch.stack(stack).to(device, torch.float32)[torch.as_tensor(embs, device=device)]
    return e, np.stack(gts)


def evaluate(sam, views: Sequence[TrainView], pairs: Sequence[tuple[int, int]], cfg: SamTuneConfig,
             device, batch: int = 16) -> dict:
    """Mean IoU on fixed (view, object) pairs at the model input: 1 click, 3 clicks
    (two corrective), a tight box; ``score`` is their mean."""
    out = {"iou_1click": [], "iou_3click": [], "iou_box": []}
    rng = np.random.default_rng(0)
    for start in range(0, len(pairs), batch):
        chunk = pairs[start:start + batch]
        e = torch.stack([views[v].embedding for v, _ in chunk]).to(device, torch.float32)
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


# -- the loop ------------------------------------------------------------------------------

def _split(n_images: int, cfg: SamTuneConfig) -> tuple[set, set]:
    rng = np.random.default_rng(cfg.seed)
    order = rng.permutation(n_images)
    n_val = int(round(n_images * cfg.val_fraction)) if n_images > 1 else 0
    if cfg.val_fraction > 0 and n_images > 1:
        n_val = max(1, n_val)
    return set(order[n_val:].tolist()), set(order[:n_val].tolist())


def _lr_factor(step: int, total: int, warmup: int, time_frac: float) -> float:
    if step < warmup:
        return (step + 1) / warmup
    frac = max((step - warmup) / max(1, total - warmup), time_frac)
    return 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))


def finetune_sam(images: Sequence[np.ndarray], labels: Sequence[np.ndarray], model="nuclei_sam",
                 config: SamTuneConfig | None = None, out_path: str | os.PathLike | None = None,
                 on_event: Callable[[SamTuneEvent], None] | None = None, progress: ProgressFn = None,
                 cancel: CancelToken | None = None, policy=None, cache_dir: str | os.PathLike | None = None,
                 meta: dict | None = None) -> SamTuneResult:
    """Fine-tune the decoder of ``model`` (a registry name, a checkpoint or decoder file, or
    a loaded :class:`SamEngine`) on 2D ``images`` with instance ``labels``; save the best
    decoder (by validation score) to ``out_path``. ``progress(done, total)`` reports the
    embedding of the training views; ``on_event`` every training step."""
    from .loader import load_engine
    from .cache import EmbeddingCache

    cfg = config or SamTuneConfig()
    cfg.check()
    if len(images) == 0:
        raise ValueError("no training images")
    if hasattr(model, "sam") and hasattr(model, "embed"):
        engine = model
    else:
        cache = EmbeddingCache(max_bytes=8 << 30, disk_dir=cache_dir) if cache_dir else EmbeddingCache(8 << 30)
        engine = load_engine(model, policy=policy, cache=cache)
    sam, device = engine.sam, engine.policy.device
    rng = np.random.default_rng(cfg.seed)
    views = collect_views(engine, images, labels, cfg.views_per_image, rng, progress, cancel)
    train_imgs, val_imgs = _split(len(images), cfg)
    train = [i for i, v in enumerate(views) if v.source in train_imgs]
    val = [i for i, v in enumerate(views) if v.source in val_imgs]
    if not train:
        raise ValueError("no training view holds a whole object: check the labels")
    pairs = [(vi, int(o)) for vi in val for o in views[vi].ids]
    if len(pairs) > cfg.val_objects:
        pick = np.random.default_rng(cfg.seed + 1).choice(len(pairs), cfg.val_objects, replace=False)
        pairs = [pairs[k] for k in sorted(pick)]

    params = list(sam.prompt_encoder.parameters()) + list(sam.mask_decoder.parameters())
    for p in sam.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    use_scaler = device.type == "cuda" and engine.policy.precision == "fp16"
    scaler = torch.amp.GradScaler("cuda", enabled=use_scaler)
    history: list[dict] = []
    best_score, best_step, best_state, stale = None, 0, None, 0
    stopped, k = "done", cfg.objects_per_view
    t0 = time.perf_counter()

    def run_eval(step: int) -> dict | None:
        nonlocal best_score, best_step, best_state, stale
        if not pairs:
            return None
        sam.eval()
        with torch.no_grad(), engine.policy.autocast():
            val = evaluate(sam, views, pairs, cfg, device)
        sam.train()
        if best_score is None or val["score"] > best_score:
            best_score, best_step, stale = val["score"], step, 0
            best_state = copy.deepcopy({n: p.detach().clone() for n, p in sam.state_dict().items()
                                        if n.startswith(("prompt_encoder.", "mask_decoder."))})
        else:
            stale += 1
        return val

    initial = run_eval(0)
    if initial is not None:
        history.append({"step": 0, "loss": None, **{f"val_{k2}": v for k2, v in initial.items()}})
    sam.train()
    step = 0
    try:
        while step < cfg.max_steps:
            check(cancel)
            elapsed = time.perf_counter() - t0
            tfrac = elapsed / cfg.max_time if cfg.max_time else 0.0
            if cfg.max_time and elapsed >= cfg.max_time:
                stopped = "time"
                break
            for g in opt.param_groups:
                g["lr"] = cfg.lr * _lr_factor(step, cfg.max_steps, cfg.warmup, tfrac)
            idx = rng.choice(train, size=min(cfg.views_per_step, len(train)), replace=False)
            try:
                emb, gt = _sample(views, idx, k, rng, device)
                is_box = rng.random(len(gt)) < cfg.box_fraction
                opt.zero_grad(set_to_none=True)
                loss_val = 0.0
                for use_box in (False, True):
                    sel = np.nonzero(is_box == use_box)[0]
                    if len(sel) == 0:
                        continue
                    with engine.policy.autocast():
                        loss = episode(sam, emb[torch.as_tensor(sel, device=device)], gt[sel], use_box,
                                       rng, cfg, device) * (len(sel) / len(gt))
                    scaler.scale(loss).backward()
                    loss_val += float(loss.detach())
                scaler.step(opt)
                scaler.update()
            except Exception as exc:  # out of memory on a GPU: fewer objects per step
                if not is_oom(exc) or k == 1:
                    raise
                opt.zero_grad(set_to_none=True)
                k = max(1, k // 2)
                empty_cache(device)
                continue
            step += 1
            scores = run_eval(step) if step % cfg.eval_every == 0 or step == cfg.max_steps else None
            rec = {"step": step, "loss": loss_val}
            if scores is not None:
                rec.update({f"val_{k2}": v for k2, v in scores.items()})
            history.append(rec)
            if on_event is not None:
                on_event(SamTuneEvent(step, cfg.max_steps, loss_val, time.perf_counter() - t0, scores))
            if scores is not None and stale >= cfg.patience:
                stopped = "early"
                break
    except Cancelled:
        stopped = "cancelled"
    if stopped == "time" and step % cfg.eval_every != 0:
        run_eval(step)
    if best_state is not None:
        sam.load_state_dict(best_state, strict=False)
    sam.eval()
    for p in sam.parameters():
        p.requires_grad_(False)
    sam.decoder_tuned = True
    seconds = time.perf_counter() - t0
    path = None
    if out_path is not None and stopped != "cancelled":
        path = str(_save(out_path, engine, cfg, history, best_step, best_score, seconds, stopped,
                         len(train), len(val), meta or {}))
    engine.forget_decoder_work()
    return SamTuneResult(engine, path, best_score, best_step, history, stopped, seconds, len(train), len(val))


def _save(out_path, engine, cfg, history, best_step, best_score, seconds, stopped, n_train, n_val, meta):
    from ...models.sam.decoder_checkpoint import save_decoder
    from .loader import base_identity

    base, sha = base_identity(engine)
    training = {"config": dataclasses.asdict(cfg), "best_step": best_step, "stopped": stopped,
                "seconds": round(seconds, 1), "train_views": n_train, "val_views": n_val,
                "history": history, **meta}
    metrics = {k: v for k, v in (history[0] if history else {}).items() if k.startswith("val_")}
    best = next((h for h in history if h.get("step") == best_step and "val_score" in h), None)
    return save_decoder(Path(out_path), engine.sam, base, sha, training=training,
                        metrics={"before": metrics, "best": best or {}, "best_score": best_score})
