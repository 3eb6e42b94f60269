"""Boxes -> SAM masks in large batches (Mode 2: detector + SAM refinement).

    boxes = detect_boxes(image, "threshold")         # engine.detect: "unet", a label image, a CSV
    result = segment_boxes(engine, image, boxes)     # AutomaticResult, label i+1 <- box i

Neighbouring boxes share views (small boxes share zoomed views); with an encoder that takes
any input size the native views are cut from one embedding of the whole image
(:mod:`..interactive.field_map`) where that needs fewer encoder passes; the other views of all images are
embedded in batched encoder calls (from the cache when already embedded), and the boxes
go through the decoder in adaptive batches (OOM back-off) that span views and images;
inside a batch the boxes of one view share its embedding in one factored decoder call
(:mod:`..interactive.fast_decoder`). Each box keeps the largest piece of its mask. This is the mode for
box-trained models such as LiteMedSAM.
"""
from __future__ import annotations

import time
from collections import defaultdict
from typing import Sequence

import numpy as np
import torch

from . import everything_ops as ops
from ..interactive import field_map as fieldmap
from ..interactive.fast_decoder import decode_sparse, mask_region
from .everything import AutomaticResult
from ...runtime.batching import remembered_batch_size, run_batched
from ...runtime.cancel import CancelToken, ProgressFn, check
from ..interactive.predictor import MaskResult, Prompt, SamEngine
from ..interactive.inputs import PreparedImage, logits_to_view_mask
from ..interactive.views import View, ViewSize, plan_cover, route_box

DEFAULT_BOX_BATCH = 64
RENDER_BYTES = 256 * 2**20
SCALES = (4.0, 1.0)  # routing="shared": view scales (input px per image px) boxes may use
ROUTE_MARGIN = 4.0  # input px a box keeps from the edge of a native or shrunk view (as SamEngine.route)


def prepare_boxes(boxes, shape: tuple[int, int], padding: float = 0.0) -> np.ndarray:
    """Boxes normalised to ``x0 <= x1``, ``y0 <= y1``, grown by ``padding`` px and clipped
    to the image; end-exclusive boxes become SAM's corner coordinates."""
    b = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    b = np.concatenate([np.minimum(b[:, :2], b[:, 2:]), np.maximum(b[:, :2], b[:, 2:])], axis=1)
    b[:, 2:] = np.maximum(b[:, 2:] - 1, b[:, :2])  # exclusive end -> last pixel
    b[:, :2] -= padding
    b[:, 2:] += padding
    h, w = shape
    return np.clip(b, 0, [w - 1, h - 1, w - 1, h - 1])


def box_array(boxes) -> np.ndarray:
    """``boxes`` as a float (N, 4) array: (N, 4) as given, one box of 4 numbers as (1, 4);
    ``ValueError`` saying so for any other shape (checked before any work is done)."""
    try:
        b = np.asarray(boxes, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"boxes must be (N, 4) numbers x0, y0, x1, y1, got {boxes!r:.80}") from exc
    if b.ndim == 1 and b.shape[0] == 4:
        return b[None]
    if b.size == 0:
        return b.reshape(0, 4)
    if b.ndim != 2 or b.shape[1] != 4:
        raise ValueError(f"boxes must be (N, 4) x0, y0, x1, y1 (or one box of 4 numbers), got shape {b.shape}")
    return b


# -- boxes -> views ----------------------------------------------------------------------
def per_box_views(engine: SamEngine, image: PreparedImage, boxes: np.ndarray, raw: np.ndarray,
                  zoom_below: float | None) -> list[View]:
    """Each box routed on its own (``routing="per-box"``, the earlier behaviour):
    :func:`views.route_box` over the grid tiles, a zoomed view per box under ``zoom_below``
    px (unpadded side)."""
    grid = engine.views(image)
    side = np.maximum(raw[:, 2] - raw[:, 0], raw[:, 3] - raw[:, 1]) + 1
    return [route_box(b, grid, image.shape, engine.input_size, ROUTE_MARGIN, zoom_below, sd)
            for b, sd in zip(boxes, side)]


