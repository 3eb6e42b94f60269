"""The Batch folder dock driven end to end on a real viewer (pytest-qt)."""
from __future__ import annotations

import time

import numpy as np
import pytest
import tifffile
from qtpy.QtCore import Qt

from batch_helpers import bbbc
from napari_gpuseg.io import label_files
from napari_gpuseg.engine.classical import classical_segment
from napari_gpuseg.widgets import batch_folder
from napari_gpuseg.widgets.batch_folder import BatchFolderWidget

NAMES = ("IXMtest_N11_s4.tif", "IXMtest_O07_s6.tif", "IXMtest_P15_s3.tif")


@pytest.fixture
def small_folder(tmp_path, shared_data):
    folder = tmp_path / "in"
    folder.mkdir()
    for name in NAMES:  # 256x256 crops of real images keep the test quick
        tifffile.imwrite(folder / name, bbbc(shared_data, name)[0][:256, :256])
    (folder / "broken.tif").write_text("not an image")
    return folder


def _dock(make_napari_viewer, qtbot, docked=False):
    """A real viewer (hidden) and the dock; undocked the widget is shown on its own, so
    its table has real geometry for mouse events without showing the GL canvas."""
    viewer = make_napari_viewer()
    widget = BatchFolderWidget(viewer)
    if docked:
        viewer.window.add_dock_widget(widget, name="Batch folder")
    else:
        qtbot.addWidget(widget)
        widget.resize(500, 900)
        widget.show()
        qtbot.waitExposed(widget)
    return viewer, widget


def test_dock_runs_folder_and_opens_results(make_napari_viewer, qtbot, small_folder, tmp_path, monkeypatch):
    viewer, w = _dock(make_napari_viewer, qtbot)
    out = tmp_path / "out"
    w.in_dir.setText(str(small_folder))
    w.out_dir.setText(str(out))
    w.method.setCurrentText("threshold")
    w.image_batch.setValue(2)
    assert w.batch_size.text() == "Auto"
    qtbot.mouseClick(w.start_button, Qt.MouseButton.LeftButton)
    assert w.running and not w.start_button.isEnabled() and w.cancel_button.isEnabled()
    qtbot.waitUntil(lambda: w.report is not None or w.error is not None, timeout=30000)
    assert w.error is None and not w.running and w.start_button.isEnabled()
    rep = w.report
    assert rep.ok == 3 and rep.errors == 1 and not rep.cancelled
    assert w.table.rowCount() == 4 and w.progress.value() == 4 and w.progress.maximum() == 4
    assert "done" in w.status.text() and w.last_progress.images_per_s > 0
    assert "memory" in w.memory_label.text()
    statuses = {w.table.item(r, 0).text(): w.table.item(r, 3).text() for r in range(4)}
    assert statuses == {**{n: "ok" for n in NAMES}, "broken.tif": "error"}
    broken = [r for r in range(4) if w.table.item(r, 0).text() == "broken.tif"][0]
    assert "not a readable TIFF" in w.table.item(broken, 4).text()

    # double-click the first good row: image and labels open in the viewer
    row = [r for r in range(4) if w.table.item(r, 0).text() == NAMES[0]][0]
    w.table.scrollToItem(w.table.item(row, 0))
    rect = w.table.visualItemRect(w.table.item(row, 0))
    # Qt 6 item views need the press before the double-click event (as a real mouse gives)
    qtbot.mouseClick(w.table.viewport(), Qt.MouseButton.LeftButton, pos=rect.center())
    qtbot.mouseDClick(w.table.viewport(), Qt.MouseButton.LeftButton, pos=rect.center())
    qtbot.waitUntil(lambda: len(viewer.layers) == 2, timeout=3000)
    qtbot.wait(20)
    image_layer, labels_layer = viewer.layers
    stem = NAMES[0][:-4]
    assert image_layer.name == stem and labels_layer.name == f"{stem} labels"
    np.testing.assert_array_equal(image_layer.data, tifffile.imread(small_folder / NAMES[0]))
    np.testing.assert_array_equal(labels_layer.data, classical_segment(image_layer.data))
    # double-click on the error row opens nothing, shows the error
    w.open_row(broken)
    assert len(viewer.layers) == 2 and "broken.tif" in w.status.text()

    opened = []
    monkeypatch.setattr(batch_folder.QDesktopServices, "openUrl", lambda url: opened.append(url))
    qtbot.mouseClick(w.open_button, Qt.MouseButton.LeftButton)
    assert opened and opened[0].toLocalFile() == str(out)


