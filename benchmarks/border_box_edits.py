"""Box edits on objects the image's border cuts: the view each edit is decoded in, in one run.

    OMP_NUM_THREADS=2 python benchmarks/border_box_edits.py [--fields 4] [--objects 3] [--edits 8]

On held-out BBBC039 fields (the last ``--fields`` of the 8 validation fields, 520 x 696, 12
native tiles), a session (the default model) embeds the whole field first, as the annotator
does in the background. Then, for up to ``--objects`` objects per field that the border
cuts, a box (3 px margin, clipped to the image) is nudged ``--edits`` times by -3..3 px per
side, as a user drags it, and each edit is timed (``session.box``, a new current object
from the box) with the views the encoder computed meanwhile. Twice, with the same nudges:
routed as shipped (a side of a view on the image's border needs no margin, so a grid tile
takes the box) and as before (4 px on every side, so no tile holds the box and each
nudged box got a view centred on it). Printed: seconds per edit (median, mean), views
encoded, the mean IoU of the masks to the ground truth, and the ratio of the means.
"""
import argparse
import time

import numpy as np
import tifffile

from _data import shared_data
from _machine import machine_line
from napari_gpuseg.engine import AnnotationSession, InferenceWorker
from napari_gpuseg.engine.sam.interactive import views as views_mod
from napari_gpuseg.engine.sam.interactive.predictor import SamEngine

SHIPPED, BEFORE = "as shipped", "before"


def route_box_before(box, views, shape, input_size, margin=4.0, zoom_below=None, side=None):
    """``views.route_box`` as it was: ``margin`` image px on every side, border or not."""
    if side is None:
        side = float(max(box[2] - box[0], box[3] - box[1])) + 1
    if zoom_below and side < zoom_below:
        return views_mod.zoomed_view(box, shape, input_size)
    holding = [v for v in views if v.contains_box(box, margin) or (v.h == shape[0] and v.w == shape[1])]
    if holding:
        return max(holding, key=lambda v: (v.scale, v.centrality(box)))
    return views_mod.centred_view(box, shape, input_size)


def border_objects(gt: np.ndarray, n: int) -> list[tuple[int, np.ndarray]]:
    """(id, box x0 y0 x1 y1 with 3 px margin) of the ``n`` largest objects touching the border."""
    h, w = gt.shape
    out = []
    for i in np.unique(gt)[1:]:
        ys, xs = np.nonzero(gt == i)
        if ys.min() == 0 or xs.min() == 0 or ys.max() == h - 1 or xs.max() == w - 1:
            out.append((int(i), len(ys), np.array([xs.min() - 3, ys.min() - 3, xs.max() + 3, ys.max() + 3], float)))
    out.sort(key=lambda t: -t[1])
    return [(i, b) for i, _n, b in out[:n]]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fields", type=int, default=4)
    ap.add_argument("--objects", type=int, default=3)
    ap.add_argument("--edits", type=int, default=8)
    args = ap.parse_args(argv)
    print(machine_line(), flush=True)
    d = shared_data() / "bbbc039"
    files = sorted((d / "images").glob("*.tif"))[-args.fields:]
    worker = InferenceWorker()
    encoded = [0]
    encode = SamEngine.encode

    def counted(self, x):
        encoded[0] += len(x)
        return encode(self, x)

    SamEngine.encode = counted
    shipped_route = views_mod.route_box
    rows = {SHIPPED: [], BEFORE: []}
    views_made = {SHIPPED: 0, BEFORE: 0}
    ious = {SHIPPED: [], BEFORE: []}
    try:
        session = AnnotationSession(worker=worker)
        for f in files:
            img, gt = tifffile.imread(f), tifffile.imread(d / "masks" / f.name)
            h, w = gt.shape
            session.set_image(img)
            session.embed()
            engine = session.engine()
            objects = border_objects(gt, args.objects)
            for obj, box in objects:
                gt_obj = gt == obj
                nudges = np.random.default_rng(obj).integers(-3, 4, (args.edits, 4))
                for name in (SHIPPED, BEFORE):
                    views_mod.route_box = shipped_route if name == SHIPPED else route_box_before
                    engine._extra_views.clear()
                    encoded[0] = 0
                    for nudge in nudges:
                        b = np.clip(box + nudge, 0, [w - 1, h - 1, w - 1, h - 1])
                        t0 = time.perf_counter()
                        mask = session.box(*b)
                        rows[name].append(time.perf_counter() - t0)
                        ious[name].append((mask & gt_obj).sum() / max(1, (mask | gt_obj).sum()))
                    views_made[name] += encoded[0]
                    views_mod.route_box = shipped_route
            print(f"{f.name}: {len(objects)} border objects", flush=True)
    finally:
        SamEngine.encode = encode
        views_mod.route_box = shipped_route
        worker.shutdown()
    for name in (SHIPPED, BEFORE):
        t = np.array(rows[name]) * 1000
        print(f"{name}: {len(t)} edits, median {np.median(t):.0f} ms, mean {t.mean():.0f} ms, max {t.max():.0f} ms; "
              f"{views_made[name]} views encoded; mean IoU {np.mean(ious[name]):.3f}")
    print(f"mean edit, before / as shipped: {np.mean(rows[BEFORE]) / np.mean(rows[SHIPPED]):.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
