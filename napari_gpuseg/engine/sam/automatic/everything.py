"""Segment everything: grid point prompts -> instance labels, batched on the device.

    params = AutomaticParams(points_per_side=32)            # official names and defaults
    result = segment_everything(engine, image, params)      # AutomaticResult
    result.labels                                           # (H, W) int32, 0 = background

Same parameters and meaning as the official ``SamAutomaticMaskGenerator``; what differs
is how the work is done:

* embeddings come from the engine's cache (all crops of all images embedded in batches,
  never recomputed on a re-run);
* point prompts are decoded in adaptive batches (``run_batched``: OOM back-off) by a
  decoder that shares the image-side work between prompts and computes masks only for
  prompts whose predicted IoU passes (``fast_decoder``);
* predicted-IoU and a conservative low-resolution stability check drop masks before
  anything is upscaled; the exact stability score, boxes and the crop-edge test run on
  the device on the survivors only, in memory-bounded chunks;
* NMS runs on the device in torch, masks are kept as box-sized crops (no RLE);
* overlaps are resolved into one label image by score, small regions/holes cleaned.

Large images: ``tiling="crops"`` is the official crop geometry (whole image +
``crop_n_layers``); ``"tiles"`` uses the whole image plus the engine's native-resolution
tiles (shared with the annotator's embeddings) as the crops, so a 4k x 4k image is
processed tile by tile and merged across tile borders by the crop NMS.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from typing import Sequence

import numpy as np
import torch

from . import everything_ops as ops
from ..interactive.fast_decoder import decode_points
from ...runtime.batching import remembered_batch_size, run_batched
from ...runtime.device import wide_float
from ...runtime.cancel import CancelToken, ProgressFn, check
from ..interactive.predictor import MaskResult, SamEngine
from ..interactive.inputs import PreparedImage, logits_to_view_mask
from ..interactive.views import View

RENDER_BYTES = 256 * 2**20  # full-resolution logits rendered at once
LOW_RES_STABILITY_MARGIN = 0.2  # low-res stability this far below the threshold: dropped unrendered


@dataclass
class AutomaticParams:
    """Parameters of :func:`segment_everything` (the first block: official names/defaults)."""

    points_per_side: int | None = 32
    points_per_batch: int = 64
    pred_iou_thresh: float = 0.88
    stability_score_thresh: float = 0.95
    stability_score_offset: float = 1.0
    box_nms_thresh: float = 0.7
    crop_n_layers: int = 0
    crop_nms_thresh: float = 0.7
    crop_overlap_ratio: float = 512 / 1500
    crop_n_points_downscale_factor: int = 1
    point_grids: list | None = None
    min_mask_region_area: int = 0
    # ours
    tiling: str = "auto"  # "crops" | "tiles" | "auto" (tiles when the image is > 2x the model input)
    tile_edge_margin: float = 8.0  # px: masks this close to an inner tile edge were cut by it
    label_order: str = "score"  # overlaps in the label image go to the higher "score" or smaller "area"
    min_object_area: int | None = None  # visible px an object must keep (None: min_mask_region_area)

    def grids(self, n_layers: int) -> list[np.ndarray]:
        if self.point_grids is not None:
            if len(self.point_grids) < n_layers + 1:
                raise ValueError(f"point_grids has {len(self.point_grids)} grids; "
                                 f"{n_layers + 1} crop layers need one each")
            return [np.asarray(g, dtype=np.float64).reshape(-1, 2) for g in self.point_grids]
        if not self.points_per_side:
            raise ValueError("set points_per_side or point_grids")
        return ops.layer_point_grids(self.points_per_side, n_layers, self.crop_n_points_downscale_factor)

    @classmethod
    def for_model(cls, box_trained: bool = False, decoder_tuned: bool = False,
                  **overrides) -> "AutomaticParams":
        """Defaults per kind of model:

        * SAM as published (ViT-B/L/H, MobileSAM): the official settings;
        * box-trained models (LiteMedSAM): settings that let their point masks through at
          all: their predicted IoUs for single points are low and their logits rarely
          exceed +-1, so every mask has stability ~0 (measured on BBBC039). Box mode is the
          right mode for these models;
        * decoders tuned to clicks on microscopy (``nuclei_sam``, Adapt SAM's files): 16
          points per side, predicted IoU >= 0.5, stability >= 0.95, and native tiles for any
          image bigger than one view (they were tuned on native-scale views; shrinking a
          320x480 image into one view halves its nuclei). Chosen by object F1 on the 13
          training images the shipped decoder held back and two 320x480 crops of them
          (``benchmarks/everything_params.py``; numbers in docs/benchmarks.md).
        """
        if box_trained:
            base = dict(points_per_side=16, pred_iou_thresh=0.18, stability_score_thresh=0.0,
                        min_mask_region_area=20)
        elif decoder_tuned:
            base = dict(points_per_side=16, pred_iou_thresh=0.5, stability_score_thresh=0.95,
                        min_mask_region_area=20, tiling="tiles")
        else:
            base = {}
        base.update(overrides)
        return cls(**base)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "point_grids"}


@dataclass
class AutomaticResult:
    """Instance labels plus the masks behind them (highest score first)."""

    labels: np.ndarray  # (H, W) int32
    masks: list[MaskResult] = field(default_factory=list)  # box-sized crops at native resolution
    boxes: np.ndarray = field(default_factory=lambda: np.zeros((0, 4)))  # x0, y0, x1, y1 (end exclusive)
    scores: np.ndarray = field(default_factory=lambda: np.zeros(0))  # predicted IoU
    stability: np.ndarray = field(default_factory=lambda: np.zeros(0))
    ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # label of mask i (0: hidden)
    points: np.ndarray = field(default_factory=lambda: np.zeros((0, 2)))  # prompt of mask i (x, y)
    n_prompts: int = 0
    seconds: float = 0.0

    def __len__(self) -> int:
        return len(self.masks)


@dataclass
class Crop:
    view: View
    layer: int
    box: tuple[int, int, int, int]  # x0, y0, x1, y1 (end exclusive)
    edge_atol: float = ops.EDGE_ATOL

    @property
    def area(self) -> int:
        return (self.box[2] - self.box[0]) * (self.box[3] - self.box[1])


def plan_crops(engine: SamEngine, image: PreparedImage, params: AutomaticParams) -> list[Crop]:
    """The crops an image is processed in (see the module docstring for the two tilings)."""
    h, w = image.shape
    s = engine.input_size
    mode = params.tiling
    if mode == "auto":
        mode = "tiles" if max(h, w) > 2 * s else "crops"
    if mode == "crops":
        boxes, layers = ops.crop_boxes((h, w), params.crop_n_layers, params.crop_overlap_ratio)
        return [Crop(View(y0, x0, y1 - y0, x1 - x0, s), layer, (x0, y0, x1, y1))
                for (x0, y0, x1, y1), layer in zip(boxes, layers)]
    if mode != "tiles":
        raise ValueError(f"tiling must be 'auto', 'crops' or 'tiles', got {params.tiling!r}")
    # the whole image as layer 0, unless shrinking it into the input leaves under half a
    # pixel across (a strip over 2 x input_size times longer than wide): the tiles hold it all
    crops = [Crop(View(0, 0, h, w, s), 0, (0, 0, w, h))] if min(h, w) * s / max(h, w) >= 0.5 else []
    for v in engine.views(image):
        if (v.h, v.w) != (h, w):
            crops.append(Crop(v, 1, (v.x0, v.y0, v.x1, v.y1), params.tile_edge_margin))
    return crops


@dataclass
class _Masks:
    """Candidate masks: bool crops on the host, scores and boxes on the device."""

    crops: list  # (mask (h, w) bool numpy, y0, x0)
    low: list  # low-res logits (L, L) float16 per mask, on the host (None: not kept)
    iou: torch.Tensor
    stab: torch.Tensor
    boxes: torch.Tensor  # (N, 4) int64 inclusive ends, image coordinates
    points: torch.Tensor  # (N, 2) image xy
    crop: torch.Tensor  # (N,) crop index

    @classmethod
    def empty(cls, device) -> "_Masks":
        z = torch.zeros(0, device=device)
        return cls([], [], z, z, torch.zeros((0, 4), dtype=torch.int64, device=device),
                   torch.zeros((0, 2), device=device, dtype=wide_float(device)),
                   torch.zeros(0, dtype=torch.int64, device=device))

    def __len__(self) -> int:
        return len(self.crops)

    def take(self, idx: torch.Tensor) -> "_Masks":
        ii = idx.tolist()
        return _Masks([self.crops[i] for i in ii], [self.low[i] for i in ii], self.iou[idx],
                      self.stab[idx], self.boxes[idx], self.points[idx], self.crop[idx])

    @classmethod
    def cat(cls, parts: Sequence["_Masks"], device) -> "_Masks":
        parts = [p for p in parts if len(p)]
        if not parts:
            return cls.empty(device)
        return cls([c for p in parts for c in p.crops], [x for p in parts for x in p.low],
                   *(torch.cat([getattr(p, k) for p in parts]) for k in ("iou", "stab", "boxes", "points", "crop")))


def _render_filter(logits: torch.Tensor, view: View, crop: Crop, shape, params: AutomaticParams):
    """Exact stability, binarisation, boxes and the crop-edge test on full-resolution logits
    rendered in memory-bounded chunks. Returns (keep, stab, boxes, mask crops)."""
    per = max(1, RENDER_BYTES // (view.h * view.w * 4 * 3))
    keep_all, stab_all, box_all, crops = [], [], [], []
    off = torch.tensor([view.x0, view.y0, view.x0, view.y0], device=logits.device)
    orig = (0, 0, shape[1], shape[0])
    for s in range(0, logits.shape[0], per):
        full = logits_to_view_mask(logits[s:s + per], view)
        stab = ops.stability_score(full, 0.0, params.stability_score_offset)
        keep = (stab >= params.stability_score_thresh) if params.stability_score_thresh > 0 else \
            torch.ones_like(stab, dtype=torch.bool)
        masks = full > 0
        del full
        boxes = ops.masks_to_boxes(masks) + off
        keep &= ~ops.near_crop_edge(boxes, crop.box, orig, crop.edge_atol)
        idx = torch.nonzero(keep).flatten()
        if len(idx):
            b = boxes[idx].cpu().numpy()
            m = masks[idx].cpu().numpy()
            for k in range(len(idx)):
                x0, y0, x1, y1 = (int(v) for v in b[k])
                crops.append((m[k, y0 - view.y0:y1 + 1 - view.y0, x0 - view.x0:x1 + 1 - view.x0].copy(), y0, x0))
        keep_all.append(keep)
        stab_all.append(stab)
        box_all.append(boxes)
    return torch.cat(keep_all), torch.cat(stab_all), torch.cat(box_all), crops


def _crop_masks(engine: SamEngine, image: PreparedImage, crop: Crop, ci: int, grid: np.ndarray,
                params: AutomaticParams, batch_size: int | None, progress, cancel,
                keep_logits: bool = True) -> _Masks:
    """All candidate masks of one crop after IoU/stability/edge filtering and NMS."""
    view, dev, sam = crop.view, engine.policy.device, engine.sam
    emb = engine.embedding(image, view).to(dev)
    pts = grid * np.array([view.w, view.h]) + np.array([view.x0, view.y0])  # image xy
    pts_in = torch.as_tensor(view.to_input(pts), dtype=torch.float32, device=dev)
    pts_img = torch.as_tensor(pts, dtype=wide_float(dev), device=dev)  # float32 on MPS
    iou_thr = params.pred_iou_thresh if params.pred_iou_thresh > 0 else float("-inf")
    s = view.input_size
    found: list[_Masks] = []
    memo = engine.decoder_memo(image, view)  # the decoder's image-only products, kept

    def batch(idx: torch.Tensor):
        check(cancel)
        idx = idx.to(dev)
        with torch.inference_mode(), engine.policy.autocast():
            iou, sel, low = decode_points(sam, emb, pts_in[idx], multimask=True, iou_thresh=iou_thr, memo=memo)
        keep = iou[sel] > iou_thr
        pi, mi = torch.nonzero(keep, as_tuple=True)
        logits, scores, pidx = low[pi, mi], iou[sel][pi, mi], idx[sel[pi]]
        del low
        if params.stability_score_thresh > 0 and len(logits):
            lr = logits.shape[-1]
            rh, rw = view.resized_hw
            lh, lw = -(-rh * lr // s), -(-rw * lr // s)
            low_stab = ops.stability_score(logits[:, :lh, :lw], 0.0, params.stability_score_offset)
            pre = ~(low_stab < params.stability_score_thresh - LOW_RES_STABILITY_MARGIN)
            logits, scores, pidx = logits[pre], scores[pre], pidx[pre]
        if len(logits):
            keep, stab, boxes, crops = _render_filter(logits, view, crop, image.shape, params)
            k = torch.nonzero(keep).flatten()
            # the low-res logits go to the host in one copy per block (or are dropped): kept
            # on the device, every mask of a stack would hold its logits there to the end
            low_host = list(logits[k].half().cpu().unbind(0)) if keep_logits else [None] * len(k)
            found.append(_Masks(crops, low_host, scores[k], stab[k], boxes[k],
                                pts_img[pidx[k]], torch.full((len(k),), ci, device=dev)))
        return [None] * len(idx)

    n = len(pts)
    key = ("sam-amg", engine.info.name, s, engine.policy.precision, str(dev))
    start = batch_size or min(params.points_per_batch, remembered_batch_size(key) or params.points_per_batch)
    hw = emb.shape[-1] * emb.shape[-2] if emb.dim() == 3 else 64 * 64
    item_bytes = 64 * 4 * hw * 256  # decoder activations per prompt, a loose upper bound
    run_batched(batch, torch.arange(n), batch_size=start, key=key, device=dev, item_bytes=item_bytes,
                progress=progress, cancel=cancel)
    masks = _Masks.cat(found, dev)
    if len(masks) > 1:
        masks = masks.take(ops.nms(masks.boxes.float(), masks.iou, params.box_nms_thresh))
    return masks


def _postprocess_small(masks: _Masks, shape, min_area: int, nms_thresh: float) -> _Masks:
    """Official small-region post-processing: holes then islands under ``min_area``,
    boxes recomputed, NMS preferring masks that needed no change."""
    if len(masks) == 0:
        return masks
    new_crops, changed = [], []
    boxes = masks.boxes.clone()
    for i, (m, y0, x0) in enumerate(masks.crops):
        m2, yy, xx, ch = ops.clean_mask(m, y0, x0, shape, min_area)
        if ch:
            ys, xs = np.nonzero(m2)
            if len(ys):
                t, b, l, r = ys.min(), ys.max(), xs.min(), xs.max()
                m2, yy, xx = m2[t:b + 1, l:r + 1], yy + t, xx + l
                boxes[i] = torch.tensor([xx, yy, xx + m2.shape[1] - 1, yy + m2.shape[0] - 1])
            else:
                m2, yy, xx = m2[:0, :0], y0, x0
                boxes[i] = 0
        else:
            m2, yy, xx = m, y0, x0
        new_crops.append((m2, yy, xx))
        changed.append(ch)
    scores = torch.tensor([0.0 if c else 1.0 for c in changed], device=masks.iou.device)
    out = _Masks(new_crops, masks.low, masks.iou, masks.stab, boxes, masks.points, masks.crop)
    return out.take(ops.nms(boxes.float(), scores, nms_thresh))


def segment_everything(engine: SamEngine, image, params: AutomaticParams | None = None,
                       batch_size: int | None = None, progress: ProgressFn = None,
                       cancel: CancelToken | None = None, embed_batch_size: int | None = None,
                       keep_logits: bool = True) -> AutomaticResult:
    """Instance labels of everything SAM finds from a grid of point prompts.

    ``image``: a 2D gray or colour image (or a :class:`PreparedImage`); ``batch_size``:
    point prompts per decoder call (default ``params.points_per_batch``, halved on OOM);
    ``progress(done, total)`` counts embedded crops and decoded prompts. ``keep_logits``:
    each mask keeps its low-res logits (on the host); ``False``: ``low_res`` is None.
    """
    params = params or AutomaticParams.for_model(engine.info.box_trained, engine.info.decoder_tuned)
    t0 = time.perf_counter()
    prepared = engine.prepare(image)
    shape = prepared.shape
    crops = plan_crops(engine, prepared, params)
    grids = params.grids(max(c.layer for c in crops))
    n_prompts = sum(len(grids[c.layer]) for c in crops)
    total = len(crops) + n_prompts
    done = [0]

    def sub(offset):
        return None if progress is None else (lambda d, _t: progress(offset + d, total))

    engine.embed([prepared], [[c.view for c in crops]], batch_size=embed_batch_size,
                 progress=sub(0), cancel=cancel)
    done[0] = len(crops)
    dev = engine.policy.device
    per_crop = []
    for ci, crop in enumerate(crops):
        check(cancel)
        grid = grids[crop.layer]
        per_crop.append(_crop_masks(engine, prepared, crop, ci, grid, params, batch_size,
                                    sub(done[0]), cancel, keep_logits))
        done[0] += len(grid)
    masks = _Masks.cat(per_crop, dev)
    if len(crops) > 1 and len(masks) > 1:  # duplicates between crops: prefer smaller crops
        areas = torch.tensor([c.area for c in crops], dtype=torch.float32, device=dev)
        masks = masks.take(ops.nms(masks.boxes.float(), 1.0 / areas[masks.crop], params.crop_nms_thresh))
    if params.min_mask_region_area > 0:
        masks = _postprocess_small(masks, shape, params.min_mask_region_area,
                                   max(params.box_nms_thresh, params.crop_nms_thresh))
    min_visible = params.min_object_area if params.min_object_area is not None else params.min_mask_region_area
    labels, ids = ops.paint_labels(masks.crops, masks.iou, shape, params.label_order, min_visible)
    return _result(masks, crops, labels, ids, n_prompts, time.perf_counter() - t0)


def segment_everything_batch(engine: SamEngine, images: Sequence, params: AutomaticParams | None = None,
                             batch_size: int | None = None, embed_batch_size: int | None = None,
                             progress: ProgressFn = None, cancel: CancelToken | None = None,
                             keep_logits: bool = True) -> list[AutomaticResult]:
    """:func:`segment_everything` for several 2D images (the planes of a stack, a folder
    batch): the crops of all images are embedded first in shared encoder batches."""
    params = params or AutomaticParams.for_model(engine.info.box_trained, engine.info.decoder_tuned)
    prepared = [engine.prepare(im) for im in images]
    views = [[c.view for c in plan_crops(engine, im, params)] for im in prepared]
    n = len(prepared)

    def sub(k):
        # embedding counts as one image's share; per-mille steps keep the total fixed
        return None if progress is None else (
            lambda d, t: progress(int(1000 * (k + d / max(1, t))), 1000 * (n + 1)))

    engine.embed(prepared, views, batch_size=embed_batch_size, progress=sub(0), cancel=cancel)
    return [segment_everything(engine, im, params, batch_size=batch_size, progress=sub(k + 1), cancel=cancel,
                               embed_batch_size=embed_batch_size, keep_logits=keep_logits)
            for k, im in enumerate(prepared)]


def _result(masks: _Masks, crops: list[Crop], labels, ids, n_prompts: int, seconds: float) -> AutomaticResult:
    iou = masks.iou.cpu().numpy()  # one device->host copy, not one per mask
    order = np.argsort(-iou, kind="stable") if len(masks) else np.zeros(0, int)
    crop_idx = masks.crop.cpu().numpy()
    out = []
    for i in order:
        m, y0, x0 = masks.crops[i]
        low = masks.low[i]
        out.append(MaskResult(m, int(y0), int(x0), float(iou[i]), None if low is None else low.float(),
                              crops[int(crop_idx[i])].view))
    boxes = masks.boxes.cpu().numpy()[order].astype(np.float64).reshape(-1, 4)
    boxes[:, 2:] += 1  # exclusive ends
    return AutomaticResult(
        labels=labels, masks=out, boxes=boxes, scores=masks.iou.cpu().numpy()[order],
        stability=masks.stab.cpu().numpy()[order], ids=ids[order],
        points=masks.points.cpu().numpy()[order].reshape(-1, 2), n_prompts=n_prompts, seconds=seconds)
