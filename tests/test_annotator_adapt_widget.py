"""'Adapt to these objects' in the SAM annotator dock on a real viewer: the button waits for
three committed cells (its tooltip says why); Cancel while it trains leaves the model as it
was and saves nothing; a click trains in the background with a live loss (a 2-step schedule
here), the dock switches to the adapted decoder and lists it, a new dock lists it too."""
import numpy as np
import pytest
import tifffile
from qtpy.QtCore import Qt

from napari_gpuseg.models.registry import DEFAULT_MODEL
from napari_gpuseg.engine.sam.training import adapt as sam_adapt
from napari_gpuseg.engine.sam.training.adapt import adapted_models
from napari_gpuseg.widgets._choices import adapted_sam_choices

from sam_fixtures import require_lite_medsam

WAIT = 240_000  # ms; the CPU encoder and training are slow on a busy 2-core machine


@pytest.fixture
def frame(shared_data, tmp_path, monkeypatch):
    """The left third of t00 of the scratch assay's cells (a training frame), its cell masks; the adapted
    decoders go to a temporary cache folder; the few-object schedule is cut to ``steps``."""
    require_lite_medsam()
    monkeypatch.setenv("NAPARI_GPUSEG_CACHE", str(tmp_path / "cache"))
    real = sam_adapt.few_object_config
    steps = {"n": 2}

    def short(n_objects, minutes=4.0):
        cfg = real(n_objects, minutes)
        cfg.max_steps, cfg.max_time, cfg.view_zooms, cfg.orientations = steps["n"], None, (1.0,), 1
        # the decoder alone: the dock's wiring is tested here (the encoder's last stage learning,
        # and the session switching to it: test_annotator_adapt_engine)
        cfg.encoder_lr = 0.0
        cfg.first_output = None  # which candidate first clicks train is measured in test_sam_adapt_engine
        return cfg

    monkeypatch.setattr(sam_adapt, "few_object_config", short)
    d = shared_data / "scratch_assay" / "cells"
    cut = np.s_[:, :192]  # the left third: 5 tiles to embed instead of 15
    return tifffile.imread(d / "images" / "t00.tif")[cut], tifffile.imread(d / "masks" / "t00.tif")[cut], steps


def cell_boxes(gt: np.ndarray, n: int) -> list:
    """Boxes (x0, y0, x1, y1; 3 px margin) of the ``n`` largest cells not cut by the border."""
    h, w = gt.shape
    out = []
    for i in np.unique(gt)[1:]:
        ys, xs = np.nonzero(gt == i)
        if ys.min() > 3 and xs.min() > 3 and ys.max() < h - 4 and xs.max() < w - 4:
            out.append((-len(ys), [xs.min() - 3, ys.min() - 3, xs.max() + 3, ys.max() + 3]))
    return [b for _n, b in sorted(out)[:n]]


def commit_box(qtbot, w, box):
    x0, y0, x1, y1 = box
    w.box_layer.add_rectangles(np.array([[y0, x0], [y0, x1], [y1, x1], [y1, x0]], float))
    qtbot.waitUntil(w.has_preview, timeout=WAIT)
    assert w.commit()


def open_annotator(make_napari_viewer, qtbot, monkeypatch, img):
    """The dock following a t00 cut, without embedding the image's tiles in the background
    (the adapt wiring is tested here: each box embeds its own view first)."""
    viewer = make_napari_viewer()
    dock, w = viewer.window.add_plugin_dock_widget("napari-gpuseg", "SAM annotator")
    monkeypatch.setattr(w, "_embed_current", lambda: False)
    viewer.add_image(img, name="t00")
    qtbot.waitUntil(lambda: w.box_layer is not None, timeout=WAIT)
    return viewer, w, dock


