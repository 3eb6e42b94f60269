"""Iterative prompting: mean IoU per object after 1, 3 and 5 clicks and with a box.

    python benchmarks/clicks.py [--models nuclei_sam decoder.pt] [--per-field 20] [--json out.json]
                                [--cache-dir DIR] [--compare-carry] [--native-clicks]
                                [--data cells bbbc039 dsb2018 scratch-nuclei heldback training]
                                [--precisions auto fp32]

Validation data no model here trained on: the whole cells of the ``scratch_assay``
validation frames t07-t09 (transmitted light, every object), the last 8 BBBC039 fields
(``--per-field`` objects drawn per field, seed 0) and the DSB2018 field in
``shared/data/dsb2018`` (every object); ``scratch-nuclei`` adds the nuclei of t07-t09.
``--models`` takes registry names and decoder files alike, so an old and a new decoder
are measured on the same objects in one run (``--cap N``: at most N objects per
``scratch_assay`` frame and of ``dsb2018/``; ``--fields N``: the first N BBBC039 validation
fields; for a quick look on a busy CPU). Every model runs through an
``AnnotationSession``, as the SAM annotator dock does (``engine.annotate.session_clicks.
session_click_ious``): a first click at the object's most interior pixel (``click``: the
best of the multimask outputs), corrective clicks at the most interior pixel of the larger
error (``click``, ``positive=False`` in a false part: the session refines the shown mask,
its logits as mask input), and a tight box on its own (``box``). ``--direct`` asks the
engine itself instead (``engine.sam.training.click_eval.click_ious``: every object's prompts of a
round in one ``predict`` call), the rule before, for comparison.
The models share one embedding cache (they share LiteMedSAM's encoder); ``--cache-dir``
keeps the embeddings on disk, so a rerun (another decoder file, say) skips the encoder.
``--data heldback`` measures instead the 13 training images the shipped decoder's last stage
held back for early stopping (``scripts/build_nuclei_sam.sh``, stage 3: the same image list
and seed): data for choosing a decoding rule without looking at the validation objects.
``--compare-carry`` runs each model that decodes clicks at a finer scale a second time with
its corrective clicks kept in the view their mask input was decoded in (the rule before
``SamEngine`` carried them into the click view), as the baseline in the same run.
``--native-clicks`` runs each model that decodes clicks at a finer scale a second time with
its clicks decoded in their native views only (``click_zoom`` 1). ``--data training`` measures
the training objects ``scripts/calibrate_iou_head.py`` chooses a decoder's rules on (the
cells of t00-t06, 15 per frame; the first 16 BBBC039 fields, 6 per field; the
``dsb2018_more`` fields, 3 per field), one row per kind: a rule is chosen there, then checked
on the validation data above.
``--precisions fp32 bf16`` runs every model at each precision in one run (``auto``, the default,
is the policy's choice for the machine: bf16 on a CPU with fast bf16, fp32 on other CPUs).
"""
import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import tifffile
import torch

from _data import bbbc039_validation, shared_data
from _machine import cpu_flags, cpu_name
from napari_gpuseg.engine import AnnotationSession, load_engine, make_policy
from napari_gpuseg.engine.annotate.session_clicks import session_click_ious
from napari_gpuseg.engine.sam.interactive.cache import EmbeddingCache
from napari_gpuseg.engine.sam.training.click_eval import click_ious


def stage3_held_back() -> list[tuple]:
    """(image path, mask path) of the images stage 3 of ``scripts/build_nuclei_sam.sh`` held
    back: its image list (bbbc039_more, the first 16 of bbbc039, dsb2018_more; sorted) split
    as ``finetune_sam`` splits it with the stage's ``--val-fraction 0.08 --seed 2``."""
    from napari_gpuseg.engine.sam.training.finetune import _split
    from napari_gpuseg.engine.sam.training.tune_config import SamTuneConfig

    data = shared_data()
    files = [*sorted((data / "bbbc039_more" / "images").glob("*.tif")),
             *sorted((data / "bbbc039" / "images").glob("*.tif"))[:16],
             *sorted((data / "dsb2018_more" / "images").glob("*.tif"))]
    _train, held = _split(len(files), SamTuneConfig(val_fraction=0.08, seed=2))
    return [(files[i], files[i].parent.parent / "masks" / files[i].name) for i in sorted(held)]


def scratch_validation(kind: str = "cells") -> list[tuple]:
    """(image path, mask path) of the ``scratch_assay`` validation frames t07-t09."""
    d = shared_data() / "scratch_assay" / kind
    return [(d / "images" / f"t{t:02d}.tif", d / "masks" / f"t{t:02d}.tif") for t in (7, 8, 9)]


