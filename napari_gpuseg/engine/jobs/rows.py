"""What the in-process and the Dask folder runners share while rows come in: counting
rows by status, the progress callback (rate, ETA), and the closing notes of a report."""
from __future__ import annotations

import time
from typing import Callable, Iterable

from .outputs import describe_method
from .report import ImageStatus, Progress, RunReport


class RowCounter:
    """Adds rows to ``report``, counts them by status and tells ``progress`` (files per
    second over the run so far, and the time left at that rate)."""

    def __init__(self, report: RunReport, progress: Callable[[Progress], None] | None, t_start: float):
        self.report, self.progress, self.t_start = report, progress, t_start
        self.counts = {"ok": 0, "skipped": 0, "error": 0}
        for r in report.rows:
            self.counts[r.status] += 1

    def emit(self, row: ImageStatus | None = None) -> None:
        if self.progress is None:
            return
        now = time.perf_counter()
        c = self.counts
        rate = (c["ok"] + c["error"]) / (now - self.t_start) if now > self.t_start else 0.0
        left = self.report.total - len(self.report.rows)
        self.progress(Progress(len(self.report.rows), self.report.total, rate, left / rate if rate > 0 else None,
                               c["ok"], c["skipped"], c["error"], now - self.t_start, row))

    def add(self, row: ImageStatus, emit: bool = True) -> None:
        self.report.rows.append(row)
        self.counts[row.status] += 1
        if emit:
            self.emit(row)


def close_report(report: RunReport, expected: Iterable[str], why: str, other_method: dict,
                 method: str, model: str) -> None:
    """An error row (``why``) for every expected file without a row (unless the run was
    cancelled), a warning per other method whose outputs were skipped, rows sorted by file."""
    if not report.cancelled:  # every file gets a row, whatever happened
        done = {r.file for r in report.rows}
        report.rows += [ImageStatus(rel, status="error", error=why) for rel in expected if rel not in done]
    for (m, mdl), n in sorted(other_method.items()):
        report.warnings.append(
            f"{n} existing output(s) were written by method {describe_method(m, mdl)}, not "
            f"{describe_method(method, model)}; they were skipped as they are (use --overwrite to redo them)")
    report.rows.sort(key=lambda r: r.file)
