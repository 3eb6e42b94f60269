"""A 2D U-Net on a ZYX volume gives 3D instances (objects linked across slices)."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import tifffile

from napari_gpuseg.engine.stacks import LINK_NOTE, link_slices
from napari_gpuseg.engine.metrics import object_f1
from napari_gpuseg.engine.jobs.pipeline import run_folder


def test_link_slices_joins_overlapping_objects_and_keeps_neighbours_apart():
    per = np.zeros((3, 10, 20), np.int32)
    per[0, 2:6, 2:6] = 1
    per[1, 3:7, 3:7] = 1      # same id reused per slice, overlaps slice 0 by 9/16
    per[2, 3:7, 3:7] = 4
    per[1, 2:6, 12:16] = 2    # a second object, only in slice 1
    per[2, 8:10, 14:16] = 5   # touches nothing in slice 1
    out = link_slices(per)
    assert out.dtype == np.int32 and out.max() == 3
    assert len(np.unique(out[per == 1])) == 1 and out[2, 4, 4] == out[0, 3, 3]
    assert out[1, 3, 13] not in (0, out[0, 3, 3])
    assert out[2, 9, 15] not in (0, out[1, 3, 13])


def test_link_slices_needs_overlap_of_half_the_smaller_object():
    per = np.zeros((2, 10, 10), np.int32)
    per[0, 0:4, 0:4] = 1
    per[1, 3:7, 3:7] = 1      # one shared pixel of 16
    assert link_slices(per).max() == 2
    with pytest.raises(ValueError, match="Z, Y, X"):
        link_slices(per[0])


def test_unet_method_on_synthetic3d_gives_3d_instances_and_says_so(tmp_path, shared_data):
    src = shared_data / "synthetic3d"
    folder = tmp_path / "in"
    folder.mkdir()
    shutil.copy(src / "image.tif", folder / "vol.tif")
    gt = tifffile.imread(src / "mask.tif")
    report = run_folder(folder, tmp_path / "out", "unet", pattern="*.tif", devices="cpu")
    row = report.rows[0]
    assert row.status == "ok", row.error
    labels = tifffile.imread(tmp_path / "out" / row.labels)
    assert labels.shape == gt.shape
    # per slice, 314 objects with 3D F1@0.5 0.0; linked: ~64 objects (51 in the ground truth)
    assert row.objects < 100
    assert object_f1(gt, labels, 0.5) > 0.25
    assert LINK_NOTE in row.notes


def test_link_slices_without_background_keeps_every_object():
    per = np.ones((2, 4, 4), np.int32)
    per[:, :, 2:] = 2
    out = link_slices(per)
    assert out.min() == 1 and out.max() == 2
