"""Box mode on full fields: encoder views, boxes/s and F1, per-box routing vs shared views.

    OMP_NUM_THREADS=2 python benchmarks/box_views.py [--fields 8] [--models nuclei_sam,lite_medsam] [--out FILE]

The 8 BBBC039 validation fields (the last 8 sorted by name, as in
``tests/test_automatic_quality.py``) at full size (520 x 696), ground-truth boxes
(``boxes_from_labels``, the method's 2 px padding), the SAM models of ``--models`` (default:
the package's default model, ``cells_nuclei_sam``; the rows in docs/benchmarks.md before
2026-11-26 used LiteMedSAM, the default then) under the device policy. Every field runs once per set-up, each in a fresh process with an empty
embedding cache, the set-ups taking turns field by field (A B C A B C ...) so all see the
same machine load. Time per field: ``segment_boxes`` alone (model loading excluded).

* ``before``: ``routing="per-box"`` (each small box its own zoomed view, each box its own
  routed view), no field map, every piece of a mask kept, allocator set-up off
  (``NAPARI_GPUSEG_MALLOC=0``): the program as it was;
* ``per-box``: the same with the allocator set-up on (what the rest adds on top of it);
* ``tiles``: shared views, each embedded on its own (``field=False``), one piece per mask,
  allocator set-up on;
* ``after``: the defaults: shared views, native ones cut from one embedding of the whole
  field where that needs fewer encoder passes (``engine/sam/interactive/field_map.py``), one piece per mask,
  allocator set-up on;
* ``after-nomalloc``: the same with glibc's defaults (a script that does not call
  ``configure_allocator()``).

The allocator set-up is ``configure_allocator()`` at the child's start, as the CLI and the
workers run it. Importing the package stopped doing it on 2026-11-24, and until 2026-11-26
this script still relied on the import: the ``on`` set-ups of its rows from those days (the
5.06x row in docs/benchmarks.md included) ran with glibc's defaults, so they compare the
routing and the field map only.

Every set-up runs the encoder's default CPU ops (``NAPARI_GPUSEG_CPU_FUSION`` is removed from
the children's environment).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from _machine import cpu_flags, cpu_name  # benchmarks/, the script's folder

ROOT = Path(__file__).resolve().parents[1]
from _data import shared_data  # noqa: E402  (benchmarks/, the script's folder)
DATA = shared_data() / "bbbc039"
SIZES = ((0, 8), (8, 16), (16, 24), (24, 10**6))  # box sides (px) quality is reported for
# set-up -> (routing, allocator set-up on "1" / off "0", field map "1" / "0", one piece per mask "1" / "0")
SETUPS = {"before": ("per-box", "0", "0", "0"), "per-box": ("per-box", "1", "0", "0"),
          "tiles": ("shared", "1", "0", "1"), "after": ("shared", "1", "1", "1"),
          "after-nomalloc": ("shared", "0", "1", "1")}


def fields(n: int) -> list[Path]:
    return sorted((DATA / "images").glob("*.tif"))[-8:][:n]


def child(field: str, routing: str, use_field: bool, one_piece: bool, model: str | None = None) -> dict:
    sys.path.insert(0, str(ROOT))
    from napari_gpuseg.engine.runtime.allocator import configure_allocator

    configure_allocator()  # as the workers and the CLI do on a CPU (a no-op with NAPARI_GPUSEG_MALLOC=0)
    import numpy as np
    import tifffile

    from napari_gpuseg.engine.metrics import pooled_stats
    from napari_gpuseg.engine.detect import boxes_from_labels
    from napari_gpuseg.engine.sam.automatic.boxes import segment_boxes
    from napari_gpuseg.engine.sam.loader import load_engine

    engine = load_engine(model or None)
    image = tifffile.imread(DATA / "images" / field)
    gt = tifffile.imread(DATA / "masks" / field)
    boxes = boxes_from_labels(gt)
    encoded = []  # input pixels per encoder call
    real = engine.encode
    engine.encode = lambda x: encoded.append(x.shape[0] * x.shape[2] * x.shape[3]) or real(x)
    t0 = os.times()
    res = segment_boxes(engine, image, boxes, padding=2, routing=routing, field=use_field,
                        one_piece=one_piece)
    t1 = os.times()
    m = pooled_stats([gt], [res.labels], 0.5)
    ids = np.unique(gt)[1:]  # box i <- label ids[i] (boxes_from_labels: increasing label order)
    side = np.maximum(boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1])
    per_box = []
    for i, r in enumerate(res.masks):  # each box's own mask against its object, before overlaps
        y, x = slice(r.y0, r.y0 + r.mask.shape[0]), slice(r.x0, r.x0 + r.mask.shape[1])
        g = gt == ids[i]
        inter = int((r.mask & g[y, x]).sum())
        per_box.append([int(side[i]), inter / max(int(g.sum()) + int(r.mask.sum()) - inter, 1)])
    return {"seconds": res.seconds, "boxes": len(boxes), "views": sum(encoded) / engine.input_size ** 2,
            "user": t1.user - t0.user, "sys": t1.system - t0.system, "tp": m.tp, "fp": m.fp, "fn": m.fn,
            "per_box": per_box}


def run_child(field: str, setup: str, model: str = "") -> dict:
    routing, malloc, use_field, one_piece = SETUPS[setup]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and k != "NAPARI_GPUSEG_CPU_FUSION"}
    env["NAPARI_GPUSEG_MALLOC"] = malloc
    load = os.getloadavg()[0]
    out = subprocess.run([sys.executable, __file__, "--child", field, "--routing", routing, "--field", use_field,
                          "--one-piece", one_piece] + (["--model", model] if model else []),
                         env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "load": load}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child")
    ap.add_argument("--routing", default="shared")
    ap.add_argument("--field", default="0")
    ap.add_argument("--one-piece", default="1")
    ap.add_argument("--fields", type=int, default=8)
    ap.add_argument("--setups", default="before,per-box,tiles,after")
    ap.add_argument("--models", default="", help="comma-separated SAM model names (default: the default model)")
    ap.add_argument("--model", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.routing, args.field == "1", args.one_piece == "1", args.model)),
              flush=True)
        return
    models = [m for m in args.models.split(",") if m] or [""]
    # a set-up per (model, set-up) pair, named "set-up" for one model and "set-up model" for several
    runs = [(s, m, s if len(models) == 1 else f"{s} {m}") for m in models for s in args.setups.split(",")]
    setups = [name for _s, _m, name in runs]
    kind = {name: s for s, _m, name in runs}
    res: dict = {name: [] for name in setups}
    t_start = time.time()
    for f in fields(args.fields):
        for s, m, name in runs:
            r = run_child(f.name, s, m)
            res[name].append(r)
            print(f.name, name, json.dumps({k: v for k, v in r.items() if k != "per_box"}), flush=True)
    lines = [f"date {datetime.date.today()}, {cpu_name()} ({cpu_flags()}), {os.cpu_count()} cores, "
             f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '-')}, {args.fields} fields, "
             f"set-ups taking turns per field, run took {time.time() - t_start:.0f} s", "",
             "| set-up | routing | allocator set-up | field map | one piece | boxes | encoder passes | s | boxes/s | vs before "
             "| user s | sys s | F1@0.5 (pooled) |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    base = None
    for s in setups:
        rs = res[s]
        boxes, secs = sum(r["boxes"] for r in rs), sum(r["seconds"] for r in rs)
        tp, fp, fn = (sum(r[k] or 0 for r in rs) for k in ("tp", "fp", "fn"))
        f1 = 2 * tp / max(2 * tp + fp + fn, 1)
        rate = boxes / secs
        base = base or (rate if kind[s] == "before" else None)
        su = SETUPS[kind[s]]
        lines.append(f"| {s} | {su[0]} | {'on' if su[1] == '1' else 'off'} | "
                     f"{'yes' if su[2] == '1' else 'no'} | {'yes' if su[3] == '1' else 'no'} | {boxes} | "
                     f"{sum(r['views'] for r in rs):.1f} | {secs:.1f} | {rate:.2f} | "
                     f"{rate / base if base else float('nan'):.2f}x | {sum(r['user'] for r in rs):.0f} | "
                     f"{sum(r['sys'] for r in rs):.0f} | {f1:.3f} |")
    lines += ["", "Each box's own mask (before overlaps are resolved) against its object, by the box's "
              "longest side: mean IoU (share with IoU >= 0.5)", "",
              "| set-up | " + " | ".join(f"{lo}-{hi - 1} px" if hi < 10**6 else f">= {lo} px" for lo, hi in SIZES)
              + " |", "|---" * (len(SIZES) + 1) + "|"]
    for s in setups:
        pb = [b for r in res[s] for b in r["per_box"]]
        cells = []
        for lo, hi in SIZES:
            ious = [iou for side, iou in pb if lo <= side < hi]
            cells.append(f"{sum(ious) / len(ious):.3f} ({sum(i >= 0.5 for i in ious) / len(ious):.2f}, "
                         f"n={len(ious)})" if ious else "-")
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    loads = [r["load"] for rs in res.values() for r in rs]
    lines[0] += f", load average (1 min) at the field starts {min(loads):.1f}-{max(loads):.1f}"
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
