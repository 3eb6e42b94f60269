"""Adapt U-Net dock: annotate -> fine-tune -> predict the rest -> correct -> again.

Fine-tunes the bundled (or the last adapted) U-Net on an Image + Labels pair, the loss
restricted to the annotated region (whole image, a rectangle from a Shapes layer, or
the bounding region of the labels; see ``engine.unet.finetune_annotated``), in the training
thread with a live loss plot and Cancel. The new checkpoint is saved beside the image,
selected in the U-Net predict dock and offered to the Batch folder dock; "Predict the
rest" adds its labels as a layer the user can correct and train on again.
"""
from __future__ import annotations


import numpy as np
from qtpy.QtWidgets import QComboBox, QFormLayout, QPushButton, QSpinBox

from ._bridge import relay, submit
from ._loss_plot import LossPlot
from ._prompts import in_pixels_of
from ._choices import image_file, layer_array, offer_unet_model
from ._train_dock import TrainDock
from ._unet_jobs import default_output, predict_job, train_worker

WHOLE, RECTANGLE, LABELS = "Whole image", "Rectangle (Shapes layer)", "Bounding region of the labels"
REGION_KEYS = {WHOLE: "whole", RECTANGLE: "rectangle", LABELS: "labels"}
BUNDLED, CURRENT = "Bundled nuclei model", "Last adapted model"


def _finetune_job(image, labels, region, rectangle, init, config, out_path, on_event, progress=None,
                  cancel=None):
    from ..engine.unet.finetune_annotated import finetune_unet

    res = finetune_unet(image, labels, region=region, rectangle=rectangle, init_checkpoint=init,
                        config=config, out_path=out_path, policy=train_worker().policy,
                        on_event=on_event, progress=progress, cancel=cancel)
    return {"checkpoint": res.checkpoint, "stopped": res.stopped, "seconds": res.seconds,
            "iterations": res.history[-1]["iteration"] if res.history else 0}


def rectangle_of(shapes_layer, image=None) -> tuple[float, float, float, float]:
    """(y0, x0, y1, x1) of the last shape in a Shapes layer (its bounding box, in the pixels
    of the ``image`` layer when given, else in the layer's data coordinates)."""
    if shapes_layer is None or not len(shapes_layer.data):
        raise ValueError("draw a rectangle in a Shapes layer first")
    pts = in_pixels_of(image, shapes_layer, shapes_layer.data[-1])[:, -2:]
    (y0, x0), (y1, x1) = pts.min(0), pts.max(0)
    return float(y0), float(x0), float(y1), float(x1)


