"""The annotator's order of work, observed through the worker's log (not by timing):
a prompt on a new image runs before the image's tiles and embeds only its own view; an
image switch cancels the old image's tiles; a stack is embedded from the displayed slice
outwards."""
import threading

import numpy as np
import pytest
import tifffile

from napari_gpuseg.engine.runtime.worker import CANCELLED, DONE, RUNNING
from napari_gpuseg.engine.sam.interactive.stack_embed_order import outward

from sam_fixtures import gt_boxes, iou, require_lite_medsam

WAIT = 180_000


@pytest.fixture(scope="module", autouse=True)
def lite_available():
    require_lite_medsam()


@pytest.fixture(scope="module")
def strip(shared_data):
    f = sorted((shared_data / "bbbc039" / "images").glob("*.tif"))[19]
    img = tifffile.imread(f)[100:356, :640]  # three 256 px tiles side by side
    gt = tifffile.imread(shared_data / "bbbc039" / "masks" / f.name)[100:356, :640]
    return img, gt


def open_dock(viewer):
    _dock, widget = viewer.window.add_plugin_dock_widget("napari-gpuseg", "SAM annotator")
    return widget


def hold_worker(worker):
    """Block the worker until the returned event is set; jobs submitted meanwhile queue."""
    release, started = threading.Event(), threading.Event()
    worker.submit(lambda: (started.set(), release.wait(120)), tag="test-gate")
    assert started.wait(WAIT / 1000)
    return release


def add_box(w, box):
    x0, y0, x1, y1 = box
    w.box_layer.add_rectangles(np.array([[y0, x0], [y0, x1], [y1, x1], [y1, x0]], float))


def final_preview(w) -> bool:
    """The full decode's mask is on display (a box's first look, from a small crop, may come
    before it while its view is not embedded)."""
    job = w.session.decode_job
    return (w.has_preview() and job is not None and job.wait(0)
            and w.session.result is job.result())


def log_index(worker, event, job):
    return [(ev, i) for ev, i, _t in worker.log].index((event, job.id))


def test_outward_order():
    assert outward([(i,) for i in range(6)], (3,)) == [(3,), (2,), (4,), (1,), (5,), (0,)]
    assert outward([(0, 0), (0, 1), (1, 1), (1, 0)], (1, 1))[:1] == [(1, 1)]


def test_a_box_on_a_new_image_needs_only_its_own_tile(make_napari_viewer, qtbot, strip):
    img, gt = strip
    viewer = make_napari_viewer()
    w = open_dock(viewer)
    qtbot.waitUntil(lambda: "ready" in w.status.text(), timeout=WAIT)  # model loaded
    texts = []
    real_set = w._set_status
    w._set_status = lambda t: (real_set(t), texts.append(w.status.text()))
    release = hold_worker(w.worker)
    try:
        viewer.add_image(img, name="strip")
        qtbot.waitUntil(lambda: w.image_layer is not None and w.image_layer.name == "strip",
                        timeout=WAIT)
        ids, boxes = gt_boxes(gt)
        k = next(i for i, b in enumerate(boxes) if b[0] > 460)  # in the last tile only
        add_box(w, boxes[k])
    finally:
        release.set()
    qtbot.waitUntil(lambda: final_preview(w), timeout=WAIT)
    engine = w.session.engine()
    tiles, preview = w._embed_job, w.session.decode_job
    assert preview.status == DONE
    result = w.session.result
    assert result.view.x0 > 256 and iou(result.full(gt.shape), gt == ids[k]) > 0.6
    # the decode (and the embedding of its one tile) ran before the image's tiles (the tiles
    # job may start just after the preview reaches the GUI thread: wait for its start)
    qtbot.waitUntil(lambda: ("start", tiles.id) in [(ev, i) for ev, i, _t in w.worker.log], timeout=WAIT)
    assert log_index(w.worker, "end", preview) < log_index(w.worker, "start", tiles)
    prepared = engine.prepare(img)  # the dock's image (embeddings are keyed by content)
    qtbot.waitUntil(lambda: engine.views_ready(prepared) == 3, timeout=WAIT)
    # the count covers the grid's 3 tiles and then the finer views first clicks use (the
    # test stops once the count has passed the grid: the rest is the same job going on)
    n = len(engine.prompt_views(prepared))
    assert n > 3
    qtbot.waitUntil(lambda: any(f"{k}/{n} tiles" in w.status.text() for k in range(4, n + 1)), timeout=WAIT)
    counts = [t for t in texts if f"/{n} tiles" in t]
    assert any(f"1/{n} tiles" in t or f"2/{n} tiles" in t for t in counts), texts


