"""Annotate folder dock: go through a folder of images one by one, labels saved as you go.

A thin view over :class:`napari_gpuseg.engine.FolderAnnotation`: it shows the open image and its
labels (``<name> SAM labels``, the layer the SAM annotator commits into) and maps the buttons
and keys to the engine object. With the SAM annotator dock open (the default), both share one
:class:`~napari_gpuseg.engine.AnnotationSession`: the annotator follows each image, and its
commits and undos (the session tells the folder) and painted strokes (the layer's paint event)
are saved to ``OUT/<name>_labels.tif`` as they happen.

**Adapt SAM on annotated** / **Train U-Net on annotated** train on the images annotated so far in
the training thread (live loss, Cancel); the new model pre-segments the images still to do.
**Segment the rest** runs a folder job with the pre-segmenter over the images not yet done.
"""
from __future__ import annotations

from pathlib import Path

from qtpy.QtCore import QTimer
from qtpy.QtWidgets import (
    QCheckBox, QComboBox, QFileDialog, QFormLayout, QHBoxLayout, QLabel, QLineEdit, QListWidget, QPushButton,
    QSpinBox, QVBoxLayout, QWidget,
)

from .. import io as gio
from ._bridge import relay, submit
from ._dock import DockWidget, let_go_of_key
from ._plot import HistoryPlot
from ._unet_jobs import train_worker

PRESEGMENT = ("none", "U-Net (bundled)", "SAM automatic")
KEYS = {"next": "Shift-Right", "previous": "Shift-Left", "skip": "Shift-K"}
LOSS = "train loss"


def presegmenter(index: int):
    """The pre-segmenter of the dock's choice ``index`` (see :data:`PRESEGMENT`)."""
    from ..engine.annotate.folder import sam_presegmenter, unet_presegmenter

    return (None, unet_presegmenter, sam_presegmenter)[index]() if index else None


def _train_unet_job(images, labels, out_dir, init, minutes, on_event, progress=None, cancel=None):
    from dataclasses import replace

    from ..engine.annotate.folder_train import train_unet_on_pairs
    from ..engine.unet.finetune_annotated import default_schedule

    config = replace(default_schedule(), max_time_s=60.0 * minutes)
    return train_unet_on_pairs(images, labels, out_dir, init_checkpoint=init, config=config, on_event=on_event,
                               progress=progress, cancel=cancel, policy=train_worker().policy)


def _adapt_sam_job(images, labels, model, minutes, image_name, on_event, progress=None, cancel=None):
    from ..engine.annotate.folder_train import adapt_sam_on_pairs

    return adapt_sam_on_pairs(images, labels, model, minutes=minutes, image_name=image_name, on_event=on_event,
                              progress=progress, cancel=cancel, policy=train_worker().policy)


