"""Where a first click's IoU is lost: the choice among candidates, or the masks themselves.

    python benchmarks/click_oracle.py [--model nuclei_sam] [--half right|left|all]

On the DSB2018 field (``shared/data/dsb2018``, never trained on), one positive click at each
object's most interior pixel, as ``benchmarks/clicks.py`` clicks. Every candidate mask of
that click is decoded at both scales the engine tries (the click view, ``click_zoom`` times
finer than native, and the native view: SAM's three multimask outputs and a tuned
decoder's single-mask output at each), and the script prints, as mean IoU per object:

- *engine*: the mask ``SamEngine.predict`` returns (best predicted IoU of both scales);
- each candidate on its own, at each scale;
- *oracle*: the best of the candidates for every object, chosen with the ground truth. No
  rule that picks among these candidates (a size prior, another score) can beat it;
- the engine's masks thresholded at other logit levels than 0 (a boundary bias would show
  as a gain here).
"""
import argparse
import sys

import numpy as np
import torch
from scipy import ndimage as ndi

from _data import dsb2018_field
from _machine import machine_line
from adapt_sam import halves
from napari_gpuseg.engine import load_engine
from napari_gpuseg.engine.sam.interactive.cache import EmbeddingCache
from napari_gpuseg.engine.sam.training.click_eval import MIN_OBJECT_AREA
from napari_gpuseg.engine.sam.interactive.inputs import logits_to_view_mask
from napari_gpuseg.engine.sam.training.simulated_prompts import interior_point
from napari_gpuseg.engine.sam.interactive.predictor import Prompt

THRESHOLDS = (-2.0, -1.0, 0.0, 1.0, 2.0)


def _full_logits(low_res: torch.Tensor, view, shape) -> np.ndarray:
    out = np.full(shape, -1e4, np.float32)
    out[view.y0:view.y1, view.x0:view.x1] = logits_to_view_mask(low_res[None], view)[0].numpy()
    return out


def _iou(a: np.ndarray, b: np.ndarray) -> float:
    return float((a & b).sum() / max(1, (a | b).sum()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="nuclei_sam")
    ap.add_argument("--half", choices=("right", "left", "all"), default="right",
                    help="the objects measured (by centre; right: those Adapt SAM is measured on)")
    args = ap.parse_args(argv)
    print(machine_line())
    img, lab = dsb2018_field()
    labels = {"all": lab, "left": halves(lab)[0], "right": halves(lab)[1]}[args.half]
    engine = load_engine(args.model, cache=EmbeddingCache(max_bytes=2 << 30))
    image = engine.prepare(img)
    engine.embed([image], [engine.prompt_views(image)])
    objs = [(i + 1, s) for i, s in enumerate(ndi.find_objects(labels))
            if s is not None and np.count_nonzero(labels[s] == i + 1) >= MIN_OBJECT_AREA]
    scales = ["click view", "native"] if engine.click_zoom > 1 else ["native"]
    names = ["single"] + [f"multi {k}" for k in (1, 2, 3)]
    cand = np.zeros((len(objs), len(scales), 4))
    chosen = np.zeros((len(objs), len(THRESHOLDS)))
    for k, (oid, s) in enumerate(objs):
        truth = labels == oid
        prompt = Prompt(points=(interior_point(truth[s]) + [s[1].start, s[0].start])[None],
                        labels=np.ones(1, np.int64))
        res = engine.predict(image, [prompt], multimask=True)[0]
        full = _full_logits(res.low_res, res.view, lab.shape)
        chosen[k] = [_iou(full > t, truth) for t in THRESHOLDS]
        for j, zoom in enumerate([True, False][:len(scales)]):
            view = engine.route(image, prompt, zoom=zoom)
            emb = engine.embedding(image, view)
            coords = torch.as_tensor(view.to_input(prompt.points)[None], dtype=torch.float32)
            with torch.inference_mode():
                sparse, dense = engine.sam.prompt_encoder(
                    points=(coords, torch.ones(1, 1, dtype=torch.int64)), boxes=None, masks=None)
                low, _iou_pred = engine._decode_module(emb, sparse, dense, "all")
            for c in range(low.shape[1]):
                cand[k, j, c] = _iou(_full_logits(low[0, c], view, lab.shape) > 0, truth)
    print(f"{args.model}, dsb2018/ {args.half} half: {len(objs)} objects, one click each")
    print(f"  engine (as predict returns it): {chosen[:, THRESHOLDS.index(0.0)].mean():.3f}")
    for j, scale in enumerate(scales):
        print(f"  {scale:10s} " + "  ".join(f"{n} {cand[:, j, c].mean():.3f}" for c, n in enumerate(names)))
    print(f"  oracle (best of {len(scales) * 4} candidates per object): {cand.reshape(len(objs), -1).max(1).mean():.3f}")
    print("  engine's mask at logit threshold " + "  ".join(f"{t:+g}: {v:.3f}" for t, v in zip(THRESHOLDS, chosen.mean(0))))
    print(f"  objects under IoU 0.5 / 0.7: {np.mean(chosen[:, 2] < 0.5):.2f} / {np.mean(chosen[:, 2] < 0.7):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
