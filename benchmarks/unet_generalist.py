"""The bundled nuclei U-Net before and after retraining, in one run, through the folder job.

    OMP_NUM_THREADS=1 python benchmarks/unet_generalist.py [--old-rev 4ce1cff] [--new PATH]

Accuracy (object F1 at IoU 0.5 and 0.75, foreground IoU, pooled over the fields of a set)
on validation data neither model trained on: the last 8 fields of ``bbbc039/`` and the
``dsb2018/`` field. Two more rows, marked as such, show DSB2018 fields of ``dsb2018_more/``
that the new model never took a gradient step on but used to pick its best epoch (one
colour H&E field, one fluorescence field), and the fit on its colour training fields.
Throughput: fields/s of the folder job (``run_folder``, method ``unet``) over the 9
validation fields, old and new interleaved in ``--rounds`` rounds (best and median).

The old checkpoint is read from git history (``git show REV:napari_gpuseg/weights/...``)
into a temporary file; the new one is the checkpoint in the package unless ``--new``.
Data: ``../shared/data`` next to the repository, or ``NAPARI_GPUSEG_SHARED_DATA``.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import tifffile
import torch

from _machine import cpu_name  # benchmarks/, the script's folder
from napari_gpuseg.engine import metrics
from napari_gpuseg.engine.jobs.pipeline import output_paths, run_folder
from napari_gpuseg.engine.normalize import is_color
from napari_gpuseg.engine.unet.unet_checkpoint import bundled_model_path

REPO = Path(__file__).resolve().parents[1]
WEIGHTS = "napari_gpuseg/weights/unet_nuclei.pt"
SELECTION_ONLY = ("9f17aea854db1301.tif", "295682d9eb5acb5c.tif")  # the new model's epoch picking


def shared_data() -> Path:
    env = os.environ.get("NAPARI_GPUSEG_SHARED_DATA")
    path = Path(env) if env else REPO.parent / "shared" / "data"
    if not path.is_dir():
        raise SystemExit(f"data not found at {path} (set NAPARI_GPUSEG_SHARED_DATA)")
    return path


def old_checkpoint(rev: str, folder: Path) -> Path:
    out = folder / f"unet_nuclei_{rev}.pt"
    blob = subprocess.run(["git", "show", f"{rev}:{WEIGHTS}"], cwd=REPO, check=True, capture_output=True).stdout
    out.write_bytes(blob)
    return out


def stage(pairs, folder: Path) -> dict:
    """Copy images into ``folder``; returns {file name: ground-truth labels}."""
    folder.mkdir(parents=True)
    truth = {}
    for image, mask in pairs:
        shutil.copyfile(image, folder / image.name)
        truth[image.name] = tifffile.imread(mask)
    return truth


def segment(folder: Path, out: Path, model: Path) -> tuple[dict, float, int]:
    report = run_folder(folder, out, "unet", devices="cpu", precision="fp32", overwrite=True,
                        method_options={"model": str(model)})
    bad = [r for r in report.rows if r.status != "ok"]
    if bad:
        raise SystemExit(f"folder job failed: {bad[0].file}: {bad[0].error}")
    labels = {p.name: tifffile.imread(output_paths(folder, out, p)[0]) for p in sorted(folder.iterdir())}
    return labels, report.seconds, len(report.rows)


def score(truth: dict, labels: dict) -> dict:
    names = sorted(truth)
    return metrics.summary([truth[n] for n in names], [labels[n] for n in names])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old-rev", default="4ce1cff", help="git revision holding the old checkpoint")
    ap.add_argument("--new", default=None, help="new checkpoint (default: the one in the package)")
    ap.add_argument("--rounds", type=int, default=3, help="throughput rounds (old and new interleaved)")
    args = ap.parse_args()
    data = shared_data()
    tmp = Path(tempfile.mkdtemp(prefix="unet_generalist_"))
    try:
        models = {"old (" + args.old_rev + ")": old_checkpoint(args.old_rev, tmp),
                  "new": Path(args.new) if args.new else bundled_model_path()}
        bb = sorted((data / "bbbc039" / "images").glob("*.tif"))[16:]
        more = data / "dsb2018_more"
        colour = [p for p in sorted((more / "images").glob("*.tif")) if is_color(tifffile.imread(p))]
        sets = {
            "BBBC039 last 8 (validation)": [(p, data / "bbbc039" / "masks" / p.name) for p in bb],
            "dsb2018/ field (validation)": [(data / "dsb2018" / "image.tif", data / "dsb2018" / "mask.tif")],
            "dsb2018_more H&E 9f17 (new: epoch picking only)": [
                (more / "images" / SELECTION_ONLY[0], more / "masks" / SELECTION_ONLY[0])],
            "dsb2018_more fluo 2956 (new: epoch picking only)": [
                (more / "images" / SELECTION_ONLY[1], more / "masks" / SELECTION_ONLY[1])],
            "dsb2018_more colour, 6 trained on (new: fit)": [
                (p, more / "masks" / p.name) for p in colour if p.name not in SELECTION_ONLY],
        }
        print(f"machine: {cpu_name()}, {os.cpu_count()} cores, "
              f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32; "
              f"old = git {args.old_rev}:{WEIGHTS}, new = {models['new']}", flush=True)
        print("\n| data | fields | model | F1@0.5 | F1@0.75 | fg IoU | precision / recall @0.5 |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for k, (name, pairs) in enumerate(sets.items()):
            folder = tmp / f"set{k}"
            truth = stage(pairs, folder)
            for label, model in models.items():
                labels, _, _ = segment(folder, tmp / f"out{k}_{label[:3]}", model)
                m = score(truth, labels)
                print(f"| {name} | {len(pairs)} | {label} | {m['f1@0.5']:.3f} | {m['f1@0.75']:.3f} | "
                      f"{m['foreground_iou']:.3f} | {m['precision@0.5']:.3f} / {m['recall@0.5']:.3f} |", flush=True)
        speed_dir = tmp / "speed"
        stage(sets["BBBC039 last 8 (validation)"] + sets["dsb2018/ field (validation)"], speed_dir)
        rates = {label: [] for label in models}
        for _ in range(max(1, args.rounds)):
            for label, model in models.items():
                t0 = time.perf_counter()
                _, seconds, n = segment(speed_dir, tmp / f"speed_out_{label[:3]}", model)
                rates[label].append(n / (time.perf_counter() - t0))
        print("\n| folder job, 9 validation fields | best fields/s | median fields/s |")
        print("| --- | --- | --- |")
        for label, r in rates.items():
            print(f"| {label} | {max(r):.2f} | {statistics.median(r):.2f} |")
        old, new = (statistics.median(r) for r in rates.values())
        print(f"\nnew / old median throughput: {new / old:.2f}x ({args.rounds} rounds, interleaved)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
