"""Train on what is annotated in a :class:`~.folder.FolderAnnotation`, and make the new model the
pre-segmenter of the images still to do (``napari_gpuseg.engine.annotate.folder_train``):

    res = train_unet_on_annotated(folder)       # U-Net fine-tuned on the annotated images
    res = adapt_sam_on_annotated(folder)        # SAM's decoder adapted to their objects

Each function is the three steps a window runs apart (the middle one in a training thread):
``folder.training_pairs()`` (the annotated images and their labels files), ``train_unet_on_pairs``
/ ``adapt_sam_on_pairs`` (``on_event`` gets the loss of every step, ``cancel`` stops it with no
model written), then ``folder.set_presegmenter(...)`` with the new model. Images already
annotated are never touched; :meth:`~.folder.FolderAnnotation.segment_rest` then segments the
rest with it.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np

from ... import io as gio
from ..runtime.cancel import CancelToken, Cancelled, ProgressFn

MODELS = "models"  # OUT/models/: the U-Net checkpoints trained on a folder's annotations


@dataclass
class FolderTrainResult:
    """``path`` the new model (None when cancelled), ``images`` / ``objects`` what it learned
    from, ``steps`` done, ``seconds``, ``stopped`` (why it ended), ``losses`` one per step."""

    path: str | None
    images: int
    objects: int
    steps: int
    seconds: float
    stopped: str
    losses: list


def models_dir(out_dir) -> Path:
    return Path(out_dir) / MODELS


def _free_path(folder: Path, stem: str) -> Path:
    k = 1
    while (folder / f"{stem}_{k}.pt").exists():
        k += 1
    return folder / f"{stem}_{k}.pt"


def _objects(labels: list[np.ndarray]) -> int:
    return int(sum(np.count_nonzero(np.unique(lab)) for lab in labels))


def train_unet_on_pairs(images: list[np.ndarray], labels: list[np.ndarray], out_dir, *, init_checkpoint=None,
                        config=None, on_event: Callable | None = None, progress: ProgressFn = None,
                        cancel: CancelToken | None = None, policy=None) -> FolderTrainResult:
    """Fine-tune ``init_checkpoint`` (None: the bundled nuclei model) on whole annotated
    images (every object labelled, 0 = background) with :func:`~..unet.finetune_annotated.default_schedule`
    (or ``config``), and save it as ``OUT/models/unet_<k>.pt`` only when training ends without
    a cancel (written beside as a temporary file, then renamed)."""
    from ..unet.finetune_annotated import check_labels, default_schedule
    from ..unet.training import train_unet

    xs, ys = [], []
    for img, lab in zip(images, labels):
        img = gio.to_gray(img) if img.ndim == 3 and img.shape[-1] in (3, 4) else np.asarray(img)
        lab = check_labels(lab)
        if img.shape != lab.shape or lab.ndim != 2:
            raise ValueError(f"U-Net training takes 2D images with labels of the same shape, got "
                             f"{img.shape} and {lab.shape}")
        xs.append(img)
        ys.append(lab)
    if not xs or not any(lab.any() for lab in ys):
        raise ValueError("the annotated images hold no object to train on")
    folder = models_dir(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    final = _free_path(folder, "unet")
    tmp = folder / f".{final.stem}.{os.getpid()}.tmp.pt"
    config = replace(config or default_schedule(), val_fraction=0.0)
    losses: list[float] = []

    def event(ev):
        if ev.kind == "iter":
            losses.append(float(ev.train_loss))
        if on_event is not None:
            on_event(ev)

    t0 = time.perf_counter()
    summary = {"annotated_folder": {"images": len(xs), "objects": _objects(ys)}}
    written: list[Path] = []
    try:
        res = train_unet(xs, ys, config, out_path=tmp, policy=policy, on_event=event, progress=progress,
                         cancel=cancel, data_summary=summary,
                         init_checkpoint=init_checkpoint or _bundled())
        if res.checkpoint:
            written.append(Path(res.checkpoint))
        if cancel is not None and cancel.cancelled:
            raise Cancelled("cancelled")
        if not res.checkpoint:
            raise RuntimeError("training ended without a checkpoint: " + "; ".join(res.notes or ["no reason given"]))
        os.replace(res.checkpoint, final)
        written.clear()
    except Cancelled:
        return FolderTrainResult(None, len(xs), _objects(ys), len(losses), time.perf_counter() - t0, "cancelled",
                                 losses)
    finally:
        for p in written + [tmp]:
            if p.exists():
                p.unlink()
    return FolderTrainResult(str(final), len(xs), _objects(ys), len(losses), time.perf_counter() - t0, res.stopped,
                             losses)


def _bundled():
    from ..unet.unet_checkpoint import bundled_model_path

    return bundled_model_path()


def adapt_sam_on_pairs(images: list[np.ndarray], labels: list[np.ndarray], model=None, *, minutes: float = 4.0,
                       name: str | None = None, folder=None, config=None, image_name: str | None = None,
                       on_event: Callable | None = None, progress: ProgressFn = None,
                       cancel: CancelToken | None = None, policy=None) -> FolderTrainResult:
    """Adapt the decoder of ``model`` (None: the default SAM model) to the annotated objects
    (:func:`~..sam.adapt.adapt_to_objects`: at most ``minutes`` of training, or ``config``),
    saved into the user's adapted decoders (``folder``: elsewhere) unless cancelled."""
    from ..sam.training.adapt import adapt_to_objects
    from ..sam.loader import DEFAULT_MODEL

    losses: list[float] = []

    def event(ev):
        losses.append(float(ev.loss))
        if on_event is not None:
            on_event(ev)

    t0 = time.perf_counter()
    try:
        res = adapt_to_objects(list(images), [np.asarray(lab) for lab in labels], model or DEFAULT_MODEL,
                               minutes=minutes, image_name=image_name, name=name, folder=folder, config=config,
                               on_event=event, progress=progress, cancel=cancel, policy=policy)
    except Cancelled:
        return FolderTrainResult(None, len(images), _objects(labels), len(losses), time.perf_counter() - t0,
                                 "cancelled", losses)
    stopped = "cancelled" if res.path is None else res.stopped
    return FolderTrainResult(res.path, len(images), res.objects, res.steps, res.seconds, stopped, losses)


