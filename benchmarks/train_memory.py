"""Peak memory (RSS) of SAM decoder training on one 192 px image, per configuration.

    OMP_NUM_THREADS=2 python benchmarks/train_memory.py [--steps 2] [--model nuclei_sam] [--size 192]

Each configuration runs in its own process (a peak is per process) on the top-left
``--size`` px of the first BBBC039 training field, with the allocator set-up that
``train-sam`` and the training worker apply (``NAPARI_GPUSEG_MALLOC=0`` turns it off):

* ``train-sam, one pass`` (the baseline: how a step ran before): ``train-sam``'s defaults
  (4 views x 6 objects a step, 2 corrective rounds), every object of an episode through the
  decoder at once (``objects_per_pass`` unbounded);
* ``train-sam``: the same, ``objects_per_pass`` at its default (2 on a CPU);
* ``Adapt SAM``: the Adapt SAM dock's schedule (``few_object_config``: 1 view x 4 objects).

The losses of the first two must be equal (same seed, same objects and prompts: chunking
does not change what is learned). Prints the peak (``VmHWM``) after loading the model,
after embedding the views and after the steps, seconds a step, and the ratio of the peaks.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "2")

CONFIGS = ("train-sam, one pass", "train-sam", "Adapt SAM")


def _status() -> dict:
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(("VmHWM", "VmRSS")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) / 1024  # MiB
    return out


def child(name: str, steps: int, model: str, size: int) -> None:
    import numpy as np
    import tifffile

    from _data import shared_data
    from napari_gpuseg.engine import load_engine
    from napari_gpuseg.engine.runtime.allocator import configure_allocator
    from napari_gpuseg.engine.sam.training.adapt import few_object_config
    from napari_gpuseg.engine.sam.training.finetune import SamTuneConfig, finetune_sam

    allocator = configure_allocator()
    d = shared_data() / "bbbc039"
    f = sorted((d / "images").glob("*.tif"))[0]  # a training field
    img = tifffile.imread(f)[:size, :size]
    lab = tifffile.imread(d / "masks" / f.name)[:size, :size]
    rec = {"config": name, "allocator": allocator, "start_mib": _status()["VmHWM"]}
    engine = load_engine(model)
    rec["loaded_mib"] = _status()["VmHWM"]
    if name.startswith("train-sam"):  # train-sam's defaults on one image (no validation split)
        cfg = SamTuneConfig(max_steps=steps, views_per_image=None, eval_every=10**6)
        if name.endswith("one pass"):
            cfg.objects_per_pass = 10**6
    else:
        cfg = few_object_config(len(np.unique(lab)) - 1, minutes=60)
        cfg.max_steps = steps
    marks = {}
    losses, times = [], []

    def progress(done, total):
        marks["embedded_mib"] = _status()["VmHWM"]
        marks["t_embedded"] = time.perf_counter()

    def on_event(ev):
        losses.append(round(ev.loss, 6))
        times.append(time.perf_counter())

    res = finetune_sam([img], [lab], model=engine, config=cfg, progress=progress, on_event=on_event)
    rec.update(marks)
    rec["peak_mib"] = _status()["VmHWM"]
    rec["views"] = res.n_train_views
    rec["losses"] = losses
    steps_t = np.diff([marks["t_embedded"], *times])
    rec["s_per_step"] = round(float(np.median(steps_t)), 1) if len(steps_t) else None
    print("RESULT " + json.dumps(rec), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--model", default="nuclei_sam")
    ap.add_argument("--size", type=int, default=192)
    ap.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.steps, args.model, args.size)
        return 0
    from _machine import machine_line

    print(machine_line())
    print(f"{args.model}, one {args.size} px BBBC039 training crop, {args.steps} steps, "
          f"NAPARI_GPUSEG_MALLOC={os.environ.get('NAPARI_GPUSEG_MALLOC', '(unset: allocator set-up on)')}")
    rows = {}
    for name in args.configs:
        out = subprocess.run([sys.executable, __file__, "--child", name, "--steps", str(args.steps),
                              "--model", args.model, "--size", str(args.size)],
                             capture_output=True, text=True, cwd=os.path.dirname(os.path.abspath(__file__)))
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            print(f"{name}: failed (exit {out.returncode})\n{out.stderr[-2000:]}")
            continue
        r = rows[name] = json.loads(line[7:])
        print(f"{name:20s} peak {r['peak_mib']:7.0f} MiB  (loaded {r['loaded_mib']:.0f}, embedded "
              f"{r.get('embedded_mib', float('nan')):.0f})  {r['views']} views  {r['s_per_step']} s/step  "
              f"losses {r['losses']}  [{r['allocator']}]", flush=True)
    base, new = rows.get("train-sam, one pass"), rows.get("train-sam")
    if base and new:
        from napari_gpuseg.engine.sam.training.finetune import CPU_OBJECTS_PER_PASS

        same = len(base["losses"]) == len(new["losses"]) and all(
            abs(a - b) <= 1e-5 * max(1.0, abs(a)) for a, b in zip(base["losses"], new["losses"]))
        print(f"peak ratio one pass / {CPU_OBJECTS_PER_PASS} objects per pass: "
              f"{base['peak_mib'] / new['peak_mib']:.2f}x; same losses: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
