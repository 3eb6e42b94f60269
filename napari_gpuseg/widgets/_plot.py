"""A tiny line plot widget (no extra plotting dependency)."""
from __future__ import annotations

from collections import deque

from qtpy.QtCore import QPointF
from qtpy.QtGui import QColor, QPainter, QPen, QPolygonF
from qtpy.QtWidgets import QSizePolicy, QWidget

COLORS = ("#4fc3f7", "#ffb74d", "#81c784", "#e57373")


class HistoryPlot(QWidget):
    """Draws one or more series as polylines, scaled to a shared y range."""

    def __init__(self, names: tuple[str, ...] = ("value",), maxlen: int = 120, parent=None):
        super().__init__(parent)
        self.names = names
        self.series = {n: deque(maxlen=maxlen) for n in names}
        self.y_max: float | None = None
        self.setMinimumHeight(70)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)

    def append(self, **values: float | None) -> None:
        for name, value in values.items():
            if name in self.series and value is not None:
                self.series[name].append(float(value))
        self.update()

    def set_series(self, name: str, values) -> None:
        self.series[name] = deque(values, maxlen=self.series[name].maxlen)
        self.update()

    def clear(self) -> None:
        for s in self.series.values():
            s.clear()
        self.update()

    def paintEvent(self, event) -> None:  # noqa: N802 - Qt API
        p = QPainter(self)
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        w, h = self.width(), self.height()
        p.fillRect(0, 0, w, h, QColor("#262930"))
        p.setPen(QPen(QColor("#555"), 1))
        p.drawRect(0, 0, w - 1, h - 1)
        data = [s for s in self.series.values() if s]
        if not data:
            p.end()
            return
        top = self.y_max or max(max(s) for s in data) or 1.0
        bottom = min(0.0, min(min(s) for s in data))
        span = (top - bottom) or 1.0
        for i, (name, s) in enumerate(self.series.items()):
            if len(s) < 2:
                continue
            n = s.maxlen or len(s)
            poly = QPolygonF(
                [QPointF(w - 1 - (len(s) - 1 - j) * (w - 2) / max(1, n - 1),
                         h - 2 - (v - bottom) / span * (h - 4)) for j, v in enumerate(s)]
            )
            p.setPen(QPen(QColor(COLORS[i % len(COLORS)]), 1.5))
            p.drawPolyline(poly)
            p.drawText(6, 14 + 14 * i, name)
        p.end()
