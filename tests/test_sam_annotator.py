"""The SAM annotator dock on a real viewer with the real LiteMedSAM checkpoint."""
import time

import numpy as np
import pytest
import tifffile

from napari_gpuseg.models.registry import DEFAULT_MODEL
from napari_gpuseg.engine.runtime.worker import CANCELLED

from sam_fixtures import gt_boxes, iou, require_lite_medsam

pytestmark = pytest.mark.usefixtures("lite_available")

WAIT = 120_000  # ms; the CPU encoder is slow on a busy 2-core machine


@pytest.fixture(scope="module")
def lite_available():
    require_lite_medsam()


@pytest.fixture(scope="module")
def crop(shared_data):
    f = sorted((shared_data / "bbbc039" / "images").glob("*.tif"))[17]
    img = tifffile.imread(f)[100:356, 200:456]
    gt = tifffile.imread(shared_data / "bbbc039" / "masks" / f.name)[100:356, 200:456]
    return img, gt


def open_dock(viewer):
    _dock, widget = viewer.window.add_plugin_dock_widget("napari-gpuseg", "SAM annotator")
    return widget


def record_shows(w) -> list:
    """(final, result, status text) of each mask the dock shows, in order (first looks too)."""
    shown = []
    show = w._show_mask

    def record(result, final=True):
        show(result, final=final)
        shown.append((final, result, w.status.text()))

    w._show_mask = record
    return shown


def wait_embedded(qtbot, w):
    qtbot.waitUntil(w.session.is_embedded, timeout=WAIT)


def count_decodes(monkeypatch, slow_s: float = 0.0, error: str | None = None) -> list:
    """The prompts the session's decodes get (``steps.decode``), optionally slowed or failing."""
    from napari_gpuseg.engine.annotate import steps

    real, calls = steps.decode, []

    def counted(engine_of, image, prompt, multimask, look=None, cancel=None):
        calls.append(prompt)
        if error:
            raise RuntimeError(error)
        time.sleep(slow_s)
        return real(engine_of, image, prompt, multimask, look, cancel=cancel)

    monkeypatch.setattr(steps, "decode", counted)
    return calls


def add_box(w, box, index=()):
    x0, y0, x1, y1 = box
    lead = list(index)
    corners = [[y0, x0], [y0, x1], [y1, x1], [y1, x0]]
    w.box_layer.add_rectangles(np.array([lead + c for c in corners], float))


@pytest.mark.usefixtures("reuse_embeddings")
def test_a_click_on_a_scaled_image_segments_the_object_clicked(make_napari_viewer, qtbot, crop):
    """An image with a pixel size and an offset: the prompt layers take them, so a click
    (a point placed at world coordinates, as the mouse places it) gives that nucleus's mask
    and the commit lands on it in the labels layer."""
    from scipy import ndimage

    img, gt = crop
    viewer = make_napari_viewer()
    layer = viewer.add_image(img, name="scaled", scale=(0.65, 0.65), translate=(100.0, -50.0))
    w = open_dock(viewer)
    wait_embedded(qtbot, w)
    for prompt_layer in (w.pos_layer, w.box_layer, w.preview_layer):
        assert tuple(prompt_layer.scale) == (0.65, 0.65) and tuple(prompt_layer.translate) == (100.0, -50.0)
    obj = gt == np.bincount(gt[gt > 0]).argmax()  # the largest nucleus of the crop
    y, x = np.unravel_index(ndimage.distance_transform_edt(obj).argmax(), obj.shape)
    w.pos_layer.add(w.pos_layer.world_to_data(layer.data_to_world((y, x))))
    qtbot.waitUntil(w.has_preview, timeout=WAIT)
    assert iou(w.preview_layer.data > 0, obj) > 0.7
    w.commit()
    assert iou(w.labels_layer.data == 1, obj) > 0.7
    assert tuple(w.labels_layer.scale) == (0.65, 0.65)


@pytest.mark.usefixtures("reuse_embeddings")
def test_an_image_too_big_to_annotate_whole_is_annotated_by_region(make_napari_viewer, qtbot, monkeypatch,
                                                                    shared_data):
    """Above the annotator's limit (lowered here: a whole BBBC039 field stands for a mosaic)
    nothing is prepared or embedded; the dock says so and offers the region in view, which
    becomes a lazily read image layer over the big one; a click there gives the nucleus and
    the commit lands over it."""
    import dask.array as da
    from scipy import ndimage

    from napari_gpuseg.engine.annotate import region as limits
    from napari_gpuseg.widgets import _annotator_region as region_mod

    monkeypatch.setattr(limits, "MAX_PLANE_PX", 256 * 256)
    monkeypatch.setattr(limits, "REGION_SIDE", 300)
    monkeypatch.setattr(limits, "MIN_REGION_SIDE", 256)
    f = sorted((shared_data / "bbbc039" / "images").glob("*.tif"))[17]
    img, gt = tifffile.imread(f), tifffile.imread(shared_data / "bbbc039" / "masks" / f.name)
    viewer = make_napari_viewer()
    w = open_dock(viewer)
    jobs = []
    monkeypatch.setattr(w, "_embed_current", lambda: jobs.append("embed") or False)
    big = viewer.add_image(da.from_array(img, chunks=128), name="mosaic", scale=(0.5, 0.5), translate=(7.0, 3.0))
    # the dock holds napari's proxies of the layers: compared by name
    qtbot.waitUntil(lambda: w.image_layer is not None and w.image_layer.name == big.name, timeout=WAIT)
    assert w.region_btn.isVisibleTo(w) and "too big to annotate whole" in w.status.text()
    assert "Annotate the region in view" in w.hint_label.text() and jobs == [] and w.pos_layer is None
    monkeypatch.undo()  # the dock's own embedding again, the limits kept below
    monkeypatch.setattr(limits, "MAX_PLANE_PX", 256 * 256)
    monkeypatch.setattr(limits, "REGION_SIDE", 300)
    monkeypatch.setattr(limits, "MIN_REGION_SIDE", 256)
    viewer.camera.center = big.data_to_world((260, 350))
    viewer.camera.zoom = 100.0  # a few pixels in view: the region grows to the smallest side
    region = w.annotate_region()
    assert region.data.shape == (256, 256) and not isinstance(region.data, np.ndarray)  # lazy
    y0, x0 = 260 - 128, 350 - 128
    assert tuple(region.translate) == (7.0 + 0.5 * y0, 3.0 + 0.5 * x0) and tuple(region.scale) == (0.5, 0.5)
    np.testing.assert_array_equal(np.asarray(region.data), img[y0:y0 + 256, x0:x0 + 256])
    viewer.camera.zoom = 0.01  # the whole image and more in view: at most REGION_SIDE a side
    assert region_mod.region_in_view(viewer, big)[1] - region_mod.region_in_view(viewer, big)[0] == 300
    qtbot.waitUntil(lambda: w.image_layer.name == region.name and w.pos_layer is not None, timeout=WAIT)
    assert not w.region_btn.isVisibleTo(w)
    sub = gt[y0:y0 + 256, x0:x0 + 256]
    dist = ndimage.distance_transform_edt(sub > 0)
    y, x = np.unravel_index(dist.argmax(), dist.shape)
    obj = sub == sub[y, x]
    w.pos_layer.add(w.pos_layer.world_to_data(region.data_to_world((y, x))))
    qtbot.waitUntil(lambda: w.has_preview() and w.status.text().startswith("preview"), timeout=WAIT)  # the full mask
    assert iou(w.preview_layer.data > 0, obj) > 0.7, w.status.text()
    w.commit()
    assert w.labels_layer.data.shape == (256, 256) and tuple(w.labels_layer.translate) == tuple(region.translate)