@pytest.mark.usefixtures("reuse_embeddings")
@pytest.mark.slow
def test_cancel_then_adapt_to_these_objects(make_napari_viewer, qtbot, monkeypatch, frame):
    img, gt, steps = frame
    viewer, w, dock = open_annotator(make_napari_viewer, qtbot, monkeypatch, img)
    panel = w.adapt_panel
    assert w.model_name == DEFAULT_MODEL and not panel.adapt_btn.isEnabled()
    assert "at least 3 objects" in panel.adapt_btn.toolTip()
    boxes = cell_boxes(gt, 4)
    for box in boxes[:2]:
        commit_box(qtbot, w, box)
    assert not panel.adapt_btn.isEnabled() and "(2 committed)" in panel.adapt_btn.toolTip()
    commit_box(qtbot, w, boxes[2])
    assert panel.adapt_btn.isEnabled() and "Train SAM's decoder" in panel.adapt_btn.toolTip()

    # Cancel while it trains: the model stays as it was, nothing is saved
    steps["n"] = 500
    losses, shown, on_event = [], [], panel._on_event

    def cancel_at_first_step(ev):
        on_event(ev)
        losses.append(ev.loss)
        shown.append(w.status.text())
        if len(losses) == 1:
            qtbot.mouseClick(panel.cancel_btn, Qt.MouseButton.LeftButton)

    panel._on_event = cancel_at_first_step
    qtbot.mouseClick(panel.adapt_btn, Qt.MouseButton.LeftButton)
    assert panel.running and panel.cancel_btn.isEnabled() and not panel.adapt_btn.isEnabled()
    qtbot.waitUntil(lambda: not panel.running, timeout=WAIT)
    assert losses and panel.result is None
    assert shown[0].startswith("adapting: step 1 of 500, loss ")  # the schedule's steps, live
    assert "adapting cancelled: the model is unchanged, nothing was saved" in w.status.text()
    assert w.model_name == DEFAULT_MODEL and w.session.model == DEFAULT_MODEL and adapted_models() == []
    assert panel.adapt_btn.isEnabled() and not panel.cancel_btn.isEnabled()

    # Adapt (2 steps): the dock switches to the adapted decoder and lists it
    steps["n"] = 2
    panel._on_event = on_event
    qtbot.mouseClick(panel.adapt_btn, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: panel.result is not None, timeout=WAIT)
    path = panel.result.path
    assert panel.result.objects == 3 and panel.result.steps == 2
    assert len(panel.plot.series["train loss"]) == 2 and not panel.plot.isHidden()
    assert w.model_name == path and w.session.model == path
    assert w.model_combo.currentText() == "t00_adapted (from t00)"
    assert "adapted to 3 objects" in w.status.text() and "annotating with t00_adapted" in w.status.text()
    assert not panel.running and panel.adapt_btn.isEnabled()
    assert [m["path"] for m in adapted_models()] == [path]
    # the status line still says so when the image's embedding for the adapted decoder is ready
    w._on_embedded(w.session.key(), 0.5)
    assert "annotating with t00_adapted" in w.status.text()
    w._on_embedded(w.session.key(), 0.5)  # the next one is the embedding's own message
    assert "embedding ready" in w.status.text()
    commit_box(qtbot, w, boxes[3])  # annotating goes on with the adapted decoder
    engine = w.worker.cached_model(("sam", path, w.worker.policy))
    assert engine is not None and engine.info.decoder_tuned
    # next time: a new annotator lists it (its name and the image it came from)
    assert adapted_sam_choices() == [("t00_adapted (from t00)", path)]
    from napari_gpuseg.widgets.sam_annotator import SamAnnotatorWidget

    other = SamAnnotatorWidget(make_napari_viewer(), worker=w.worker)
    i = other.model_combo.findData(path)
    assert i > 0 and other.model_combo.itemText(i) == "t00_adapted (from t00)"
    other.model_combo.setCurrentIndex(i)
    assert other.model_name == path
    other.close()

    # the dock closed while it adapts: the run is cancelled, nothing more is saved
    steps["n"] = 500
    seen = []

    def close_at_first_step(ev):
        on_event(ev)
        seen.append(ev.step)
        if len(seen) == 1:
            dock.destroyOnClose()  # the dock's close button: napari keeps the widget

    panel._on_event = close_at_first_step
    qtbot.mouseClick(panel.adapt_btn, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: not panel.running, timeout=WAIT)
    assert seen and w.parent() is None
    assert panel.result.path == path and [m["path"] for m in adapted_models()] == [path]
    assert w.model_name == path
