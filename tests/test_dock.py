"""The shared dock base (widgets/_dock.py) and the annotator's layout at napari's default size."""
from __future__ import annotations

import logging

import numpy as np
import torch

from napari_gpuseg.engine.runtime.device import Policy
from napari_gpuseg.engine.runtime.worker import InferenceWorker


def test_a_broken_gui_callback_is_logged_and_the_worker_keeps_serving(caplog):
    worker = InferenceWorker(Policy(torch.device("cpu"), "fp32"))
    try:
        def broken(_value):
            raise ValueError("callback bug")

        with caplog.at_level(logging.ERROR, logger="napari_gpuseg.engine.runtime.worker"):
            job = worker.submit(lambda: 1, on_result=broken)
            assert job.result(5) == 1
            assert worker.submit(lambda: 2).result(5) == 2  # the callback ran before this job
        assert any("callback bug" in (r.exc_text or "") or r.exc_info and "callback bug" in str(r.exc_info[1])
                   for r in caplog.records)
        assert worker.alive
    finally:
        worker.shutdown()
    assert not worker.alive


def test_dock_errors_go_to_status_line_notification_and_log(qtbot, caplog, monkeypatch):
    from napari_gpuseg.widgets import _dock

    shown = []
    monkeypatch.setattr("napari.utils.notifications.show_error", shown.append)

    class Dock(_dock.DockWidget):
        TITLE = "Test dock"

        def __init__(self):
            super().__init__()
            self._make_status_parts()

    dock = Dock()
    qtbot.addWidget(dock)
    with caplog.at_level(logging.ERROR, logger="napari_gpuseg.widgets"):
        try:
            raise RuntimeError("CUDA out of memory")
        except RuntimeError as exc:
            dock._on_error(exc)
    msg = "Test dock: RuntimeError: CUDA out of memory"
    assert dock.status.text() == msg and shown == [msg]
    assert [r.getMessage() for r in caplog.records] == [msg] and caplog.records[0].exc_info


def _manifest() -> str:
    from pathlib import Path

    import napari_gpuseg

    return (Path(napari_gpuseg.__file__).parent / "napari.yaml").read_text(encoding="utf-8")


def _manifest_docks() -> list[tuple[str, str]]:
    """(module, class) of every widget contribution in napari.yaml."""
    import re

    return re.findall(r"python_name:\s*(napari_gpuseg\.widgets\.\w+):(\w+)", _manifest())


def _manifest_titles() -> list[str]:
    """The names of napari.yaml's widget contributions, as the Plugins menu lists them."""
    import re

    return re.findall(r"- command: napari-gpuseg\.\w+\n\s+display_name: (.+)", _manifest())


def test_batch_size_boxes_read_Auto_in_every_dock(make_napari_viewer):
    """Every dock of napari.yaml: its spin boxes with a special text read "Auto", and those of
    the docks with a per-call batch size are there."""
    import importlib

    from qtpy.QtWidgets import QSpinBox

    docks = _manifest_docks()
    assert len(docks) >= 8, docks
    viewer = make_napari_viewer()
    with_auto = set()
    for module, name in docks:
        dock = getattr(importlib.import_module(module), name)(viewer)
        texts = {s.specialValueText() for s in dock.findChildren(QSpinBox) if s.specialValueText()}
        assert texts <= {"Auto"}, (name, texts)
        if texts:
            with_auto.add(name)
    assert {"BatchFolderWidget", "SamAnnotatorWidget", "SamAutomaticWidget", "UNetPredictWidget"} <= with_auto