def test_image_switch_cancels_the_old_tiles_and_serves_the_new_prompt_first(
        make_napari_viewer, qtbot, strip):
    img, gt = strip
    viewer = make_napari_viewer()
    w = open_dock(viewer)
    qtbot.waitUntil(lambda: "ready" in w.status.text(), timeout=WAIT)
    release = hold_worker(w.worker)
    try:
        viewer.add_image(img[:, ::-1] + 3, name="old")  # content no test has embedded
        qtbot.waitUntil(lambda: w.image_layer is not None and w.image_layer.name == "old",
                        timeout=WAIT)
        old_tiles = w._embed_job
        old_image = w.image_layer
        viewer.add_image(img, name="new")
        qtbot.waitUntil(lambda: w.image_layer.name == "new", timeout=WAIT)
        new_tiles = w._embed_job
        ids, boxes = gt_boxes(gt)
        k = next(i for i, b in enumerate(boxes) if b[0] > 460)
        add_box(w, boxes[k])
        preview = w.session.decode_job
    finally:
        release.set()
    qtbot.waitUntil(lambda: final_preview(w), timeout=WAIT)
    assert old_tiles.wait(60) and old_tiles.status == CANCELLED
    engine = w.session.engine()
    assert engine.views_ready(engine.prepare(np.asarray(old_image.data))) == 0
    assert log_index(w.worker, "end", preview) < log_index(w.worker, "start", new_tiles)
    assert w.image_layer.name == "new"
    assert iou(w.session.result.full(gt.shape), gt == ids[k]) > 0.6
    # the new image's tiles go on after the prompt (started above, not cancelled)
    assert new_tiles.status in (RUNNING, DONE)


def test_stack_precompute_starts_at_the_displayed_slice(make_napari_viewer, qtbot, shared_data):
    vol = tifffile.imread(shared_data / "synthetic3d" / "image.tif")[20:25] + 5
    viewer = make_napari_viewer()
    viewer.add_image(vol, name="volume")
    w = open_dock(viewer)
    viewer.dims.set_current_step(0, 3)
    w.precompute_stack()
    qtbot.waitUntil(lambda: "stack ready" in w.status.text(), timeout=WAIT)
    assert w.stack_order == [(3,), (2,), (4,), (1,), (0,)]
    assert all(w.session.is_embedded((z,)) for z in range(5))


def test_tiles_wait_while_the_preview_is_drawn(make_napari_viewer, qtbot, strip):
    """After a preview's decode the background tiles are held (they sleep at a pause point)
    until the window has repainted with the mask; then they go on."""
    img, gt = strip
    viewer = make_napari_viewer()
    w = open_dock(viewer)
    qtbot.waitUntil(lambda: "ready" in w.status.text(), timeout=WAIT)
    w.hold_background_s = 600  # so only the dock's release can end the hold
    at_show = []
    real_show = w._show_mask

    def show(*args, **kw):
        tiles = w._embed_job
        for _ in range(6000):  # the worker holds the tiles (or fails the test)
            if ("held", tiles.id) in [(ev, i) for ev, i, _t in list(w.worker.log)]:
                break
            threading.Event().wait(0.01)
        at_show.append((tiles, list(w.worker.log), w.worker.holding))
        real_show(*args, **kw)

    w._show_mask = show
    img, gt = img[:, :256], gt[:, :256]  # one grid tile (and its click views) is enough here
    release = hold_worker(w.worker)
    try:
        viewer.add_image(img + 5, name="held")
        qtbot.waitUntil(lambda: w.image_layer is not None and w.image_layer.name == "held",
                        timeout=WAIT)
        ids, boxes = gt_boxes(gt)
        add_box(w, boxes[0])
    finally:
        release.set()
    qtbot.waitUntil(w.has_preview, timeout=WAIT)
    (tiles, log, holding) = at_show[0]  # a box's first look, or its only mask
    events = [ev for ev, i, _t in log if i == tiles.id]
    assert holding and events[-1] == "held" and "unheld" not in events
    qtbot.waitUntil(lambda: tiles.wait(0), timeout=WAIT)  # released after the repaint
    assert tiles.status == DONE and not w.worker.holding
    assert ("unheld", tiles.id) in [(ev, i) for ev, i, _t in w.worker.log]


