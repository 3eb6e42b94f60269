"""The SAM annotator's later layers: SAM negative and ``<image> SAM labels``.

Following a new image makes only the layers a first prompt needs (SAM positive, SAM boxes,
SAM preview): its view embeds with less of the GUI thread's work beside it, and the window
is free sooner. The other two come one at a time once the first tile is embedded or the
first mask shown and the prompts have rested (:data:`REST_IDLE_MS`), or at once when
something needs them (Shift-N, commit, propagate).
"""
from __future__ import annotations

from qtpy.QtCore import Qt, QTimer
from qtpy.QtWidgets import QApplication

from ._annotation_layers import add_rest, toggle_click_sign

REST_IDLE_MS = 600
"""How long the prompts rest before a later layer is made (making one freezes the window for
a moment: never while the user edits a prompt, a decode runs or a mouse button is down)."""


class LaterLayers:
    """Mixed into :class:`~.sam_annotator.SamAnnotatorWidget` (its ``_layers``, ``viewer``,
    ``image_layer``, ``_preview_job`` and ``_connect_prompts``)."""

    def _init_later_layers(self) -> None:
        self._rest_timer = QTimer(self)  # SAM negative and the labels layer, after a first prompt
        self._rest_pending = False  # following the image left them for later
        self._rest_timer.setSingleShot(True)
        self._rest_timer.timeout.connect(self._rest_when_idle)

    def _postpone_rest(self) -> None:
        if self._rest_timer.isActive():
            self._rest_timer.start(REST_IDLE_MS)

    @property
    def neg_layer(self):
        """SAM negative (made now if following the image left it for later)."""
        self._make_rest(labels=False)
        return None if self._layers is None else self._layers.neg

    @property
    def labels_layer(self):
        """``<image> SAM labels`` (made now if following the image left it for later)."""
        self._make_rest(neg=False)
        return None if self._layers is None else self._layers.labels

    def _missing(self) -> list[str]:
        """Which of SAM negative and the labels layer the followed image still lacks."""
        lay = self._layers
        if lay is None or not self._image_alive():
            return []
        return [k for k in ("neg", "labels")
                if getattr(lay, k) is None or getattr(lay, k) not in self.viewer.layers]

    def _make_rest(self, neg: bool = True, labels: bool = True) -> None:
        missing = self._missing()
        if not (neg and "neg" in missing or labels and "labels" in missing):
            return
        self._layers = add_rest(self.viewer, self.image_layer, self._layers, neg=neg, labels=labels)
        self._connect_prompts(self._layers)
        if neg:
            self._layers.neg.mode = "add"

    def _rest_soon(self) -> None:
        """Make the rest once the prompts are left alone for :data:`REST_IDLE_MS` (only what
        following the image left for later: a layer the user deleted since stays deleted
        until something needs it)."""
        if self._rest_pending and self._missing() and not self._rest_timer.isActive():
            self._rest_timer.start(REST_IDLE_MS)

    def _rest_when_idle(self) -> None:
        """One layer of the rest per call (each is a short freeze of the window, not one
        long one), never while a prompt decodes or is being drawn."""
        missing = self._missing()
        if not (missing and self._rest_pending):
            self._rest_pending = False
            return
        decoding = self._preview_job is not None and not self._preview_job.wait(0)
        if not decoding and QApplication.mouseButtons() == Qt.MouseButton.NoButton:
            self._make_rest(neg=missing[0] == "neg", labels=missing[0] == "labels")
        if self._missing():
            self._rest_timer.start(REST_IDLE_MS)
        else:
            self._rest_pending = False

    def _toggle_click_sign(self) -> None:
        self._make_rest(labels=False)
        toggle_click_sign(self.viewer, self._layers)
