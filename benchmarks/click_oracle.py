"""Where a first click's IoU is lost: the choice among candidates, or the masks themselves.

    python benchmarks/click_oracle.py [--model nuclei_sam] [--half right|left|all]
    python benchmarks/click_oracle.py --data cells [--model cells_nuclei_sam] [--cap N]

On the DSB2018 field (``shared/data/dsb2018``, never trained on), or with ``--data cells`` on
every whole cell of the ``scratch_assay`` validation frames t07-t09 (at most ``--cap`` per
frame, drawn as ``benchmarks/clicks.py`` draws them), one positive click at each object's
most interior pixel, as ``benchmarks/clicks.py`` clicks. Every candidate mask of
that click is decoded at both scales the engine tries (the click view, ``click_zoom`` times
finer than native, and the native view: SAM's three multimask outputs and a tuned
decoder's single-mask output at each), and the script prints, as mean IoU per object:

- *engine*: the mask ``SamEngine.predict`` returns (best predicted IoU of both scales);
- each candidate on its own, at each scale;
- *oracle*: the best of the candidates for every object, chosen with the ground truth. No
  rule that picks among these candidates (a size prior, another score) can beat it;
- the engine's masks thresholded at other logit levels than 0, and grown or shrunk by 1-3 px
  (a boundary bias would show as a gain here), and its median area against the object's;
- *size prior*: the candidate whose area is nearest (in log) to a size the annotator could
  know: the median area of 5 other objects of the same field (as if the user had committed
  them; 5 draws, seeded), and the object's own area (a prior that knew each object's size).
"""
import argparse
import sys

import numpy as np
import torch
from scipy import ndimage as ndi

import tifffile
from skimage.morphology import disk

from _data import dsb2018_field, shared_data
from _machine import machine_line
from adapt_sam import halves
from napari_gpuseg.engine import load_engine
from napari_gpuseg.engine.sam.interactive.cache import EmbeddingCache
from napari_gpuseg.engine.sam.training.click_eval import MIN_OBJECT_AREA, pick_objects
from napari_gpuseg.engine.sam.interactive.inputs import logits_to_view_mask
from napari_gpuseg.engine.sam.training.simulated_prompts import interior_point
from napari_gpuseg.engine.sam.interactive.predictor import Prompt

THRESHOLDS = (-2.0, -1.0, 0.0, 1.0, 2.0)
GROW = (-2, -1, 1, 2, 3)  # px: the engine's mask grown (negative: shrunk) by a disk of this radius


def _full_logits(low_res: torch.Tensor, view, shape) -> np.ndarray:
    out = np.full(shape, -1e4, np.float32)
    out[view.y0:view.y1, view.x0:view.x1] = logits_to_view_mask(low_res[None], view)[0].numpy()
    return out


def _iou(a: np.ndarray, b: np.ndarray) -> float:
    return float((a & b).sum() / max(1, (a | b).sum()))


def size_prior(cand: np.ndarray, areas: np.ndarray, truth_area: np.ndarray, field: np.ndarray,
               others: int = 5, draws: int = 5) -> tuple[float, float]:
    """Mean IoU when each object keeps the candidate whose area is nearest (in log) to the
    median area of ``others`` other objects of its field (``draws`` seeded draws, averaged),
    and when it is nearest to the object's own area (a prior that knew each object's size)."""
    rng = np.random.default_rng(0)
    n = len(cand)
    rows = np.arange(n)

    def pick(target):
        cost = np.abs(np.log(np.maximum(areas, 1) / target[:, None]))
        return cand[rows, cost.argmin(1)].mean()
    means = []
    for _ in range(draws):
        target = np.empty(n)
        for i in range(n):
            same = np.flatnonzero((field == field[i]) & (rows != i))
            if not len(same):  # the field's only object: the others of every field
                same = np.flatnonzero(rows != i)
            if not len(same):
                return float("nan"), float(pick(truth_area.astype(float)))
            target[i] = np.median(truth_area[rng.choice(same, min(others, len(same)), replace=False)])
        means.append(pick(target))
    return float(np.mean(means)), float(pick(truth_area.astype(float)))


