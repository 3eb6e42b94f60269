"""Adapt SAM dock: fine-tune the SAM decoder to your images in a few minutes.

From an Image layer and a Labels layer (objects committed with the SAM annotator, or a
U-Net result corrected by hand), the decoder of the chosen model learns from simulated
clicks and boxes on those objects (``engine.sam.training.finetune``); the image encoder stays
frozen, so the image is embedded once. Runs in the training thread with a live loss and
Cancel; the decoder is saved beside the image (``<image>_sam_adapted.pt``) and the SAM
annotator switches to it.
"""
from __future__ import annotations

import numpy as np
from qtpy.QtWidgets import QComboBox, QFormLayout, QSpinBox

from ._choices import chosen_sam_model, fill_sam_models, image_file, offer_sam_model
from ._plot import HistoryPlot
from ._train_dock import TrainDock
from ._unet_jobs import default_output, train_worker

LOSS = "train loss"


def adapt_config(minutes: int, objects: int):
    """The Adapt SAM schedule, the annotator's "Adapt to these objects" one
    (:func:`~napari_gpuseg.engine.sam.training.adapt.few_object_config`): a fixed number of
    visits per annotated object, so a GPU learns what a CPU does, sooner; ``minutes`` bounds
    the wait on a slow machine."""
    from ..engine.sam.training.adapt import few_object_config

    return few_object_config(objects, minutes)


def adapt_job(image, labels, model, minutes, out_path, on_event, image_name=None, progress=None, cancel=None):
    """Runs in the training thread: fine-tune, save (marked as adapted to ``image_name``'s
    objects, as the annotator's adapted decoders are), return what the dock shows."""
    from ..engine.sam.training.click_choice import store_click_choice
    from ..engine.sam.training.finetune import finetune_sam

    objects = int(len(np.unique(labels[labels > 0])))
    res = finetune_sam([image], [labels], model=model, config=adapt_config(minutes, objects), out_path=out_path,
                       on_event=on_event, progress=progress, cancel=cancel, policy=train_worker().policy,
                       meta={"adapted": {"image": image_name, "objects": objects}})
    path, stopped = res.path, res.stopped
    # which candidate a first click on these objects keeps, measured on them (a cancel meanwhile
    # removes the file: nothing is kept)
    if path is not None and store_click_choice(res.engine, path, [image], [labels], cancel=cancel) is None:
        path, stopped = None, "cancelled"
    return {"path": path, "stopped": stopped, "seconds": res.seconds,
            "steps": res.history[-1]["step"] if res.history else 0}


class SamAdaptWidget(TrainDock):
    """Image, Labels, starting model, time limit; Train / Cancel with a live loss."""

    TITLE = "Adapt SAM"
    CANCELLED = "Cancelled: nothing was saved."

    def __init__(self, napari_viewer=None, parent=None):
        super().__init__(parent)
        self._init_train_dock(napari_viewer)
        self.setObjectName("SamAdaptWidget")
        self.model_combo = QComboBox()
        fill_sam_models(self.model_combo, browse=False)  # with the user's adapted decoders, newest first
        self.model_combo.setToolTip("the decoder to start from (a model adapted here or in the SAM annotator "
                                    "joins the list)")
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
        self._layout_dock(form, buttons, HistoryPlot((LOSS,), maxlen=1000),
                          "Label a few objects (annotator or corrected U-Net), then Adapt SAM.")

    def train(self):
        from ..engine.unet.finetune_annotated import default_output_path

        chosen = self._chosen_pair()
        if chosen is None:
            return None
        layer, image, labels = chosen
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
        return self._submit_train(adapt_job, image.copy(), labels.copy(), self.model_name,
                                  self.minutes.value(), out, forward, image_file(layer) or layer.name)

    @property
    def model_name(self) -> str:
        """The decoder to start from: a name, or a file (an adapted decoder's entry shows its name)."""
        return chosen_sam_model(self.model_combo)

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
        else:  # cancelled once training was done, while its first-click choice was measured
            self._set_status(self.CANCELLED)
