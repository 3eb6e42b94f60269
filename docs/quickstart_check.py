"""The README's quick start, done as a user does it, in the window ``napari-gpuseg`` opens.

    QT_QPA_PLATFORM=xcb xvfb-run -a python docs/quickstart_check.py [--screenshots]

1. the window opened by the command's own code (``napari_gpuseg.cli.main``, with ``--no-run``:
   this script runs the event loop instead of ``napari.run()``), on the sample field, with
   the SAM annotator and the GPU monitor docked; nothing is waited for;
2. a left click on a nucleus of the canvas (a mouse click in the middle of the canvas, the
   camera moved over the nucleus): its mask in SAM preview;
3. ``Shift-N``, a click just outside the nucleus (a negative one), ``Shift-N`` again;
4. ``Shift-C``: the object in ``<image> SAM labels``;
5. that layer selected and saved as ``.tif`` (what *File > Save Selected Layers...* does),
   then read back with tifffile.

It prints each step with its time and what the window showed, and fails when a step does
not do what the README says. ``tests/test_docs.py`` runs :func:`walk` and checks that every
layer, dock, button, key and menu entry the quick start names is the one the window shows.
``--screenshots`` writes ``docs/images/quickstart_click.png`` (after step 2) and
``quickstart_saved.png`` (after step 4, the File menu open) at napari's default window size,
as on a first start (a settings file of its own: no window geometry saved by an earlier run).
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
WAIT_S = 300.0  # a decode on a busy 2-core CPU: generous, it is a bound, not a target


def _pump(app, until=None, seconds: float = WAIT_S, what: str = "") -> float:
    """Process events until ``until()`` (``TimeoutError(what)`` after ``seconds``), or for
    ``seconds`` when there is no condition; returns the seconds it took."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        app.processEvents()
        if until is not None and until():
            return time.perf_counter() - t0
        time.sleep(0.01)
    if until is not None:
        raise TimeoutError(f"quick start: {what} did not happen within {seconds:.0f} s")
    return seconds