def test_annotator_rows_are_not_clipped_at_the_default_window_size(make_napari_viewer, qtbot, monkeypatch):
    """With the GPU monitor docked below it (as ``napari-gpuseg`` opens them and the README
    screenshot shows), the annotator shares the window's height; its Model and Image rows
    must keep their full height and width (a shown scroll bar once covered their right edge),
    its Commit, Clear and Undo buttons must show without scrolling, and the monitor both lines
    of a long CPU name."""
    from napari_gpuseg.widgets import gpu_monitor

    monkeypatch.setattr(gpu_monitor, "device_name",
                        lambda _d: "CPU (Intel(R) Xeon(R) Platinum 8480+ Processor, 2 threads)")
    viewer = make_napari_viewer(show=True)
    viewer.add_image(np.zeros((64, 64), np.uint8), name="img")
    from napari_gpuseg.cli.main import DEFAULT_DOCKS

    assert DEFAULT_DOCKS == ("SAM annotator", "GPU monitor")
    _d, w = viewer.window.add_plugin_dock_widget("napari-gpuseg", "SAM annotator")
    _d, monitor = viewer.window.add_plugin_dock_widget("napari-gpuseg", "GPU monitor")
    form = w.model_combo.parentWidget().layout().itemAt(0).layout()
    widgets = [(f, form.labelForField(f)) for f in (w.model_combo, w.image_label)]

    def settled():
        return all(wd.isVisible() and wd.visibleRegion().boundingRect() == wd.rect()
                   for pair in widgets for wd in pair)

    # the docks' layout settles over a few event-loop rounds (the status line's text changes
    # as the model loads, and a 2 px clip was once seen right after 300 ms)
    qtbot.wait(300)
    qtbot.waitUntil(settled, timeout=5000)
    for field in (w.model_combo, w.image_label):
        label = form.labelForField(field)
        for widget in (field, label):
            assert widget.isVisible()
            assert widget.height() >= widget.sizeHint().height(), (label.text(), widget.size())
            visible = widget.visibleRegion().boundingRect()
            assert visible == widget.rect(), (label.text(), visible, widget.rect())
    assert w.image_label.text() != "no image layer"
    # what a user needs for every object shows without scrolling: Commit, Clear, Undo (they
    # were under the fold, below the hint and a checkbox, in the README screenshot)
    for button in (w.commit_btn, w.clear_btn, w.undo_btn):
        visible = button.visibleRegion().boundingRect()
        assert button.isVisible() and visible == button.rect(), (button.text(), visible, button.rect())
    label = monitor.device_label
    assert label.heightForWidth(label.width()) > label.fontMetrics().height() * 1.5  # it wraps
    assert label.height() >= label.heightForWidth(label.width())


def test_a_status_that_wraps_does_not_move_the_bar_under_it(make_napari_viewer, qtbot):
    """The status line keeps two lines' height: a first look's text with the tile count
    wrapped at the annotator's default width and pushed the progress bar and buttons down."""
    from qtpy.QtWidgets import QLabel

    viewer = make_napari_viewer(show=True)
    viewer.add_image(np.zeros((64, 64), np.uint8), name="img")
    _d, w = viewer.window.add_plugin_dock_widget("napari-gpuseg", "SAM annotator")
    seen = []

    def settled():  # napari styles the new dock and the window lays it out after a while
        seen.append((w.status.width(), w.status.fontMetrics().lineSpacing()))
        return len(seen) > 50 and len(set(seen[-50:])) == 1

    qtbot.waitUntil(settled, timeout=20_000)
    # its own messages come no more (they would replace the texts measured here)
    qtbot.waitUntil(lambda: "embedding ready" in w.status.text(), timeout=120_000)

    def bar_top_after(text):  # below the status line's top: rows above it may change meanwhile
        w.status.setText(text)
        qtbot.wait(100)
        top = w.status.mapTo(w, w.status.rect().topLeft()).y()
        return w.progress.mapTo(w, w.progress.rect().topLeft()).y() - top

    short = bar_top_after("idle")
    label, width = w.status, w.status.width()

    def plain_height(text):  # the height the text takes at this width, as a plain label
        label.setText(text)
        return QLabel.heightForWidth(label, width)

    one_line = plain_height("idle")
    long_text = "first look: 877 px, predicted IoU 0.92 · 2/36 tiles"
    while plain_height(long_text) <= one_line:  # two lines at this dock's width, whatever the font
        long_text += " and more"
    assert plain_height(long_text) == label._reserved()  # two lines, not three
    assert bar_top_after(long_text) == short == bar_top_after("idle")
    from napari_gpuseg.engine.sam.training.adapt import unsure_hint

    for adapted in (False, True):  # the longest first-mask message: a big mask the model is unsure of
        text = "preview: 123456 px, " + unsure_hint(0.41, adapted=adapted)
        assert plain_height(text) <= label._reserved(), text
        assert bar_top_after(text) == short


