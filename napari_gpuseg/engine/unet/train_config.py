"""The knobs, events and result of U-Net training (:func:`.training.train_unet`)."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from ...models.unet import UNet, UNetConfig
from ..normalize import normalization_spec


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
