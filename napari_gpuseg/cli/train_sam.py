"""``napari-gpuseg train-sam``: fine-tune a SAM decoder on folders of images and labels.

    napari-gpuseg train-sam --images DIR --labels DIR --out decoder.pt [options]

``--images/--labels`` may be given several times (one pair of folders each; ``--limit``
then takes one number per pair, 0 = all). Files are paired by name as ``train`` pairs them.
The image encoder stays frozen: each training view is embedded once (cached on disk under
the model cache folder, so a rerun skips the encoder), then the prompt encoder and mask
decoder learn from simulated clicks and boxes. ``--encoder-lr`` also trains a TinyViT
encoder's last stage and neck (the views then keep the output of the stages before it). Last, one click on up to ``--choose-output``
objects of each image measures which candidate mask a first click keeps (as Adapt SAM does).
The output is a small decoder checkpoint that every dock and ``load_engine(path)`` open
like a model. Errors are one line, exit 2.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..engine.runtime.allocator import configure_allocator
from ..engine.runtime.device import PRECISIONS
from .train import TrainInputError, find_pairs


def add_train_sam_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("train-sam", help="fine-tune a SAM decoder on labelled images",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", action="append", required=True, help="folder of images (repeatable)")
    p.add_argument("--labels", action="append", required=True, help="folder of instance labels (repeatable)")
    p.add_argument("--limit", action="append", type=int, default=None,
                   help="first N pairs of each folder pair, sorted by name (0 = all)")
    p.add_argument("--out", required=True, help="decoder checkpoint to write (.pt)")
    p.add_argument("--model", default="nuclei_sam", help="model whose decoder is tuned (name or file)")
    p.add_argument("--max-steps", type=int, default=300)
    p.add_argument("--max-time", type=float, default=None, help="seconds of training (embedding excluded)")
    p.add_argument("--views-per-image", action="append", type=int, default=None,
                   help="views embedded per image, at random (0 = every view; one number, or one per folder pair)")
    p.add_argument("--zoom", action="append", type=float, default=None,
                   help="scale of training views: 1 = native tiles, 1.5 = tiles 1/1.5 of the model "
                        "input upscaled to it (repeatable; default: 1 and the scale the model "
                        "decodes clicks at)")
    p.add_argument("--click-zoom", type=float, default=None,
                   help="scale the saved model decodes clicks at (default: the starting model's)")
    p.add_argument("--polarity", action="append", default=None,
                   choices=("as-is", "both", "invert", "random"),
                   help="pictures of each image to train on: as-is, invert (dark and light swapped), both "
                        "(twice the views), random (one of the two per image); one, or one per folder pair")
    p.add_argument("--contrast-jitter", type=float, default=1.0,
                   help="G > 1: each embedded picture gets a random gamma in [1/G, G] (default 1: off)")
    p.add_argument("--orientations", type=int, default=1,
                   help="each picture in N of its 8 quarter turns and mirrors, as it is and N-1 at "
                        "random (N times the views; default 1: as it is)")
    p.add_argument("--views-per-step", type=int, default=4)
    p.add_argument("--objects-per-view", type=int, default=6)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--encoder-lr", type=float, default=0.0,
                   help="also train the image encoder's last stage and neck at this learning rate "
                        "(TinyViT encoders: LiteMedSAM, MobileSAM); the checkpoint then carries them "
                        "(about 6 MB more). Default 0: the encoder stays frozen")
    p.add_argument("--encoder-stages", type=int, default=1,
                   help="with --encoder-lr: how many of the encoder's last stages train (1-3; default 1, "
                        "the last; 2 adds LiteMedSAM's third stage, about 4 MB more in the file)")
    p.add_argument("--box-fraction", type=float, default=0.3)
    p.add_argument("--corrections", type=int, default=2)
    p.add_argument("--first-candidates", default="multi", choices=("multi", "all"),
                   help="a first click's masks in training: multi = the three multimask outputs, "
                        "all = the single-mask output as well (as the annotator picks)")
    p.add_argument("--first-output", default="best", choices=("best", "measured", "0", "1", "2", "3"),
                   help="the candidate a first click's mask loss trains: best = whichever fits (SAM's rule), "
                        "measured = the one the starting model's first clicks keep (measured on the training "
                        "objects when it names none), 0-3 = that candidate (0 the single-mask output, "
                        "which needs --first-candidates all)")
    p.add_argument("--choose-output", type=int, default=15, metavar="N",
                   help="after training, click N objects of each image once (seed 0) to measure which "
                        "candidate mask a first click keeps, and store it with the decoder, as Adapt SAM "
                        "does (default 15; 0: keep the IoU head's choice)")
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--val-objects", type=int, default=96)
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--patience", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache", default=None, help="embedding cache folder (default: under the model cache)")
    p.add_argument("--device", default="auto")
    p.add_argument("--precision", default="auto", choices=PRECISIONS)
    p.add_argument("--quiet", action="store_true")
    return p


def _read(pairs):
    from ..engine.sam.training.train_views import check_pair
    from ..io import ImageReadError, read_image
    from ..io.label_files import read_labels

    images, labels = [], []
    for a, b in pairs:
        try:
            img = read_image(a)
        except ImageReadError as exc:
            raise TrainInputError(f"image {a}: {exc.message}") from exc
        try:
            lab = read_labels(b)
        except Exception as exc:  # noqa: BLE001 - tifffile/numpy errors of a bad file
            raise TrainInputError(f"labels {b}: cannot read ({type(exc).__name__})") from exc
        if img.ndim == 3 and img.shape[-1] not in (3, 4) or img.ndim not in (2, 3):
            raise TrainInputError(f"image {a.name}: shape {img.shape} is not a 2D gray or RGB image")
        if img.shape[:2] != lab.shape:
            raise TrainInputError(f"image {a.name} {tuple(img.shape)} and labels {b.name} "
                                  f"{tuple(lab.shape)} differ in shape")
        try:
            check_pair(img, lab, f"labels {b.name}")
        except ValueError as exc:
            raise TrainInputError(str(exc)) from exc
        images.append(img)
        labels.append(lab)
    if not any(lab.any() for lab in labels):
        raise TrainInputError("the labels contain no objects to learn from")
    return images, labels


def collect_pairs(args) -> list:
    if len(args.images) != len(args.labels):
        raise TrainInputError(f"{len(args.images)} --images but {len(args.labels)} --labels folders")
    limits = args.limit or [0]
    if len(limits) == 1:
        limits = limits * len(args.images)
    if len(limits) != len(args.images):
        raise TrainInputError(f"--limit: give one number, or one per --images folder ({len(args.images)})")
    views = args.views_per_image or [4]
    if len(views) == 1:
        views = views * len(args.images)
    if len(views) != len(args.images) or min(views) < 0:
        raise TrainInputError("--views-per-image: give one number >= 0, or one per --images folder")
    pols = getattr(args, "polarity", None) or ["as-is"]
    if len(pols) == 1:
        pols = pols * len(args.images)
    if len(pols) != len(args.images):
        raise TrainInputError(f"--polarity: give one value, or one per --images folder ({len(args.images)})")
    pairs, per_image, per_pol = [], [], []
    for img_dir, lab_dir, lim, nv, pol in zip(args.images, args.labels, limits, views, pols):
        if lim < 0:
            raise TrainInputError(f"--limit must be >= 0, got {lim}")
        found = find_pairs(img_dir, lab_dir, limit=lim or None)
        pairs += found
        per_image += [nv or None] * len(found)
        per_pol += [pol] * len(found)
    args.per_image_views = per_image
    args.per_image_polarity = per_pol
    return pairs


def result_line(result) -> str:
    """The run's last line: how it stopped, the best held-back score and its step, the score
    the starting model had on the same objects (when held-back objects were scored), the file."""
    start = next((h for h in result.history if h.get("step") == 0 and "val_score" in h), None)
    return (f"{result.stopped}: best validation score {result.best_score} at step {result.best_step}"
            + (f" (at the start: {start['val_score']})" if start else "") + f"; saved {result.path}")


def config_from(args):
    from ..engine.sam.training.tune_config import SamTuneConfig

    cfg = SamTuneConfig(max_steps=args.max_steps, views_per_step=args.views_per_step,
                        objects_per_view=args.objects_per_view, lr=args.lr, encoder_lr=args.encoder_lr,
                        box_fraction=args.box_fraction,
                        corrections=args.corrections, first_candidates=args.first_candidates,
                        first_output=_first_output(getattr(args, "first_output", "best")),
                        views_per_image=None,
                        val_fraction=args.val_fraction, val_objects=args.val_objects,
                        eval_every=args.eval_every, patience=args.patience, max_time=args.max_time,
                        seed=args.seed, contrast_jitter=getattr(args, "contrast_jitter", 1.0),
                        orientations=getattr(args, "orientations", 1),
                        encoder_stages=getattr(args, "encoder_stages", 1),
                        view_zooms=tuple(args.zoom) if args.zoom else None, click_zoom=args.click_zoom)
    try:
        cfg.check()
    except ValueError as exc:
        raise TrainInputError("--" + str(exc).replace("_", "-", 2)) from exc
    return cfg


def _first_output(value: str) -> int | str | None:
    """``--first-output`` as ``SamTuneConfig.first_output``."""
    return None if value == "best" else value if value == "measured" else int(value)


def run_train_sam(args) -> int:
    configure_allocator()
    from ..engine.runtime.device import make_policy
    from ..engine.sam.training.finetune import TuneInterrupted, finetune_sam
    from ..engine.unet.train_output import check_output_path
    from ..models.registry import cache_dir

    def say(text: str) -> None:
        if not args.quiet:
            print(text, flush=True)

    try:
        cfg = config_from(args)
        if args.choose_output < 0:
            raise TrainInputError(f"--choose-output must be >= 0, got {args.choose_output}")
        out = Path(args.out)
        if out.exists() and out.is_dir():
            raise TrainInputError(f"--out {out} is a folder; give a file name such as decoder.pt")
        check_output_path(out)  # a read-only folder fails now, not after the training
        pairs = collect_pairs(args)
        cfg.views_per_image = args.per_image_views
        cfg.polarity = (args.per_image_polarity[0] if len(set(args.per_image_polarity)) == 1
                        else args.per_image_polarity)
        images, labels = _read(pairs)
        policy = make_policy(args.device, args.precision)
        cache = Path(args.cache) if args.cache else cache_dir() / "embeddings"
        say(f"{len(pairs)} image/label pairs; model {args.model}; {policy.describe()}")
        t0 = time.perf_counter()

        def progress(done, total):
            say(f"embedded {done}/{total} images ({time.perf_counter() - t0:.0f} s)")

        def on_event(ev):
            text = f"step {ev.step}/{ev.total} loss {ev.loss:.4f} ({ev.seconds:.0f} s)"
            if ev.val:
                text += (f" | val 1 click {ev.val['iou_1click']:.3f}, 3 clicks {ev.val['iou_3click']:.3f}, "
                         f"box {ev.val['iou_box']:.3f}")
            say(text)

        data = {"pairs": [[str(a), str(b)] for a, b in pairs]}
        result = finetune_sam(images, labels, model=args.model, config=cfg, out_path=out, on_event=on_event,
                              progress=progress, policy=policy, cache_dir=cache, meta={"data": data})
    except TuneInterrupted as exc:
        r = exc.result
        saved = (f"best decoder so far (validation score {r.best_score:.3f} at step {r.best_step}) saved to {r.path}"
                 if r.path and r.best_score is not None else
                 f"decoder saved to {r.path}" if r.path else "nothing saved")
        print(f"napari-gpuseg train-sam: interrupted; {saved}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("napari-gpuseg train-sam: interrupted before training; nothing saved", file=sys.stderr)
        return 130
    except (TrainInputError, OSError, ValueError, RuntimeError) as exc:
        print(f"napari-gpuseg train-sam: {exc}", file=sys.stderr)
        return 2
    say(result_line(result))
    if not args.choose_output or result.path is None:
        return 0
    from ..engine.sam.training.click_choice import store_click_choice

    say(f"measuring which candidate a first click keeps on up to {args.choose_output} objects per image")
    try:
        choice = store_click_choice(result.engine, result.path, images, labels, per_image=args.choose_output)
    except KeyboardInterrupt:
        print(f"napari-gpuseg train-sam: interrupted while measuring the first-click choice; decoder saved to "
              f"{result.path} (a first click keeps the IoU head's choice)", file=sys.stderr)
        return 130
    except (OSError, RuntimeError) as exc:
        print(f"napari-gpuseg train-sam: first-click choice not measured ({exc}); decoder saved to {result.path}",
              file=sys.stderr)
        return 2
    if choice is not None:
        ious = ", ".join(f"{k} {v:.3f}" for k, v in choice.ious.items())
        kept = "the IoU head's choice" if choice.output is None else f"candidate {choice.output}"
        say(f"a first click keeps {kept} (one click on {choice.objects} objects, mean IoU: {ious})")
    return 0
