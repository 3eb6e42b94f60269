"""The Annotate folder loop measured: annotate a few, train the U-Net on them, segment the rest.

    python benchmarks/folder_train.py [--annotated 3] [--minutes 5] [--data bbbc039|scratch]

``bbbc039``: the 8 held-out BBBC039 fields (whole 520x696); ``scratch``: the scratch assay's
Hoechst nuclei, its training frames t00-t06 as the folder's first images and its validation
frames t07-t09 as the rest. The first ``--annotated`` images of the folder are annotated with
their ground truth (the stand-in for a corrected pre-segmentation) through
:class:`napari_gpuseg.engine.FolderAnnotation`; then, in one run:

- *before*: Segment the rest with the bundled U-Net (a copy of the folder);
- Train U-Net on annotated (the dock's default schedule, at most ``--minutes``);
- *after*: Segment the rest with the new model.

Prints the object F1 (IoU 0.5) of the rest against their ground truth before and after, the
training and Segment the rest times, with the CPU, its flags, the threads and the date.
"""
import argparse
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import tifffile

from _data import bbbc039_validation, shared_data
from _machine import machine_line


def pairs(data: str) -> list[tuple[Path, Path]]:
    if data == "bbbc039":
        return bbbc039_validation()
    d = shared_data() / "scratch_assay" / "nuclei"
    frames = [f"t0{i}" for i in range(10)]
    return [(d / "images" / f"{t}.tif", d / "masks" / f"{t}.tif") for t in frames]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--annotated", type=int, default=3)
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--data", choices=("bbbc039", "scratch"), default="bbbc039")
    args = ap.parse_args()

    from napari_gpuseg.engine import AnnotationSession, FolderAnnotation
    from napari_gpuseg.engine.annotate.folder import unet_presegmenter
    from napari_gpuseg.engine.annotate.folder_train import train_unet_on_annotated
    from napari_gpuseg.engine.metrics import object_f1
    from napari_gpuseg.engine.unet.finetune_annotated import default_schedule

    print(machine_line())
    found = pairs(args.data)
    if args.data == "scratch":  # training frames to annotate, validation frames as the rest
        found = found[:args.annotated] + found[7:]
    tmp = Path(tempfile.mkdtemp(prefix="gpuseg-folder-train-"))
    try:
        images = tmp / "images"
        images.mkdir()
        gts = {}
        for img, mask in found:
            shutil.copy(img, images / img.name)
            gts[img.stem] = tifffile.imread(mask)
        out = tmp / "out"
        f = FolderAnnotation(AnnotationSession(None), images, out, presegment=unet_presegmenter(), prefetch=False,
                             embed=False)
        for _ in range(args.annotated):
            f.session.labels[:] = gts[Path(f.current.name).stem]
            f.edited()
            f.next()
        rest = [im for im in f.images if im.state != "annotated"]
        f.goto(0)  # nothing open among the rest: all of it is segmented
        before_dir = tmp / "before"
        shutil.copytree(out, before_dir)
        g = FolderAnnotation(AnnotationSession(None), images, before_dir, presegment=unet_presegmenter(),
                             prefetch=False, embed=False, open_first=False)
        t0 = time.perf_counter()
        g.segment_rest()
        t_before = time.perf_counter() - t0
        g.close()

        def f1s(folder: Path) -> list[float]:
            return [object_f1(gts[Path(im.name).stem], tifffile.imread(folder / im.labels_path.name)) for im in rest]

        before = f1s(before_dir)
        config = replace(default_schedule(), max_time_s=60.0 * args.minutes)
        res = train_unet_on_annotated(f, config=config)
        t0 = time.perf_counter()
        f.segment_rest()
        t_after = time.perf_counter() - t0
        after = f1s(out)
        f.close()
        print(f"data {args.data}: {args.annotated} annotated, {len(rest)} to segment")
        print(f"train U-Net on annotated: {res.steps} steps in {res.seconds:.0f} s ({res.stopped}), "
              f"loss {res.losses[0]:.3f} -> {np.mean(res.losses[-10:]):.3f}")
        print(f"segment the rest: {t_before:.1f} s bundled, {t_after:.1f} s new model")
        print("F1@0.5 of the rest, bundled U-Net: " + " ".join(f"{v:.3f}" for v in before)
              + f"  mean {np.mean(before):.3f}")
        print("F1@0.5 of the rest, trained here:  " + " ".join(f"{v:.3f}" for v in after)
              + f"  mean {np.mean(after):.3f}")
        print(f"ratio after / before: {np.mean(after) / max(1e-9, np.mean(before)):.3f}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
