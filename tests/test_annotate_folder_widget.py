"""The Annotate folder dock on a real viewer (pytest-qt): open a folder of held-out BBBC039 cuts,
edit, go Next; the layers follow and the labels file is written. With the SAM annotator: it
follows each image and commits into the folder's labels."""
from __future__ import annotations

import numpy as np
import pytest
import tifffile
from qtpy.QtCore import Qt

from napari_gpuseg.engine.annotate.folder import ANNOTATED, NOT_STARTED, SKIPPED
from napari_gpuseg.widgets.annotate_folder import AnnotateFolderWidget

# every test asserts what the dock shows and writes: the held-out cuts' embeddings are
# computed once in the run (tests/encoder_memo.py)
pytestmark = pytest.mark.usefixtures("reuse_embeddings")


def small_folder(shared_data, tmp_path, n=3):
    folder = tmp_path / "images"
    folder.mkdir()
    for f in sorted((shared_data / "bbbc039" / "images").glob("*.tif"))[-n:]:  # validation fields
        tifffile.imwrite(folder / f.name, tifffile.imread(f)[100:356, 200:456])
    return folder


def test_open_edit_next_writes_labels_and_follows(make_napari_viewer, qtbot, shared_data, tmp_path):
    images, out = small_folder(shared_data, tmp_path), tmp_path / "out"
    viewer = make_napari_viewer()
    dock = AnnotateFolderWidget(viewer)
    qtbot.addWidget(dock)
    dock.with_annotator.setChecked(False)  # the folder's own session (it embeds in the background)
    assert dock.open(images, out)
    names = sorted(p.stem for p in images.glob("*.tif"))
    assert dock.where.text().startswith("image 1 of 3")
    assert [ly.name for ly in viewer.layers] == [names[0], f"{names[0]} SAM labels"]
    layer = dock.labels_layer
    assert layer.data.shape == (256, 256)
    layer.paint((128, 128), 7)  # a painted object: saved once the edit rests
    qtbot.waitUntil(lambda: (out / f"{names[0]}_labels.tif").exists(), timeout=5000)
    saved = tifffile.imread(out / f"{names[0]}_labels.tif")
    assert saved[128, 128] == 7 and dock.folder.images[0].objects == 1
    qtbot.mouseClick(dock.next_button, Qt.MouseButton.LeftButton)
    assert dock.where.text().startswith("image 2 of 3")
    assert [ly.name for ly in viewer.layers] == [names[1], f"{names[1]} SAM labels"]
    assert not dock.labels_layer.data.any()
    qtbot.mouseClick(dock.skip_button, Qt.MouseButton.LeftButton)
    assert [im.state for im in dock.folder.images] == [ANNOTATED, SKIPPED, NOT_STARTED]
    assert "skipped" in dock.list.item(1).text() and "1 object" in dock.list.item(0).text()
    qtbot.mouseClick(dock.prev_button, Qt.MouseButton.LeftButton)
    qtbot.mouseClick(dock.prev_button, Qt.MouseButton.LeftButton)
    np.testing.assert_array_equal(dock.labels_layer.data, saved)  # the saved labels shown again
    dock.folder.close()


def test_sam_annotator_follows_each_image(make_napari_viewer, qtbot, shared_data, tmp_path):
    images, out = small_folder(shared_data, tmp_path, 2), tmp_path / "out"
    viewer = make_napari_viewer()
    dock = AnnotateFolderWidget(viewer)
    viewer.window.add_dock_widget(dock, name="Annotate folder")
    assert dock.open(images, out)
    annotator = dock.annotator
    assert annotator is not None and annotator.session is dock.folder.session
    for _ in range(2):
        # napari hands a plugin's dock a proxy of the viewer (its layers are proxies too)
        qtbot.waitUntil(lambda: getattr(annotator.image_layer, "name", None) == dock.image_layer.name,
                        timeout=30000)
        assert annotator.session.image is dock.folder.image
        # its commits land in the labels the folder saves and the layer shows
        assert annotator.session.labels is dock.labels_layer.data
        dock.next()
    annotator.session.close()
    dock.folder.close()