def test_closing_a_dock_cancels_its_run(make_napari_viewer, monkeypatch):
    """napari takes a closed dock's widget out of the window and keeps it alive: every dock
    with a run and a Cancel button cancels that run when its close button is pressed (the
    runs' cancelling is tested with each dock; the annotator and the folder annotator stop
    more, tested in their modules)."""
    import importlib

    viewer = make_napari_viewer()
    names = {"BatchFolderWidget": "Batch folder", "SamAutomaticWidget": "SAM automatic",
             "UNetPredictWidget": "U-Net predict", "UNetTrainWidget": "U-Net train",
             "UNetAdaptWidget": "Adapt U-Net", "SamAdaptWidget": "Adapt SAM"}
    cancelled = []
    for module, name in _manifest_docks():
        if name in names:
            cls = getattr(importlib.import_module(module), name)
            monkeypatch.setattr(cls, "cancel", lambda self, n=name: cancelled.append(n))
    for name, title in names.items():
        dock, w = viewer.window.add_plugin_dock_widget("napari-gpuseg", title)
        assert cancelled.count(name) == 0
        dock.destroyOnClose()  # the dock's close button
        assert w.parent() is None and cancelled.count(name) == 1, (name, cancelled)


def test_a_long_layer_name_is_cut_in_the_middle_for_the_status_line():
    from napari_gpuseg.widgets._dock import short_name

    assert short_name("t00") == "t00"
    name = "IXMtest_A02_s1_w1B8B3C6E8-6F0B-4F1B-9D4B-1E2E8A0B2C3D"
    cut = short_name(name)
    assert len(cut) == 24 and cut.startswith("IXMtest_A02") and cut.endswith("2C3D") and "…" in cut


def test_closing_napari_s_window_stops_every_dock_in_it(make_napari_viewer, qtbot, monkeypatch):
    """napari keeps the docks' widgets until Qt deletes its closed window: each dock stops when
    the window closes (``viewer.close()``, the window's close button), as its own close button
    stops it; a dock closed by its button first is told again (``on_closed`` is idempotent).
    Hiding the window stops nothing."""
    import importlib

    from napari_gpuseg.widgets._dock import DockWidget

    stopped = []
    for module, name in _manifest_docks():
        cls = getattr(importlib.import_module(module), name)
        monkeypatch.setattr(cls, "on_closed", lambda self, n=name: stopped.append(n))
    viewer = make_napari_viewer()
    opened = {}
    for title in _manifest_titles():
        dock, widget = viewer.window.add_plugin_dock_widget("napari-gpuseg", title)
        assert isinstance(widget, DockWidget), title
        opened[type(widget).__name__] = dock, widget
    assert {"SamAnnotatorWidget", "AnnotateFolderWidget", "SamAutomaticWidget"} <= set(opened)
    window = opened["SamAutomaticWidget"][1].window()
    window.hide()
    window.show()
    qtbot.wait(50)
    assert stopped == []
    opened["UNetPredictWidget"][0].destroyOnClose()  # one dock closed by its close button first
    assert stopped == ["UNetPredictWidget"]
    viewer.close()
    assert sorted(stopped) == sorted(list(opened) + ["UNetPredictWidget"])


def test_a_close_the_window_refuses_stops_no_dock(qtbot):
    """A close the shown window refuses (napari asks to confirm) is not followed by the window
    hiding: the dock goes on; once a close is accepted, it stops."""
    from qtpy.QtCore import Qt
    from qtpy.QtWidgets import QDockWidget, QMainWindow

    from napari_gpuseg.widgets._dock import DockWidget

    class Window(QMainWindow):
        accept = False

        def closeEvent(self, event):  # noqa: N802 - Qt name
            event.setAccepted(self.accept)

    class Dock(DockWidget):
        stops = 0

        def on_closed(self):
            self.stops += 1

    window, dock = Window(), Dock()
    qtbot.addWidget(window)
    holder = QDockWidget("dock")
    holder.setWidget(dock)
    window.addDockWidget(Qt.DockWidgetArea.RightDockWidgetArea, holder)
    window.show()
    qtbot.waitExposed(window)
    window.close()
    qtbot.wait(50)
    assert window.isVisible() and dock.stops == 0
    window.accept = True
    window.close()
    qtbot.waitUntil(lambda: dock.stops == 1, timeout=5000)
    assert not window.isVisible()
