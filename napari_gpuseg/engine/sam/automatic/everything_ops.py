"""Building blocks of automatic mask generation: point grids, crop boxes, stability,
mask -> box, box non-maximum suppression (pure torch, no torchvision) and small-region
cleanup (scipy). Semantics follow the official ``segment_anything.utils.amg`` so the
same parameters mean the same thing; tensors stay on their device throughout.
"""
from __future__ import annotations

import math
from itertools import product

import numpy as np
import torch
from scipy import ndimage as ndi

from ...runtime.device import wide_float

EDGE_ATOL = 20.0  # official: masks whose box lies within 20 px of an inner crop edge are dropped
_EIGHT = np.ones((3, 3), dtype=bool)


# -- prompts and crops ----------------------------------------------------------------------
def point_grid(n_per_side: int) -> np.ndarray:
    """(n*n, 2) points (x, y) evenly spaced in [0, 1]^2, cell centres (row-major in y)."""
    offset = 1.0 / (2 * n_per_side)
    side = np.linspace(offset, 1 - offset, n_per_side)
    xs = np.tile(side[None, :], (n_per_side, 1))
    ys = np.tile(side[:, None], (1, n_per_side))
    return np.stack([xs, ys], axis=-1).reshape(-1, 2)


def layer_point_grids(n_per_side: int, n_layers: int, scale_per_layer: int = 1) -> list[np.ndarray]:
    """One normalised grid per crop layer; layer ``i`` has ``n / scale**i`` points a side."""
    return [point_grid(int(n_per_side / (scale_per_layer ** i))) for i in range(n_layers + 1)]


def crop_boxes(shape: tuple[int, int], n_layers: int, overlap_ratio: float
               ) -> tuple[list[list[int]], list[int]]:
    """Crop boxes ``[x0, y0, x1, y1]`` (exclusive end) and their layer: the whole image,
    then ``(2**i)**2`` overlapping crops in layer ``i`` (official geometry and order)."""
    im_h, im_w = int(shape[0]), int(shape[1])
    boxes, layers = [[0, 0, im_w, im_h]], [0]
    short = min(im_h, im_w)
    for i in range(n_layers):
        n = 2 ** (i + 1)
        overlap = int(overlap_ratio * short * (2 / n))
        cw = int(math.ceil((overlap * (n - 1) + im_w) / n))
        ch = int(math.ceil((overlap * (n - 1) + im_h) / n))
        xs = [int((cw - overlap) * k) for k in range(n)]
        ys = [int((ch - overlap) * k) for k in range(n)]
        for x0, y0 in product(xs, ys):
            boxes.append([x0, y0, min(x0 + cw, im_w), min(y0 + ch, im_h)])
            layers.append(i + 1)
    return boxes, layers


# -- mask statistics ---------------------------------------------------------------------------
def stability_score(logits: torch.Tensor, threshold: float = 0.0, offset: float = 1.0) -> torch.Tensor:
    """IoU of the masks thresholded at ``threshold + offset`` and ``threshold - offset``
    (the first is contained in the second). ``logits``: (N, H, W) -> (N,) float32."""
    inter = (logits > (threshold + offset)).flatten(1).sum(1, dtype=torch.int64)
    union = (logits > (threshold - offset)).flatten(1).sum(1, dtype=torch.int64)
    return inter.float() / union.float()  # 0/0 -> nan: never passes a threshold, like the official


def masks_to_boxes(masks: torch.Tensor) -> torch.Tensor:
    """(N, H, W) bool -> (N, 4) int64 ``x0, y0, x1, y1`` with *inclusive* ends (official
    convention); ``[0, 0, 0, 0]`` for an empty mask."""
    n, h, w = masks.shape
    if n == 0:
        return torch.zeros((0, 4), dtype=torch.int64, device=masks.device)
    rows = masks.any(dim=2)  # (N, H)
    cols = masks.any(dim=1)  # (N, W)
    ar_h = torch.arange(h, device=masks.device)
    ar_w = torch.arange(w, device=masks.device)
    y1 = torch.where(rows, ar_h, -1).amax(1)
    y0 = torch.where(rows, ar_h, h).amin(1)
    x1 = torch.where(cols, ar_w, -1).amax(1)
    x0 = torch.where(cols, ar_w, w).amin(1)
    out = torch.stack([x0, y0, x1, y1], dim=1)
    empty = ~rows.any(1)
    return out.masked_fill(empty[:, None], 0)