class UNetAdaptWidget(TrainDock):
    """Image, Labels, region, schedule; Train / Cancel with live loss; Predict the rest."""

    TITLE = "Adapt U-Net"

    def __init__(self, napari_viewer=None, parent=None):
        super().__init__(parent)
        from ..engine.unet.finetune_annotated import default_schedule

        self._init_train_dock(napari_viewer)  # model_path: the last adapted checkpoint
        self.setObjectName("UNetAdaptWidget")
        relay()
        self.losses: list[float] = []
        d = default_schedule()
        self.shapes_combo = QComboBox()
        self.extra_combos = [(self.shapes_combo, "Shapes")]
        self.region = QComboBox()
        self.region.addItems([LABELS, RECTANGLE, WHOLE])
        self.region.setToolTip("pixels outside the annotated region are ignored in the loss")
        self.start = QComboBox()
        self.start.addItems([BUNDLED, CURRENT])
        self.iters = QSpinBox()
        self.iters.setRange(1, 100000)
        self.iters.setValue(d.epochs * d.iters_per_epoch)
        self.minutes = QSpinBox()
        self.minutes.setRange(1, 600)
        self.minutes.setValue(int(round(d.max_time_s / 60)))
        self.minutes.setSuffix(" min max")
        form = QFormLayout()
        form.addRow("Image", self.image_combo)
        form.addRow("Labels", self.labels_combo)
        form.addRow("Annotated region", self.region)
        form.addRow("Rectangle from", self.shapes_combo)
        form.addRow("Start from", self.start)
        form.addRow("Iterations", self.iters)
        form.addRow("Time limit", self.minutes)
        self.train_button, buttons = self._make_run_buttons("Train", self.train, self.cancel)
        self.predict_button = QPushButton("Predict the rest")
        self.predict_button.setEnabled(False)
        self.predict_button.clicked.connect(self.predict)
        buttons.addWidget(self.predict_button)
        self._layout_dock(form, buttons, LossPlot(validation=False, maxlen=1000))

    def config(self):
        from dataclasses import replace

        from ..engine.unet.finetune_annotated import default_schedule

        d = default_schedule()
        n = self.iters.value()
        return replace(d, epochs=max(1, n // d.iters_per_epoch), iters_per_epoch=min(n, d.iters_per_epoch),
                       warmup_iters=min(d.warmup_iters, max(1, n // 5)), max_time_s=60.0 * self.minutes.value())

    def train(self):
        chosen = self._chosen_pair()
        if chosen is None:
            return None
        layer, image, labels = chosen
        if getattr(layer, "rgb", False):
            from ..engine.normalize import model_input

            image = model_input(image, rgb=True)
        if image.shape != labels.shape or labels.ndim != 2:
            self._set_status(f"Need a 2D image and labels of one shape, got {image.shape} and {labels.shape}.")
            return None
        region = REGION_KEYS[self.region.currentText()]
        rectangle = None
        try:
            if region == "rectangle":
                name = self.shapes_combo.currentText()
                rectangle = rectangle_of(self.viewer.layers[name] if name else None, image=layer)
            from ..engine.unet.finetune_annotated import region_mask

            mask = region_mask(labels.shape, region, labels=labels, rectangle=rectangle)
            if not np.any(mask & (labels > 0)):
                raise ValueError("no labelled objects inside the annotated region")
        except ValueError as exc:
            self._set_status(f"Cannot train: {exc}")
            return None
        init = self.model_path if self.start.currentText() == CURRENT and self.model_path else None
        from ..engine.unet.finetune_annotated import default_output_path

        src = image_file(layer)
        out = default_output_path(src, base=default_output().parent)
        self.losses.clear()
        self.plot.clear()
        self.progress.setValue(0)
        self._busy(True)
        self._set_status("Fine-tuning…")
        forward = lambda ev: relay().call.emit(self._on_event, (ev,))  # noqa: E731
        return self._submit_train(_finetune_job, image.copy(), labels.copy(), region, rectangle, init,
                                  self.config(), out, forward)

    def predict(self):
        name = self.image_combo.currentText()
        if not self.model_path or not name:
            self._set_status("Train a model first.")
            return None
        layer = self.viewer.layers[name]
        self._busy(True)
        self._set_status("Predicting…")
        self.job = submit(predict_job, layer_array(layer), self.model_path, bool(getattr(layer, "rgb", False)),
                          ["labels"], None, 0.25, 0, owner=self,
                          on_result=lambda r, layer=layer: self._predicted(r, layer), on_error=self._failed,
                          on_progress=self._on_progress, on_cancelled=self._cancelled)
        return self.job

    # -- results ------------------------------------------------------------
    def _busy(self, busy: bool) -> None:
        self._set_busy(busy)
        self.predict_button.setEnabled(not busy and self.model_path is not None)

    def _on_event(self, ev) -> None:
        if ev.kind == "iter":
            self.losses.append(ev.train_loss)
            self.plot.add_event(ev)
            self._set_status(f"iteration {ev.iteration}/{ev.total_iterations}: loss {ev.train_loss:.3f}")

    def _done(self, result: dict) -> None:
        self.result = result
        self.model_path = result["checkpoint"]
        self._busy(False)
        if self.model_path:
            self.start.setCurrentText(CURRENT)
            offer_unet_model(self.model_path)
        self._set_status(f"Saved {result['checkpoint']} ({result['iterations']} iterations, "
                         f"{result['seconds']:.0f} s); selected in U-Net predict. Predict the rest next.")

    def _predicted(self, result: dict, layer) -> None:
        self._busy(False)
        name = f"{layer.name} adapted labels"
        if name in self.viewer.layers:
            self.viewer.layers[name].data = result["labels"]
        else:
            self.viewer.add_labels(result["labels"], name=name, scale=layer.scale, translate=layer.translate)
        self.labels_combo.setCurrentText(name)  # correct it, then Train again
        self._set_status(f"{int(result['labels'].max())} objects in '{name}': correct them and Train again "
                         "(region: whole image).")
