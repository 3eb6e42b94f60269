"""The preview layer shows exactly the current object's mask, and napari is sent only the
rectangle that changed (``widgets/_preview_paint.py``)."""
import numpy as np
from napari.layers import Labels

from napari_gpuseg.widgets._preview_paint import PreviewPaint


def _disc(shape, cy, cx, r):
    yy, xx = np.ogrid[:shape[0], :shape[1]]
    return (yy - cy) ** 2 + (xx - cx) ** 2 < r * r


def _updates(layer):
    seen = []
    layer.events.labels_update.connect(lambda e: seen.append((tuple(e.offset), e.data.shape[:2])))
    return seen


def test_a_moved_mask_replaces_the_old_one_and_only_the_changed_rectangle_is_sent():
    layer = Labels(np.zeros((300, 400), np.uint8))
    paint, seen = PreviewPaint(), _updates(layer)
    a = _disc((60, 60), 30, 30, 25)
    paint.show(layer, (), a, 100, 200)
    truth = np.zeros((300, 400), bool)
    truth[100:160, 200:260] = a
    assert np.array_equal(layer.data != 0, truth) and set(np.unique(layer.data)) == {0, 1}
    paint.show(layer, (), a, 104, 203)  # the box moved by a few pixels
    truth[:] = False
    truth[104:164, 203:263] = a
    assert np.array_equal(layer.data != 0, truth)
    offset, shape = seen[-1]
    # one update, inside the union of the two masks' rectangles: not the 300 x 400 plane
    assert offset[0] >= 100 and offset[1] >= 200 and offset[0] + shape[0] <= 164 and offset[1] + shape[1] <= 263
    paint.show(layer, (), a, 104, 203)  # the same mask again: nothing to send
    n = len(seen)
    paint.show(layer, (), a, 104, 203)
    assert len(seen) == n
    paint.clear(layer)
    assert not layer.data.any()


def test_masks_cut_by_the_border_and_a_stack_s_planes():
    layer = Labels(np.zeros((3, 50, 60), np.uint8))
    paint = PreviewPaint()
    m = np.ones((20, 20), bool)
    paint.show(layer, (1,), m, 40, 50)  # hangs over the bottom-right border
    assert layer.data[1, 40:, 50:].all() and int(layer.data.sum()) == 10 * 10
    paint.show(layer, (2,), m, -5, -5)  # another plane: the first plane's mask goes
    assert not layer.data[1].any() and layer.data[2, :15, :15].all() and int(layer.data.sum()) == 15 * 15
    paint.clear(layer)
    assert not layer.data.any()


def test_a_layer_painted_by_someone_else_is_cleared_once_before_the_first_mask():
    layer = Labels(np.zeros((40, 40), np.uint8))
    layer.data[0:5, 0:5] = 1  # left by an earlier dock or by hand
    paint = PreviewPaint()
    m = np.ones((4, 4), bool)
    paint.show(layer, (), m, 20, 20)
    assert int(layer.data.sum()) == 16 and layer.data[20:24, 20:24].all()
    other = Labels(np.ones((40, 40), np.uint8))  # the preview layer was made again
    paint.show(other, (), m, 0, 0)
    assert int(other.data.sum()) == 16
