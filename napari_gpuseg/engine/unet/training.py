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
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np
import torch

from ...models.unet import UNet, UNetConfig, build_unet, count_parameters
from ..runtime.device import Policy, resolve_policy, pin_fp32
from ..runtime.cancel import CancelToken, ProgressFn, check, report
from ..metrics import foreground_iou, object_f1
from .unet_checkpoint import save_checkpoint
from .train_config import MIN_CROP, TrainConfig, TrainConfigError, TrainEvent, TrainResult  # noqa: F401 - re-exported
from .predict import predict_probabilities, probabilities_to_labels
from .loss import dice_ce_loss
from .train_data import CropDataset, TrainingData, crop_tuple, prepare_training_data, val_indices
from .train_output import SaveTarget, check_output_path, fallback_checkpoint_path  # noqa: F401


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
        from .unet_checkpoint import load_checkpoint

        init = load_checkpoint(init_checkpoint)
        config = replace(config, model=dict(init["config"]), normalization=dict(init["normalization"]))
    data = prepare_training_data(images, labels, config, sample_weights)
    model, channels_last = _build_model(data.mcfg, init, config, device)
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay,
                            fused=device.type == "cuda")
    summary = _summary(len(images), data, model, device, config, data_summary)
    stepper = _Stepper(model, opt, policy, config, data.has_ignore, summary)
    summary["precision"] = policy.active_precision if stepper.use_amp else "fp32"
    loader, notes = _loader(data, config, device)
    total = config.epochs * config.iters_per_epoch
    track = _Track()
    stopped, it = "completed", 0
    report(progress, 0, total)
    model.train()
    pending: list = []  # (iteration, loss on the device, lr): read back every few iterations
    for epoch in range(config.epochs):
        it, losses, timed_out = _run_epoch(loader, stepper, config, channels_last, epoch, it, total, t0,
                                           pending, track, on_event, progress, cancel)
        stopped = "time_limit" if timed_out else stopped
        losses += _flush_losses(pending, on_event, epoch, total, track.best_score)
        if data.vx:
            check(cancel)
        track.end_epoch(epoch, it, total, losses, model, data, config, policy, target, summary, t0,
                        opt.param_groups[0]["lr"], on_event)
        if track.bad_epochs >= config.patience:
            stopped = "early_stopping"
            break
        if stopped == "time_limit":
            break
    if target is not None and track.saved is not None:
        from .unet_checkpoint import load_checkpoint, model_from_checkpoint

        model = model_from_checkpoint(load_checkpoint(track.saved), device)
    model.eval()
    if target is not None and target.failure:
        notes.append(target.failure)
    return TrainResult(model, str(track.saved) if track.saved else None, track.best_score, track.best_epoch,
                       track.history, stopped, time.perf_counter() - t0, notes)


def _run_epoch(loader, stepper, config: TrainConfig, channels_last: bool, epoch: int, it: int, total: int,
               t0: float, pending: list, track, on_event, progress, cancel) -> tuple[int, list, bool]:
    """The steps of one epoch (learning rate by schedule, losses read back every
    :data:`LOSS_SYNC_EVERY` steps); returns the iteration count, the losses read back and
    whether the time budget ran out."""
    device, opt = stepper.policy.device, stepper.opt
    losses: list = []
    for xb, yb in loader:
        check(cancel)
        for g in opt.param_groups:
            g["lr"] = config.lr * _lr_factor(it, total, config.warmup_iters, _time_fraction(config, t0))
        xb = xb.to(device, non_blocking=True)
        if channels_last:
            xb = xb.contiguous(memory_format=torch.channels_last)
        loss = stepper.step(xb, yb.to(device, non_blocking=True))
        it += 1
        pending.append((it, loss.detach(), opt.param_groups[0]["lr"]))
        if len(pending) >= LOSS_SYNC_EVERY:
            flushed = _flush_losses(pending, on_event, epoch, total, track.best_score)
            losses += flushed
            stepper.after_flush(flushed)
        report(progress, it, total)
        if config.max_time_s and time.perf_counter() - t0 > config.max_time_s:
            return it, losses, True
    return it, losses, False


def _summary(n_images: int, data, model, device, config: TrainConfig, extra: dict | None) -> dict:
    """The data and run facts the checkpoint keeps (``precision`` is added by the caller)."""
    return {
        "n_images": n_images, "n_train": len(data.tx), "n_val": len(data.vx),
        "train_shapes": [list(x.shape[1:]) for x in data.tx],
        "n_objects": int(sum(len(np.unique(y)) - 1 for y in data.ty)),
        "parameters": count_parameters(model), "device": str(device),
        "torch": str(torch.__version__),
        "val_image_indices": val_indices(len(data.xs), config.val_fraction, config.seed),
        **(extra or {}),
    }


