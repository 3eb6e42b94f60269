"""Adapt SAM dock on a real viewer: labels -> fine-tuned decoder beside the image -> annotator uses it."""
import numpy as np
import pytest
import tifffile

from napari_gpuseg.models.registry import DEFAULT_MODEL
from napari_gpuseg.widgets import sam_adapt
from napari_gpuseg.widgets.sam_adapt import SamAdaptWidget

from sam_fixtures import require_lite_medsam

WAIT = 240_000


@pytest.fixture
def field(shared_data, tmp_path):
    require_lite_medsam()
    img = tifffile.imread(shared_data / "dsb2018" / "image.tif")[:200, :256]
    gt = tifffile.imread(shared_data / "dsb2018" / "mask.tif")[:200, :256]
    src = tmp_path / "dsb.tif"
    tifffile.imwrite(src, img)
    return src, img, gt


def short(minutes, objects):
    """The dock's schedule cut to 3 steps on native views with 2 objects each (the dock's
    flow is tested here; what the schedule learns is ``benchmarks/adapt_sam.py``'s)."""
    cfg = ADAPT(minutes, objects)
    cfg.max_steps, cfg.view_zooms, cfg.objects_per_view, cfg.orientations = 3, (1.0,), 2, 1
    cfg.encoder_lr = 0.0  # the decoder alone: the dock's wiring is tested here (the encoder: test_sam_adapt_engine)
    cfg.first_output = None  # and which candidate first clicks train is measured there too
    return cfg


ADAPT = sam_adapt.adapt_config


@pytest.mark.usefixtures("reuse_embeddings")
@pytest.mark.slow
def test_adapt_sam_saves_beside_the_image_and_the_annotator_switches(make_napari_viewer, qtbot, field,
                                                                      monkeypatch):
    monkeypatch.setattr(sam_adapt, "adapt_config", short)
    src, img, gt = field
    viewer = make_napari_viewer()
    layer = viewer.open(str(src), plugin="napari")[0]
    viewer.add_labels(np.where(np.arange(img.shape[1])[None] < 128, gt, 0).astype(np.int32), name="committed")
    _d, annotator = viewer.window.add_plugin_dock_widget("napari-gpuseg", "SAM annotator")
    _d, dock = viewer.window.add_plugin_dock_widget("napari-gpuseg", "Adapt SAM")
    assert isinstance(dock, SamAdaptWidget)
    dock.image_combo.setCurrentText(layer.name)
    dock.labels_combo.setCurrentText("committed")
    assert dock.model_combo.currentText() == DEFAULT_MODEL
    assert dock.train() is not None
    qtbot.waitUntil(lambda: dock.result is not None, timeout=WAIT)
    path = str(src.with_name("dsb_sam_adapted.pt"))
    assert dock.model_path == path and dock.result["steps"] == 3
    # the first-click candidate, measured on the committed objects, travels with the file
    from napari_gpuseg.models.sam.decoder_checkpoint import read_decoder

    choice = read_decoder(path)["click_choice"]
    assert choice["objects"] == len(np.unique(gt[:, :128][gt[:, :128] > 0])) and "head" in choice["one_click_iou"]
    assert len(dock.plot.series["train loss"]) == 3
    assert annotator.model_name == path and "Click" in annotator.hint_label.text()
    assert "annotator uses it" in dock.status.text()


def test_adapt_sam_refuses_empty_labels_and_cancels(make_napari_viewer, qtbot, field):
    src, img, gt = field
    viewer = make_napari_viewer()
    layer = viewer.add_image(img, name="img")
    viewer.add_labels(np.zeros(img.shape, np.int32), name="empty")
    _d, dock = viewer.window.add_plugin_dock_widget("napari-gpuseg", "Adapt SAM")
    dock.image_combo.setCurrentText(layer.name)
    dock.labels_combo.setCurrentText("empty")
    assert dock.train() is None and "no objects" in dock.status.text()
    viewer.layers["empty"].data = gt.astype(np.int32)
    job = dock.train()
    assert job is not None
    dock.cancel()
    qtbot.waitUntil(lambda: dock._run_button.isEnabled(), timeout=WAIT)
    assert dock.result is None and ("Cancelled" in dock.status.text() or "Saved" in dock.status.text())
