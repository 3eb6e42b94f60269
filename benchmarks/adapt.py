"""Adapt the U-Net to a new kind of image: annotate -> fine-tune -> predict.

On the DSB2018 field (``shared/data/dsb2018``): the left half is annotated as a user
would (one ground-truth box per object that reaches into it -> LiteMedSAM masks via
``engine.sam.automatic.boxes.segment_boxes``), the bundled U-Net is fine-tuned on that half
(rectangle region; the right half is ignored in the loss) with the default schedule,
and the right half is predicted. Scores are object F1@0.5 against the ground truth on the
right half (objects cut by the middle line are cut in both), the bundled model scored in
the same run.

    OMP_NUM_THREADS=2 python benchmarks/adapt.py [--iters N] [--no-time-limit] [--annotation ann.tif]
        [--out results.md]
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
from _data import shared_data  # noqa: E402  (benchmarks/, the script's folder)
from _machine import cpu_name  # noqa: E402  (benchmarks/, the script's folder)
DATA = shared_data() / "dsb2018"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=None, help="override the schedule's iterations")
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-time-limit", action="store_true",
                    help="run every iteration of the schedule even on a loaded machine (no wall-clock cap)")
    ap.add_argument("--annotation", default=None, help="reuse (or write) the SAM annotation of the left half here")
    args = ap.parse_args()
    import tifffile

    from napari_gpuseg.engine.metrics import object_f1
    from napari_gpuseg.engine.detect import boxes_from_labels
    from napari_gpuseg.engine.sam.automatic.boxes import segment_boxes
    from napari_gpuseg.engine.sam.loader import load_engine
    from napari_gpuseg.engine.unet.finetune_annotated import default_schedule, finetune_unet
    from napari_gpuseg.engine.unet.unet_checkpoint import load_unet
    from napari_gpuseg.engine.unet.predict import predict_labels

    image = tifffile.imread(DATA / "image.tif")
    gt = tifffile.imread(DATA / "mask.tif")
    h, w = gt.shape
    half = w // 2
    rows = []

    def emit(s=""):
        print(s, flush=True)
        rows.append(s)

    # 1. annotate the left half: a box per ground-truth object reaching into it -> SAM
    boxes = boxes_from_labels(gt)
    left = boxes[boxes[:, 0] < half]
    t0 = time.perf_counter()
    if args.annotation and Path(args.annotation).is_file():
        ann = tifffile.imread(args.annotation)
        took = "reused"
    else:
        sam = segment_boxes(load_engine(), image, left, padding=2)
        ann = np.where(np.arange(w)[None, :] < half, sam.labels, 0)
        took = f"{time.perf_counter() - t0:.1f} s"
        if args.annotation:
            tifffile.imwrite(args.annotation, ann)
    sam_f1 = object_f1([gt[:, :half]], [ann[:, :half]], 0.5)
    emit(f"annotation: {len(left)} boxes -> LiteMedSAM masks ({took}); "
         f"their F1@0.5 vs ground truth on the left half {sam_f1:.3f}")

    def score(model_path):
        m = load_unet(model_path)
        pred = predict_labels(m, image)
        return (object_f1([gt[:, half:]], [pred[:, half:]], 0.5), object_f1([gt], [pred], 0.5))

    # 2. fine-tune from the bundled model (default schedule)
    cfg = default_schedule()
    if args.iters:
        cfg = replace(cfg, epochs=1, iters_per_epoch=args.iters)
    if args.no_time_limit:
        cfg = replace(cfg, max_time_s=None)
    losses = []
    out = Path(tempfile.mkdtemp()) / "dsb2018_unet_adapted.pt"
    c0, t0 = time.process_time(), time.perf_counter()
    res = finetune_unet(image, ann, region="rectangle", rectangle=(0, 0, h, half), config=cfg, out_path=out,
                        on_event=lambda e: losses.append(e.train_loss) if e.kind == "iter" else None)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    iters = res.history[-1]["iteration"] if res.history else 0
    emit(f"fine-tune: {iters} iterations (batch {cfg.batch_size}, crop {cfg.crop_size}), stopped: {res.stopped}; "
         f"wall {wall:.0f} s, process CPU {cpu:.0f} s; loss {losses[0]:.3f} -> {np.mean(losses[-10:]):.3f}")
    # 3. predict: bundled vs adapted, in the same run
    b_right, b_whole = score(None)
    a_right, a_whole = score(res.checkpoint)
    emit("")
    emit("| model | F1@0.5 right half (not annotated) | F1@0.5 whole field |")
    emit("| --- | --- | --- |")
    emit(f"| bundled | {b_right:.3f} | {b_whole:.3f} |")
    emit(f"| adapted (left half, default schedule) | {a_right:.3f} | {a_whole:.3f} |")
    emit("")
    emit(f"machine: {cpu_name()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, "
         f"load average {os.getloadavg()[0]:.1f}")
    if args.out:
        Path(args.out).write_text("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