def datasets(per_field: int, which=("cells", "bbbc039", "dsb2018"), n_fields: int = 8, cap: int | None = None):
    out = {}
    if "cells" in which:
        out["scratch cells t07-t09"] = [(tifffile.imread(a), tifffile.imread(b), cap)
                                        for a, b in scratch_validation("cells")]
    if "scratch-nuclei" in which:
        out["scratch nuclei t07-t09"] = [(tifffile.imread(a), tifffile.imread(b), cap)
                                         for a, b in scratch_validation("nuclei")]
    if "heldback" in which:
        out["stage-3 held back (13)"] = [(tifffile.imread(a), tifffile.imread(b), per_field)
                                         for a, b in stage3_held_back()]
    if "training" in which:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
        from calibrate_iou_head import training_fields

        for image, mask, n in training_fields(shared_data()):
            kind = image.parent.parent.name
            name = {"cells": "training cells t00-t06", "bbbc039": "training BBBC039 (16 fields)"}.get(
                kind, f"training {kind}")
            out.setdefault(name, []).append((tifffile.imread(image), tifffile.imread(mask), n))
    if "dsb2018" in which:
        d = shared_data() / "dsb2018"
        out["dsb2018/ (1 field)"] = [(tifffile.imread(d / "image.tif"), tifffile.imread(d / "mask.tif"), cap)]
    if "bbbc039" in which:
        fields = bbbc039_validation()[:n_fields]
        out[f"BBBC039 val ({len(fields)} fields)"] = [(tifffile.imread(a), tifffile.imread(b), per_field)
                                                     for a, b in fields]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["lite_medsam", "nuclei_sam"],
                    help="registry names or decoder files")
    ap.add_argument("--per-field", type=int, default=20)
    ap.add_argument("--fields", type=int, default=8,
                    help="the first N of the 8 BBBC039 validation fields (sorted by name)")
    ap.add_argument("--cap", type=int, default=None,
                    help="at most N objects per scratch_assay frame and of dsb2018/ (drawn with seed 0; default: all)")
    ap.add_argument("--clicks", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--cache-dir", default=None, help="keep the embeddings in this folder across runs")
    ap.add_argument("--compare-carry", action="store_true",
                    help="also run each zoomed-click model with corrective clicks kept in their mask input's view")
    ap.add_argument("--native-clicks", action="store_true",
                    help="also run each zoomed-click model with its clicks decoded in native views only")
    ap.add_argument("--direct", action="store_true",
                    help="prompt the engine directly (all objects of a round in one predict) instead of a session")
    ap.add_argument("--data", nargs="+", choices=("cells", "bbbc039", "dsb2018", "scratch-nuclei", "heldback", "training"),
                    default=["cells", "bbbc039", "dsb2018"])
    ap.add_argument("--precisions", nargs="+", default=["auto"], choices=("auto", "fp32", "bf16", "fp16"),
                    help="run every model at each of these (auto: the policy's choice for this machine)")
    args = ap.parse_args(argv)
    print(f"{cpu_name()} ({cpu_flags()}), {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    cache = EmbeddingCache(max_bytes=4 << 30, disk_dir=args.cache_dir)
    engines = {}
    for prec in args.precisions:  # the cache keys hold the precision: no embedding is shared
        policy = make_policy(precision=None if prec == "auto" else prec)
        for m in args.models:
            name = m if args.precisions == ["auto"] else f"{m} @ {policy.precision}"
            engines[name] = load_engine(m, policy=policy, cache=cache)
            if args.compare_carry and engines[name].click_zoom > 1:
                kept = load_engine(m, policy=policy, cache=cache)
                kept._into_click_view = lambda _image, prompt: prompt  # the previous rule
                engines[name + " (kept)"] = kept
            if args.native_clicks and engines[name].click_zoom > 1:
                native = load_engine(m, policy=policy, cache=cache)
                native.click_zoom = 1.0
                engines[name + " (native clicks)"] = native
    rows, sessions = [], {}
    for name, items in datasets(args.per_field, args.data, args.fields, args.cap).items():
        for model, engine in engines.items():
            t0 = time.perf_counter()
            clicks, boxes = [], []
            for img, lab, cap in items:
                if args.direct:
                    r = click_ious(engine, img, lab, clicks=args.clicks, max_objects=cap)
                else:
                    r = session_click_ious(sessions.setdefault(model, AnnotationSession(engine, cache=cache)),
                                           img, lab, clicks=args.clicks, max_objects=cap)
                clicks.append(r["clicks"])
                boxes.append(r["box"])
            c, b = np.concatenate(clicks), np.concatenate(boxes)
            row = {"data": name, "model": model, "objects": len(b), "seconds": round(time.perf_counter() - t0, 1),
                   **{f"click_{k}": round(float(c[:, k - 1].mean()), 3) for k in range(1, args.clicks + 1)},
                   "box": round(float(b.mean()), 3)}
            rows.append(row)
            print(f"{name:24s} {model[-24:]:24s} n={row['objects']:4d}  1 click {row['click_1']:.3f}  "
                  f"3 clicks {row.get('click_3', float('nan')):.3f}  5 clicks {row.get('click_5', float('nan')):.3f}  "
                  f"box {row['box']:.3f}  ({row['seconds']} s)", flush=True)
    print()
    print("| data | model | objects | 1 click | 3 clicks | 5 clicks | box |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['data']} | {r['model']} | {r['objects']} | {r['click_1']:.3f} | "
              f"{r.get('click_3', float('nan')):.3f} | {r.get('click_5', float('nan')):.3f} | {r['box']:.3f} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
