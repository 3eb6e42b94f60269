"""Box-mode outlines: per-box views, shared views, and the field map (the default).

    OMP_NUM_THREADS=2 python benchmarks/box_field_outlines.py [INDEX ...]

BBBC039 fields by index in sorted order (default 17 and 20, the README screenshot's field
and another validation field; 3 and 9 are training fields), boxes from the bundled U-Net
detector, LiteMedSAM, ``min_area=15`` as the dock uses. Per set-up: masks in more than one
piece as the model gives them (``one_piece=False``); then, with each mask cut to its
largest piece (``one_piece=True``, the default), the mean boundary roughness (boundary
pixels squared over area; a circle of radius r gives about 4 pi; the ground truth's own is
printed for reference) and F1@0.5 against the ground truth. Each set-up starts from an
empty embedding cache.

* ``before``: each box routed on its own (``routing="per-box"``), every view embedded;
* ``views``: shared views, every view embedded on its own (``field=False``);
* ``field map``: the default: native views cut from one locally normalised embedding of
  the field.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import tifffile
from scipy import ndimage as ndi

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from napari_gpuseg.engine.detect import detect_boxes  # noqa: E402
from napari_gpuseg.engine.metrics import pooled_stats  # noqa: E402
from napari_gpuseg.engine.sam.automatic.boxes import segment_boxes  # noqa: E402
from napari_gpuseg.engine.sam.loader import load_engine  # noqa: E402

from _machine import cpu_flags  # noqa: E402  (benchmarks/, the script's folder)

from _data import shared_data  # noqa: E402  (benchmarks/, the script's folder)
DATA = shared_data() / "bbbc039"
SETUPS = (("before", "per-box", False), ("views", "shared", False), ("field map", "shared", True))


def pieces(masks) -> int:
    return sum(ndi.label(m)[1] > 1 for m in masks)


def roughness(masks) -> float:
    return float(np.mean([float((m ^ ndi.binary_erosion(m)).sum()) ** 2 / m.sum() for m in masks if m.any()]))


def main(indices: list[int]) -> None:
    engine = load_engine()
    files = sorted((DATA / "images").glob("*.tif"))
    print(f"CPU flags: {cpu_flags()}")
    print("| field | boxes | set-up | masks in pieces (model output) | roughness | F1@0.5 |\n|---|---|---|---|---|---|")
    for i in indices:
        image = tifffile.imread(files[i])
        gt = tifffile.imread(DATA / "masks" / files[i].name)
        print(f"| {files[i].name} | | ground truth | | {roughness([gt == k for k in np.unique(gt)[1:]]):.1f} | |")
        boxes = detect_boxes(image, "unet")
        for name, routing, field in SETUPS:
            engine.cache.clear()
            kw = dict(padding=2, min_area=15, routing=routing, field=field)
            raw = segment_boxes(engine, image, boxes, one_piece=False, **kw)
            res = segment_boxes(engine, image, boxes, **kw)  # embeddings from the cache
            m = pooled_stats([gt], [res.labels], 0.5)
            f1 = 2 * m.tp / max(2 * m.tp + m.fp + m.fn, 1)
            print(f"| {files[i].name} | {len(boxes)} | {name} | {pieces([r.mask for r in raw.masks])} | "
                  f"{roughness([r.mask for r in res.masks]):.1f} | {f1:.3f} |", flush=True)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [17, 20])
