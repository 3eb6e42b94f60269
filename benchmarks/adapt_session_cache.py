""""Adapt to these objects" on the session's embeddings vs a cache of its own, in one run.

    OMP_NUM_THREADS=2 python benchmarks/adapt_session_cache.py [--objects 6] [--steps 2] [--frame 0]

A session annotates ``--objects`` whole cells of a ``scratch_assay`` training frame with
boxes (each committed), as a user does before adapting; then the same adaptation
(:class:`~napari_gpuseg.engine.annotate.adapting.SessionAdaptation`, the few-object schedule
cut to ``--steps`` steps on native views) runs twice: on the session's embedding cache (as
shipped) and on a cache of its own (the way before). Printed per run: the views the encoder
computed, of them those for the first-click choice, and the seconds; then the ratio. The
adapted decoders go to a temporary folder.
"""
import argparse
import tempfile
import time

import numpy as np
import tifffile

from _data import shared_data
from _machine import machine_line
from napari_gpuseg.engine import AnnotationSession, InferenceWorker
from napari_gpuseg.engine.annotate.adapting import SessionAdaptation
from napari_gpuseg.engine.detect import boxes_from_labels
from napari_gpuseg.engine.sam.interactive.cache import EmbeddingCache
from napari_gpuseg.engine.sam.interactive.predictor import SamEngine
from napari_gpuseg.engine.sam.training import adapt as sam_adapt


SHARED, OWN = "the session's cache", "a cache of its own"


def cell_boxes(gt: np.ndarray, n: int) -> list[list[float]]:
    """Boxes (xyxy, 3 px margin) of the ``n`` largest cells, by box area, not cut by the border."""
    h, w = gt.shape
    inside = [b for b in boxes_from_labels(gt) if b[0] > 3 and b[1] > 3 and b[2] < w - 4 and b[3] < h - 4]
    inside.sort(key=lambda b: -(b[2] - b[0]) * (b[3] - b[1]))
    return [[float(b[0]) - 3, float(b[1]) - 3, float(b[2]) + 3, float(b[3]) + 3] for b in inside[:n]]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--objects", type=int, default=6)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--frame", type=int, default=0, help="training frame (0-6)")
    args = ap.parse_args(argv)
    print(machine_line(), flush=True)
    d = shared_data() / "scratch_assay" / "cells"
    img = tifffile.imread(d / "images" / f"t{args.frame:02d}.tif")
    gt = tifffile.imread(d / "masks" / f"t{args.frame:02d}.tif")
    worker = InferenceWorker()
    session = AnnotationSession("nuclei_sam", worker=worker)
    session.set_image(img)
    for box in cell_boxes(gt, args.objects):
        session.box(*box)
        session.commit()

    counts = {"all": 0, "choice": 0}
    in_choice = [False]
    encode, store = SamEngine.encode, sam_adapt.store_click_choice

    def counted(self, x):
        counts["all"] += len(x)
        counts["choice"] += len(x) if in_choice[0] else 0
        return encode(self, x)

    def measured_choice(*a, **k):
        in_choice[0] = True
        try:
            return store(*a, **k)
        finally:
            in_choice[0] = False

    SamEngine.encode, sam_adapt.store_click_choice = counted, measured_choice
    seconds = {}
    try:
        for name in (SHARED, OWN):
            job = SessionAdaptation(session, folder=tempfile.mkdtemp())
            job.config = sam_adapt.few_object_config(job.objects, minutes=1)
            job.config.max_steps, job.config.max_time, job.config.view_zooms = args.steps, None, (1.0,)
            if name == OWN:
                job.cache = EmbeddingCache()
            counts.update(all=0, choice=0)
            t0 = time.perf_counter()
            res = job.run()
            seconds[name] = time.perf_counter() - t0
            print(f"{name}: {counts['all']} views encoded ({counts['choice']} for the first-click choice), "
                  f"{seconds[name]:.1f} s, {res.steps} steps, {job.objects} cells of t{args.frame:02d} "
                  f"{img.shape}", flush=True)
    finally:
        SamEngine.encode, sam_adapt.store_click_choice = encode, store
        worker.shutdown()
    print(f"a cache of its own / the session's: {seconds[OWN] / seconds[SHARED]:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
