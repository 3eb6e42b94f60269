"""Adapt U-Net dock on a real viewer: annotate -> fine-tune -> predict the rest -> train again."""
import numpy as np
import pytest
import tifffile

from napari_gpuseg.widgets.unet_adapt import CURRENT, RECTANGLE, WHOLE, UNetAdaptWidget
from napari_gpuseg.widgets._unet_jobs import FROM_FILE


@pytest.fixture
def field(shared_data, tmp_path):
    img = tifffile.imread(shared_data / "dsb2018" / "image.tif")[:128, :160]
    gt = tifffile.imread(shared_data / "dsb2018" / "mask.tif")[:128, :160]
    src = tmp_path / "dsb.tif"
    tifffile.imwrite(src, img)
    return src, img, gt


def test_adapt_loop_through_the_docks(make_napari_viewer, qtbot, field):
    src, img, gt = field
    viewer = make_napari_viewer()
    layer = viewer.open(str(src), plugin="napari")[0]
    viewer.add_labels(np.where(np.arange(160)[None] < 80, gt, 0), name="annotated")
    viewer.add_shapes([np.array([[0, 0], [127, 79]])], shape_type="rectangle", name="region")
    _d, predict_dock = viewer.window.add_plugin_dock_widget("napari-gpuseg", "U-Net predict")
    _d, batch_dock = viewer.window.add_plugin_dock_widget("napari-gpuseg", "Batch folder")
    batch_dock.method.setCurrentText("unet")
    _d, dock = viewer.window.add_plugin_dock_widget("napari-gpuseg", "Adapt U-Net")
    assert isinstance(dock, UNetAdaptWidget)
    dock.image_combo.setCurrentText(layer.name)
    dock.labels_combo.setCurrentText("annotated")
    dock.region.setCurrentText(RECTANGLE)
    dock.shapes_combo.setCurrentText("region")
    dock.iters.setValue(3)
    assert dock.train() is not None
    qtbot.waitUntil(lambda: dock.result is not None, timeout=180000)
    first = dock.model_path
    assert first == str(src.with_name("dsb_unet_adapted.pt"))  # beside the image
    assert len(dock.plot.series["train loss"]) == 3 and np.isfinite(dock.losses).all()
    assert predict_dock.model_combo.currentText() == FROM_FILE and predict_dock.model_path.text() == first
    assert batch_dock.model.text() == first
    # predict the rest -> a labels layer to correct, selected for the next round
    assert dock.predict() is not None
    name = f"{layer.name} adapted labels"
    qtbot.waitUntil(lambda: name in viewer.layers, timeout=120000)
    assert viewer.layers[name].data.shape == img.shape and viewer.layers[name].data.max() > 0
    assert dock.labels_combo.currentText() == name
    # train again on the corrected prediction (whole image), from the adapted model
    viewer.layers[name].data[:, 80:] = np.where(gt[:, 80:] > 0, gt[:, 80:] + 1000, 0)  # "corrections"
    dock.region.setCurrentText(WHOLE)
    assert dock.start.currentText() == CURRENT
    dock.result = None
    assert dock.train() is not None
    qtbot.waitUntil(lambda: dock.result is not None, timeout=180000)
    assert dock.model_path == str(src.with_name("dsb_unet_adapted_2.pt"))
    assert predict_dock.model_path.text() == dock.model_path


def test_adapt_dock_cancel_and_bad_region(make_napari_viewer, qtbot, field):
    _src, img, gt = field
    viewer = make_napari_viewer()
    viewer.add_image(img, name="img")
    viewer.add_labels(np.zeros_like(gt), name="empty")
    dock = UNetAdaptWidget(viewer)
    qtbot.addWidget(dock)
    dock.labels_combo.setCurrentText("empty")
    assert dock.train() is None and "no objects" in dock.status.text()
    dock.region.setCurrentText(RECTANGLE)
    assert dock.train() is None and "Shapes layer" in dock.status.text()
    viewer.add_labels(gt, name="gt")
    dock.labels_combo.setCurrentText("gt")
    dock.region.setCurrentText(WHOLE)
    dock.iters.setValue(10000)
    dock.train()
    qtbot.waitUntil(lambda: len(dock.losses) > 0, timeout=180000)
    dock.cancel()
    qtbot.waitUntil(lambda: dock.train_button.isEnabled(), timeout=60000)
    assert "Cancelled" in dock.status.text() and dock.model_path is None


def test_a_failed_adapt_job_is_reported_like_every_dock(make_napari_viewer, caplog, monkeypatch):
    """Adapt U-Net is built on the docks' base: a failure goes to the status line, a napari
    notification and the log, and the buttons come back."""
    from napari_gpuseg.widgets import _dock

    shown = []
    monkeypatch.setattr(_dock, "notify_error", shown.append)
    viewer = make_napari_viewer()
    _d, dock = viewer.window.add_plugin_dock_widget("napari-gpuseg", "Adapt U-Net")
    dock._busy(True)
    assert not dock.train_button.isEnabled() and dock.cancel_button.isEnabled()
    with caplog.at_level("ERROR", logger="napari_gpuseg.widgets"):
        dock._failed(MemoryError("no room for the batch"))
    assert dock.status.text() == "Adapt U-Net: MemoryError: no room for the batch" == shown[-1]
    assert "no room for the batch" in caplog.text
    assert dock.train_button.isEnabled() and not dock.cancel_button.isEnabled()


def test_a_rectangle_drawn_over_a_scaled_image_means_the_pixels_it_covers():
    """A Shapes layer made by hand has scale 1 and no offset; over an image with a pixel size
    of 0.5 and an offset, its rectangle is converted into the image's pixels."""
    from napari.layers import Image, Shapes

    from napari_gpuseg.widgets.unet_adapt import rectangle_of

    image = Image(np.zeros((200, 300), np.uint8), scale=(0.5, 0.5), translate=(30.0, 40.0))
    world = np.array([[30 + 0.5 * 20, 40 + 0.5 * 50], [30 + 0.5 * 120, 40 + 0.5 * 250]])  # pixels (20, 50)-(120, 250)
    shapes = Shapes([world], shape_type="rectangle")
    assert rectangle_of(shapes) == pytest.approx((40.0, 65.0, 90.0, 165.0))  # its own coordinates
    assert rectangle_of(shapes, image=image) == pytest.approx((20.0, 50.0, 120.0, 250.0))
    same = Shapes([np.array([[20.0, 50.0], [120.0, 250.0]])], shape_type="rectangle", scale=(0.5, 0.5),
                  translate=(30.0, 40.0))
    assert rectangle_of(same, image=image) == pytest.approx((20.0, 50.0, 120.0, 250.0))
