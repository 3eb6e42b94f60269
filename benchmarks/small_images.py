"""Clicks and boxes on images smaller than the model input, padded or stretched.

    python benchmarks/small_images.py [--sides 128 171 200] [--crops 3] [--per-crop 6] [--model nuclei_sam]

Random square crops (seed 0) of the last 8 BBBC039 fields (validation: no model here trained
on them); the objects lying whole inside a crop (at most ``--per-crop`` each). One click at the
object's most interior pixel (best candidate, both scales, as the annotator's first click) and
a tight box, mean IoU per object. Each crop is decoded twice in the same run: as the engine
does now (a click's views of a small image padded at native and click scale) and stretched to
the input as before (the official rule, which boxes keep), so the ratio is a same-run one.
"""
import argparse

import numpy as np
import tifffile
from scipy import ndimage

from _data import bbbc039_validation
from _machine import machine_line
from napari_gpuseg.engine import load_engine
from napari_gpuseg.engine.sam.interactive.cache import EmbeddingCache
from napari_gpuseg.engine.sam.interactive.prompt_types import Prompt
from napari_gpuseg.engine.sam.interactive.views import zoom_grid


def stretched(engine):
    """The same engine with a small image's click views stretched to the input (before)."""
    engine.native_click_views = engine.views
    engine.click_views = lambda image: zoom_grid(image.shape, engine.input_size, engine.click_zoom)
    return engine


def objects(side: int, crops: int, per_crop: int):
    rng = np.random.default_rng(0)
    for img_path, mask_path in bbbc039_validation():
        img, gt = tifffile.imread(img_path), tifffile.imread(mask_path)
        for _ in range(crops):
            y0, x0 = rng.integers(0, img.shape[0] - side), rng.integers(0, img.shape[1] - side)
            sub, g = img[y0:y0 + side, x0:x0 + side], gt[y0:y0 + side, x0:x0 + side]
            cut = set(np.unique(np.r_[g[0], g[-1], g[:, 0], g[:, -1]]))
            for lab in [v for v in np.unique(g) if v and v not in cut][:per_crop]:
                yield sub, g == lab


def measure(engine, side: int, crops: int, per_crop: int) -> tuple[float, float, int]:
    clicks, boxes = [], []
    iou = lambda m, o: (m & o).sum() / (m | o).sum()  # noqa: E731
    for sub, obj in objects(side, crops, per_crop):
        y, x = np.unravel_index(ndimage.distance_transform_edt(obj).argmax(), obj.shape)
        clicks.append(iou(engine.predict(sub, [Prompt(points=[[x, y]])], multimask=True)[0].full(sub.shape), obj))
        ys, xs = np.nonzero(obj)
        box = Prompt(box=[xs.min(), ys.min(), xs.max() + 1, ys.max() + 1])
        boxes.append(iou(engine.predict(sub, [box])[0].full(sub.shape), obj))
    return float(np.mean(clicks)), float(np.mean(boxes)), len(clicks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sides", type=int, nargs="+", default=[128, 171, 200])
    ap.add_argument("--crops", type=int, default=3, help="crops per field")
    ap.add_argument("--per-crop", type=int, default=6, help="objects per crop at most")
    ap.add_argument("--model", default="nuclei_sam")
    args = ap.parse_args()
    print(machine_line(), flush=True)
    cache = EmbeddingCache()
    now = load_engine(args.model, cache=cache)
    before = stretched(load_engine(args.model, cache=cache))
    print(f"model {args.model}, click zoom {now.click_zoom}; {args.crops} crops per field, "
          f"at most {args.per_crop} objects each")
    print("side | objects | 1 click padded (now) | 1 click stretched (before) | ratio | box (now) | box (before)")
    for side in args.sides:
        c1, b1, n = measure(now, side, args.crops, args.per_crop)
        c0, b0, _n = measure(before, side, args.crops, args.per_crop)  # the embeddings shared: no times
        print(f"{side} | {n} | {c1:.3f} | {c0:.3f} | {c1 / c0:.3f} | {b1:.3f} | {b0:.3f}", flush=True)


if __name__ == "__main__":
    main()
