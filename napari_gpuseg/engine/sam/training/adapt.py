"""Adapt SAM to a new kind of object from a few annotated ones, and the user's adapted decoders.

    res = adapt_to_objects(image, labels, model="nuclei_sam", minutes=4, image_name="cells.tif")
    engine = load_engine(res.path)            # or pick res.name from adapted_models()

``labels`` holds the objects the user committed (5-20 is the case this is tuned for; 0 is
unannotated). The prompt encoder, the mask decoder and the image encoder's last stage and
neck (LiteMedSAM's TinyViT, the encoder of every model fine-tuning takes) learn from
simulated clicks, boxes and corrective clicks on those objects with
:func:`few_object_config`'s schedule; then one click on each of them measures which
candidate a first click should keep (:func:`~.click_choice.store_click_choice`: the
file's ``click_output``), and the decoder is saved into the user's list of
adapted decoders (:func:`adapted_dir`: ``<cache folder>/adapted_sam``, an ``index.json``
beside the files naming the image each came from), which :func:`adapted_models` reads.
:func:`unsure_hint` turns a first mask's predicted IoU into the hint to show when the
model is unsure.
"""
from __future__ import annotations

import functools
import json
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ...runtime.cancel import CancelToken, ProgressFn
from ..interactive.prompt_types import shown_iou
from .click_choice import store_click_choice
from .finetune import SamTuneEvent, SamTuneResult, finetune_sam
from .train_views import ORIENTATIONS
from .tune_config import SamTuneConfig

UNSURE_IOU = 0.80
"""A first mask whose predicted IoU (clamped to [0, 1]) is below this is flagged unsure.
Chosen on training objects with ``benchmarks/unsure_threshold.py --data training --per-field 8``,
for what the flag is for (not showing a confident wrong mask): the lowest of 0.50, 0.55, ...,
0.95 that flags at least 85 % of the bad first masks (true IoU under 0.5).
- Setup: the default ``cells_nuclei_sam`` as shipped on 2026-11-29. One click at each object's
  most interior pixel: 105 cells of the scratch-assay training frames t00-t06 (15 per frame)
  and 120 nuclei of the first 16 BBBC039 fields (8 per field); 28 of 225 first masks bad.
  AMD EPYC Zen 4, avx512_bf16, bf16, 2 threads, 2026-11-29.
- Training objects: 0.80 flags 96 of 225 and catches 24 of the 28 bad (precision 0.25, recall
  0.86); 0.85 catches 25 and flags 111; 0.70 (the best F1 there, 0.51) catches only 14.
- Validation (``--data validation``: 45 cells of t07-t09, 120 nuclei of the last 8 BBBC039
  fields, 20 of 165 bad; same day and machine): 0.80 flags 46 and catches 16 (precision 0.35,
  recall 0.80, F1 0.48); 41 of the 45 cells. 0.85, chosen on these objects before (a choice
  made on validation data), flags 54 and catches 19.
- On whole cells the predicted IoU hardly ranks the masks, so most first clicks on a cell are
  flagged, where a box is the better prompt."""
INDEX = "index.json"


FEW_OBJECT_VISITS = 20
"""How often the few-object schedule shows each annotated object (a visit: one object of
one step), which sets its number of steps: ``ceil(20 * objects / objects per step)``, at
least 20 (75 steps for 15 objects). Measured with ``benchmarks/adapt_sam_cells.py`` (15
cells of t06 from ``nuclei_sam``, every one of the 270 cells of t07-t09 measured; 1-click
gain over the start's 0.358). AMD EPYC, avx2 only, fp32, 2 threads, 2026-11-28, lr 3e-4:
+0.153 after 75 steps (134 s), +0.142 after 150 (286 s). An H200, bf16, the same day
(``docs/gpu-runs/2026-11-28-h200-adapt-steps.log``): at lr 1e-3 +0.065 / +0.087 / +0.094 /
+0.078 / +0.048 after 40 / 80 / 150 / 250 / 400 steps, with 3 clicks and boxes below the
start at every count, and the old schedule, bound by time alone, made 963 steps in two
minutes for +0.018 (boxes 0.592 -> 0.459); at lr 3e-4 150 steps gave +0.136. More steps
teach the few objects' outlines, not their kind. With the 8 orientations (AMD EPYC Zen 4,
avx512_bf16, 2 threads, 2026-11-29): +0.159 after 75 steps (94 s), +0.155 after 150.
With the encoder's last stage trained too (:data:`ADAPT_ENCODER_LR`; Zen 4, 2026-11-30):
+0.180 after 75 steps (143 s), +0.186 after 115 (241 s, the 4-minute bound)."""