def test_dock_cancel_is_fast_and_clean(make_napari_viewer, qtbot, small_folder, tmp_path, monkeypatch):
    import batch_helpers  # noqa: F401 - registers "slow-threshold"

    monkeypatch.setenv("NAPARI_GPUSEG_TEST_DELAY", "1.0")
    viewer, w = _dock(make_napari_viewer, qtbot)
    w.method.addItem("slow-threshold")
    w.method.setCurrentText("slow-threshold")
    w.in_dir.setText(str(small_folder))
    w.out_dir.setText(str(tmp_path / "out"))
    w.image_batch.setValue(1)
    w.start()
    qtbot.waitUntil(lambda: w.table.rowCount() >= 2, timeout=20000)  # the bad file + one image
    qtbot.mouseClick(w.cancel_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: w.report is not None, timeout=20000)  # 1 s per image: the run stops early
    assert w.report.cancelled and "cancelled" in w.status.text(), (w.report.summary(), [(r.file, r.status, r.seconds) for r in w.report.rows])
    assert w.start_button.isEnabled() and not w.cancel_button.isEnabled()
    out = tmp_path / "out"
    assert not list(out.rglob(label_files.TEMP_PREFIX + "*"))
    labels = list(out.glob("*_labels.tif"))
    assert len(labels) < 3 and all(label_files.is_valid_output(p) for p in labels)


def test_dock_reports_bad_input_folder(make_napari_viewer, qtbot, tmp_path):
    viewer, w = _dock(make_napari_viewer, qtbot, docked=True)
    w.in_dir.setText(str(tmp_path / "missing"))
    w.start()
    assert not w.running and "input folder not found" in w.status.text()
    assert w.output_folder() == tmp_path / "missing" / "labels"


def _finished_threshold_run(make_napari_viewer, qtbot, folder, out, docked=False):
    """A viewer and the dock after a ``threshold`` run over ``folder``; rows by file name."""
    viewer, w = _dock(make_napari_viewer, qtbot, docked=docked)
    w.in_dir.setText(str(folder))
    w.out_dir.setText(str(out))
    w.method.setCurrentText("threshold")
    w.start()
    qtbot.waitUntil(lambda: w.report is not None, timeout=30000)
    return viewer, w, {w.table.item(r, 0).text(): r for r in range(w.table.rowCount())}


def _slow_reads(monkeypatch, seconds: float, record: list) -> None:
    """The dock's image reader takes ``seconds`` more (a large file); each read appends
    (path, read on the main thread) to ``record`` when it ends."""
    import threading

    real_load = batch_folder.gio.load_image

    def slow_load(path):
        time.sleep(seconds)
        try:
            return real_load(path)
        finally:
            record.append((path, threading.current_thread() is threading.main_thread()))

    monkeypatch.setattr(batch_folder.gio, "load_image", slow_load)


def test_opening_a_result_reads_off_the_gui_thread(make_napari_viewer, qtbot, small_folder, tmp_path, monkeypatch):
    """A double-clicked result is read in a background thread: the window keeps running while
    a slow (large) file is read, the layers come once it is in memory, and a result that can
    no longer be read (deleted since the run) gives a message and no layer."""
    viewer, w, rows = _finished_threshold_run(make_napari_viewer, qtbot, small_folder, tmp_path / "out")
    reads = []
    _slow_reads(monkeypatch, 2.0, reads)
    w.open_row(rows[NAMES[1]])
    assert reads == []  # the call came back before the 2 s read ended: the GUI thread did not wait
    assert len(viewer.layers) == 0 and "opening" in w.status.text()
    ticks = []
    qtbot.waitUntil(lambda: ticks.append(time.perf_counter()) or len(viewer.layers) == 2, timeout=10000)
    assert [on_main for _p, on_main in reads] == [False]  # read in a background thread
    assert len(ticks) > 5  # the event loop ran while the file was read
    stem = NAMES[1][:-4]
    assert [ly.name for ly in viewer.layers] == [stem, f"{stem} labels"]
    assert f"opened {NAMES[1]}" in w.status.text()

    (small_folder / NAMES[2]).unlink()  # gone since the run
    w.open_row(rows[NAMES[2]])
    qtbot.waitUntil(lambda: "cannot open" in w.status.text(), timeout=5000)
    assert NAMES[2] in w.status.text() and len(viewer.layers) == 2


def test_closing_the_viewer_while_a_result_is_read(make_napari_viewer, qtbot, small_folder, tmp_path, monkeypatch):
    """The window closed while a double-clicked result is still being read: the read ends
    without an error and nothing is added to the closed viewer."""
    viewer, w, rows = _finished_threshold_run(make_napari_viewer, qtbot, small_folder, tmp_path / "out",
                                              docked=True)
    done = []
    _slow_reads(monkeypatch, 0.5, done)
    w.open_row(rows[NAMES[0]])
    viewer.close()
    qtbot.waitUntil(lambda: bool(done), timeout=5000)
    qtbot.wait(300)  # the result is handed to the GUI thread after the read
    assert len(viewer.layers) == 0