def _loader(data, config: TrainConfig, device) -> tuple:
    """The DataLoader of random crops (workers and pinned memory on CUDA), and a note when
    the crop had to shrink to the largest training image."""
    workers = _workers(config, device)
    dataset = CropDataset(data.tx, data.targets if config.scale_range is None else data.ty, config.crop_size,
                          config.iters_per_epoch * config.batch_size, weights=data.weights,
                          scale=config.scale_range, target_fn=data.to_targets,
                          strong_intensity=config.strong_intensity)
    notes = []
    if dataset.crop != crop_tuple(config.crop_size, len(dataset.crop)):
        notes.append(f"crop {config.crop_size} clamped to {'x'.join(map(str, dataset.crop))} "
                     "(the largest training image)")
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=config.batch_size, num_workers=workers, pin_memory=device.type == "cuda",
        persistent_workers=workers > 0, drop_last=True,
    )
    return loader, notes


def _build_model(mcfg: UNetConfig, init: dict | None, config: TrainConfig, device) -> tuple[UNet, bool]:
    """The network (from ``init``'s weights when fine-tuning) on ``device``; channels-last
    memory for 2D on CUDA unless the config says otherwise."""
    model = build_unet(mcfg)
    if init is not None:
        from .unet_checkpoint import load_unet_state

        load_unet_state(model, init["state_dict"])
    model = model.to(device)
    model.gradient_checkpointing = config.gradient_checkpointing
    channels_last = config.channels_last
    if channels_last is None:
        channels_last = device.type == "cuda"
    channels_last = channels_last and mcfg.spatial_dims == 2
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model, channels_last


class _Stepper:
    """One optimiser step: forward (compiled when asked; eager if compiling fails), Dice +
    CE loss, backward with the gradient scaler. A non-finite loss under autocast pins the
    device to fp32: on a CPU the step is redone at once, on a GPU after the next read-back."""

    def __init__(self, model, opt, policy: Policy, config: TrainConfig, has_ignore: bool, summary: dict):
        self.model, self.opt, self.policy, self.config = model, opt, policy, config
        self.has_ignore, self.summary = has_ignore, summary
        self.fwd = _compiled(model) if config.compile else model
        self.compile_pending = self.fwd is not model  # compilation happens (and can fail) on the first call
        self.use_amp, self.scaler = amp_setup(policy)
        self.check_each_step = policy.device.type in SYNC_FREE_DEVICES  # elsewhere: at read-back

    def _loss(self, xb, yb):
        with self.policy.autocast() if self.use_amp else contextlib.nullcontext():
            logits = self.fwd(xb)
        return dice_ce_loss(logits, yb, self.config.contact_weight, ignore=self.has_ignore)

    def _first_loss(self, xb, yb):
        try:
            return self._loss(xb, yb)
        except Exception as exc:  # noqa: BLE001 - any compiler failure: train eagerly
            warnings.warn(f"napari-gpuseg: torch.compile failed ({exc.__class__.__name__}: "
                          f"{str(exc).splitlines()[0][:200] if str(exc) else ''}); training "
                          "without compilation", RuntimeWarning, stacklevel=4)
            self.summary["compile"] = f"failed, eager: {exc.__class__.__name__}"
            self.fwd = self.model
            return self._loss(xb, yb)
        finally:
            self.compile_pending = False

    def step(self, xb, yb) -> torch.Tensor:
        loss = self._first_loss(xb, yb) if self.compile_pending else self._loss(xb, yb)
        if self.use_amp and self.check_each_step and not bool(torch.isfinite(loss)):  # free on a CPU
            pin_fp32(self.policy.device, f"non-finite training loss in {self.policy.precision}")
            self.use_amp = False  # this batch and every later one in fp32
            loss = self._loss(xb, yb)
        self.opt.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()
        return loss

    def after_flush(self, flushed: list[float]) -> None:
        if self.use_amp and not np.isfinite(flushed).all():
            # on a GPU the scaler skipped those steps on the device: fp32 from here on
            pin_fp32(self.policy.device, f"non-finite training loss in {self.policy.precision}")
            self.use_amp, self.scaler = False, torch.amp.GradScaler("cuda", enabled=False)


@dataclass
class _Track:
    """The history, the best validation score so far and the checkpoint it was saved to."""

    history: list = field(default_factory=list)
    best_score: float | None = None
    best_epoch: int = -1
    bad_epochs: int = 0
    saved: object = None

    def end_epoch(self, epoch, it, total, losses, model, data: TrainingData, config, policy, target, summary, t0,
                  lr, on_event) -> None:
        """Validate, record the epoch, save when the score is the best so far, tell ``on_event``."""
        finite = [v for v in losses if math.isfinite(v)]  # skipped (non-finite) steps left out
        mean_loss = float(np.mean(finite)) if finite else float("nan")
        entry = {"epoch": epoch, "iteration": it, "train_loss": mean_loss}
        if data.vx:
            f1, fg = evaluate(model, data.vx, data.vy, config, policy)
            score = 0.5 * (f1 + fg)
            entry.update(val_f1=f1, val_fg_iou=fg, val_score=score)
        else:
            score = -mean_loss
        self.history.append(entry)
        if self.best_score is None or score > self.best_score:
            self.best_score, self.best_epoch, self.bad_epochs = score, epoch, 0
            if target is not None:
                self.saved = _save(target, model, config, summary, self.history, epoch, t0)
        else:
            self.bad_epochs += 1
        _emit(on_event, TrainEvent("epoch", epoch, it, total, mean_loss, entry.get("val_score"),
                                   entry.get("val_f1"), entry.get("val_fg_iou"), self.best_score, lr))


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
