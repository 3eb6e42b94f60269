"""The first drop after napari starts: the annotator's first-layer warm-up against none.

    xvfb-run -a python benchmarks/first_layer.py [--pairs 3] [--kinds cold,warm]

Each trial is a fresh process (the work is one-off per process): a real napari window, the
SAM annotator docked and its model loaded, the worker idle; then the first BBBC039
validation field is added. Timed on the GUI thread: ``viewer.add_image`` and, after it,
until the dock follows the image (its prompt layers made). ``warm`` is the dock as shipped
(``widgets/_first_layer.py``: napari's layer imports and a garbage-collector pass in the
dock's worker, pint's unit registry and vispy's visuals on the GUI thread, when the dock
opens); ``cold`` replaces all of them with no-ops; ``novisuals`` the visuals and the
collector pass (the warm-up before visuals were added); ``nogc`` the collector pass only
(the warm-up before it was added).
Trials alternate between the kinds (``--kinds``, the first one is the baseline); medians
and the ratio baseline / kind are printed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _machine import cpu_flags, cpu_name  # noqa: E402  (benchmarks/, the script's folder)

DATA = HERE.parents[1] / "shared" / "data"


def trial(kind: str) -> dict:
    """One process: dock open and ready, then the first field dropped (runs in a child)."""
    import napari
    import tifffile
    from qtpy.QtWidgets import QApplication

    from napari_gpuseg.widgets import _first_layer
    from _viewer import pump

    if kind == "cold":
        _first_layer.import_layer_modules = lambda: 0.0
        _first_layer.build_unit_registry = lambda: None
    if kind in ("cold", "novisuals"):
        _first_layer.build_visuals = lambda: 0.0
    if kind in ("cold", "novisuals", "nogc"):
        _first_layer.collect_garbage = lambda: 0.0
    field = sorted((DATA / "bbbc039" / "images").glob("*.tif"))[16]
    viewer = napari.Viewer(show=True)
    app = QApplication.instance()
    _dock, w = viewer.window.add_plugin_dock_widget("napari-gpuseg", "SAM annotator")
    pump(app, lambda: "ready" in w.status.text(), 600)
    pump(app, lambda: not w.worker.busy, 600)
    img = tifffile.imread(field)
    t0 = time.perf_counter()
    viewer.add_image(img, name=field.stem)
    t1 = time.perf_counter()
    pump(app, lambda: w.image_layer is not None and w.box_layer is not None, 600)
    t2 = time.perf_counter()
    viewer.close()
    return {"add_image": t1 - t0, "follow": t2 - t1, "total": t2 - t0}


KINDS = ("cold", "novisuals", "nogc", "warm")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--kinds", default="cold,warm", help="comma-separated, of: " + ", ".join(KINDS))
    ap.add_argument("--child", choices=KINDS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(trial(args.child)), flush=True)
        return
    kinds = [k for k in args.kinds.split(",") if k]
    if len(kinds) < 2 or any(k not in KINDS for k in kinds):
        ap.error(f"--kinds: two or more of {', '.join(KINDS)}")
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    print(f"{cpu_name()} ({cpu_flags()}), {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}")
    rows: dict[str, list[dict]] = {k: [] for k in kinds}
    for _ in range(args.pairs):
        for kind in kinds:
            out = subprocess.run([sys.executable, __file__, "--child", kind], env=env, check=True,
                                 capture_output=True, text=True).stdout
            res = json.loads(out.strip().splitlines()[-1])
            rows[kind].append(res)
            print(f"{kind}: add_image {res['add_image']:.2f} s, dock following {res['follow']:.2f} s, "
                  f"total {res['total']:.2f} s", flush=True)
    med = {k: {part: statistics.median(r[part] for r in v) for part in ("add_image", "follow", "total")}
           for k, v in rows.items()}
    base = kinds[0]
    for part in ("add_image", "follow", "total"):
        for kind in kinds[1:]:
            print(f"median {part}: {base} {med[base][part]:.2f} s, {kind} {med[kind][part]:.2f} s, "
                  f"{base} / {kind} {med[base][part] / med[kind][part]:.2f}x")


if __name__ == "__main__":
    main()
