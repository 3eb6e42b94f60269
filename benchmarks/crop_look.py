"""A prompt's first look from a small crop (``engine/sam/interactive/crop_look.py``) against what it
stands in for: mask quality (mean IoU against the ground truth) and the time from the prompt
to its mask when nothing is embedded yet (the crop's embedding + decode vs the views'), same
run. Boxes: tight ground-truth boxes, against the full view. First clicks (the most interior
pixel, best of the candidates): against the native tile's mask (the first look when the
crop is not used) and the mask of both scales (the final one).

    OMP_NUM_THREADS=2 python benchmarks/crop_look.py [--models nuclei_sam,lite_medsam]

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
    from napari_gpuseg.engine.sam.interactive.crop_look import crop_look, look_view
    from napari_gpuseg.engine.sam.training.simulated_prompts import interior_point
    from napari_gpuseg.engine.sam.loader import load_engine
    from napari_gpuseg.engine.sam.interactive.prompt_types import Prompt

    print(machine_line())
    for model in args.models.split(","):
        engine = load_engine(model)
        per_model_clicks = engine.click_zoom > 1  # a point-capable decoder (not LiteMedSAM's boxes-only)
        engine.embedding(engine.prepare(np.zeros((300, 300), np.uint8)),
                         look_view(np.array([10, 10, 20, 20]), (300, 300), engine.input_size))  # one-off costs
        rows: dict[str, dict[str, list]] = {}
        for name, img, gt, per in fields():
            gt = gt[..., 0] if gt.ndim == 3 else gt
            objs = ndi.find_objects(gt.astype(np.int32))
            ids = [i + 1 for i, s in enumerate(objs) if s is not None]
            if per is not None:
                ids = list(np.random.default_rng(0).choice(ids, size=min(per, len(ids)), replace=False))
            r = rows.setdefault(name, {k: [] for k in ("full", "look", "agree", "t_full", "t_look", "c_native",
                                                       "c_look", "c_final", "t_native", "t_clook")})
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
                look = crop_look(engine, image, Prompt(box=box)).full(truth.shape)
                t2 = time.perf_counter()
                r["full"].append(iou(full, truth))
                r["look"].append(iou(look, truth))
                r["agree"].append(iou(full, look))
                r["t_full"].append(t1 - t0)
                r["t_look"].append(t2 - t1)
                if not per_model_clicks:
                    continue
                click = Prompt(points=np.array([interior_point(truth)], float), labels=np.array([1]))
                engine.cache.clear()
                t0 = time.perf_counter()
                native = engine.predict(image, [click], multimask=True, zoom=False)[0].full(truth.shape)
                t1 = time.perf_counter()
                clook = crop_look(engine, image, click, multimask=True).full(truth.shape)
                t2 = time.perf_counter()
                final = engine.predict(image, [click], multimask=True)[0].full(truth.shape)
                r["c_native"].append(iou(native, truth))
                r["c_look"].append(iou(clook, truth))
                r["c_final"].append(iou(final, truth))
                r["t_native"].append(t1 - t0)
                r["t_clook"].append(t2 - t1)
        for name, r in rows.items():
            tf, tl = statistics.median(r["t_full"]), statistics.median(r["t_look"])
            print(f"{model} {name}: {len(r['full'])} boxes; mean IoU full view {np.mean(r['full']):.3f}, "
                  f"first look {np.mean(r['look']):.3f} (look vs full mask {np.mean(r['agree']):.3f}); "
                  f"box -> mask with nothing embedded: full view {tf * 1000:.0f} ms, look {tl * 1000:.0f} ms "
                  f"(ratio {tl / tf:.2f})", flush=True)
            if r["c_look"]:
                tn, tc = statistics.median(r["t_native"]), statistics.median(r["t_clook"])
                print(f"{model} {name}: {len(r['c_look'])} first clicks; mean IoU native tile "
                      f"{np.mean(r['c_native']):.3f}, crop look {np.mean(r['c_look']):.3f}, both scales (final) "
                      f"{np.mean(r['c_final']):.3f}; click -> look with nothing embedded: native tile "
                      f"{tn * 1000:.0f} ms, crop {tc * 1000:.0f} ms (ratio {tc / tn:.2f})", flush=True)


if __name__ == "__main__":
    main()
