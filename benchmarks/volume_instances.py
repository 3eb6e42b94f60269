"""3D instances from the bundled 2D nuclei U-Net on a ZYX volume: per-slice labels (the
old behaviour), slices linked by overlap (what ``--method unet`` does now) and a 3D
watershed on the stacked probabilities, all from the same probabilities in one run.

    PYTHONPATH=. OMP_NUM_THREADS=2 python benchmarks/volume_instances.py [volume.tif mask.tif]
"""
from __future__ import annotations

import sys
import time

import numpy as np
import tifffile

from napari_gpuseg.engine import metrics
from napari_gpuseg.engine.unet import unet_checkpoint as unet_ckpt, predict as unet
from napari_gpuseg.engine.runtime.device import Policy
from napari_gpuseg.engine.stacks import link_slices

from _data import shared_data  # benchmarks/, the script's folder


def main(argv) -> None:
    import torch

    if len(argv) >= 2:
        img_path, gt_path = argv[0], argv[1]
    else:
        img_path, gt_path = shared_data() / "synthetic3d" / "image.tif", shared_data() / "synthetic3d" / "mask.tif"
    image, gt = tifffile.imread(img_path), tifffile.imread(gt_path)
    policy = Policy(torch.device("cpu"), "fp32")
    net = unet_ckpt.load_unet(None, device="cpu")
    probs = unet.predict_probabilities(net, image, policy=policy)  # (Z, 3, Y, X)
    post = net.meta.get("postprocess", {})
    print(f"{img_path}: {image.shape}, {len(np.unique(gt)) - 1} objects in the ground truth")
    print("| 3D instances | objects | 3D F1@0.5 | precision | recall | F1@0.75 | post-processing s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")

    def per_slice():
        return unet.probabilities_to_labels(probs, spatial_dims=2, **post)

    variants = {
        "per slice (before)": per_slice,
        "slices linked by overlap (now)": lambda: link_slices(per_slice()),
        "3D watershed on stacked probabilities": lambda: unet.probabilities_to_labels(
            np.moveaxis(probs, 1, 0), spatial_dims=3, **post),
    }
    for name, fn in variants.items():
        t0 = time.perf_counter()
        lab = fn()
        dt = time.perf_counter() - t0
        s = metrics.pooled_stats(gt, lab, 0.5)
        f75 = metrics.object_f1(gt, lab, 0.75)
        print(f"| {name} | {len(np.unique(lab)) - 1} | {s.f1:.3f} | {s.precision:.3f} | {s.recall:.3f} "
              f"| {f75:.3f} | {dt:.2f} |")
    print(f"foreground IoU of the model (same for all): {metrics.foreground_iou(gt, per_slice()):.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