def near_crop_edge(boxes: torch.Tensor, crop_box, orig_box, atol: float = EDGE_ATOL) -> torch.Tensor:
    """True for boxes (image coords) within ``atol`` of an edge of ``crop_box`` that is not
    also an edge of the image ``orig_box``: such masks were cut by the crop."""
    crop = torch.as_tensor(crop_box, dtype=torch.float32, device=boxes.device)
    orig = torch.as_tensor(orig_box, dtype=torch.float32, device=boxes.device)
    b = boxes.float()
    near_crop = torch.isclose(b, crop[None, :], atol=atol, rtol=0)
    near_image = torch.isclose(b, orig[None, :], atol=atol, rtol=0)
    return (near_crop & ~near_image).any(dim=1)


# -- non-maximum suppression -------------------------------------------------------------------
def box_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Pairwise IoU of float boxes ``x0, y0, x1, y1`` (areas ``(x1-x0)*(y1-y0)``, as torchvision)."""
    area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
    area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    lt = torch.maximum(a[:, None, :2], b[None, :, :2])
    rb = torch.minimum(a[:, None, 2:], b[None, :, 2:])
    wh = (rb - lt).clamp(min=0)
    inter = wh[..., 0] * wh[..., 1]
    return inter / (area_a[:, None] + area_b[None, :] - inter)


def nms(boxes: torch.Tensor, scores: torch.Tensor, iou_threshold: float,
        chunk: int = 4096) -> torch.Tensor:
    """Greedy NMS: indices of kept boxes, highest score first (ties keep input order).

    Exact greedy result (what torchvision's kernel returns): the suppression matrix
    ``iou > threshold`` among score-sorted boxes is built on the boxes' device in chunks.
    On an accelerator the recursion "kept unless an earlier *kept* box overlaps it" is
    solved by fixed-point iteration (one matrix-vector product per step, no per-box
    host sync; it converges within the longest suppression chain); on the CPU a
    sequential sweep over the matrix is cheaper.
    """
    n = boxes.shape[0]
    if n == 0:
        return torch.zeros(0, dtype=torch.int64, device=boxes.device)
    order = torch.sort(scores, descending=True, stable=True).indices
    b = boxes[order].float()
    over = torch.zeros((n, n), dtype=torch.bool, device=b.device)
    for s in range(0, n, chunk):
        over[s:s + chunk] = box_iou(b[s:s + chunk], b).to(wide_float(b.device)) > float(iou_threshold)
    over = torch.triu(over, diagonal=1)  # over[i, j]: earlier box i would suppress later box j
    if b.device.type == "cpu":
        m = over.numpy()
        keep_np = np.ones(n, dtype=bool)
        for i in range(n):
            if keep_np[i]:
                keep_np &= ~m[i]
        keep = torch.from_numpy(keep_np)
    else:
        overf = over.to(torch.float32)
        keep = torch.ones(n, dtype=torch.bool, device=b.device)
        for _ in range(n):
            new = (keep.to(torch.float32) @ overf) == 0
            if torch.equal(new, keep):
                break
            keep = new
    return order[keep.to(order.device)]


# -- small regions and holes -------------------------------------------------------------------
def remove_small_regions(mask: np.ndarray, area_thresh: float, mode: str,
                         outside: int = 0) -> tuple[np.ndarray, bool]:
    """Fill holes (``mode="holes"``) or drop islands (``"islands"``) smaller than
    ``area_thresh`` pixels (8-connectivity). Returns ``(mask, changed)``.

    ``outside``: background pixels beyond ``mask``'s frame that touch it (the rest of the
    image when ``mask`` is a crop with a one-pixel empty border): they are added to the
    background component that touches the border so it is never taken for a hole.
    """
    if mode not in ("holes", "islands"):
        raise ValueError(f"mode must be 'holes' or 'islands', got {mode!r}")
    holes = mode == "holes"
    work = ~mask if holes else mask
    regions, n = ndi.label(work, structure=_EIGHT)
    if n == 0:
        return mask, False
    sizes = np.bincount(regions.ravel(), minlength=n + 1)[1:].astype(np.int64)
    if holes and outside:
        border = np.unique(np.concatenate([regions[0], regions[-1], regions[:, 0], regions[:, -1]]))
        for lab in border[border > 0]:
            sizes[lab - 1] += outside
    small = np.flatnonzero(sizes < area_thresh) + 1
    if len(small) == 0:
        return mask, False
    if holes:
        return mask | np.isin(regions, small), True
    keep = np.setdiff1d(np.arange(1, n + 1), small)
    if len(keep) == 0:
        keep = np.array([int(np.argmax(sizes)) + 1])
    return np.isin(regions, keep), True


def clean_mask(mask: np.ndarray, y0: int, x0: int, shape: tuple[int, int], min_area: int
               ) -> tuple[np.ndarray, int, int, bool]:
    """Holes then islands under ``min_area`` removed from a mask crop at ``(y0, x0)`` of an
    image of ``shape``; the crop is framed by one empty pixel where it is inside the image
    so that components touching the frame are measured as they are in the whole image.
    Returns ``(mask, y0, x0, changed)`` with the (possibly framed) crop."""
    h, w = mask.shape
    top, left = int(y0 > 0), int(x0 > 0)
    bottom, right = int(y0 + h < shape[0]), int(x0 + w < shape[1])
    framed = np.pad(mask, ((top, bottom), (left, right)))
    outside = int(shape[0]) * int(shape[1]) - framed.size
    framed, c1 = remove_small_regions(framed, min_area, "holes", outside=outside)
    framed, c2 = remove_small_regions(framed, min_area, "islands")
    return framed, y0 - top, x0 - left, c1 or c2


def largest_piece(mask: np.ndarray) -> tuple[np.ndarray, bool]:
    """The largest 4-connected piece of ``mask`` alone; ``changed`` when others were dropped."""
    lab, n = ndi.label(mask)
    if n <= 1:
        return mask, False
    sizes = np.bincount(lab.ravel(), minlength=n + 1)
    sizes[0] = 0
    return lab == int(np.argmax(sizes)), True


def paint_labels(crops: list, iou: torch.Tensor, shape, order: str, min_visible: int) -> tuple[np.ndarray, np.ndarray]:
    """One label image from mask ``crops`` ``(mask, y0, x0)`` scored by ``iou``; overlaps go to the higher score (or the smaller mask); objects left
    with fewer than ``min_visible`` pixels are removed; ids are 1..N by descending score."""
    n = len(crops)
    labels = np.zeros(shape, np.int32)
    ids = np.zeros(n, np.int32)
    if n == 0:
        return labels, ids
    score = iou.cpu().numpy()
    rank = np.argsort(-score, kind="stable")  # rank[k] = mask with the k-th highest score
    label_of = np.empty(n, np.int32)
    label_of[rank] = np.arange(1, n + 1)
    if order == "area":
        paint = sorted(range(n), key=lambda i: -int(crops[i][0].sum()))
    elif order == "score":
        paint = list(rank[::-1])
    else:
        raise ValueError(f"label_order must be 'score' or 'area', got {order!r}")
    for i in paint:
        m, y0, x0 = crops[i]
        region = labels[y0:y0 + m.shape[0], x0:x0 + m.shape[1]]
        region[m] = label_of[i]
    counts = np.bincount(labels.ravel(), minlength=n + 1)
    alive = counts >= max(1, min_visible)
    alive[0] = True
    lut = np.zeros(n + 1, np.int32)
    lut[alive] = np.arange(int(alive.sum()), dtype=np.int32)
    labels = lut[labels]
    ids = lut[label_of]
    return labels, ids
