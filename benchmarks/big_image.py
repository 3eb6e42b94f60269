"""The annotator on an image too big to annotate whole: the whole plane (the way before) against
the region in view, each in a fresh process, in one run.

    xvfb-run -a python benchmarks/big_image.py [--tiles 32] [--settle 10]

A lazily read (dask) mosaic of a BBBC039 validation field's top-left 512 x 512 px, ``--tiles``
a side (32: 16384 x 16384 uint16), is dropped while the SAM annotator is open. ``whole`` lifts
the annotator's limit (``MAX_PLANE_PX``), so the plane is prepared and embedded as before;
``region`` presses *Annotate the region in view* on a 1.6x view of the mosaic's centre. Then a
click on the nucleus nearest the view's centre (its most interior pixel). Printed per mode:
napari's memory ``--settle`` s after the drop and after the click's first mask (RSS above the
process before the drop), the time from the click to the first mask, and its IoU.
"""
import argparse
import json
import os
import subprocess
import sys
import time

MODES = ("whole", "region")


def trial(mode: str, tiles: int, settle: float) -> dict:
    import dask.array as da
    import napari
    import numpy as np
    import psutil
    import tifffile
    from qtpy.QtWidgets import QApplication
    from scipy import ndimage

    from _data import bbbc039_validation
    from napari_gpuseg.engine.annotate import region as limits
    from napari_gpuseg.widgets import _annotator_region

    def pump(until, seconds=120.0):
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds and not until():
            app.processEvents()
            time.sleep(0.01)

    if mode == "whole":
        limits.MAX_PLANE_PX = 2**62
    img_path, mask_path = bbbc039_validation()[1]
    tile, gtile = tifffile.imread(img_path)[:512, :512], tifffile.imread(mask_path)[:512, :512]
    big = da.tile(da.from_array(tile, chunks=512), (tiles, tiles))
    viewer = napari.Viewer(title="napari-gpuseg")
    app = QApplication.instance()
    _dock, w = viewer.window.add_plugin_dock_widget("napari-gpuseg", "SAM annotator")
    pump(lambda: "ready" in w.status.text())
    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    layer = viewer.add_image(big, name="mosaic")
    pump(lambda: False, settle)
    out = {"mode": mode, "shape": list(big.shape), "rss_after_drop_mib": (proc.memory_info().rss - rss0) / 2**20}
    cy, cx = big.shape[0] // 2 + 40, big.shape[1] // 2 + 40
    viewer.camera.center, viewer.camera.zoom = layer.data_to_world((cy, cx)), 1.6
    pump(lambda: False, 1.0)
    y0 = x0 = 0
    if mode == "region":
        t0 = time.perf_counter()
        w.region_btn.click()
        pump(lambda: w.image_layer is not None and w.image_layer.name != "mosaic" and w.pos_layer is not None)
        out["region_s"] = time.perf_counter() - t0
        y0, y1, x0, x1 = _annotator_region.region_in_view(viewer, layer)
        out["region"] = [y0, y1, x0, x1]
    else:
        pump(lambda: w.pos_layer is not None)
    gt = np.tile(gtile, (tiles, tiles))[cy - 200:cy + 200, cx - 200:cx + 200]
    cc, _n = ndimage.label(gt > 0)
    dist = ndimage.distance_transform_edt(cc > 0)
    near = np.argmin([np.hypot(*(np.argwhere(cc == k).mean(0) - 200)) for k in range(1, cc.max() + 1)]) + 1
    obj_local = cc == near
    y, x = np.unravel_index(np.where(obj_local, dist, 0).argmax(), obj_local.shape)
    y, x = y + cy - 200, x + cx - 200  # mosaic pixels
    w.pos_layer.add(w.pos_layer.world_to_data(layer.data_to_world((y, x))))
    t0 = time.perf_counter()
    pump(w.has_preview, 600)
    out["click_to_first_mask_s"] = time.perf_counter() - t0
    mask = np.asarray(w.preview_layer.data) > 0
    obj = np.zeros(mask.shape, bool)
    oy, ox = cy - 200 - y0, cx - 200 - x0  # the ground truth window in the followed image's pixels
    sl = (slice(max(oy, 0), oy + 400), slice(max(ox, 0), ox + 400))
    obj[sl] = obj_local[max(-oy, 0):max(-oy, 0) + obj[sl].shape[0], max(-ox, 0):max(-ox, 0) + obj[sl].shape[1]]
    out["iou"] = float((mask & obj).sum() / max(1, (mask | obj).sum()))
    out["rss_after_mask_mib"] = (proc.memory_info().rss - rss0) / 2**20
    out["status"] = w.status.text()
    viewer.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiles", type=int, default=32)
    ap.add_argument("--settle", type=float, default=10.0)
    ap.add_argument("--trial", choices=MODES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trial:
        print(json.dumps(trial(args.trial, args.tiles, args.settle)))
        return
    from _machine import machine_line

    print(machine_line(), flush=True)
    env = {**os.environ, "QT_QPA_PLATFORM": os.environ.get("QT_QPA_PLATFORM", "xcb")}
    res = {}
    for mode in MODES:
        run = subprocess.run([sys.executable, __file__, "--trial", mode, "--tiles", str(args.tiles),
                              "--settle", str(args.settle)], capture_output=True, text=True, env=env)
        lines = [ln for ln in run.stdout.splitlines() if ln.startswith("{")]
        if run.returncode or not lines:
            print(f"{mode}: failed (exit {run.returncode}): {run.stderr[-2000:]}")
            return
        res[mode] = json.loads(lines[-1])
        print(mode, res[mode], flush=True)
    a, b = res["whole"], res["region"]
    print(f"memory {args.settle:.0f} s after the drop: {a['rss_after_drop_mib']:.0f} -> {b['rss_after_drop_mib']:.0f} MiB; "
          f"after the first mask: {a['rss_after_mask_mib']:.0f} -> {b['rss_after_mask_mib']:.0f} MiB")
    print(f"click to first mask: {a['click_to_first_mask_s']:.2f} -> {b['click_to_first_mask_s']:.2f} s "
          f"(ratio {b['click_to_first_mask_s'] / a['click_to_first_mask_s']:.3f}; the region itself "
          f"{b['region_s']:.2f} s); IoU {a['iou']:.3f} / {b['iou']:.3f}")


if __name__ == "__main__":
    main()
