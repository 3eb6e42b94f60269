"""The window while a run's result arrives: the first-layer warm-up in the docks that add a
labels layer when they finish (SAM automatic, U-Net predict) or open a result (Batch folder)
against none.

    xvfb-run -a python benchmarks/result_stall.py [--pairs 3] [--docks automatic,unet,batch,bigread] [--size 256] [--tile 8]

Each trial is a fresh process (napari's one-off work for its first labels layer is paid
once per process): a real napari window with a BBBC039 validation field (cropped to
``--size``) already open, then the dock docked as a user opens it, 3 s of idle (the user
reading the dock), then Run. ``automatic`` is SAM automatic in *Segment everything* with its
default model (``nuclei_sam``), ``unet`` is U-Net predict with the bundled model. A 10 ms
``QTimer`` on the GUI thread records every tick from Run until the result is on screen;
the longest gap between ticks is how long the window froze. ``warm`` is the dock as shipped
(``widgets/_first_layer.py``: layer imports in the dock's worker and vispy's visuals on the
GUI thread when it opens), ``cold`` replaces the warm-up with a no-op. Trials alternate;
medians and the ratio cold / warm are printed.

``batch`` is the folder flow instead: an empty window, Batch folder docked, 3 s of idle, a
folder of two crops run with the ``threshold`` method, then the first result opened as a
double-click on its row does it (the image and its labels: the first layers of the process);
the timer runs from the double-click until both are on screen.

``bigread`` is the batch flow with a large result: the crop tiled ``--tile`` times each way
and written zlib-compressed (``--tile 8`` on a 520x696 field: 4160x5568, 23 megapixels), the
dock warmed up as shipped; ``gui`` reads the image and its labels on the GUI thread when the
row is opened (the way before), ``background`` as shipped (a reader thread, the layers added
once both are in memory).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _machine import cpu_flags, cpu_name  # noqa: E402  (benchmarks/, the script's folder)

DATA = Path(os.environ.get("NAPARI_GPUSEG_SHARED_DATA", HERE.parents[1] / "shared" / "data"))
DOCKS = {"automatic": "SAM automatic", "unet": "U-Net predict", "batch": "Batch folder",
         "bigread": "Batch folder"}
KINDS = {"bigread": ("gui", "background")}  # (baseline, as shipped); the others: cold, warm


class _Inline:
    """Stands in for ``threading.Thread``: runs the target at ``start()`` in the caller."""

    def __init__(self, target=None, args=(), **_kw):
        self._call = lambda: target(*args)

    def start(self) -> None:
        self._call()


def trial(kind: str, dock: str, size: int, tile: int = 1) -> dict:
    """One process: image open, dock opened, then one run timed (runs in a child)."""
    import napari
    import tifffile
    from qtpy.QtCore import Qt
    from qtpy.QtTest import QTest
    from qtpy.QtWidgets import QApplication

    from _viewer import pump

    if dock in ("batch", "bigread"):
        return batch_trial(kind, size, tile if dock == "bigread" else 1)
    if kind == "cold":
        from napari_gpuseg.widgets import sam_automatic, unet_predict

        sam_automatic.warm_up = unet_predict.warm_up = lambda *_a, **_k: None
    field = sorted((DATA / "bbbc039" / "images").glob("*.tif"))[-2]  # a validation field
    img = tifffile.imread(field)[:size, :size]
    viewer = napari.Viewer(show=True)
    app = QApplication.instance()
    viewer.add_image(img, name=field.stem)
    _dock, w = viewer.window.add_plugin_dock_widget("napari-gpuseg", DOCKS[dock])
    if dock == "automatic":
        k = next(i for i in range(w.mode_combo.count()) if "everything" in w.mode_combo.itemText(i).lower())
        w.mode_combo.setCurrentIndex(k)
    t_open = time.perf_counter()
    pump(app, lambda: time.perf_counter() - t_open > 3.0)
    name = f"{field.stem} SAM automatic" if dock == "automatic" else f"{field.stem} U-Net labels"
    res = watch(app, lambda: QTest.mouseClick(w.run_button, Qt.MouseButton.LeftButton),
                lambda: name in viewer.layers and w.run_button.isEnabled())
    res["objects"] = int(viewer.layers[name].data.max())
    viewer.close()
    return res


def watch(app, act, done) -> dict:
    """``act()``, then the event loop until ``done()`` and 1 s more (the first paint of the new
    layers), a 10 ms ``QTimer`` ticking on the GUI thread throughout: the seconds to ``done``
    (``run``) and the longest and 99th-percentile gaps between ticks."""
    import numpy as np
    from qtpy.QtCore import QTimer

    from _viewer import pump

    ticks: list[float] = []
    timer = QTimer()
    timer.setInterval(10)
    timer.timeout.connect(lambda: ticks.append(time.perf_counter()))
    timer.start()
    t0 = time.perf_counter()
    act()
    pump(app, done, 900)
    t_result = time.perf_counter()
    pump(app, lambda: time.perf_counter() - t_result > 1.0)
    timer.stop()
    gaps = np.diff([t0] + ticks)
    return {"run": t_result - t0, "stall": float(gaps.max()), "p99": float(np.percentile(gaps, 99))}


def batch_trial(kind: str, size: int, tile: int = 1) -> dict:
    """One process: an empty window, Batch folder run on two crops, the first result opened."""
    import tempfile

    import napari
    import numpy as np
    import tifffile
    from qtpy.QtCore import QTimer
    from qtpy.QtWidgets import QApplication

    from _viewer import pump

    if kind == "cold":
        from napari_gpuseg.widgets import batch_folder

        batch_folder.warm_up = lambda *_a, **_k: None
    fields = sorted((DATA / "bbbc039" / "images").glob("*.tif"))[-2:]  # validation fields
    with tempfile.TemporaryDirectory(prefix="result_stall_") as tmp:
        (Path(tmp) / "in").mkdir()
        for f in fields:
            img = np.tile(tifffile.imread(f)[:size, :size], (tile, tile))
            tifffile.imwrite(Path(tmp) / "in" / f.name, img, compression="zlib" if tile > 1 else None)
        viewer = napari.Viewer(show=True)
        app = QApplication.instance()
        _dock, w = viewer.window.add_plugin_dock_widget("napari-gpuseg", DOCKS["batch"])
        w.in_dir.setText(str(Path(tmp) / "in"))
        w.out_dir.setText(str(Path(tmp) / "out"))
        w.method.setCurrentText("threshold")
        t_open = time.perf_counter()
        pump(app, lambda: time.perf_counter() - t_open > 3.0)
        w.start()
        pump(app, lambda: not w.running and w.table.rowCount() == len(fields), 600)
        if kind == "gui":  # the way before: the files read on the GUI thread
            from napari_gpuseg.widgets import batch_folder

            # only the dock module's name: replacing threading.Thread itself would make every
            # later thread of the process (napari's, the worker's) run inline too
            batch_folder.threading = types.SimpleNamespace(Thread=_Inline)
        res = watch(app, lambda: QTimer.singleShot(0, lambda: w.table.cellDoubleClicked.emit(0, 0)),
                    lambda: len(viewer.layers) == 2)
        res["objects"] = int(viewer.layers[-1].data.max())
        viewer.close()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--docks", default="automatic,unet", help="comma-separated, of: " + ", ".join(DOCKS))
    ap.add_argument("--size", type=int, default=256, help="crop of the field, px a side")
    ap.add_argument("--tile", type=int, default=8, help="bigread: the crop tiled this many times each way")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(trial(args.child[0], args.child[1], args.size, args.tile)), flush=True)
        return
    docks = [d for d in args.docks.split(",") if d]
    if not docks or any(d not in DOCKS for d in docks):
        ap.error(f"--docks: of {', '.join(DOCKS)}")
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    print(f"{cpu_name()} ({cpu_flags()}), {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}, "
          f"{args.size}x{args.size} crop")
    for dock in docks:
        base, shipped = KINDS.get(dock, ("cold", "warm"))
        rows: dict[str, list[dict]] = {base: [], shipped: []}
        for i in range(args.pairs):
            for kind in ((base, shipped) if i % 2 == 0 else (shipped, base)):
                out = subprocess.run([sys.executable, __file__, "--size", str(args.size), "--tile", str(args.tile),
                                      "--child", kind, dock],
                                     env=env, check=True, capture_output=True, text=True).stdout
                res = json.loads(out.strip().splitlines()[-1])
                rows[kind].append(res)
                print(f"{dock} {kind}: run {res['run']:.2f} s, longest stall {res['stall'] * 1000:.0f} ms, "
                      f"p99 {res['p99'] * 1000:.0f} ms, {res['objects']} objects", flush=True)
        med = {k: statistics.median(r["stall"] for r in v) for k, v in rows.items()}
        print(f"{dock}: median longest stall {base} {med[base] * 1000:.0f} ms, {shipped} {med[shipped] * 1000:.0f} ms, "
              f"{base} / {shipped} {med[base] / med[shipped]:.2f}x", flush=True)


if __name__ == "__main__":
    main()
