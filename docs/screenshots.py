"""Regenerate the README screenshots (real napari window under Xvfb).

    QT_QPA_PLATFORM=xcb xvfb-run -a -s "-screen 0 1600x1000x24" python docs/screenshots.py [NAME ...]
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np
import tifffile

os.environ.setdefault("OMP_NUM_THREADS", "2")
HERE = Path(__file__).resolve().parent
OUT = HERE / "images"
DATA = Path(os.environ.get("NAPARI_GPUSEG_SHARED_DATA") or HERE.parents[1] / "shared" / "data")


def pump(app, until=None, seconds=None):
    """Process events until ``until()`` is true (at most 600 s) or for ``seconds``."""
    if seconds is None:
        seconds = 2.0 if until is None else 600.0
    until = until or (lambda: False)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        app.processEvents()
        if until():
            break
        time.sleep(0.01)
    for _ in range(20):
        app.processEvents()
        time.sleep(0.02)


def annotator(viewer, app):
    from skimage.measure import regionprops

    f = sorted((DATA / "bbbc039" / "images").glob("*.tif"))[17]
    img = tifffile.imread(f)
    gt = tifffile.imread(DATA / "bbbc039" / "masks" / f.name)
    viewer.add_image(img, name="BBBC039 nuclei", contrast_limits=(0, np.percentile(img, 99.8)))
    _d, w = viewer.window.add_plugin_dock_widget("napari-gpuseg", "SAM annotator")
    viewer.window.add_plugin_dock_widget("napari-gpuseg", "GPU monitor")
    pump(app, lambda: w.session.is_embedded())
    props = [p for p in regionprops(gt) if 60 < p.centroid[0] < 300 and 60 < p.centroid[1] < 400]
    for p in props[:10]:  # one click per nucleus (the default model is tuned for clicks)
        r, c = p.coords[len(p.coords) // 2]
        w.pos_layer.add(np.array([[r, c]], float))
        pump(app, w.has_preview, 120)
        w.commit()
    p = props[10]
    r, c = p.coords[len(p.coords) // 2]
    w.pos_layer.add(np.array([[r, c]], float))
    pump(app, w.has_preview, 120)
    viewer.scene.camera.zoom = 1.6
    viewer.scene.camera.center = (180, 230)
    pump(app)


def annotate_folder(viewer, app):
    """Annotate folder in the middle of a folder of held-out BBBC039 cuts: the first image
    annotated with clicks, one skipped, the third open."""
    import tempfile

    from skimage.measure import regionprops

    root = Path(tempfile.mkdtemp(prefix="annotate-folder-"))
    (root / "images").mkdir()
    gts = []
    for f in sorted((DATA / "bbbc039" / "images").glob("*.tif"))[-6:]:
        tifffile.imwrite(root / "images" / f.name, tifffile.imread(f)[130:386, 220:476])
        gts.append(tifffile.imread(DATA / "bbbc039" / "masks" / f.name)[130:386, 220:476])
    _d, dock = viewer.window.add_plugin_dock_widget("napari-gpuseg", "Annotate folder")
    dock.open(root / "images", root / "labels")
    w = dock.annotator
    pump(app, lambda: w.image_layer is not None and w.session.is_embedded())
    props = [p for p in regionprops(gts[0]) if 20 < p.centroid[0] < 236 and 20 < p.centroid[1] < 236]
    for p in props[:6]:
        r, c = p.coords[len(p.coords) // 2]
        w.pos_layer.add(np.array([[r, c]], float))
        pump(app, w.has_preview, 120)
        w.commit()
    pump(app, seconds=1.5)  # the labels saved
    dock.next()
    pump(app, lambda: w.image_layer is not None and w.image_layer.name == dock.image_layer.name)
    dock.skip()
    pump(app, lambda: w.image_layer is not None and w.image_layer.name == dock.image_layer.name)
    pump(app, lambda: w.session.is_embedded())


def propagate(viewer, app):
    """One nucleus of synthetic3d boxed on its middle slice, propagated through the stack."""
    from napari_gpuseg.engine.sam.propagation.propagate import mask_box

    vol = tifffile.imread(DATA / "synthetic3d" / "image.tif")
    gt = tifffile.imread(DATA / "synthetic3d" / "mask.tif")
    viewer.add_image(vol, name="synthetic3d")
    _d, w = viewer.window.add_plugin_dock_widget("napari-gpuseg", "SAM annotator")
    z = 11
    viewer.dims.set_current_step(0, z)
    pump(app, lambda: w.session.is_embedded())
    x0, y0, x1, y1 = mask_box(gt[z] == 33, 1)
    w.box_layer.add_rectangles(np.array([[z, y0, x0], [z, y0, x1], [z, y1, x1], [z, y1, x0]], float))
    pump(app, w.has_preview, 120)
    w.propagate_panel.propagate()
    pump(app, lambda: "propagated" in w.status.text(), 900)
    for ly in (w.box_layer, w.preview_layer):
        ly.visible = False
    viewer.dims.ndisplay = 3
    viewer.camera.angles = (0, 35, 60)
    pump(app)


def annotator_cells_click(viewer, app):
    """One click per cell with the default model on a held-out scratch-assay frame (t07): five
    cells committed, the sixth in preview. Prints the six first masks' mean IoU with the true
    outlines (the figure's caption quotes it)."""
    from scipy import ndimage as ndi
    from skimage.measure import regionprops

    d = DATA / "scratch_assay" / "cells"
    img = tifffile.imread(d / "images" / "t07.tif")
    gt = tifffile.imread(d / "masks" / "t07.tif")
    viewer.add_image(img, name="t07", contrast_limits=tuple(np.percentile(img, (0.5, 99.8))))
    _d, w = viewer.window.add_plugin_dock_widget("napari-gpuseg", "SAM annotator")
    pump(app, lambda: w.session.is_embedded())
    h, wd = gt.shape
    props = [p for p in regionprops(gt) if p.area >= 150 and min(p.bbox[:2]) > 3
             and p.bbox[2] < h - 3 and p.bbox[3] < wd - 3]
    props.sort(key=lambda p: np.hypot(p.centroid[0] - h / 2, p.centroid[1] - wd / 2))  # one region
    ious = []
    for k, p in enumerate(props[:6]):
        obj = gt == p.label
        depth = ndi.distance_transform_edt(obj)
        r, c = np.unravel_index(int(np.argmax(depth)), depth.shape)  # the most interior pixel
        w.pos_layer.add(np.array([[r, c]], float))
        pump(app, lambda: w.has_preview() and w.session.final, 300)  # the full mask, not a first look
        mask = w.session.result.full(gt.shape)
        ious.append((mask & obj).sum() / max(1, (mask | obj).sum()))
        print(f"cell {p.label}: IoU {ious[-1]:.3f}; {w.status.text()}", flush=True)
        if k < 5:
            w.commit()
    print(f"six first masks, mean IoU {np.mean(ious):.3f}", flush=True)
    rows, cols = zip(*(p.centroid for p in props[:6]))
    viewer.camera.zoom = 3.0
    viewer.camera.center = ((min(rows) + max(rows)) / 2, (min(cols) + max(cols)) / 2)
    pump(app)


def annotator_adapted_cells(viewer, app):
    """Whole cells of a scratch-assay training frame: ten committed with boxes (from the ground
    truth, as a user draws them), the decoder adapted to them (a short budget for the picture),
    then a few more cells clicked with the adapted decoder."""
    from skimage.measure import regionprops

    d = DATA / "scratch_assay" / "cells"
    img = tifffile.imread(d / "images" / "t00.tif")
    gt = tifffile.imread(d / "masks" / "t00.tif")
    viewer.add_image(img, name="t00 cells", contrast_limits=tuple(np.percentile(img, (0.5, 99.8))))
    _d, w = viewer.window.add_plugin_dock_widget("napari-gpuseg", "SAM annotator")
    pump(app)  # boxes need not wait for the tiles: each embeds its own view first
    h, wd = gt.shape
    props = [p for p in regionprops(gt) if p.area >= 150 and min(p.bbox[:2]) > 3
             and p.bbox[2] < h - 3 and p.bbox[3] < wd - 3]
    props.sort(key=lambda p: np.hypot(p.centroid[0] - h / 2, p.centroid[1] - wd / 4))  # one region
    for p in props[:10]:
        r0, c0, r1, c1 = p.bbox
        x0, y0, x1, y1 = c0 - 3, r0 - 3, c1 + 3, r1 + 3
        w.box_layer.add_rectangles(np.array([[y0, x0], [y0, x1], [y1, x1], [y1, x0]], float))
        pump(app, lambda: w.has_preview() and w.session.final, 300)  # the full mask, not a first look
        w.commit()
    panel = w.adapt_panel
    panel.minutes.setValue(2.5)
    panel.adapt()
    pump(app, lambda: not panel.running, 900)
    r = panel.result
    print(f"adapted: {r.objects} cells, {r.steps} steps, {r.seconds:.0f} s" if r else "not adapted", flush=True)
    for p in props[10:13]:  # a click on each of a few more cells, committed with the adapted decoder
        r, c = (int(v) for v in p.coords[len(p.coords) // 2])
        w.pos_layer.add(np.array([[r, c]], float))
        pump(app, lambda: w.has_preview() and w.session.final, 300)  # the full mask, not a first look
        print(w.status.text(), flush=True)
        w.commit()
    viewer.layers.selection.active = w.labels_layer
    viewer.camera.zoom = 2.6
    viewer.camera.center = (105, 140)
    w.content.parentWidget().parentWidget().ensureWidgetVisible(panel)  # the adapt controls in view
    pump(app)


def gpu_monitor(viewer, app):
    viewer.open_sample("napari-gpuseg", "bbbc039")
    viewer.window.add_plugin_dock_widget("napari-gpuseg", "GPU monitor")
    pump(app, seconds=4)


def unet_predict(viewer, app):
    f = sorted((DATA / "bbbc039" / "images").glob("*.tif"))[16]  # a validation image
    img = tifffile.imread(f)
    viewer.add_image(img, name="BBBC039 nuclei", contrast_limits=(0, np.percentile(img, 99.8)))
    _d, w = viewer.window.add_plugin_dock_widget("napari-gpuseg", "U-Net predict")
    w.out_probs.setChecked(True)
    w.run()
    pump(app, lambda: "BBBC039 nuclei U-Net labels" in viewer.layers and w.run_button.isEnabled(), 300)
    viewer.layers["BBBC039 nuclei boundary prob"].visible = False
    viewer.layers["BBBC039 nuclei interior prob"].visible = False
    viewer.layers["BBBC039 nuclei U-Net labels"].contour = 2
    viewer.layers.selection.active = viewer.layers["BBBC039 nuclei U-Net labels"]
    viewer.scene.camera.zoom = 1.5
    viewer.scene.camera.center = (200, 260)
    pump(app, seconds=3)


def sam_automatic(viewer, app):
    f = sorted((DATA / "bbbc039" / "images").glob("*.tif"))[17]  # a validation image
    img = tifffile.imread(f)
    viewer.add_image(img, name="BBBC039 nuclei", contrast_limits=(0, np.percentile(img, 99.8)))
    _d, w = viewer.window.add_plugin_dock_widget("napari-gpuseg", "SAM automatic")
    w.source_combo.setCurrentText("Detector: U-Net")
    w.run()
    pump(app, lambda: w.labels_layer is not None and w.run_button.isEnabled()
         and "objects" in w.status.text(), 600)
    w.labels_layer.contour = 2
    viewer.scene.camera.zoom = 1.5
    viewer.scene.camera.center = (200, 260)
    pump(app, seconds=3)


def sam_everything_nuclei(viewer, app):
    """Segment everything with the default model on a 320x480 crop of a validation field."""
    img = tifffile.imread(DATA / "bbbc039" / "images" / "IXMtest_O18_s7.tif")[:320, :480]
    viewer.add_image(img, name="IXMtest_O18_s7", contrast_limits=(0, np.percentile(img, 99.8)))
    _d, w = viewer.window.add_plugin_dock_widget("napari-gpuseg", "SAM automatic")
    w.mode_combo.setCurrentIndex(1)  # Segment everything
    w.run()
    pump(app, lambda: w.labels_layer is not None and w.run_button.isEnabled()
         and "objects" in w.status.text(), 600)
    pump(app, seconds=3)


SHOTS = {"annotator": annotator, "gpu_monitor": gpu_monitor, "unet_predict": unet_predict,
         "annotate_folder": annotate_folder, "sam_automatic": sam_automatic, "sam_everything_nuclei": sam_everything_nuclei,
         "propagate": propagate, "annotator_adapted_cells": annotator_adapted_cells,
         "annotator_cells_click": annotator_cells_click}
AT_DEFAULT_SIZE = {"annotator"}  # shown at napari's default window size (no clipped dock rows)


def main(names):
    import tempfile

    # a first start's napari settings: napari sizes the window to its contents only on a first
    # start, and a saved window geometry (or a first start already spent) would change
    # AT_DEFAULT_SIZE's pictures; the settings file of this Python environment is not touched
    os.environ.setdefault("NAPARI_CONFIG", str(Path(tempfile.mkdtemp(prefix="napari-settings-")) / "settings.yaml"))
    import napari
    from napari.settings import get_settings
    from qtpy.QtWidgets import QApplication

    OUT.mkdir(parents=True, exist_ok=True)
    for name in names or SHOTS:
        get_settings().reset()  # each picture a first start (the file is the temporary one above)
        viewer = napari.Viewer(title="napari-gpuseg")
        if name not in AT_DEFAULT_SIZE:
            viewer.window._qt_window.resize(1500, 900)
        app = QApplication.instance()
        SHOTS[name](viewer, app)
        viewer.screenshot(str(OUT / f"{name}.png"), canvas_only=False)
        print("wrote", OUT / f"{name}.png")
        viewer.close()


if __name__ == "__main__":
    main(sys.argv[1:])
