"""What the two adapt docks (Adapt SAM, Adapt U-Net) share: an Image and a Labels choice
kept in step with the viewer, the layout form / buttons / loss plot / progress / status,
a training job in the training thread with Cancel, and how a failure or a cancel ends."""
from __future__ import annotations

from qtpy.QtWidgets import QComboBox, QVBoxLayout

from ._choices import fill_layer_combos, layer_array, watch_layers
from ._dock import DockWidget
from ._unet_jobs import train_worker


class TrainDock(DockWidget):
    """Base of the adapt docks. Subclasses build their form, call :meth:`_layout_dock`,
    and give ``_done`` (the job's result) and ``_busy(bool)`` when more than the run and
    Cancel buttons change."""

    CANCELLED = "Cancelled."

    def _init_train_dock(self, viewer) -> None:
        self.viewer = viewer
        self.job = None
        self.result: dict | None = None
        self.model_path: str | None = None
        self.image_combo, self.labels_combo = QComboBox(), QComboBox()
        self.extra_combos: list = []  # more (combo box, layer kind) pairs to keep filled

    def _layout_dock(self, form, buttons, plot, idle: str = "") -> None:
        self.plot = plot
        self._make_status_parts(idle)
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addLayout(buttons)
        layout.addWidget(self.plot)
        layout.addWidget(self.progress)
        layout.addWidget(self.status)
        layout.addStretch(1)
        watch_layers(self.viewer, self.refresh_layers)

    def refresh_layers(self, *_args) -> None:
        fill_layer_combos(self.viewer, [(self.image_combo, "Image"), (self.labels_combo, "Labels")]
                          + self.extra_combos)

    def _chosen_pair(self):
        """``(image layer, image, labels)`` of the chosen layers (full resolution), or None
        with the reason in the status line."""
        img_name, lab_name = self.image_combo.currentText(), self.labels_combo.currentText()
        if self.viewer is None or not img_name or not lab_name:
            self._set_status("Pick an Image layer and a Labels layer.")
            return None
        layer = self.viewer.layers[img_name]
        return layer, layer_array(layer), layer_array(self.viewer.layers[lab_name])

    def _busy(self, busy: bool) -> None:
        self._set_busy(busy)

    def _submit_train(self, fn, *args):
        """``fn(*args)`` in the training thread, with this dock's callbacks."""
        from ._bridge import submit

        self.job = submit(fn, *args, worker=train_worker(), inference=False, owner=self,
                          on_result=self._done, on_error=self._failed, on_progress=self._on_progress,
                          on_cancelled=self._cancelled)
        return self.job

    def cancel(self) -> None:
        if self.job is not None:
            self.job.cancel()

    def _failed(self, exc: BaseException) -> None:
        self.job = None  # a failed job is not kept (its error, its inputs, its memory): a retry gets it
        self._busy(False)
        self._report_error(exc)  # status line, napari notification and the log

    def _cancelled(self) -> None:
        self.job = None
        self._busy(False)
        self._set_status(self.CANCELLED)
