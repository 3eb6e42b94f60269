"""The settings of SAM decoder fine-tuning (:func:`.finetune.finetune_sam`) and of the
simulated episodes it trains on (:mod:`.episode_loss`): steps, objects, learning rate,
prompt mix, training views, validation and the time limit. ``check()`` refuses bad values
with a one-line message."""
from __future__ import annotations

from dataclasses import dataclass

from .train_views import POLARITIES


@dataclass
class SamTuneConfig:
    max_steps: int = 300
    views_per_step: int = 4
    objects_per_view: int = 6
    lr: float = 2e-4
    encoder_lr: float = 0.0  # > 0: the image encoder's last stage(s) and neck train too, at this
    # learning rate (TinyViT encoders; the checkpoint then carries them, see finetune)
    encoder_stages: int = 1  # with encoder_lr: how many of its last stages train (1-3 for TinyViT)
    weight_decay: float = 1e-4
    warmup: int = 10
    box_fraction: float = 0.3  # objects whose first prompt is a box (else one click)
    corrections: int = 2  # corrective rounds per object: 1..corrections, the last one trained
    first_candidates: str = "multi"  # a first click's masks: "multi" (the 3 multimask outputs,
    # as SAM trains) or "all" (single + 3, as the engine offers a tuned decoder's first click)
    first_output: int | str | None = None  # the candidate a first click's mask loss trains and
    # its episode goes on from, numbered as SamEngine.click_output (0 the single-mask output, 1-3
    # SAM's three); None: the best of them (SAM's rule); "measured": the one the engine keeps
    # (its click_output), else the one measured on the training objects (click_choice)
    click_spread: float = 0.3  # first click anywhere within 30 % of the deepest interior
    box_jitter: float = 0.1
    views_per_image: int | list | None = 4  # None = all; a list: one number per image (per zoom)
    view_zooms: tuple | None = None  # scales of the training views (train_views.candidate_views);
    # None: native and the scale the model decodes clicks at (SamEngine.click_zoom)
    click_zoom: float | None = None  # saved with the decoder for the engine; None: the model's own
    polarity: str | list = "as-is"  # "as-is" | "invert" | "both" | "random" (one, or one per image):
    # the pictures of an image that are embedded (train_views.intensity_variants)
    contrast_jitter: float = 1.0  # > 1: each picture gets a random gamma in [1/g, g]
    orientations: int = 1  # each picture in this many of the 8 quarter turns and mirrors
    # (train_views.orientations_of: 1 = as it is)
    val_fraction: float = 0.1  # of the images, for early stopping
    val_objects: int = 96
    eval_every: int = 25
    patience: int = 4  # evaluations without improvement
    max_time: float | None = None  # seconds of training (embedding not counted)
    seed: int = 0
    objects_per_pass: int | None = None  # objects through the decoder at once in a step (the
    # gradients are the same for any value; fewer: less memory); None: 2 on a CPU, all elsewhere

    def check(self) -> None:
        for name in ("max_steps", "views_per_step", "objects_per_view", "eval_every", "val_objects"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.objects_per_pass is not None and int(self.objects_per_pass) < 1:
            raise ValueError(f"objects_per_pass must be at least 1, got {self.objects_per_pass}")
        if not 0 < self.lr < 1:
            raise ValueError(f"lr must be between 0 and 1, got {self.lr}")
        if not 0 <= self.encoder_lr < 1:
            raise ValueError(f"encoder_lr must be 0 (the encoder stays frozen) or below 1, got {self.encoder_lr}")
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.first_candidates not in ("all", "multi"):
            raise ValueError(f"first_candidates must be 'all' or 'multi', got {self.first_candidates!r}")
        if not (self.first_output is None or self.first_output == "measured" or (
                type(self.first_output) is int and self.first_output in first_outputs(self.first_candidates))):
            raise ValueError(f"first_output must be None, 'measured' or a candidate the first click decodes "
                             f"(0-3 with first_candidates 'all', 1-3 with 'multi'), got {self.first_output!r}")
        if self.view_zooms is not None and (not self.view_zooms or min(float(z) for z in self.view_zooms) < 1):
            raise ValueError(f"view_zooms must be one or more scales >= 1, got {self.view_zooms}")
        if self.click_zoom is not None and not 1 <= self.click_zoom <= 4:
            raise ValueError(f"click_zoom must be between 1 and 4, got {self.click_zoom}")
        pols = [self.polarity] if isinstance(self.polarity, str) else list(self.polarity)
        if any(p not in POLARITIES for p in pols):
            raise ValueError(f"polarity must be one of {', '.join(POLARITIES)}, got {self.polarity!r}")
        if not 1 <= self.contrast_jitter <= 4:
            raise ValueError(f"contrast_jitter must be between 1 and 4, got {self.contrast_jitter}")
        if type(self.encoder_stages) is not int or not 1 <= self.encoder_stages <= 3:
            raise ValueError(f"encoder_stages must be a whole number 1-3, got {self.encoder_stages!r}")
        if type(self.orientations) is not int or not 1 <= self.orientations <= 8:
            raise ValueError(f"orientations must be a whole number 1-8, got {self.orientations!r}")
        if self.max_time is not None and self.max_time <= 0:
            raise ValueError(f"max_time must be positive, got {self.max_time}")


def first_outputs(first_candidates: str) -> range:
    """The candidates a training first click decodes, numbered as ``SamEngine.click_output``:
    all four, or SAM's three (1-3) without the single-mask output (0)."""
    return range(4) if first_candidates == "all" else range(1, 4)
