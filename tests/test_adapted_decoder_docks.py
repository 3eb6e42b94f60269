"""A decoder adapted with the annotator's "Adapt to these objects" in the other SAM docks, on
a real viewer: SAM automatic and Adapt SAM list it as the annotator does ("name (from
image)", newest first), choosing it makes segment everything load it and Adapt SAM start from
it; a dock opened before the adapting gets it too; the annotator's unsure hint, with an
adapted decoder, offers a box or corrective clicks, not adapting again; and *Forget* deletes
it and takes it off every list."""
import functools
from pathlib import Path

import numpy as np
import pytest
import tifffile
import torch
from qtpy.QtCore import Qt

from napari_gpuseg.engine.sam.training import adapt as sam_adapt
from napari_gpuseg.models import registry
from napari_gpuseg.models.registry import DEFAULT_MODEL
from napari_gpuseg.models.sam.decoder_checkpoint import read_decoder
from napari_gpuseg.widgets import sam_adapt as adapt_dock
from napari_gpuseg.widgets import sam_automatic
from napari_gpuseg.widgets._choices import BROWSE, adapted_sam_choices

from sam_fixtures import adapted_decoder, decoder_matches

WAIT = 240_000  # ms; the CPU encoder and training are slow on a busy 2-core machine


@pytest.fixture(scope="module")
def made(shared_data, tmp_path_factory):
    """A cache folder whose adapted-decoder list holds one real adapted decoder: (cache, path, label)."""
    cache, path, label = adapted_decoder(shared_data, tmp_path_factory)
    base = read_decoder(registry.cached_path(DEFAULT_MODEL))["state"]
    mine = read_decoder(path)["state"]
    assert any(not torch.equal(base[k], mine[k]) for k in base)  # it is not the base's decoder
    return cache, path, label


@pytest.fixture
def adapted(made, monkeypatch):
    """(path, label) of the adapted decoder, its list being the user's (``NAPARI_GPUSEG_CACHE``)."""
    cache, path, label = made
    monkeypatch.setenv("NAPARI_GPUSEG_CACHE", str(cache))
    assert adapted_sam_choices() == [(label, path)]
    return path, label


@pytest.fixture(scope="module")
def cells(shared_data):
    d = shared_data / "scratch_assay" / "cells"
    cut = np.s_[114:, 384:480]  # 9 cells of a training frame, away from the part adapted on
    return tifffile.imread(d / "images" / "t00.tif")[cut], tifffile.imread(d / "masks" / "t00.tif")[cut]


def dock(viewer, name):
    return viewer.window.add_plugin_dock_widget("napari-gpuseg", name)[1]


@pytest.mark.slow
def test_segment_everything_lists_the_adapted_decoder_and_runs_with_it(make_napari_viewer, qtbot, adapted,
                                                                       cells, monkeypatch):
    path, label = adapted
    loaded = []
    real = sam_automatic.load_engine
    monkeypatch.setattr(sam_automatic, "load_engine", lambda model, policy: loaded.append(model) or real(model, policy))
    viewer = make_napari_viewer()
    viewer.add_image(cells[0], name="cells")
    w = dock(viewer, "SAM automatic")
    combo = w.model_combo
    i = combo.findData(path)
    # as the annotator lists it: after the known models, before Browse
    assert i == combo.count() - 2 and combo.itemText(i) == label and combo.itemText(i + 1) == BROWSE
    assert w.model_name == DEFAULT_MODEL
    combo.setCurrentIndex(i)
    combo.activated.emit(i)
    assert w.model_name == path
    w.mode_combo.setCurrentIndex(1)
    assert "measured for this microscopy decoder" in w.hint_label.text()  # a decoder tuned to clicks
    w.param_widgets["points_per_side"].setValue(4)
    w.run()
    qtbot.waitUntil(lambda: w.run_button.isEnabled(), timeout=WAIT)
    assert "objects" in w.status.text(), w.status.text()
    assert loaded == [path]
    engine = w.worker.cached_model(("sam", path, w.worker.policy))
    assert engine is not None and decoder_matches(engine, path)  # the adapted decoder segmented
    assert w.last_result[1][0].n_prompts == 16


