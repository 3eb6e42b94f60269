"""A prompt's first look: its mask from a small native crop, in the engine and in the
annotator right after a drop (the shipped model, real BBBC039 validation fields)."""
import numpy as np
import pytest
import tifffile
import torch

from napari_gpuseg.engine.runtime.device import Policy
from napari_gpuseg.engine.sam.interactive import crop_look as bl
from napari_gpuseg.engine.sam.interactive.prompt_types import Prompt

from sam_fixtures import gt_boxes, iou, require_lite_medsam
from test_sam_annotator import record_shows

WAIT = 120_000


@pytest.fixture(scope="module")
def engine():
    from napari_gpuseg.engine.sam.interactive.cache import EmbeddingCache
    from napari_gpuseg.engine.sam.loader import load_engine

    require_lite_medsam()
    return load_engine("nuclei_sam", Policy(torch.device("cpu"), "fp32"), cache=EmbeddingCache())


@pytest.fixture(scope="module")
def field(shared_data):
    f = sorted((shared_data / "bbbc039" / "images").glob("*.tif"))[18]  # a validation field
    return tifffile.imread(f), tifffile.imread(shared_data / "bbbc039" / "masks" / f.name)


def whole_nuclei(gt):
    """(ids, boxes) of the nuclei of at least 200 px (not the fragments the border cuts)."""
    ids, boxes = gt_boxes(gt)
    keep = [i for i, oid in enumerate(ids) if (gt == oid).sum() >= 200]
    return [ids[i] for i in keep], boxes[keep]


def nearest_nucleus(gt, fy: float, fx: float):
    """(id, box) of the whole nucleus nearest the point at fractions ``fy``, ``fx`` of the
    field's height and width."""
    ids, boxes = whole_nuclei(gt)
    h, w = gt.shape
    k = int(np.argmin(np.hypot((boxes[:, 0] + boxes[:, 2]) / 2 - fx * w, (boxes[:, 1] + boxes[:, 3]) / 2 - fy * h)))
    return ids[k], boxes[k]


def test_the_crop_is_centred_on_the_box_kept_inside_the_image_and_refused_when_too_small():
    v = bl.look_view(np.array([209, 100, 239, 140]), (520, 696), 256)
    assert (v.h, v.w, v.input_size) == (128, 128, 128) and v.scale == 1.0
    assert abs(v.x0 + 64 - 224) <= 8 and abs(v.y0 + 64 - 120) <= 8  # its centre is the box's
    assert v.x0 % bl.ALIGN == 0 and v.y0 % bl.ALIGN == 0
    assert bl.look_view(np.array([212, 103, 242, 143]), (520, 696), 256) == v  # moved a little: the same crop
    corner = bl.look_view(np.array([0, 2, 20, 30]), (520, 696), 256)
    assert (corner.y0, corner.x0) == (0, 0)
    far = bl.look_view(np.array([680, 500, 695, 519]), (520, 696), 256)
    assert (far.y1, far.x1) == (520, 696)
    assert bl.look_view(np.array([0, 0, 97, 20]), (520, 696), 256) is None  # longer side over 96 px
    assert bl.look_view(np.array([0, 0, 10, 10]), (100, 696), 256) is None  # image under 128 px


def test_a_box_s_look_embeds_a_quarter_of_a_view_and_finds_the_nucleus(engine, field):
    img, gt = field
    image = engine.prepare(img)
    ids, boxes = whole_nuclei(gt)
    got, full = [], []
    for oid, box in list(zip(ids, boxes))[:10]:
        res = bl.crop_look(engine, image, Prompt(box=box))
        assert res.view.input_size == 128 and res.low_res is None  # never fed back
        assert engine.embedding(image, res.view).shape[-2:] == (32, 32)
        got.append(iou(res.full(gt.shape), gt == oid))
        full.append(iou(engine.predict(image, [Prompt(box=box)], near_box=True)[0].full(gt.shape), gt == oid))
    assert np.mean(got) > 0.8, (got, full)
    assert np.mean(got) > np.mean(full) - 0.05, (got, full)
    # a box with a click, or a prompt with a mask input, has no look
    both = Prompt(points=np.array([[50.0, 50.0]]), box=np.array([40.0, 40, 70, 70]))
    assert bl.crop_look(engine, image, both) is None


def test_a_first_clicks_look_takes_the_best_candidate_and_finds_the_nucleus(engine, field):
    from napari_gpuseg.engine.sam.training.simulated_prompts import interior_point

    img, gt = field
    image = engine.prepare(img)
    ids, _boxes = whole_nuclei(gt)
    got, native = [], []
    for oid in ids[:10]:
        x, y = interior_point(gt == oid)
        click = Prompt(points=np.array([[x, y]], float), labels=np.array([1]))
        res = bl.crop_look(engine, image, click, multimask=True)
        assert res.view.input_size == 128 and len(res.all_scores) > 1  # the candidates' scores
        assert res.score == res.all_scores.max()
        got.append(iou(res.full(gt.shape), gt == oid))
        tile = engine.predict(image, [click], multimask=True, zoom=False)[0]  # the native tile's look
        native.append(iou(tile.full(gt.shape), gt == oid))
    assert np.mean(got) > 0.75 and np.mean(got) > np.mean(native) - 0.05, (got, native)


