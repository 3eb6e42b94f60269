"""A first click while the tiles embed: when is its first look on screen, and its final mask?

    xvfb-run -a python benchmarks/click_first_look.py [--fields 2] [--clicks 8]
                                                      [--look-paint alternate|on|off]

A real napari window, the SAM annotator with its default model. Per held-out 520x696
BBBC039 field: the field is dropped, and once the dock's native tiles are embedded (its
finer click views still coming in the background), nuclei are clicked one after the other
(a positive point at the most interior pixel, the prompts cleared in between), each one
whose finer click view is not embedded yet. A first click is decoded twice: in its native
tile (the *first look*, shown at once) and in the finer view (the *final* mask), which the
encoder has to embed first. Clocked from the click: the first look painted, the final mask
painted. ``--look-paint alternate`` (the default) switches click by click whether the full
decode waits for the first look's paint (as shipped) or starts at once (the way before: the
finer view's encoder then holds Python's lock while the window paints the first look).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import tifffile

os.environ.setdefault("OMP_NUM_THREADS", "2")
DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import machine_line  # noqa: E402
from _viewer import pump as pump_until  # noqa: E402


def click_points(gt: np.ndarray) -> list[tuple[float, float]]:
    """(x, y) of each object's most interior pixel, objects of at least 200 px, shuffled."""
    from napari_gpuseg.engine.sam.training.simulated_prompts import interior_point

    ids = [i for i in np.unique(gt) if i and np.count_nonzero(gt == i) >= 200]
    pts = [tuple(float(v) for v in interior_point(gt == i)) for i in ids]
    order = np.random.default_rng(0).permutation(len(pts))
    return [pts[k] for k in order]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fields", type=int, default=2)
    ap.add_argument("--clicks", type=int, default=8, help="per field")
    ap.add_argument("--look-paint", choices=("alternate", "on", "off"), default="alternate")
    ap.add_argument("--data", default=str(DATA))
    args = ap.parse_args()

    import napari
    from qtpy.QtWidgets import QApplication

    from napari_gpuseg.engine.sam.interactive.predictor import Prompt

    print(machine_line(), flush=True)
    files = sorted((Path(args.data) / "bbbc039" / "images").glob("*.tif"))[16:16 + args.fields]
    viewer = napari.Viewer(show=True)
    app = QApplication.instance()
    _dock, w = viewer.window.add_plugin_dock_widget("napari-gpuseg", "SAM annotator")
    pump_until(app, lambda: "ready" in w.status.text())
    engine = w.session.engine()
    print(f"model: {w.model_name}; device: {engine.policy.describe()}", flush=True)

    stamps: dict[str, float] = {}
    show = w._show_mask

    def painted(*a, **kw):
        show(*a, **kw)
        app.processEvents()  # the repaint that makes it visible
        stamps.setdefault("look", time.perf_counter())
        if kw.get("final", True):
            stamps["final"] = time.perf_counter()
    w._show_mask = painted
    from napari_gpuseg.engine.annotate import steps

    predict, waits = steps.decode, {"on": True}

    def job_predict(engine_of, image, prompt, multimask, look=None, cancel=None):
        return predict(engine_of, image, prompt, multimask, look if waits["on"] else None, cancel=cancel)
    steps.decode = job_predict

    rows = []
    for f in files:
        viewer.layers.select_all()  # as first_mask.py: removing them one by one crashed
        viewer.layers.remove_selected()  # vispy's software-GL draw of the next image at times
        img = tifffile.imread(f)
        gt = tifffile.imread(f.parent.parent / "masks" / f.name)
        viewer.add_image(img, name=f.stem)
        pump_until(app, lambda: w.pos_layer is not None and w.pos_layer in viewer.layers, 60)
        pump_until(app, lambda: (w.session.tiles() or (0, 1))[0] >= len(engine.views(engine.prepare(img))), 120)
        prepared = engine.prepare(img)
        n = 0
        for x, y in click_points(gt):
            if n >= args.clicks:
                break
            prompt = Prompt(points=np.array([[x, y]]), labels=np.ones(1, np.int64))
            if engine.is_embedded(prepared, [engine.route(prepared, prompt)]):
                continue  # its finer view is there already: nothing to wait for
            waits["on"] = args.look_paint == "on" or (args.look_paint == "alternate" and n % 2 == 1)
            stamps.clear()
            t0 = time.perf_counter()
            w.pos_layer.add([[y, x]])
            pump_until(app, lambda: "final" in stamps, 60)
            rows.append((waits["on"], stamps["look"] - t0, stamps["final"] - t0))
            print(f"{f.stem} click ({x:.0f}, {y:.0f}), full decode "
                  f"{'after the paint' if waits['on'] else 'at once'}: first look {rows[-1][1] * 1000:.0f} ms, "
                  f"final {rows[-1][2] * 1000:.0f} ms", flush=True)
            w.clear_prompts()
            pump_until(app, lambda: not w.has_preview(), 10)
            time.sleep(0.2)
            n += 1
    med = statistics.median
    for on in (False, True):
        sub = [r for r in rows if r[0] == on]
        if sub:
            print(f"full decode {'after the first look is painted' if on else 'at once'} ({len(sub)} clicks): "
                  f"first look on screen median {med(r[1] for r in sub) * 1000:.0f} ms "
                  f"(p90 {np.percentile([r[1] for r in sub], 90) * 1000:.0f}), final mask median "
                  f"{med(r[2] for r in sub) * 1000:.0f} ms", flush=True)
    viewer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
