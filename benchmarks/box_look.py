"""A box's first look (``engine/sam/box_look.py``) against the full view it stands in for:
mask quality (mean IoU against the ground truth, tight boxes) and the time from a box to its
mask when nothing is embedded yet (the crop's embedding + decode vs the view's), same run.

    OMP_NUM_THREADS=2 python benchmarks/box_look.py [--models nuclei_sam,lite_medsam]

Data: BBBC039's 8 validation fields (20 nuclei each, seeded) and ``dsb2018/`` (every nucleus
whose box fits the crop), never trained on.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import tifffile
from scipy import ndimage as ndi

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _data import bbbc039_validation, dsb2018_field  # noqa: E402
from _machine import machine_line  # noqa: E402


def fields():
    for img, mask in bbbc039_validation():
        yield "BBBC039 val", tifffile.imread(img), tifffile.imread(mask), 20
    img, mask = dsb2018_field()
    yield "dsb2018/", img, mask, None


def iou(a, b) -> float:
    return float((a & b).sum() / max(1, (a | b).sum()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="nuclei_sam,lite_medsam")
    args = ap.parse_args()
    from napari_gpuseg.engine.sam.box_look import box_look, look_view
    from napari_gpuseg.engine.sam.loader import load_engine
    from napari_gpuseg.engine.sam.prompt_types import Prompt

    print(machine_line())
    for model in args.models.split(","):
        engine = load_engine(model)
        engine.embedding(engine.prepare(np.zeros((300, 300), np.uint8)),
                         look_view(np.array([10, 10, 20, 20]), (300, 300), engine.input_size))  # one-off costs
        rows: dict[str, dict[str, list]] = {}
        for name, img, gt, per in fields():
            gt = gt[..., 0] if gt.ndim == 3 else gt
            objs = ndi.find_objects(gt.astype(np.int32))
            ids = [i + 1 for i, s in enumerate(objs) if s is not None]
            if per is not None:
                ids = list(np.random.default_rng(0).choice(ids, size=min(per, len(ids)), replace=False))
            r = rows.setdefault(name, {"full": [], "look": [], "agree": [], "t_full": [], "t_look": []})
            for i in ids:
                sl = objs[i - 1]
                box = np.array([sl[1].start, sl[0].start, sl[1].stop - 1, sl[0].stop - 1], float)
                if look_view(box, gt.shape[:2], engine.input_size) is None:
                    continue
                truth = gt == i
                engine.cache.clear()  # nothing embedded: the case a first look is for
                image = engine.prepare(img)
                t0 = time.perf_counter()
                full = engine.predict(image, [Prompt(box=box)], near_box=True)[0].full(truth.shape)
                t1 = time.perf_counter()
                look = box_look(engine, image, Prompt(box=box)).full(truth.shape)
                t2 = time.perf_counter()
                r["full"].append(iou(full, truth))
                r["look"].append(iou(look, truth))
                r["agree"].append(iou(full, look))
                r["t_full"].append(t1 - t0)
                r["t_look"].append(t2 - t1)
        for name, r in rows.items():
            tf, tl = statistics.median(r["t_full"]), statistics.median(r["t_look"])
            print(f"{model} {name}: {len(r['full'])} boxes; mean IoU full view {np.mean(r['full']):.3f}, "
                  f"first look {np.mean(r['look']):.3f} (look vs full mask {np.mean(r['agree']):.3f}); "
                  f"box -> mask with nothing embedded: full view {tf * 1000:.0f} ms, look {tl * 1000:.0f} ms "
                  f"(ratio {tl / tf:.2f})", flush=True)


if __name__ == "__main__":
    main()
