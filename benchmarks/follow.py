"""The annotator following a newly dropped image: as shipped against the previous way.

    xvfb-run -a python benchmarks/follow.py [--drops 8] [--flow beside|fresh|both]

A real napari window, the SAM annotator docked with its default model. Each drop adds a
BBBC039 field never dropped before (520x696; every other one cut to 480x600, so the preview layer must
change shape, as it does between a user's images of different sizes) and draws a
ground-truth box as soon as the dock has followed. Two flows:

* ``beside``: the field is dropped beside the last one, whose layers stay (the common
  way to go through a folder's images);
* ``fresh``: every layer is deleted first, so the dock makes all its layers again.

Variants alternate drop by drop, in the same run:

* ``shipped``: the encoder starts on the new image before the dock makes its layers; the
  shared prompt and preview layers are kept (the preview takes the new shape) and moved
  above the new image;
* ``previous``: the dock's earlier order: the layers first, the preview layer made again
  when its shape differs, then the encoder (and the prompt layers left where they are).

Timed on the GUI thread from ``viewer.add_image``: *follow* (the dock has its layers for
the new image), *first mask* (the box's mask painted) and *grid* (the field's native tiles
embedded, which box mode and first clicks use). Medians per flow and variant, and the
ratio previous / shipped.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import tifffile

os.environ.setdefault("OMP_NUM_THREADS", "2")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _machine import cpu_flags, cpu_name  # noqa: E402
from _viewer import pump as pump_until  # noqa: E402
from first_mask import central_box, corners  # noqa: E402

DATA = HERE.parents[1] / "shared" / "data"


def previous_layers(viewer, image):
    """The annotator's layers as the dock made them before (the baseline): the preview
    made again whenever its shape differs, the prompt layers left where they are."""
    from napari_gpuseg.widgets import _annotation_layers as al

    layers = viewer.layers
    if al.PREVIEW in layers and layers[al.PREVIEW].data.shape != al.spatial_shape(image):
        layers.remove(al.PREVIEW)
    shipped_raise = al.raise_above
    al.raise_above = lambda *a: None
    try:
        return al.ensure_layers(viewer, image)
    finally:
        al.raise_above = shipped_raise


def previous_follow(w, layer) -> None:
    """The dock's ``set_image_layer`` before (the baseline): layers first, then the encoder."""
    from napari_gpuseg.widgets import sam_annotator

    w.image_layer = layer
    w.image_label.setText(layer.name)
    w._plane = sam_annotator.plane_index(layer, w.viewer)
    shipped_layers = sam_annotator.ensure_layers
    sam_annotator.ensure_layers = previous_layers
    try:
        w._ensure_layers()
    finally:
        sam_annotator.ensure_layers = shipped_layers
    w._generation += 1
    w._clear_preview()
    w._embed_current()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drops", type=int, default=8, help="drops per flow (variants alternate)")
    ap.add_argument("--flow", choices=("beside", "fresh", "both"), default="both")
    args = ap.parse_args()

    import napari
    from qtpy.QtWidgets import QApplication

    viewer = napari.Viewer(show=True)
    app = QApplication.instance()

    def pump(until, timeout=900.0):
        pump_until(app, until, timeout)

    _dock, w = viewer.window.add_plugin_dock_widget("napari-gpuseg", "SAM annotator")
    pump(lambda: "ready" in w.status.text())
    shipped = w.set_image_layer
    shown = {}
    show = w._show_mask

    def record(*a, **kw):
        show(*a, **kw)
        app.processEvents()
        shown["t"] = time.perf_counter()

    w._show_mask = record
    engine = w.session.engine()
    # a field is never dropped twice (a second drop would find its embeddings cached)
    files = [*sorted((DATA / "bbbc039" / "images").glob("*.tif"))[16:24],
             *sorted((DATA / "bbbc039_more" / "images").glob("*.tif"))]
    files = iter(files)
    flows = ("beside", "fresh") if args.flow == "both" else (args.flow,)
    rows = {(f, v): [] for f in flows for v in ("shipped", "previous")}
    for flow in flows:
        if flow == "beside":  # an image already being annotated, untimed
            viewer.add_image(tifffile.imread(next(files)), name="before")
            pump(lambda: w.image_layer is not None and w.image_layer.name == "before")
            w.cancel()
        for i in range(args.drops):
            f = next(files)
            cut = (slice(0, 480), slice(0, 600)) if i % 2 else (slice(None), slice(None))
            img = tifffile.imread(f)[cut]
            gt = tifffile.imread(f.parents[1] / "masks" / f.name)[cut]
            variant = ("shipped", "previous")[(i // 2) % 2]  # shape changes in both variants
            w.set_image_layer = shipped if variant == "shipped" else (lambda ly: previous_follow(w, ly))
            if flow == "fresh":
                viewer.layers.select_all()
                viewer.layers.remove_selected()
            pump(lambda: not w.worker.busy)
            n_grid = len(engine.views(engine.prepare(img)))
            name = f"{flow}{i}"
            shown.clear()
            t0 = time.perf_counter()
            viewer.add_image(img, name=name)
            pump(lambda: w.image_layer is not None and w.image_layer.name == name
                 and w.preview_layer is not None and w.preview_layer.data.shape == img.shape)
            follow = time.perf_counter() - t0
            w.box_layer.data = [corners(central_box(gt))]
            pump(lambda: "t" in shown)
            first = shown["t"] - t0
            pump(lambda: (w.session.tiles() or (0, 1))[0] >= n_grid)
            grid = time.perf_counter() - t0
            w.cancel()
            w.box_layer.data = []
            rows[flow, variant].append((follow, first, grid))
            print(f"{flow} {variant:8s} {img.shape}: follow {follow:.2f} s, first mask {first:.2f} s, "
                  f"grid ({n_grid} tiles) {grid:.2f} s", flush=True)
    w.set_image_layer = shipped
    print(f"\ncpu: {cpu_name()} ({cpu_flags()}), OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}, "
          f"model {w.model_name}")
    for flow in flows:
        med = {v: [statistics.median(r[k] for r in rows[flow, v]) for k in range(3)]
               for v in ("shipped", "previous")}
        for k, what in enumerate(("follow", "first mask", "grid embedded")):
            s, p = med["shipped"][k], med["previous"][k]
            print(f"{flow:6s} {what:13s}: shipped {s:.2f} s, previous {p:.2f} s, previous/shipped {p / s:.2f}x "
                  f"(n={len(rows[flow, 'shipped'])}+{len(rows[flow, 'previous'])})")
    viewer.close()


if __name__ == "__main__":
    main()
