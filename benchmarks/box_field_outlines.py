"""Box-mode outlines with and without the field map (``segment_boxes(..., field=True)``).

    OMP_NUM_THREADS=2 python benchmarks/box_field_outlines.py [INDEX ...]

BBBC039 fields by index in sorted order (default 17 and 20, the screenshot's field and
another), boxes from the bundled U-Net detector, LiteMedSAM, ``min_area=15`` as the dock
uses. Per set-up: masks in more than one piece, and the mean boundary roughness
(boundary pixels squared over area; a circle of radius r gives about 4 pi). Each set-up
starts from an empty embedding cache.
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
from napari_gpuseg.engine.sam.boxes import segment_boxes  # noqa: E402
from napari_gpuseg.engine.sam.loader import load_engine  # noqa: E402

from _machine import cpu_flags  # noqa: E402  (benchmarks/, the script's folder)

DATA = ROOT.parent / "shared" / "data" / "bbbc039" / "images"


def outline_stats(masks) -> tuple[int, float]:
    pieces = sum(ndi.label(m.mask)[1] > 1 for m in masks)
    rough = [float((m.mask ^ ndi.binary_erosion(m.mask)).sum()) ** 2 / m.mask.sum() for m in masks if m.mask.any()]
    return pieces, float(np.mean(rough))


def main(indices: list[int]) -> None:
    engine = load_engine()
    files = sorted(DATA.glob("*.tif"))
    print(f"CPU flags: {cpu_flags()}")
    print("| field | boxes | set-up | masks in pieces | roughness |\n|---|---|---|---|---|")
    for i in indices:
        image = tifffile.imread(files[i])
        boxes = detect_boxes(image, "unet")
        for name, field in (("views", False), ("field map", True)):
            engine.cache.clear()
            res = segment_boxes(engine, image, boxes, padding=2, min_area=15, field=field)
            pieces, rough = outline_stats(res.masks)
            print(f"| {files[i].name} | {len(boxes)} | {name} | {pieces} | {rough:.1f} |", flush=True)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [17, 20])
