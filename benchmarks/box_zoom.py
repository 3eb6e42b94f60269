"""A box on a whole cell decoded in its native view (the engine's rule) vs in a crop around
the box zoomed ``z`` times (the crop ``input / z`` px a side, centred on the box, stretched
to the model input), on the same boxes in one run.

    python benchmarks/box_zoom.py [--model cells_nuclei_sam] [--frames 0 1 2 3 4 5 6] [--cap 10]
                                  [--zooms 1.5 2 2.5 3] [--cache-dir DIR]

Objects: at most ``--cap`` cells per ``scratch_assay`` frame (seed 0), a tight box each; mean
IoU against the cell's label. A box too large for a crop (over 3/4 of its side) keeps the
native mask. Also printed: the fraction of a tight box its cell fills (the IoU of the box
itself as the mask), a floor for what the labels allow. Choose on training frames (t00-t06).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")
import numpy as np  # noqa: E402
import tifffile  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _data import shared_data  # noqa: E402
from _machine import machine_line  # noqa: E402
from napari_gpuseg.engine import load_engine  # noqa: E402
from napari_gpuseg.engine.sam.interactive.cache import EmbeddingCache  # noqa: E402
from napari_gpuseg.engine.sam.interactive.prompt_types import Prompt  # noqa: E402
from napari_gpuseg.engine.sam.interactive.views import View  # noqa: E402
from napari_gpuseg.engine.sam.training.click_eval import pick_objects  # noqa: E402
from napari_gpuseg.engine.sam.training.simulated_prompts import mask_iou, tight_box  # noqa: E402


def _iou(res, truth: np.ndarray) -> float:
    full = np.zeros(truth.shape, bool)
    full[res.y0:res.y0 + res.mask.shape[0], res.x0:res.x0 + res.mask.shape[1]] = res.mask
    return mask_iou(full, truth)


def crop_view(box: np.ndarray, shape: tuple[int, int], input_size: int, zoom: float) -> View | None:
    """The ``input_size / zoom`` px crop centred on ``box``, shifted inside the image; None
    when the image is smaller or the box over 3/4 of the crop's side."""
    side = int(round(input_size / zoom))
    h, w = shape
    if side > min(h, w) or max(box[2] - box[0], box[3] - box[1]) > 0.75 * side:
        return None
    top = int(np.clip(round((box[1] + box[3]) / 2 - side / 2), 0, h - side))
    left = int(np.clip(round((box[0] + box[2]) / 2 - side / 2), 0, w - side))
    return View(top, left, side, side, input_size)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="cells_nuclei_sam")
    ap.add_argument("--frames", type=int, nargs="+", default=list(range(7)))
    ap.add_argument("--cap", type=int, default=10)
    ap.add_argument("--zooms", type=float, nargs="+", default=[1.5, 2.0, 2.5, 3.0])
    ap.add_argument("--cache-dir", default=None)
    args = ap.parse_args(argv)
    print(machine_line())
    engine = load_engine(args.model, cache=EmbeddingCache(max_bytes=4 << 30, disk_dir=args.cache_dir))
    d = shared_data() / "scratch_assay" / "cells"
    ious: dict[float, list[float]] = {z: [] for z in [1.0, *args.zooms]}
    fill = []
    for t in args.frames:
        img = engine.prepare(tifffile.imread(d / "images" / f"t{t:02d}.tif"))
        lab = tifffile.imread(d / "masks" / f"t{t:02d}.tif")
        for oid, s in pick_objects(lab, args.cap, 0):
            truth = lab == oid
            box = (tight_box(truth[s]) + [s[1].start, s[0].start] * 2).astype(float)
            fill.append(float(truth[s].mean()))
            native = _iou(engine.predict(img, [Prompt(box=box)])[0], truth)
            ious[1.0].append(native)
            for z in args.zooms:
                view = crop_view(box, lab.shape, engine.input_size, z)
                if view is None:
                    ious[z].append(native)
                    continue
                res = engine._decode(engine.embedding(img, view), view, [Prompt(box=box)], False)[0]
                ious[z].append(_iou(res, truth))
    print(f"{args.model}, frames {args.frames}, {len(fill)} cells; a cell fills {np.mean(fill):.3f} of its box")
    for z, v in ious.items():
        print(f"  {'native view' if z == 1.0 else f'crop zoomed {z}x':18s} box IoU {np.mean(v):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
