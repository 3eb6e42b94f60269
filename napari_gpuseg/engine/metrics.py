"""Segmentation metrics: object matching at an IoU threshold and foreground IoU.

Functions accept one label image or a list of them (pooled: counts are summed over
images before the ratio is taken, so an empty image does not dominate the mean).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import linear_sum_assignment


@dataclass
class MatchStats:
    tp: int = 0
    fp: int = 0
    fn: int = 0
    sum_iou: float = 0.0

    def __add__(self, other: "MatchStats") -> "MatchStats":
        return MatchStats(self.tp + other.tp, self.fp + other.fp, self.fn + other.fn, self.sum_iou + other.sum_iou)

    @property
    def f1(self) -> float:
        denom = 2 * self.tp + self.fp + self.fn
        return 1.0 if denom == 0 else 2 * self.tp / denom

    @property
    def precision(self) -> float:
        return 1.0 if self.tp + self.fp == 0 else self.tp / (self.tp + self.fp)

    @property
    def recall(self) -> float:
        return 1.0 if self.tp + self.fn == 0 else self.tp / (self.tp + self.fn)

    @property
    def mean_iou(self) -> float:
        return self.sum_iou / self.tp if self.tp else 0.0


def iou_matrix(gt: np.ndarray, pred: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """IoU between every gt object and every predicted object (rows gt, columns pred).

    Returns ``(iou, gt_ids, pred_ids)``; only ids present in the images are included.
    """
    gt = np.asarray(gt).ravel()
    pred = np.asarray(pred).ravel()
    if gt.shape != pred.shape:
        raise ValueError(f"shape mismatch: {gt.shape} vs {pred.shape}")
    gt_ids, gt_inv = np.unique(gt, return_inverse=True)
    pr_ids, pr_inv = np.unique(pred, return_inverse=True)
    # contingency table over (gt id, pred id) pairs, including background 0
    pairs = gt_inv.astype(np.int64) * len(pr_ids) + pr_inv
    table = np.bincount(pairs, minlength=len(gt_ids) * len(pr_ids)).reshape(len(gt_ids), len(pr_ids))
    g_fg = gt_ids != 0
    p_fg = pr_ids != 0
    area_g = table.sum(1)[g_fg]
    area_p = table.sum(0)[p_fg]
    inter = table[np.ix_(g_fg, p_fg)].astype(np.float64)
    union = area_g[:, None] + area_p[None, :] - inter
    iou = np.divide(inter, union, out=np.zeros_like(inter), where=union > 0)
    return iou, gt_ids[g_fg], pr_ids[p_fg]


def match_stats(gt: np.ndarray, pred: np.ndarray, iou: float = 0.5) -> MatchStats:
    """One-to-one matching maximising total IoU among pairs with IoU >= ``iou``."""
    mat, g, p = iou_matrix(gt, pred)
    n_g, n_p = len(g), len(p)
    if n_g == 0 or n_p == 0:
        return MatchStats(0, n_p, n_g, 0.0)
    valid = mat >= iou
    if iou > 0.5:
        # above 0.5 each object overlaps at most one partner by more than half: no assignment needed
        rows, cols = np.nonzero(valid)
    else:
        cost = -np.where(valid, mat, 0.0)
        rows, cols = linear_sum_assignment(cost)
        keep = valid[rows, cols]
        rows, cols = rows[keep], cols[keep]
    tp = len(rows)
    return MatchStats(tp, n_p - tp, n_g - tp, float(mat[rows, cols].sum()))


def _pairs(gt, pred):
    if isinstance(gt, (list, tuple)):
        if len(gt) != len(pred):
            raise ValueError("gt and pred lists differ in length")
        return list(zip(gt, pred))
    return [(gt, pred)]


def pooled_stats(gt, pred, iou: float = 0.5) -> MatchStats:
    total = MatchStats()
    for g, p in _pairs(gt, pred):
        total = total + match_stats(g, p, iou)
    return total


def object_f1(gt, pred, iou: float = 0.5) -> float:
    """Object F1 = 2TP / (2TP + FP + FN) at IoU threshold ``iou`` (pooled over a list)."""
    return pooled_stats(gt, pred, iou).f1


def mean_matched_iou(gt, pred, iou: float = 0.5) -> float:
    """Mean IoU of matched object pairs (matched at ``iou``)."""
    return pooled_stats(gt, pred, iou).mean_iou


def foreground_iou(gt, pred) -> float:
    """Binary IoU of ``gt > 0`` and ``pred > 0`` (pooled over a list; both empty = 1)."""
    inter = union = 0
    for g, p in _pairs(gt, pred):
        g = np.asarray(g) > 0
        p = np.asarray(p) > 0
        inter += int(np.count_nonzero(g & p))
        union += int(np.count_nonzero(g | p))
    return 1.0 if union == 0 else inter / union


def summary(gt, pred, thresholds=(0.5, 0.75)) -> dict:
    """F1 (and precision/recall) at each threshold, foreground IoU, mean matched IoU."""
    out: dict = {"foreground_iou": foreground_iou(gt, pred)}
    for t in thresholds:
        s = pooled_stats(gt, pred, t)
        key = f"{t:g}"
        out[f"f1@{key}"] = s.f1
        out[f"precision@{key}"] = s.precision
        out[f"recall@{key}"] = s.recall
        if t == thresholds[0]:
            out[f"mean_matched_iou@{key}"] = s.mean_iou
    return out


def mask_set_match(a: list, b: list, iou: float = 0.9) -> tuple[float, float]:
    """Fraction of the (possibly overlapping) binary masks of ``a`` / of ``b`` that have a
    partner in the other set with IoU >= ``iou`` (two empty sets match fully). Used to
    compare our automatic mask sets with the official generator's."""
    if not a or not b:
        return float(len(a) == len(b)), float(len(a) == len(b))
    A = np.stack(a).reshape(len(a), -1).astype(np.float32)
    B = np.stack(b).reshape(len(b), -1).astype(np.float32)
    inter = A @ B.T
    union = A.sum(1)[:, None] + B.sum(1)[None] - inter
    m = np.where(union > 0, inter / np.maximum(union, 1), 1.0)
    return float((m.max(1) >= iou).mean()), float((m.max(0) >= iou).mean())