def _key(viewer, qtbot, key):
    """A key press on the viewer's canvas, as the user types it (Shift + key)."""
    from qtpy.QtCore import Qt as _Qt

    canvas = viewer.window._qt_viewer.canvas.native
    canvas.setFocus()
    qtbot.keyClick(canvas, key, _Qt.KeyboardModifier.ShiftModifier)


def test_next_previous_skip_keys(make_napari_viewer, qtbot, shared_data, tmp_path):
    images, out = small_folder(shared_data, tmp_path), tmp_path / "out"
    viewer = make_napari_viewer(show=True)
    dock = AnnotateFolderWidget(viewer)
    qtbot.addWidget(dock)
    dock.with_annotator.setChecked(False)
    assert dock.open(images, out)
    _key(viewer, qtbot, Qt.Key.Key_Right)  # Shift-Right: Next
    assert dock.folder.index == 1 and dock.where.text().startswith("image 2 of 3")
    _key(viewer, qtbot, Qt.Key.Key_K)  # Shift-K: Skip
    assert dock.folder.index == 2 and dock.folder.images[1].state == SKIPPED
    _key(viewer, qtbot, Qt.Key.Key_Left)  # Shift-Left: Previous
    assert dock.folder.index == 1 and dock.where.text().startswith("image 2 of 3")
    dock.folder.close()


def test_status_line_follows_the_image(make_napari_viewer, qtbot, shared_data, tmp_path):
    images, out = small_folder(shared_data, tmp_path, 2), tmp_path / "out"
    viewer = make_napari_viewer()
    dock = AnnotateFolderWidget(viewer)
    qtbot.addWidget(dock)
    dock.with_annotator.setChecked(False)
    assert dock.open(images, out)
    dock.labels_layer.paint((100, 100), 3)  # saved as the stroke ends: the layer's paint event, no polling
    qtbot.waitUntil(lambda: (out / f"{sorted(p.stem for p in images.glob('*.tif'))[0]}_labels.tif").exists(),
                    timeout=5000)
    assert dock.status.text().startswith("saved ")
    dock.next()
    assert "saved" not in dock.status.text() and "not started" in dock.status.text()
    dock.folder.close()


def test_train_segment_rest_and_cancel_buttons(make_napari_viewer, qtbot, shared_data, tmp_path, monkeypatch):
    from dataclasses import replace

    import napari_gpuseg.engine.unet.finetune_annotated as finetune
    from napari_gpuseg.engine.annotate.folder import PRESEGMENTED

    tiny = replace(finetune.default_schedule(), epochs=1, iters_per_epoch=2, batch_size=2, crop_size=64,
                   warmup_iters=1)
    monkeypatch.setattr(finetune, "default_schedule", lambda: tiny)
    images, out = small_folder(shared_data, tmp_path, 4), tmp_path / "out"
    names = sorted(p.stem for p in images.glob("*.tif"))
    viewer = make_napari_viewer()
    dock = AnnotateFolderWidget(viewer)
    qtbot.addWidget(dock)
    dock.with_annotator.setChecked(False)
    assert dock.open(images, out)
    assert dock.train_unet_button.isEnabled() and not dock.cancel_button.isEnabled()
    gt = tifffile.imread(shared_data / "bbbc039" / "masks" / f"{names[0]}.tif")[100:356, 200:456]
    dock.labels_layer.data[:] = gt
    dock.labels_layer.brush_size = 1
    y, x = np.argwhere(gt == 0)[0]
    dock.labels_layer.paint((y, x), int(gt.max()) + 1)  # a painted stroke: everything saved
    first = out / f"{names[0]}_labels.tif"
    qtbot.waitUntil(first.exists, timeout=5000)
    kept = first.read_bytes()
    dock.next()
    # Train U-Net on annotated: in the background with a live loss; then it pre-segments the rest
    qtbot.mouseClick(dock.train_unet_button, Qt.MouseButton.LeftButton)
    assert dock.cancel_button.isEnabled() and not dock.rest_button.isEnabled()
    qtbot.waitUntil(lambda: dock.job is None, timeout=120000)
    model = dock.folder.presegment.model
    assert dock.folder.presegment.method == "unet" and model and (out / "models" / "unet_1.pt").exists()
    assert len(dock.plot.series["train loss"]) == 2 and "pre-segments" in dock.status.text()
    assert dock.folder.current.state == PRESEGMENTED  # the open image, untouched: pre-segmented again
    # Cancel: no model written
    dock.train_unet()
    dock.cancel()
    qtbot.waitUntil(lambda: dock.job is None, timeout=120000)
    assert not (out / "models" / "unet_2.pt").exists() and dock.folder.presegment.model == model
    # Segment the rest: the two images not opened yet, the annotated file byte for byte as it was
    qtbot.mouseClick(dock.rest_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: dock.job is None, timeout=120000)
    assert [im.state for im in dock.folder.images] == [ANNOTATED, PRESEGMENTED, PRESEGMENTED, PRESEGMENTED]
    assert (out / f"{names[2]}_labels.tif").exists() and (out / f"{names[3]}_labels.tif").exists()
    assert not (out / f"{names[1]}_labels.tif").exists()  # open: left to the user
    assert first.read_bytes() == kept and "pre-segmented" in dock.list.item(3).text()
    assert "Segmented 2 of 2 images" in dock.status.text()
    dock.folder.close()


