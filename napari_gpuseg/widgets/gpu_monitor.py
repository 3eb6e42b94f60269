"""GPU monitor dock: device, precision, live memory and utilisation, history plot."""
from __future__ import annotations

from qtpy.QtCore import QTimer
from qtpy.QtWidgets import (
    QFormLayout, QHBoxLayout, QLabel, QPushButton, QVBoxLayout,
)

from ..engine.runtime import memory
from ..engine.runtime.device import device_name, get_policy
from ._dock import DockWidget
from ._plot import HistoryPlot

fmt = memory.format_bytes


class _WrappedLabel(QLabel):
    """A word-wrapped label that keeps the height of all its lines: a dock squeezed by the
    window's height (docked below the annotator at napari's default size) otherwise cut a long
    CPU name's second line off, since Qt lays docks out without height-for-width."""

    def __init__(self, text: str):
        super().__init__(text)
        self.setWordWrap(True)

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt name
        super().resizeEvent(event)
        self.setMinimumHeight(self.heightForWidth(self.width()))


class GpuMonitorWidget(DockWidget):
    """Refreshes about twice a second while open; reading the probes is cheap
    (docs/benchmarks.md)."""

    def __init__(self, napari_viewer=None, interval_ms: int = 500, parent=None):
        super().__init__(parent)
        self.viewer = napari_viewer
        policy = get_policy()
        self.device = policy.device
        self.is_gpu = self.device.type == "cuda"
        self.setObjectName("GpuMonitorWidget")

        self.device_label = _WrappedLabel(device_name(self.device))
        self.precision_label = QLabel(f"{policy.precision} ({policy.reason})")
        self.fields: dict[str, QLabel] = {}
        form = QFormLayout()
        form.addRow("Device", self.device_label)
        form.addRow("Precision", self.precision_label)
        rows = (("allocated", "Allocated"), ("reserved", "Reserved"), ("peak", "Peak"),
                ("free", "Free / total"), ("util", "Utilisation"), ("temp", "Temp / power"))
        if not self.is_gpu:
            rows = (("rss", "Process RSS"), ("system", "System RAM"), ("gpu", "GPU"))
        for key, title in rows:
            self.fields[key] = QLabel("…")
            form.addRow(title, self.fields[key])

        names = ("allocated MiB", "reserved MiB") if self.is_gpu else ("process RSS MiB",)
        self.plot = HistoryPlot(names)
        self.reset_button = QPushButton("Reset peak")
        self.empty_button = QPushButton("Empty cache")
        self.reset_button.clicked.connect(self.reset_peak)
        self.empty_button.clicked.connect(self.empty_cache)
        self.reset_button.setEnabled(self.is_gpu)
        self.empty_button.setEnabled(self.is_gpu)
        buttons = QHBoxLayout()
        buttons.addWidget(self.reset_button)
        buttons.addWidget(self.empty_button)

        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addWidget(self.plot)
        layout.addLayout(buttons)
        layout.addStretch(1)

        self.last: memory.MemorySnapshot | None = None
        self.timer = QTimer(self)
        self.timer.setInterval(interval_ms)
        self.timer.timeout.connect(self.refresh)
        self.timer.start()
        self.refresh()

    def refresh(self) -> None:
        snap = memory.snapshot(self.device)
        self.last = snap
        f = self.fields
        if self.is_gpu:
            f["allocated"].setText(fmt(snap.allocated))
            f["reserved"].setText(fmt(snap.reserved))
            f["peak"].setText(fmt(snap.peak))
            f["free"].setText(f"{fmt(snap.free)} / {fmt(snap.total)}")
            if snap.utilization is None:
                f["util"].setText(snap.nvml_error or "n/a")
                f["temp"].setText("n/a")
            else:
                f["util"].setText(f"{snap.utilization:.0f} %")
                temp = f"{snap.temperature:.0f} °C" if snap.temperature is not None else "n/a"
                power = f"{snap.power:.0f} W" if snap.power is not None else "n/a"
                f["temp"].setText(f"{temp} / {power}")
            self.plot.append(**{"allocated MiB": snap.allocated / 2**20,
                                "reserved MiB": snap.reserved / 2**20})
        else:
            f["rss"].setText(fmt(snap.process_rss))
            f["system"].setText(f"{fmt(snap.system_used)} / {fmt(snap.system_total)}")
            f["gpu"].setText("none detected: running on CPU")
            self.plot.append(**{"process RSS MiB": snap.process_rss / 2**20})

    def reset_peak(self) -> None:
        memory.reset_peak(self.device)
        self.refresh()

    def empty_cache(self) -> None:
        memory.empty_cache()
        self.refresh()

    def on_closed(self) -> None:
        """The dock was closed (napari keeps its widget): it stops polling the device."""
        self.timer.stop()

    def closeEvent(self, event) -> None:  # noqa: N802
        self.timer.stop()
        super().closeEvent(event)