@pytest.mark.usefixtures("reuse_embeddings")
def test_boxes_preview_commit_reach_ground_truth(make_napari_viewer, qtbot, crop):
    img, gt = crop
    viewer = make_napari_viewer()
    viewer.add_image(img, name="nuclei")
    w = open_dock(viewer)
    assert w.image_layer.name == "nuclei" and w.model_name == DEFAULT_MODEL
    assert "Click" in w.hint_label.text()  # the default model takes clicks and boxes
    wait_embedded(qtbot, w)
    assert "embedding ready" in w.status.text()
    ids, boxes = gt_boxes(gt)
    ids, boxes = ids[:8], boxes[:8]
    for box in boxes:
        add_box(w, box)
        qtbot.waitUntil(w.has_preview, timeout=WAIT)
        committed = w.commit()
        assert committed
        assert len(w.box_layer.data) == 0 and not w.preview_layer.data.any()
    labels = w.labels_layer.data
    assert labels.max() == len(boxes)
    ious = [iou(labels == k + 1, gt == i) for k, i in enumerate(ids)]
    assert np.mean(ious) >= 0.80, ious
    # undo removes the last object; hand painting afterwards is kept by undo
    w.undo()
    assert labels.max() == len(boxes) - 1
    labels[0:3, 0:3] = 99  # napari's own paint tool writes into the same array
    w.undo()
    assert (labels[0:3, 0:3] == 99).all() and labels.max() == 99


@pytest.mark.usefixtures("reuse_embeddings")
def test_segment_all_boxes_is_one_batched_call(make_napari_viewer, qtbot, crop, monkeypatch):
    from napari_gpuseg.engine.sam.interactive.predictor import SamEngine

    img, gt = crop
    viewer = make_napari_viewer()
    viewer.add_image(img, name="nuclei")
    w = open_dock(viewer)
    wait_embedded(qtbot, w)
    ids, boxes = gt_boxes(gt)
    calls, inside = [], []  # prompts per decoder call made for the boxes (not the warm-up's)
    decode, predict_boxes = SamEngine._decode, SamEngine.predict_boxes

    def counted(self, emb, view, prompts, *args, **kwargs):
        if inside:
            calls.append(len(prompts))
        return decode(self, emb, view, prompts, *args, **kwargs)

    def boxes_job(self, *args, **kwargs):
        inside.append(True)
        try:
            return predict_boxes(self, *args, **kwargs)
        finally:
            inside.clear()

    monkeypatch.setattr(SamEngine, "_decode", counted)
    monkeypatch.setattr(SamEngine, "predict_boxes", boxes_job)
    w.box_layer.add_rectangles([np.array([[b[1], b[0]], [b[3], b[2]]]) for b in boxes])
    w.segment_all_boxes()
    qtbot.waitUntil(lambda: "committed" in w.status.text(), timeout=WAIT)
    assert len(boxes) > 5 and calls == [len(boxes)], calls  # every box in one decoder call
    assert w.labels_layer.data.max() >= 0.9 * len(boxes)


@pytest.mark.usefixtures("reuse_embeddings")
def test_box_only_model_steers_to_boxes(make_napari_viewer, qtbot, crop):
    viewer = make_napari_viewer()
    viewer.add_image(crop[0], name="nuclei")
    w = open_dock(viewer)
    assert viewer.layers.selection.active.name == w.pos_layer.name and w.pos_layer.mode == "add"
    w.model_combo.setCurrentText("lite_medsam")
    w._on_model_chosen(0)
    assert "trained with boxes" in w.hint_label.text()
    # the box tool is what the user gets, for this model, on this image and the next one
    assert viewer.layers.selection.active.name == w.box_layer.name and w.box_layer.mode == "add_rectangle"
    viewer.add_image(crop[0][:128], name="nuclei 2")
    qtbot.waitUntil(lambda: w.image_layer is not None and w.image_layer.name == "nuclei 2", timeout=WAIT)
    assert viewer.layers.selection.active.name == w.box_layer.name
    w.model_combo.setCurrentText("nuclei_sam")
    w._on_model_chosen(0)
    assert viewer.layers.selection.active.name == w.pos_layer.name and "Click an object" in w.hint_label.text()


