"""Calibrating the annotator's "unsure" threshold: predicted IoU against true IoU of first masks.

    python benchmarks/unsure_threshold.py [--model cells_nuclei_sam] [--cap 15] [--per-field 15] [--json out.json]

The SAM annotator flags an object's first mask as unsure when the model's own predicted IoU
is under ``UNSURE_IOU`` (``engine/sam/training/adapt.py``). This measures what that flag is
worth: each object gets one click at its most interior pixel through an
``AnnotationSession``, as the dock makes it (``engine.annotate.session_clicks.session_click_ious``,
what ``benchmarks/clicks.py`` reports), and the first mask's predicted IoU (clamped to
[0, 1], as shown) is set against its true IoU. A first mask is *bad* when its true IoU is
under 0.5 (the object needs real correction). For thresholds 0.50..0.95 the table gives how
many first masks are flagged, and the precision (flagged masks that are bad) and recall (bad
masks that are flagged) of the flag. ``--data training`` (choose the threshold there): the
whole cells of the ``scratch_assay`` training frames t00-t06 (at most ``--cap`` per frame)
and the nuclei of the first 16 BBBC039 fields (at most ``--per-field`` per field);
``--data validation`` (report it there): the cells of t07-t09 and the nuclei of the last 8
BBBC039 fields; drawn with seed 0. Each click
embeds the views it needs (the whole images are not embedded). With 8 nuclei per field no
first mask of a nucleus was bad (true IoU >= 0.5 for all 64): the default 15 per field gives
the flag something to find on nuclei too. The defaults (165 objects) took 485 s of CPU time
(both threads together) on a 2-core AMD EPYC (avx2), 2026-11-28, so between 4 and 8 minutes
on that CPU when idle (not measured idle: the wall time was 1412 s under a load of about 9 from
other jobs); ``--cap 8 --per-field 8`` halves it.
"""
import argparse
import json
import sys
import time

import numpy as np
import tifffile

from _data import bbbc039_validation, shared_data
from _machine import machine_line
from clicks import scratch_validation
from napari_gpuseg.engine import AnnotationSession, load_engine
from napari_gpuseg.engine.annotate.session_clicks import session_click_ious
from napari_gpuseg.engine.sam.interactive.cache import EmbeddingCache
from napari_gpuseg.models.registry import DEFAULT_MODEL

BAD_IOU = 0.5
THRESHOLDS = np.round(np.arange(0.50, 0.951, 0.05), 2)


def frames(data: str = "validation") -> dict[str, list[tuple]]:
    if data == "validation":
        return {"scratch cells t07-t09": scratch_validation("cells"), "BBBC039 val (8 fields)": bbbc039_validation()}
    cells, bbbc = shared_data() / "scratch_assay" / "cells", shared_data() / "bbbc039"
    return {"scratch cells t00-t06": [(cells / "images" / f"t{t:02d}.tif", cells / "masks" / f"t{t:02d}.tif")
                                      for t in range(7)],
            "BBBC039 training (16 fields)": [(p, bbbc / "masks" / p.name)
                                             for p in sorted((bbbc / "images").glob("*.tif"))[:16]]}


def flag_table(pred: np.ndarray, true: np.ndarray, thresholds=THRESHOLDS) -> list[dict]:
    """Per threshold: first masks flagged (predicted IoU under it), and precision / recall /
    F1 of the flag for "true IoU under ``BAD_IOU``" (nan where undefined)."""
    bad = true < BAD_IOU
    rows = []
    for t in thresholds:
        flagged = pred < t
        hit = int((flagged & bad).sum())
        prec = hit / flagged.sum() if flagged.any() else float("nan")
        rec = hit / bad.sum() if bad.any() else float("nan")
        f1 = 2 * prec * rec / (prec + rec) if prec + rec > 0 else float("nan")
        rows.append({"threshold": float(t), "flagged": int(flagged.sum()), "bad_flagged": hit,
                     "precision": prec, "recall": rec, "f1": f1})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="a registry name or decoder file")
    ap.add_argument("--cap", type=int, default=15, help="at most N cells per scratch_assay frame (seed 0)")
    ap.add_argument("--per-field", type=int, default=15, help="at most N nuclei per BBBC039 field (seed 0)")
    ap.add_argument("--data", choices=("training", "validation"), default="validation",
                    help="training: the objects to choose the threshold on; validation: to report it")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    print(machine_line())
    cache = EmbeddingCache(max_bytes=2 << 30)
    session = AnnotationSession(load_engine(args.model, cache=cache), cache=cache)
    pred, true, where = [], [], []
    t0 = time.perf_counter()
    for (name, files), cap in zip(frames(args.data).items(), (args.cap, args.per_field)):
        for img_path, mask_path in files:
            r = session_click_ious(session, tifffile.imread(img_path), tifffile.imread(mask_path), clicks=1,
                                   max_objects=cap, box=False)
            pred.append(r["score"])
            true.append(r["clicks"][:, 0])
            where += [name] * r["n"]
        print(f"{name}: {sum(w == name for w in where)} objects ({time.perf_counter() - t0:.0f} s)", flush=True)
    raw, true, where = np.concatenate(pred), np.concatenate(true), np.array(where)
    pred = np.clip(raw, 0.0, 1.0)  # as the annotator shows it
    print(f"\n{args.model}, one click at the most interior pixel, {len(true)} first masks, "
          f"{int((true < BAD_IOU).sum())} bad (true IoU < {BAD_IOU}); predicted IoU > 1 in {int((raw > 1).sum())} "
          f"(max {raw.max():.3f}); Spearman rho(predicted, true) {_spearman(pred, true):.3f}")
    for name in dict.fromkeys(where):
        sel = where == name
        print(f"  {name}: n={int(sel.sum())}, mean true IoU {true[sel].mean():.3f}, "
              f"mean predicted {pred[sel].mean():.3f}, bad {int((true[sel] < BAD_IOU).sum())}")
    rows = flag_table(pred, true)
    print("\n| threshold | flagged | flagged % | bad flagged | precision | recall | F1 |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['threshold']:.2f} | {r['flagged']} | {100 * r['flagged'] / len(true):.0f} | {r['bad_flagged']} | "
              f"{r['precision']:.2f} | {r['recall']:.2f} | {r['f1']:.2f} |")
    for name in dict.fromkeys(where):
        sel = where == name
        print(f"\n{name}: threshold flagged/{int(sel.sum())} precision recall")
        for r in flag_table(pred[sel], true[sel]):
            print(f"  {r['threshold']:.2f} {r['flagged']:4d} {r['precision']:.2f} {r['recall']:.2f}")
    print(f"\n{time.perf_counter() - t0:.0f} s in all, {time.process_time():.0f} s of CPU time (all threads; "
          "the wall time on a busy machine says little)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"model": args.model, "predicted": raw.tolist(), "true": true.tolist(),
                       "data": where.tolist(), "table": rows}, fh, indent=1)
    return 0


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


if __name__ == "__main__":
    sys.exit(main())