def fields_of(args) -> list:
    """(image, labels, objects) of each field measured."""
    if args.data == "cells":
        d = shared_data() / "scratch_assay" / "cells"
        out = []
        for t in (7, 8, 9):
            lab = tifffile.imread(d / "masks" / f"t{t:02d}.tif")
            out.append((tifffile.imread(d / "images" / f"t{t:02d}.tif"), lab, pick_objects(lab, args.cap)))
        return out
    img, lab = dsb2018_field()
    labels = {"all": lab, "left": halves(lab)[0], "right": halves(lab)[1]}[args.half]
    objs = [(i + 1, s) for i, s in enumerate(ndi.find_objects(labels))
            if s is not None and np.count_nonzero(labels[s] == i + 1) >= MIN_OBJECT_AREA]
    return [(img, labels, objs)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="nuclei_sam")
    ap.add_argument("--half", choices=("right", "left", "all"), default="right",
                    help="the objects measured (by centre; right: those Adapt SAM is measured on)")
    ap.add_argument("--data", choices=("dsb2018", "cells"), default="dsb2018")
    ap.add_argument("--cap", type=int, default=None, help="--data cells: at most N cells per frame (default: all)")
    args = ap.parse_args(argv)
    print(machine_line())
    engine = load_engine(args.model, cache=EmbeddingCache(max_bytes=2 << 30))
    scales = ["click view", "native"] if engine.click_zoom > 1 else ["native"]
    names = ["single"] + [f"multi {k}" for k in (1, 2, 3)]
    cand, areas, chosen, truth_area, field, grown, area_ratio = [], [], [], [], [], [], []
    for f, (img, labels, objs) in enumerate(fields_of(args)):
        image = engine.prepare(img)
        for oid, s in objs:
            truth = labels == oid
            prompt = Prompt(points=(interior_point(truth[s]) + [s[1].start, s[0].start])[None],
                            labels=np.ones(1, np.int64))
            res = engine.predict(image, [prompt], multimask=True)[0]
            full = _full_logits(res.low_res, res.view, labels.shape)
            chosen.append([_iou(full > t, truth) for t in THRESHOLDS])
            mask = full > 0
            grown.append([_iou((ndi.binary_dilation if k > 0 else ndi.binary_erosion)(mask, disk(abs(k))), truth)
                          for k in GROW])
            area_ratio.append(mask.sum() / max(1, truth.sum()))
            c_iou, c_area = np.zeros((len(scales), 4)), np.zeros((len(scales), 4))
            for j, zoom in enumerate([True, False][:len(scales)]):
                view = engine.route(image, prompt, zoom=zoom)
                emb = engine.embedding(image, view)
                coords = torch.as_tensor(view.to_input(prompt.points)[None], dtype=torch.float32)
                with torch.inference_mode():
                    sparse, dense = engine.sam.prompt_encoder(
                        points=(coords, torch.ones(1, 1, dtype=torch.int64)), boxes=None, masks=None)
                    low, _iou_pred = engine._decode_module(emb, sparse, dense, "all")
                for c in range(low.shape[1]):
                    m = _full_logits(low[0, c], view, labels.shape) > 0
                    c_iou[j, c], c_area[j, c] = _iou(m, truth), m.sum()
            cand.append(c_iou)
            areas.append(c_area)
            truth_area.append(truth.sum())
            field.append(f)
    cand, areas, chosen = np.array(cand), np.array(areas), np.array(chosen)
    where = "scratch_assay t07-t09 cells" if args.data == "cells" else f"dsb2018/ {args.half} half"
    print(f"{args.model}, {where}: {len(cand)} objects, one click each")
    print(f"  engine (as predict returns it): {chosen[:, THRESHOLDS.index(0.0)].mean():.3f}")
    for j, scale in enumerate(scales):
        print(f"  {scale:10s} " + "  ".join(f"{n} {cand[:, j, c].mean():.3f}" for c, n in enumerate(names)))
    print(f"  oracle (best of {len(scales) * 4} candidates per object): {cand.reshape(len(cand), -1).max(1).mean():.3f}")
    print("  engine's mask at logit threshold " + "  ".join(f"{t:+g}: {v:.3f}" for t, v in zip(THRESHOLDS, chosen.mean(0))))
    print("  engine's mask grown by " + "  ".join(f"{k:+d} px: {v:.3f}" for k, v in zip(GROW, np.mean(grown, 0)))
          + f"; its area / the object's, median {np.median(area_ratio):.2f}")
    print(f"  objects under IoU 0.5 / 0.7: {np.mean(chosen[:, 2] < 0.5):.2f} / {np.mean(chosen[:, 2] < 0.7):.2f}")
    flat, flat_area = cand.reshape(len(cand), -1), areas.reshape(len(cand), -1)
    committed, own = size_prior(flat, flat_area, np.array(truth_area), np.array(field))
    print(f"  size prior, the candidate nearest in area to the median of 5 other objects of the field: "
          f"{committed:.3f}; to the object's own area (a prior that knew each size): {own:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
