"""Refit a SAM decoder's IoU head on first clicks of training objects (see
``napari_gpuseg.engine.sam.training.iou_head``).

    python scripts/calibrate_iou_head.py DECODER.pt OUT.pt [--cache-dir DIR]

Training parts of ``../shared/data`` (or ``$NAPARI_GPUSEG_SHARED_DATA``) only: the whole
cells of ``scratch_assay`` t00-t06 (15 per frame), the first 16 BBBC039 fields (6 per
field) and the 32 ``dsb2018_more`` fields (3 per field); validation frames and fields are
never read. Every first click (the object's most
interior pixel) is decoded in each view the annotator decodes it in, every candidate's IoU
measured; the IoU head is refitted on those (20 % of them held out to pick the epoch) and
the decoder written to OUT with the head replaced and the fit recorded under ``iou_head``.
The masks do not change, only which candidate a first click keeps. Deterministic for a
given decoder and machine precision (seed 0); ``--cache-dir`` keeps the embeddings.

Measured on the shipped ``cells_nuclei_sam`` (2026-11-28, AMD EPYC, 2 cores, avx2 only, fp32;
``benchmarks/clicks.py --models nuclei_sam cells_nuclei_sam OUT.pt --data cells bbbc039 dsb2018
--clicks 5 --cap 15 --per-field 6``): one click on the validation cells 0.437 -> 0.541, but on
the ``dsb2018/`` field 0.766 -> 0.716 (without the ``dsb2018_more`` fields: 0.551 and 0.728),
under the 0.76 kept for nuclei; the shipped decoder does not use it. ``--bias-only``
moves one offset per candidate instead of the whole head: through ``clicks.py`` (same run as
the shipped decoder) cells 0.470, BBBC039 0.896, ``dsb2018/`` 0.744, again under 0.76; not
shipped either. Run after Adapt SAM on the annotated objects' own first clicks it changed
nothing: training has already fitted the head on them (``docs/benchmarks.md``, Adapt SAM).

``--choose-output`` leaves the head alone and measures instead which candidate a first click
should keep (one click per training object with the head's choice and with each candidate
kept; :func:`napari_gpuseg.engine.sam.training.click_choice.choose_click_output`), storing
the best as the decoder's ``click_output`` (OUT may be DECODER). On the shipped
``cells_nuclei_sam`` (2026-11-28, same machine; 181 s with the embeddings on disk) candidate
1, SAM's first multimask output: training cells 0.513 -> 0.588, BBBC039 0.865 -> 0.862,
``dsb2018_more`` 0.704 -> 0.688, all 291 objects 0.685 -> 0.706; on validation (the
``clicks.py`` command above, same run as before) cells 0.437 -> **0.539**, BBBC039 0.888 ->
0.905, ``dsb2018/`` 0.766 -> 0.765. The shipped decoder keeps it
(``scripts/build_cells_nuclei_sam.sh`` runs this step last).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import tifffile
import torch

from napari_gpuseg.engine import load_engine
from napari_gpuseg.engine.sam.interactive.cache import EmbeddingCache
from napari_gpuseg.engine.sam.training.iou_head import first_click_samples, fit_iou_head
from napari_gpuseg.engine.sam.training.click_choice import (BLENDS, THRESHOLDS, choose_click_blend,
                                                           choose_click_output, choose_click_threshold)
from napari_gpuseg.models.sam.decoder_checkpoint import read_decoder, save_decoder, set_decoder_fields


def training_fields(data: Path) -> list[tuple[Path, Path, int]]:
    """(image, labels, objects per image): training parts of the shared data only."""
    cells = data / "scratch_assay" / "cells"
    out = [(cells / "images" / f"t{t:02d}.tif", cells / "masks" / f"t{t:02d}.tif", 15) for t in range(7)]
    bbbc = sorted((data / "bbbc039" / "images").glob("*.tif"))[:16]  # the first 16: training
    out += [(p, data / "bbbc039" / "masks" / p.name, 6) for p in bbbc]
    dsb = sorted((data / "dsb2018_more" / "images").glob("*.tif"))  # fluorescence, brightfield, tissue
    out += [(p, data / "dsb2018_more" / "masks" / p.name, 3) for p in dsb]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("decoder", help="decoder checkpoint to start from")
    ap.add_argument("out", help="where to write the decoder with the refitted IoU head")
    ap.add_argument("--cache-dir", default=None, help="keep the embeddings in this folder across runs")
    ap.add_argument("--bias-only", action="store_true",
                    help="move only the head's output biases (one offset per candidate)")
    ap.add_argument("--choose-blend", action="store_true",
                    help="leave the head as it is: measure first clicks with the candidates of both views "
                         f"blended at each of {', '.join(f'{b:g}' for b in BLENDS)} and kept one by one, "
                         "and store the best temperature in OUT as click_blend (None: keep one)")
    ap.add_argument("--choose-output", action="store_true",
                    help="leave the head as it is: measure which candidate a first click should keep "
                         "(click_choice.choose_click_output) and store it in OUT as click_output")
    ap.add_argument("--choose-threshold", action="store_true",
                    help="leave the head as it is: measure first clicks with their mask cut at logit 0 and at each "
                         f"of {', '.join(f'{t:g}' for t in THRESHOLDS)}, and store the best in OUT as "
                         "click_threshold (None: 0)")
    args = ap.parse_args(argv)
    env = os.environ.get("NAPARI_GPUSEG_SHARED_DATA")
    data = Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "data"
    if not data.is_dir():
        raise SystemExit(f"real data not found at {data} (set NAPARI_GPUSEG_SHARED_DATA)")
    doc = read_decoder(args.decoder)
    engine = load_engine(args.decoder, cache=EmbeddingCache(max_bytes=4 << 30, disk_dir=args.cache_dir))
    t0 = time.perf_counter()
    if args.choose_output:
        return choose_output(engine, data, args.decoder, args.out, t0)
    if args.choose_blend:
        return choose_blend(engine, data, args.decoder, args.out, t0, doc)
    if args.choose_threshold:
        return choose_threshold(engine, data, args.decoder, args.out, t0)
    feats, ious = [], []
    for image, labels, cap in training_fields(data):
        f, i = first_click_samples(engine, tifffile.imread(image), tifffile.imread(labels), cap, seed=0)
        feats.append(f)
        ious.append(i)
        print(f"{image.parent.parent.name}/{image.name}: {len(f)} views of first clicks "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    features, targets = np.concatenate(feats), np.concatenate(ious)
    head = engine.sam.mask_decoder.iou_prediction_head
    fit = fit_iou_head(head, features, targets, bias_only=args.bias_only, lr=1e-2 if args.bias_only else 3e-4)
    print(f"held-out squared error {fit.held_out_mse_before:.4f} -> {fit.held_out_mse_after:.4f} "
          f"(epoch {fit.epoch}; {fit.fitted} samples fitted, {fit.held_out} held out)")
    engine.sam.float()
    meta = {k: doc[k] for k in ("training", "click_zoom", "metrics") if k in doc}
    meta["iou_head"] = {"samples": int(len(features)), "held_out_mse_before": round(fit.held_out_mse_before, 5),
                        "held_out_mse_after": round(fit.held_out_mse_after, 5), "epoch": int(fit.epoch), "bias_only": bool(args.bias_only),
                        "data": "scratch_assay cells t00-t06 (15 per frame), bbbc039 first 16 (6 per field), dsb2018_more (3 per field)"}
    save_decoder(args.out, engine.sam, doc["base"], doc.get("base_sha256"), **meta)
    print(f"wrote {args.out} in {time.perf_counter() - t0:.0f} s (torch {torch.__version__})")
    return 0


def choose_output(engine, data: Path, decoder: str, out: str, t0: float) -> int:
    """``--choose-output``: one click per training object with each rule; OUT is the decoder
    with the best rule stored (``click_output``) and what was measured (``click_choice``)."""
    fields = training_fields(data)
    choice = choose_click_output(engine, [(tifffile.imread(i), tifffile.imread(m), cap) for i, m, cap in fields])
    groups: dict[str, list[dict]] = {}
    for (image, _m, _c), row in zip(fields, choice.per_field):
        groups.setdefault(image.parent.parent.name, []).append(row)
    print("| training objects | n | " + " | ".join(choice.ious) + " |")
    print("| --- | ---: |" + " ---: |" * len(choice.ious))
    for name, rows in groups.items():
        cat = {k: np.concatenate([r[k] for r in rows]) for k in choice.ious}
        print(f"| {name} | {len(cat['head'])} | " + " | ".join(f"{v.mean():.3f}" for v in cat.values()) + " |")
    print(f"| all | {choice.objects} | " + " | ".join(f"{v:.3f}" for v in choice.ious.values()) + " |")
    print(f"click_output: {choice.output} (None: the IoU head's choice)")
    _copy(decoder, out)
    set_decoder_fields(out, click_output=choice.output,
                       click_choice={**choice.record(), "data": "scratch_assay cells t00-t06 (15 per frame), "
                                     "bbbc039 first 16 (6 per field), dsb2018_more (3 per field)"})
    print(f"wrote {out} in {time.perf_counter() - t0:.0f} s (torch {torch.__version__})")
    return 0


def choose_blend(engine, data: Path, decoder: str, out: str, t0: float, doc: dict) -> int:
    """``--choose-blend``: one click per training object with one candidate kept (the engine's
    rule without a blend) and with the candidates of both views blended at each of
    :data:`~napari_gpuseg.engine.sam.training.click_choice.BLENDS`
    (:func:`~napari_gpuseg.engine.sam.training.click_choice.choose_click_blend`); OUT is the
    decoder with the chosen temperature stored as ``click_blend`` (None: keep one) and what was
    measured as ``click_blend_choice``. Where ``--choose-output`` kept a candidate, the blends
    weigh the IoU head's predictions all the same, and the best one replaces that candidate
    (``click_output`` None) only when its mean IoU is also above the candidate's, as measured
    then on the same objects."""
    kept = engine.click_output
    if kept is not None:  # a candidate kept by --choose-output: a blend must beat it too
        kept_iou = (doc.get("click_choice") or {}).get("one_click_iou", {}).get(str(kept))
        if kept_iou is None:
            print(f"{decoder} keeps candidate {kept} (click_output) without its measured IoU: no blend chosen")
            _copy(decoder, out)
            return 0
        engine.click_output = engine.sam.click_output = None  # the blends weigh the IoU head's predictions
    fields = training_fields(data)
    chosen, means, per_rule = choose_click_blend(engine, [(tifffile.imread(i), tifffile.imread(m), cap)
                                                          for i, m, cap in fields])
    names = {r: "one kept" if r is None else f"blend {r:g}" for r in means}
    n = _print_rules(fields, names, means, per_rule)
    if kept is not None:
        print(f"| candidate {kept} kept (--choose-output) | {n} | {kept_iou:.3f} |")
        if chosen is not None and means[chosen] <= kept_iou:
            chosen = None
    print(f"click_blend: {chosen} (None: one candidate kept" + (f", candidate {kept})" if kept is not None else ")"))
    _copy(decoder, out)
    if kept is not None and chosen is not None:  # the blend replaces the kept candidate
        set_decoder_fields(out, click_output=None)
    set_decoder_fields(out, click_blend=chosen, click_blend_choice={
        "blend": chosen, "objects": n, "one_click_iou": {names[r]: round(v, 4) for r, v in means.items()},
        "data": "scratch_assay cells t00-t06 (15 per frame), bbbc039 first 16 (6 per field), dsb2018_more (3 per field)"})
    print(f"wrote {out} in {time.perf_counter() - t0:.0f} s (torch {torch.__version__})")
    return 0


def choose_threshold(engine, data: Path, decoder: str, out: str, t0: float) -> int:
    """``--choose-threshold``: one click per training object with the decoder's first-click
    rule as it is (``click_output`` / ``click_blend``) and its mask cut at logit 0 and at each
    of :data:`~napari_gpuseg.engine.sam.training.click_choice.THRESHOLDS`
    (:func:`~napari_gpuseg.engine.sam.training.click_choice.choose_click_threshold`); OUT is the
    decoder with the chosen logit stored as ``click_threshold`` (None: 0) and what was measured
    as ``click_threshold_choice``. Run after ``--choose-output`` and ``--choose-blend``."""
    fields = training_fields(data)
    chosen, means, per_rule = choose_click_threshold(engine, [(tifffile.imread(i), tifffile.imread(m), cap)
                                                              for i, m, cap in fields])
    names = {r: f"logit {r:+g}" for r in means}
    n = _print_rules(fields, names, means, per_rule)
    print(f"click_threshold: {chosen} (None: logit 0)")
    _copy(decoder, out)
    set_decoder_fields(out, click_threshold=chosen, click_threshold_choice={
        "threshold": chosen, "objects": n, "one_click_iou": {names[r]: round(v, 4) for r, v in means.items()},
        "data": "scratch_assay cells t00-t06 (15 per frame), bbbc039 first 16 (6 per field), dsb2018_more (3 per field)"})
    print(f"wrote {out} in {time.perf_counter() - t0:.0f} s (torch {torch.__version__})")
    return 0


def _print_rules(fields, names: dict, means: dict, per_rule: dict) -> int:
    """A table of one-click IoU per rule (``names``: each rule's column), one row per kind of
    training object and one for all; returns the number of objects."""
    print("| training objects | n | " + " | ".join(names.values()) + " |")
    print("| --- | ---: |" + " ---: |" * len(means))
    first = next(iter(means))
    for kind in dict.fromkeys(i.parent.parent.name for i, _m, _c in fields):
        idx = [k for k, (i, _m, _c) in enumerate(fields) if i.parent.parent.name == kind]
        cat = {r: np.concatenate([per_rule[r][k] for k in idx]) for r in means}
        print(f"| {kind} | {len(cat[first])} | " + " | ".join(f"{v.mean():.3f}" for v in cat.values()) + " |")
    n = len(np.concatenate(per_rule[first]))
    print(f"| all | {n} | " + " | ".join(f"{v:.3f}" for v in means.values()) + " |")
    return n


def _copy(decoder: str, out: str) -> None:
    """OUT starts as the decoder file (nothing to do where they are one file)."""
    if Path(decoder).resolve() != Path(out).resolve():
        shutil.copyfile(decoder, out)


if __name__ == "__main__":
    sys.exit(main())