@pytest.mark.usefixtures("reuse_embeddings")
@pytest.mark.slow
def test_adapt_sam_starts_from_the_adapted_decoder(make_napari_viewer, qtbot, adapted, cells, tmp_path,
                                                   monkeypatch):
    from napari_gpuseg.engine.sam.training import finetune

    path, label = adapted
    started = []
    real_engine = finetune._engine

    def engine_of(model, policy, cache_dir):
        engine = real_engine(model, policy, cache_dir)
        started.append((model, decoder_matches(engine, path)))  # before any step changed it
        return engine

    monkeypatch.setattr(finetune, "_engine", engine_of)

    def short(minutes, objects):
        cfg = real_config(minutes, objects)
        cfg.max_steps, cfg.view_zooms, cfg.objects_per_view, cfg.orientations = 1, (1.0,), 2, 1
        cfg.first_output = None  # which candidate first clicks train: measured in test_sam_adapt_engine
        return cfg

    real_config = adapt_dock.adapt_config
    monkeypatch.setattr(adapt_dock, "adapt_config", short)
    img, gt = cells
    src = tmp_path / "cells.tif"
    tifffile.imwrite(src, img)
    viewer = make_napari_viewer()
    layer = viewer.open(str(src), plugin="napari")[0]
    viewer.add_labels(gt.astype(np.int32), name="committed")
    w = dock(viewer, "Adapt SAM")
    w.image_combo.setCurrentText(layer.name)
    w.labels_combo.setCurrentText("committed")
    i = w.model_combo.findData(path)
    assert i == w.model_combo.count() - 1 and w.model_combo.itemText(i) == label  # no Browse in this dock
    w.model_combo.setCurrentIndex(i)
    assert w.model_name == path
    assert w.train() is not None, w.status.text()
    qtbot.waitUntil(lambda: w.result is not None, timeout=WAIT)
    assert started == [(path, True)]
    out = w.result["path"]
    assert out == str(tmp_path / "cells_sam_adapted.pt") and w.result["steps"] == 1
    assert read_decoder(out)["training"]["adapted"] == {"image": str(src), "objects": len(np.unique(gt)) - 1}
    assert sam_adapt.is_adapted(out)  # the annotator will not offer adapting it again


def test_docks_opened_before_adapting_list_the_new_decoder(make_napari_viewer, qtbot, made, tmp_path, monkeypatch):
    """The annotator switching to a decoder it has just adapted hands it to the SAM automatic
    and Adapt SAM docks already open (newest first among the adapted ones), which keep their choice."""
    _cache, path, label = made
    monkeypatch.setenv("NAPARI_GPUSEG_CACHE", str(tmp_path / "empty"))
    viewer = make_napari_viewer()
    auto, adapt = dock(viewer, "SAM automatic"), dock(viewer, "Adapt SAM")
    annotator = dock(viewer, "SAM annotator")
    assert auto.model_combo.findData(path) < 0 and adapt.model_combo.findData(path) < 0
    older = str(tmp_path / "older.pt")
    for w in (auto, adapt, annotator):  # an adapted decoder listed already (before Browse, where there is one)
        browse = w.model_combo.findText(BROWSE)
        w.model_combo.insertItem(browse if browse >= 0 else w.model_combo.count(), "older_adapted (from a.tif)", older)
    annotator.use_adapted(path, label, "annotating with t00_adapted")
    assert annotator.model_name == path
    for w in (auto, adapt):
        i = w.model_combo.findData(path)
        assert w.model_combo.itemText(i) == label and w.model_combo.itemData(i + 1) == older
        assert w.model_name == DEFAULT_MODEL


