"""Fine-tune a U-Net on one annotated image (annotate -> fine-tune -> predict).

The user labels part of an image and says which part is annotated: the whole image, a
rectangle, or the bounding region of the labels. Pixels outside that region are left out
of the loss (they are given the label -1, which :func:`train_unet` turns into the
ignored target class), so unlabelled objects there do not teach the model "background".
Training itself is :func:`engine.unet.training.train_unet` (crops, flips, rot90,
intensity jitter, Dice + cross-entropy, checkpoint saving) started from the bundled or
the current checkpoint, with a short schedule and no validation split.
"""
from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Callable

import numpy as np

from ..runtime.cancel import CancelToken, ProgressFn
from .unet_checkpoint import bundled_model_path
from .training import TrainConfig, TrainEvent, TrainResult, train_unet

REGIONS = ("whole", "rectangle", "labels")
CONTEXT = 32  # pixels of image context kept around a region (their loss is ignored)


def default_schedule() -> TrainConfig:
    """The short default: 150 iterations of 4 crops of 128 px, lr 1e-3, at most 5 min
    (the learning rate decays over whichever runs out first; see docs/benchmarks.md)."""
    return TrainConfig(crop_size=128, batch_size=4, epochs=6, iters_per_epoch=25, lr=1e-3,
                       warmup_iters=10, val_fraction=0.0, patience=1000, max_time_s=300.0)


def region_mask(shape, region: str = "labels", labels=None, rectangle=None, margin: int = 8) -> np.ndarray:
    """Boolean mask (``shape``, 2D) of the annotated region.

    ``region``: ``"whole"``; ``"rectangle"`` with ``rectangle`` = (y0, x0, y1, x1), end
    exclusive, clipped to the image; ``"labels"``: the bounding box of the labelled
    pixels grown by ``margin`` pixels (the background around the objects counts as
    annotated)."""
    shape = tuple(int(s) for s in shape[-2:])
    mask = np.zeros(shape, bool)
    if region == "whole":
        mask[:] = True
        return mask
    if region == "rectangle":
        if rectangle is None or len(rectangle) != 4:
            raise ValueError("a rectangle region needs (y0, x0, y1, x1)")
        y0, x0, y1, x1 = (int(round(float(v))) for v in rectangle)
        y0, y1 = sorted((max(0, min(shape[0], y0)), max(0, min(shape[0], y1))))
        x0, x1 = sorted((max(0, min(shape[1], x0)), max(0, min(shape[1], x1))))
        if y1 - y0 < 1 or x1 - x0 < 1:
            raise ValueError(f"the rectangle {tuple(rectangle)} does not overlap the image {shape}")
        mask[y0:y1, x0:x1] = True
        return mask
    if region == "labels":
        if labels is None or not np.any(np.asarray(labels) > 0):
            raise ValueError("the labels layer has no objects: nothing marks the annotated region")
        ys, xs = np.nonzero(np.asarray(labels) > 0)
        mask[max(0, ys.min() - margin):ys.max() + 1 + margin, max(0, xs.min() - margin):xs.max() + 1 + margin] = True
        return mask
    raise ValueError(f"unknown region {region!r}; use one of {', '.join(REGIONS)}")


def check_labels(labels) -> np.ndarray:
    """An instance label image as int64 with ids 1..N (0 = background), or ValueError: a
    float image must hold whole numbers (a probability map or ``labels + 0.5`` is not a
    label image), and ids must not be negative; any id size is kept (uint64 too)."""
    from ..detect import sequential_labels

    labels = np.asarray(labels)
    if labels.dtype.kind == "f":
        finite = np.isfinite(labels)
        if not finite.all():
            raise ValueError("the labels are not a label image: they hold NaN or infinite values")
        frac = labels != np.round(labels)
        if frac.any():
            raise ValueError(f"the labels are not a label image: non-integer values such as "
                             f"{float(labels[frac].flat[0]):g} (use whole-number object ids, 0 = background)")
    elif labels.dtype.kind not in "uib":
        raise ValueError(f"the labels are not a label image (dtype {labels.dtype})")
    if labels.dtype.kind in "if" and labels.size and labels.min() < 0:
        raise ValueError("the labels are not a label image: negative values (0 = background, objects > 0)")
    if labels.dtype.kind == "f":
        labels = labels.astype(np.int64)
    return sequential_labels(labels)


