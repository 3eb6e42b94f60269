"""What the SAM annotator does on the window's side, on a real viewer: the preview shows a
new mask in the layer's data and on screen, colouring and uploading again only the part of
the plane that changed (napari's partial labels refresh), for a 2D image and a stack's plane;
a drag on a prompt layer keeps background embedding parked from the press to the release."""
from types import SimpleNamespace

import numpy as np

from napari_gpuseg.widgets._annotation_layers import PAINTED, paint_preview


def _disk(shape, cy, cx, r):
    yy, xx = np.ogrid[:shape[0], :shape[1]]
    return (yy - cy) ** 2 + (xx - cx) ** 2 <= r * r


def _updates(layer):
    seen = []
    layer.events.labels_update.connect(lambda ev: seen.append((tuple(ev.offset), ev.data.shape[:2])))
    return seen


def test_a_moved_mask_repaints_only_the_pixels_that_changed(make_napari_viewer):
    viewer = make_napari_viewer()
    shape = (520, 696)
    viewer.add_image(np.zeros(shape, np.uint8))
    preview = viewer.add_labels(np.zeros(shape, np.uint8), name="SAM preview")
    seen = _updates(preview)

    first = _disk(shape, 100, 200, 20)
    paint_preview(preview, (), first)
    np.testing.assert_array_equal(preview.data, first)
    assert seen[-1] == ((80, 180), (41, 41))  # the disk's bounding box, not the field
    # what the canvas shows is what the data says (the texture's colours follow the data)
    view = preview._slice.image.view
    assert (view[first] != view[0, 0]).all() and (view[~first] == view[0, 0]).all()

    moved = _disk(shape, 104, 200, 20)  # the box dragged 4 px down
    paint_preview(preview, (), moved)
    np.testing.assert_array_equal(preview.data, moved)
    (y0, x0), (h, w) = seen[-1]
    assert y0 >= 80 and y0 + h <= 125 and h * w < 50 * 50  # the two crescents that changed

    n = len(seen)
    paint_preview(preview, (), moved)  # nothing changed: nothing is uploaded
    assert len(seen) == n
    paint_preview(preview, (), None)  # cleared
    assert not preview.data.any() and seen[-1][0] == (84, 180)


def test_a_stack_plane_is_painted_and_the_other_planes_are_cleared(make_napari_viewer):
    viewer = make_napari_viewer()
    shape = (3, 64, 80)
    viewer.add_image(np.zeros(shape, np.uint8))
    preview = viewer.add_labels(np.zeros(shape, np.uint8), name="SAM preview")
    viewer.dims.set_current_step(0, 1)
    paint_preview(preview, (0,), _disk(shape[1:], 30, 30, 5))  # an earlier plane's preview
    viewer.dims.set_current_step(0, 2)
    mask = _disk(shape[1:], 20, 40, 6)
    seen = _updates(preview)
    paint_preview(preview, (2,), mask)
    assert not preview.data[:2].any()
    np.testing.assert_array_equal(preview.data[2], mask)
    assert seen and seen[-1][0] == (14, 34)
    paint_preview(preview, (1,), None)  # cleared from another plane (the user moved): all of it
    assert not preview.data.any()
    paint_preview(preview, (2,), np.ones((5, 5), bool))  # a mask of another shape (stale): ignored
    assert not preview.data.any()


def test_moving_through_a_stack_clears_only_the_plane_painted_before(make_napari_viewer):
    viewer = make_napari_viewer()
    shape = (6, 64, 80)
    preview = viewer.add_labels(np.zeros(shape, np.uint8), name="SAM preview")
    preview.data[4, :3, :3] = 1  # on a plane the preview never painted (made before it kept a record)
    paint_preview(preview, (1,), _disk(shape[1:], 30, 30, 5))
    assert not preview.data[4].any()  # no record yet: every other plane cleared once
    assert preview.metadata[PAINTED] == (1,)
    preview.data[5, :3, :3] = 7  # not the preview's: planes it did not paint are not read again
    mask = _disk(shape[1:], 20, 40, 6)
    paint_preview(preview, (3,), mask)
    assert not preview.data[1].any()
    np.testing.assert_array_equal(preview.data[3], mask)
    assert preview.metadata[PAINTED] == (3,) and preview.data[5, 0, 0] == 7
    preview.metadata[PAINTED] = (9,)  # a record that does not fit the layer (its data replaced)
    paint_preview(preview, (0,), None)
    assert not preview.data.any() and preview.metadata[PAINTED] == (0,)


def test_a_plane_index_the_layer_does_not_have_paints_the_layer_whole(make_napari_viewer):
    viewer = make_napari_viewer()
    preview = viewer.add_labels(np.zeros((40, 50), np.uint8), name="SAM preview")
    mask = _disk((40, 50), 20, 25, 5)
    paint_preview(preview, (3,), mask)  # the session already on a stack, the layer not yet
    np.testing.assert_array_equal(preview.data, mask)


def test_a_drag_on_a_prompt_layer_parks_the_tiles_from_press_to_release(make_napari_viewer, qtbot, monkeypatch):
    viewer = make_napari_viewer()
    dock, w = viewer.window.add_plugin_dock_widget("napari-gpuseg", "SAM annotator")
    monkeypatch.setattr(w, "_embed_current", lambda: False)  # no tiles: the wiring is tested here
    viewer.add_image(np.zeros((64, 80), np.uint8), name="img")
    qtbot.waitUntil(lambda: w.box_layer is not None, timeout=60_000)
    layers = [w.pos_layer, w.neg_layer, w.box_layer]
    assert all(ly.mouse_drag_callbacks[0] is w._drag_hold for ly in layers)  # before napari's tools
    holds = []
    monkeypatch.setattr(w.session, "hold_background", holds.append)
    w.box_layer.mode = "select"
    event = SimpleNamespace(type="mouse_press")
    drag = w._drag_hold(w.box_layer, event)
    next(drag)  # the press
    for _ in range(3):  # each move extends the hold
        event.type = "mouse_move"
        next(drag)
    event.type = "mouse_release"
    assert next(drag, "ended") == "ended"
    assert holds == [w.hold_background_s] * 4
    w.hold_while_dragging = False
    assert next(w._drag_hold(w.box_layer, SimpleNamespace(type="mouse_press")), None) is None and len(holds) == 4
    w.hold_while_dragging = True
    w.box_layer.mode = "pan_zoom"  # panning the canvas is not an edit
    assert list(w._drag_hold(w.box_layer, SimpleNamespace(type="mouse_press"))) == [] and len(holds) == 4
    # a closed dock takes its callback off the layers, which stay
    viewer.window.remove_dock_widget(dock)
    w.close()
    assert all(w._drag_hold not in ly.mouse_drag_callbacks for ly in layers if ly in viewer.layers)
