"""Automatic SAM benchmark: segment everything, ours vs the official generator, and box mode.

    OMP_NUM_THREADS=2 python benchmarks/automatic.py [--pps 8] [--repeats 1] [--out FILE]

1. Segment everything, ours vs ``segment_anything.SamAutomaticMaskGenerator`` in the same
   run: the same network object (LiteMedSAM, real weights), the same image (a 256 x 256
   BBBC039 validation crop, one view, no resizing) and the same parameters. The official
   generator re-embeds on every ``generate``; ours is timed cold (empty embedding cache:
   encoder included) and warm (a re-run, e.g. after a threshold change: embedding from
   the cache). Parameter sets: everything passes (``pred_iou_thresh=0``: every prompt
   needs its masks, our worst case) and the box-trained defaults of the dock. Peak
   memory is the resident memory the call adds (``PeakRSS`` from ``benchmarks/sam.py``),
   measured in a separate untimed run (its allocator mode would distort timings).
   Both sides should return the same masks (fraction matched at IoU >= 0.9 is reported);
   the official predictor is given our float image resize (see the table's note).
2. Box mode throughput (boxes/s): all ground-truth boxes of the 8 validation crops,
   batched decoder calls vs one box per call vs the engine's plain ``predict_boxes``
   (embeddings cached, decode + render timed).
3. On CUDA only: images/s of both modes and the speed-up over the official generator.

Runs interleave ours and the official code so both see the same machine load.
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from pathlib import Path

import numpy as np
import tifffile
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

import sam_reference as ref  # noqa: E402
from sam import PeakRSS, val_crops  # noqa: E402  (benchmarks/sam.py)
from _data import shared_data  # noqa: E402  (benchmarks/, the script's folder)
from _timing import timed  # noqa: E402  (the allocator in its normal mode)
from _machine import cpu_name  # noqa: E402

from napari_gpuseg.engine.sam.automatic.everything import AutomaticParams, segment_everything  # noqa: E402
from napari_gpuseg.engine.runtime.device import Policy, device_name  # noqa: E402
from napari_gpuseg.engine.sam.interactive.cache import EmbeddingCache  # noqa: E402
from napari_gpuseg.engine.metrics import mask_set_match  # noqa: E402
from napari_gpuseg.engine.sam.interactive.predictor import Prompt, SamEngine, SamModelInfo  # noqa: E402
from napari_gpuseg.engine.detect import boxes_from_labels  # noqa: E402
from napari_gpuseg.engine.sam.automatic.boxes import prepare_boxes, segment_boxes_batch  # noqa: E402
from napari_gpuseg.models.sam import load_sam  # noqa: E402

LINES: list[str] = []


def emit(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)


def peak(fn, device) -> PeakRSS:
    """Peak memory of a separate, untimed run: PeakRSS makes glibc mmap every allocation
    >= 64 KiB so that RSS is exact, which also makes every such allocation page-fault;
    timing inside it would measure the allocator, not the code."""
    with PeakRSS(device) as pk:
        fn()
    return pk


def to_uint8_rgb(img: np.ndarray) -> np.ndarray:
    x = img.astype(np.float32)
    lo, hi = np.percentile(x, [1, 99.8])
    return (np.repeat(np.clip((x - lo) / (hi - lo), 0, 1)[..., None], 3, -1) * 255).astype(np.uint8)


def everything(sam, device, images: dict, pps: int, repeats: int) -> None:
    from segment_anything import SamAutomaticMaskGenerator
    from segment_anything.utils.transforms import ResizeLongestSide

    ResizeLongestSide.apply_image = ref.float_resize_longest_side

    sets = {
        "all prompts pass (pred_iou_thresh 0)": dict(pred_iou_thresh=0.0, stability_score_thresh=0.0),
        "dock defaults for LiteMedSAM": {k: v for k, v in AutomaticParams.for_model(True).to_dict().items()
                                         if k in ("pred_iou_thresh", "stability_score_thresh",
                                                  "min_mask_region_area")},
    }
    emit(f"points_per_side={pps} ({pps * pps} prompts, 3 masks each), points_per_batch=64, LiteMedSAM, "
         "fp32, official crop geometry (``tiling='crops'``: the whole image resized into the 256 px input). "
         "The official predictor resizes through PIL in uint8; here it gets our float resize (same "
         "time, identical encoder inputs), otherwise LiteMedSAM's unstable point masks on the resized "
         "520 x 696 field differ by input rounding alone (measured 0.70 / 0.53 matched). "
         f"Medians of {repeats} interleaved run(s) after one untimed warm-up each.")
    emit()
    emit("| image | parameters | official | ours cold (embeds) | ours warm (cached embedding) "
         "| speed-up cold / warm | peak RSS official / ours cold | masks official / ours "
         "| matched official / ours |")
    emit("|---|---|---|---|---|---|---|---|---|")
    for (img_label, img), (label, extra) in [(i, p) for i in images.items() for p in sets.items()]:
        kw = dict(points_per_side=pps, **extra)
        if kw.get("min_mask_region_area"):
            kw["min_mask_region_area"] = 0  # the official needs cv2 for it (not installed)
        gen = SamAutomaticMaskGenerator(sam, **kw)
        params = AutomaticParams(tiling="crops", **kw)
        t_off, t_cold, t_warm = [], [], []
        warm = SamEngine(sam, SamModelInfo("lite_medsam", 256, "none", True), Policy(device, "fp32"))
        gen.generate(img), segment_everything(warm, img, params)  # untimed warm-up of both
        def fresh():
            return SamEngine(sam, SamModelInfo("lite_medsam", 256, "none", True),
                             Policy(device, "fp32"), cache=EmbeddingCache())

        for r in range(repeats):
            dt, recs = timed(lambda: gen.generate(img), device)
            t_off.append(dt)
            engine = fresh()
            dt, res = timed(lambda: segment_everything(engine, img, params), device)
            t_cold.append(dt)
            dt, res = timed(lambda: segment_everything(engine, img, params), device)
            t_warm.append(dt)
        pk_off = peak(lambda: gen.generate(img), device)
        engine = fresh()
        pk_cold = peak(lambda: segment_everything(engine, img, params), device)
        o, c, w = (statistics.median(t) for t in (t_off, t_cold, t_warm))
        f1, f2 = mask_set_match([x["segmentation"] for x in recs], [m.full(img.shape[:2]) for m in res.masks])
        emit(f"| {img_label} | {label} | {o:.1f} s | {c:.1f} s | {w:.1f} s | {o / c:.2f}x / {o / w:.2f}x "
             f"| {pk_off.mib:.0f} / {pk_cold.mib:.0f} MiB | {len(recs)} / {len(res)} | {f1:.2f} / {f2:.2f} |")


def boxes(sam, device, crops, repeats: int) -> None:
    engine = SamEngine(sam, SamModelInfo("lite_medsam", 256, "minmax", True), Policy(device, "fp32"))
    imgs = [c[1] for c in crops]
    bxs = [boxes_from_labels(c[2]) for c in crops]
    n = sum(len(b) for b in bxs)
    engine.embed(imgs)
    padded = [prepare_boxes(b, im.shape, 2) for b, im in zip(bxs, imgs)]
    variants = {
        "ours, batched (auto: 64 per call, factored, best-fit of 4 masks)":
            lambda: segment_boxes_batch(engine, imgs, bxs, padding=2),
        "ours, one box per call": lambda: segment_boxes_batch(engine, imgs, bxs, padding=2, batch_size=1),
        "ours, batched, single-mask output": lambda: segment_boxes_batch(engine, imgs, bxs, padding=2,
                                                                         mask_choice="single"),
        "engine.predict_boxes (all boxes of a view per call, no zoomed views, no best-fit)":
            lambda: [engine.predict_boxes(im, b) for im, b in zip(imgs, padded)],
        "module decoder, one box per call (like a SamPredictor.predict loop)":
            lambda: [plain.predict(im, [Prompt(box=x)]) for im, b in zip(imgs, padded) for x in b],
    }
    plain = SamEngine(engine.sam, engine.info, engine.policy, cache=engine.cache)
    plain._factored = False  # the network's own decoder module, no kept products
    for fn in variants.values():
        fn()  # warm-up (and every zoomed view embedded)
    rates = {}
    for label, fn in variants.items():
        ts = []
        for _ in range(repeats):
            dt, _res = timed(fn, device)
            ts.append(dt)
        rates[label] = (n / statistics.median(ts), peak(fn, device).mib)
    emit(f"{n} ground-truth boxes on the 8 validation crops, embeddings cached (decoder + render).")
    emit()
    emit("| box mode | boxes/s | peak RSS |")
    emit("|---|---|---|")
    for label, (rate, mib) in rates.items():
        emit(f"| {label} | {rate:.1f} | {mib:.0f} MiB |")
    first, second = list(rates.values())[:2]
    emit(f"\nBatched vs one box per call: {first[0] / second[0]:.2f}x (CPU: the decoder is compute-bound, "
         "so batching mainly saves per-call overhead; it matters far more on a GPU).")


def gpu_section(sam_cpu_path, crops, pps) -> None:
    from segment_anything import SamAutomaticMaskGenerator

    device = torch.device("cuda")
    sam = load_sam("lite_medsam", sam_cpu_path, device=device)
    sam.pixel_std.fill_(255.0)
    imgs = [to_uint8_rgb(c[1]) for c in crops]
    params = AutomaticParams(points_per_side=pps, pred_iou_thresh=0.0, stability_score_thresh=0.0)
    gen = SamAutomaticMaskGenerator(sam, points_per_side=pps, pred_iou_thresh=0.0, stability_score_thresh=0.0)
    gen.generate(imgs[0])
    dt_off, _ = timed(lambda: [gen.generate(im) for im in imgs], device)
    engine = SamEngine(sam, SamModelInfo("lite_medsam", 256, "none", True), Policy(device, "fp32"))
    segment_everything(engine, imgs[0], params)
    engine.cache.clear()  # cold: every image's embedding in the timed run
    dt_ours, _ = timed(lambda: [segment_everything(engine, im, params) for im in imgs], device)
    pk = peak(lambda: segment_everything(engine, imgs[0], params), device)
    eng2 = SamEngine(sam, SamModelInfo("lite_medsam", 256, "minmax", True), Policy(device, "fp32"))
    raw = [c[1] for c in crops]
    bxs = [boxes_from_labels(c[2]) for c in crops]
    segment_boxes_batch(eng2, raw[:1], bxs[:1])
    eng2.cache.clear()
    dt_box, _ = timed(lambda: segment_boxes_batch(eng2, raw, bxs, padding=2), device)
    emit(f"\n## GPU: {device_name(device)}\n")
    emit("| mode | images/s |")
    emit("|---|---|")
    emit(f"| segment everything, official | {len(imgs) / dt_off:.2f} |")
    emit(f"| segment everything, ours (cold) | {len(imgs) / dt_ours:.2f} (GPU peak {pk.gpu_mib:.0f} MiB) |")
    emit(f"| boxes -> SAM, ours (cold) | {len(raw) / dt_box:.2f} |")
    emit(f"\nSpeed-up over the official generator on the GPU: {dt_off / dt_ours:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pps", type=int, default=8, help="points per side (same for both)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT.parent / "notes" / "automatic_bench.md"))
    ap.add_argument("--only", choices=["everything", "boxes"], help="run one CPU section")
    ap.add_argument("--gpu-only", action="store_true", help="only the CUDA section")
    args = ap.parse_args()
    ref.install_stubs()
    torch.manual_seed(0)
    path = str(ref.LITE_MEDSAM_ASSET)
    sam = load_sam("lite_medsam", path)
    sam.pixel_std.fill_(255.0)  # the official predictor feeds 0..255; LiteMedSAM wants 0..1
    crops = val_crops()
    cpu = torch.device("cpu")
    emit("# Automatic SAM benchmark")
    emit()
    emit(f"`OMP_NUM_THREADS={torch.get_num_threads()} python benchmarks/automatic.py --pps {args.pps} "
         f"--repeats {args.repeats}` on {cpu_name()}, "
         f"{torch.get_num_threads()} threads, torch {torch.__version__}, "
         f"{datetime.date.today().isoformat()}. Shared machine: compare columns of one run only.")
    emit()
    if args.only != "boxes" and not args.gpu_only:
        emit("## Segment everything: ours vs official SamAutomaticMaskGenerator (CPU)\n")
        full = tifffile.imread(sorted((shared_data() / "bbbc039" / "images").glob("*.tif"))[-8])
        images = {"256 x 256 crop": to_uint8_rgb(crops[0][1]), "520 x 696 field": to_uint8_rgb(full)}
        everything(sam, cpu, images, args.pps, args.repeats)
        emit()
    if args.only != "everything" and not args.gpu_only:
        emit("## Boxes -> SAM throughput (CPU)\n")
        boxes(sam, cpu, crops, args.repeats)
    if torch.cuda.is_available():
        gpu_section(path, crops, args.pps)
    else:
        emit("\n(No CUDA device in this run: GPU section skipped.)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()
