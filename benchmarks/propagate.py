"""Propagate through a stack: one box per ground-truth object on its middle slice, then
SAM propagation both ways. Reports the mean 3D IoU per object, the share of objects whose
z-extent is right within one slice, and the time per slice with slices embedded in batches
vs one slice at a time (both in this run, interleaved, fresh embedding cache each).

    PYTHONPATH=. OMP_NUM_THREADS=2 python benchmarks/propagate.py [model] [--repeats N]
"""
from __future__ import annotations

import sys
import time

import numpy as np
import tifffile

from napari_gpuseg.engine.runtime.device import Policy
from napari_gpuseg.engine.sam.interactive.cache import EmbeddingCache
from napari_gpuseg.engine.sam.loader import DEFAULT_MODEL, load_engine
from napari_gpuseg.engine.sam.propagation.propagate import PropagateOptions, mask_box, propagate, propagate_all

from _data import shared_data  # noqa: E402  (benchmarks/, the script's folder)
DATA = shared_data() / "synthetic3d"


def objects(gt: np.ndarray):
    """(id, middle slice, box on it, (z0, z1)) per ground-truth object."""
    out = []
    for i in np.unique(gt)[1:]:
        zs = np.nonzero((gt == i).any(axis=(1, 2)))[0]
        mid = int(zs[len(zs) // 2])
        out.append((int(i), mid, mask_box(gt[mid] == i), (int(zs.min()), int(zs.max()))))
    return out


def score(gt, objs, results):
    ious, extent_ok = [], []
    for (i, _mid, _box, (z0, z1)), r in zip(objs, results):
        pred = r.volume(gt.shape)
        truth = gt == i
        ious.append(np.logical_and(pred, truth).sum() / np.logical_or(pred, truth).sum())
        e = r.extent
        extent_ok.append(e is not None and abs(e[0] - z0) <= 1 and abs(e[1] - z1) <= 1)
    return float(np.mean(ious)), float(np.mean(extent_ok)), ious


def main(argv) -> None:
    import torch

    model = argv[0] if argv and not argv[0].startswith("--") else DEFAULT_MODEL
    repeats = int(argv[argv.index("--repeats") + 1]) if "--repeats" in argv else 1
    image, gt = tifffile.imread(DATA / "image.tif"), tifffile.imread(DATA / "mask.tif")
    policy = Policy(torch.device("cpu"), "fp32")
    engine = load_engine(model, policy)
    objs = objects(gt)
    print(f"{DATA}: {image.shape}, {len(objs)} objects, model {model}, box_trained={engine.info.box_trained}")

    # quality: every object from its own box (propagate one object at a time)
    opts = PropagateOptions()
    results = [propagate(engine, image, mid, box, opts) for _i, mid, box, _e in objs]
    miou, ext, ious = score(gt, objs, results)
    print(f"defaults {opts}: mean 3D IoU {miou:.3f} (median {np.median(ious):.3f}), "
          f"z-extent within 1 slice {ext:.2%}", flush=True)
    variants = (PropagateOptions(min_contrast=0), PropagateOptions(min_iou=0.3, min_area_ratio=0.35),
                PropagateOptions(mask_input=True))
    for o in variants:
        m2, e2, _ = score(gt, objs, [propagate(engine, image, mid, box, o) for _i, mid, box, _e in objs])
        print(f"{o}: mean 3D IoU {m2:.3f}, z-extent within 1 slice {e2:.2%}", flush=True)

    # timing: all objects of the middle slice at once (Segment all objects in 3D) on the
    # slices z-4..z+4, fresh embedding cache per run, embed_batch 1 vs 4 interleaved
    z = image.shape[0] // 2
    sub = image[z - 4:z + 5]
    starts = [mask_box(gt[z] == i) for i in np.unique(gt[z])[1:]]
    times = {1: [], 4: []}
    for _ in range(repeats):
        for batch in times:
            engine.cache = EmbeddingCache()
            engine._memos.clear()
            t = time.perf_counter()
            res = propagate_all(engine, sub, 4, starts, PropagateOptions(embed_batch=batch))
            times[batch].append((time.perf_counter() - t) / sub.shape[0])
    base = np.median(times[1])
    print(f"propagate_all, {len(starts)} objects from slice {z}, slices {z - 4}..{z + 4} "
          f"({sum(len(r.masks) for r in res)} masks):")
    for batch, ts in times.items():
        print(f"  embed_batch={batch}: {np.median(ts) * 1000:.0f} ms per slice "
              f"(x{base / np.median(ts):.2f} vs one slice at a time)", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