def current_unet(folder) -> str | None:
    """The U-Net checkpoint of ``folder``'s pre-segmenter (None: none, or the bundled model)."""
    pre = folder.presegment
    return pre.model if getattr(pre, "method", None) == "unet" else None


def train_unet_on_annotated(folder, *, config=None, on_event=None, progress: ProgressFn = None,
                            cancel: CancelToken | None = None, policy=None) -> FolderTrainResult:
    """Fine-tune the folder's U-Net (its pre-segmenter's, else the bundled model) on its
    annotated images; the new checkpoint becomes its pre-segmenter."""
    from .folder import unet_presegmenter

    images, labels, _which = folder.training_pairs()
    res = train_unet_on_pairs(images, labels, folder.out_dir, init_checkpoint=current_unet(folder), config=config,
                              on_event=on_event, progress=progress, cancel=cancel, policy=policy)
    if res.path is not None:
        folder.set_presegmenter(unet_presegmenter(res.path))
    return res


def adapt_sam_on_annotated(folder, *, minutes: float = 4.0, config=None, models_folder=None, on_event=None,
                           progress: ProgressFn = None, cancel: CancelToken | None = None,
                           policy=None) -> FolderTrainResult:
    """Adapt the session's SAM model to the folder's annotated objects; the session prompts
    with the adapted decoder, and it becomes the pre-segmenter (SAM automatic) unless a U-Net
    pre-segments the folder (see :func:`use_adapted_sam`)."""
    images, labels, _which = folder.training_pairs()
    model = folder.session.model if isinstance(folder.session.model, str) else None
    res = adapt_sam_on_pairs(images, labels, model, minutes=minutes, folder=models_folder, config=config,
                             image_name=folder.in_dir.name, on_event=on_event, progress=progress, cancel=cancel,
                             policy=policy)
    if res.path is not None:
        folder.session.set_model(res.path)
        use_adapted_sam(folder, res.path)
    return res


def use_adapted_sam(folder, path) -> bool:
    """Make the adapted SAM decoder ``path`` the folder's pre-segmenter (SAM automatic) when it
    has none or SAM automatic; a U-Net pre-segmenter stays (adapting SAM then helps the
    clicks). True when the pre-segmenter changed."""
    from .folder import sam_presegmenter

    pre = folder.presegment
    if pre is not None and getattr(pre, "method", None) != "sam-everything":
        return False
    folder.set_presegmenter(sam_presegmenter(path))
    return True
