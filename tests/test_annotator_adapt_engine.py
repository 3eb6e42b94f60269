"""'Adapt to these objects' without a window: cells committed with boxes on a scratch-assay
training frame, the session's decoder adapted to them (a few steps), the session annotating on
with it, the decoder in the user's list; a cancel changes nothing; when the offer speaks."""
import numpy as np
import pytest
import tifffile

from napari_gpuseg.engine import AnnotationSession, InferenceWorker
from napari_gpuseg.engine.annotate.adapting import SessionAdaptation, adapt_blocker, adapt_offer
from napari_gpuseg.engine.annotate.effort import CommitEffort
from napari_gpuseg.engine.runtime.cancel import CancelToken
from napari_gpuseg.engine.sam.training.adapt import adapted_dir, adapted_models, few_object_config

from sam_fixtures import require_lite_medsam


@pytest.fixture(scope="module")
def frame(shared_data):
    """t00 of the scratch assay's cells (a training frame) and its cell masks."""
    d = shared_data / "scratch_assay" / "cells"
    return tifffile.imread(d / "images" / "t00.tif"), tifffile.imread(d / "masks" / "t00.tif")


@pytest.fixture(scope="module")
def worker():
    w = InferenceWorker()
    yield w
    w.shutdown()


@pytest.fixture(scope="module")
def embeddings():
    """One embedding cache for this module's sessions: they annotate the same frame with the
    same encoder (each adaptation tunes a decoder of its own), so its tiles embed once."""
    from napari_gpuseg.engine.sam.interactive.cache import EmbeddingCache

    return EmbeddingCache()


def cell_boxes(gt: np.ndarray, n: int) -> list[tuple[np.ndarray, list[float]]]:
    """(mask, box xyxy with a 3 px margin) of the ``n`` largest cells not cut by the border."""
    h, w = gt.shape
    out = []
    for i in np.unique(gt)[1:]:
        ys, xs = np.nonzero(gt == i)
        if ys.min() > 3 and xs.min() > 3 and ys.max() < h - 4 and xs.max() < w - 4:
            out.append((gt == i, [xs.min() - 3.0, ys.min() - 3.0, xs.max() + 3.0, ys.max() + 3.0]))
    return sorted(out, key=lambda mb: -mb[0].sum())[:n]


def short(n_objects: int) -> object:
    """The few-object schedule cut to 2 steps on native views (the flow is tested here; what
    adapting learns is ``benchmarks/adapt_sam_cells.py``'s)."""
    cfg = few_object_config(n_objects, minutes=1)
    cfg.max_steps, cfg.max_time, cfg.view_zooms, cfg.orientations = 2, None, (1.0,), 1
    return cfg


@pytest.mark.usefixtures("reuse_embeddings")
@pytest.mark.slow
def test_adapting_to_committed_cells_switches_the_session_and_lists_it(frame, worker, embeddings, tmp_path,
                                                                       monkeypatch):
    require_lite_medsam()
    monkeypatch.setenv("NAPARI_GPUSEG_CACHE", str(tmp_path / "cache"))
    img, gt = frame
    s = AnnotationSession("nuclei_sam", worker=worker, cache=embeddings)
    s.set_image(img)
    cells = cell_boxes(gt, 5)
    for _mask, box in cells[:2]:
        s.box(*box)
        s.commit()
    with pytest.raises(ValueError, match="at least 3 objects.*2 committed"):
        SessionAdaptation(s)
    for _mask, box in cells[2:4]:
        s.box(*box)
        s.commit()
    assert adapt_blocker(s) is None
    # the copy trained runs on the session's embeddings: no view the session embedded is encoded again
    from napari_gpuseg.engine.sam.interactive.cache import EmbeddingCache

    assert s.embedding_cache() is embeddings  # where the session's engine keeps them
    again, put = [], EmbeddingCache.put
    monkeypatch.setattr(EmbeddingCache, "put", lambda cache, key, value: again.append(key in embeddings)
                        or put(cache, key, value))
    steps = []
    base_encoder = worker.cached_model(("sam", "nuclei_sam", worker.policy)).info.encoder
    res = s.adapt(image_name="/data/scratch/t00.tif", config=short(4), on_event=lambda ev: steps.append(ev.step))
    monkeypatch.setattr(EmbeddingCache, "put", put)
    assert not any(again), again
    assert res.objects == 4 and res.steps == 2 and steps == [1, 2] and res.stopped == "done"
    assert res.name == "t00_adapted" and adapted_dir() == tmp_path / "cache" / "adapted_sam"
    assert s.model == res.path  # the session annotates on with the adapted decoder
    listed = adapted_models()
    assert [(m["name"], m["image"], m["objects"]) for m in listed] == [("t00_adapted", "/data/scratch/t00.tif", 4)]
    mask, box = cells[4]
    got = s.box(*box)
    engine = worker.cached_model(("sam", res.path, worker.policy))
    assert engine is not None and engine.info.decoder_tuned  # the adapted decoder made that mask
    assert engine.info.encoder != base_encoder  # its encoder's last stage learnt too: the box's view
    # was embedded again, for it
    assert (got & mask).sum() > 0.5 * mask.sum()
    s.commit()
    assert len(np.unique(s.labels)) - 1 == 5