def training_pair(image, labels, mask: np.ndarray, context: int = CONTEXT):
    """(image crop, labels crop) around ``mask`` with ``context`` pixels of image kept
    around it; labels outside the mask become -1 (ignored in the loss). ``image`` is
    (C,) Y, X."""
    image, labels = np.asarray(image), np.asarray(labels)
    ys, xs = np.nonzero(mask)
    y0, y1 = max(0, ys.min() - context), min(mask.shape[0], ys.max() + 1 + context)
    x0, x1 = max(0, xs.min() - context), min(mask.shape[1], xs.max() + 1 + context)
    lab = np.where(mask, labels.astype(np.int32), -1)[y0:y1, x0:x1]
    img = image[..., y0:y1, x0:x1]  # (C,) Y, X
    return img, lab


def default_output_path(image_path=None, base=None, suffix: str = "_unet_adapted") -> Path:
    """``<image stem><suffix>.pt`` beside the image (a numbered name when taken);
    without an image path, or when its folder cannot be written, in ``base`` (default: the
    current folder)."""
    if image_path:
        p = Path(image_path)
        folder, stem = p.parent, p.name.split(".")[0]
        if base is not None and not os.access(folder, os.W_OK):
            folder = Path(base)
    else:
        folder, stem = Path(base or "."), "image"
    out = folder / f"{stem}{suffix}.pt"
    k = 2
    while out.exists():
        out = folder / f"{stem}{suffix}_{k}.pt"
        k += 1
    return out


def finetune_unet(image, labels, *, region: str = "labels", rectangle=None, init_checkpoint=None,
                  config: TrainConfig | None = None, out_path=None, image_path=None,
                  on_event: Callable[[TrainEvent], None] | None = None, progress: ProgressFn = None,
                  cancel: CancelToken | None = None, policy=None) -> TrainResult:
    """Fine-tune ``init_checkpoint`` (None = the bundled nuclei model) on one 2D image and
    its instance ``labels`` in the annotated ``region`` (see :func:`region_mask`).

    The checkpoint is written to ``out_path`` (default: beside ``image_path``, see
    :func:`default_output_path`); ``TrainResult.checkpoint`` is its path. ``on_event``
    gets the loss every iteration; ``cancel`` stops between iterations (``Cancelled``)."""
    image, labels = np.asarray(image), np.asarray(labels)
    if labels.ndim != 2:
        raise ValueError(f"fine-tuning takes one 2D labels image, got shape {labels.shape}")
    labels = check_labels(labels)
    if image.shape[:2] != labels.shape and image.shape[-2:] != labels.shape:
        raise ValueError(f"image {image.shape} and labels {labels.shape} differ in shape")
    if image.shape[-2:] != labels.shape and image.ndim == 3:  # YXC (RGB) -> CYX
        image = np.moveaxis(image, -1, 0)
    mask = region_mask(labels.shape, region, labels=labels, rectangle=rectangle)
    if not np.any((labels > 0) & mask):
        raise ValueError("no labelled objects inside the annotated region")
    img, lab = training_pair(image, labels, mask)
    config = replace(config or default_schedule(), val_fraction=0.0)
    out_path = out_path or default_output_path(image_path)
    init = init_checkpoint or bundled_model_path()
    summary = {"finetune": {"region": region, "init": str(init), "annotated_pixels": int(mask.sum()),
                            "objects": int(len(np.unique(labels[mask & (labels > 0)])))}}
    return train_unet([img], [lab], config, out_path=out_path, policy=policy, on_event=on_event,
                      progress=progress, cancel=cancel, data_summary=summary, init_checkpoint=init)
