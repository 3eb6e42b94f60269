"""A box dragged on the canvas: what one mouse move costs the window, the mesh shader kept vs compiled again.

    xvfb-run -a python benchmarks/mesh_shader.py [--drags 20] [--moves 8]

A real napari window shows a 520x696 BBBC039 field, a labels layer over it (as the annotator's
labels and preview) and a shapes layer with one box, selected, in select mode: the annotator's
**SAM boxes** as a user drags a box. Each drag is a press on the box, ``--moves`` mouse moves of
1-3 px and a release, sent as Qt mouse events into the canvas; every move is timed from the
event to the end of the canvas repaint it causes (``repaint()``: Qt paints at once). Drags
alternate between vispy's mesh as it is (a new colour-transform function at each data change:
the program is generated, compiled and linked again, vispy issue 2568) and the mesh keeping its
compiled shader (``widgets/_mesh_shader.py``, installed by the annotator dock): the same-run
baseline and the variant. Prints medians and p90 of a move, and the ratio.
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
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import machine_line  # noqa: E402
from first_mask import DATA, central_box, corners  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drags", type=int, default=20)
    ap.add_argument("--moves", type=int, default=8)
    ap.add_argument("--field", default="IXMtest_A02_s1.tif")
    args = ap.parse_args()

    import napari
    from qtpy.QtCore import QEvent, QPointF, Qt
    from qtpy.QtGui import QMouseEvent
    from qtpy.QtWidgets import QApplication

    from napari_gpuseg.widgets import _mesh_shader as mesh_shader

    img = tifffile.imread(Path(DATA) / "bbbc039" / "images" / args.field)
    gt = tifffile.imread(Path(DATA) / "bbbc039" / "masks" / args.field)
    viewer = napari.Viewer(show=True)
    viewer.window._qt_window.resize(1400, 900)
    viewer.add_image(img, name="field")
    viewer.add_labels(np.zeros(img.shape, np.int32), name="labels")
    viewer.add_labels(np.zeros(img.shape, np.int32), name="preview")
    box = central_box(gt, (0.5, 0.5))
    shapes = viewer.add_shapes([corners(box)], shape_type="rectangle", name="boxes", edge_color="yellow",
                               face_color="transparent")
    shapes.mode = "select"
    shapes.selected_data = {0}
    app = QApplication.instance()
    for _ in range(20):
        app.processEvents()
        time.sleep(0.02)
    canvas = viewer.window._qt_viewer.canvas
    native = canvas._scene_canvas.native
    to_canvas = canvas.view.transform * canvas.view.scene.transform

    def pixel(row, col):
        p = to_canvas.map([float(col), float(row)])
        return QPointF(float(p[0] / p[3]), float(p[1] / p[3]))

    def send(kind, pos, button, buttons):
        app.sendEvent(native, QMouseEvent(kind, pos, native.mapToGlobal(pos), button, buttons,
                                          Qt.KeyboardModifier.NoModifier))

    draws = [0]
    canvas._scene_canvas.events.draw.connect(lambda _e: draws.__setitem__(0, draws[0] + 1), position="last")

    def painted():  # process events until the canvas has drawn once more
        n, t_end = draws[0], time.perf_counter() + 2.0
        while draws[0] == n and time.perf_counter() < t_end:
            app.processEvents()

    left, none = Qt.MouseButton.LeftButton, Qt.MouseButton.NoButton
    rng = np.random.default_rng(0)
    times: dict[bool, list[float]] = {False: [], True: []}
    for d in range(args.drags + 2):  # the first two warm both ways up and are not counted
        kept = d % 2 == 1
        (mesh_shader.install if kept else mesh_shader.uninstall)()
        (x0, y0, x1, y1) = shapes.data[0][:, ::-1].min(0).tolist() + shapes.data[0][:, ::-1].max(0).tolist()
        row, col = (y0 + y1) / 2, (x0 + x1) / 2
        send(QEvent.Type.MouseButtonPress, pixel(row, col), left, left)
        painted()
        for _ in range(args.moves):
            row, col = row + rng.integers(-3, 4), col + rng.integers(-3, 4)
            t0 = time.perf_counter()
            send(QEvent.Type.MouseMove, pixel(row, col), none, left)
            painted()
            if d >= 2:
                times[kept].append((time.perf_counter() - t0) * 1000)
        send(QEvent.Type.MouseButtonRelease, pixel(row, col), left, none)
        painted()
    moved = not np.allclose(shapes.data[0], corners(box))
    mesh_shader.uninstall()
    print(machine_line())
    print(f"a 520x696 field, two labels layers, one box dragged: {args.drags} drags x {args.moves} moves, "
          "each move timed from the mouse event to the canvas's next draw")
    for kept in (False, True):
        t = times[kept]
        print(f"  {('mesh shader compiled again (vispy as it is)', 'mesh shader kept (as shipped)')[kept]}: "
              f"median {statistics.median(t):.1f} ms, p90 {np.percentile(t, 90):.1f} ms over {len(t)} moves")
    print(f"  the box moved: {moved}")
    print(f"  ratio (median): {statistics.median(times[False]) / statistics.median(times[True]):.2f}x")
    viewer.close()


if __name__ == "__main__":
    main()
