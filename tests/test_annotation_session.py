"""AnnotationSession without a window: the default model on held-out BBBC039 nuclei (the last 8
fields are validation), a synthetic 3D stack, an image too big to annotate whole."""
from __future__ import annotations

import numpy as np
import pytest
import tifffile
from scipy import ndimage as ndi

from napari_gpuseg.engine import AnnotationSession, InferenceWorker, Prompt, load_engine
from napari_gpuseg.engine.runtime.job import CANCELLED

from sam_fixtures import iou, require_lite_medsam


@pytest.fixture(scope="module")
def field(shared_data):
    require_lite_medsam()
    f = sorted((shared_data / "bbbc039" / "images").glob("*.tif"))[-1]  # a validation field
    img = tifffile.imread(f)[100:356, 200:456]
    gt = tifffile.imread(shared_data / "bbbc039" / "masks" / f.name)[100:356, 200:456]
    return img, gt


@pytest.fixture(scope="module")
def engine():
    require_lite_medsam()
    return load_engine()


@pytest.fixture(scope="module")
def worker():
    w = InferenceWorker()
    yield w
    w.shutdown()


def inner_objects(gt: np.ndarray, n: int) -> list[np.ndarray]:
    """The ``n`` largest objects not cut by the border."""
    out = []
    for i in np.unique(gt)[1:]:
        obj = gt == i
        ys, xs = np.nonzero(obj)
        if ys.min() > 2 and xs.min() > 2 and ys.max() < gt.shape[0] - 3 and xs.max() < gt.shape[1] - 3:
            out.append(obj)
    return sorted(out, key=lambda o: -o.sum())[:n]


def centre(obj: np.ndarray) -> tuple[float, float]:
    dist = ndi.distance_transform_edt(obj)
    y, x = np.unravel_index(int(np.argmax(dist)), obj.shape)
    return float(x), float(y)


def box_of(obj: np.ndarray, margin: int = 3) -> list[float]:
    ys, xs = np.nonzero(obj)
    return [xs.min() - margin, ys.min() - margin, xs.max() + margin, ys.max() + margin]


@pytest.mark.usefixtures("reuse_embeddings")
def test_click_refine_box_commit_undo_as_the_readme_writes_it(field, engine, worker):
    img, gt = field
    a, b = inner_objects(gt, 2)
    s = AnnotationSession(engine, worker=worker)
    assert s.set_image(img)
    mask = s.click(*centre(a))
    assert mask.shape == img.shape and mask.dtype == bool
    assert iou(mask, a) > 0.7
    first = s.result
    # a negative click outside the object refines the mask: the shown logits go back in
    x, y = centre(a)
    refined = s.click(x + 25, y + 25, positive=False)
    assert s.prompt.mask_input is first and len(s.prompt.points) == 2
    assert list(s.prompt.labels) == [1, 0]
    assert iou(refined, a) > 0.7
    # a box is a new object
    boxed = s.box(*box_of(b))
    assert s.prompt.points is None and iou(boxed, b) > 0.8
    obj = s.commit()
    assert obj == 1 and s.labels.shape == img.shape and s.labels.dtype == np.int32
    assert np.array_equal(s.labels == 1, boxed & True)
    assert s.mask is None and s.commit() is None  # nothing current after a commit
    assert s.undo() == [1] and not s.labels.any()
    assert s.undo() == []


def test_a_negative_first_click_and_a_bad_box_are_one_line_errors(field, engine, worker):
    s = AnnotationSession(engine, worker=worker)
    with pytest.raises(ValueError, match="set_image"):
        s.click(10, 10)
    s.set_image(field[0])
    with pytest.raises(ValueError, match="negative click"):
        s.click(10, 10, positive=False)
    with pytest.raises(ValueError, match="zero width"):
        s.box(10, 10, 10, 40)
    assert not s.labels.any()


@pytest.mark.usefixtures("reuse_embeddings")
def test_async_request_gives_the_mask_the_sync_call_gives(field, engine, worker):
    img, gt = field
    (a,) = inner_objects(gt, 1)
    sync = AnnotationSession(engine, worker=worker)
    sync.set_image(img)
    want = sync.click(*centre(a))
    s = AnnotationSession(engine, worker=worker)
    s.set_image(img)
    got = []
    job = s.request(Prompt(points=[centre(a)]), on_mask=got.append)
    job.wait(60)
    deadline = __import__("time").monotonic() + 30
    while not got and __import__("time").monotonic() < deadline:  # the callback follows the job's end
        job.wait(0.01)
    assert len(got) == 1 and np.array_equal(got[0].full(img.shape), want)
    # a prompt replaced before its mask came is never reported
    late = []
    s.request(Prompt(points=[centre(a)]), on_mask=late.append)
    s.clear()
    worker.submit(lambda: None).wait(60)  # the worker has served what was queued before
    assert not late and s.result is None


