"""U-Net training from (image, instance labels) pairs.

Targets are three classes (background / interior / boundary, the boundary being the
inner one-pixel rim of every object from ``skimage.segmentation.find_boundaries``), so
touching objects separate. Random crops, flips, 90-degree rotations and a mild intensity
jitter; Dice + cross-entropy; AdamW (fused on CUDA) with warm-up and cosine decay; AMP
with gradient scaling for fp16; DataLoader workers with pinned memory on CUDA; early
stopping on the validation score (mean of object F1@0.5 and foreground IoU after the
same post-processing as prediction); the best checkpoint is written with its metadata.
Targets, pairs and crops are :mod:`.train_data`; the loss is :mod:`.loss`.
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

import numpy as np
import torch

from ...models.unet import UNet, UNetConfig, build_unet, count_parameters
from ..runtime.device import Policy, resolve_policy, pin_fp32
from ..runtime.cancel import CancelToken, ProgressFn, check, report
from ..metrics import foreground_iou, object_f1
from ..normalize import normalization_spec
from .checkpoint import save_checkpoint
from .predict import predict_probabilities, probabilities_to_labels
from .loss import dice_ce_loss
from .train_data import (IGNORE, CropDataset, crop_tuple, make_targets, prepare_pairs, split_train_val,
                         train_weights, val_indices)
from .train_output import SaveTarget, check_output_path, fallback_checkpoint_path  # noqa: F401


@dataclass
class TrainConfig:
    """Knobs of :func:`train_unet` (all serialisable into the checkpoint)."""

    model: dict = field(default_factory=lambda: UNetConfig().to_dict())
    crop_size: int = 192
    batch_size: int = 8
    epochs: int = 40
    iters_per_epoch: int = 50
    lr: float = 2e-3
    weight_decay: float = 1e-4
    warmup_iters: int = 50
    val_fraction: float = 0.15
    patience: int = 10
    seed: int = 0
    num_workers: int | None = None  # None = 0 on CPU, up to 4 on CUDA
    compile: bool = False
    gradient_checkpointing: bool = False
    channels_last: bool | None = None  # None = on CUDA for 2D
    max_time_s: float | None = None
    normalization: dict = field(default_factory=normalization_spec)
    val_roi: int | None = None  # validation window edge (None = automatic, see engine.unet.default_roi)
    contact_width: int = 2  # boundary thickness where objects touch (pixels)
    contact_weight: float = 5.0  # cross-entropy weight of those contact pixels
    scale_range: tuple | None = None  # (low, high) zoom of training crops, e.g. (0.5, 2.0)
    strong_intensity: bool = False  # gamma, blur and noise on top of the scale/shift jitter

    def to_dict(self) -> dict:
        return asdict(self)

    def check(self) -> None:
        """Raise :class:`TrainConfigError` naming the first knob with an unusable value."""
        def bad(name, value, need):
            raise TrainConfigError(name, f"{name} must be {need}, got {value!r}")

        for name in ("batch_size", "epochs", "iters_per_epoch", "patience"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                bad(name, v, "an integer >= 1")
        crops = self.crop_size if isinstance(self.crop_size, (tuple, list)) else [self.crop_size]
        if not all(isinstance(c, (int, np.integer)) and c >= MIN_CROP for c in crops):
            bad("crop_size", self.crop_size, f"an integer >= {MIN_CROP} (pixels)")
        for name in ("lr", "weight_decay", "val_fraction", "contact_weight"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.number)) or not math.isfinite(v):
                bad(name, v, "a finite number")
        if self.lr <= 0:
            bad("lr", self.lr, "a positive number")
        if self.weight_decay < 0:
            bad("weight_decay", self.weight_decay, ">= 0")
        if not 0 <= self.val_fraction < 1:
            bad("val_fraction", self.val_fraction, "in [0, 1) (some data must be left to train on)")
        if self.max_time_s is not None and not (math.isfinite(self.max_time_s) and self.max_time_s > 0):
            bad("max_time_s", self.max_time_s, "a positive number of seconds")
        if self.scale_range is not None:
            lo_hi = tuple(self.scale_range) if isinstance(self.scale_range, (tuple, list)) else ()
            if len(lo_hi) != 2 or not all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0
                                           for v in lo_hi) or lo_hi[0] > lo_hi[1]:
                bad("scale_range", self.scale_range, "two positive numbers, low <= high")
        if self.num_workers is not None and (not isinstance(self.num_workers, int) or self.num_workers < 0):
            bad("num_workers", self.num_workers, "an integer >= 0")


MIN_CROP = 8  # smallest crop edge (the smallest U-Net, depth 1-3, pads anything shorter)


class TrainConfigError(ValueError):
    """A :class:`TrainConfig` value that cannot work; ``name`` is the field."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name


