"""U-Net docks in a real viewer: predict on a real image, train from Image + Labels layers."""
import numpy as np
import pytest
import tifffile
import torch

from napari_gpuseg.widgets.unet_predict import UNetPredictWidget
from napari_gpuseg.widgets.unet_train import UNetTrainWidget


@pytest.fixture
def field(shared_data):
    name = "IXMtest_M04_s3.tif"  # a validation image
    img = tifffile.imread(shared_data / "bbbc039" / "images" / name)
    lab = tifffile.imread(shared_data / "bbbc039" / "masks" / name)
    return img, lab


def test_predict_dock_adds_labels_and_probabilities(make_napari_viewer, qtbot, field):
    viewer = make_napari_viewer()
    img, truth = field
    viewer.add_image(img, name="nuclei")
    _dock, widget = viewer.window.add_plugin_dock_widget("napari-gpuseg", "U-Net predict")
    assert isinstance(widget, UNetPredictWidget)
    assert widget.image_combo.currentText() == "nuclei"
    widget.out_probs.setChecked(True)
    widget.batch.setValue(0)  # Auto
    job = widget.run()
    assert job is not None and not widget.run_button.isEnabled()
    qtbot.waitUntil(lambda: "nuclei U-Net labels" in viewer.layers, timeout=60000)
    labels = viewer.layers["nuclei U-Net labels"].data
    assert labels.shape == img.shape
    from napari_gpuseg.engine.metrics import object_f1

    assert object_f1(truth, labels, 0.5) > 0.85
    assert "nuclei interior prob" in viewer.layers and "nuclei boundary prob" in viewer.layers
    assert widget.run_button.isEnabled() and "objects" in widget.status.text()


def test_predict_dock_and_folder_job_give_the_same_labels_on_colour(make_napari_viewer, qtbot, shared_data,
                                                                   tmp_path):
    """One input conversion: an RGB H&E field in the predict dock (an RGB layer) and in a
    U-Net folder job (the file) gives identical labels."""
    from napari_gpuseg.engine.jobs.pipeline import output_paths, run_folder

    name = "9f17aea854db1301.tif"
    img = tifffile.imread(shared_data / "dsb2018_more" / "images" / name)
    assert img.ndim == 3 and img.shape[-1] == 3
    (tmp_path / "in").mkdir()
    tifffile.imwrite(tmp_path / "in" / name, img)
    report = run_folder(tmp_path / "in", tmp_path / "out", "unet", devices="cpu")
    assert report.ok == 1
    from_job = tifffile.imread(output_paths(tmp_path / "in", tmp_path / "out", tmp_path / "in" / name)[0])
    viewer = make_napari_viewer()
    viewer.add_image(img, name="he", rgb=True)
    _dock, widget = viewer.window.add_plugin_dock_widget("napari-gpuseg", "U-Net predict")
    assert widget.image_combo.currentText() == "he"
    assert widget.run() is not None
    qtbot.waitUntil(lambda: "he U-Net labels" in viewer.layers, timeout=60000)
    from_dock = viewer.layers["he U-Net labels"].data
    assert from_dock.shape == img.shape[:2] and from_job.max() > 10
    np.testing.assert_array_equal(from_dock, from_job)


def test_predict_dock_reports_missing_file(qtbot, make_napari_viewer):
    viewer = make_napari_viewer()
    viewer.add_image(np.zeros((32, 32), np.uint16), name="x")
    widget = UNetPredictWidget(viewer)
    qtbot.addWidget(widget)
    widget.model_combo.setCurrentText("From file…")
    widget.model_path.setText("/nonexistent/model.pt")
    assert widget.run() is None and "not found" in widget.status.text()


def _small(widget, tmp_path, epochs=2, iters=3):
    widget.depth.setValue(2)
    widget.base.setValue(8)
    widget.crop.setValue(64)
    widget.batch.setValue(2)
    widget.epochs.setValue(epochs)
    widget.iters.setValue(iters)
    widget.val_fraction.setValue(0.3)
    widget.out_path.setText(str(tmp_path / "dock.pt"))


def test_train_dock_from_layers_gives_checkpoint_that_predicts(make_napari_viewer, qtbot, field, tmp_path):
    viewer = make_napari_viewer()
    img, lab = field
    viewer.add_image(img[:192, :256], name="img")
    viewer.add_labels(lab[:192, :256], name="annot")
    _dock, widget = viewer.window.add_plugin_dock_widget("napari-gpuseg", "U-Net train")
    assert isinstance(widget, UNetTrainWidget)
    assert widget.image_combo.currentText() == "img" and widget.labels_combo.currentText() == "annot"
    _small(widget, tmp_path)
    assert widget.train() is not None
    qtbot.waitUntil(lambda: widget.result is not None, timeout=60000)
    assert widget.train_button.isEnabled()
    assert len(widget.plot.series["train loss"]) == 6 and len(widget.plot.series["val score"]) == 2
    ckpt = torch.load(tmp_path / "dock.pt", map_location="cpu", weights_only=True)
    assert ckpt["training"]["data"]["source"] == "napari layers"
    from napari_gpuseg.engine.runtime.device import Policy
    from napari_gpuseg.engine.unet.unet_checkpoint import load_unet
    from napari_gpuseg.engine.unet.predict import predict_labels

    model = load_unet(tmp_path / "dock.pt", device="cpu")
    labels = predict_labels(model, img[:128, :128], policy=Policy(torch.device("cpu"), "fp32"))
    assert labels.shape == (128, 128)


def test_train_dock_cancel_and_validation(make_napari_viewer, qtbot, field, tmp_path):
    viewer = make_napari_viewer()
    img, lab = field
    viewer.add_image(img[:128, :128], name="img")
    viewer.add_labels(np.zeros((128, 128), np.int32), name="empty")
    widget = UNetTrainWidget(viewer)
    qtbot.addWidget(widget)
    assert widget.train() is None and "empty" in widget.status.text()
    viewer.layers["empty"].data = lab[:128, :128]
    _small(widget, tmp_path, epochs=100, iters=50)
    widget.train()
    qtbot.waitUntil(lambda: len(widget.events) >= 1, timeout=30000)
    widget.cancel()
    qtbot.waitUntil(lambda: widget.train_button.isEnabled(), timeout=30000)
    assert "Cancelled" in widget.status.text()


def test_loss_plot_is_shared_by_the_train_and_adapt_docks(qtbot):
    """One plot helper: iteration losses always, validation scores only where the dock
    validates (the adapt dock has no validation series)."""
    from napari_gpuseg.engine.unet.training import TrainEvent
    from napari_gpuseg.widgets import unet_adapt, unet_train
    from napari_gpuseg.widgets._loss_plot import LossPlot

    events = [TrainEvent("iter", 0, i, 4, 1.0 / (i + 1)) for i in range(3)]
    events.append(TrainEvent("epoch", 0, 3, 4, 0.3, val_score=0.7))
    with_val, loss_only = LossPlot(validation=True), LossPlot(validation=False, maxlen=1000)
    qtbot.addWidget(with_val)
    qtbot.addWidget(loss_only)
    for ev in events:
        with_val.add_event(ev)
        loss_only.add_event(ev)
    assert list(with_val.series["train loss"]) == list(loss_only.series["train loss"]) == [1.0, 0.5, 1 / 3]
    assert list(with_val.series["val score"]) == [0.7] and "val score" not in loss_only.series
    assert unet_train.LossPlot is unet_adapt.LossPlot is LossPlot