def test_adapt_sam_button_switches_the_annotator_model(make_napari_viewer, qtbot, shared_data, tmp_path,
                                                       monkeypatch):
    import napari_gpuseg.engine.annotate.folder_train as folder_train

    made = tmp_path / "adapted.pt"
    made.write_bytes(b"")

    def fake(images, labels, model, **kw):  # the engine's adaptation is tested in test_folder_training
        kw["on_event"](type("Ev", (), {"loss": 0.5})())
        return folder_train.FolderTrainResult(str(made), len(images), 3, 1, 0.1, "done", [0.5])

    monkeypatch.setattr(folder_train, "adapt_sam_on_pairs", fake)
    images, out = small_folder(shared_data, tmp_path, 2), tmp_path / "out"
    viewer = make_napari_viewer()
    dock = AnnotateFolderWidget(viewer)
    qtbot.addWidget(dock)
    dock.with_annotator.setChecked(False)
    assert dock.open(images, out)
    qtbot.mouseClick(dock.adapt_sam_button, Qt.MouseButton.LeftButton)  # nothing annotated yet
    assert dock.job is None and "no annotated image" in dock.status.text()
    dock.labels_layer.paint((100, 100), 2)
    dock.next()
    dock.labels_layer.paint((50, 50), 1)  # the open image is the user's: not pre-segmented again
    qtbot.mouseClick(dock.adapt_sam_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: dock.job is None, timeout=60000)
    assert dock.folder.session.model == str(made)
    assert dock.folder.presegment.method == "sam-everything" and dock.folder.presegment.model == str(made)
    assert list(dock.plot.series["train loss"]) == [0.5]
    dock.folder.close()


def test_closing_the_dock_lets_go_of_its_keys_and_the_folder(make_napari_viewer, qtbot, shared_data, tmp_path):
    images, out = small_folder(shared_data, tmp_path, 2), tmp_path / "out"
    viewer = make_napari_viewer(show=True)
    dock, w = viewer.window.add_plugin_dock_widget("napari-gpuseg", "Annotate folder")
    w.with_annotator.setChecked(False)
    assert w.open(images, out)
    _key(viewer, qtbot, Qt.Key.Key_Right)  # Shift-Right: Next, while the dock is open
    assert w.folder.index == 1
    dock.destroyOnClose()  # the dock's close button: napari keeps the widget
    _key(viewer, qtbot, Qt.Key.Key_Left)  # Shift-Left reaches it no more
    assert w.folder.index == 1
    for key in ("Shift-Right", "Shift-Left", "Shift-K"):
        assert viewer.bind_key(key, None) is None
