"""Annotate folder dock: go through a folder of images one by one, labels saved as you go.

A thin view over :class:`napari_gpuseg.engine.FolderAnnotation`: it shows the open image and its
labels (``<name> SAM labels``, the layer the SAM annotator commits into) and maps the buttons
and keys to the engine object. With the SAM annotator dock open (the default), both share one
:class:`~napari_gpuseg.engine.AnnotationSession`: the annotator follows each image, and its
commits, undos and painted edits are saved (looked for twice a second) to ``OUT/<name>_labels.tif``.
"""
from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
from qtpy.QtCore import QTimer
from qtpy.QtWidgets import (
    QCheckBox, QComboBox, QFileDialog, QFormLayout, QHBoxLayout, QLabel, QLineEdit, QListWidget, QPushButton,
    QVBoxLayout, QWidget,
)

from .. import io as gio
from ._dock import DockWidget

PRESEGMENT = ("none", "U-Net (bundled)")
KEYS = {"next": "Shift-Right", "previous": "Shift-Left", "skip": "Shift-K"}


class AnnotateFolderWidget(DockWidget):
    """Image and output folders, pattern, pre-segmentation; Open; Previous / Skip / Next; the
    images with their state and object count (double-click one to open it)."""

    TITLE = "Annotate folder"

    def __init__(self, napari_viewer, parent=None, worker=None):
        super().__init__(parent)
        self.viewer = napari_viewer
        self.worker = worker
        self.setObjectName("AnnotateFolderWidget")
        self.folder = None  # the FolderAnnotation
        self.annotator = None  # the SAM annotator dock whose session the folder drives
        self.image_layer = self.labels_layer = None
        self._saved_sum = None
        self._build_ui()
        for name, key in KEYS.items():
            self.viewer.bind_key(key, lambda _v, fn=getattr(self, name): fn(), overwrite=True)
        self.timer = QTimer(self)
        self.timer.setInterval(500)
        self.timer.timeout.connect(self.save_edits)
        self.destroyed.connect(lambda *_: self.folder is not None and self.folder.close())

    # -- UI ---------------------------------------------------------------------------------
    def _build_ui(self) -> None:
        self.in_edit, self.out_edit = QLineEdit(), QLineEdit()
        self.pattern_edit = QLineEdit(gio.DEFAULT_PATTERN)
        self.presegment_box = QComboBox()
        self.presegment_box.addItems(PRESEGMENT)
        self.with_annotator = QCheckBox("annotate with the SAM annotator")
        self.with_annotator.setChecked(True)
        form = QFormLayout()
        form.addRow("images", self._with_browse(self.in_edit))
        form.addRow("output", self._with_browse(self.out_edit))
        form.addRow("pattern", self.pattern_edit)
        form.addRow("pre-segment", self.presegment_box)
        form.addRow(self.with_annotator)
        self.open_button = QPushButton("Open")
        self.open_button.clicked.connect(self.open)
        self.where = QLabel("no folder open")
        self.prev_button = QPushButton(f"Previous [{KEYS['previous']}]")
        self.skip_button = QPushButton(f"Skip [{KEYS['skip']}]")
        self.next_button = QPushButton(f"Next [{KEYS['next']}]")
        row = QHBoxLayout()
        for button, fn in ((self.prev_button, self.previous), (self.skip_button, self.skip),
                           (self.next_button, self.next)):
            button.clicked.connect(fn)
            button.setEnabled(False)
            row.addWidget(button)
        self.list = QListWidget()
        self.list.itemDoubleClicked.connect(lambda item: self.goto(self.list.row(item)))
        self._make_status_parts("pick an image folder and an output folder, then Open")
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addWidget(self.open_button)
        layout.addWidget(self.where)
        layout.addLayout(row)
        layout.addWidget(self.status)
        layout.addWidget(self.list, 1)

    def _with_browse(self, edit: QLineEdit) -> QWidget:
        box = QWidget()
        row = QHBoxLayout(box)
        row.setContentsMargins(0, 0, 0, 0)
        row.addWidget(edit, 1)
        browse = QPushButton("…")
        browse.clicked.connect(lambda: self._browse(edit))
        row.addWidget(browse)
        return box

    def _browse(self, edit: QLineEdit) -> None:
        path = QFileDialog.getExistingDirectory(self, "Choose a folder", edit.text())
        if path:
            edit.setText(path)

    # -- the folder ---------------------------------------------------------------------------
    def open(self, in_dir=None, out_dir=None) -> bool:
        """Open the folders (the fields', or those given) at the resume point."""
        from ..engine import AnnotationSession, FolderAnnotation
        from ..engine.annotate.folder import unet_presegmenter

        if in_dir is not None:
            self.in_edit.setText(str(in_dir))
        if out_dir is not None:
            self.out_edit.setText(str(out_dir))
        src, dst = self.in_edit.text().strip(), self.out_edit.text().strip()
        if not src or not dst:
            self._report_error("choose an image folder and an output folder")
            return False
        if self.folder is not None:
            self.save_edits()
            self.folder.close()
            self.folder = None
        self.annotator = self._find_annotator() if self.with_annotator.isChecked() else None
        if self.annotator is not None:
            session = self.annotator.session
        else:
            session = AnnotationSession(None, worker=self.worker, submit=self._submit_job)
        presegment = unet_presegmenter() if self.presegment_box.currentIndex() == 1 else None
        try:
            # the annotator embeds each image as it follows it; alone, the folder does
            folder = FolderAnnotation(session, Path(src), Path(dst), self.pattern_edit.text().strip()
                                      or gio.DEFAULT_PATTERN, presegment=presegment,
                                      embed=self.annotator is None, open_first=False)
        except (OSError, ValueError) as exc:
            self._report_error(str(exc))
            return False
        self.folder = folder
        folder.listeners.append(self._refresh)
        self.timer.start()
        self.goto(folder.resume_index())
        return True

    def _find_annotator(self):
        """The SAM annotator dock of this window, opened through the plugin when it is not
        (docks never import each other): any docked widget with an AnnotationSession."""
        from ..engine import AnnotationSession

        window = getattr(self.viewer, "window", None)
        if window is None:
            return None
        for widget in dict(getattr(window, "dock_widgets", {})).values():
            if isinstance(getattr(widget, "session", None), AnnotationSession):
                return widget
        try:
            _dock, widget = window.add_plugin_dock_widget("napari-gpuseg", "SAM annotator")
        except Exception as exc:  # noqa: BLE001 - annotate with the folder's own session
            self._report_error(f"the SAM annotator could not be opened ({exc}); clicks are not available")
            return None
        return widget

    def goto(self, index: int) -> None:
        if self.folder is None:
            return
        self.save_edits()
        try:
            self.folder.goto(index)
        except (OSError, ValueError) as exc:
            self._report_error(str(exc))
            return
        self._show()

    def next(self) -> None:
        self._move(lambda f: f.next())

    def previous(self) -> None:
        self._move(lambda f: f.previous())

    def skip(self) -> None:
        self._move(lambda f: f.skip())

    def _move(self, step) -> None:
        if self.folder is None:
            return
        self.save_edits()
        before = self.folder.index
        try:
            step(self.folder)
        except (OSError, ValueError) as exc:
            self._report_error(str(exc))
            return
        if self.folder.index != before:
            self._show()
        elif self.folder.finished:
            self._set_status("every image is done or skipped")

    def save_edits(self) -> None:
        """Save the labels when they changed since the last save (a commit or an undo in the
        SAM annotator, a painted edit)."""
        folder = self.folder
        if folder is None or folder.index is None or self.labels_layer is None:
            return
        labels = folder.session.labels
        if _checksum(labels) != self._saved_sum:
            try:
                folder.edited()
            except OSError as exc:
                self._report_error(f"labels not saved: {exc}")
                return
            self._saved_sum = _checksum(labels)
            self._set_status(f"saved {folder.current.labels_path.name}")

    # -- the viewer -----------------------------------------------------------------------------
    def _show(self) -> None:
        """The open image and its labels in the viewer (the previous image's layers go)."""
        folder = self.folder
        im = folder.current
        for layer in (self.labels_layer, self.image_layer):
            if layer is not None and layer in self.viewer.layers:
                self.viewer.layers.remove(layer)
        name = Path(im.name).name.split(".")[0]
        self.image_layer = self.viewer.add_image(folder.image, name=name, rgb=folder.session.rgb)
        self.labels_layer = self.viewer.add_labels(folder.session.labels, name=f"{name} SAM labels")
        folder.session.use_labels(self.labels_layer.data)  # one array: painted edits are the session's
        self.viewer.layers.selection.active = self.image_layer  # the annotator follows the image
        self._saved_sum = _checksum(folder.session.labels)
        self._refresh()

    def _refresh(self) -> None:
        folder = self.folder
        if folder is None:
            return
        n = len(folder)
        self.where.setText(f"image {folder.index + 1} of {n}: {folder.current.name}")
        self.prev_button.setEnabled(bool(folder.index))
        self.next_button.setEnabled(True)  # on the last image: marks it done
        self.skip_button.setEnabled(True)
        rows = [f"{im.name}  —  {im.state}, {im.objects} object{'s' * (im.objects != 1)}"
                + ("  ✓" if im.done and im.state != "skipped" else "") for im in folder.images]
        if self.list.count() != n:
            self.list.clear()
            self.list.addItems(rows)
        else:
            for i, text in enumerate(rows):
                if self.list.item(i).text() != text:
                    self.list.item(i).setText(text)
        self.list.setCurrentRow(folder.index)


def _checksum(labels: np.ndarray) -> int:
    return zlib.adler32(np.ascontiguousarray(labels).data)