def test_the_tiles_at_the_canvas_centre_come_first_and_follow_a_pan(make_napari_viewer, qtbot, strip):
    """Before any prompt, the background tiles start where the user looks: the canvas centre
    (after a drop napari shows the whole image: its middle tile), and a pan or zoom moves
    that start to the tile now in the middle."""
    img, _gt = strip
    viewer = make_napari_viewer()
    w = open_dock(viewer)
    qtbot.waitUntil(lambda: "ready" in w.status.text(), timeout=WAIT)
    engine = w.session.engine()
    order = []
    real_embed = engine.embed

    def spy(images, views=None, *a, **kw):
        if views is not None:
            order.extend(v.x0 for v in views[0])
        return real_embed(images, views, *a, **kw)

    engine.embed = spy
    release = hold_worker(w.worker)
    try:
        viewer.add_image(img + 7, name="strip")  # content no test has embedded
        qtbot.waitUntil(lambda: w.image_layer is not None and w.image_layer.name == "strip",
                        timeout=WAIT)
        assert w.session.focus == pytest.approx((img.shape[1] / 2 - 0.5, img.shape[0] / 2 - 0.5), abs=3)
        viewer.camera.zoom *= 4
        viewer.camera.center = (128, 600)  # (y, x): the right end of the strip
        assert w.session.focus == pytest.approx((600, 128), abs=1)
    finally:
        release.set()
    qtbot.waitUntil(lambda: len(order) >= 2, timeout=WAIT)
    w.cancel()
    grid = sorted({v.x0 for v in engine.views(engine.prepare(img + 7))})
    assert order[0] == grid[-1] and order[1] == grid[-2], (order, grid)
    # a prompt moves the start to itself, and a later pan leaves it there
    w.pos_layer.data = np.array([[100.0, 20.0]])
    assert w.session.focus == pytest.approx((20, 100))
    viewer.camera.center = (128, 300)
    assert w.session.focus == pytest.approx((20, 100))


def test_a_box_in_the_tile_being_embedded_waits_for_it_instead_of_embedding_it_again(
        make_napari_viewer, qtbot, strip):
    img, gt = strip
    img = img + 11  # content no test has embedded
    viewer = make_napari_viewer()
    w = open_dock(viewer)
    qtbot.waitUntil(lambda: "ready" in w.status.text(), timeout=WAIT)
    engine = w.session.engine()
    embedded = []
    real_embed = engine.embed

    def spy(images, views=None, *a, **kw):
        if views is not None:
            embedded.extend((v.x0, v.y0, v.w) for v in views[0])
        return real_embed(images, views, *a, **kw)

    engine.embed = spy
    # the first tile's encoder pass stops half-way until the box is queued
    midway, go_on = threading.Event(), threading.Event()
    hook = engine.sam.image_encoder.layers[1].register_forward_pre_hook(
        lambda *_a: None if midway.is_set() else (midway.set(), go_on.wait(60)) and None)
    try:
        viewer.add_image(img, name="strip")
        qtbot.waitUntil(midway.is_set, timeout=WAIT)  # the middle tile (the canvas centre) comes first
        ids, boxes = gt_boxes(gt)
        k = next(i for i, b in enumerate(boxes) if 260 < b[0] and b[2] < 380)
        add_box(w, boxes[k])
        assert w.session.decode_job is not None and w.session.decode_job.status == "pending"  # queued, waiting
    finally:
        go_on.set()
        hook.remove()
    qtbot.waitUntil(w.has_preview, timeout=WAIT)
    result = w.session.result
    view = (result.view.x0, result.view.y0, result.view.w)
    assert embedded[0] == view  # the tile in progress was the box's
    assert embedded.count(view) == 1, embedded  # embedded once: the box waited for it
    assert iou(result.full(gt.shape), gt == ids[k]) > 0.6
    w.cancel()
