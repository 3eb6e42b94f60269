"""Box edits on an embedded field: where an edit's time goes, and what the repaint hold costs.

    xvfb-run -a python benchmarks/edit_repaint.py [--edits 60] [--field 16]

A real napari window (LiteMedSAM, the dock open) shows a 520x696 BBBC039 field with all
its tiles embedded and the decoder warmed up. A ground-truth box near the middle is moved
by up to 3 px, ``--edits`` times; the clock stops when the window has been repainted with
the new mask. Edits alternate between the dock's repaint hold (update requests kept back:
Qt repaints what changed) and, as the same-run baseline, the window-wide hold it replaced
(the window's updates switched off: the release repaints every widget of the window).

Each edit is split (medians): napari's setter until the dock submits the decode, the
decode and its delivery to the GUI thread, the dock showing the preview, and the repaint
(of it: vispy's canvas draw).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import tifffile

os.environ.setdefault("OMP_NUM_THREADS", "2")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _viewer import pump as pump_until, window_wide_hold  # noqa: E402
from first_mask import DATA, central_box, corners  # noqa: E402

PARTS = ("setter", "decode + delivery", "show", "repaint", "total", "of it: canvas draw")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--edits", type=int, default=60)
    ap.add_argument("--field", type=int, default=16, help="index of the BBBC039 field")
    ap.add_argument("--data", default=str(DATA))
    args = ap.parse_args()

    import napari
    from qtpy.QtWidgets import QApplication
    from vispy.scene import SceneCanvas

    from napari_gpuseg.engine.runtime.device import set_policy

    policy = set_policy("auto", "auto")
    data = Path(args.data)
    f = sorted((data / "bbbc039" / "images").glob("*.tif"))[args.field]
    viewer = napari.Viewer(show=True)
    app = QApplication.instance()

    def pump(until):
        pump_until(app, until, 600.0)

    _dock, w = viewer.window.add_plugin_dock_widget("napari-gpuseg", "SAM annotator")
    pump(lambda: "ready" in w.status.text())
    stamps: dict[str, float] = {}
    show, submit = w._show_mask, w.session._submit_fn

    def timed_show(*a, **kw):
        stamps["gui"] = time.perf_counter()
        show(*a, **kw)
        stamps["shown"] = time.perf_counter()
        app.processEvents()  # the repaint that makes it visible
        stamps["painted"] = time.perf_counter()

    def timed_submit(fn, *a, **kw):
        if kw.get("tag") == "preview":
            stamps["submit"] = time.perf_counter()
        return submit(fn, *a, **kw)

    w._show_mask, w.session._submit_fn = timed_show, timed_submit
    draws: list[float] = []
    on_draw = SceneCanvas.on_draw

    def timed_draw(canvas, event):
        t = time.perf_counter()
        on_draw(canvas, event)
        draws.append(time.perf_counter() - t)

    SceneCanvas.on_draw = timed_draw

    redraw = w.joint_repaint
    hold, release = redraw.start, redraw.finish

    window_hold, window_release = window_wide_hold(w)

    img = tifffile.imread(f)
    box = central_box(tifffile.imread(data / "bbbc039" / "masks" / f.name))
    viewer.add_image(img, name=f.stem)
    pump(lambda: w.image_layer is not None and w.box_layer is not None)
    w.box_layer.data = [corners(box)]
    pump(lambda: "painted" in stamps)
    pump(lambda: w.session.is_embedded() and not w.worker.busy)  # tiles, decoder warm-up

    rng = np.random.default_rng(0)
    rows: dict[str, list] = {"hold": [], "window": []}
    for i in range(args.edits):
        mode = ("hold", "window")[i % 2]
        redraw.start, redraw.finish = (hold, release) if mode == "hold" else (window_hold, window_release)
        moved = box + rng.integers(-3, 4, 4)
        stamps.clear()
        draws.clear()
        t0 = time.perf_counter()
        w.box_layer.data = [corners(moved)]
        pump(lambda: "painted" in stamps)
        s = stamps
        rows[mode].append([(s["submit"] - t0) * 1e3, (s["gui"] - s["submit"]) * 1e3,
                           (s["shown"] - s["gui"]) * 1e3, (s["painted"] - s["shown"]) * 1e3,
                           (s["painted"] - t0) * 1e3, sum(draws) * 1e3])
        pump(lambda: not redraw.gathering)
    redraw.start, redraw.finish = hold, release

    print(f"device: {policy.describe()}; field {f.name}, {args.edits} edits")
    med = {}
    for mode, label in (("hold", "repaint hold (update requests kept)"),
                        ("window", "window-wide hold (baseline)")):
        a = np.array(rows[mode])
        med[mode] = np.median(a[:, 4])
        print(f"{label}: box edit -> mask visible median {med[mode]:.0f} ms, "
              f"p90 {np.percentile(a[:, 4], 90):.0f} ms over {len(a)} edits")
        print("  split, medians: " + ", ".join(f"{k} {v:.0f} ms" for k, v in zip(PARTS, np.median(a, 0))))
    print(f"window-wide / repaint hold: {med['window'] / med['hold']:.2f}x")
    viewer.close()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (Qt/GL objects of a closed viewer)


if __name__ == "__main__":
    main()