def test_a_look_is_for_size_agnostic_encoders_on_a_cpu(engine, monkeypatch):
    assert bl.supports_look(engine)
    monkeypatch.setattr(engine, "policy", Policy(torch.device("cuda"), "bf16"))
    assert not bl.supports_look(engine)  # a view takes milliseconds on a GPU
    monkeypatch.undo()
    monkeypatch.setattr(type(engine.sam.image_encoder), "size_agnostic", False)
    assert not bl.supports_look(engine)  # a ViT with its fixed position embedding


def test_a_box_right_after_a_drop_shows_its_first_look_then_the_full_views_mask(
        make_napari_viewer, qtbot, field):
    """A box far from where the background starts (the canvas centre): its look from the
    small crop first, then the mask of its own view, the one the engine gives for it."""
    img, gt = field
    viewer = make_napari_viewer()
    _dock, w = viewer.window.add_plugin_dock_widget("napari-gpuseg", "SAM annotator")
    shown = record_shows(w)
    oid, (x0, y0, x1, y1) = nearest_nucleus(gt, 0.2, 0.15)
    viewer.add_image(img, name="nuclei")
    qtbot.waitUntil(lambda: w.image_layer is not None and w.box_layer is not None, timeout=WAIT)
    w.box_layer.add_rectangles(np.array([[y0, x0], [y0, x1], [y1, x1], [y1, x0]], float))
    qtbot.waitUntil(lambda: any(final for final, _r, _t in shown), timeout=WAIT)
    assert [final for final, _r, _t in shown] == [False, True]
    look, final = shown[0][1], shown[1][1]
    assert look.view.input_size == 128 and final.view.input_size == 256
    assert "first look" in shown[0][2] and "first look" not in shown[1][2]
    assert w.session.result is final
    assert iou(look.full(gt.shape), gt == oid) > 0.75
    assert iou(final.full(gt.shape), gt == oid) > 0.75
    assert not w._looks_waiting
    # once its view is embedded, the same box again has nothing to look at first
    shown.clear()
    w.box_layer.data = []
    w.box_layer.add_rectangles(np.array([[y0, x0], [y0, x1 + 1], [y1, x1 + 1], [y1, x0]], float))
    qtbot.waitUntil(lambda: any(final for final, _r, _t in shown), timeout=WAIT)
    assert [final for final, _r, _t in shown] == [True]


def test_a_first_click_outside_the_first_tile_shows_its_crop_look_then_both_scales(
        make_napari_viewer, qtbot, field):
    """Right after a drop, a click far from the canvas centre has neither its native tile
    nor its finer view embedded: its look from the small crop comes first, then the mask
    the engine gives for the click, and a second click refines that final mask."""
    from napari_gpuseg.engine.sam.training.simulated_prompts import interior_point

    img, gt = field
    img = img + 3  # content no other test embedded
    viewer = make_napari_viewer()
    _dock, w = viewer.window.add_plugin_dock_widget("napari-gpuseg", "SAM annotator")
    shown = record_shows(w)
    oid, _box = nearest_nucleus(gt, 0.2, 0.85)
    x, y = interior_point(gt == oid)
    viewer.add_image(img, name="nuclei")
    qtbot.waitUntil(lambda: w.image_layer is not None and w.pos_layer is not None, timeout=WAIT)
    w.pos_layer.add([[y, x]])
    qtbot.waitUntil(lambda: any(final for final, _r, _t in shown), timeout=WAIT)
    assert [final for final, _r, _t in shown] == [False, True]
    look, final = shown[0][1], shown[1][1]
    assert look.view.input_size == 128 and "first look" in shown[0][2]
    assert iou(look.full(gt.shape), gt == oid) > 0.6
    engine = w.session.engine()
    click = Prompt(points=np.array([[x, y]], float), labels=np.array([1]))
    job = w.worker.submit(lambda: engine.predict(np.array(img), [click], multimask=True)[0])
    qtbot.waitUntil(lambda: job.wait(0), timeout=WAIT)
    np.testing.assert_array_equal(job.result().full(gt.shape), final.full(gt.shape))
    w.pos_layer.add([[y + 2, x + 2]])  # a second click refines the mask on display
    qtbot.waitUntil(lambda: w.has_preview() and w.session.result is not final, timeout=WAIT)
    assert w.session.prompt.mask_input is final
