"""Run reports of folder jobs: one status row per file, progress events, CSV/JSON output."""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from ...io import label_files, tables


@dataclass
class ImageStatus:
    """One row of the run report."""

    file: str
    shape: str = ""
    objects: int | None = None
    seconds: float = 0.0
    status: str = "ok"  # ok | skipped | error
    error: str = ""
    labels: str = ""  # output label file (relative to out_dir)
    notes: str = ""
    device: str = ""


def safe_text(text: str) -> str:
    """``text`` as valid Unicode: the bytes of a file name that is not valid UTF-8 (held as
    surrogates in a ``str``) are written as ``\\xff`` escapes; other text is unchanged."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return os.fsencode(text).decode("utf-8", "backslashreplace")


def safe_row(row: ImageStatus) -> ImageStatus:
    """``row`` with every text field :func:`safe_text` (reports, terminals and tables take it)."""
    changed = {f.name: safe_text(v) for f in fields(row)
               if isinstance(v := getattr(row, f.name), str) and safe_text(v) is not v}
    return replace(row, **changed) if changed else row


@dataclass
class Progress:
    """What a progress callback receives after every finished file."""

    done: int
    total: int
    images_per_s: float
    eta_s: float | None
    ok: int = 0
    skipped: int = 0
    errors: int = 0
    elapsed_s: float = 0.0
    row: ImageStatus | None = None


@dataclass
class RunReport:
    in_dir: str
    out_dir: str
    method: str
    total: int
    rows: list[ImageStatus] = field(default_factory=list)
    seconds: float = 0.0
    cancelled: bool = False
    shard: str = ""
    report_csv: str = ""
    report_json: str = ""
    model: str = ""  # the method's model ("" = its default); stored so a rerun can compare
    warnings: list[str] = field(default_factory=list)
    kept: list[ImageStatus] = field(default_factory=list)  # earlier rows of files not in this run
    disk_error: str = ""  # why the run stopped writing (disk full, read-only), if it did
    report_error: str = ""  # why report.csv/json could not be written, if they could not

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.rows)

    @property
    def ok(self) -> int:
        return self.count("ok")

    @property
    def skipped(self) -> int:
        return self.count("skipped")

    @property
    def errors(self) -> int:
        return self.count("error")

    @property
    def failed(self) -> bool:
        return self.errors > 0

    @property
    def images_per_s(self) -> float:
        processed = self.ok + self.errors
        return processed / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> str:
        head = "cancelled" if self.cancelled else "done"
        return (f"{head}: {len(self.rows)}/{self.total} files, {self.ok} ok, {self.skipped} skipped, "
                f"{self.errors} errors in {self.seconds:.1f} s ({self.images_per_s:.2f} images/s)")


def report_names(shard: tuple[int, int] | None) -> tuple[str, str]:
    if shard is None:
        return "report.csv", "report.json"
    tag = f"_shard{shard[0]}of{shard[1]}"
    return f"report{tag}.csv", f"report{tag}.json"


def write_report(report: RunReport, out_dir: Path, shard) -> None:
    """``report.csv`` / ``report.json``: this run's rows merged with the rows an earlier
    run wrote for files this run did not see (``report.kept``). The counts in the JSON
    header are this run's. Raises ``OSError`` when the folder cannot take them."""
    csv_name, json_name = report_names(shard)
    rows = sorted(report.rows + report.kept, key=lambda r: r.file)
    cols = ["file", "shape", "objects", "seconds", "status", "error", "labels", "notes", "device"]
    table = {c: [getattr(r, c) if getattr(r, c) is not None else "" for r in rows] for c in cols}
    report.report_csv, report.report_json = str(out_dir / csv_name), str(out_dir / json_name)
    doc = {k: v for k, v in asdict(report).items() if k not in ("rows", "kept", "report_error")}
    doc.update(ok=report.ok, skipped=report.skipped, errors=report.errors, earlier_rows=len(report.kept),
               images_per_s=round(report.images_per_s, 4), rows=[asdict(r) for r in rows])
    label_files.atomic_write_text(out_dir / csv_name, tables.table_to_csv(table))
    label_files.atomic_write_text(out_dir / json_name, json.dumps(doc, indent=1))


