"""What a folder job finds in its output folder: output names, which existing files this
program wrote (and with which method), the earlier report, skipped rows that keep what
the earlier run measured, and object tables rebuilt from complete label files.

GUI-free and print-free.
"""
from __future__ import annotations

import errno
import json
import os
import re
from dataclasses import fields
from pathlib import Path

import numpy as np

from ... import io as gio
from ...io import label_files, tables
from .report import ImageStatus, report_names

LABELS_SUFFIX = "_labels.tif"
TABLE_SUFFIX = "_objects.csv"
_REPORT_RE = re.compile(r"^report(_shard\d+of\d+)?\.(csv|json)$")
# write errors that every later write would hit too: the run stops instead of failing each file
DISK_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EIO, getattr(errno, "EDQUOT", errno.ENOSPC)}


def _rel(file, in_dir) -> Path:
    """``file`` relative to ``in_dir`` without following symbolic links (a folder of links
    to images elsewhere is a normal input folder)."""
    return Path(os.path.relpath(os.path.abspath(file), os.path.abspath(in_dir)))


def rel_name(file, in_dir) -> str:
    return _rel(file, in_dir).as_posix()


def output_paths(in_dir: str | os.PathLike, out_dir: str | os.PathLike, file: str | os.PathLike):
    """(labels path, object table path) for an input ``file`` under ``in_dir``."""
    rel = _rel(file, in_dir)
    if rel.parts and rel.parts[0] == "..":
        raise ValueError(f"{file} is not inside the input folder {in_dir}")
    stem = rel.name.split(".")[0] if rel.name.lower().endswith((".ome.tif", ".ome.tiff")) else rel.stem
    base = Path(out_dir) / rel.parent / stem
    return base.with_name(stem + LABELS_SUFFIX), base.with_name(stem + TABLE_SUFFIX)


def is_own_output_name(name: str) -> bool:
    """Label files, object tables and reports of folder jobs: never read back as images."""
    return name.endswith((LABELS_SUFFIX, TABLE_SUFFIX)) or bool(_REPORT_RE.match(name))


def list_inputs(in_dir, out_dir, pattern=gio.DEFAULT_PATTERN, recursive=False) -> list[Path]:
    """Input files, leaving out the output folder and our own outputs."""
    files = gio.scan_folder(in_dir, pattern, recursive, exclude=[out_dir])
    return [f for f in files if not is_own_output_name(f.name)]


def no_input_note(in_dir, out_dir, pattern, recursive=False) -> str:
    """The warning of a run whose pattern matched no file: what the folder holds instead,
    counted by extension, so that the pattern can be set (a folder of JPEGs or CZIs)."""
    others: dict[str, int] = {}
    for f in list_inputs(in_dir, out_dir, "*", recursive):
        ext = f.suffix.lower() or f.name
        others[ext] = others.get(ext, 0) + 1
    text = f"no file in {in_dir} matches the file pattern {pattern!r}"
    if not others:
        return text + " (the folder holds no other file either)"
    top = sorted(others.items(), key=lambda kv: (-kv[1], kv[0]))[:3]
    held = ", ".join(f"{n} {ext}" for ext, n in top)
    return text + f"; it holds {held}: set the pattern to '*{top[0][0]}' to take them"


def same_folder(a, b) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)


# ----------------------------------------------------------------------------- earlier run
def read_earlier(out_dir: Path, shard) -> tuple[dict, dict[str, ImageStatus]]:
    """(report header, rows by file) of the report an earlier run left in ``out_dir``
    (empty when there is none or it cannot be read)."""
    path = out_dir / report_names(shard)[1]
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        names = {f.name for f in fields(ImageStatus)}
        rows = {}
        for r in doc.get("rows", []):
            row = ImageStatus(**{k: v for k, v in r.items() if k in names})
            rows[row.file] = row
        return {k: v for k, v in doc.items() if k != "rows"}, rows
    except (OSError, ValueError, TypeError, AttributeError):
        return {}, {}


def _our_table(path: Path) -> bool:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.readline().startswith("label,area,")
    except (OSError, UnicodeDecodeError):
        return False


def foreign_output(labels_path: Path, table_path: Path, labels_rel: str,
                   listed: set[str]) -> Path | None:
    """The file at an output name that another program wrote (e.g. a ground truth
    ``X_labels.tif`` beside ``X.tif``), or None. Ours: label files carry our metadata;
    files ``listed`` in the labels column of an earlier report of ours count as ours too."""
    if os.path.lexists(labels_path):
        if label_files.output_info(labels_path) is None and labels_rel not in listed:
            return labels_path
        return None
    if os.path.lexists(table_path) and not _our_table(table_path):
        return table_path
    return None


def method_id(info: dict | None, header: dict) -> tuple[str, str] | None:
    """(method, model) that wrote an output: its own metadata, else the earlier report."""
    src = info if info and info.get("method") else header
    if not src or not src.get("method"):
        return None
    return str(src.get("method")), str(src.get("model") or "")


def describe_method(method: str, model: str) -> str:
    return f"{method!r}" + (f" (model {model})" if model else "")


def skipped_row(rel: str, labels_rel: str, labels: np.ndarray, info: dict | None,
                table_path: Path, earlier: ImageStatus | None, header: dict,
                current: tuple[str, str], image_path=None) -> tuple[ImageStatus, tuple[str, str] | None]:
    """The row of a file whose output is complete: what the earlier run measured (shape,
    objects, seconds, device) is kept (without an earlier row, the shape is read from the
    header of ``image_path``); a missing object table is rebuilt from the labels.
    Also returns the (method, model) that wrote it when that is not ``current``."""
    notes = ["existing valid output"]
    ids = np.unique(labels)
    n_obj = int(np.count_nonzero(ids > 0))
    if not table_path.is_file():
        try:
            tables.write_object_table(table_path, labels)
            notes.append("object table rebuilt from the labels (no scores)")
        except OSError as exc:
            notes.append(f"object table missing and not rebuilt: {exc.strerror or exc}")
    wrote = method_id(info, header)
    other = wrote if wrote is not None and wrote != current else None
    if other is not None:
        notes.append(f"written by method {describe_method(*other)}")
    old = earlier
    shape = old.shape if old and old.shape else (gio.peek_shape(image_path) if image_path else "")
    return ImageStatus(rel, shape=shape, objects=n_obj,
                       seconds=old.seconds if old else 0.0, status="skipped",
                       labels=labels_rel, notes="; ".join(notes),
                       device=old.device if old else ""), other