def plan_views(engine: SamEngine, image: PreparedImage, boxes: np.ndarray, raw: np.ndarray,
               zoom_below: float | None, scales: Sequence[float] = SCALES,
               field_stride: int | None = None) -> list[View]:
    """The view of every box (``boxes`` padded, ``raw`` unpadded, inclusive corners), with
    as few views as a greedy cover finds (:func:`views.plan_cover`).

    Views come in ``scales`` (model input px per image px: 1 native, 2 and 4 zoomed, 0.5
    shrunk). A box may use a scale at which its (unpadded) longest side spans at least
    ``zoom_below`` input px; zoomed views serve only boxes smaller than that (the smallest
    ones, too small for every zoom, the largest zoom). A box keeps a margin of 4 input px
    in native and shrunk views and a context of its own size in zoomed
    ones. Grid tiles already embedded are taken first (free), grid tiles win ties among
    native views (the annotator's cache is shared), and each box is decoded in the finest
    chosen view that holds it. Boxes too large for every view get a larger view centred on
    them. Never more views than :func:`per_box_views`: if the cover finds more (it is
    greedy), the per-box routing is used. With ``field_stride`` (the image's native views
    are cut from one field embedding, :mod:`..interactive.field_map`) native views cost no encoder pass:
    they sit on the stride's grid and the grid tiles get no preference."""
    n = len(boxes)
    s = engine.input_size
    grid = engine.views(image)
    side = np.maximum(raw[:, 2] - raw[:, 0], raw[:, 3] - raw[:, 1]) + 1
    scales = sorted(scales, reverse=True) if zoom_below else [1.0]
    need = zoom_below or 0.0
    top = scales[0]
    kinds = []
    small = side < need  # too small for a native view
    for z in scales:
        size = int(round(s / z))
        if z > 1:  # zoomed, for small boxes: a context of the box's own size on every side
            allowed = small & ((side * z >= need) | (z == top))
            margin = np.maximum(side, 2.0)
        else:
            allowed = ~small & (side * z >= need)
            margin = np.full(n, ROUTE_MARGIN / z)
        native = z == 1.0
        if native and field_stride:
            kinds.append(ViewSize(size, margin, allowed, align=field_stride))
            continue
        cached = [v for v in grid if engine.is_embedded(image, [v])] if native else []
        kinds.append(ViewSize(size, margin, allowed, grid if native else [], cached))
    out: list = [None] * n
    views, assign = plan_cover(boxes, image.shape, s, kinds)
    for i in range(n):
        out[i] = views[assign[i]] if assign[i] >= 0 else engine.route(image, Prompt(box=boxes[i]))
    per_box = per_box_views(engine, image, boxes, raw, zoom_below)
    if field_stride:  # compared in encoder passes: the field map is one pass over the whole image
        return per_box if encoder_passes(engine, image, per_box) < encoder_passes(
            engine, image, out, field_stride) else out
    return per_box if len(set(per_box)) < len(set(out)) else out


def encoder_passes(engine: SamEngine, image: PreparedImage, views: Sequence[View],
                   field_stride: int | None = None) -> float:
    """The encoder work a plan still needs, in passes of one model input: its views not yet
    embedded, and (with ``field_stride``) the field map its native views are cut from."""
    cut = [v for v in set(views) if fieldmap.holds(v, field_stride)]
    own = [v for v in set(views) if v not in cut and not engine.is_embedded(image, [v])]
    field = fieldmap.passes(engine, image) if cut and not fieldmap.is_embedded(engine, image) else 0.0
    return len(own) + field


def choose_views(engine: SamEngine, image: PreparedImage, boxes: np.ndarray, raw: np.ndarray,
                 zoom_below: float | None, field_stride: int | None) -> tuple[list[View], int | None]:
    """:func:`plan_views` with and without a field map (``field_stride``; images at least
    one model input on each side): the plan with less encoder work, and the stride its
    native views are cut with (None: every view embedded on its own)."""
    tiles = plan_views(engine, image, boxes, raw, zoom_below)
    if not field_stride or min(image.shape) < engine.input_size:
        return tiles, None
    cut = plan_views(engine, image, boxes, raw, zoom_below, field_stride=field_stride)
    if encoder_passes(engine, image, cut, field_stride) < encoder_passes(engine, image, tiles):
        return cut, field_stride
    return tiles, None


# -- boxes -> masks ----------------------------------------------------------------------
def _crop_to_mask(masks: torch.Tensor, view) -> list[tuple[np.ndarray, int, int]]:
    boxes = ops.masks_to_boxes(masks).cpu().numpy()
    m = masks.cpu().numpy()
    out = []
    for k, (x0, y0, x1, y1) in enumerate(boxes):
        out.append((m[k, y0:y1 + 1, x0:x1 + 1].copy(), view.y0 + int(y0), view.x0 + int(x0)))
    return out


