"""Segment everything on images much larger than the model input: native-resolution tiles,
crop-edge filtering and the merge across tile borders.

The network is replaced by an oracle (the test is about the tiling logic, and a real model
on hundreds of tiles would take minutes on this CPU): the engine's "embedding" of a view
records the view, and the "decoder" returns, for a point on a disk of a synthetic image,
low-resolution logits of that disk as seen in the view (predicted IoU 0.95; 0.1 for
points on background or disks the view shows smaller than 8 x 8 px). Every disk must come
out exactly once and whole, including the many that straddle tile borders.
"""
from __future__ import annotations

import numpy as np
import torch
from scipy import ndimage as ndi

from napari_gpuseg.engine.sam.automatic import everything as automatic
from napari_gpuseg.engine.sam.automatic.everything import AutomaticParams, plan_crops, segment_everything
from napari_gpuseg.engine.runtime.device import Policy
from napari_gpuseg.engine.sam.interactive.predictor import SamEngine, SamModelInfo
from napari_gpuseg.engine.sam.interactive.views import View


def disks(shape, n, radius, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    labels = np.zeros(shape, np.int32)
    yy, xx = np.mgrid[: shape[0], : shape[1]]
    k = 0
    for _ in range(n * 20):
        cy, cx = rng.integers(radius + 2, shape[0] - radius - 2), rng.integers(radius + 2, shape[1] - radius - 2)
        disk = (yy - cy) ** 2 + (xx - cx) ** 2 <= radius ** 2
        if labels[ndi.binary_dilation(disk, iterations=3)].any():
            continue
        k += 1
        labels[disk] = k
        if k == n:
            break
    return labels


S = 256  # model input: native tiles of 256 px overlapping by 64 px (the engine's default)


class OracleEngine(SamEngine):
    def __init__(self, truth: np.ndarray):
        super().__init__(torch.nn.Identity(), SamModelInfo("oracle", S, "none"),
                         Policy(torch.device("cpu"), "fp32"))
        self.embedded = 0

    def embed(self, images, views=None, batch_size=None, progress=None, cancel=None):
        self.embedded += sum(len(v) for v in views)
        return [self.prepare(im) for im in images]

    def embedding(self, image, view):
        return torch.tensor([view.y0, view.x0, view.h, view.w], dtype=torch.float64)


def oracle_decode(truth):
    areas = np.bincount(truth.ravel())
    low_side = S // 4
    centres = (torch.arange(low_side, dtype=torch.float64) + 0.5) * (S / low_side)

    def decode(sam, emb, coords, multimask=True, iou_thresh=float("-inf"), factored=None, memo=None):
        y0, x0, h, w = (int(v) for v in emb.tolist())
        view = View(y0, x0, h, w, S)
        n = coords.shape[0]
        iou = torch.full((n, 3), 0.1)
        low = torch.full((n, 3, low_side, low_side), -10.0)
        ys = (y0 + centres / view.scale).clamp(max=truth.shape[0] - 1).long().numpy()
        xs = (x0 + centres / view.scale).clamp(max=truth.shape[1] - 1).long().numpy()
        rh, rw = view.resized_hw
        inside = (centres[:, None] < rh) & (centres[None, :] < rw)
        sampled = torch.from_numpy(truth[np.ix_(ys, xs)])
        for i, (px, py) in enumerate(coords.tolist()):
            k = int(truth[int(y0 + py / view.scale), int(x0 + px / view.scale)])
            if k == 0 or areas[k] * view.scale ** 2 < 64:
                continue
            low[i, 0] = torch.where((sampled == k) & inside, 10.0, -10.0)
            iou[i, 0] = 0.95
        sel = torch.nonzero((iou > iou_thresh).any(1)).flatten()
        return iou, sel, low[sel]
    return decode


def test_tiles_merge_objects_across_borders(monkeypatch):
    truth = disks((700, 900), n=60, radius=9)
    engine = OracleEngine(truth)
    monkeypatch.setattr(automatic, "decode_points", oracle_decode(truth))
    params = AutomaticParams(points_per_side=24, pred_iou_thresh=0.5, stability_score_thresh=0.8)
    prepared = engine.prepare(truth.astype(np.float32))
    crops = plan_crops(engine, prepared, params)
    assert crops[0].view == View(0, 0, 700, 900, S) and len(crops) == 21  # whole image + 20 native tiles
    assert all(c.view.scale == 1.0 for c in crops[1:])
    borders = {c.box[0] for c in crops[1:]} | {c.box[2] for c in crops[1:]}
    straddling = [k for k in range(1, truth.max() + 1)
                  if any(np.any(np.nonzero(truth == k)[1] == b) for b in borders if 0 < b < 900)]
    assert len(straddling) >= 10
    res = segment_everything(engine, truth.astype(np.float32), params)
    assert engine.embedded == len(crops)
    assert res.labels.shape == truth.shape and res.labels.dtype == np.int32
    n = int(truth.max())
    assert res.labels.max() == n, (res.labels.max(), n)  # each disk once: duplicates merged
    for k in range(1, n + 1):
        ids, counts = np.unique(res.labels[truth == k], return_counts=True)
        best = ids[np.argmax(counts)]
        assert best > 0
        found = res.labels == best
        assert (found & (truth == k)).sum() / (found | (truth == k)).sum() > 0.7, k


def test_crops_mode_keeps_the_official_geometry():
    engine = OracleEngine(np.zeros((300, 200), np.int32))
    prepared = engine.prepare(np.zeros((300, 200), np.float32))
    crops = plan_crops(engine, prepared, AutomaticParams(crop_n_layers=1))  # auto: 300 <= 2 x 256
    assert [c.box for c in crops][:2] == [(0, 0, 200, 300), (0, 0, 134, 184)]
    assert len(crops) == 5 and {c.layer for c in crops} == {0, 1}
    assert crops[1].view == View(0, 0, 184, 134, S)  # each crop is embedded on its own, resized
    big = engine.prepare(np.zeros((600, 200), np.float32))
    assert len(plan_crops(engine, big, AutomaticParams())) == 1 + len(engine.views(big))  # auto: tiles


def test_each_kind_of_model_gets_its_own_everything_defaults():
    official = AutomaticParams.for_model()
    assert (official.points_per_side, official.pred_iou_thresh, official.stability_score_thresh) == (32, 0.88, 0.95)
    box = AutomaticParams.for_model(box_trained=True)
    assert (box.points_per_side, box.pred_iou_thresh, box.stability_score_thresh) == (16, 0.18, 0.0)
    tuned = AutomaticParams.for_model(decoder_tuned=True)
    assert (tuned.points_per_side, tuned.pred_iou_thresh, tuned.stability_score_thresh) == (16, 0.5, 0.95)
    assert tuned.min_mask_region_area == 20 and tuned.tiling == "tiles"
    assert AutomaticParams.for_model(decoder_tuned=True, points_per_side=8).points_per_side == 8  # overrides win
