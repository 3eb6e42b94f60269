"""U-Net train dock: Image + Labels layers -> a checkpoint, with a live loss/metric plot.

Training runs in its own worker thread (so the shared inference worker stays free for
prediction docks), with gradients enabled; events reach the GUI thread through the Qt
relay of ``_bridge``. The checkpoint is written whenever validation improves.
"""
from __future__ import annotations


from qtpy.QtWidgets import (
    QCheckBox, QComboBox, QDoubleSpinBox, QFileDialog, QFormLayout, QHBoxLayout, QLineEdit,
    QPushButton, QSpinBox, QVBoxLayout,
)

from ..engine.runtime.worker import InferenceWorker
from ._bridge import relay
from ._choices import fill_layer_combos, layer_array, watch_layers
from ._dock import DockWidget
from ._loss_plot import LossPlot
from ._unet_jobs import default_output, train_worker

def _train_job(image, labels, config, out_path, init, on_event, progress=None, cancel=None):
    from ..engine.unet.training import train_unet

    result = train_unet(image, labels, config, out_path=out_path, policy=train_worker().policy,
                        on_event=on_event, progress=progress, cancel=cancel, init_checkpoint=init,
                        data_summary={"source": "napari layers"})
    return {"checkpoint": result.checkpoint, "best_score": result.best_score, "stopped": result.stopped,
            "seconds": result.seconds, "best_epoch": result.best_epoch}


