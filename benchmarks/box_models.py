"""Box mode (boxes -> SAM -> labels) with each SAM model, on the BBBC039 validation fields.

The 8 validation fields' central 256x256 crops (``[100:356, 200:456]``, one native view
each, 201 nuclei), three sources of boxes: the ground truth, the threshold detector and the
bundled U-Net (its own labels printed for reference). Each model decodes every box set with
``segment_boxes_batch`` (2 px padding); pooled F1 at IoU 0.5 and 0.75, foreground IoU, seconds.

    OMP_NUM_THREADS=2 python benchmarks/box_models.py [--models lite_medsam nuclei_sam]
"""
import argparse
import sys
import time
from pathlib import Path

import tifffile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from napari_gpuseg.engine.detect import boxes_from_labels, detect_boxes  # noqa: E402
from napari_gpuseg.engine.metrics import summary  # noqa: E402
from napari_gpuseg.engine.sam.automatic.boxes import segment_boxes_batch  # noqa: E402
from napari_gpuseg.engine.sam.loader import load_engine  # noqa: E402
from napari_gpuseg.engine.unet import unet_checkpoint as checkpoint, predict  # noqa: E402

from _data import bbbc039_validation  # noqa: E402
from _machine import machine_line  # noqa: E402

CROP = (slice(100, 356), slice(200, 456))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["lite_medsam", "nuclei_sam"])
    args = ap.parse_args(argv)
    print(machine_line())
    pairs = bbbc039_validation()
    imgs = [tifffile.imread(f)[CROP] for f, _m in pairs]
    gts = [tifffile.imread(m)[CROP] for _f, m in pairs]
    unet = checkpoint.load_unet(None, device="cpu")
    unet_labels = [predict.predict_labels(unet, im) for im in imgs]
    sources = {"ground truth": [boxes_from_labels(g) for g in gts],
               "threshold detector": [detect_boxes(im, "threshold") for im in imgs],
               "U-Net": [boxes_from_labels(lb) for lb in unet_labels]}
    print(f"{len(imgs)} crops, {sum(len(b) for b in sources['ground truth'])} objects\n")
    print("| model | boxes from | F1@0.5 | F1@0.75 | fg IoU | s |\n| --- | --- | ---: | ---: | ---: | ---: |")
    for name in args.models:
        engine = load_engine(name)
        for source, boxes in sources.items():
            t0 = time.perf_counter()
            res = segment_boxes_batch(engine, imgs, boxes, padding=2)
            s = summary(gts, [r.labels for r in res])
            print(f"| {name} | {source} | {s['f1@0.5']:.3f} | {s['f1@0.75']:.3f} | {s['foreground_iou']:.3f} "
                  f"| {time.perf_counter() - t0:.1f} |", flush=True)
    s = summary(gts, unet_labels)
    print(f"| (the U-Net's own labels) | | {s['f1@0.5']:.3f} | {s['f1@0.75']:.3f} | {s['foreground_iou']:.3f} | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
