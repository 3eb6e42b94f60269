"""The Annotate folder dock on a real viewer (pytest-qt): open a folder of held-out BBBC039 cuts,
edit, go Next; the layers follow and the labels file is written. With the SAM annotator: it
follows each image and commits into the folder's labels."""
from __future__ import annotations

import numpy as np
import tifffile
from qtpy.QtCore import Qt

from napari_gpuseg.engine.annotate.folder import ANNOTATED, NOT_STARTED, SKIPPED
from napari_gpuseg.widgets.annotate_folder import AnnotateFolderWidget


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
    dock.timer.stop()
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
    dock.timer.stop()
    annotator.session.close()
    dock.folder.close()