@pytest.mark.usefixtures("reuse_embeddings")
def test_a_mouse_click_on_a_dropped_image_segments_the_nucleus(make_napari_viewer, qtbot, crop):
    """As a user: drop an image, open the dock, click a nucleus on the canvas. The dock has
    the positive-points tool ready (the default model takes clicks), so the click is a
    prompt, and the preview is that nucleus."""
    from qtpy.QtCore import QPoint, Qt
    from qtpy.QtTest import QTest
    from qtpy.QtWidgets import QWidget

    from scipy import ndimage as ndi

    from napari_gpuseg.engine.sam.training.simulated_prompts import interior_point
    from napari_gpuseg.widgets._joint_repaint import napari_window

    img, gt = crop
    viewer = make_napari_viewer(show=True)
    viewer.add_image(img, name="nuclei")
    w = open_dock(viewer)
    assert viewer.layers.selection.active.name == w.pos_layer.name and w.pos_layer.mode == "add"
    central = napari_window(w).centralWidget()
    canvas = max((c for c in central.findChildren(QWidget) if hasattr(c, "_vispy_canvas")),
                 key=lambda c: c.width() * c.height())
    ids, _boxes = gt_boxes(gt)
    oid = max(ids, key=lambda i: np.count_nonzero(gt == i))
    x, y = interior_point(gt == oid)
    viewer.camera.center = (float(y), float(x))  # the nucleus under the canvas centre
    qtbot.wait(50)
    QTest.mouseClick(canvas, Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier,
                     QPoint(canvas.width() // 2, canvas.height() // 2))
    qtbot.waitUntil(lambda: len(w.pos_layer.data) == 1, timeout=5_000)
    cy, cx = w.pos_layer.data[0]
    assert abs(cy - y) <= 2 and abs(cx - x) <= 2, (cy, cx, y, x)
    # the full mask (a first look from a small crop may come before it; a click made while
    # the look is on screen starts over, as a look keeps no logits)
    qtbot.waitUntil(lambda: w.has_preview() and w.status.text().startswith("preview"), timeout=WAIT)
    first = w.session.result
    assert iou(first.full(gt.shape), gt == oid) > 0.7
    # Shift-N: the next click is negative, in the background just outside the nucleus; it
    # refines the mask (the first click's logits go back in) and the nucleus stays
    viewer.window._qt_viewer.canvas.native.setFocus()
    QTest.keyClick(canvas, Qt.Key.Key_N, Qt.KeyboardModifier.ShiftModifier)
    qtbot.waitUntil(lambda: viewer.layers.selection.active.name == w.neg_layer.name, timeout=5_000)
    assert w.neg_layer.mode == "add"
    ys, xs = np.nonzero(ndi.binary_dilation(gt == oid, iterations=6) & (gt == 0))
    k = int(np.argmin((ys - y) ** 2 + (xs - x) ** 2))
    viewer.camera.center = (float(ys[k]), float(xs[k]))
    qtbot.wait(50)
    QTest.mouseClick(canvas, Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier,
                     QPoint(canvas.width() // 2, canvas.height() // 2))
    qtbot.waitUntil(lambda: len(w.neg_layer.data) == 1, timeout=5_000)
    assert len(w.pos_layer.data) == 1
    qtbot.waitUntil(lambda: w.has_preview() and w.session.result is not first, timeout=WAIT)
    assert w.session.prompt.mask_input is first
    assert iou(w.session.result.full(gt.shape), gt == oid) > 0.7
    QTest.keyClick(canvas, Qt.Key.Key_N, Qt.KeyboardModifier.ShiftModifier)  # and back
    qtbot.waitUntil(lambda: viewer.layers.selection.active.name == w.pos_layer.name, timeout=5_000)


@pytest.mark.usefixtures("reuse_embeddings")
def test_clicks_with_the_default_model_find_the_nucleus_and_refine(make_napari_viewer, qtbot, crop):
    from napari_gpuseg.engine.sam.training.simulated_prompts import corrective_point, interior_point

    img, gt = crop
    viewer = make_napari_viewer()
    viewer.add_image(img, name="nuclei")
    w = open_dock(viewer)
    wait_embedded(qtbot, w)
    # the background job embeds the grid, then the views first clicks are decoded in
    engine = w.session.engine()
    prepared = w.session.prepared()
    views = engine.prompt_views(prepared)
    assert engine.click_zoom > 1 and len(views) > len(engine.views(prepared))
    qtbot.waitUntil(lambda: engine.is_embedded(prepared, views), timeout=WAIT)
    assert w.session.tiles() == (len(views), len(views))
    ids, _boxes = gt_boxes(gt)
    scores = []
    for oid in ids[:6]:
        x, y = interior_point(gt == oid)
        w.pos_layer.add([[y, x]])
        qtbot.waitUntil(w.has_preview, timeout=WAIT)
        first = w.session.result
        # of SAM's three multimask outputs and the tuned single-mask output, the one the
        # default decoder names (click_output, measured on training objects; None: the
        # one its IoU head rates highest)
        assert first.all_scores is not None and len(first.all_scores) == 4
        named = w.session.engine().click_output  # None: the IoU head's choice
        assert first.score == (first.all_scores.max() if named is None else first.all_scores[named])
        mask = first.full(gt.shape)
        scores.append(iou(mask, gt == oid))
        (cx, cy), label = corrective_point(mask, gt == oid) or ((x, y), 1)
        (w.pos_layer if label else w.neg_layer).add([[cy, cx]])
        qtbot.waitUntil(lambda: w.has_preview() and w.session.result is not first, timeout=WAIT)
        assert w.session.prompt.mask_input is first  # the second click refines the first mask
        assert w.commit()
    assert np.mean(scores) >= 0.8, scores


def test_a_first_click_after_a_drop_shows_its_native_tile_mask_first(make_napari_viewer, qtbot, shared_data,
                                                                    monkeypatch):
    """Right after a drop the finer click view a first click is also decoded in is not
    embedded (a whole field's 12 native tiles come first): the dock shows the mask of the
    click's native tile as soon as that tile is ready, then the mask of both scales, the
    same as the engine gives for the click."""
    from napari_gpuseg.engine.sam.training.simulated_prompts import interior_point
    from napari_gpuseg.engine.sam.interactive.prompt_types import Prompt
    from napari_gpuseg.engine.annotate import steps

    f = sorted((shared_data / "bbbc039" / "images").glob("*.tif"))[17]
    img = tifffile.imread(f)
    gt = tifffile.imread(shared_data / "bbbc039" / "masks" / f.name)
    viewer = make_napari_viewer()
    w = open_dock(viewer)
    shown = record_shows(w)
    events = []  # the full decode's finer view is embedded once the first look is painted
    painted, wait_shown = w._on_look_painted, steps.wait_shown

    def on_painted():
        events.append("painted")
        painted()

    def waited(look, cancel=None):
        wait_shown(look, cancel, limit=60.0)  # however busy the machine: the paint, not a timeout
        events.append(("decode", look.is_set()))

    w._look_painted._fn = on_painted
    monkeypatch.setattr(steps, "wait_shown", waited)
    viewer.add_image(img, name="nuclei")
    qtbot.waitUntil(lambda: w.image_layer is not None and w.pos_layer is not None, timeout=WAIT)
    oid = gt[gt.shape[0] // 2 - 60:gt.shape[0] // 2 + 60, gt.shape[1] // 2 - 60:gt.shape[1] // 2 + 60].max()
    x, y = interior_point(gt == oid)
    w.pos_layer.add([[y, x]])
    qtbot.waitUntil(lambda: any(final for final, _r, _t in shown), timeout=WAIT)
    assert [final for final, _r, _t in shown] == [False, True]
    assert events == ["painted", ("decode", True)]  # the decode went on after the paint, not the timeout
    assert not w._looks_waiting
    assert "first look" in shown[0][2] and "first look" not in shown[1][2]
    assert w.session.result is shown[1][1]
    engine = w.session.engine()
    click = Prompt(points=np.array([[x, y]], float), labels=np.array([1]))
    job = w.worker.submit(lambda: engine.predict(np.array(img), [click], multimask=True)[0])
    qtbot.waitUntil(lambda: job.wait(0), timeout=WAIT)
    np.testing.assert_array_equal(job.result().full(gt.shape), shown[1][1].full(gt.shape))
    assert iou(shown[0][1].full(gt.shape), gt == oid) > 0.6


def test_a_first_clicks_full_decode_waits_for_its_first_look_but_not_forever():
    """The full decode of a first click goes on once its first look is shown (the event is
    set), gives up waiting when it never is (a stale look), and stops when the click is
    replaced (cancelled)."""
    import threading

    from napari_gpuseg.engine.annotate import steps
    from napari_gpuseg.engine.runtime.cancel import CancelToken, Cancelled

    look = threading.Event()
    threading.Timer(0.05, look.set).start()
    assert steps.wait_shown(look, limit=60.0) and look.is_set()
    assert not steps.wait_shown(threading.Event(), limit=0.02)  # never shown: it goes on
    token = CancelToken()
    token.cancel()
    with pytest.raises(Cancelled):
        steps.wait_shown(threading.Event(), token)


@pytest.mark.usefixtures("reuse_embeddings")
def test_points_give_a_preview_and_negative_points_count(make_napari_viewer, qtbot, crop):
    img, gt = crop
    viewer = make_napari_viewer()
    viewer.add_image(img, name="nuclei")
    w = open_dock(viewer)
    wait_embedded(qtbot, w)
    ids, boxes = gt_boxes(gt)
    b = boxes[0]
    cy, cx = (b[1] + b[3]) / 2, (b[0] + b[2]) / 2
    w.pos_layer.add([[cy, cx]])
    qtbot.waitUntil(w.has_preview, timeout=WAIT)
    first = w.session.result
    assert first.all_scores is not None  # point prompt: best of the candidates
    w.neg_layer.add([[b[1] - 5, b[0] - 5]])
    qtbot.waitUntil(lambda: w.has_preview() and w.session.result is not first, timeout=WAIT)
    add_box(w, b)  # a box together with the points
    qtbot.waitUntil(lambda: w.has_preview() and w.session.result.all_scores.shape == (1,), timeout=WAIT)
    assert w.commit()
    assert iou(w.labels_layer.data == 1, gt == ids[0]) > 0.6


@pytest.mark.usefixtures("reuse_embeddings")
def test_stack_precompute_and_commit_into_the_right_slice(make_napari_viewer, qtbot, shared_data):
    vol = tifffile.imread(shared_data / "synthetic3d" / "image.tif")[12:16]
    gt = tifffile.imread(shared_data / "synthetic3d" / "mask.tif")[12:16]
    viewer = make_napari_viewer()
    viewer.add_image(vol, name="volume")
    w = open_dock(viewer)
    assert w.labels_layer.data.shape == vol.shape
    w.batch_spin.setValue(3)
    w.precompute_stack()
    qtbot.waitUntil(lambda: "stack ready" in w.status.text(), timeout=WAIT)
    assert all(w.session.is_embedded((z,)) for z in range(vol.shape[0]))
    viewer.dims.set_current_step(0, 3)
    assert w.session.is_embedded()  # moving through slices needs no encoder call
    # a 61 x 57 slice is one view upscaled 4x: measured with the box-trained LiteMedSAM (the
    # shipped decoder trained on native-resolution views gives 0.36 here)
    w.use_sam_model("lite_medsam")
    qtbot.waitUntil(w.session.is_embedded, timeout=WAIT)
    ids, boxes = gt_boxes(gt[3], margin=2)
    big = int(np.argmax([(b[2] - b[0]) * (b[3] - b[1]) for b in boxes]))
    add_box(w, boxes[big], index=(3,))
    qtbot.waitUntil(w.has_preview, timeout=WAIT)
    w.commit()
    labels = w.labels_layer.data
    assert labels[3].max() == 1 and labels[[0, 1, 2]].max() == 0
    assert iou(labels[3] == 1, gt[3] == ids[big]) > 0.5  # small synthetic slice, 4x upscaled


def test_cancel_stack_precompute(make_napari_viewer, qtbot, shared_data):
    vol = tifffile.imread(shared_data / "synthetic3d" / "image.tif")
    viewer = make_napari_viewer()
    viewer.add_image(vol + 1, name="volume")  # different content: nothing cached
    w = open_dock(viewer)
    w.batch_spin.setValue(1)
    w.precompute_stack()
    job = w._stack_job
    qtbot.waitUntil(lambda: w.progress.value() >= 1, timeout=WAIT)
    w.cancel()
    assert job.wait(60)
    assert job.status == CANCELLED
    assert not all(w.session.is_embedded((z,)) for z in range(vol.shape[0]))  # it stopped part-way
    qtbot.waitUntil(lambda: "cancelled" in w.status.text(), timeout=5000)


def test_switching_images_mid_embedding_never_mixes_them(make_napari_viewer, qtbot, crop, shared_data):
    img, gt = crop
    other = tifffile.imread(sorted((shared_data / "bbbc039" / "images").glob("*.tif"))[20])[:256, :256]
    viewer = make_napari_viewer()
    viewer.add_image(other, name="first")
    w = open_dock(viewer)
    first_job = w._embed_job
    viewer.add_image(img, name="second")  # becomes the active layer mid-embedding
    qtbot.waitUntil(lambda: w.image_layer.name == "second", timeout=WAIT)
    wait_embedded(qtbot, w)
    assert first_job.status in (CANCELLED, "done")
    ids, boxes = gt_boxes(gt)
    add_box(w, boxes[1])
    qtbot.waitUntil(w.has_preview, timeout=WAIT)
    layer, result = w.image_layer, w.session.result
    assert layer.name == "second"
    assert iou(result.full(gt.shape), gt == ids[1]) > 0.6


def test_a_second_image_keeps_the_prompt_layers_above_it_and_embeds_first(make_napari_viewer, qtbot, crop):
    """An image dropped beside an annotated one lands on top of the layer list: the shared
    prompt and preview layers move above it (its pixels would hide the boxes drawn on it)
    and are kept, the preview taking the new shape, rather than made again. The encoder
    starts on the new image before its labels layer is made, where a first drop puts it
    (under the preview)."""
    img, gt = crop
    viewer = make_napari_viewer()
    viewer.add_image(img[:128, :128], name="first")
    w = open_dock(viewer)
    kept = (w.pos_layer, w.neg_layer, w.box_layer, w.preview_layer)
    order = []
    submit = w.session._submit_fn

    def spy(fn, *a, **kw):
        order.append(("submit", kw.get("tag")))
        return submit(fn, *a, **kw)

    w.session._submit_fn = spy
    viewer.layers.events.inserted.connect(lambda e: order.append(("layer", e.value.name)))
    viewer.add_image(img, name="second")
    qtbot.waitUntil(lambda: w.image_layer.name == "second", timeout=WAIT)
    assert order.index(("submit", "embed")) < order.index(("layer", "second SAM labels"))
    active = viewer.layers.selection.active
    assert (w.pos_layer, w._layers.neg, w.box_layer, w.preview_layer) == kept
    assert w.preview_layer.data.shape == img.shape and not w.preview_layer.data.any()
    ids, boxes = gt_boxes(gt)
    add_box(w, boxes[0])
    qtbot.waitUntil(w.has_preview, timeout=WAIT)
    assert w.image_layer.name == "second"
    assert iou(w.preview_layer.data > 0, gt == ids[0]) > 0.6
    names = [ly.name for ly in viewer.layers]
    assert names[names.index("second"):] == ["second", "SAM positive", "SAM negative", "SAM boxes",
                                             "second SAM labels", "SAM preview"]
    assert viewer.layers.selection.active.name == active.name  # the user's tool stays active

def test_following_a_drop_makes_all_five_layers_at_once(make_napari_viewer, qtbot, crop):
    """A first drop makes SAM positive, SAM negative, SAM boxes, the labels layer and SAM
    preview while the dock follows it (made later, each was a half-second freeze while the
    tiles embedded: docs/benchmarks.md, SAM annotator), in that order, with the click
    tool active; a layer the user deletes is not made again behind their back."""
    img, gt = crop
    viewer = make_napari_viewer()
    w = open_dock(viewer)
    viewer.add_image(img, name="cells")
    qtbot.waitUntil(lambda: w.image_layer is not None and w.box_layer is not None, timeout=WAIT)
    assert [ly.name for ly in viewer.layers] == ["cells", "SAM positive", "SAM negative", "SAM boxes",
                                                 "cells SAM labels", "SAM preview"]
    assert w._layers.neg.mode == "add"
    active = viewer.layers.selection.active
    ids, boxes = gt_boxes(gt)
    add_box(w, boxes[0])
    qtbot.waitUntil(w.has_preview, timeout=WAIT)
    assert viewer.layers.selection.active.name == active.name
    ids_committed = w.commit()
    assert iou(w.labels_layer.data == ids_committed[0], gt == ids[0]) > 0.6
    viewer.layers.remove("SAM negative")  # the user's choice: not made again behind their back
    add_box(w, boxes[1])
    qtbot.waitUntil(w.has_preview, timeout=WAIT)
    qtbot.wait(300)  # events flow; nothing makes it again
    assert "SAM negative" not in viewer.layers
    w._toggle_click_sign()  # until they ask for it
    assert viewer.layers.selection.active.name == "SAM negative"


def test_deleted_layers_come_back_where_they_belong_when_needed(make_napari_viewer, qtbot, crop):
    """SAM negative and the labels layer deleted: Shift-N makes SAM negative again (and
    makes it the click tool), and anything that reads the labels layer (commit, propagate,
    Segment all boxes) gets it again; undo with nothing committed makes nothing."""
    img, gt = crop
    viewer = make_napari_viewer()
    w = open_dock(viewer)
    viewer.add_image(img, name="cells")
    qtbot.waitUntil(lambda: w.image_layer is not None and w.box_layer is not None, timeout=WAIT)
    viewer.layers.remove("SAM negative")
    viewer.layers.remove("cells SAM labels")
    w.undo()  # nothing committed: no labels layer made for it
    assert "cells SAM labels" not in viewer.layers and "nothing to undo" in w.status.text()
    w._toggle_click_sign()
    assert viewer.layers.selection.active.name == "SAM negative"
    assert w._layers.neg.mode == "add", w._layers.neg.mode
    assert viewer.layers.index("SAM negative") == viewer.layers.index("SAM positive") + 1
    assert w.labels_layer.data.shape == gt.shape
    assert viewer.layers.index("cells SAM labels") == viewer.layers.index("SAM preview") - 1


@pytest.mark.usefixtures("reuse_embeddings")
def test_deleting_every_layer_then_dropping_an_image(make_napari_viewer, qtbot, crop):
    """Select all, delete, drop a new image: the dock rebuilds its layers for the new image
    after napari's layer-list change (rebuilding inside it once crashed Qt's model)."""
    img, gt = crop
    viewer = make_napari_viewer()
    viewer.add_image(img[:128, :128], name="old")
    w = open_dock(viewer)
    viewer.layers.select_all()
    viewer.layers.remove_selected()
    qtbot.wait(10)
    assert len(viewer.layers) == 0
    viewer.add_image(img, name="new")
    qtbot.waitUntil(lambda: w.image_layer.name == "new", timeout=WAIT)
    wait_embedded(qtbot, w)  # the rest of the layers come after the first tile
    qtbot.waitUntil(lambda: {"SAM positive", "SAM negative", "SAM boxes", "SAM preview", "new SAM labels"}
                    <= {ly.name for ly in viewer.layers}, timeout=WAIT)
    ids, boxes = gt_boxes(gt)
    add_box(w, boxes[0])
    qtbot.waitUntil(w.has_preview, timeout=WAIT)
    assert iou(w.session.result.full(gt.shape), gt == ids[0]) > 0.6


def test_prompt_and_mask_are_drawn_in_one_repaint(make_napari_viewer, qtbot, crop, monkeypatch):
    """The window's repaints wait for the preview (at most JOINT_REPAINT_MAX_MS): a slow or failing
    decoder never keeps the user's prompt hidden longer, and never leaves it held."""
    from napari_gpuseg.widgets._joint_repaint import JOINT_REPAINT_MAX_MS, napari_window

    img, gt = crop
    viewer = make_napari_viewer()
    viewer.add_image(img, name="nuclei")
    w = open_dock(viewer)
    wait_embedded(qtbot, w)
    engine = w.session.engine()  # loaded by now; the dock warms its decoder after embedding
    qtbot.waitUntil(lambda: any(len(m) > 10 for m in engine._memos.values()), timeout=WAIT)
    window = napari_window(w)
    assert window is not None and window is w.window()  # napari's main window
    _ids, boxes = gt_boxes(gt)

    calls = count_decodes(monkeypatch)
    for box in boxes[:2]:  # the usual case: held until the mask is there
        add_box(w, box)  # into an empty box layer: its extent, and the viewer's dims, change
        assert w.joint_repaint.gathering and window.updatesEnabled()  # held, never switched off
        qtbot.waitUntil(w.has_preview, timeout=WAIT)
        assert not w.joint_repaint.gathering
        w.clear_prompts()
    qtbot.wait(50)
    assert len(calls) == 2  # one decode per box: a dims event on the same plane is no edit

    count_decodes(monkeypatch, slow_s=30 * JOINT_REPAINT_MAX_MS / 1000)  # a decoder slower than the limit
    timeouts = w.joint_repaint.timeouts
    add_box(w, boxes[1])
    assert w.joint_repaint.gathering
    qtbot.waitUntil(lambda: not w.joint_repaint.gathering, timeout=WAIT)
    # released by its time limit, not by the mask: the box shows before its mask
    assert w.joint_repaint.timeouts == timeouts + 1 and not w.has_preview()
    qtbot.waitUntil(w.has_preview, timeout=WAIT)
    w.clear_prompts()

    count_decodes(monkeypatch, error="decoder exploded")  # an error releases at once and is reported
    add_box(w, boxes[2])
    qtbot.waitUntil(lambda: "decoder exploded" in w.status.text(), timeout=WAIT)
    assert not w.joint_repaint.gathering and window.updatesEnabled()


def test_a_held_edit_repaints_what_changed_not_the_whole_window(make_napari_viewer, qtbot, crop):
    """While held nothing of the window is painted; the release paints the canvas (the box
    and its mask together) and leaves widgets that did not change (the menu bar) alone."""
    from qtpy.QtCore import QEvent, QObject
    from qtpy.QtWidgets import QApplication, QMenuBar

    img, gt = crop
    viewer = make_napari_viewer(show=True)
    viewer.add_image(img, name="nuclei")
    w = open_dock(viewer)
    wait_embedded(qtbot, w)
    qtbot.wait(200)  # the window's first paints are done
    # what a hold paints, not how long it lasts (the test above): a busy machine may take
    # longer than JOINT_REPAINT_MAX_MS to decode, so this repaint waits for the mask however long it takes
    w.joint_repaint._timer.setInterval(60_000)
    _ids, boxes = gt_boxes(gt)
    painted: list[str] = []  # what was painted, by kind (no references kept)

    class Paints(QObject):
        def eventFilter(self, obj, event):
            if event.type() == QEvent.Type.Paint:
                kind = "canvas" if hasattr(obj, "_vispy_canvas") else type(obj).__name__
                painted.append("menu bar" if isinstance(obj, QMenuBar) else kind)
            return False

    spy = Paints()
    app = QApplication.instance()
    app.installEventFilter(spy)
    try:
        # a loaded machine may still owe the window paints from before the edit: wait until
        # none has come for 300 ms (bounded), so that what follows was caused by the edit
        for _ in range(100):
            before = len(painted)
            qtbot.wait(300)
            if len(painted) == before:
                break
        painted.clear()
        shown = []
        real = w._show_mask
        w._show_mask = lambda *a, **kw: (shown.append(len(painted)), real(*a, **kw))
        timeouts = w.joint_repaint.timeouts
        add_box(w, boxes[0])
        assert w.joint_repaint.gathering
        qtbot.waitUntil(lambda: bool(shown), timeout=WAIT)
        # the canvas was not painted between the edit and the mask (the box alone)
        assert "canvas" not in painted[:shown[0]], f"painted while held: {painted[:shown[0]]}"
        qtbot.waitUntil(lambda: not w.joint_repaint.gathering, timeout=WAIT)
        assert w.joint_repaint.timeouts == timeouts  # released by the mask, not by the time limit
        qtbot.wait(100)
    finally:
        app.removeEventFilter(spy)
    assert "canvas" in painted, set(painted)  # the box and its mask, drawn together
    assert "menu bar" not in painted, set(painted)  # unchanged: not repainted


def test_drawing_a_box_with_the_mouse_decodes_once_on_release(make_napari_viewer, qtbot, crop, monkeypatch):
    """A user drags a rectangle on the canvas: nothing is decoded (or held) while the mouse
    moves, one decode and one joint repaint follow the release, and the mask comes."""
    from qtpy.QtCore import QPoint, Qt
    from qtpy.QtTest import QTest
    from qtpy.QtWidgets import QWidget

    from napari_gpuseg.widgets._joint_repaint import napari_window

    img, _gt = crop
    viewer = make_napari_viewer(show=True)
    viewer.add_image(img, name="nuclei")
    w = open_dock(viewer)
    wait_embedded(qtbot, w)
    assert viewer.layers.selection.active.name == w.pos_layer.name  # a click model: clicks come first
    viewer.layers.selection.active = w.box_layer  # the user picks SAM boxes in the layer list
    assert w.box_layer.mode == "add_rectangle"  # and has the box tool at once
    central = napari_window(w).centralWidget()
    canvas = max((c for c in central.findChildren(QWidget) if hasattr(c, "_vispy_canvas")),
                 key=lambda c: c.width() * c.height())
    calls = count_decodes(monkeypatch)
    mid = QPoint(canvas.width() // 2, canvas.height() // 2)
    a, b = mid - QPoint(40, 40), mid + QPoint(40, 40)
    QTest.mousePress(canvas, Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier, a)
    for t in np.linspace(0, 1, 6)[1:]:
        QTest.mouseMove(canvas, QPoint(int(a.x() + t * (b.x() - a.x())), int(a.y() + t * (b.y() - a.y()))))
        qtbot.wait(5)
    assert not calls and not w.joint_repaint.gathering  # drawing: no decode per mouse move
    QTest.mouseRelease(canvas, Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier, b)
    assert len(w.box_layer.data) == 1 and w.joint_repaint.gathering
    qtbot.waitUntil(w.has_preview, timeout=WAIT)
    qtbot.wait(50)
    assert len(calls) == 1 and calls[0].box is not None and w.joint_repaint.starts == 1
    assert not w.joint_repaint.gathering
    # then the user moves the box: the select tool, a drag from inside it. Nothing is decoded
    # while it moves; the release decodes the box where it was dropped, once
    w.box_layer.mode = "select"
    before = np.asarray(w.box_layer.data[0]).copy()
    c, d = mid, mid + QPoint(24, 12)
    QTest.mousePress(canvas, Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier, c)
    for t in np.linspace(0, 1, 6)[1:]:
        QTest.mouseMove(canvas, QPoint(int(c.x() + t * (d.x() - c.x())), int(c.y() + t * (d.y() - c.y()))))
        qtbot.wait(5)
    assert len(calls) == 1
    QTest.mouseRelease(canvas, Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier, d)
    qtbot.waitUntil(lambda: len(calls) == 2 and w.session.result is not None
                    and w.session.prompt is calls[1], timeout=WAIT)
    after = np.asarray(w.box_layer.data[0])
    dy, dx = (after - before).mean(0)
    assert dx > 5 and dy > 2 and np.allclose(after - before, [dy, dx])  # moved whole, right and down
    x0, y0, x1, y1 = calls[1].box
    assert np.allclose([y0, x0, y1, x1], [*after.min(0), *after.max(0)], atol=1)
    qtbot.waitUntil(w.has_preview, timeout=WAIT)
    qtbot.wait(50)
    assert len(calls) == 2


def test_missing_model_file_is_a_notification_not_a_crash(make_napari_viewer, qtbot, crop, tmp_path):
    img, _gt = crop
    viewer = make_napari_viewer()
    viewer.add_image(img[:64, :64], name="small")
    w = open_dock(viewer)
    n_layers = len(viewer.layers)
    w.model_combo.insertItem(0, str(tmp_path / "missing.pth"))
    w.model_combo.setCurrentIndex(0)
    w._on_model_chosen(0)
    qtbot.waitUntil(lambda: "not found" in w.status.text(), timeout=WAIT)
    assert len(viewer.layers) == n_layers  # the user's layers are untouched


def test_the_stack_embeds_in_the_worker_while_the_event_loop_runs(make_napari_viewer, qtbot, shared_data):
    """Every encoder call of a stack precompute runs in the worker thread, and the GUI thread's
    timers keep firing between its first and last call (how long the longest stall is, is
    measured by ``benchmarks/first_mask.py``, not asserted here)."""
    import threading

    from qtpy.QtCore import QTimer

    vol = tifffile.imread(shared_data / "synthetic3d" / "image.tif")[:2] + 7
    viewer = make_napari_viewer()
    viewer.add_image(vol, name="volume")
    w = open_dock(viewer)
    qtbot.waitUntil(lambda: "ready" in w.status.text() or w.session.busy("embed"), timeout=WAIT)
    engine = w.session.engine()
    calls, encode = [], engine.encode

    def recorded(batch):
        t0 = time.perf_counter()
        try:
            return encode(batch)
        finally:
            calls.append((threading.current_thread(), t0, time.perf_counter()))

    engine.encode = recorded
    ticks = []
    timer = QTimer()
    timer.timeout.connect(lambda: ticks.append(time.perf_counter()))
    timer.start(10)
    try:
        w.batch_spin.setValue(2)
        w.precompute_stack()
        qtbot.waitUntil(lambda: "stack ready" in w.status.text(), timeout=WAIT)
    finally:
        timer.stop()
        del engine.encode
    assert calls and all(t is not threading.main_thread() for t, _a, _b in calls)
    first, last = min(a for _t, a, _b in calls), max(b for _t, _a, b in calls)
    assert any(first < t < last for t in ticks)  # the event loop ran while the encoder did


@pytest.mark.usefixtures("reuse_embeddings")
def test_the_same_clicks_give_the_same_masks_in_the_dock_and_a_session(make_napari_viewer, qtbot, crop):
    """A click, a negative click that refines it, a box and a commit: the dock (prompts in its
    layers) and a script's AnnotationSession (click/box/commit) give the same masks and labels."""
    from scipy import ndimage as ndi

    from napari_gpuseg.engine import AnnotationSession
    from napari_gpuseg.engine.sam.training.simulated_prompts import interior_point

    img, gt = crop
    viewer = make_napari_viewer()
    viewer.add_image(img, name="nuclei")
    w = open_dock(viewer)
    s = AnnotationSession(w.model_name, worker=w.worker)  # the dock's model, loaded once
    s.set_image(img)
    ids, boxes = gt_boxes(gt)
    x, y = interior_point(gt == ids[0])
    ys, xs = np.nonzero(ndi.binary_dilation(gt == ids[0], iterations=5) & (gt == 0))
    nx, ny = float(xs[0]), float(ys[0])

    def dock_mask(edit):
        before = w.session.result
        edit()
        qtbot.waitUntil(lambda: w.session.final and w.session.result is not before, timeout=WAIT)
        return w.preview_layer.data > 0

    shown = dock_mask(lambda: w.pos_layer.add([[y, x]]))
    np.testing.assert_array_equal(shown, s.click(x, y))
    assert iou(shown, gt == ids[0]) > 0.7
    shown = dock_mask(lambda: w.neg_layer.add([[ny, nx]]))
    np.testing.assert_array_equal(shown, s.click(nx, ny, positive=False))
    assert w.session.prompt.mask_input is not None and s.prompt.mask_input is not None  # both refined
    w.clear_prompts()
    shown = dock_mask(lambda: add_box(w, boxes[1]))
    np.testing.assert_array_equal(shown, s.box(*boxes[1]))
    assert w.commit() == [s.commit()]
    np.testing.assert_array_equal(w.labels_layer.data, s.labels)


def test_closing_the_dock_stops_its_work_and_lets_go_of_the_viewer(make_napari_viewer, qtbot, shared_data):
    """napari takes a closed dock's widget out of the window and keeps it: the annotator stops
    there (its tiles cancelled, new images, prompts and its keys no longer reach it, the mesh
    fix let go); what it made stays in the viewer."""
    from vispy.visuals.mesh import MeshVisual

    from napari_gpuseg.widgets import _mesh_shader

    img = tifffile.imread(shared_data / "bbbc039" / "images" / "IXMtest_A02_s1.tif")  # 36 tiles
    viewer = make_napari_viewer()
    viewer.add_image(img, name="field")
    dock, w = viewer.window.add_plugin_dock_widget("napari-gpuseg", "SAM annotator")
    qtbot.waitUntil(lambda: w.worker.busy, timeout=WAIT)  # the tiles embed in the background
    made = [ly.name for ly in viewer.layers]
    holders = _mesh_shader._HOLDERS[0]
    dock.destroyOnClose()  # the dock's close button
    assert w.parent() is None
    qtbot.waitUntil(lambda: not w.worker.busy, timeout=WAIT)
    assert not w.session.is_embedded()  # cancelled, not finished
    assert _mesh_shader._HOLDERS[0] == holders - 1
    if holders == 1:
        assert not getattr(MeshVisual._build_color_transform, _mesh_shader._MARK, False)
    assert [ly.name for ly in viewer.layers] == made  # its layers and labels stay
    viewer.add_image(img[:128, :128], name="second")  # not followed
    qtbot.wait(300)
    assert w.image_layer.name == "field" and len(viewer.layers) == len(made) + 1
    w.pos_layer.add(np.array([[100.0, 100.0]]))  # a prompt reaches it no more
    qtbot.wait(300)
    assert not w.has_preview() and not w.worker.busy
    for key in ("Shift-C", "Shift-X", "Shift-Z", "Shift-N", "Shift-P"):
        assert viewer.bind_key(key, None) is None  # unbound
    w.retire()  # twice: nothing more happens
    # opened again from the Plugins menu: a new annotator on the active image, its keys bound
    viewer.layers.selection.active = viewer.layers["second"]
    _dock2, w2 = viewer.window.add_plugin_dock_widget("napari-gpuseg", "SAM annotator")
    assert w2 is not w and w2.image_layer.name == "second"
    qtbot.waitUntil(w2.session.is_embedded, timeout=WAIT)
    w2.pos_layer.add(np.array([[64.0, 64.0]]))
    qtbot.waitUntil(w2.has_preview, timeout=WAIT)
    assert viewer.bind_key("Shift-C", None) is not None


def test_closing_napari_s_window_stops_the_annotator_s_tiles(make_napari_viewer, qtbot, shared_data):
    """``viewer.close()`` (a script, or the window's close button) stops the annotator as its
    own close button does: napari keeps the dock's widget, and the field's tiles would go on."""
    img = tifffile.imread(shared_data / "bbbc039" / "images" / "IXMtest_A02_s1.tif") + 3  # 36 tiles
    viewer = make_napari_viewer()
    viewer.add_image(img, name="field")
    _dock, w = viewer.window.add_plugin_dock_widget("napari-gpuseg", "SAM annotator")
    qtbot.waitUntil(lambda: w.worker.busy, timeout=WAIT)
    viewer.close()
    qtbot.waitUntil(lambda: not w.worker.busy, timeout=WAIT)
    assert not w.session.is_embedded()  # cancelled, not finished
    assert viewer.bind_key("Shift-C", None) is None  # its keys let go
