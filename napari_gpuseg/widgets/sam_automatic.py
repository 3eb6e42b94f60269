"""SAM automatic dock: instance labels from detector/shapes/CSV boxes or from a point grid.

A thin skin over :mod:`napari_gpuseg.engine.sam.automatic.boxes` and
:mod:`napari_gpuseg.engine.sam.automatic.everything`: reads the image plane(s) and box sources on the
GUI thread, runs everything else in the shared inference worker (which also holds the
annotator's model and embedding cache), and writes the result into a Labels layer.
"""
from __future__ import annotations

import time

import numpy as np
from napari.layers import Image, Shapes
from qtpy.QtWidgets import (
    QCheckBox, QComboBox, QDoubleSpinBox, QFileDialog, QFormLayout, QGroupBox, QHBoxLayout,
    QLabel, QLineEdit, QPushButton, QSpinBox, QVBoxLayout,
)

from ..engine.sam.automatic.everything import AutomaticParams, segment_everything_batch
from ..engine.box_files import boxes_for_planes
from ..engine.sam.automatic.box_stack import segment_box_planes
from ..engine.sam.loader import load_engine
from ..engine.runtime.worker import InferenceWorker, default_worker
from ..engine.stacks import label_offsets, shift_ids
from ._big_layer import lazy_data, run_sam_blocks
from ._choices import (automatic_defaults, browse_checkpoint, chosen_sam_model, fill_layer_combos, fill_sam_models,
                       is_box_trained, is_decoder_tuned, watch_layers)
from ._dock import DockWidget, auto_spin
from ._first_layer import warm_up
from ._prompts import boxes_xyxy, plane, plane_index

MODE_BOXES, MODE_EVERYTHING = "Boxes -> SAM (detector + SAM)", "Segment everything (point grid)"
SOURCES = {
    "Detector: auto (U-Net if installed)": "auto",
    "Detector: threshold": "threshold",
    "Detector: U-Net": "unet",
    "Shapes layer (rectangles)": "shapes",
    "CSV file (x0,y0,x1,y1)": "csv",
}
# (attribute, label, min, max, step/decimals) of the segment-everything parameters shown
_INT_PARAMS = [("points_per_side", "Points per side", 1, 128), ("crop_n_layers", "Crop layers", 0, 3),
               ("min_mask_region_area", "Min region area (px)", 0, 100000)]
_FLOAT_PARAMS = [("pred_iou_thresh", "Predicted IoU threshold"), ("stability_score_thresh", "Stability threshold"),
                 ("stability_score_offset", "Stability offset"), ("box_nms_thresh", "Box NMS threshold")]