def walk(out: Path, screenshots: Path | None = None, log=print) -> dict:
    """Do the five steps; returns what the window showed (names, texts, times, the IoU of the
    saved object with the true nucleus). ``screenshots``: a folder for the two pictures."""
    import napari
    import tifffile
    from qtpy.QtCore import QPoint, Qt
    from qtpy.QtTest import QTest
    from qtpy.QtWidgets import QApplication

    from napari_gpuseg.cli.main import DEFAULT_DOCKS, main
    from napari_gpuseg.engine.sam.training.simulated_prompts import interior_point, mask_iou
    from napari_gpuseg.sample_data import sample_dir

    out = Path(out)
    t0 = time.perf_counter()
    facts: dict = {"seconds": {}}

    def step(name: str, text: str) -> None:
        facts["seconds"][name] = round(time.perf_counter() - t0, 2)
        log(f"[{time.perf_counter() - t0:6.1f} s] {text}")

    # 1. Start it
    if main(["--no-run"]) != 0:
        raise RuntimeError("napari-gpuseg --no-run failed")
    viewer = napari.current_viewer()
    try:
        app = QApplication.instance()
        window = viewer.window._qt_window
        _pump(app, seconds=0.5)
        w = viewer.window.dock_widgets[f"{DEFAULT_DOCKS[0]} (napari-gpuseg)"]
        canvas = viewer.window._qt_viewer.canvas.native
        if min(canvas.width(), canvas.height()) < 100:
            raise RuntimeError(f"napari opened at {window.width()}x{window.height()} with a "
                               f"{canvas.width()}x{canvas.height()} px canvas (its settings remember no "
                               "window size but not a first start either): nothing to click on")
        facts.update(window=(window.width(), window.height()), docks=list(viewer.window.dock_widgets),
                     image=w.image_layer.name, active=viewer.layers.selection.active.name,
                     buttons=[b.text() for b in (w.commit_btn, w.clear_btn, w.undo_btn)],
                     status_start=w.status.text())
        step("window", f"1. window {window.width()}x{window.height()}, docks {facts['docks']}, "
                       f"active layer {facts['active']!r}, status {w.status.text()!r}")

        # 2. Click an object: a nucleus that touches another, near the middle of the field
        from scipy import ndimage as ndi

        gt = tifffile.imread(sample_dir() / "bbbc039_nuclei_masks.tif")
        middle = np.array(gt.shape) / 2
        touching = [i for i in np.unique(gt[gt > 0])
                    if ((ndi.binary_dilation(gt == i, iterations=2) & (gt != i)) & (gt > 0)).any()]
        oid = int(min(touching, key=lambda i: np.hypot(*(interior_point(gt == i)[::-1] - middle))))

        def click(y: int, x: int) -> None:
            viewer.scene.camera.center = (float(y), float(x))
            _pump(app, seconds=0.2)
            QTest.mouseClick(canvas, Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier,
                             QPoint(canvas.width() // 2, canvas.height() // 2))

        viewer.scene.camera.zoom = 2.0
        x, y = (int(v) for v in interior_point(gt == oid))  # the pixel farthest from its edge
        click(y, x)
        _pump(app, lambda: len(w.pos_layer.data) == 1, 10, "a point in SAM positive")
        _pump(app, lambda: w.has_preview() and w.status.text().startswith("preview"), what="the mask")
        first = w.session.result
        facts["click_iou"] = mask_iou(first.full(gt.shape), gt == oid)
        facts["preview_layer"] = w.preview_layer.name
        facts["positive_layer"] = w.pos_layer.name
        step("click", f"2. click on nucleus {oid} at ({y}, {x}): IoU {facts['click_iou']:.3f} "
                      f"with the true nucleus; status {w.status.text()!r}")
        if screenshots:
            _pump(app, seconds=1.0)
            viewer.screenshot(str(screenshots / "quickstart_click.png"), canvas_only=False)

        # 3. Correct it: Shift-N, a click just outside the nucleus, Shift-N back
        canvas.setFocus()
        QTest.keyClick(canvas, Qt.Key.Key_N, Qt.KeyboardModifier.ShiftModifier)
        _pump(app, lambda: viewer.layers.selection.active.name == "SAM negative", 10, "Shift-N")
        facts["negative_layer"] = viewer.layers.selection.active.name
        ys, xs = np.nonzero(ndi.binary_dilation(gt == oid, iterations=6) & (gt == 0))
        k = int(np.argmin((ys - y) ** 2 + (xs - x) ** 2))
        click(int(ys[k]), int(xs[k]))
        _pump(app, lambda: len(w.neg_layer.data) == 1, 10, "a point in SAM negative")
        _pump(app, lambda: w.has_preview() and w.session.result is not first
              and w.status.text().startswith("preview"), what="the corrected mask")
        facts["corrected_iou"] = mask_iou(w.session.result.full(gt.shape), gt == oid)
        QTest.keyClick(canvas, Qt.Key.Key_N, Qt.KeyboardModifier.ShiftModifier)
        _pump(app, lambda: viewer.layers.selection.active.name == "SAM positive", 10, "Shift-N back")
        step("correct", f"3. Shift-N, a negative click just outside: IoU {facts['corrected_iou']:.3f}; "
                        f"Shift-N again: {viewer.layers.selection.active.name!r} active")

        # 4. Commit with Shift-C
        QTest.keyClick(canvas, Qt.Key.Key_C, Qt.KeyboardModifier.ShiftModifier)
        _pump(app, lambda: w.status.text().startswith("committed"), 10, "Shift-C")
        labels = w.labels_layer
        facts["labels_layer"] = labels.name
        facts["layers"] = [ly.name for ly in viewer.layers]
        facts["keys"] = sorted(str(k).replace("+", "-") for k in viewer.keymap)
        step("commit", f"4. Shift-C: {w.status.text()!r}; {labels.name!r} holds ids "
                       f"{np.unique(labels.data).tolist()}")

        # 5. Save: the labels layer selected, what File > Save Selected Layers... does
        menu = next(a.menu() for a in window.menuBar().actions() if a.text().replace("&", "") == "File")
        facts["file_menu"] = [a.text().replace("&", "") for a in menu.actions() if a.text()]
        _select_in_layer_list(app, viewer, labels)
        if screenshots:  # the object right of the open menu
            viewer.scene.camera.center = (float(y), float(x) - 45)
            _show_menu(app, window, menu, "Save Selected Layers...")
            _grab_window(app, window, screenshots / "quickstart_saved.png")
            menu.close()
        path = out / "nuclei_labels.tif"
        saved = viewer.layers.save(str(path), selected=True)
        back = tifffile.imread(path)
        png = out / "nuclei_labels.png"  # a name ending in .png instead: napari's writer refuses int32
        with warnings.catch_warnings(record=True) as said:  # napari warns "No data written! ..."
            warnings.simplefilter("always")
            try:
                viewer.layers.save(str(png), selected=True)
            except Exception as exc:  # noqa: BLE001 - what the user would see, recorded
                facts["png_error"] = f"{type(exc).__name__}: {exc}"
        facts["png_saved"] = png.exists()
        if not png.exists():
            facts.setdefault("png_error", " ".join(str(m.message) for m in said) or "no file written")
        facts["saved_ids"] = np.unique(back).tolist()
        facts["saved_iou"] = mask_iou(back == 1, gt == oid)
        step("save", f"5. saved {saved}: ids {facts['saved_ids']}, IoU {facts['saved_iou']:.3f} "
                     f"with the true nucleus; as .png: {facts.get('png_error', 'saved')}")
    finally:
        viewer.close()
    return facts


def _select_in_layer_list(app, viewer, layer) -> None:
    """Scroll the layer list up to ``layer`` and click its row, as a user does."""
    from napari._qt.containers._base_item_view import index_of
    from qtpy.QtCore import Qt
    from qtpy.QtTest import QTest

    view = viewer.window._qt_viewer.layers
    bar = view.verticalScrollBar()
    bar.setValue(bar.minimum())  # at the default window size three rows show: the labels are second
    _pump(app, seconds=0.3)
    rect = view.visualRect(index_of(view.model(), layer))
    QTest.mouseClick(view.viewport(), Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier, rect.center())
    _pump(app, lambda: list(viewer.layers.selection) == [layer], 10, f"{layer.name} selected in the layer list")


def _show_menu(app, window, menu, entry: str) -> None:
    """Open ``menu`` under its menu-bar title with ``entry`` highlighted, as a user sees it."""
    bar = window.menuBar()
    title = next(a for a in bar.actions() if a.menu() is menu)
    menu.popup(bar.mapToGlobal(bar.actionGeometry(title).bottomLeft()))
    _pump(app, seconds=0.5)
    menu.setActiveAction(next(a for a in menu.actions() if a.text().replace("&", "") == entry))
    _pump(app, seconds=0.5)


def _grab_window(app, window, path: Path) -> None:
    """The screen under the window (an open menu included: it is a window of its own)."""
    from qtpy.QtWidgets import QApplication

    _pump(app, seconds=0.5)
    geo = window.frameGeometry()
    QApplication.primaryScreen().grabWindow(0, geo.x(), geo.y(), geo.width(), geo.height()).save(str(path))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    shots = HERE / "images" if "--screenshots" in sys.argv[1:] else None
    with tempfile.TemporaryDirectory(prefix="quickstart-") as tmp:
        # a first start: napari's own settings file, no window geometry from an earlier run
        os.environ.setdefault("NAPARI_CONFIG", str(Path(tmp) / "napari-settings.yaml"))
        result = walk(Path(tmp), shots)
    print({k: v for k, v in result.items() if k not in ("file_menu",)})
