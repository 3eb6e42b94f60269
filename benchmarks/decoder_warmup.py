"""First prompt on a fresh embedding: cold vs after ``SamEngine.warm_decoder``.

    OMP_NUM_THREADS=2 python benchmarks/decoder_warmup.py [--images 8]

The annotator dock warms the decoder in the worker right after an embedding. For each
BBBC039 crop (256 x 256, LiteMedSAM, one view) this embeds the crop, then times one box
prompt with an empty decoder memo (cold, the baseline) and, after clearing the memo and
running ``warm_decoder`` (timed on its own: background work), the same prompt again.
Cold and warm alternate on the same image, so both see the same machine load; the masks
must be identical.
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
import torch  # noqa: E402
from skimage.measure import regionprops  # noqa: E402

from napari_gpuseg.engine.runtime.device import get_policy  # noqa: E402
from napari_gpuseg.engine.sam.interactive.predictor import Prompt  # noqa: E402
from napari_gpuseg.engine.sam.loader import load_engine  # noqa: E402

from _data import shared_data  # noqa: E402  (benchmarks/, the script's folder)
DATA = shared_data() / "bbbc039"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=8)
    args = ap.parse_args()
    policy = get_policy()
    engine = load_engine("lite_medsam", policy)
    cold, warm, warming = [], [], []
    for f in sorted((DATA / "images").glob("*.tif"))[16:16 + args.images]:
        img = tifffile.imread(f)[100:356, 200:456]
        gt = tifffile.imread(DATA / "masks" / f.name)[100:356, 200:456]
        r0, c0, r1, c1 = regionprops(gt)[0].bbox
        prompt = Prompt(box=[c0 - 3, r0 - 3, c1 + 3, r1 + 3])
        image = engine.embed([img])[0]
        with torch.inference_mode(), policy.autocast():
            engine._memos.clear()
            t0 = time.perf_counter()
            a = engine.predict(image, [prompt])[0]
            cold.append(time.perf_counter() - t0)
            engine._memos.clear()
            t0 = time.perf_counter()
            engine.warm_decoder(image)
            warming.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            b = engine.predict(image, [prompt])[0]
            warm.append(time.perf_counter() - t0)
        assert np.array_equal(a.mask, b.mask)
    ms = [1000 * statistics.median(x) for x in (cold, warm, warming)]
    print(f"device: {policy.describe()}; {len(cold)} BBBC039 crops, one box each")
    print(f"first prompt, cold decoder (baseline): {ms[0]:.1f} ms median")
    print(f"first prompt after warm_decoder: {ms[1]:.1f} ms median; ratio {ms[0] / ms[1]:.2f}x")
    print(f"warm_decoder itself (in the worker, right after the embedding): {ms[2]:.1f} ms median")


if __name__ == "__main__":
    main()