def test_a_cancelled_adaptation_keeps_the_model_and_writes_nothing(frame, worker, embeddings, tmp_path):
    require_lite_medsam()
    img, gt = frame
    s = AnnotationSession("nuclei_sam", worker=worker, cache=embeddings)
    s.set_image(img)
    for _mask, box in cell_boxes(gt, 3):
        s.box(*box)
        s.commit()
    folder = tmp_path / "adapted"
    token = CancelToken()
    cfg = short(3)
    cfg.max_steps = 50
    res = s.adapt(folder=folder, config=cfg, cancel=token, on_event=lambda ev: token.cancel())
    assert res.path is None and res.stopped == "cancelled"
    assert s.model == "nuclei_sam" and adapted_models(folder) == [] and list(folder.glob("*")) == []
    # cancelled before anything was trained (while its views were embedded): the same
    token = CancelToken()
    token.cancel()
    res = SessionAdaptation(s, folder=folder, config=cfg).run(cancel=token)
    assert res.path is None and res.stopped == "cancelled" and s.model == "nuclei_sam"


def test_corrective_clicks_are_counted_and_the_offer_speaks_when_objects_are_hard(frame, worker, embeddings):
    require_lite_medsam()
    img, gt = frame
    s = AnnotationSession("nuclei_sam", worker=worker, cache=embeddings)
    s.set_image(img)
    cells = cell_boxes(gt, 3)
    for mask, box in cells:  # a box and two corrective clicks inside the cell each
        s.box(*box)
        ys, xs = np.nonzero(mask)
        for k in (len(ys) // 3, 2 * len(ys) // 3):
            s.click(float(xs[k]), float(ys[k]))
        s.commit()
    assert list(s.effort._recent) == [(False, 2)] * 3
    offer = adapt_offer(s)
    assert offer == "3 of the last 3 needed 2+ corrections: try 'Adapt to these objects'"
    s.set_model("nuclei_sam")  # another model (the adapted one): its own effort counts
    assert adapt_offer(s) is None


def test_commit_effort_speaks_only_when_most_recent_commits_were_hard():
    e = CommitEffort()
    e.record(True, 0)
    e.record(False, 0)
    assert e.struggling() is None  # fewer than three commits
    e.record(False, 1)
    assert e.struggling() is None  # one hard in three
    e.record(True, 0)
    assert e.struggling() is None  # (False, 0), (False, 1), (True, 0): one hard in the last three
    e.record(False, 3)
    assert e.struggling() == "2 of the last 3 began unsure or needed 2+ corrections"
    for _ in range(3):
        e.record(True, 1)
    assert e.struggling() == "3 of the last 3 began unsure"
    e.clear()
    assert e.struggling() is None and len(e) == 0


@pytest.fixture(scope="module")
def adapted_file(shared_data, tmp_path_factory):
    """A real adapted decoder (one step) in an adapted-decoders folder: (cache folder, path)."""
    from sam_fixtures import adapted_decoder

    return adapted_decoder(shared_data, tmp_path_factory)[:2]


def unsure_first_click(s: AnnotationSession, score: float) -> None:
    """The session's current object: a first click whose mask the model rates ``score``."""
    from napari_gpuseg.engine.sam.interactive.prompt_types import MaskResult, Prompt

    s.prompt = Prompt(points=np.array([[5.0, 5.0]]), labels=np.array([1]))
    s.result = MaskResult(mask=np.ones((4, 4), bool), y0=0, x0=0, score=score, low_res=None, view=None)


def test_with_an_adapted_decoder_the_hints_offer_a_box_or_clicks_not_adapting(adapted_file, monkeypatch):
    """An unsure first mask, and commits that were hard work: with the default model the hints
    offer adapting; once the session uses an adapted decoder (from the user's list, or any
    decoder file saved as adapted) they offer a box or corrective clicks instead."""
    from napari_gpuseg.engine.sam.training.adapt import is_adapted
    from napari_gpuseg.models import registry

    cache, path = adapted_file
    monkeypatch.setenv("NAPARI_GPUSEG_CACHE", str(cache))
    gt = np.zeros((64, 64), np.int32)
    gt[5:15, 5:15], gt[20:30, 20:30], gt[40:50, 40:50] = 1, 2, 3
    s = AnnotationSession(registry.DEFAULT_MODEL)  # nothing is decoded here: no model is loaded
    s.set_image(np.zeros((64, 64), np.uint16), labels=gt.copy())
    assert not s.adapted
    unsure_first_click(s, 0.41)
    assert "unsure (predicted IoU 0.41)" in s.unsure() and "adapt SAM to these objects" in s.unsure()
    for _ in range(3):
        s.effort.record(True, 0)
    assert adapt_offer(s) == "3 of the last 3 began unsure: try 'Adapt to these objects'"

    s.set_model(path)
    assert s.adapted and is_adapted(path)
    unsure_first_click(s, 0.41)
    hint = s.unsure()
    assert hint == "unsure (predicted IoU 0.41): draw a box, or correct the mask with clicks"
    assert "adapt" not in hint.lower()
    for _ in range(3):
        s.effort.record(True, 0)
    assert adapt_offer(s) == "3 of the last 3 began unsure: try a box around each object"
    effort = CommitEffort()  # corrections count the same way
    for c in (2, 3, 0):
        effort.record(False, c)
    s.effort = effort
    assert adapt_offer(s) == "2 of the last 3 needed 2+ corrections: try a box around each object"

    # a decoder file saved as adapted but not in the list (moved, or the list is another
    # user's) is adapted too; the shipped default decoder and a missing file are not
    monkeypatch.setenv("NAPARI_GPUSEG_CACHE", str(cache / "elsewhere"))
    assert is_adapted(path) and AnnotationSession(path).adapted
    assert not is_adapted(registry.cached_path(registry.DEFAULT_MODEL))
    assert not is_adapted(str(cache / "missing.pt")) and not is_adapted(registry.DEFAULT_MODEL)


def test_the_predicted_iou_shown_is_clamped_to_0_1():
    """SAM's IoU head can give more than 1 (or less than 0): what the user is shown is clamped."""
    from napari_gpuseg.engine.sam.interactive.prompt_types import MaskResult
    from napari_gpuseg.engine.sam.training.adapt import unsure_hint

    r = MaskResult(mask=np.ones((2, 2), bool), y0=0, x0=0, score=1.07, low_res=None, view=None)
    assert r.predicted_iou == 1.0 and r.score == 1.07
    r.score = -0.2
    assert r.predicted_iou == 0.0
    assert unsure_hint(-0.2).startswith("unsure (predicted IoU 0.00)")
    assert unsure_hint(1.07) is None and unsure_hint(1.07, threshold=1.5).startswith("unsure (predicted IoU 1.00)")
    s = AnnotationSession("cells_nuclei_sam")
    unsure_first_click(s, -0.2)
    assert s.unsure().startswith("unsure (predicted IoU 0.00)")