ADAPT_LR = 1e-4
"""The few-object schedule's learning rate for the prompt encoder and mask decoder."""

ADAPT_ENCODER_LR = 1e-4
"""The few-object schedule's learning rate for the image encoder's last stage and neck
(the models fine-tuning takes, LiteMedSAM-based, have a TinyViT encoder). Chosen on
training frames, ``benchmarks/adapt_sam_cells.py --frame 3 --measure-frames 0 1 2``: 15 cells
of t03 from ``nuclei_sam``, the 209 cells of t00-t02 measured, 1-click gain over 0.431 (an
H200, bf16, 2026-11-30, ``docs/gpu-runs/2026-11-30-h200-adapt-encoder.log``):
- decoder only at lr 3e-4 (before): +0.140;
- with the decoder at 3e-4: encoder 3e-5 / 1e-4 / 3e-4 +0.135 / +0.136 / +0.098, the last
  two stages at 1e-4 +0.102;
- with the decoder at 1e-4: encoder 3e-5 / **1e-4** / 2e-4 +0.144 / **+0.151** (twice) /
  +0.153, 120 steps +0.157; the decoder at 2e-4 +0.148.
Within 0.01 of each other, 1e-4 for both is kept (the 75 steps of the schedule). Then on
the validation protocol (15 cells of t06, the 270 cells of t07-t09), same run: +0.157
before, +0.178 with it (3 clicks 0.639 -> 0.646, box 0.611 -> 0.656). On the CPU (AMD EPYC
Zen 4, avx512_bf16, training steps fp32, 2026-11-30): 0.363 -> 0.543 (+0.180), 3 clicks
0.647, box 0.657, 143 s of training; an AVX2-only CPU in fp32 (emulated there): 0.358 ->
0.543 (+0.185), 175 s of training, 242 s wall; on a real AVX2-only CPU (AMD EPYC Zen 3, fp32,
2026-11-30): 0.358 -> 0.542 (+0.184), 192 s of training, 277 s wall."""


ORIENTED_OBJECTS = 160
"""The few-object schedule shows its objects in as many of their 8 orientations as keep the
oriented objects near this (20 objects in all 8; 40 in 4; 160 or more as they are): few
objects need the variety, and the views to embed stay bounded for many."""


