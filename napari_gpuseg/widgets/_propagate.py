"""Propagate panel of the SAM annotator: grow the previewed (or last committed) object
through the stack, or every object committed on the current slice ("Segment all objects
in 3D"). Runs as a worker job; masks are drawn into the labels layer as they come, a
cancel keeps what is done, and one undo removes the whole propagation."""
from __future__ import annotations

import time
from collections import deque

import numpy as np
from qtpy.QtCore import QTimer
from qtpy.QtWidgets import QDoubleSpinBox, QFormLayout, QGroupBox, QHBoxLayout, QPushButton, QSpinBox

from ..engine.sam.propagate import PropagateOptions, propagate_all
from ._prompts import plane_index


class PropagatePanel(QGroupBox):
    def __init__(self, dock, parent=None):
        super().__init__("Propagate through the stack", parent)
        self.dock = dock
        self._pending: deque = deque()  # (object index, z, mask) from the worker thread
        self._ids: list[int] = []
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
        viewer = dock.viewer
        viewer.bind_key("Shift-P", lambda _v: self.propagate(), overwrite=True)

    def options(self) -> PropagateOptions:
        return PropagateOptions(min_iou=float(self.min_iou.value()), min_area=int(self.min_area.value()),
                                min_contrast=float(self.min_contrast.value()))

    @property
    def running(self) -> bool:
        return self._job is not None

    # -- starting points ---------------------------------------------------------------
    def _stack_index(self):
        d = self.dock
        if not d._image_alive() or d.labels_layer is None:
            return None
        if d.labels_layer.data.ndim != 3:
            d._set_status("propagation needs a stack (Z, Y, X): this image has no slices")
            return None
        index = plane_index(d.image_layer, d.viewer)
        return index[0] if len(index) == 1 else None

    def propagate(self) -> None:
        """The previewed object, else the object committed last on this slice."""
        d, z = self.dock, self._stack_index()
        if z is None or self.running:
            return
        labels = d.labels_layer.data
        if d.has_preview():
            _layer, _index, _gen, result = d._preview
            start, obj_id = result.full(labels.shape[1:]), None
            d.clear_prompts()
        else:
            last = next((c for c in reversed(d.committer.history) if c.index == (z,)), None)
            if last is None:
                d._set_status("propagate: preview or commit an object on this slice first")
                return
            obj_id = last.ids[-1]
            start = labels[z] == obj_id
        self._run(z, [start], [obj_id])

    def propagate_all(self) -> None:
        """Every object on the current slice, all at once."""
        d, z = self.dock, self._stack_index()
        if z is None or self.running:
            return
        plane = d.labels_layer.data[z]
        ids = [int(i) for i in np.unique(plane) if i != 0]
        if not ids:
            d._set_status("segment all in 3D: commit objects on this slice first")
            return
        self._run(z, [plane == i for i in ids], ids)

    # -- the job -------------------------------------------------------------------------
    def _run(self, z: int, starts: list[np.ndarray], ids: list[int | None]) -> None:
        d = self.dock
        labels = d.labels_layer.data
        d.committer.open_group(labels)
        nxt = d.committer.next_id(labels)
        self._ids = []
        for i in ids:
            self._ids.append(i if i is not None else nxt)
            nxt += i is None
        volume, model, opts = d.image_layer.data, d.model_name, self.options()
        self._t0 = time.perf_counter()
        d._set_status(f"propagating {len(starts)} object(s) from slice {z}…")
        self._timer.start()
        self._job = d._submit(self._job_propagate, model, volume, z, starts, opts, tag="propagate",
                              on_result=self._done, on_error=self._failed,
                              on_progress=d._on_progress, on_cancelled=lambda *_: self._done(None))

    def _job_propagate(self, model, volume, z, starts, opts, progress=None, cancel=None):
        engine = self.dock._engine(model)
        return propagate_all(engine, volume, z, starts, opts,
                             on_slice=lambda i, zz, m: self._pending.append((i, zz, m)),
                             progress=progress, cancel=cancel)

    def _drain(self) -> None:
        d = self.dock
        if not self._pending or d.labels_layer is None:
            return
        labels = d.labels_layer.data
        while self._pending:
            i, z, mask = self._pending.popleft()
            d.committer.commit_slice(labels, z, mask, self._ids[i])
        d.labels_layer.refresh()

    def _done(self, results) -> None:
        self._drain()
        self._timer.stop()
        self._job = None
        if results is None or any(r.cancelled for r in results):
            self.dock._set_status("propagation cancelled: the slices done so far are kept")
            return
        spans = [r.extent for r in results if r.extent]
        n = sum(len(r.masks) for r in results)
        self.dock._set_status(f"propagated {len(results)} object(s) over {n} slice masks "
                              f"({', '.join(f'{a}-{b}' for a, b in spans)}) in "
                              f"{time.perf_counter() - self._t0:.1f} s")

    def _failed(self, exc: BaseException) -> None:
        self._drain()
        self._timer.stop()
        self._job = None
        self.dock._on_error(exc)
