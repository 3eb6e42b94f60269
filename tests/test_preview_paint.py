"""The SAM preview on a real viewer: a new mask reaches the layer's data and the screen, and
only the part of the plane that changed is coloured and uploaded again (napari's partial
labels refresh), for a 2D image and a stack's plane."""
import numpy as np

from napari_gpuseg.widgets._annotation_layers import paint_preview


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