@pytest.mark.usefixtures("reuse_embeddings")
def test_rgb_image(field, engine, worker):
    img, gt = field
    (a,) = inner_objects(gt, 1)
    rgb = np.repeat(img[..., None], 3, axis=-1)
    s = AnnotationSession(engine, worker=worker)
    s.set_image(rgb)
    assert s.rgb and s.shape == img.shape
    assert iou(s.click(*centre(a)), a) > 0.7
    assert s.commit() == 1 and s.labels.shape == img.shape


@pytest.mark.usefixtures("reuse_embeddings")
def test_a_stack_is_annotated_plane_by_plane(shared_data, engine, worker):
    vol = tifffile.imread(shared_data / "synthetic3d" / "image.tif")
    gt = tifffile.imread(shared_data / "synthetic3d" / "mask.tif")
    s = AnnotationSession(engine, worker=worker)
    s.set_image(vol)
    assert s.plane == (0,) and s.shape == vol.shape
    z = vol.shape[0] // 2
    s.set_plane(z)
    obj = inner_objects(gt[z], 1)[0]
    mask = s.box(*box_of(obj, 2))
    assert mask.shape == vol.shape[1:] and iou(mask, obj) > 0.6
    s.commit()
    assert s.labels.shape == vol.shape
    assert s.labels[z].any() and not np.delete(s.labels, z, axis=0).any()
    s.set_plane(z + 1)
    assert s.result is None  # another plane: no current object
    with pytest.raises(ValueError, match="not in a stack"):
        s.set_plane(vol.shape[0])
    # the committed object grows through the stack (a slice each way); one undo removes that
    from napari_gpuseg.engine.sam.propagation.propagate import PropagateOptions

    s.set_plane(z)
    before = s.labels.copy()
    ids = s.propagate(options=PropagateOptions(max_slices=1, embed_batch=1))
    grown = s.labels == ids[0]
    assert ids == [1] and grown.any(axis=(1, 2)).sum() > 1
    assert s.undo() == ids and np.array_equal(s.labels, before)


@pytest.mark.usefixtures("reuse_embeddings")
def test_a_too_big_image_is_annotated_by_region(field, engine, worker, monkeypatch):
    from napari_gpuseg.engine.annotate import region

    img, gt = field
    monkeypatch.setattr(region, "MAX_PLANE_PX", 128 * 128)  # the field is "too big"
    s = AnnotationSession(engine, worker=worker)
    assert not s.set_image(img) and s.too_big
    with pytest.raises(ValueError, match="set_region"):
        s.click(100, 100)
    with pytest.raises(ValueError, match="too big"):
        s.set_region(0, 256, 0, 256)
    s.set_region(64, 192, 64, 192)
    assert s.shape == (128, 128) and s.region == (64, 192, 64, 192)
    part = gt[64:192, 64:192]
    obj = inner_objects(part, 1)[0]
    mask = s.box(*box_of(obj, 2))
    assert mask.shape == (128, 128) and iou(mask, obj) > 0.7
    assert s.commit() == 1 and s.labels.shape == (128, 128)


@pytest.mark.usefixtures("reuse_embeddings")
def test_a_model_switch_is_one_call(field, worker):
    require_lite_medsam()
    img, gt = field
    (a,) = inner_objects(gt, 1)
    s = AnnotationSession("lite_medsam", worker=worker)  # by name: loaded in the worker
    s.set_image(img)
    box = box_of(a)
    stock = s.box(*box)
    assert s.engine().info.name == "lite_medsam"
    s.set_model("nuclei_sam")
    assert s.result is None  # the old decoder's logits are not refined by the new one
    tuned = s.box(*box)
    assert s.engine().info.name == "nuclei_sam"
    assert iou(stock, a) > 0.6 and iou(tuned, a) > 0.8
    assert not np.array_equal(stock, tuned)


def test_cancel_stops_the_background_tiles(shared_data, engine):
    worker = InferenceWorker()
    try:
        f = sorted((shared_data / "bbbc039" / "images").glob("*.tif"))[-2]
        s = AnnotationSession(engine, worker=worker)
        s.set_image(tifffile.imread(f))
        block = worker.submit(lambda: __import__("time").sleep(0.2))  # the tiles are still queued
        job = s.embed_async()
        assert s.busy("embed") and s.cancel() >= 1
        job.wait(60)
        block.wait(60)
        assert job.status == CANCELLED and not s.is_embedded() and not s.busy()
    finally:
        worker.shutdown()