@dataclass
class TrainEvent:
    """Progress report: ``kind`` is "iter" (train loss) or "epoch" (validation)."""

    kind: str
    epoch: int
    iteration: int
    total_iterations: int
    train_loss: float
    val_score: float | None = None
    val_f1: float | None = None
    val_fg_iou: float | None = None
    best_score: float | None = None
    lr: float = 0.0


@dataclass
class TrainResult:
    model: UNet
    checkpoint: str | None
    best_score: float | None
    best_epoch: int
    history: list
    stopped: str  # "completed", "early_stopping", "time_limit"
    seconds: float
    notes: list = field(default_factory=list)  # e.g. crop clamped, checkpoint saved elsewhere


def _lr_factor(it: int, total: int, warmup: int, time_fraction: float = 0.0) -> float:
    """Linear warm-up, then cosine decay to 1 % over the iterations or the time budget,
    whichever runs out first."""
    if it < warmup:
        return (it + 1) / warmup
    t = max((it - warmup) / max(1, total - warmup), time_fraction)
    return 0.01 + 0.99 * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))


def _time_fraction(config: TrainConfig, t0: float) -> float:
    if not config.max_time_s:
        return 0.0
    return (time.perf_counter() - t0) / config.max_time_s


def _workers(config: TrainConfig, device: torch.device) -> int:
    """DataLoader workers: ``config.num_workers``, else none on the CPU and off Linux (macOS
    and Windows start workers by spawning, which imports torch again in each of them at
    every Train / Adapt start), else up to 4."""
    if config.num_workers is not None:
        return config.num_workers
    if device.type == "cpu" or not sys.platform.startswith("linux"):
        return 0
    return max(0, min(4, (os.cpu_count() or 1) // 2))


SYNC_FREE_DEVICES = ("cpu",)  # devices where reading a loss back costs no wait (no queued kernels)


def amp_setup(policy: Policy) -> tuple[bool, "torch.amp.GradScaler"]:
    """(autocast on?, gradient scaler) for training under ``policy``.

    CUDA: autocast in the policy's precision, with an enabled scaler (fp16: the usual
    loss scaling; bf16: scale 1, kept only so that a step with non-finite gradients is
    skipped on the device, by the fused optimizer, without a host sync). MPS: fp32 and no
    scaler (the MPS scaler's ``unscale_`` fails on torch 2.5-2.7, and fp16 without one
    loses small gradients). CPU: bf16 autocast where the policy has it, no scaler."""
    device = policy.device
    use_amp = policy.uses_autocast and device.type != "mps"
    if device.type == "cuda" and use_amp:
        if policy.active_precision == "fp16":
            return True, torch.amp.GradScaler("cuda")
        return True, torch.amp.GradScaler("cuda", init_scale=1.0, growth_interval=2**30)
    return use_amp, torch.amp.GradScaler(device.type if device.type == "cuda" else "cpu", enabled=False)


def evaluate(model: UNet, xs: list, ys: list, config: TrainConfig, policy: Policy) -> tuple[float, float]:
    """(object F1@0.5, foreground IoU) of the current model on validation pairs."""
    preds = []
    model.eval()
    d = model.config.spatial_dims
    for x in xs:
        inp = x[0] if model.config.in_channels == 1 else x
        probs = predict_probabilities(model, inp, normalization={"kind": "none"}, tile=config.val_roi,
                                      sw_batch_size=4, policy=policy, channels_last=False,
                                      convert=False)
        preds.append(probabilities_to_labels(probs, spatial_dims=d))
    model.train()
    truth = [np.asarray(y) for y in ys]
    return object_f1(truth, preds, 0.5), foreground_iou(truth, preds)


LOSS_SYNC_EVERY = 8  # iterations whose losses are read back to the host in one copy


def _compiled(model):
    """``torch.compile(model)``, or ``model`` (with a warning) when compiling is unavailable."""
    try:
        return torch.compile(model)
    except Exception as exc:  # noqa: BLE001 - e.g. no compiler for this Python or platform
        warnings.warn(f"napari-gpuseg: torch.compile unavailable ({exc.__class__.__name__}); "
                      "training without compilation", RuntimeWarning, stacklevel=2)
        return model


def _flush_losses(pending: list, on_event, epoch: int, total: int, best_score) -> list[float]:
    """One device->host copy for the pending losses; emits their "iter" events."""
    if not pending:
        return []
    values = torch.stack([p[1].float() for p in pending]).tolist()
    for (it, _loss, lr), lv in zip(pending, values):
        _emit(on_event, TrainEvent("iter", epoch, it, total, lv, best_score=best_score, lr=lr))
    pending.clear()
    return values


def train_unet(
    images,
    labels,
    config: TrainConfig | None = None,
    out_path=None,
    policy: Policy | None = None,
    on_event: Callable[[TrainEvent], None] | None = None,
    progress: ProgressFn = None,
    cancel: CancelToken | None = None,
    data_summary: dict | None = None,
    init_checkpoint=None,
    sample_weights=None,
) -> TrainResult:
    """Train a U-Net on ``images``/``labels`` (lists of arrays, or one pair).

    ``on_event`` receives a :class:`TrainEvent` every iteration and after every
    validation; ``progress(done, total)`` counts iterations; ``cancel`` stops between
    iterations (raising ``Cancelled``; the best checkpoint so far stays on disk).
    ``init_checkpoint``: start from these weights (fine-tuning); its architecture and
    normalisation replace ``config.model`` and ``config.normalization``.
    ``sample_weights``: relative weight of each (2D) training image when crops are drawn
    (default: by pixel count), e.g. to balance data sets of different sizes.
    """
    t0 = time.perf_counter()
    config = config or TrainConfig()
    config.check()
    target = SaveTarget(out_path) if out_path is not None else None
    if target is not None:
        check_output_path(target.path)
    policy = resolve_policy(policy)
    device = policy.device
    if isinstance(images, np.ndarray) and isinstance(labels, np.ndarray):
        images, labels = [images], [labels]
    torch.manual_seed(config.seed)
    init = None
    if init_checkpoint is not None:
        from .checkpoint import load_checkpoint, load_unet_state

        init = load_checkpoint(init_checkpoint)
        config = replace(config, model=dict(init["config"]), normalization=dict(init["normalization"]))
    mcfg = UNetConfig.from_dict(config.model)
    xs, ys = prepare_pairs(images, labels, mcfg, config.normalization)
    if not xs:
        raise ValueError("no training data")
    if not any(int(y.max()) > 0 for y in ys):
        raise ValueError("the labels contain no objects to learn from")
    tx, ty, vx, vy = split_train_val(xs, ys, config.val_fraction, config.seed)
    weights = train_weights(sample_weights, len(xs), len(tx), config.val_fraction, config.seed)

    def to_targets(y):  # labels < 0: outside the annotated region
        return np.where(y < 0, IGNORE, make_targets(y, contact_width=config.contact_width,
                                                    mark_contacts=True)).astype(np.uint8)

    targets = [to_targets(y) for y in ty]
    has_ignore = any(bool((t == IGNORE).any()) for t in targets)  # decided here: no per-step sync

    model = build_unet(mcfg)
    if init is not None:
        load_unet_state(model, init["state_dict"])
    model = model.to(device)
    model.gradient_checkpointing = config.gradient_checkpointing
    channels_last = config.channels_last
    if channels_last is None:
        channels_last = device.type == "cuda"
    channels_last = channels_last and mcfg.spatial_dims == 2
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    fwd = _compiled(model) if config.compile else model
    compile_pending = fwd is not model  # compilation happens (and can fail) on the first call
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay, fused=fused)
    use_amp, scaler = amp_setup(policy)
    check_each_step = device.type in SYNC_FREE_DEVICES  # elsewhere: checked when losses are read back
    workers = _workers(config, device)
    dataset = CropDataset(tx, targets if config.scale_range is None else ty, config.crop_size,
                          config.iters_per_epoch * config.batch_size, weights=weights,
                          scale=config.scale_range, target_fn=to_targets,
                          strong_intensity=config.strong_intensity)
    notes = []
    if dataset.crop != crop_tuple(config.crop_size, len(dataset.crop)):
        notes.append(f"crop {config.crop_size} clamped to {'x'.join(map(str, dataset.crop))} "
                     "(the largest training image)")
    out_path = target
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=config.batch_size, num_workers=workers, pin_memory=device.type == "cuda",
        persistent_workers=workers > 0, drop_last=True,
    )
    total = config.epochs * config.iters_per_epoch
    history: list = []
    best_score, best_epoch, bad_epochs, it = None, -1, 0, 0
    stopped = "completed"
    saved = None
    summary = {
        "n_images": len(images), "n_train": len(tx), "n_val": len(vx),
        "train_shapes": [list(x.shape[1:]) for x in tx], "n_objects": int(sum(len(np.unique(y)) - 1 for y in ty)),
        "parameters": count_parameters(model), "device": str(device),
        "precision": policy.active_precision if use_amp else "fp32",
        "torch": str(torch.__version__), "val_image_indices": val_indices(len(xs), config.val_fraction, config.seed),
        **(data_summary or {}),
    }
    report(progress, 0, total)
    model.train()
    pending: list = []  # (iteration, loss on the device, lr): read back every few iterations
    for epoch in range(config.epochs):
        losses = []
        for xb, yb in loader:
            check(cancel)
            for g in opt.param_groups:
                g["lr"] = config.lr * _lr_factor(it, total, config.warmup_iters, _time_fraction(config, t0))
            xb = xb.to(device, non_blocking=True)
            if channels_last:
                xb = xb.contiguous(memory_format=torch.channels_last)
            yb = yb.to(device, non_blocking=True)
            def step_loss():
                with policy.autocast() if use_amp else contextlib.nullcontext():
                    logits = fwd(xb)
                return dice_ce_loss(logits, yb, config.contact_weight, ignore=has_ignore)

            if compile_pending:
                try:
                    loss = step_loss()
                except Exception as exc:  # noqa: BLE001 - any compiler failure: train eagerly
                    warnings.warn(f"napari-gpuseg: torch.compile failed ({exc.__class__.__name__}: "
                                  f"{str(exc).splitlines()[0][:200] if str(exc) else ''}); training "
                                  "without compilation", RuntimeWarning, stacklevel=2)
                    summary["compile"] = f"failed, eager: {exc.__class__.__name__}"
                    fwd = model
                    loss = step_loss()
                compile_pending = False
            else:
                loss = step_loss()
            if use_amp and check_each_step and not bool(torch.isfinite(loss)):  # free on a CPU
                pin_fp32(device, f"non-finite training loss in {policy.precision}")
                use_amp = False  # this batch and every later one in fp32
                loss = step_loss()
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            it += 1
            pending.append((it, loss.detach(), opt.param_groups[0]["lr"]))
            if len(pending) >= LOSS_SYNC_EVERY:
                flushed = _flush_losses(pending, on_event, epoch, total, best_score)
                losses += flushed
                if use_amp and not np.isfinite(flushed).all():
                    # on a GPU the scaler skipped those steps on the device: fp32 from here on
                    pin_fp32(device, f"non-finite training loss in {policy.precision}")
                    use_amp, scaler = False, torch.amp.GradScaler("cuda", enabled=False)
            report(progress, it, total)
            if config.max_time_s and time.perf_counter() - t0 > config.max_time_s:
                stopped = "time_limit"
                break
        losses += _flush_losses(pending, on_event, epoch, total, best_score)
        finite = [v for v in losses if math.isfinite(v)]  # skipped (non-finite) steps left out
        mean_loss = float(np.mean(finite)) if finite else float("nan")
        entry = {"epoch": epoch, "iteration": it, "train_loss": mean_loss}
        if vx:
            check(cancel)
            f1, fg = evaluate(model, vx, vy, config, policy)
            score = 0.5 * (f1 + fg)
            entry.update(val_f1=f1, val_fg_iou=fg, val_score=score)
        else:
            score = -mean_loss
        history.append(entry)
        if best_score is None or score > best_score:
            best_score, best_epoch, bad_epochs = score, epoch, 0
            if out_path is not None:
                saved = _save(out_path, model, config, summary, history, epoch, t0)
        else:
            bad_epochs += 1
        _emit(on_event, TrainEvent("epoch", epoch, it, total, mean_loss, entry.get("val_score"),
                                   entry.get("val_f1"), entry.get("val_fg_iou"), best_score,
                                   opt.param_groups[0]["lr"]))
        if bad_epochs >= config.patience:
            stopped = "early_stopping"
            break
        if stopped == "time_limit":
            break
    if out_path is not None and saved is not None:
        from .checkpoint import load_checkpoint, model_from_checkpoint

        model = model_from_checkpoint(load_checkpoint(saved), device)
    model.eval()
    if target is not None and target.failure:
        notes.append(target.failure)
    return TrainResult(model, str(saved) if saved else None, best_score, best_epoch, history, stopped,
                       time.perf_counter() - t0, notes)


def _emit(fn, event: TrainEvent) -> None:
    if fn is not None:
        fn(event)


def _save(target: SaveTarget, model, config, summary, history, epoch, t0):
    best = history[-1]
    metrics = {k: float(v) for k, v in best.items() if k.startswith("val_") or k == "train_loss"}
    meta = dict(
        training={"config": config.to_dict(), "data": summary, "best_epoch": epoch,
                  "seconds": round(time.perf_counter() - t0, 1), "history": [dict(h) for h in history]},
        metrics=metrics,
    )
    return target.save(lambda path: save_checkpoint(path, model, config.normalization, **meta))