@pytest.mark.usefixtures("reuse_embeddings")
def test_the_status_line_offers_a_box_or_clicks_with_an_adapted_decoder(make_napari_viewer, qtbot, adapted,
                                                                       cells, monkeypatch):
    """Every first mask rated unsure here (a threshold above any predicted IoU): with the
    default model the status line offers adapting; with the adapted decoder, a box or
    corrective clicks; the predicted IoU it shows is at most 1."""
    path, label = adapted
    monkeypatch.setattr(sam_adapt, "unsure_hint", functools.partial(sam_adapt.unsure_hint, threshold=1.01))
    img, gt = cells
    viewer = make_napari_viewer()
    w = dock(viewer, "SAM annotator")
    monkeypatch.setattr(w, "_embed_current", lambda: False)
    viewer.add_image(img, name="cells")
    qtbot.waitUntil(lambda: w.pos_layer is not None, timeout=WAIT)
    ids, counts = np.unique(gt[gt > 0], return_counts=True)
    ys, xs = np.nonzero(gt == ids[counts.argmax()])

    def first_click():
        w.clear_prompts()
        w.pos_layer.add([[ys[len(ys) // 2], xs[len(xs) // 2]]])
        qtbot.waitUntil(lambda: w.has_preview() and w.status.text().startswith("preview"), timeout=WAIT)
        return w.status.text()

    text = first_click()
    assert "unsure (predicted IoU" in text and "adapt SAM to these objects" in text, text
    w.model_combo.setCurrentIndex(w.model_combo.findData(path))
    w._on_model_chosen(w.model_combo.currentIndex())
    assert w.session.model == path and w.session.adapted
    text = first_click()
    assert "unsure (predicted IoU" in text and "correct the mask with clicks" in text, text
    assert "adapt" not in text.lower(), text
    shown = float(text.split("predicted IoU ")[1][:4])
    assert 0.0 <= shown <= 1.0


def test_forget_deletes_the_adapted_decoder_in_use_and_every_list_lets_go_of_it(make_napari_viewer, qtbot, made,
                                                                                tmp_path, monkeypatch):
    """*Forget* in the annotator's Adapt panel: only for an adapted decoder of the user's list,
    asked first (No keeps it); Yes puts the annotator on the default model, deletes the file,
    and takes it off every open model list, a dock that had it chosen going to the default."""
    import json
    import shutil

    from qtpy.QtWidgets import QMessageBox

    from napari_gpuseg.engine.sam.training.adapt import adapted_models

    _cache, made_path, label = made
    folder = tmp_path / "cache" / "adapted_sam"
    folder.mkdir(parents=True)
    path = str(folder / "t00_adapted.pt")
    shutil.copy(made_path, path)  # the run's shared decoder stays as it is
    entry = {"name": "t00_adapted", "path": path, "image": "/data/scratch/t00.tif", "base": DEFAULT_MODEL,
             "objects": 4, "created": "2026-11-30T10:00:00"}
    (folder / "index.json").write_text(json.dumps([entry]))
    monkeypatch.setenv("NAPARI_GPUSEG_CACHE", str(tmp_path / "cache"))
    viewer = make_napari_viewer()
    auto, annotator = dock(viewer, "SAM automatic"), dock(viewer, "SAM annotator")
    panel = annotator.adapt_panel
    assert annotator.model_name == DEFAULT_MODEL and not panel.forget_btn.isEnabled()
    assert "not one of your adapted models" in panel.forget_btn.toolTip()
    for w in (auto, annotator):  # both docks on the adapted decoder, as a user picks it
        i = w.model_combo.findData(path)
        assert w.model_combo.itemText(i) == label
        w.model_combo.setCurrentIndex(i)
        w.model_combo.activated.emit(i)
    assert auto.model_name == annotator.model_name == annotator.session.model == path
    assert panel.forget_btn.isEnabled() and "Delete t00_adapted" in panel.forget_btn.toolTip()

    asked = []
    answer = QMessageBox.StandardButton.No
    monkeypatch.setattr(QMessageBox, "question", lambda *a, **k: asked.append(a[2]) or answer)
    qtbot.mouseClick(panel.forget_btn, Qt.MouseButton.LeftButton)
    assert asked and "Delete t00_adapted (from t00.tif)?" in asked[0]
    assert annotator.model_name == path and Path(path).is_file() and len(adapted_models()) == 1  # No: kept

    answer = QMessageBox.StandardButton.Yes
    qtbot.mouseClick(panel.forget_btn, Qt.MouseButton.LeftButton)
    assert not Path(path).exists() and adapted_models() == []
    assert json.loads((folder / "index.json").read_text()) == []
    assert annotator.model_name == annotator.session.model == DEFAULT_MODEL
    assert annotator.status.text().startswith("forgot t00_adapted (its file was deleted): annotating with")
    for w in (auto, annotator):
        assert w.model_combo.findData(path) < 0
    assert auto.model_name == DEFAULT_MODEL  # it had it chosen
    assert not panel.forget_btn.isEnabled()
    assert Path(made_path).is_file()