def few_object_config(n_objects: int, minutes: float = 4.0) -> SamTuneConfig:
    """The schedule for a few annotated objects on one or two images: a fixed number of
    visits per object (:data:`FEW_OBJECT_VISITS`), so a GPU and a CPU learn the same thing,
    the GPU sooner; ``minutes`` only bounds the wait on a slow machine (the learning rate's
    decay follows whichever runs out first). The prompt encoder, the mask decoder and the
    image encoder's last stage and neck learn (:data:`ADAPT_LR`, :data:`ADAPT_ENCODER_LR`).
    Small steps (one view, up to four objects), a box as the first prompt for 40 % of the
    objects (the fast way to annotate an unfamiliar kind, and the decoder's most reliable
    prompt, which the clicks learn beside), one corrective click, native views and views
    1.5x finer (objects larger and smaller than nuclei), a mild random gamma per embedded
    picture, and every picture in up to 8 quarter turns and mirrors
    (:func:`~.train_views.orient`; :data:`ORIENTED_OBJECTS`: all 8 for up to 20 objects,
    eight times the views to embed, seconds on a CPU for one field). A first click trains the
    candidate the annotator will keep (``first_output`` "measured"). No validation split:
    every object teaches."""
    n = max(1, int(n_objects))
    per_step = min(4, n)
    steps = max(FEW_OBJECT_VISITS, math.ceil(FEW_OBJECT_VISITS * n / per_step))
    return SamTuneConfig(max_steps=steps, views_per_step=1, objects_per_view=per_step,
                         lr=ADAPT_LR, encoder_lr=ADAPT_ENCODER_LR, warmup=3, box_fraction=0.4, corrections=1,
                         views_per_image=None, val_fraction=0.0, max_time=60.0 * float(minutes),
                         contrast_jitter=1.25, view_zooms=(1.0, 1.5), first_output="measured",
                         orientations=max(1, min(ORIENTATIONS, ORIENTED_OBJECTS // n)))


@dataclass
class AdaptResult:
    """``path`` the saved decoder (None when cancelled), ``name`` its entry in
    :func:`adapted_models`, ``objects`` how many annotated objects it learned from."""

    path: str | None
    name: str | None
    objects: int
    steps: int
    seconds: float
    stopped: str
    tune: SamTuneResult | None  # None when cancelled before training began


def adapted_dir(folder: str | os.PathLike | None = None) -> Path:
    """Where adapted decoders are kept: ``folder``, else ``<cache folder>/adapted_sam``
    (platformdirs' user cache, or ``$NAPARI_GPUSEG_CACHE``)."""
    if folder is not None:
        return Path(folder)
    from ....models.registry import cache_dir

    return cache_dir() / "adapted_sam"


def adapted_models(folder: str | os.PathLike | None = None) -> list[dict]:
    """The user's adapted decoders, newest first: dicts with ``name``, ``path`` (load it
    with ``load_engine(path)``), ``image`` (the image it came from), ``base`` (the model
    it started from), ``objects``, ``created`` (ISO time). Entries whose file is gone are
    left out; a missing or unreadable index gives []."""
    out = [e for e in _read_index(adapted_dir(folder))
           if isinstance(e, dict) and isinstance(e.get("path"), str) and Path(e["path"]).is_file()]
    return sorted(out, key=lambda e: str(e.get("created", "")), reverse=True)


def adapted_entry(model, folder: str | os.PathLike | None = None) -> dict | None:
    """The entry of :func:`adapted_models` whose file is ``model`` (a path), else None (a
    registry name, another file, a file gone)."""
    if not isinstance(model, (str, os.PathLike)) or not str(model):
        return None
    try:
        return _entry_of(adapted_models(folder), Path(model).resolve())
    except OSError:
        return None


def _entry_of(entries: list, target: Path) -> dict | None:
    """The index entry whose file is ``target`` (a resolved path), else None."""
    return next((e for e in entries if isinstance(e, dict) and isinstance(e.get("path"), str)
                 and Path(e["path"]).resolve() == target), None)


def _free_name(d: Path, image_name: str | None) -> str:
    stem = Path(image_name).name.split(".")[0] if image_name else "image"
    stem = re.sub(r"[^A-Za-z0-9_-]+", "_", stem).strip("_") or "image"
    name, k = f"{stem}_adapted", 2
    while (d / f"{name}.pt").exists():
        name, k = f"{stem}_adapted_{k}", k + 1
    return name


def _read_index(d: Path) -> list:
    try:
        entries = json.loads((d / INDEX).read_text())
    except (OSError, ValueError):
        return []
    return entries if isinstance(entries, list) else []


def _write_index(d: Path, entries: list) -> None:
    index = d / INDEX
    tmp = index.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(entries, indent=1))
    os.replace(tmp, index)


def _record(d: Path, entry: dict) -> None:
    entries = [e for e in _read_index(d) if not (isinstance(e, dict) and e.get("name") == entry["name"])]
    _write_index(d, entries + [entry])


def forget_adapted(path: str | os.PathLike, folder: str | os.PathLike | None = None) -> dict | None:
    """Take the adapted decoder ``path`` off the user's list (:func:`adapted_models`) and
    delete its file; the entry it had. ``None`` when ``path`` is not on that list: then
    nothing is deleted (only files the list holds are removed, never a checkpoint the user
    browsed to)."""
    d = adapted_dir(folder)
    target = Path(path).resolve()
    entries = _read_index(d)
    gone = _entry_of(entries, target)
    if gone is None:
        return None
    target.unlink(missing_ok=True)  # first: a list whose file is gone already leaves it out
    _write_index(d, [e for e in entries if e is not gone])
    return gone


def adapt_to_objects(images: np.ndarray | Sequence[np.ndarray], labels: np.ndarray | Sequence[np.ndarray],
                     model="nuclei_sam", *, minutes: float = 4.0, image_name: str | None = None,
                     name: str | None = None, folder: str | os.PathLike | None = None,
                     config: SamTuneConfig | None = None, on_event: Callable[[SamTuneEvent], None] | None = None,
                     progress: ProgressFn = None, cancel: CancelToken | None = None, policy=None,
                     cache_dir: str | os.PathLike | None = None) -> AdaptResult:
    """Adapt the decoder of ``model`` (a name, a file or a loaded engine) to the objects
    in ``labels`` (one 2D label image per image; 0 = not annotated) for at most
    ``minutes`` of training (embedding not counted), then save it as ``name`` (default
    ``<image stem>_adapted``, numbered when taken) in :func:`adapted_dir` and record it with
    ``image_name`` in the list :func:`adapted_models` reads. ``on_event`` gets every step
    (live loss), ``cancel`` stops it with nothing saved. ``ValueError`` (one line) when the
    labels hold no object."""
    if isinstance(images, np.ndarray) and images.ndim == 2 or (
            isinstance(images, np.ndarray) and images.ndim == 3 and images.shape[-1] in (3, 4)):
        images, labels = [images], [labels]
    images, labels = list(images), [np.asarray(lab) for lab in labels]
    n_objects = int(sum(len(np.unique(lab[lab > 0])) for lab in labels))
    if n_objects == 0:
        raise ValueError("the labels hold no annotated object to adapt to")
    d = adapted_dir(folder)
    d.mkdir(parents=True, exist_ok=True)
    name = name or _free_name(d, image_name)
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise ValueError(f"adapted model name {name!r}: use letters, digits, '_', '-', '.'")
    cfg = config or few_object_config(n_objects, minutes)
    base = model if isinstance(model, (str, os.PathLike)) else getattr(getattr(model, "info", None), "name", "engine")
    out = d / f"{name}.pt"
    res = finetune_sam(images, labels, model=model, config=cfg, out_path=out, on_event=on_event, progress=progress,
                       cancel=cancel, policy=policy, cache_dir=cache_dir,
                       meta={"adapted": {"image": image_name, "objects": n_objects}})
    steps = res.history[-1]["step"] if res.history else 0
    if res.path is None:
        return AdaptResult(None, None, n_objects, steps, res.seconds, res.stopped, res)
    # which candidate a first click on these objects should keep, measured on them
    if store_click_choice(res.engine, out, images, labels, cancel=cancel) is None:  # cancelled: file gone
        return AdaptResult(None, None, n_objects, steps, res.seconds, "cancelled", res)
    _record(d, {"name": name, "path": str(out), "image": image_name, "base": str(base), "objects": n_objects,
                "steps": steps, "seconds": round(res.seconds, 1),
                "created": time.strftime("%Y-%m-%dT%H:%M:%S")})
    return AdaptResult(str(out), name, n_objects, steps, res.seconds, res.stopped, res)


def is_adapted(model) -> bool:
    """Whether ``model`` (a name, a file or a loaded engine) is a decoder already adapted to
    the user's objects: one in :func:`adapted_models`, or a decoder file saved as adapted
    (``training["adapted"]``: :func:`adapt_to_objects`, the Adapt SAM dock). Registry models
    and other files are not."""
    name = getattr(getattr(model, "info", None), "name", model)  # an engine: the file it came from
    if not isinstance(name, (str, os.PathLike)):
        return False
    path = Path(name)
    try:
        if not path.is_file():
            return False
        path = path.resolve()
        if adapted_entry(path) is not None:
            return True
        return _saved_as_adapted(str(path), path.stat().st_mtime_ns)
    except OSError:
        return False


@functools.lru_cache(maxsize=16)
def _saved_as_adapted(path: str, _stamp: int) -> bool:
    from ....models.registry import read_if_decoder

    try:
        doc = read_if_decoder(path)
    except Exception:  # noqa: BLE001 - a malformed decoder: not one adapted here
        return False
    training = doc.get("training") if doc else None
    return isinstance(training, dict) and training.get("adapted") is not None


def unsure_hint(predicted_iou: float, threshold: float = UNSURE_IOU, adapted: bool = False) -> str | None:
    """The status-line hint for a first mask whose predicted IoU (clamped to [0, 1], as
    shown) is below ``threshold`` (None when the model is confident): the model is unsure, a
    box helps, and so does adapting, unless the model is already ``adapted`` (then a box or
    corrective clicks). Short enough that the annotator's status line keeps its two lines;
    the value is cut, not rounded, to two decimals."""
    if predicted_iou is None or not np.isfinite(predicted_iou):
        return None
    shown = shown_iou(predicted_iou)
    if shown >= threshold:
        return None
    shown = math.floor(round(shown * 100, 6)) / 100  # 0.799 reads 0.79, never the threshold
    if adapted:
        return f"unsure (predicted IoU {shown:.2f}): draw a box, or correct the mask with clicks"
    return f"unsure (predicted IoU {shown:.2f}): draw a box, or adapt SAM to these objects"
