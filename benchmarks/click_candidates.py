"""How much a first click could gain from choosing better among the masks a model already makes.

    python benchmarks/click_candidates.py [--model cells_nuclei_sam] [--cache-dir DIR]

A first click on a decoder tuned here decodes four candidate masks in its click view (1.5x
finer than native) and four in a native view; the engine keeps the one its IoU head rates
highest (``SamEngine.predict``). This script decodes all eight for every object's first click
(its most interior pixel, as ``benchmarks/clicks.py``) and reports, per kind of object, the
mean IoU of:

- ``engine``: the engine's rule (the head's choice in each view, the higher predicted IoU of
  the two, the native one when the finer view's mask reaches a cut edge);
- ``head native`` / ``head finer``: the head's choice in one view only;
- ``nK`` / ``fK``: always candidate K, native / finer view;
- ``linear``: a ridge regression of a candidate's true IoU from what is known at run time (its
  view and index, predicted IoU, stability, area against the largest candidate, a cut edge),
  fitted on the training objects (``scripts/calibrate_iou_head.py``'s: cells of t00-t06, the
  first 16 BBBC039 fields, ``dsb2018_more``) and applied to the validation objects;
- ``oracle``: the best of the eight for each object (what no rule can beat).

Training rows are for fitting and choosing a rule; the validation rows (cells of t07-t09,
6 nuclei per validation BBBC039 field, the ``dsb2018/`` field) are for reporting it.
"""
import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import tifffile

from _machine import machine_line
from clicks import bbbc039_validation, scratch_validation, shared_data
from napari_gpuseg.engine import load_engine
from napari_gpuseg.engine.sam.interactive.cache import EmbeddingCache
from napari_gpuseg.engine.sam.interactive.inputs import logits_to_view_mask
from napari_gpuseg.engine.sam.interactive.predictor import Prompt
from napari_gpuseg.engine.sam.interactive.views import touches_cut
from napari_gpuseg.engine.sam.training.click_eval import pick_objects
from napari_gpuseg.engine.sam.training.simulated_prompts import interior_point, mask_iou


def training_objects(data: Path) -> list[tuple]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from calibrate_iou_head import training_fields

    return [(str(i), tifffile.imread(i), tifffile.imread(m), n) for i, m, n in training_fields(data)]


def validation_objects(data: Path) -> list[tuple]:
    out = [(str(a), tifffile.imread(a), tifffile.imread(b), None) for a, b in scratch_validation("cells")]
    out += [(str(a), tifffile.imread(a), tifffile.imread(b), 6) for a, b in bbbc039_validation()]
    d = data / "dsb2018"
    return out + [(str(d), tifffile.imread(d / "image.tif"), tifffile.imread(d / "mask.tif"), None)]


def kind(name: str) -> str:
    return "cells" if "scratch_assay" in name else ("BBBC039" if "bbbc039" in name else "DSB2018")


def candidates(engine, fields) -> list[tuple[str, list[dict]]]:
    """Per object: (kind, the eight candidates as dicts of features and true IoU)."""
    out = []
    for name, image, labels, cap in fields:
        prepared = engine.prepare(image)
        for oid, s in pick_objects(labels, cap, 0):
            truth = labels == oid
            point = interior_point(labels[s] == oid) + [s[1].start, s[0].start]
            prompt = Prompt(points=np.asarray(point, float)[None], labels=np.ones(1, np.int64))
            rows = []
            for finer in (True, False):
                view = engine.route(prepared, prompt, zoom=finer)
                emb = engine.embedding(prepared, view)
                low, iou = engine._decoder_outputs(emb, view, [prompt], True,
                                                   engine.decoder_memo(prepared, view), False)
                full = (logits_to_view_mask(low[0], view) > 0).cpu().numpy()
                for k in range(low.shape[1]):
                    pred = np.zeros(labels.shape, bool)
                    pred[view.y0:view.y0 + view.h, view.x0:view.x0 + view.w] = full[k]
                    lg = low[0, k]
                    rows.append({"finer": finer, "k": k, "piou": float(iou[0, k]),
                                 "stability": float((lg > 1).sum() / max(1, int((lg > -1).sum()))),
                                 "area": int(full[k].sum()), "cut": bool(touches_cut(full[k], view, labels.shape)),
                                 "iou": float(mask_iou(pred, truth))})
            out.append((kind(name), rows))
    return out


def engine_rule(rows: list[dict]) -> dict:
    finer = max((r for r in rows if r["finer"]), key=lambda r: r["piou"])
    native = max((r for r in rows if not r["finer"]), key=lambda r: r["piou"])
    return native if native["piou"] > finer["piou"] or finer["cut"] else finer


def features(rows: list[dict]) -> np.ndarray:
    largest = max(r["area"] for r in rows) or 1
    out = []
    for r in rows:
        which = np.zeros(8)
        which[r["k"] + 4 * (not r["finer"])] = 1
        base = [r["piou"], r["stability"], float(r["cut"]), np.log1p(r["area"]) / 10, r["area"] / largest]
        out.append(np.concatenate([which, which * r["piou"], base]))
    return np.array(out)


def fit_linear(objects, lam: float = 0.1) -> np.ndarray:
    x = np.concatenate([features(rows) for _k, rows in objects])
    y = np.concatenate([[r["iou"] for r in rows] for _k, rows in objects])
    return np.linalg.solve(x.T @ x + lam * np.eye(x.shape[1]), x.T @ y)


def rules(weights: np.ndarray) -> dict:
    out = {"engine": engine_rule,
           "head native": lambda rows: max((r for r in rows if not r["finer"]), key=lambda r: r["piou"]),
           "head finer": lambda rows: max((r for r in rows if r["finer"]), key=lambda r: r["piou"])}
    for k in range(4):
        out[f"n{k}"] = lambda rows, k=k: next(r for r in rows if not r["finer"] and r["k"] == k)
        out[f"f{k}"] = lambda rows, k=k: next(r for r in rows if r["finer"] and r["k"] == k)
    out["linear"] = lambda rows: rows[int(np.argmax(features(rows) @ weights))]
    out["oracle"] = lambda rows: max(rows, key=lambda r: r["iou"])
    return out


def table(title: str, objects, named: dict) -> None:
    by_kind = defaultdict(list)
    for k, rows in objects:
        by_kind[k].append(rows)
    print(f"\n{title}\n")
    print("| objects | n | " + " | ".join(named) + " |")
    print("| --- | ---: | " + " | ".join("---:" for _ in named) + " |")
    for k, items in by_kind.items():
        means = [np.mean([rule(rows)["iou"] for rows in items]) for rule in named.values()]
        print(f"| {k} | {len(items)} | " + " | ".join(f"{m:.3f}" for m in means) + " |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="registry name or decoder file (default: the default model)")
    ap.add_argument("--cache-dir", default=None, help="keep the embeddings in this folder across runs")
    args = ap.parse_args(argv)
    print(machine_line())
    engine = load_engine(args.model, cache=EmbeddingCache(max_bytes=4 << 30, disk_dir=args.cache_dir))
    print(f"model {engine.info.name}, precision {engine.policy.precision}")
    data = shared_data()
    t0 = time.perf_counter()
    train = candidates(engine, training_objects(data))
    val = candidates(engine, validation_objects(data))
    print(f"{len(train)} training and {len(val)} validation objects in {time.perf_counter() - t0:.0f} s")
    named = rules(fit_linear(train))
    table("training objects (the linear rule is fitted here)", train, named)
    table("validation objects", val, named)
    return 0


if __name__ == "__main__":
    sys.exit(main())
