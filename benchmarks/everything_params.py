"""Segment-everything settings for a point-tuned model, chosen on training images, then validated.

"Segment everything" prompts a grid of points and keeps the masks whose predicted IoU and
stability pass two thresholds. The official thresholds (0.88 / 0.95, 32 points per side)
were set for SAM on natural images; a decoder tuned to clicks on nuclei (``nuclei_sam``)
scores its masks differently. This script sweeps points per side x predicted-IoU threshold x
stability threshold (and, for the best few, the tiling) over the 13 training images that
the shipped decoder's last stage held back for early stopping (plus two 320x480 crops of
them, the size where ``tiling="auto"`` shrinks the image into one view), picks the setting
with the highest pooled object F1 at IoU 0.5, and only then runs it once on the validation
data (BBBC039's last 8 fields, ``dsb2018/``, two 320x480 crops of validation fields), beside
the official defaults and the box-model settings.

    python benchmarks/everything_params.py [--precision fp32] [--budget 300] [--json F]
        [--select IMAGE ...]    # default: the 13 held-back training images
    python benchmarks/everything_params.py --pps 16 --iou 0.5 --stab 0.95 --compare-tiling
    python benchmarks/everything_params.py --pps 16 --iou 0.5 --stab 0.95 --tiling tiles --only-validate

Each image's mask is ``../masks/<same name>``. Prints the machine line, one row per setting
(pooled precision, recall, F1 at IoU 0.5 and 0.75, masks, seconds), the choice, and the
validation table.
"""
import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import tifffile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from napari_gpuseg.engine import metrics  # noqa: E402
from napari_gpuseg.engine.runtime.device import make_policy  # noqa: E402
from napari_gpuseg.engine.sam.interactive.cache import EmbeddingCache  # noqa: E402
from napari_gpuseg.engine.sam.automatic.everything import AutomaticParams, segment_everything  # noqa: E402
from napari_gpuseg.engine.sam.loader import load_engine  # noqa: E402

from _data import bbbc039_validation, dsb2018_field  # noqa: E402
from _machine import machine_line  # noqa: E402

CROP = (320, 480)


def _pair(image_path: Path):
    return tifffile.imread(image_path), tifffile.imread(image_path.parent.parent / "masks" / image_path.name)


def _crop(image, gt):
    h, w = CROP
    return image[:h, :w], gt[:h, :w]


def selection_set(paths: list[Path]):
    items = [(p.name, *_pair(p)) for p in paths]
    big = [it for it in items if it[1].shape[0] >= CROP[0] + 100 and it[1].shape[1] >= CROP[1] + 100][:2]
    items += [(f"{name} crop", *_crop(im, gt)) for name, im, gt in big]
    return items


def validation_set():
    items = [(p.name, *_pair(p)) for p, _mask in bbbc039_validation()]
    items.append(("dsb2018", *dsb2018_field()))
    items += [(f"{name} crop", *_crop(im, gt)) for name, im, gt in items[:8:4]]
    return items


def score(engine, items, params: AutomaticParams) -> dict:
    t0 = time.perf_counter()
    gts, preds, n = [], [], 0
    for _name, image, gt in items:
        r = segment_everything(engine, image, params, keep_logits=False)
        gts.append(gt)
        preds.append(r.labels)
        n += len(r)
    s50 = metrics.pooled_stats(gts, preds, 0.5)
    s75 = metrics.pooled_stats(gts, preds, 0.75)
    return {"precision": s50.precision, "recall": s50.recall, "f1": s50.f1, "f1_75": s75.f1,
            "masks": n, "seconds": time.perf_counter() - t0}


def row(label: str, r: dict) -> str:
    return (f"| {label} | {r['precision']:.3f} | {r['recall']:.3f} | **{r['f1']:.3f}** | {r['f1_75']:.3f} "
            f"| {r['masks']} | {r['seconds']:.1f} |")


HEADER = ("| setting | precision | recall | F1@0.5 | F1@0.75 | masks | s |\n"
          "| --- | ---: | ---: | ---: | ---: | ---: | ---: |")


def label(kw: dict) -> str:
    return (f"pps {kw['points_per_side']}, IoU >= {kw['pred_iou_thresh']}, stability >= "
            f"{kw['stability_score_thresh']}, tiling {kw.get('tiling', 'auto')}")


