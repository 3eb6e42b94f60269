"""Propagate panel of the SAM annotator: grow the object on display (or the last committed
one) through the stack, or every object committed on the current slice ("Segment all objects
in 3D"), through the dock's session (``AnnotationSession.propagate_async``); masks are drawn
into the labels layer as they come, a cancel keeps what is done, and one undo removes the
whole propagation.

The panel reaches the dock only through what it is given: the viewer, the session and a
few callbacks (the labels layer, whether the image is still there, the prompt preview, the
status line, the progress bar, error reports)."""
from __future__ import annotations

import time
from typing import Callable

from qtpy.QtCore import QTimer
from qtpy.QtWidgets import QDoubleSpinBox, QFormLayout, QGroupBox, QHBoxLayout, QPushButton, QSpinBox

from ..engine.sam.propagation.propagate import PropagateOptions
from ._dock import let_go_of_key


class PropagatePanel(QGroupBox):
    """``labels_layer()``: the labels layer the session writes into (made when missing; None
    without an image); ``image_alive()``: whether the image followed is still in the viewer;
    ``has_preview()`` / ``clear_prompts()``: the prompt on display; ``set_status(text)``,
    ``on_progress(done, total)``, ``on_error(exc)``: the dock's status line, progress bar
    and error report."""

    def __init__(self, viewer, session, *, labels_layer: Callable[[], object], image_alive: Callable[[], bool],
                 has_preview: Callable[[], bool], clear_prompts: Callable[[], None],
                 set_status: Callable[[str], None], on_progress: Callable[[int, int], None],
                 on_error: Callable[[BaseException], None], parent=None):
        super().__init__("Propagate through the stack", parent)
        self.session = session
        self._labels_layer, self._image_alive = labels_layer, image_alive
        self._has_preview, self._clear_prompts = has_preview, clear_prompts
        self._set_status, self._on_progress, self._on_error = set_status, on_progress, on_error
        self._layer = None  # the labels layer of the running propagation
        self._job = None
        self._t0 = 0.0
        self.min_iou = QDoubleSpinBox()
        self.min_iou.setRange(0.0, 1.0)
        self.min_iou.setSingleStep(0.05)
        self.min_iou.setValue(PropagateOptions.min_iou)
        self.min_iou.setToolTip("Stop where the mask overlaps its neighbour slice's mask less than this (IoU)")
        self.min_area = QSpinBox()
        self.min_area.setRange(1, 10_000)
        self.min_area.setValue(PropagateOptions.min_area)
        self.min_area.setToolTip("Stop where the mask is smaller than this (pixels)")
        self.min_contrast = QDoubleSpinBox()
        self.min_contrast.setRange(0.0, 1.0)
        self.min_contrast.setSingleStep(0.05)
        self.min_contrast.setValue(PropagateOptions.min_contrast)
        self.min_contrast.setToolTip("Stop where the object fades out: its contrast against a thin ring around it "
                                     "falls below this share of the start slice's (0: off)")
        self.propagate_btn = QPushButton("Propagate [Shift-P]")
        self.all_btn = QPushButton("Segment all objects in 3D")
        self.propagate_btn.clicked.connect(self.propagate)
        self.all_btn.clicked.connect(self.propagate_all)
        form = QFormLayout(self)
        form.addRow("Min IoU with neighbour", self.min_iou)
        form.addRow("Min area (px)", self.min_area)
        form.addRow("Min contrast (share of start)", self.min_contrast)
        row = QHBoxLayout()
        row.addWidget(self.propagate_btn)
        row.addWidget(self.all_btn)
        form.addRow(row)
        self._timer = QTimer(self)
        self._timer.setInterval(50)
        self._timer.timeout.connect(self._drain)
        self._viewer = viewer
        self._key = lambda _v: self.propagate()
        viewer.bind_key("Shift-P", self._key, overwrite=True)

    def unbind(self) -> None:
        """Let go of Shift-P (its dock was closed); a binding made since by another dock stays."""
        let_go_of_key(self._viewer, "Shift-P", self._key)

    def options(self) -> PropagateOptions:
        return PropagateOptions(min_iou=float(self.min_iou.value()), min_area=int(self.min_area.value()),
                                min_contrast=float(self.min_contrast.value()))

    @property
    def running(self) -> bool:
        return self._job is not None

    # -- the job --------------------------------------------------------------------------
    def propagate(self) -> None:
        """The object on display, else the object committed last on this slice."""
        self._run(every=False)

    def propagate_all(self) -> None:
        """Every object on the current slice, all at once."""
        self._run(every=True)

    def _run(self, every: bool) -> None:
        if self.running or not self._image_alive():
            return
        layer = self._labels_layer()
        if layer is None:
            return
        shown = self._has_preview()
        try:
            self._job = self.session.propagate_async(every, self.options(), on_done=self._done,
                                                     on_progress=self._on_progress, on_error=self._failed,
                                                     on_cancelled=lambda *_: self._done(None))
        except ValueError as exc:  # no stack, nothing to start from
            self._set_status(str(exc))
            return
        self._layer = layer
        if shown and not every:
            self._clear_prompts()
        self._t0 = time.perf_counter()
        n = len(self.session.propagate_ids)
        self._set_status(f"propagating {n} object(s) from slice {self.session.plane[0]}…")
        self._timer.start()

    def _drain(self) -> None:
        if self.session.take_propagated() and self._layer is not None:
            self._layer.refresh()

    def _done(self, results) -> None:
        self._drain()
        self._timer.stop()
        self._job = self._layer = None
        if results is None or any(r.cancelled for r in results):
            self._set_status("propagation cancelled: the slices done so far are kept")
            return
        spans = [r.extent for r in results if r.extent]
        n = sum(len(r.masks) for r in results)
        self._set_status(f"propagated {len(results)} object(s) over {n} slice masks "
                              f"({', '.join(f'{a}-{b}' for a, b in spans)}) in "
                              f"{time.perf_counter() - self._t0:.1f} s")

    def _failed(self, exc: BaseException) -> None:
        self._drain()
        self._timer.stop()
        self._job = self._layer = None
        self._on_error(exc)
