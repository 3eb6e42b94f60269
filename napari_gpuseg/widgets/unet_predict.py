"""U-Net predict dock: image layer -> instance labels and/or class probabilities.

A thin skin over :mod:`napari_gpuseg.engine.unet.predict`: the network runs in the shared
inference worker (which caches the loaded model), progress and results come back on the
GUI thread through ``_bridge``; the GUI thread only builds layers.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from qtpy.QtWidgets import (
    QCheckBox, QComboBox, QDoubleSpinBox, QFileDialog, QFormLayout, QHBoxLayout, QLineEdit,
    QPushButton, QVBoxLayout,
)

from ._big_layer import add_lazy_labels, block_source, blocks_job, lazy_data, out_folder
from ._choices import fill_layer_combos, layer_array, take_unet_models, watch_layers
from ._unet_jobs import FROM_FILE, predict_job
from ._dock import DockWidget, auto_spin
from ._first_layer import warm_up

BUNDLED = "Bundled nuclei model"
class UNetPredictWidget(DockWidget):
    """Image layer, model (bundled or file), outputs, batch size (Auto), tile, overlap."""

    TITLE = "U-Net predict"

    def __init__(self, napari_viewer=None, parent=None):
        super().__init__(parent)
        self.viewer = napari_viewer
        self.setObjectName("UNetPredictWidget")
        take_unet_models(self)
        self.job = None
        self.last_result: dict | None = None

        self.image_combo = QComboBox()
        self.model_combo = QComboBox()
        self.model_combo.addItems([BUNDLED, FROM_FILE])
        self.model_path = QLineEdit()
        self.model_path.setPlaceholderText("checkpoint .pt")
        self.browse = QPushButton("…")
        self.browse.clicked.connect(self._browse)
        model_row = QHBoxLayout()
        model_row.addWidget(self.model_path)
        model_row.addWidget(self.browse)
        self.model_combo.currentTextChanged.connect(self._model_mode)
        self.out_labels = QCheckBox("Labels")
        self.out_labels.setChecked(True)
        self.out_probs = QCheckBox("Probabilities")
        outputs = QHBoxLayout()
        outputs.addWidget(self.out_labels)
        outputs.addWidget(self.out_probs)
        self.batch = auto_spin("windows per device call; Auto starts from free memory and halves on OOM")
        self.tile = auto_spin("largest window edge; Auto = whole image up to 768 px, else 256-512 px tiles",
                              maximum=2048, step=64)
        self.overlap = QDoubleSpinBox()
        self.overlap.setRange(0.0, 0.9)
        self.overlap.setSingleStep(0.05)
        self.overlap.setValue(0.25)

        form = QFormLayout()
        form.addRow("Image", self.image_combo)
        form.addRow("Model", self.model_combo)
        form.addRow("", model_row)
        form.addRow("Output", outputs)
        form.addRow("Batch size", self.batch)
        form.addRow("Tile", self.tile)
        form.addRow("Overlap", self.overlap)
        self.run_button, buttons = self._make_run_buttons("Run", self.run, self.cancel)
        self._make_status_parts("")
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addLayout(buttons)
        layout.addWidget(self.progress)
        layout.addWidget(self.status)
        layout.addStretch(1)
        self._model_mode(self.model_combo.currentText())
        watch_layers(self.viewer, self.refresh_layers)
        if self.viewer is not None:
            warm_up(self)  # napari's one-off work for a first labels layer, before the result

    # -- UI -----------------------------------------------------------------
    def refresh_layers(self, *_args) -> None:
        fill_layer_combos(self.viewer, [(self.image_combo, "Image")])

    def use_model(self, path: str) -> None:
        """Select the checkpoint ``path`` (a model made elsewhere, e.g. by Adapt U-Net)."""
        self.model_combo.setCurrentText(FROM_FILE)
        self.model_path.setText(str(path))

    def _model_mode(self, text: str) -> None:
        from_file = text == FROM_FILE
        self.model_path.setEnabled(from_file)
        self.browse.setEnabled(from_file)

    def _browse(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "U-Net checkpoint", "", "Checkpoints (*.pt *.pth)")
        if path:
            self.model_path.setText(path)

    # -- actions -------------------------------------------------------------
    def run(self):
        name = self.image_combo.currentText()
        if not name or self.viewer is None:
            self.status.setText("Add an image layer first.")
            return None
        outputs = [k for k, box in (("labels", self.out_labels), ("probabilities", self.out_probs))
                   if box.isChecked()]
        if not outputs:
            self.status.setText("Choose labels and/or probabilities.")
            return None
        model_path = None
        if self.model_combo.currentText() == FROM_FILE:
            model_path = self.model_path.text().strip()
            if not model_path or not Path(model_path).is_file():
                self.status.setText(f"Model file not found: {model_path or '(none)'}")
                return None
        layer = self.viewer.layers[name]
        if lazy_data(layer) is not None and not getattr(layer, "rgb", False):
            return self._run_blocks(layer, model_path)
        image = layer_array(layer)
        self._set_busy(True)
        self.progress.setValue(0)
        self.status.setText(f"Predicting {name} {image.shape}…")
        self.job = self._submit_job(
            predict_job, image, model_path, bool(getattr(layer, "rgb", False)), outputs,
            self.batch.value() or None, float(self.overlap.value()), int(self.tile.value()),
            tag="unet_predict", replace=True,
            on_result=lambda r, layer=layer: self._done(r, layer), on_error=self._failed,
            on_progress=self._on_progress, on_cancelled=self._cancelled,
        )
        return self.job

    def _run_blocks(self, layer, model_path):
        """A lazily opened (dask / zarr) image: in blocks, labels read back lazily."""
        from ..engine.runtime.worker import default_worker

        data = lazy_data(layer)
        options = {"model": model_path, "batch_size": self.batch.value() or None,
                   "overlap": float(self.overlap.value()), "tile": int(self.tile.value()) or None}
        self._set_busy(True)
        self.progress.setValue(0)
        self.status.setText(f"Predicting {layer.name} {tuple(data.shape)} in blocks…")
        self.job = self._submit_job(
            blocks_job, block_source(layer, data), out_folder(layer), "unet",
            {k: v for k, v in options.items() if v is not None}, "unet", default_worker().policy,
            tag="unet_predict", replace=True,
            on_result=lambda r, layer=layer: self._blocks_done(r, layer), on_error=self._failed,
            on_progress=self._on_progress, on_cancelled=self._cancelled)
        return self.job

    def _blocks_done(self, report, layer) -> None:
        self._set_busy(False)
        self.last_result = {"blocks": report}
        if report.cancelled:
            self.status.setText("Cancelled (finished blocks are kept; run again to resume).")
            return
        add_lazy_labels(self.viewer, report, layer, f"{layer.name} U-Net labels")
        self.status.setText(f"Done: {report.objects} objects in {report.blocks} blocks ({report.labels}).")

    def cancel(self) -> None:
        if self.job is not None:
            self.job.cancel()

    def _done(self, result: dict, layer) -> None:
        self._set_busy(False)
        self.last_result = result
        kw = {"scale": layer.scale, "translate": layer.translate}
        if "labels" in result:
            name = f"{layer.name} U-Net labels"
            if name in self.viewer.layers:
                self.viewer.layers[name].data = result["labels"]
            else:
                self.viewer.add_labels(result["labels"], name=name, **kw)
        if "probabilities" in result:
            probs = result["probabilities"]
            axis = probs.ndim - result["spatial_dims"] - 1
            fg = np.take(probs, [1, 2], axis=axis)
            names = [f"{layer.name} interior prob", f"{layer.name} boundary prob"]
            for n in names:
                if n in self.viewer.layers:
                    self.viewer.layers.remove(n)
            self.viewer.add_image(fg, channel_axis=axis, name=names, colormap=["green", "magenta"],
                                  blending="additive", contrast_limits=[0, 1], **kw)
        n = int(result["labels"].max()) if "labels" in result else None
        self.status.setText(f"Done: {n} objects." if n is not None else "Done.")

    def _failed(self, exc: BaseException) -> None:
        self._set_busy(False)
        self._report_error(exc)

    def _cancelled(self) -> None:
        self._set_busy(False)
        self.status.setText("Cancelled.")