def _best_fit(masks: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Index of the candidate (dim 1 of ``masks`` (n, c, h, w)) whose bounding box has the
    highest IoU with ``target`` (n, 4) inclusive corners; empty masks never win."""
    n, c = masks.shape[:2]
    mb = ops.masks_to_boxes(masks.flatten(0, 1)).view(n, c, 4).float()
    lt = torch.maximum(mb[..., :2], target[:, None, :2])
    rb = torch.minimum(mb[..., 2:], target[:, None, 2:])
    inter = (rb - lt + 1).clamp(min=0).prod(-1)
    area_m = (mb[..., 2:] - mb[..., :2] + 1).prod(-1)
    area_t = (target[:, 2:] - target[:, :2] + 1).prod(-1)[:, None]
    fit = inter / (area_m + area_t - inter)
    fit = torch.where(masks.flatten(2).any(-1), fit, torch.full_like(fit, -1.0))
    return fit.argmax(1)


def segment_boxes_batch(engine: SamEngine, images: Sequence, boxes: Sequence, padding: float = 0.0,
                        batch_size: int | None = None, embed_batch_size: int | None = None,
                        min_area: int = 0, zoom_small: bool = True, mask_choice: str = "box-fit",
                        progress: ProgressFn = None, cancel: CancelToken | None = None,
                        routing: str = "shared", field: bool = True, one_piece: bool = True,
                        keep_logits: bool = True) -> list[AutomaticResult]:
    """One :class:`AutomaticResult` per image from its boxes (several images per call).

    ``batch_size``: boxes per decoder call (default 64 or what worked before; halved on
    OOM); ``embed_batch_size``: views per encoder call; ``min_area``: holes and islands
    smaller than this are cleaned from each mask and objects left with fewer visible
    pixels are dropped; ``zoom_small``: boxes under 1/16 of the model input (16 px for
    LiteMedSAM) get a zoomed view of their own (see :func:`route_box`); ``mask_choice``:
    ``"box-fit"`` takes, of the single-mask output and the three multimask outputs, the
    mask whose bounding box best matches the box (a box states the object's extent;
    LiteMedSAM's single output often covers only the bright part of large, textured
    nuclei: BBBC039 validation crops, ground-truth boxes; docs/benchmarks.md), or
    ``"single"`` the single-mask output. The score of an object is the single output's
    predicted IoU either way. ``routing``: ``"shared"`` (default) lets boxes share views
    (see :func:`plan_views`), ``"per-box"`` routes each box on its own (:func:`route_box`,
    a zoomed view per small box; the earlier behaviour). ``field`` (with shared routing,
    for encoders that take any input size, as TinyViT does): native views are cut from one
    embedding of the whole image (:mod:`..interactive.field_map`, normalised locally for min-max models)
    where that needs fewer encoder passes: about a third less encoder work on a 520 x 696
    field; ``field=False`` embeds every view on its own. ``one_piece``: each box's mask
    keeps only its largest connected piece (a box holds one object; stray pieces beside it
    are dropped). ``keep_logits``: each mask keeps its low-res logits (``low_res``, on the
    host, for refinement); ``False`` drops them (``low_res`` None), which a stack of many
    boxes needs to stay small. Label ``i + 1`` is the mask of box ``i`` (where visible).
    Each box list is (N, 4), or one box of 4 numbers; anything else is a ``ValueError``
    before any work.
    """
    t0 = time.perf_counter()
    if len(boxes) != len(images):
        raise ValueError(f"{len(images)} images but {len(boxes)} box lists")
    boxes = [box_array(b) for b in boxes]
    if mask_choice not in ("box-fit", "single"):
        raise ValueError(f"mask_choice must be 'box-fit' or 'single', got {mask_choice!r}")
    if routing not in ("shared", "per-box"):
        raise ValueError(f"routing must be 'shared' or 'per-box', got {routing!r}")
    run = _BoxRun(engine, [engine.prepare(im) for im in images], mask_choice == "box-fit", keep_logits, cancel)
    run.plan(boxes, padding, engine.input_size / 16 if zoom_small else None,
             fieldmap.field_stride(engine) if field and routing == "shared" else None, routing)
    n_views = run.embed(embed_batch_size, progress)
    dev, sam = engine.policy.device, engine.sam
    key = ("sam-boxes", engine.info.name, engine.input_size, engine.policy.precision, str(dev))
    start = batch_size or remembered_batch_size(key) or DEFAULT_BOX_BATCH
    hw = int(np.prod(sam.prompt_encoder.image_embedding_size))
    order = sorted(range(len(run.items)), key=lambda k: (run.items[k][0], run.items[k][2]))
    decoded = run_batched(run.decode, order, batch_size=start, key=key, device=dev,
                          item_bytes=64 * 4 * hw * 256, progress=run.offset_progress(n_views), cancel=cancel)
    per_image: list[list] = [[None] * len(b) for b in boxes]
    for k, res in zip(order, decoded):
        per_image[run.items[k][0]][run.items[k][1]] = res
    seconds = time.perf_counter() - t0
    return [_assemble(img.shape, res, prepare_boxes(b, img.shape, padding), min_area, seconds, one_piece)
            for img, res, b in zip(run.prepared, per_image, boxes)]


class _BoxRun:
    """The boxes of one :func:`segment_boxes_batch` call: routed to views, embedded (views
    cut from one field map where that costs fewer encoder passes), decoded per view."""

    def __init__(self, engine: SamEngine, prepared: list[PreparedImage], fit: bool, keep_logits: bool, cancel):
        self.engine, self.prepared, self.fit, self.keep_logits, self.cancel = engine, prepared, fit, keep_logits, cancel
        self.items: list = []  # (image, box index, view, padded box, box) with inclusive corners
        self.strides: list[int | None] = []  # per image: the stride its native views are cut with
        self.needed: list[list] = []
        self.cut_from_field = [False] * len(prepared)
        # field maps live in the engine's (bounded) cache, like view embeddings; the decoder keeps
        # the map of the image it is on (a stack's maps need not all fit in memory at once)
        self.current: dict[int, torch.Tensor | None] = {}
        self.total, self.progress = 0, None

    def plan(self, boxes, padding, zoom_below, stride, routing) -> None:
        for i, (img, bxs) in enumerate(zip(self.prepared, boxes)):
            raw = prepare_boxes(bxs, img.shape, 0.0)
            padded = prepare_boxes(bxs, img.shape, padding)
            if routing == "shared":
                routed, cut_stride = choose_views(self.engine, img, padded, raw, zoom_below, stride)
            else:
                routed, cut_stride = per_box_views(self.engine, img, padded, raw, zoom_below), None
            self.strides.append(cut_stride)
            for j, (b, v) in enumerate(zip(padded, routed)):
                self.items.append((i, j, v, b, raw[j]))
        self.needed = [sorted({v for (i, _j, v, _b, _r) in self.items if i == k}) for k in range(len(self.prepared))]

    def offset_progress(self, offset: int):
        return None if self.progress is None else (lambda d, _t: self.progress(offset + d, self.total))

    def embed(self, embed_batch_size, progress) -> int:
        """Field maps first (their views are then cut, not embedded), then the other views;
        returns the number of views (the first part of the progress total)."""
        n_views = sum(len(v) for v in self.needed)
        self.total, self.progress = n_views + len(self.items), progress
        done = 0
        for k, img in enumerate(self.prepared):
            cut = [v for v in self.needed[k] if fieldmap.holds(v, self.strides[k])]
            fmap = fieldmap.embed_field(self.engine, img, self.cancel) if cut else None
            if fmap is not None:
                self.cut_from_field[k] = True
                if not self.current:  # the first image decoded
                    self.current[k] = fmap
                self.needed[k] = [v for v in self.needed[k] if v not in cut]
                done += len(cut)
                if progress is not None:
                    progress(done, self.total)
            del fmap
        self.engine.embed(self.prepared, self.needed, batch_size=embed_batch_size,
                          progress=self.offset_progress(done), cancel=self.cancel)
        return n_views

    def field_of(self, i: int) -> torch.Tensor | None:
        if i not in self.current:
            self.current.clear()
            self.current[i] = fieldmap.embed_field(self.engine, self.prepared[i], self.cancel)  # cached, or again
        return self.current[i]

    def decode(self, idx: list[int]):
        """Boxes ``idx`` (sorted by image and view): one factored decoder call per view."""
        check(self.cancel)
        groups: dict = defaultdict(list)
        for pos, k in enumerate(idx):
            groups[(self.items[k][0], self.items[k][2])].append(pos)
        out: list = [None] * len(idx)
        for (i, view), positions in groups.items():
            self._decode_view(i, view, [self.items[idx[p]] for p in positions], positions, out)
        return out

    def _decode_view(self, i: int, view, items: list, positions: list[int], out: list) -> None:
        engine, sam = self.engine, self.engine.sam
        dev, img = engine.policy.device, self.prepared[i]
        fmap = self.field_of(i) if self.cut_from_field[i] and fieldmap.holds(view, self.strides[i]) else None
        cut = fmap is not None
        # host embeddings: decode_sparse copies one to the device only when its memo is new
        emb = fieldmap.view_embedding(fmap, view, self.strides[i]) if cut else engine.embedding(img, view)
        bx = np.stack([view.to_input(it[3]) for it in items])
        roi = torch.as_tensor(mask_region(bx, engine.input_size, emb.shape[-1]), device=dev)
        with torch.inference_mode(), engine.policy.autocast():
            sparse, _dense = sam.prompt_encoder(points=None, masks=None,
                                                boxes=torch.as_tensor(bx, dtype=torch.float32, device=dev))
            iou, _sel, low = decode_sparse(sam, emb, sparse, "all" if self.fit else "single", roi=roi, device=dev,
                                           memo=engine.decoder_memo(img, view, "field" if cut else "view"))
        score, c = iou[:, 0], low.shape[1]
        per = max(1, RENDER_BYTES // (view.h * view.w * 4 * c))
        for s in range(0, len(positions), per):
            sub = slice(s, min(s + per, len(positions)))
            n = sub.stop - sub.start
            masks = (logits_to_view_mask(low[sub].flatten(0, 1), view) > 0).unflatten(0, (n, c))
            pick = torch.zeros(n, dtype=torch.int64, device=dev)
            if c > 1:
                target = np.stack([it[4] for it in items[sub]]) - [view.x0, view.y0, view.x0, view.y0]
                pick = _best_fit(masks, torch.as_tensor(target, dtype=torch.float32, device=dev))
            ar = torch.arange(n, device=dev)
            scores = score[sub].tolist()  # one device->host copy per block, not one per box
            # the chosen low-res logits go to the host in the same block copy (or not at
            # all): kept on the device, a stack's boxes would hold gigabytes there
            lows = low[sub][ar, pick].detach().half().cpu().unbind(0) if self.keep_logits else [None] * n
            for k, (p, crop) in enumerate(zip(positions[sub], _crop_to_mask(masks[ar, pick], view))):
                out[p] = (crop, scores[k], lows[k], view)


def _assemble(shape, decoded: list, boxes: np.ndarray, min_area: int, seconds: float,
              one_piece: bool = True) -> AutomaticResult:
    """Paint masks (low scores first, so high scores win overlaps); label i+1 = box i."""
    labels = np.zeros(shape, np.int32)
    masks, scores = [], np.zeros(len(decoded))
    for i, ((m, y0, x0), score, low, view) in enumerate(decoded):
        if min_area > 0 and m.size:
            m, y0, x0, _changed = ops.clean_mask(m, y0, x0, shape, min_area)
        if one_piece and m.size:
            m, _changed = ops.largest_piece(m)
        masks.append(MaskResult(m, int(y0), int(x0), score, None if low is None else low.float(), view))
        scores[i] = score
    for i in np.argsort(scores, kind="stable"):
        r = masks[i]
        region = labels[r.y0:r.y0 + r.mask.shape[0], r.x0:r.x0 + r.mask.shape[1]]
        region[r.mask] = i + 1
    counts = np.bincount(labels.ravel(), minlength=len(masks) + 1)
    ids = np.arange(1, len(masks) + 1, dtype=np.int32)
    hidden = counts[1:] < max(1, min_area)
    if hidden.any():
        lut = np.arange(len(masks) + 1, dtype=np.int32)
        lut[1:][hidden] = 0
        labels = lut[labels]
        ids[hidden] = 0
    out_boxes = boxes.copy()
    out_boxes[:, 2:] += 1
    return AutomaticResult(labels=labels, masks=masks, boxes=out_boxes, scores=scores,
                           stability=np.full(len(masks), np.nan), ids=ids,
                           points=np.zeros((len(masks), 2)), n_prompts=len(masks), seconds=seconds)


def segment_boxes(engine: SamEngine, image, boxes, padding: float = 0.0, batch_size: int | None = None,
                  embed_batch_size: int | None = None, min_area: int = 0, zoom_small: bool = True,
                  mask_choice: str = "box-fit", progress: ProgressFn = None,
                  cancel: CancelToken | None = None, routing: str = "shared",
                  field: bool = True, one_piece: bool = True, keep_logits: bool = True) -> AutomaticResult:
    """Masks for ``boxes`` (N, 4) ``x0, y0, x1, y1`` (end exclusive; or one box of 4
    numbers) in one 2D image; see :func:`segment_boxes_batch`."""
    return segment_boxes_batch(engine, [image], [boxes], padding=padding, batch_size=batch_size,
                               embed_batch_size=embed_batch_size, min_area=min_area,
                               zoom_small=zoom_small, mask_choice=mask_choice, progress=progress,
                               cancel=cancel, routing=routing, field=field, one_piece=one_piece,
                               keep_logits=keep_logits)[0]
