"""The one box workflow (boxes per plane -> SAM -> results per plane) shared by the SAM
automatic dock and the ``sam-boxes`` folder method; SAM itself is replaced by a recorder."""
from __future__ import annotations

import numpy as np
import pytest

from napari_gpuseg.engine.runtime.cancel import CancelToken, Cancelled
from napari_gpuseg.engine.sam.automatic import box_stack, boxes


@pytest.fixture
def calls(monkeypatch):
    seen = []

    def fake(engine, planes, boxes_, **kw):
        seen.append((planes, boxes_, kw))
        return [len(b) for b in boxes_]

    monkeypatch.setattr(boxes, "segment_boxes_batch", fake)
    return seen


def _planes():
    a = np.zeros((32, 32), np.uint8)
    a[4:10, 4:12] = 200
    b = np.zeros((32, 32), np.uint8)
    b[20:28, 18:30] = 200
    return [a, b]


def test_detector_runs_per_plane_and_options_reach_sam(calls):
    out = box_stack.segment_box_planes(None, _planes(), "threshold", padding=3, batch_size=7,
                                       embed_batch_size=2, min_area=5)
    from napari_gpuseg.engine.detect import detect_boxes

    (_, given, kw), = calls
    assert out == [len(b) for b in given] and out[0] == 1
    for plane, got in zip(_planes(), given):
        np.testing.assert_array_equal(got, detect_boxes(plane, "threshold"))
    assert kw["padding"] == 3.0 and kw["batch_size"] == 7 and kw["embed_batch_size"] == 2 and kw["min_area"] == 5


def test_given_boxes_pass_through_and_must_match_the_planes(calls):
    given = [np.array([[1.0, 2, 3, 4]]), np.zeros((0, 4))]
    assert box_stack.segment_box_planes(None, _planes(), given) == [1, 0]
    assert calls[0][1] is given
    with pytest.raises(ValueError, match="1 box arrays for 2 planes"):
        box_stack.segment_box_planes(None, _planes(), given[:1])


def test_cancel_stops_before_detection(calls):
    token = CancelToken()
    token.cancel()
    with pytest.raises(Cancelled):
        box_stack.segment_box_planes(None, _planes(), "threshold", cancel=token)
    assert not calls


def test_folder_method_uses_the_shared_workflow(monkeypatch):
    from napari_gpuseg.engine.jobs.method_registry import create_method

    seen = {}

    def fake(engine, planes, boxes_, **kw):
        seen.update(boxes=boxes_, **kw)
        return []

    monkeypatch.setattr(box_stack, "segment_box_planes", fake)
    seg = create_method("sam-boxes", detector="threshold", padding=1, min_area=3)
    assert seg._segment_planes(_planes()) == []
    assert seen["boxes"] == "threshold" and seen["padding"] == 1 and seen["min_area"] == 3


def test_automatic_dock_job_uses_the_shared_workflow(monkeypatch):
    """The dock's worker job hands planes, boxes (or a detector) and its knobs to the same
    function, with its progress callback and cancel token."""
    import types

    import torch

    from napari_gpuseg.engine.runtime.device import Policy
    from napari_gpuseg.engine.runtime.worker import InferenceWorker
    from napari_gpuseg.widgets import sam_automatic

    seen = {}

    def fake(engine, planes, boxes_, **kw):
        seen.update(engine=engine, boxes=boxes_, **kw)
        return ["result"]

    monkeypatch.setattr(sam_automatic, "load_engine", lambda model, policy: "engine:" + model)
    monkeypatch.setattr(sam_automatic, "segment_box_planes", fake)
    worker = InferenceWorker(Policy(torch.device("cpu"), "fp32"))
    dock = types.SimpleNamespace(worker=worker)
    token, progress = CancelToken(), (lambda done, total: None)
    try:
        out = sam_automatic.SamAutomaticWidget._job_run(dock, "m", "boxes", _planes(), "unet", None, 2.5, 9,
                                                        4, 64, progress=progress, cancel=token)
    finally:
        worker.shutdown()
    assert out == ["result"] and seen["engine"] == "engine:m" and seen["boxes"] == "unet"
    assert (seen["padding"], seen["min_area"], seen["embed_batch_size"], seen["batch_size"]) == (2.5, 9, 4, 64)
    assert seen["progress"] is progress and seen["cancel"] is token and seen["policy"] is worker.policy
