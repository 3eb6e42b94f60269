"""Adapt SAM's out-of-memory back-off on a real CUDA device (not a mocked error).

    python benchmarks/gpu_finetune_oom.py [--objects 256] [--steps 6] [--headroom 3]

Decoder fine-tuning (``finetune_sam``) halves the objects per training view when a step
runs out of GPU memory and goes on. This script measures the memory of a short run at one
object per view, caps PyTorch's allocator for this process at that peak plus ``--headroom``
times what the run added (``torch.cuda.set_per_process_memory_fraction``: a real CUDA
out-of-memory error beyond it), then fine-tunes with ``--objects`` objects per view: every
step the training loop tried (objects per view) is printed, with the steps done, the last
loss and the time. Two BBBC039 training fields, the default model, the device policy's
precision. Exit status 1 if no back-off happened, a step failed or a loss was not finite.
"""
from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import tifffile
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from napari_gpuseg.engine.runtime.device import make_policy  # noqa: E402
from napari_gpuseg.engine.sam.training import finetune as ft  # noqa: E402
from napari_gpuseg.engine.sam.loader import load_engine  # noqa: E402

from _data import shared_data  # noqa: E402  (benchmarks/, the script's folder)
from _machine import machine_line  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--objects", type=int, default=256, help="objects per view asked for")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--headroom", type=float, default=3.0)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 2
    print(machine_line())
    d = shared_data() / "bbbc039"
    files = sorted((d / "images").glob("*.tif"))[:2]  # training fields
    images = [tifffile.imread(f) for f in files]
    labels = [tifffile.imread(d / "masks" / f.name) for f in files]
    policy = make_policy("cuda", None)
    dev = torch.device("cuda", torch.cuda.current_device()) if policy.device.index is None else policy.device
    engine = load_engine("nuclei_sam", policy=policy)
    print(f"{torch.cuda.get_device_name(dev)}, {policy.precision}; fields {[f.stem for f in files]}")

    tried: list[int] = []
    real_step = ft._step

    def counted_step(engine, views, train, k, *rest):
        tried.append(k)
        return real_step(engine, views, train, k, *rest)

    ft._step = counted_step
    cache = tempfile.mkdtemp(prefix="gpuseg_oom_")  # the views are embedded once, then reused

    def run(objects: int, steps: int):
        cfg = ft.SamTuneConfig(max_steps=steps, objects_per_view=objects, eval_every=1000, val_objects=8)
        return ft.finetune_sam(images, labels, model=engine, config=cfg, cache_dir=cache)

    run(1, 1)  # embeddings cached, kernels loaded
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    tried.clear()
    run(1, 2)
    peak = torch.cuda.max_memory_allocated(dev)
    cap = peak + args.headroom * (peak - base)
    total = torch.cuda.get_device_properties(dev).total_memory
    print(f"one object per view: allocated {base / 2**20:.0f} MiB before, peak {peak / 2**20:.0f} MiB; "
          f"allocator capped at {cap / 2**20:.0f} MiB")
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(cap / total, dev)
    tried.clear()
    t0 = time.perf_counter()
    try:
        res = run(args.objects, args.steps)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, dev)
    seconds = time.perf_counter() - t0
    losses = [h["loss"] for h in res.history if h.get("loss") is not None]
    steps_done = len(losses)
    backoffs = sum(1 for a, b in zip(tried, tried[1:]) if b < a)
    print(f"asked {args.objects} objects per view: steps tried with {tried}")
    print(f"{backoffs} back-off(s) after out-of-memory errors; {steps_done}/{args.steps} steps done, "
          f"last loss {losses[-1] if losses else float('nan'):.4f}, {seconds:.1f} s (embedding cached)")
    ok = backoffs >= 1 and steps_done == args.steps and all(math.isfinite(v) for v in losses)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