@pytest.mark.usefixtures("reuse_embeddings")
def test_a_multichannel_image_is_taken_as_folder_jobs_take_it(field, engine):
    """A two-channel YXC image needs channel=N, as in folder jobs and the other entry points;
    with it, the session annotates that channel (the same mask as the gray image)."""
    from napari_gpuseg.io import ChannelError

    img, gt = field
    two = np.stack([np.zeros_like(img), img], axis=-1)
    s = AnnotationSession(engine)
    with pytest.raises(ChannelError, match="channel=N"):
        s.set_image(two)
    with pytest.raises(ChannelError, match="does not exist"):
        s.set_image(two, channel=2)
    s.set_image(two, channel=1)
    assert s.shape == img.shape and not s.rgb
    x, y = centre(inner_objects(gt, 1)[0])
    picked = s.click(x, y)
    gray = AnnotationSession(engine)
    gray.set_image(img)
    assert np.array_equal(picked, gray.click(x, y))


@pytest.mark.usefixtures("reuse_embeddings")
def test_a_first_click_the_model_rates_low_says_so(engine):
    """A first click whose predicted IoU is under ``UNSURE_IOU`` gets the unsure hint (draw a box, or
    adapt); a confident click, a box and a refined object do not."""
    from napari_gpuseg.engine.sam.interactive.prompt_types import MaskResult

    s = AnnotationSession(engine)
    s.prompt = Prompt(points=np.array([[5.0, 5.0]]), labels=np.array([1]))
    s.result = MaskResult(mask=np.ones((4, 4), bool), y0=0, x0=0, score=0.41, low_res=None, view=None)
    assert s.unsure() == "unsure (predicted IoU 0.41): draw a box, or adapt SAM to these objects"
    s.result.score = 0.7999  # cut, not rounded: the hint never reads the threshold itself
    assert "(predicted IoU 0.79)" in s.unsure()
    s.result.score = 0.29
    assert "(predicted IoU 0.29)" in s.unsure()
    s.result.score = 0.9
    assert s.unsure() is None
    s.result.score = 0.41
    s.prompt = Prompt(box=np.array([1.0, 1.0, 8.0, 8.0]))
    assert s.unsure() is None
    s.prompt = Prompt(points=np.array([[5.0, 5.0], [7.0, 7.0]]), labels=np.array([1, 0]))
    assert s.unsure() is None


@pytest.mark.usefixtures("reuse_embeddings")
def test_the_session_shows_the_engines_masks_for_the_same_prompts(engine, worker, field):
    """A first click, a corrective click (negative in a false part, positive in a missed
    one) and a box give through the session the masks the engine gives for the same
    prompts (the refinement with the shown logits as mask input, the box decoded near it),
    and ``session_click_ious`` (what benchmarks/clicks.py reports) the click IoUs of the
    engine's ``click_ious`` and the first masks' predicted IoUs."""
    from napari_gpuseg.engine.annotate.session_clicks import session_click_ious
    from napari_gpuseg.engine.sam.training.click_eval import click_ious, pick_objects
    from napari_gpuseg.engine.sam.training.simulated_prompts import corrective_point, interior_point, tight_box

    img, gt = field
    s = AnnotationSession(engine, worker=worker)
    s.set_image(img)
    shape = gt.shape
    scores = []  # the predicted IoU of each first click's mask
    for oid, sl in pick_objects(gt, max_objects=3, seed=0):
        truth = gt == oid
        x, y = interior_point(truth)
        s.clear()
        first = s.click(x, y)
        r1 = engine.predict(img, [Prompt(points=[[x, y]], labels=[1])], multimask=True)[0]
        assert np.array_equal(first, r1.full(shape))
        scores.append(r1.score)
        corr = corrective_point(first, truth)
        if corr is not None:
            (px, py), lab = corr
            second = s.click(px, py, positive=bool(lab))
            r2 = engine.predict(img, [Prompt(points=[[x, y], [px, py]], labels=[1, lab], mask_input=r1)])[0]
            assert np.array_equal(second, r2.full(shape))
        b = tight_box(truth)
        boxed = s.box(*b)
        rb = engine.predict(img, [Prompt(box=b)], near_box=True)[0]
        assert np.array_equal(boxed, rb.full(shape)) and iou(boxed, truth) > 0.5
    direct = click_ious(engine, img, gt, clicks=3, max_objects=3)
    through = session_click_ious(s, img, gt, clicks=3, max_objects=3)
    assert direct["n"] == through["n"] == 3
    np.testing.assert_allclose(through["clicks"], direct["clicks"], atol=1e-6)
    np.testing.assert_allclose(through["score"], scores, atol=1e-6)  # benchmarks/unsure_threshold.py's
