"""An interactive box prompt decoded near its box vs over the whole view (LiteMedSAM).

    OMP_NUM_THREADS=2 python benchmarks/near_box.py [--fields 4] [--boxes 20]

The annotator decodes a box's mask near the box (``SamEngine.predict(..., near_box=True)``:
the mask upscaling runs on the box grown by half its size per side). For held-out BBBC039
fields (520 x 696, embedded and the decoder warmed, as in the dock), ``--boxes``
ground-truth boxes per field (3 px margin) are decoded one prompt at a time, whole view
(the baseline) and near the box alternating, so both see the same machine load. Reported:
median time per prompt, the ratio, and how far the two masks differ.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")

import numpy as np  # noqa: E402
import tifffile  # noqa: E402
from skimage.measure import regionprops  # noqa: E402

from napari_gpuseg.engine.runtime.device import get_policy  # noqa: E402
from napari_gpuseg.engine.sam.loader import load_engine  # noqa: E402
from napari_gpuseg.engine.sam.interactive.predictor import Prompt  # noqa: E402

from _data import shared_data  # noqa: E402  (benchmarks/, the script's folder)
DATA = shared_data() / "bbbc039"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fields", type=int, default=4)
    ap.add_argument("--boxes", type=int, default=20)
    args = ap.parse_args()
    policy = get_policy()
    engine = load_engine("lite_medsam", policy)
    times = {False: [], True: []}
    ious, differ = [], 0
    for f in sorted((DATA / "images").glob("*.tif"))[16:16 + args.fields]:
        img = tifffile.imread(f)
        gt = tifffile.imread(DATA / "masks" / f.name)
        props = sorted(regionprops(gt), key=lambda p: -p.area)[:: max(1, len(np.unique(gt)) // args.boxes)]
        prompts = [Prompt(box=[p.bbox[1] - 3, p.bbox[0] - 3, p.bbox[3] + 3, p.bbox[2] + 3])
                   for p in props[:args.boxes]]
        prompts = [p for p in prompts if min(p.box[:2]) >= 0 and p.box[2] < gt.shape[1] and p.box[3] < gt.shape[0]]
        image = engine.embed([img])[0]
        engine.warm_decoder(image)
        for k, prompt in enumerate(prompts):
            engine.predict(image, [prompt])  # the prompt's view embedded and warmed
            out = {}
            for near in ((False, True) if k % 2 else (True, False)):
                t0 = time.perf_counter()
                out[near] = engine.predict(image, [prompt], near_box=near)[0]
                times[near].append(time.perf_counter() - t0)
            a, b = out[False].full(gt.shape), out[True].full(gt.shape)
            union = (a | b).sum()
            ious.append((a & b).sum() / union if union else 1.0)
            differ += int(not np.array_equal(a, b))
    ms = {k: 1000 * statistics.median(v) for k, v in times.items()}
    print(f"device: {policy.describe()}; {len(ious)} boxes on {args.fields} BBBC039 fields")
    print(f"whole view (baseline): {ms[False]:.1f} ms median per prompt")
    print(f"near the box: {ms[True]:.1f} ms median per prompt; ratio {ms[False] / ms[True]:.2f}x")
    print(f"masks: {differ} of {len(ious)} differ; IoU between the two: min {min(ious):.4f}, "
          f"mean {statistics.mean(ious):.4f}")


if __name__ == "__main__":
    main()
