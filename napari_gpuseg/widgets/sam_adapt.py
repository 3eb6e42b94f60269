"""Adapt SAM dock: fine-tune the SAM decoder to your images in a few minutes.

From an Image layer and a Labels layer (objects committed with the SAM annotator, or a
U-Net result corrected by hand), the decoder of the chosen model learns from simulated
clicks and boxes on those objects (``engine.sam.finetune``); the image encoder stays
frozen, so the image is embedded once. Runs in the training thread with a live loss and
Cancel; the decoder is saved beside the image (``<image>_sam_adapted.pt``) and the SAM
annotator switches to it.
"""
from __future__ import annotations

from qtpy.QtWidgets import QComboBox, QFormLayout, QSpinBox, QVBoxLayout

from ._choices import fill_layer_combos, image_file, layer_array, offer_sam_model, sam_model_names, watch_layers
from ._dock import DockWidget
from ._plot import HistoryPlot
from ._unet_jobs import default_output, train_worker

LOSS = "train loss"


def adapt_config(minutes: int):
    """The Adapt SAM schedule: time-bound, small steps (one image, no validation split)."""
    from ..engine.sam.finetune import SamTuneConfig

    return SamTuneConfig(max_steps=400, views_per_step=2, objects_per_view=4, lr=1e-4, warmup=5,
                         views_per_image=None, val_fraction=0.0, max_time=60.0 * minutes)


def adapt_job(image, labels, model, minutes, out_path, on_event, progress=None, cancel=None):
    """Runs in the training thread: fine-tune, save, return what the dock shows."""
    from ..engine.sam.finetune import finetune_sam

    res = finetune_sam([image], [labels], model=model, config=adapt_config(minutes), out_path=out_path,
                       on_event=on_event, progress=progress, cancel=cancel, policy=train_worker().policy)
    return {"path": res.path, "stopped": res.stopped, "seconds": res.seconds,
            "steps": res.history[-1]["step"] if res.history else 0}


class SamAdaptWidget(DockWidget):
    """Image, Labels, starting model, time limit; Train / Cancel with a live loss."""

    TITLE = "Adapt SAM"

    def __init__(self, napari_viewer=None, parent=None):
        super().__init__(parent)
        self.viewer = napari_viewer
        self.setObjectName("SamAdaptWidget")
        self.job = None
        self.result: dict | None = None
        self.model_path: str | None = None
        self.image_combo, self.labels_combo = QComboBox(), QComboBox()
        self.model_combo = QComboBox()
        self.model_combo.addItems(sam_model_names())
        self.model_combo.setToolTip("the decoder to start from (a model adapted here joins the list)")
        self.minutes = QSpinBox()
        self.minutes.setRange(1, 120)
        self.minutes.setValue(4)
        self.minutes.setSuffix(" min")
        form = QFormLayout()
        form.addRow("Image", self.image_combo)
        form.addRow("Labels", self.labels_combo)
        form.addRow("Start from", self.model_combo)
        form.addRow("Time limit", self.minutes)
        _run, buttons = self._make_run_buttons("Adapt SAM", self.train, self.cancel)
        self.plot = HistoryPlot((LOSS,), maxlen=1000)
        self._make_status_parts("Label a few objects (annotator or corrected U-Net), then Adapt SAM.")
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addLayout(buttons)
        layout.addWidget(self.plot)
        layout.addWidget(self.progress)
        layout.addWidget(self.status)
        layout.addStretch(1)
        watch_layers(self.viewer, self.refresh_layers)

    def refresh_layers(self, *_args) -> None:
        fill_layer_combos(self.viewer, [(self.image_combo, "Image"), (self.labels_combo, "Labels")])

    def train(self):
        from ..engine.unet.finetune import default_output_path

        img_name, lab_name = self.image_combo.currentText(), self.labels_combo.currentText()
        if self.viewer is None or not img_name or not lab_name:
            self._set_status("Pick an Image layer and a Labels layer.")
            return None
        layer = self.viewer.layers[img_name]
        image, labels = layer_array(layer), layer_array(self.viewer.layers[lab_name])
        if labels.ndim != 2 or image.shape[:2] != labels.shape:
            self._set_status(f"Need a 2D image and 2D labels of one size, got {image.shape} and {labels.shape}.")
            return None
        if not labels.any():
            self._set_status("The labels layer has no objects: commit a few with the SAM annotator first.")
            return None
        out = default_output_path(image_file(layer), base=default_output().parent, suffix="_sam_adapted")
        self.plot.clear()
        self._on_progress(0, 1)
        self._set_busy(True)
        self._set_status("Embedding the image…")
        from ._bridge import relay

        forward = lambda ev: relay().call.emit(self._on_event, (ev,))  # noqa: E731
        self.job = self._submit_train(adapt_job, image.copy(), labels.copy(), self.model_combo.currentText(),
                                      self.minutes.value(), out, forward)
        return self.job

    def _submit_train(self, fn, *args):
        from ._bridge import submit

        return submit(fn, *args, worker=train_worker(), inference=False, owner=self,
                      on_result=self._done, on_error=self._failed, on_progress=self._on_progress,
                      on_cancelled=self._cancelled)

    def cancel(self) -> None:
        if self.job is not None:
            self.job.cancel()

    def _on_event(self, ev) -> None:
        self.plot.append(**{LOSS: ev.loss})
        left = max(0.0, 60.0 * self.minutes.value() - ev.seconds)
        self._set_status(f"step {ev.step}: loss {ev.loss:.3f} ({ev.seconds:.0f} s, at most {left:.0f} s left)")

    def _done(self, result: dict) -> None:
        self.result = result
        self._set_busy(False)
        self.model_path = result["path"]
        if self.model_path:
            if self.model_combo.findText(self.model_path) < 0:
                self.model_combo.insertItem(0, self.model_path)
            self.model_combo.setCurrentText(self.model_path)
            taken = offer_sam_model(self.model_path)
            where = "; the SAM annotator uses it now" if taken else ""
            self._set_status(f"Saved {self.model_path} ({result['steps']} steps, {result['seconds']:.0f} s){where}.")

    def _failed(self, exc: BaseException) -> None:
        self.job = None  # a failed job's memory (weights, optimizer state) is not kept
        self._set_busy(False)
        self._report_error(exc)

    def _cancelled(self) -> None:
        self.job = None
        self._set_busy(False)
        self._set_status("Cancelled: nothing was saved.")