def _rest_job(folder, items, progress=None, cancel=None):
    return folder.run_rest(items, progress=None if progress is None else (lambda p: progress(p.done, p.total)),
                           cancel=cancel)


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
        self.job = None  # the training or Segment the rest job under way
        self._rest_items = None
        relay()
        self._build_ui()
        self._keys = {key: (lambda _v, fn=getattr(self, name): fn()) for name, key in KEYS.items()}
        for key, bound in self._keys.items():
            self.viewer.bind_key(key, bound, overwrite=True)
        self.destroyed.connect(lambda *_: self.folder is not None and self.folder.close())

    def on_closed(self) -> None:
        """The dock was closed: its training or Segment-the-rest job is cancelled, the folder
        stops reading ahead (labels are saved as they change), and Shift-Right/Left/K are let go
        (a key another dock bound since keeps its binding)."""
        if self.job is not None:
            self.job.cancel()
        if self.folder is not None:
            self.folder.close()
        for key, ours in self._keys.items():
            let_go_of_key(self.viewer, key, ours)

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
        self.adapt_sam_button = QPushButton("Adapt SAM on annotated")
        self.train_unet_button = QPushButton("Train U-Net on annotated")
        self.rest_button = QPushButton("Segment the rest")
        self.cancel_button = QPushButton("Cancel")
        self.minutes = QSpinBox()
        self.minutes.setRange(1, 600)
        self.minutes.setValue(4)
        self.minutes.setSuffix(" min max")
        self.minutes.setToolTip("training time limit of Adapt SAM and Train U-Net")
        train_row, rest_row = QHBoxLayout(), QHBoxLayout()
        for button, fn in ((self.adapt_sam_button, self.adapt_sam), (self.train_unet_button, self.train_unet),
                           (self.rest_button, self.segment_rest), (self.cancel_button, self.cancel)):
            button.clicked.connect(fn)
            button.setEnabled(False)
        train_row.addWidget(self.adapt_sam_button)
        train_row.addWidget(self.train_unet_button)
        rest_row.addWidget(self.minutes)
        rest_row.addWidget(self.rest_button)
        rest_row.addWidget(self.cancel_button)
        self.plot = HistoryPlot((LOSS,), maxlen=1000)
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addWidget(self.open_button)
        layout.addWidget(self.where)
        layout.addLayout(row)
        layout.addWidget(self.status)
        layout.addWidget(self.list, 1)
        layout.addLayout(train_row)
        layout.addLayout(rest_row)
        layout.addWidget(self.plot)
        layout.addWidget(self.progress)

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

        if in_dir is not None:
            self.in_edit.setText(str(in_dir))
        if out_dir is not None:
            self.out_edit.setText(str(out_dir))
        src, dst = self.in_edit.text().strip(), self.out_edit.text().strip()
        if not src or not dst:
            self._report_error("choose an image folder and an output folder")
            return False
        if self.job is not None:
            self._report_error("wait for the training or Segment the rest to end (or cancel it)")
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
        try:
            presegment = presegmenter(self.presegment_box.currentIndex())
            # the annotator embeds each image as it follows it; alone, the folder does
            folder = FolderAnnotation(session, Path(src), Path(dst), self.pattern_edit.text().strip()
                                      or gio.DEFAULT_PATTERN, presegment=presegment,
                                      embed=self.annotator is None, open_first=False)
        except (OSError, ValueError) as exc:
            self._report_error(str(exc))
            return False
        self.folder = folder
        folder.listeners.append(self._refresh)
        folder.label_listeners.append(self._saved)
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
        """Save the labels if they changed without being reported (e.g. napari's own undo of a
        painted stroke); commits, undos and painted strokes are saved as they happen."""
        folder = self.folder
        if folder is None or folder.index is None:
            return
        try:
            folder.flush()
        except OSError as exc:
            self._report_error(f"labels not saved: {exc}")

    def _painted(self, _event=None) -> None:
        """A painted stroke (or fill) ended on the open image's labels layer: save it once the
        layer has written it (napari tells of a stroke before its last pixels are in the data)."""
        if self.folder is None or self.folder.index is None:
            return
        index, layer = self.folder.index, self.labels_layer
        QTimer.singleShot(0, lambda: self.folder is not None and self.folder.index == index
                          and self.labels_layer is layer and self.save_edits())

    def _saved(self, image, error) -> None:
        if error:
            self._report_error(error)
        else:
            self._set_status(f"saved {image.labels_path.name}")

    # -- training and Segment the rest ------------------------------------------------------
    def _pairs(self):
        """The annotated pairs, or None with the reason in the status line."""
        if self.folder is None:
            self._set_status("open a folder first")
            return None
        if self.job is not None:
            self._set_status("a job is already running: wait for it or cancel it")
            return None
        try:
            return self.folder.training_pairs()
        except (OSError, ValueError) as exc:
            self._report_error(str(exc))
            return None

    def train_unet(self):
        """Fine-tune the folder's U-Net (the pre-segmenter's, else the bundled one) on the
        annotated images in the training thread; it then pre-segments the images still to do."""
        from ..engine.annotate.folder_train import current_unet

        pairs = self._pairs()
        if pairs is None:
            return None
        images, labels, which = pairs
        self._start_training(f"Training the U-Net on {len(which)} annotated images…")
        return self._submit(_train_unet_job, images, labels, self.folder.out_dir, current_unet(self.folder),
                            self.minutes.value(), self._forward, on_result=self._trained_unet)

    def adapt_sam(self):
        """Adapt SAM's decoder to the annotated objects in the training thread; the annotator
        prompts with it, and it pre-segments (SAM automatic) unless a U-Net does."""
        pairs = self._pairs()
        if pairs is None:
            return None
        images, labels, which = pairs
        model = self.folder.session.model if isinstance(self.folder.session.model, str) else None
        self._start_training(f"Adapting SAM to the objects of {len(which)} annotated images…")
        return self._submit(_adapt_sam_job, images, labels, model, self.minutes.value(), self.folder.in_dir.name,
                            self._forward, on_result=self._adapted_sam)

    def segment_rest(self):
        """A folder job with the pre-segmenter over the images not yet done, into OUT."""
        if self.folder is None or self.job is not None:
            self._set_status("open a folder first" if self.folder is None else "a job is already running")
            return None
        try:
            items = self.folder.start_rest()
        except ValueError as exc:
            self._report_error(str(exc))
            return None
        self._rest_items = items
        self.progress.setValue(0)
        self._busy(True)
        self._set_status(f"Segmenting {len(items)} images with {self.folder.presegment.describe()}…")
        return self._submit(_rest_job, self.folder, items, on_result=self._rest_done)

    def cancel(self) -> None:
        if self.job is not None:
            self.job.cancel()

    def _start_training(self, text: str) -> None:
        self.plot.clear()
        self.progress.setValue(0)
        self._busy(True)
        self._set_status(text)

    def _forward(self, ev) -> None:
        """Training events, from the training thread to the GUI thread."""
        relay().call.emit(self._on_event, (ev,))

    def _on_event(self, ev) -> None:
        loss = getattr(ev, "loss", None)
        if loss is None and getattr(ev, "kind", None) == "iter":
            loss = ev.train_loss
        if loss is not None:
            self.plot.append(**{LOSS: float(loss)})

    def _submit(self, fn, *args, on_result):
        self.job = submit(fn, *args, worker=train_worker(), inference=False, owner=self, on_result=on_result,
                          on_error=self._failed, on_progress=self._on_progress, on_cancelled=self._cancelled)
        return self.job

    def _busy(self, busy: bool) -> None:
        on = not busy and self.folder is not None
        for button in (self.adapt_sam_button, self.train_unet_button, self.rest_button, self.open_button):
            button.setEnabled(on or (button is self.open_button and not busy))
        self.cancel_button.setEnabled(busy)

    def _end_job(self) -> None:
        self.job = None
        if self._rest_items is not None and self.folder is not None:
            items, self._rest_items = self._rest_items, None
            self.folder.finish_rest(items)
        self._busy(False)

    def _failed(self, exc: BaseException) -> None:
        self._end_job()
        self._report_error(exc)

    def _cancelled(self) -> None:
        rest = self._rest_items is not None
        self._end_job()
        self._set_status("Cancelled: the images done so far keep their labels." if rest
                         else "Cancelled: no model written.")

    def _use(self, fn) -> None:
        """Run ``fn()`` (a change of pre-segmenter); show the open image again if it changed."""
        before = self.folder.image
        fn()
        if self.folder.image is not before:
            self._show()

    def _trained_unet(self, result) -> None:
        from ..engine.annotate.folder import unet_presegmenter
        from ._choices import offer_unet_model

        self._end_job()
        if result.path is None:
            self._set_status("Cancelled: no model written.")
            return
        self._use(lambda: self.folder.set_presegmenter(unet_presegmenter(result.path)))
        offer_unet_model(result.path)
        self._set_status(f"Saved {result.path} ({result.steps} steps on {result.images} images, "
                         f"{result.seconds:.0f} s); it pre-segments the images still to do.")

    def _adapted_sam(self, result) -> None:
        from ..engine.annotate.folder_train import use_adapted_sam
        from ._choices import offer_sam_model

        self._end_job()
        if result.path is None:
            self._set_status("Cancelled: no model written.")
            return
        if not offer_sam_model(result.path) or self.annotator is None:
            self.folder.session.set_model(result.path)
        changed = []
        self._use(lambda: changed.append(use_adapted_sam(self.folder, result.path)))
        then = ("SAM automatic with it pre-segments the images still to do" if changed[0]
                else "the U-Net still pre-segments; clicks use the adapted decoder")
        self._set_status(f"Saved {result.path} ({result.steps} steps, {result.seconds:.0f} s); {then}.")

    def _rest_done(self, report) -> None:
        n = len(self._rest_items or [])
        self._end_job()
        errors = sum(1 for r in report.rows if r.status == "error")
        self._set_status(f"Segmented {n - errors} of {n} images into {self.folder.out_dir}"
                         + (f" ({errors} failed: see report.csv)" if errors else "")
                         + "; open one to correct it.")

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
        self.labels_layer.events.paint.connect(self._painted)
        self.viewer.layers.selection.active = self.image_layer  # the annotator follows the image
        # what this image is (the last image's "saved ..." does not stay)
        self._set_status(f"{im.name}: {im.state}, {im.objects} object{'s' * (im.objects != 1)}")
        self._busy(self.job is not None)
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