class UNetTrainWidget(DockWidget):
    """Layers, architecture, schedule, output file; Train / Cancel; live plot."""

    TITLE = "U-Net train"

    @property
    def worker(self) -> InferenceWorker:
        """Training jobs go to their own worker thread."""
        return train_worker()

    def __init__(self, napari_viewer=None, parent=None):
        super().__init__(parent)
        self.viewer = napari_viewer
        self.setObjectName("UNetTrainWidget")
        relay()  # created on the GUI thread, used from the training thread
        self.job = None
        self.result: dict | None = None
        self.events: list = []

        self.image_combo = QComboBox()
        self.labels_combo = QComboBox()
        self.init_combo = QComboBox()
        self.init_combo.addItems(["From scratch", "Fine-tune bundled model"])
        self.depth = _spin(1, 6, 3)
        self.base = _spin(4, 128, 16)
        self.norm = QComboBox()
        self.norm.addItems(["batch", "instance", "group", "none"])
        self.crop = _spin(32, 1024, 128, step=32)
        self.batch = _spin(1, 256, 8)
        self.epochs = _spin(1, 10000, 30)
        self.iters = _spin(1, 100000, 40)
        self.lr = QDoubleSpinBox()
        self.lr.setDecimals(5)
        self.lr.setRange(1e-5, 1.0)
        self.lr.setSingleStep(1e-4)
        self.lr.setValue(2e-3)
        self.val_fraction = QDoubleSpinBox()
        self.val_fraction.setRange(0.0, 0.5)
        self.val_fraction.setSingleStep(0.05)
        self.val_fraction.setValue(0.15)
        self.patience = _spin(1, 1000, 8)
        self.compile = QCheckBox("torch.compile")
        self.checkpointing = QCheckBox("Gradient checkpointing")
        self.out_path = QLineEdit(str(default_output()))
        browse = QPushButton("…")
        browse.clicked.connect(self._browse)
        out_row = QHBoxLayout()
        out_row.addWidget(self.out_path)
        out_row.addWidget(browse)

        form = QFormLayout()
        form.addRow("Image", self.image_combo)
        form.addRow("Labels", self.labels_combo)
        form.addRow("Start", self.init_combo)
        form.addRow("Depth / base", _row(self.depth, self.base))
        form.addRow("Normalisation", self.norm)
        form.addRow("Crop / batch", _row(self.crop, self.batch))
        form.addRow("Epochs × iters", _row(self.epochs, self.iters))
        form.addRow("Learning rate", self.lr)
        form.addRow("Validation", _row(self.val_fraction, self.patience))
        form.addRow("", _row(self.compile, self.checkpointing))
        form.addRow("Save to", out_row)
        self.train_button, buttons = self._make_run_buttons("Train", self.train, self.cancel)
        self._make_status_parts("")
        self.plot = LossPlot(validation=True, maxlen=400)
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addLayout(buttons)
        layout.addWidget(self.progress)
        layout.addWidget(self.plot)
        layout.addWidget(self.status)
        layout.addStretch(1)
        watch_layers(self.viewer, self.refresh_layers)

    def refresh_layers(self, *_args) -> None:
        fill_layer_combos(self.viewer, [(self.image_combo, "Image"), (self.labels_combo, "Labels")])

    def _browse(self) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Save checkpoint", self.out_path.text(), "*.pt")
        if path:
            self.out_path.setText(path)

    def config(self):
        from ..engine.unet.training import TrainConfig
        from ..models.unet import UNetConfig

        model = UNetConfig(depth=self.depth.value(), base=self.base.value(), norm=self.norm.currentText())
        return TrainConfig(model=model.to_dict(), crop_size=self.crop.value(), batch_size=self.batch.value(),
                           epochs=self.epochs.value(), iters_per_epoch=self.iters.value(),
                           lr=float(self.lr.value()), val_fraction=float(self.val_fraction.value()),
                           patience=self.patience.value(), compile=self.compile.isChecked(),
                           gradient_checkpointing=self.checkpointing.isChecked(),
                           warmup_iters=min(50, self.epochs.value() * self.iters.value() // 5 + 1))

    def train(self):
        img_name, lab_name = self.image_combo.currentText(), self.labels_combo.currentText()
        if self.viewer is None or not img_name or not lab_name:
            self.status.setText("Pick an Image layer and a Labels layer.")
            return None
        image = layer_array(self.viewer.layers[img_name])
        labels = layer_array(self.viewer.layers[lab_name])
        if getattr(self.viewer.layers[img_name], "rgb", False):
            from ..engine.normalize import model_input

            image = model_input(image, rgb=True)
        if image.shape != labels.shape:
            self.status.setText(f"Image {image.shape} and labels {labels.shape} differ in shape.")
            return None
        if not labels.any():
            self.status.setText("The labels layer is empty: paint some objects first.")
            return None
        init = None
        if self.init_combo.currentIndex() == 1:
            from ..engine.unet.unet_checkpoint import bundled_model_path

            init = bundled_model_path()
        config = self.config()
        self.events.clear()
        self.plot.clear()
        self.progress.setValue(0)
        self._set_busy(True)
        self.status.setText("Training…")
        forward = lambda ev: relay().call.emit(self._on_event, (ev,))  # noqa: E731
        self.job = self._submit_job(_train_job, image.copy(), labels.copy(), config, self.out_path.text().strip(),
                                    init, forward, inference=False, on_result=self._done,
                                    on_error=self._failed, on_progress=self._on_progress,
                                    on_cancelled=self._cancelled)
        return self.job

    def cancel(self) -> None:
        if self.job is not None:
            self.job.cancel()

    def _on_event(self, ev) -> None:
        self.events.append(ev)
        self.plot.add_event(ev)
        if ev.kind != "iter" and ev.val_score is not None:
            self.status.setText(f"epoch {ev.epoch + 1}: loss {ev.train_loss:.3f}, val F1 {ev.val_f1:.3f}, "
                                f"fg IoU {ev.val_fg_iou:.3f} (best score {ev.best_score:.3f})")

    def _finish(self, text: str) -> None:
        self._set_busy(False)
        self.status.setText(text)

    def _done(self, result: dict) -> None:
        self.result = result
        self._finish(f"Saved {result['checkpoint']} ({result['stopped']}, {result['seconds']:.0f} s). "
                     "Use it in the U-Net predict dock: Model → From file.")

    def _failed(self, exc: BaseException) -> None:
        self._set_busy(False)
        self._report_error(exc)

    def _cancelled(self) -> None:
        self._finish("Cancelled; the best checkpoint so far (if any) is on disk.")


def _spin(lo: int, hi: int, value: int, step: int = 1) -> QSpinBox:
    box = QSpinBox()
    box.setRange(lo, hi)
    box.setSingleStep(step)
    box.setValue(value)
    return box


def _row(*widgets) -> QHBoxLayout:
    row = QHBoxLayout()
    for w in widgets:
        row.addWidget(w)
    return row
