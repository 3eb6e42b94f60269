"""Propagation through a stack with the real LiteMedSAM on a crop of shared/data/synthetic3d."""
from __future__ import annotations

import numpy as np
import pytest
import tifffile

from napari_gpuseg.engine.runtime.cancel import CancelToken
from napari_gpuseg.engine.annotate.label_commits import LabelCommitter
from napari_gpuseg.engine.sam.propagation.propagate import (PropagateOptions, contrast, mask_box, propagate, propagate_all,
                                               reference_contrast)

from sam_fixtures import iou, require_lite_medsam

OBJ, Z0, Z1 = 36, 2, 9  # object 36 spans z 1..6; the crop holds z 2..8 (ends at crop slice 4)


@pytest.fixture(scope="module")
def stack(shared_data):
    vol = tifffile.imread(shared_data / "synthetic3d" / "image.tif")[Z0:Z1]
    gt = tifffile.imread(shared_data / "synthetic3d" / "mask.tif")[Z0:Z1]
    return vol, gt


@pytest.fixture(scope="module")
def engine():
    import torch

    from napari_gpuseg.engine.runtime.device import Policy
    from napari_gpuseg.engine.sam.loader import load_engine

    require_lite_medsam()
    return load_engine("lite_medsam", Policy(torch.device("cpu"), "fp32"))


def test_one_box_grows_both_ways_and_stops_where_the_object_ends(engine, stack):
    vol, gt = stack
    truth = gt == OBJ
    seen = []
    r = propagate(engine, vol, 2, mask_box(truth[2], 1), on_slice=lambda z, m: seen.append(z))
    assert seen[0] == 2 and set(seen) == set(r.masks)
    first, last = r.extent
    assert first == 0 and last >= 3  # the object's last slice in the crop is 4
    # why each direction stopped, keyed by direction (-1: towards slice 0, +1: towards the last)
    assert sorted(r.stopped) == [-1, 1], r.stopped
    assert r.stopped[-1] == "end of stack" and r.stopped[1] != "end of stack", r.stopped
    assert np.mean([iou(r.masks[z], truth[z]) for z in (1, 2, 3)]) > 0.5
    vol3d = r.volume(gt.shape)
    assert iou(vol3d, truth) > 0.4


def test_stops_within_one_slice_of_the_objects_end(engine, stack):
    vol, gt = stack
    r = propagate(engine, vol, 2, mask_box(gt[2] == OBJ, 1))
    assert r.extent[1] <= 5
    assert r.stopped[1].startswith("faded out")


def test_without_the_contrast_rule_sam_runs_past_the_end(engine, stack):
    """What the contrast rule is for: the shape rules alone let LiteMedSAM go on."""
    vol, gt = stack
    r = propagate(engine, vol, 2, mask_box(gt[2] == OBJ, 1), PropagateOptions(min_contrast=0))
    assert r.extent[1] >= 6


def test_contrast_is_inside_minus_ring_and_off_for_a_flat_start():
    plane = np.full((40, 40), 10.0)
    plane[10:20, 10:20] = 30.0
    mask = np.zeros((40, 40), bool)
    mask[10:20, 10:20] = True
    assert contrast(plane, mask) == pytest.approx(20.0)
    assert contrast(plane, np.zeros_like(mask)) == 0.0
    assert reference_contrast(plane, mask) == pytest.approx(20.0)
    assert reference_contrast(np.full((40, 40), 5.0), mask) is None  # nothing stands out
    rgb = np.repeat(plane[..., None], 3, axis=2)
    assert contrast(rgb, mask) == pytest.approx(20.0, rel=1e-3)
    with pytest.raises(ValueError, match="min_contrast"):
        PropagateOptions(min_contrast=1.5)


def test_cancel_keeps_the_slices_done(engine, stack):
    vol, gt = stack
    token = CancelToken()

    def stop_after_two(_i, z, _m):
        if z != 2:
            token.cancel()

    (r,) = propagate_all(engine, vol, 2, [gt[2] == OBJ], on_slice=stop_after_two, cancel=token)
    assert r.cancelled and 2 in r.masks and 1 <= len(r.masks) - 1 <= 2


def test_all_objects_of_a_slice_at_once_match_one_at_a_time(engine, stack):
    vol, gt = stack
    ids = [i for i in np.unique(gt[2]) if i and (gt[2] == i).sum() > 40][:3]
    starts = [gt[2] == i for i in ids]
    together = propagate_all(engine, vol, 2, starts)
    for s, t in zip(starts, together):
        alone = propagate(engine, vol, 2, s)
        assert sorted(alone.masks) == sorted(t.masks)
        assert all(np.array_equal(alone.masks[z], t.masks[z]) for z in alone.masks)


def test_bad_input_is_one_clear_message(engine, stack):
    vol, _gt = stack
    with pytest.raises(ValueError, match="outside the stack"):
        propagate(engine, vol, 99, [1, 1, 5, 5])
    with pytest.raises(ValueError, match="mask or an"):
        propagate(engine, vol, 2, np.zeros((3, 3), bool))
    with pytest.raises(ValueError, match="needs a stack"):
        propagate(engine, vol[0], 0, [1, 1, 5, 5])
    with pytest.raises(ValueError, match="min_iou"):
        PropagateOptions(min_iou=2)


def test_a_propagated_object_is_one_undo_step():
    labels = np.zeros((4, 6, 6), np.int32)
    labels[1, 0, 0] = 7  # painted by hand, never overwritten
    c = LabelCommitter()
    c.commit(labels, [np.eye(6, dtype=bool)], (0,))  # an earlier 2D commit: id 8
    c.open_group(labels)
    for z in (1, 2, 3):
        c.commit_slice(labels, z, np.ones((6, 6), bool), 9)
    assert labels[1, 0, 0] == 7 and (labels[1:] == 9).sum() == 3 * 36 - 1
    assert c.undo(labels) == [9]
    assert (labels == 9).sum() == 0 and labels[1, 0, 0] == 7 and (labels[0] == 8).sum() == 6
    assert c.undo(labels) == [8] and labels.max() == 7
