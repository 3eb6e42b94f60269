"""Measuring which candidate a first click keeps (``choose_click_output``, the last part of
Adapt SAM and of ``scripts/calibrate_iou_head.py --choose-output``): every rule decoded
separately (the way before) vs each object's clicks decoded once and kept for every rule
(``SamEngine.reuse_decodes``), in one run, on the same objects.

    python benchmarks/click_choice.py [--frames 0 1] [--cap 15] [--model cells_nuclei_sam] [--rounds 2]

Objects: at most ``--cap`` whole cells per ``scratch_assay`` training frame (seed 0), as
Adapt SAM measures the objects a user annotated. The embeddings are made before the clock
starts (both setups read the same cached views), so the times are the decoder's work. The
two setups alternate ``--rounds`` times; the choices must be identical.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")
import numpy as np  # noqa: E402
import tifffile  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _data import shared_data  # noqa: E402
from _machine import machine_line  # noqa: E402
from napari_gpuseg.engine import load_engine  # noqa: E402
from napari_gpuseg.engine.sam.training.click_choice import choose_click_output  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--cap", type=int, default=15)
    ap.add_argument("--model", default="cells_nuclei_sam")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    print(machine_line())
    d = shared_data() / "scratch_assay" / "cells"
    fields = [(tifffile.imread(d / "images" / f"t{t:02d}.tif"), tifffile.imread(d / "masks" / f"t{t:02d}.tif"),
               args.cap) for t in args.frames]
    engine = load_engine(args.model)
    choose_click_output(engine, fields)  # embeds the views the clicks need; warms the decoder memos
    reuse = engine.reuse_decodes
    times = {"separately": [], "decoded once": []}
    choices = {}
    for _ in range(args.rounds):
        for name in times:
            engine.reuse_decodes = reuse if name == "decoded once" else contextlib.nullcontext
            t0 = time.perf_counter()
            choice = choose_click_output(engine, fields)
            times[name].append(time.perf_counter() - t0)
            choices[name] = choice.record()
    engine.reuse_decodes = reuse
    n = choices["separately"]["objects"]
    for name, ts in times.items():
        print(f"{name:13s}: {np.median(ts):6.2f} s median of {len(ts)} ({n} objects, 5 rules)  {choices[name]}")
    assert choices["separately"] == choices["decoded once"], "the two setups chose differently"
    print(f"ratio separately / decoded once: {np.median(times['separately']) / np.median(times['decoded once']):.2f}x "
          "(the same choice and IoUs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
