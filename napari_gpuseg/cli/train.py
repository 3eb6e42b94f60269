"""``napari-gpuseg train``: the command-line twin of the U-Net training dock.

    napari-gpuseg train --images DIR --labels DIR --out model.pt [--limit 16] [options]

Several data sets: repeat ``--images DIR --labels DIR``; ``--limit``, ``--skip`` and
``--weight`` then go once (for every folder) or once per folder, in the same order
(``--limit all`` takes every pair). ``--weight`` sets each folder's share of the training
crops (default: by pixel count). Colour images (RGB/RGBA) become one channel by the same
conversion as prediction (``engine.normalize.model_input``).
Image and label files are paired by file name (labels may carry a ``_mask``, ``_masks``,
``_label`` or ``_labels`` suffix). ``--eval-images/--eval-labels`` measure the final
model on held-out pairs after training (never used for model selection) and store the
numbers in the checkpoint.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..engine.runtime.allocator import configure_allocator
from ..engine.runtime.device import PRECISIONS

_SUFFIXES = ("_masks", "_mask", "_labels", "_label", "_gt")


def _key(path: Path) -> str:
    stem = path.name.split(".")[0]
    for suffix in _SUFFIXES:
        if stem.lower().endswith(suffix):
            return stem[: -len(suffix)]
    return stem


class TrainInputError(ValueError):
    """A user error in the ``train`` arguments or data: printed as one line, exit 2."""


def _scan(folder, pattern, what: str) -> list[Path]:
    from ..io import scan_folder

    if not Path(folder).is_dir():
        raise TrainInputError(f"{what} folder not found: {folder}")
    return scan_folder(folder, pattern)


def find_pairs(images_dir, labels_dir, pattern: str = "*.tif*,*.png,*.npy", limit: int | None = None,
               skip: int = 0) -> list[tuple[Path, Path]]:
    """(image, labels) paths matched by name, sorted by image name; ``skip`` then ``limit``."""
    images = _scan(images_dir, pattern, "images")
    labels = {_key(p): p for p in _scan(labels_dir, pattern, "labels")}
    pairs = [(p, labels[_key(p)]) for p in images if _key(p) in labels]
    if not pairs:
        raise TrainInputError(f"no image/label pairs matched between {images_dir} and {labels_dir}")
    pairs = pairs[skip:]
    if not pairs:
        raise TrainInputError(f"--skip {skip} leaves no image/label pairs")
    return pairs[:limit] if limit else pairs


def _read_pairs(pairs):
    """Images (gray: colour through the shared conversion's luminance) and labels; a file
    that cannot be read or a pair whose shapes differ raises :class:`TrainInputError`
    naming the file(s)."""
    from ..engine.normalize import is_color, to_gray
    from ..io import ImageReadError, read_image
    from ..io.label_files import read_labels

    images, labels = [], []
    for a, b in pairs:
        try:
            img = read_image(a)
            img = to_gray(img) if is_color(img) else img
        except ImageReadError as exc:
            raise TrainInputError(f"image {a}: {exc.message}") from exc
        try:
            lab = read_labels(b)
        except Exception as exc:  # noqa: BLE001 - tifffile/numpy errors of a bad file
            raise TrainInputError(f"labels {b}: cannot read ({type(exc).__name__}: "
                                  f"{str(exc).splitlines()[0][:200] if str(exc) else 'no detail'})") from exc
        if lab.dtype.kind not in "uib":
            raise TrainInputError(f"labels {b}: dtype {lab.dtype} is not an integer label image")
        if img.shape != lab.shape:
            raise TrainInputError(f"image {a.name} {tuple(img.shape)} and labels {b.name} "
                                  f"{tuple(lab.shape)} differ in shape")
        images.append(img)
        labels.append(lab)
    return images, labels


def add_train_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("train", help="train a U-Net on image/label folders",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", required=True, action="append", help="folder of images (repeatable)")
    p.add_argument("--labels", required=True, action="append",
                   help="folder of instance label images (one per --images)")
    p.add_argument("--out", required=True, help="checkpoint to write (best epoch)")
    p.add_argument("--pattern", default="*.tif*,*.png,*.npy", help="file name globs (comma-separated)")
    p.add_argument("--limit", type=_count, action="append",
                   help="use only the first N pairs (sorted) of a folder; 'all' for every pair")
    p.add_argument("--skip", type=int, action="append", help="skip the first N pairs (sorted) of a folder")
    p.add_argument("--weight", type=float, action="append",
                   help="a folder's relative share of the training crops")
    p.add_argument("--scale-aug", type=float, nargs=2, metavar=("LOW", "HIGH"), default=None,
                   help="random zoom of training crops, e.g. 0.5 2")
    p.add_argument("--strong-intensity", action="store_true",
                   help="gamma, blur and noise augmentation besides the scale/shift jitter")
    p.add_argument("--eval-images", help="held-out images to report metrics on after training")
    p.add_argument("--eval-labels", help="labels of the held-out images")
    p.add_argument("--eval-skip", type=int, default=0, help="skip the first N held-out pairs")
    p.add_argument("--spatial-dims", type=int, choices=(2, 3), default=2)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--base", type=int, default=16)
    p.add_argument("--norm", default="batch", choices=("batch", "instance", "group", "none"))
    p.add_argument("--crop", type=int, default=128, help="crop edge length")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--iters-per-epoch", type=int, default=50)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--val-fraction", type=float, default=0.15)
    p.add_argument("--patience", type=int, default=10, help="epochs without improvement before stopping")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=None, help="DataLoader workers (default: auto)")
    p.add_argument("--compile", action="store_true", help="torch.compile the network")
    p.add_argument("--grad-checkpointing", action="store_true", help="save memory on large 3D crops")
    p.add_argument("--max-time", type=float, default=None, help="stop after this many seconds")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, mps")
    p.add_argument("--precision", default="auto", choices=PRECISIONS)
    return p


def _config(args):
    from ..engine.unet.training import TrainConfig
    from ..models.unet import UNetConfig

    model = UNetConfig(spatial_dims=args.spatial_dims, depth=args.depth, base=args.base, norm=args.norm)
    return TrainConfig(
        model=model.to_dict(), crop_size=args.crop, scale_range=tuple(args.scale_aug) if args.scale_aug else None,
        strong_intensity=args.strong_intensity, batch_size=args.batch_size, epochs=args.epochs,
        iters_per_epoch=args.iters_per_epoch, lr=args.lr, weight_decay=args.weight_decay,
        val_fraction=args.val_fraction, patience=args.patience, seed=args.seed,
        num_workers=args.workers, compile=args.compile, gradient_checkpointing=args.grad_checkpointing,
        max_time_s=args.max_time,
    )


# TrainConfig field -> the option that sets it, for one-line error messages
_FLAGS = {"crop_size": "--crop", "batch_size": "--batch-size", "epochs": "--epochs",
          "iters_per_epoch": "--iters-per-epoch", "lr": "--lr", "weight_decay": "--weight-decay",
          "val_fraction": "--val-fraction", "patience": "--patience", "num_workers": "--workers",
          "max_time_s": "--max-time", "scale_range": "--scale-aug"}


def _count(text: str) -> int | None:
    """``--limit`` value: a positive integer, or ``all`` (None)."""
    if text.strip().lower() == "all":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'all', got {text!r}") from None


def _per_folder(args, name: str, default):
    """``args.<name>`` as one value per ``--images`` folder (given once = for every folder)."""
    values, n = getattr(args, name), len(args.images)
    if not values:
        return [default] * n
    if len(values) == 1:
        return values * n
    if len(values) != n:
        raise TrainInputError(f"--{name} given {len(values)} times for {n} --images folders "
                              "(give it once, or once per folder)")
    return list(values)


def folder_sets(args) -> list[dict]:
    """One dict per data folder: images, labels, limit, skip, weight."""
    if len(args.images) != len(args.labels):
        raise TrainInputError(f"{len(args.images)} --images but {len(args.labels)} --labels folders")
    rows = zip(args.images, args.labels, _per_folder(args, "limit", None), _per_folder(args, "skip", 0),
               _per_folder(args, "weight", None))
    return [dict(images=i, labels=lab, limit=n, skip=k, weight=w) for i, lab, n, k, w in rows]


def _fail(message: str) -> int:
    print(f"napari-gpuseg train: error: {message}", file=sys.stderr, flush=True)
    return 2


def _check_inputs(args):
    """Everything that can be checked before training: options, output path, data.
    Returns (config, pairs, images, labels); raises TrainInputError / OSError."""
    from ..engine.unet.training import TrainConfigError, check_output_path

    checks = [("--limit", v, 1) for v in args.limit or []] + [("--skip", v, 0) for v in args.skip or []]
    checks += [("--eval-skip", args.eval_skip, 0), ("--depth", args.depth, 1), ("--base", args.base, 1)]
    for flag, value, low in checks:
        if value is not None and value < low:
            raise TrainInputError(f"{flag} must be >= {low}, got {value}")
    for w in args.weight or []:
        if not (w > 0 and w < float("inf")):
            raise TrainInputError(f"--weight must be a positive number, got {w}")
    sets = folder_sets(args)
    if bool(args.eval_images) != bool(args.eval_labels):
        raise TrainInputError("--eval-images and --eval-labels go together")
    config = _config(args)
    try:
        config.check()
    except TrainConfigError as exc:
        flag = _FLAGS.get(exc.name, exc.name)
        raise TrainInputError(str(exc).replace(exc.name, flag, 1)) from exc
    check_output_path(args.out)
    pairs, weights = [], []
    for fs in sets:
        found = find_pairs(fs["images"], fs["labels"], args.pattern, fs["limit"], fs["skip"])
        pairs += found
        weights.append((len(found), fs["weight"]))
    images, labels = _read_pairs(pairs)
    sample_weights = _sample_weights(weights, images)
    flat = [im for im in images if im.ndim < args.spatial_dims]
    if flat:
        raise TrainInputError(f"--spatial-dims {args.spatial_dims} needs ZYX volumes, "
                              f"got an image of shape {tuple(flat[0].shape)}")
    if not any(int(lab.max()) > 0 for lab in labels):
        raise TrainInputError("the labels contain no objects to learn from")
    if args.eval_images:  # checked now, not after hours of training
        _read_pairs(find_pairs(args.eval_images, args.eval_labels, args.pattern, skip=args.eval_skip))
    return config, pairs, images, labels, sample_weights


def _sample_weights(counts_weights, images):
    """Per-image crop weights: a folder's ``--weight`` shared by its images in proportion to
    their pixel counts; None (by pixel count overall) when no folder has a weight."""
    if all(w is None for _, w in counts_weights):
        return None
    out, start = [], 0
    for n, w in counts_weights:
        sizes = [float(images[i].size) for i in range(start, start + n)]
        out += [(1.0 if w is None else w) * s / sum(sizes) for s in sizes]
        start += n
    return out


def run_train(args) -> int:
    configure_allocator()
    import torch

    from ..engine.runtime.device import make_policy
    from ..engine.unet.training import train_unet

    try:
        config, pairs, images, labels, sample_weights = _check_inputs(args)
        policy = make_policy(args.device, args.precision)
    except (TrainInputError, OSError, ValueError) as exc:
        return _fail(str(exc))
    print(f"training on {len(pairs)} pairs ({pairs[0][0].name} .. {pairs[-1][0].name}), "
          f"{policy.describe()}, torch {torch.__version__}", flush=True)
    t0 = time.perf_counter()

    def on_event(ev) -> None:
        if ev.kind == "epoch":
            val = "" if ev.val_score is None else (
                f" val F1@0.5 {ev.val_f1:.4f} fg IoU {ev.val_fg_iou:.4f} best {ev.best_score:.4f}")
            print(f"epoch {ev.epoch + 1:3d} it {ev.iteration:5d}/{ev.total_iterations} loss {ev.train_loss:.4f}"
                  f"{val} lr {ev.lr:.2e} [{time.perf_counter() - t0:.0f} s]", flush=True)

    several = len(args.images) > 1  # then names carry their data set (the folder above images/)
    summary = {"train_files": [f"{a.parent.parent.name}/{a.name}" if several else a.name for a, _ in pairs], "command": " ".join(["napari-gpuseg"] + sys.argv[1:])}
    result = train_unet(images, labels, config, out_path=args.out, policy=policy, on_event=on_event,
                        data_summary=summary, sample_weights=sample_weights)
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr, flush=True)
    if not result.checkpoint:
        print("napari-gpuseg train: error: no checkpoint was written", file=sys.stderr, flush=True)
        return 1
    print(f"done: {result.stopped} after {result.seconds:.0f} s, best epoch {result.best_epoch + 1}, "
          f"checkpoint {result.checkpoint}", flush=True)
    if args.eval_images and args.eval_labels and result.checkpoint:
        _evaluate(args, result.checkpoint, policy)
    return 0


def _evaluate(args, checkpoint, policy) -> dict:
    """Metrics of the saved model on held-out pairs, stored in the checkpoint as ``test``."""
    import torch

    from ..engine import metrics
    from ..engine.classical import classical_segment
    from ..engine.unet.unet_checkpoint import load_checkpoint, load_unet, plain
    from ..engine.unet.predict import predict_labels

    pairs = find_pairs(args.eval_images, args.eval_labels, args.pattern, skip=args.eval_skip)
    images, truth = _read_pairs(pairs)
    loaded = load_unet(checkpoint, policy.device)
    preds = [predict_labels(loaded, im, policy=policy) for im in images]
    base = [classical_segment(im) for im in images]
    ours, classic = metrics.summary(truth, preds), metrics.summary(truth, base)
    for name, m in (("U-Net", ours), ("classical", classic)):
        print(f"{name:9s} on {len(pairs)} held-out: F1@0.5 {m['f1@0.5']:.4f} F1@0.75 {m['f1@0.75']:.4f} "
              f"fg IoU {m['foreground_iou']:.4f}", flush=True)
    ckpt = load_checkpoint(checkpoint)
    ckpt["test"] = plain({"files": [a.name for a, _ in pairs], "unet": ours, "classical_baseline": classic,
                    "precision": policy.precision})
    tmp = Path(str(checkpoint) + ".tmp")
    try:  # never rewrite the trained checkpoint in place: a failed write would destroy it
        torch.save(ckpt, tmp)
        tmp.replace(checkpoint)
    except (OSError, RuntimeError) as exc:
        tmp.unlink(missing_ok=True)
        print(f"note: held-out metrics not stored in {checkpoint} ({type(exc).__name__}: "
              f"{str(exc).splitlines()[0][:200] if str(exc) else ''}); the checkpoint is unchanged",
              file=sys.stderr, flush=True)
    return ours