def compare_tiling(engine, sel, args) -> int:
    """One setting in both tilings, where they differ: images no side of which exceeds twice
    the model input go into one shrunk view under "auto", into native tiles under "tiles"."""
    kw = dict(points_per_side=int(args.pps.split(",")[0]), pred_iou_thresh=float(args.iou.split(",")[0]),
              stability_score_thresh=float(args.stab.split(",")[0]), min_mask_region_area=args.min_area)
    small = 2 * engine.input_size
    for title, items in (("selection", sel), ("validation", [] if args.skip_validation else validation_set())):
        items = [it for it in items if max(it[1].shape[:2]) <= small]
        if not items:
            continue
        print(f"\n{title}: {len(items)} images where the tilings differ ({', '.join(n for n, *_ in items)})")
        print(HEADER)
        variants = {label(kw): kw, label(dict(kw, tiling="tiles")): dict(kw, tiling="tiles")}
        if title == "validation":
            variants["official defaults (pps 32, 0.88 / 0.95)"] = {}
        for name, v in variants.items():
            print(row(name, score(engine, items, AutomaticParams(**v))), flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="nuclei_sam")
    ap.add_argument("--precision", default="fp32", help="fp32 (default: what a CPU without fast bf16 runs), bf16, auto")
    ap.add_argument("--device", default=None)
    ap.add_argument("--pps", default="16,32")
    ap.add_argument("--iou", default="0.5,0.7,0.8,0.88")
    ap.add_argument("--stab", default="0,0.8,0.9,0.95")
    ap.add_argument("--min-area", type=int, default=20)
    ap.add_argument("--retile", type=int, default=3, help="the best N settings also run with tiling 'tiles'")
    ap.add_argument("--budget", type=float, default=300.0, help="seconds for the sweep (validation runs after)")
    ap.add_argument("--select", nargs="*", type=Path, default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip-validation", action="store_true")
    ap.add_argument("--tiling", default="auto", help="the sweep's tiling (auto, tiles, crops)")
    ap.add_argument("--only-validate", action="store_true",
                    help="no sweep: the first --pps/--iou/--stab setting (with --tiling) on the validation data")
    ap.add_argument("--compare-tiling", action="store_true",
                    help="no sweep: the first --pps/--iou/--stab setting with tiling 'auto' vs 'tiles' (and the "
                         "official settings) on the images where the two tilings differ (sides <= 2x the input)")
    args = ap.parse_args(argv)

    print(machine_line())
    policy = make_policy(args.device, None if args.precision == "auto" else args.precision)
    engine = load_engine(args.model, policy=policy)
    engine.cache = EmbeddingCache(max_bytes=8 << 30)
    print(f"{args.model} on {policy.device} in {policy.precision}")
    if args.select is None and not args.only_validate:
        from clicks import stage3_held_back

        args.select = [a for a, _b in stage3_held_back()]
    sel = [] if args.only_validate else selection_set(args.select)
    print(f"selection: {len(sel)} images ({', '.join(n for n, *_ in sel)})")

    if args.compare_tiling:
        return compare_tiling(engine, sel, args)
    if args.only_validate:
        kw = dict(points_per_side=int(args.pps.split(",")[0]), pred_iou_thresh=float(args.iou.split(",")[0]),
                  stability_score_thresh=float(args.stab.split(",")[0]), min_mask_region_area=args.min_area,
                  tiling=args.tiling)
        val = validation_set()
        print(f"validation: {len(val)} images ({', '.join(n for n, *_ in val)})")
        print(HEADER)
        print(row(label(kw), score(engine, val, AutomaticParams(**kw))), flush=True)
        return 0
    grid = [dict(points_per_side=int(p), pred_iou_thresh=float(i), stability_score_thresh=float(s),
                 min_mask_region_area=args.min_area, tiling=args.tiling)
            for p, i, s in itertools.product(args.pps.split(","), args.iou.split(","), args.stab.split(","))]
    results = []
    t0 = time.perf_counter()
    print(HEADER)
    for kw in grid:
        if time.perf_counter() - t0 > args.budget:
            print(f"(budget spent: {len(grid) - len(results)} settings not run)")
            break
        r = score(engine, sel, AutomaticParams(**kw))
        results.append((kw, r))
        print(row(label(kw), r), flush=True)
    best = sorted(results, key=lambda kr: -kr[1]["f1"])[: args.retile]
    for kw, _r in best:
        if time.perf_counter() - t0 > args.budget:
            break
        kw2 = dict(kw, tiling="tiles")
        r = score(engine, sel, AutomaticParams(**kw2))
        results.append((kw2, r))
        print(row(label(kw2), r), flush=True)
    chosen, chosen_r = max(results, key=lambda kr: kr[1]["f1"])
    print(f"\nchosen on the selection images: {label(chosen)} (F1@0.5 {chosen_r['f1']:.3f})\n")

    if args.skip_validation:
        return 0
    val = validation_set()
    print(f"validation: {len(val)} images ({', '.join(n for n, *_ in val)})")
    box = dict(AutomaticParams.for_model(True).to_dict())
    variants = {"official defaults (pps 32, 0.88 / 0.95)": {},
                "box-model settings (pps 16, 0.18 / 0, min area 20)": {k: box[k] for k in (
                    "points_per_side", "pred_iou_thresh", "stability_score_thresh", "min_mask_region_area")},
                f"chosen: {label(chosen)}": chosen}
    print(HEADER)
    val_out = {}
    for name, kw in variants.items():
        r = score(engine, val, AutomaticParams(**kw))
        val_out[name] = dict(r, params=kw)
        print(row(name, r), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "machine": machine_line(), "model": args.model, "precision": policy.precision,
            "selection": [dict(r, params=kw) for kw, r in results], "chosen": chosen,
            "validation": val_out}, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