class SamAutomaticWidget(DockWidget):
    TITLE = "SAM automatic"

    def __init__(self, napari_viewer, worker: InferenceWorker | None = None, parent=None):
        super().__init__(parent)
        self.viewer = napari_viewer
        self.worker = worker or default_worker()
        self.labels_layer = None
        self.last_result = None  # (indices, list of AutomaticResult) of the last run
        self._job = None
        self._started = 0.0
        self._build_ui()
        watch_layers(self.viewer, self._refresh_layers)
        self._apply_model_defaults()
        warm_up(self)  # napari's one-off work for a first labels layer, before the result

    # -- UI -----------------------------------------------------------------------
    def _build_ui(self) -> None:
        self.model_combo = QComboBox()
        # the default model: in box mode it outlines nuclei more tightly than LiteMedSAM (F1@0.75
        # 0.90 against 0.79 from ground-truth boxes; docs/benchmarks.md, SAM automatic)
        # then the user's adapted decoders (the annotator's "Adapt to these objects"), newest first
        fill_sam_models(self.model_combo)
        self.model_combo.activated.connect(self._on_model_chosen)
        self.image_combo = QComboBox()
        self.mode_combo = QComboBox()
        self.mode_combo.addItems([MODE_BOXES, MODE_EVERYTHING])
        self.mode_combo.currentIndexChanged.connect(self._update_visibility)
        self.hint_label = QLabel()
        self.hint_label.setWordWrap(True)
        self._build_box_group()
        self._build_param_group()
        self.stack_check = QCheckBox("Run on the whole stack")
        self.embed_batch_spin = auto_spin("Images (tiles) per encoder call; Auto: from free memory on a GPU, timed on a CPU")
        self.prompt_batch_spin = auto_spin("Prompts (boxes or points) per decoder call; Auto adapts to memory",
                                           maximum=4096)
        self.run_button, buttons = self._make_run_buttons("Run", self.run, self.cancel, cancel_enabled=True)
        self._make_status_parts()

        form = QFormLayout()
        form.addRow("Model", self.model_combo)
        form.addRow("Image", self.image_combo)
        form.addRow("Mode", self.mode_combo)
        batch = QFormLayout()
        batch.addRow("Encoder batch", self.embed_batch_spin)
        batch.addRow("Prompt batch", self.prompt_batch_spin)
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addWidget(self.hint_label)
        layout.addWidget(self.box_group)
        layout.addWidget(self.param_group)
        layout.addWidget(self.stack_check)
        layout.addLayout(batch)
        layout.addLayout(buttons)
        layout.addWidget(self.progress)
        layout.addWidget(self.status)
        layout.addStretch(1)

    def _build_box_group(self) -> None:
        """Box mode: where boxes come from, padding, minimum area."""
        self.source_combo = QComboBox()
        self.source_combo.addItems(list(SOURCES))
        self.source_combo.currentIndexChanged.connect(self._update_visibility)
        self.shapes_combo = QComboBox()
        self.csv_edit = QLineEdit()
        self.csv_edit.setPlaceholderText("boxes.csv with x0,y0,x1,y1 (optional z) columns")
        self.csv_button = QPushButton("…")
        self.csv_button.clicked.connect(self._browse_csv)
        self.padding_spin = QDoubleSpinBox()
        self.padding_spin.setRange(0, 50)
        self.padding_spin.setValue(2.0)
        self.padding_spin.setToolTip("Pixels added around every box before it goes to SAM")
        self.min_area_spin = QSpinBox()
        self.min_area_spin.setRange(0, 100000)
        self.min_area_spin.setValue(15)
        self.min_area_spin.setToolTip("Holes, islands and objects smaller than this (px) are removed")
        csv_row = QHBoxLayout()
        csv_row.addWidget(self.csv_edit)
        csv_row.addWidget(self.csv_button)
        self.box_group = QGroupBox("Boxes")
        bf = QFormLayout(self.box_group)
        bf.addRow("Source", self.source_combo)
        bf.addRow("Shapes layer", self.shapes_combo)
        bf.addRow("CSV", csv_row)
        bf.addRow("Box padding (px)", self.padding_spin)
        bf.addRow("Min area (px)", self.min_area_spin)

    def _build_param_group(self) -> None:
        """Segment everything: the official generator's parameters."""
        self.param_group = QGroupBox("Segment everything")
        pf = QFormLayout(self.param_group)
        self.param_widgets: dict[str, QSpinBox | QDoubleSpinBox] = {}
        for name, label, lo, hi in _INT_PARAMS:
            sb = QSpinBox()
            sb.setRange(lo, hi)
            self.param_widgets[name] = sb
            pf.addRow(label, sb)
        for name, label in _FLOAT_PARAMS:
            sb = QDoubleSpinBox()
            sb.setRange(0.0, 10.0 if name == "stability_score_offset" else 1.0)
            sb.setDecimals(3)
            sb.setSingleStep(0.01)
            self.param_widgets[name] = sb
            pf.addRow(label, sb)
        self.defaults_button = QPushButton("Model defaults")
        self.defaults_button.clicked.connect(self._apply_model_defaults)
        pf.addRow(self.defaults_button)

    @property
    def model_name(self) -> str:
        """The model chosen: a name, or a file (an adapted decoder's entry shows its name)."""
        return chosen_sam_model(self.model_combo)

    @property
    def mode(self) -> str:
        return "boxes" if self.mode_combo.currentText() == MODE_BOXES else "everything"

    @property
    def source(self) -> str:
        return SOURCES[self.source_combo.currentText()]

    def _refresh_layers(self, event=None) -> None:
        fill_layer_combos(self.viewer, [(self.image_combo, Image), (self.shapes_combo, Shapes)],
                          prefer_active=True)

    def _update_visibility(self, _i=None) -> None:
        boxes = self.mode == "boxes"
        self.box_group.setVisible(boxes)
        self.param_group.setVisible(not boxes)
        self.shapes_combo.setEnabled(self.source == "shapes")
        self.csv_edit.setEnabled(self.source == "csv")
        self.csv_button.setEnabled(self.source == "csv")
        box_model = is_box_trained(self.model_name)
        if box_model and not boxes:
            text = ("This model was trained with boxes: single points give poor masks (mean IoU "
                    "about 0.05 on nuclei). Use 'Boxes -> SAM' with a detector or your own boxes.")
        elif box_model:
            text = "Box mode: the right mode for this box-trained model."
        elif boxes:
            text = "Each box becomes one object; boxes are decoded in large batches."
        elif is_decoder_tuned(self.model_name):
            text = ("A grid of point prompts in native tiles, with the settings measured for this "
                    "microscopy decoder ('Model defaults'); masks are filtered, de-duplicated and painted by score.")
        else:
            text = "A grid of point prompts; masks are filtered, de-duplicated and painted by score."
        self.hint_label.setText(text)

    def _apply_model_defaults(self) -> None:
        """The point grid's settings for the model; a box-trained model also goes to box mode
        (other models keep the mode the user chose: both modes suit them)."""
        params = automatic_defaults(self.model_name)
        for name, widget in self.param_widgets.items():
            widget.setValue(getattr(params, name))
        if is_box_trained(self.model_name):
            self.mode_combo.setCurrentText(MODE_BOXES)
        self._update_visibility()

    def _on_model_chosen(self, _index: int) -> None:
        if browse_checkpoint(self.model_combo, self):
            self._apply_model_defaults()

    def _browse_csv(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Boxes CSV", "", "CSV (*.csv)")
        if path:
            self.csv_edit.setText(path)

    def params(self) -> AutomaticParams:
        values = {name: w.value() for name, w in self.param_widgets.items()}
        base = automatic_defaults(self.model_name)
        for k, v in values.items():
            setattr(base, k, v)
        return base

    # -- running -------------------------------------------------------------------
    def _image_layer(self) -> Image | None:
        name = self.image_combo.currentText()
        return self.viewer.layers[name] if name in self.viewer.layers else None

    def _indices(self, layer: Image) -> list[tuple]:
        ndim = layer.data.ndim - (1 if layer.rgb else 0)
        if ndim <= 2:
            return [()]
        if not self.stack_check.isChecked():
            return [plane_index(layer, self.viewer)]
        lead = layer.data.shape[: ndim - 2]
        return [tuple(int(i) for i in np.unravel_index(k, lead)) for k in range(int(np.prod(lead)))]

    def _boxes_for(self, layer: Image, indices: list[tuple]):
        """Per-plane box arrays read on the GUI thread, or detector names for the worker."""
        if self.source == "shapes":
            name = self.shapes_combo.currentText()
            if name not in self.viewer.layers:
                raise ValueError("choose a Shapes layer with rectangles around the objects")
            return [boxes_xyxy(self.viewer.layers[name], idx, image=layer) for idx in indices]
        if self.source == "csv":
            path = self.csv_edit.text().strip()
            if not path:
                raise ValueError("choose a CSV file with x0, y0, x1, y1 columns")
            ndim = layer.data.ndim - (1 if layer.rgb else 0)
            shape = tuple(layer.data.shape[:ndim])
            return boxes_for_planes(path, shape[:-2], shape[-2:], indices)
        return self.source  # a detector, run in the worker

    def run(self) -> None:
        layer = self._image_layer()
        if layer is None:
            self._set_status("add an image layer first")
            return
        if lazy_data(layer) is not None and not layer.rgb:  # a big, lazily opened image: in blocks
            return run_sam_blocks(self, layer)
        indices = self._indices(layer)
        try:
            boxes = self._boxes_for(layer, indices) if self.mode == "boxes" else None
        except (ValueError, OSError) as exc:
            self._on_error(exc)
            return
        planes = [np.array(plane(layer, idx), copy=True) for idx in indices]
        self._started = time.perf_counter()
        self._set_status(f"running {self.mode} on {len(planes)} plane(s)…")
        self._set_busy(True, toggle_cancel=False)
        self._job = self._submit_job(
            self._job_run, self.model_name, self.mode, planes, boxes, self.params(),
            self.padding_spin.value(), self.min_area_spin.value(),
            self.embed_batch_spin.value() or None, self.prompt_batch_spin.value() or None,
            tag="sam-automatic",
            on_result=lambda r, ly=layer, ix=indices: self._on_result(ly, ix, r),
            on_error=self._on_error, on_progress=self._on_progress, on_cancelled=self._on_cancelled)

    def _job_run(self, model, mode, planes, boxes, params, padding, min_area, embed_batch, prompt_batch,
                 progress=None, cancel=None):
        """Runs in the worker thread."""
        policy = self.worker.policy
        engine = self.worker.model(("sam", model, policy), lambda: load_engine(model, policy), replace=True)
        if mode == "boxes":
            return segment_box_planes(engine, planes, boxes, policy=policy, padding=padding,
                                      batch_size=prompt_batch, embed_batch_size=embed_batch,
                                      min_area=min_area, progress=progress, cancel=cancel)
        return segment_everything_batch(engine, planes, params, batch_size=prompt_batch,  # kept: no logits
                                        embed_batch_size=embed_batch, progress=progress, cancel=cancel,
                                        keep_logits=False)

    def _labels_for(self, layer: Image):
        shape = tuple(layer.data.shape[:-1] if layer.rgb else layer.data.shape)
        name = f"{layer.name} SAM automatic"
        if name in self.viewer.layers and self.viewer.layers[name].data.shape == shape:
            return self.viewer.layers[name]
        if name in self.viewer.layers:
            self.viewer.layers.remove(name)
        ndim = len(shape)
        return self.viewer.add_labels(np.zeros(shape, np.int32), name=name,
                                      scale=layer.scale[-ndim:], translate=layer.translate[-ndim:])

    def _on_result(self, layer: Image, indices: list[tuple], results) -> None:
        self.run_button.setEnabled(True)
        if layer not in self.viewer.layers:
            return
        self.labels_layer = self._labels_for(layer)
        data = self.labels_layer.data
        n = 0
        for idx, res, offset in zip(indices, results, label_offsets([r.labels for r in results])):
            lab = res.labels
            target = data[idx] if idx else data
            target[...] = shift_ids(lab, offset)
            n += int(len(np.unique(lab)) - 1)
        self.labels_layer.refresh()
        self.last_result = (indices, results)
        self._set_status(f"{n} objects in {len(indices)} plane(s), {time.perf_counter() - self._started:.1f} s")

    def cancel(self) -> None:
        n = self.worker.cancel("sam-automatic")
        self._set_status(f"cancelling {n} job(s)…" if n else "nothing to cancel")

    # -- callbacks ----------------------------------------------------------------------
    def _on_cancelled(self) -> None:
        self._set_busy(False, toggle_cancel=False)
        self._set_status("cancelled")

    def _on_error(self, exc: BaseException) -> None:
        self._set_busy(False, toggle_cancel=False)
        self._report_error(exc)
