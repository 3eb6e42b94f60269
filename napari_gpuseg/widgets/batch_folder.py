"""Batch folder dock: segment every image of a folder with the folder pipeline.

A thin skin over :func:`napari_gpuseg.engine.jobs.pipeline.run_folder`: the run happens in a
background thread (the pipeline's own reader/device/writer threads under it), progress
and results come back to the GUI thread through the Qt relay of ``_bridge``. The GUI
thread never segments, reads or writes images, except when the user double-clicks a
result row to open that image and its labels.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

from qtpy.QtCore import Qt, QTimer, QUrl
from qtpy.QtGui import QDesktopServices
from qtpy.QtWidgets import (
    QAbstractItemView, QCheckBox, QComboBox, QFileDialog, QFormLayout, QHBoxLayout,
    QHeaderView, QLabel, QLineEdit, QPushButton, QSpinBox, QTableWidget,
    QTableWidgetItem, QVBoxLayout, QWidget,
)

from .. import io as gio
from ..io import label_files
from ..engine.runtime import memory
from ..engine.runtime.device import PRECISIONS, get_policy
from ..engine.runtime.cancel import Cancelled, CancelToken
from ..engine.jobs.method_registry import DEFAULT_FOLDER_METHOD, available_methods, method_description, parse_options
from ..engine.jobs.pipeline import Progress, RunReport, output_paths, run_folder
from ._bridge import alive, relay
from ._choices import take_unet_models
from ._dock import DockWidget, auto_spin
from ._first_layer import warm_up

COLUMNS = ("file", "objects", "time (s)", "status", "error")
RUN_ON = ("this computer", "Dask cluster")


def _eta(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    seconds = int(round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


class BatchFolderWidget(DockWidget):
    """Input folder, pattern, output folder, method and knobs; Start / Cancel; results."""

    TITLE = "Batch folder"

    def __init__(self, napari_viewer=None, parent=None):
        super().__init__(parent)
        self.viewer = napari_viewer
        self.setObjectName("BatchFolderWidget")
        take_unet_models(self)
        relay()  # created on the GUI thread, used from the run thread
        self.token: CancelToken | None = None
        self.thread: threading.Thread | None = None
        self.report: RunReport | None = None
        self.error: str | None = None
        self.last_progress: Progress | None = None
        self._run_dirs: tuple[Path, Path] | None = None
        self._t_cancel: float | None = None
        form = self._build_form()
        self.start_button, buttons = self._make_run_buttons("Start", self.start, self.cancel)
        self._make_status_parts()
        self.progress.setFormat("%v / %m")
        self.memory_label = QLabel("")
        self._build_table()
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addLayout(buttons)
        layout.addWidget(self.progress)
        layout.addWidget(self.status)
        layout.addWidget(self.memory_label)
        layout.addWidget(self.table, 1)
        layout.addWidget(self.open_button)
        self.timer = QTimer(self)
        self.timer.setInterval(500)
        self.timer.timeout.connect(self._refresh_memory)
        if self.viewer is not None:
            warm_up(self)  # napari's one-off work for the first layers, before a result is opened

    def _build_form(self) -> QFormLayout:
        """The folders, method and knobs."""
        self.in_dir = QLineEdit()
        self.out_dir = QLineEdit()
        self.out_dir.setPlaceholderText("default: <input>/labels")
        self.pattern = QLineEdit(gio.DEFAULT_PATTERN)
        self.recursive = QCheckBox("include subfolders")
        self.overwrite = QCheckBox("redo files that already have output")
        self.method = QComboBox()
        for name in available_methods():
            self.method.addItem(name)
            self.method.setItemData(self.method.count() - 1, method_description(name),
                                     Qt.ItemDataRole.ToolTipRole)
        self.method.setCurrentText(DEFAULT_FOLDER_METHOD)  # the bundled U-Net, as from the terminal
        self.model = QLineEdit()
        self.model.setPlaceholderText("default: the bundled U-Net; for SAM methods the annotator's model")
        self.options = QLineEdit()
        self.options.setPlaceholderText("method options, e.g. detector=unet, min_size=20, channel=1")
        self.boxes = QLineEdit()  # sam-boxes: boxes from files (<stem>.csv or <stem>_labels.tif)
        self.boxes.setPlaceholderText("sam-boxes: folder of <name>.csv / <name>_labels.tif (else a detector)")
        self.image_batch = QSpinBox(minimum=1, maximum=256, value=4)
        self.image_batch.setToolTip("images of the same shape per device call")
        self.batch_size = auto_spin("prompts or tiles per device call inside the method (Auto: "
                                    "from free memory, halved on out-of-memory)", maximum=4096)
        self.io_workers = QSpinBox(minimum=1, maximum=32, value=2)
        self.precision = QComboBox()
        self.precision.addItems(list(PRECISIONS))
        self.run_on = QComboBox()  # this computer, or a Dask cluster (address or a local one)
        self.run_on.addItems(list(RUN_ON))
        self.address = QLineEdit()
        self.address.setPlaceholderText("tcp://HOST:PORT (empty: start a local cluster)")
        self.dashboard = QLabel("")
        self.dashboard.setOpenExternalLinks(True)
        self.run_on.currentTextChanged.connect(self._run_on_changed)
        self.address.setEnabled(False)

        form = QFormLayout()
        form.addRow("Input folder", self._with_browse(self.in_dir, self._browse_in))
        form.addRow("File pattern", self.pattern)
        form.addRow("", self.recursive)
        form.addRow("Output folder", self._with_browse(self.out_dir, self._browse_out))
        form.addRow("", self.overwrite)
        form.addRow("Method", self.method)
        form.addRow("Model", self._with_browse(self.model, self._browse_model))
        form.addRow("Options", self.options)
        form.addRow("Box files", self._with_browse(self.boxes, self._browse_boxes))
        form.addRow("Images per call", self.image_batch)
        form.addRow("Prompts/tiles per call", self.batch_size)
        form.addRow("I/O workers", self.io_workers)
        form.addRow("Precision", self.precision)
        form.addRow("Run on", self.run_on)
        form.addRow("Cluster address", self.address)
        form.addRow("", self.dashboard)
        return form

    def _run_on_changed(self, text: str) -> None:
        """A cluster runs one file per task: the address applies, the in-process knobs do not."""
        cluster = text == RUN_ON[1]
        self.address.setEnabled(cluster)
        for spin in (self.image_batch, self.io_workers):
            spin.setEnabled(not cluster)
            if not spin.property("own_tip"):
                spin.setProperty("own_tip", spin.toolTip() or " ")
            spin.setToolTip("runs on this computer only (a cluster runs one file per task)" if cluster
                            else spin.property("own_tip").strip())

    def _build_table(self) -> None:
        """The results table (double-click a row: open the image and its labels)."""
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        header = self.table.horizontalHeader()
        for col in range(len(COLUMNS)):
            mode = QHeaderView.ResizeMode.Stretch if col in (0, 4) else QHeaderView.ResizeMode.ResizeToContents
            header.setSectionResizeMode(col, mode)
        self.table.verticalHeader().setVisible(False)
        self.table.setToolTip("double-click a row to open the image and its labels")
        self.table.cellDoubleClicked.connect(lambda row, _col: self.open_row(row))
        self.open_button = QPushButton("Open output folder")
        self.open_button.clicked.connect(self.open_output_folder)

    # -- helpers ------------------------------------------------------------------------
    def _with_browse(self, edit: QLineEdit, slot) -> QWidget:
        box = QWidget()
        row = QHBoxLayout(box)
        row.setContentsMargins(0, 0, 0, 0)
        row.addWidget(edit)
        button = QPushButton("…")
        button.setMaximumWidth(30)
        button.clicked.connect(slot)
        row.addWidget(button)
        return box

    def _browse_in(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Input folder", self.in_dir.text())
        if path:
            self.in_dir.setText(path)

    def _browse_out(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Output folder", self.out_dir.text())
        if path:
            self.out_dir.setText(path)

    def _browse_boxes(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Folder of box files", self.boxes.text())
        if path:
            self.boxes.setText(path)

    def use_model(self, path: str) -> None:
        """Take a U-Net checkpoint made elsewhere (e.g. by Adapt U-Net) when the method is a
        U-Net method; other methods keep their model."""
        if "unet" in self.method.currentText().lower():
            self.model.setText(str(path))

    def _browse_model(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Model file", "", "Checkpoints (*.pt *.pth)")
        if path:
            self.model.setText(path)

    def output_folder(self) -> Path:
        text = self.out_dir.text().strip()
        return Path(text) if text else Path(self.in_dir.text().strip()) / "labels"

    @property
    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def _deliver(self, fn, *args) -> None:
        """From the run thread: call ``fn(*args)`` on the GUI thread."""

        def call(*a):
            try:
                fn(*a)
            except RuntimeError as exc:  # the dock was closed and deleted meanwhile
                if "deleted" not in str(exc):
                    raise

        relay().call.emit(call, args)

    # -- run ----------------------------------------------------------------------------
    def start(self) -> None:
        if self.running:
            return
        in_dir = Path(self.in_dir.text().strip())
        if self.in_dir.text().strip() and in_dir.is_file():
            self._fail(f"the input must be a folder of images; {in_dir} is a file (put it in a folder of its own)")
            return
        if not self.in_dir.text().strip() or not in_dir.is_dir():
            self._fail(f"input folder not found: {in_dir}")
            return
        out_dir = self.output_folder()
        try:
            options = parse_options(self.options.text())
        except ValueError as exc:
            self._fail(str(exc))
            return
        options.update(model=self.model.text().strip() or None,
                       batch_size=self.batch_size.value() or None)
        if self.boxes.text().strip():
            options["boxes"] = self.boxes.text().strip()
        self._run_dirs = (in_dir, out_dir)
        kwargs = dict(
            method=self.method.currentText(),
            method_options=options,
            pattern=self.pattern.text().strip() or "*",
            recursive=self.recursive.isChecked(),
            io_workers=self.io_workers.value(),
            image_batch=self.image_batch.value(),
            overwrite=self.overwrite.isChecked(),
            precision=self.precision.currentText(),
        )
        self.token = CancelToken()
        self.report, self.error, self.last_progress, self._t_cancel = None, None, None, None
        self.table.setRowCount(0)
        self.progress.setRange(0, 0)  # busy until the first event gives the total
        self.status.setText("starting…")
        self._set_running(True)
        self.dashboard.setText("")
        if self.run_on.currentText() == RUN_ON[1]:  # "" starts a local cluster for the run
            kwargs.update(cluster=self.address.text().strip() or "local", io_workers=None, image_batch=None,
                          on_dashboard=lambda link: self._deliver(self._show_dashboard, link))
        self.thread = threading.Thread(target=self._run, args=(in_dir, out_dir, kwargs, self.token),
                                       name="gpuseg-batch-dock", daemon=True)
        self.thread.start()

    def _run(self, in_dir: Path, out_dir: Path, kwargs: dict, token: CancelToken) -> None:
        """Runs in the background thread."""
        progress = lambda p: self._deliver(self._on_run_progress, p)  # noqa: E731
        try:  # here or on a Dask cluster: the same progress, cancel and report
            report = run_folder(in_dir, out_dir, progress=progress, cancel=token, **kwargs)
        except Cancelled:  # e.g. while the cluster started
            self._deliver(self._on_failed, "cancelled")
        except Exception as exc:  # noqa: BLE001 - shown to the user
            self._deliver(self._on_failed, f"{type(exc).__name__}: {exc}")
        else:
            self._deliver(self._on_finished, report)

    def cancel(self) -> None:
        if self.token is not None and self.running:
            self._t_cancel = time.perf_counter()
            self.token.cancel()
            self.status.setText("cancelling…")
            self.cancel_button.setEnabled(False)

    def _set_running(self, running: bool) -> None:
        self._set_busy(running)
        if running:
            self.timer.start()
        else:
            self.timer.stop()
            self._refresh_memory()

    # -- results (GUI thread) -------------------------------------------------------------
    def _add_row(self, row) -> None:
        r = self.table.rowCount()
        self.table.insertRow(r)
        values = (row.file, "" if row.objects is None else str(row.objects),
                  f"{row.seconds:.2f}", row.status, row.error)
        for c, text in enumerate(values):
            item = QTableWidgetItem(text)
            if c == 4:
                item.setToolTip(text)
            self.table.setItem(r, c, item)

    def _on_run_progress(self, p: Progress) -> None:
        self.last_progress = p
        self._on_progress(p.done, p.total)
        if self._t_cancel is None:
            self.status.setText(
                f"{p.done}/{p.total} · {p.ok} ok, {p.skipped} skipped, {p.errors} errors · "
                f"{p.images_per_s:.2f} images/s · ETA {_eta(p.eta_s)}")
        if p.row is not None:
            self._add_row(p.row)

    def _on_finished(self, report: RunReport) -> None:
        self.report = report
        self.thread = None
        self._set_running(False)
        self.table.setRowCount(0)
        for row in report.rows:
            self._add_row(row)
        self.progress.setRange(0, max(1, report.total))
        self.progress.setValue(len(report.rows))
        where = report.report_error or f"report: {report.report_csv}"
        notes = [n for n in (report.disk_error and f"stopped: {report.disk_error}", *report.warnings) if n]
        self.status.setText(" · ".join([report.summary(), *notes, where]))

    def _show_dashboard(self, link: str) -> None:
        self.dashboard.setText(f'<a href="{link}">Dask dashboard</a> {link}' if link else "")

    def _on_failed(self, message: str) -> None:
        self.thread = None
        self._set_running(False)
        self.progress.setRange(0, 1)
        self._fail(message)

    def _fail(self, message: str) -> None:
        self.error = message
        self._report_error(message)

    def _refresh_memory(self) -> None:
        snap = memory.snapshot(get_policy().device)
        if snap.is_gpu:
            util = "" if snap.utilization is None else f" · util {snap.utilization:.0f} %"
            text = (f"GPU memory {memory.format_bytes(snap.allocated)} allocated, "
                    f"{memory.format_bytes(snap.free)} free of {memory.format_bytes(snap.total)}{util}")
        else:
            text = f"process memory {memory.format_bytes(snap.process_rss)} (CPU)"
        self.memory_label.setText(text)

    def open_row(self, row: int) -> None:
        """Open the image of result ``row`` and its labels in the viewer. Both files are read
        in a background thread (a large image takes seconds to read, and the window would
        freeze meanwhile); the layers are added on the GUI thread once they are in memory."""
        if self.viewer is None or self._run_dirs is None:
            return
        in_dir, out_dir = self._run_dirs
        rel = self.table.item(row, 0).text()
        status = self.table.item(row, 3).text()
        if status == "error":
            self.status.setText(f"{rel}: {self.table.item(row, 4).text()}")
            return
        labels_path = output_paths(in_dir, out_dir, in_dir / rel)[0]
        self.status.setText(f"opening {rel}…")
        threading.Thread(target=self._read_result, args=(rel, in_dir / rel, labels_path),
                         name="gpuseg-batch-open", daemon=True).start()

    def _read_result(self, rel: str, image_path: Path, labels_path: Path) -> None:
        """Runs in a background thread: reads one result, then hands it to the GUI thread."""
        try:
            loaded = gio.load_image(image_path)
            labels = label_files.read_labels(labels_path)
        except Exception as exc:  # noqa: BLE001 - shown to the user
            self._deliver(self._fail, f"cannot open {rel}: {exc}")
            return
        self._deliver(self._show_result, rel, loaded, labels)

    def _show_result(self, rel: str, loaded, labels) -> None:
        if self.viewer is None or not alive(self):  # the window was closed during the read
            return
        name = Path(rel).stem
        self.viewer.add_image(loaded.data, name=name, rgb=loaded.rgb)
        self.viewer.add_labels(labels, name=f"{name} labels")
        self.status.setText(f"opened {rel}")

    def open_output_folder(self) -> None:
        folder = self._run_dirs[1] if self._run_dirs else self.output_folder()
        if folder.is_dir():
            QDesktopServices.openUrl(QUrl.fromLocalFile(str(folder)))
        else:
            self.status.setText(f"output folder does not exist yet: {folder}")

    def closeEvent(self, event) -> None:  # noqa: N802 - Qt name
        self.cancel()
        self.timer.stop()
        super().closeEvent(event)
