"""Adapt SAM to a new kind of object: whole cells in transmitted light, from a few annotated ones.

    OMP_NUM_THREADS=2 python benchmarks/adapt_sam_cells.py [--objects 15] [--minutes 4]
        [--model nuclei_sam] [--frame 6] [--cache-dir DIR] [--cap N] [--set lr=1e-3 ...]
        [--measure-frames 7 8 9] [--variant KEY=VALUE,KEY=VALUE ...]

The user's case of issue 60: the ``scratch_assay`` cells (oblique transmitted light; the
decoder under test never saw a cell) of one training frame (``--frame``, t00-t06), of which
``--objects`` whole cells next to each other are annotated (the ones nearest the frame's
left-middle, as a user annotates one region); :func:`engine.sam.training.adapt.adapt_to_objects`
adapts ``--model`` to them (its few-object schedule, ``--minutes`` of training), then every
cell of the validation frames t07-t09 is clicked (``click_ious``: 1 and 3 clicks, a box)
with the starting decoder and the adapted one, in the same run. The wall time printed
includes the embedding of the annotated frame. ``--cache-dir`` keeps the validation
frames' embeddings on disk between runs (the adapted decoder's own embedding cache is
fresh, so its time is what a user waits).

``--variant`` (repeatable) adapts once per variant, each a comma-separated set of schedule
overrides on top of ``--set`` (``base``: none), all measured against the same start in one
run. To choose between variants without looking at the validation frames, annotate one
training frame and measure on others (``--frame 3 --measure-frames 0 1 2``).
"""
import argparse
import sys
import tempfile
import time

import numpy as np
import tifffile
from scipy import ndimage as ndi

from _data import shared_data
from _machine import machine_line
from _overrides import override
from napari_gpuseg.engine import load_engine
from napari_gpuseg.engine.sam.training.adapt import adapt_to_objects, few_object_config
from napari_gpuseg.engine.sam.interactive.cache import EmbeddingCache
from napari_gpuseg.engine.sam.training.click_eval import click_ious


def annotated(lab: np.ndarray, n: int) -> np.ndarray:
    """The ``n`` cells (at least 60 px, not cut by the border) whose centres lie nearest the
    point a quarter across the frame, halfway down: one annotated region; the rest is 0."""
    ids = [i for i in np.unique(lab) if i]
    sl = ndi.find_objects(lab)
    h, w = lab.shape
    keep = []
    for i in ids:
        s = sl[i - 1]
        if s is None or s[0].start == 0 or s[1].start == 0 or s[0].stop == h or s[1].stop == w:
            continue
        if np.count_nonzero(lab[s] == i) < 60:
            continue
        cy, cx = ndi.center_of_mass(lab[s] == i)
        keep.append((np.hypot(cy + s[0].start - h / 2, cx + s[1].start - w / 4), i))
    chosen = [i for _, i in sorted(keep)[:n]]
    return np.where(np.isin(lab, chosen), lab, 0)


def row(name, r) -> str:
    c = r["clicks"]
    return (f"| {name} | {r['n']} | {c[:, 0].mean():.3f} | {c[:, min(2, c.shape[1] - 1)].mean():.3f} | "
            f"{r['box'].mean():.3f} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--objects", type=int, default=15)
    ap.add_argument("--minutes", type=float, default=4.0, help="training time (embedding not counted)")
    ap.add_argument("--model", default="nuclei_sam")
    ap.add_argument("--frame", type=int, default=6, help="training frame annotated (0-6)")
    ap.add_argument("--cache-dir", default=None, help="embedding cache of the validation frames")
    ap.add_argument("--cap", type=int, default=None, help="at most N cells measured per frame (seed 0; default: all)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a field of the few-object schedule, e.g. lr=1e-3")
    ap.add_argument("--measure-frames", type=int, nargs="+", default=[7, 8, 9],
                    help="frames whose cells are clicked (default: the validation frames 7 8 9)")
    ap.add_argument("--variant", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                    help="adapt once more with these overrides (on top of --set); 'base': none")
    args = ap.parse_args(argv)
    if not 0 <= args.frame <= 6:
        raise SystemExit("--frame must be a training frame, 0-6")
    if args.frame in args.measure_frames or not all(0 <= t <= 9 for t in args.measure_frames):
        raise SystemExit("--measure-frames: frames 0-9, not the annotated --frame")
    print(machine_line(), flush=True)
    d = shared_data() / "scratch_assay" / "cells"
    img = tifffile.imread(d / "images" / f"t{args.frame:02d}.tif")
    ann = annotated(tifffile.imread(d / "masks" / f"t{args.frame:02d}.tif"), args.objects)
    val = [(tifffile.imread(d / "images" / f"t{t:02d}.tif"), tifffile.imread(d / "masks" / f"t{t:02d}.tif"))
           for t in args.measure_frames]
    frames = ", ".join(f"t{t:02d}" for t in args.measure_frames)
    sizes = np.bincount(ann.ravel())[1:]
    print(f"annotated: {len(np.unique(ann)) - 1} cells of t{args.frame:02d} "
          f"(median {np.median(sizes[sizes > 0]):.0f} px); measured: cells of {frames}"
          + (f" (at most {args.cap} per frame)" if args.cap else " (every one)"), flush=True)

    cache = EmbeddingCache(max_bytes=2 << 30, disk_dir=args.cache_dir)

    def measure(engine):
        rs = [click_ious(engine, im, lab, clicks=3, max_objects=args.cap) for im, lab in val]
        return {"clicks": np.concatenate([r["clicks"] for r in rs]), "box": np.concatenate([r["box"] for r in rs]),
                "n": sum(r["n"] for r in rs)}

    start = load_engine(args.model, cache=cache)
    before = measure(start)
    print(row(f"start ({args.model})", before), flush=True)
    rows = []
    for variant in args.variant or ["base"]:
        extra = [] if variant == "base" else variant.split(",")
        cfg = override(few_object_config(args.objects, args.minutes), args.set + extra)
        if args.set or extra:
            print("schedule overrides:", ", ".join(args.set + extra), flush=True)
        folder = tempfile.mkdtemp()
        t0 = time.perf_counter()
        fresh = load_engine(args.model, cache=EmbeddingCache(max_bytes=2 << 30))  # embedding is part of the wait
        res = adapt_to_objects(img, ann, model=fresh, image_name=f"t{args.frame:02d}.tif", folder=folder, config=cfg)
        wall = time.perf_counter() - t0
        adapted = load_engine(res.path, cache=cache)
        after = measure(adapted)
        print(f"adapted ({variant}): {res.objects} objects, {res.steps} steps, {res.seconds:.0f} s training, "
              f"{wall:.0f} s wall (embedding included); first clicks: click_output {adapted.click_output}, "
              f"click_blend {adapted.click_blend} (measured on the annotated cells)", flush=True)
        print(row(f"adapted {variant} ({res.objects} cells, {wall / 60:.1f} min)", after), flush=True)
        rows.append((variant, res, wall, after))
    print()
    print("| decoder | cells | 1 click | 3 clicks | box |")
    print("| --- | ---: | ---: | ---: | ---: |")
    print(row(f"start ({args.model})", before))
    for variant, res, wall, after in rows:
        print(row(f"adapted {variant} ({res.objects} cells, {wall / 60:.1f} min)", after))
    for variant, _res, _wall, after in rows:
        gain = after["clicks"][:, 0].mean() - before["clicks"][:, 0].mean()
        print(f"1-click gain ({variant}) {gain:+.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
