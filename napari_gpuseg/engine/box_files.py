"""Box prompts from files: one reader and one validation policy for the SAM automatic
dock's CSV field and for ``sam-boxes`` folder jobs (``--set boxes=DIR``).

A box file is one of:

- a CSV file: one box per line, ``x0,y0,x1,y1`` in pixels (x = column, y = row, end
  exclusive), plus a ``z`` (or ``frame``/``t``/``slice``/``plane``) column for stacks: the
  0-based plane of the box (for stacks with several leading axes, e.g. TZYX, planes are
  numbered in C order: plane = t * Z + z). A header line is allowed (then the columns may
  come in any order and case, and other columns are ignored); without one a line has 4
  values, or 5 with the plane last. Comma or tab separated; blank lines and lines starting
  with ``#`` are skipped. A file with no boxes is an image with no objects.
- a label image ``a_labels.tif`` of the image's shape (YX, or ZYX for a stack); every object
  gives the box around it (per plane for a stack). The label files a folder job writes are
  named this way, so the output folder of an earlier run can serve as a box folder.

Every line is checked (numbers, ``x0 < x1``, ``y0 < y1``, inside the image, a plane that
exists); a malformed file raises :class:`BoxFileError` naming the file and the line. For a
folder job, an input ``IN/sub/a.tif`` finds its box file as ``DIR/sub/a.csv`` or
``DIR/sub/a_labels.tif`` (the output names of folder jobs: ``a.ome.tif`` -> ``a``).

GUI-free and print-free.
"""
from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .detect import boxes_from_labels
from .jobs.outputs import LABELS_SUFFIX, output_paths

CSV_SUFFIX = ".csv"
BOX_COLUMNS = ("x0", "y0", "x1", "y1")
PLANE_COLUMNS = ("z", "frame", "t", "slice", "plane")  # the 0-based plane of a box in a stack
_CSV_SPLIT = re.compile(r"[,\t]")


_NUMBER = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


def _float(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _number(text: str) -> float | None:
    """A plain decimal number (``12``, ``-3.5``, ``1e3``); not ``1_0`` (Python's digit
    grouping), ``nan``, ``inf``, hexadecimal or non-ASCII digits, which ``float()`` takes."""
    return float(text) if _NUMBER.fullmatch(text) else None


def _as_boxes(rows) -> np.ndarray:
    return np.asarray(rows, dtype=np.float64).reshape(-1, 4)


class CsvBoxes(NamedTuple):
    """The rows of a CSV box file: ``boxes`` ``(N, 4)`` float64 ``x0, y0, x1, y1``,
    ``planes`` ``(N,)`` float64 (None without a plane column), ``lines`` the 1-based line
    number and ``texts`` the text of each row (for messages)."""

    boxes: np.ndarray
    planes: np.ndarray | None
    lines: list
    texts: list


def read_box_csv(path) -> CsvBoxes:
    """Every box of a CSV box file, checked to be finite numbers.

    One box per line, ``x0,y0,x1,y1`` in pixels (x = column, y = row, end exclusive), plus
    an optional plane column (``z``, ``frame``, ``t``, ``slice`` or ``plane``: the 0-based
    plane of a stack). A header line is optional (with one the columns may come in any
    order and case, other columns are ignored); without one a line has 4 values, or 5 with
    the plane last. Comma or tab separated; blank lines and ``#`` comments are skipped.
    A malformed line raises ``ValueError("PATH, line N: why: 'text'")``.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot be read as a text file ({exc})") from exc
    cols: dict[str, int] | None = None  # column index by name, from the header or the width
    width = None
    rows, planes, lines, texts = [], [], [], []
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        fields = [f.strip().strip('"').strip("'").strip() for f in _CSV_SPLIT.split(line)]

        def bad(why: str) -> ValueError:
            return ValueError(f"{path}, line {line_no}: {why}: {line.strip()!r}")

        values = [_number(f) for f in fields]
        if cols is None:
            if any(_float(f) is None for f in fields):  # the header line (``nan``, ``1_0``: data)
                names = [f.lower() for f in fields]
                known = [n for n in names if n in BOX_COLUMNS + PLANE_COLUMNS]
                twice = sorted({n for n in known if known.count(n) > 1})
                if twice:
                    raise bad(f"column {', '.join(twice)} appears more than once in the header")
                planes_named = [n for n in known if n in PLANE_COLUMNS]
                if len(planes_named) > 1:
                    raise bad(f"two plane columns ({', '.join(planes_named)}); keep one")
                missing = [c for c in BOX_COLUMNS if c not in names]
                if missing:
                    raise bad(f"not four numbers x0,y0,x1,y1 and not a header naming x0, y0, x1, y1 "
                              f"(missing {', '.join(missing)})")
                cols = {c: names.index(c) for c in BOX_COLUMNS}
                plane = next((c for c in PLANE_COLUMNS if c in names), None)
                if plane is not None:
                    cols["z"] = names.index(plane)
                width = len(fields)
                continue
            if len(fields) not in (4, 5):
                raise bad(f"{len(fields)} values; expected x0,y0,x1,y1 or x0,y0,x1,y1,z")
            cols = {c: i for i, c in enumerate(BOX_COLUMNS)}
            if len(fields) == 5:
                cols["z"] = 4
            width = len(fields)
        if len(fields) != width:
            raise bad(f"{len(fields)} values where the first line has {width}")
        if any(values[i] is None or not math.isfinite(values[i]) for i in cols.values()):
            raise bad("not a number")
        rows.append([values[cols[c]] for c in BOX_COLUMNS])
        planes.append(values[cols["z"]] if "z" in cols else 0.0)
        lines.append(line_no)
        texts.append(line.strip())
    has_plane = cols is not None and "z" in cols
    return CsvBoxes(_as_boxes(rows), np.asarray(planes, np.float64) if has_plane else None, lines, texts)


class BoxFileError(ValueError):
    """A box file that is missing, ambiguous or malformed (the message names the file)."""


class PlaneBoxes(list):
    """Boxes ``(N, 4)`` per plane, with ``notes`` for the report (duplicates dropped)."""

    notes: str = ""


def box_file_candidates(box_dir: str | os.PathLike, rel: str) -> tuple[Path, Path]:
    """``(DIR/sub/a.csv, DIR/sub/a_labels.tif)`` for the input ``rel`` = ``"sub/a.tif"``."""
    root = Path(box_dir)
    labels, _ = output_paths(root, root, root / rel)
    return labels.with_name(labels.name[: -len(LABELS_SUFFIX)] + CSV_SUFFIX), labels


def find_box_file(box_dir: str | os.PathLike, rel: str) -> Path:
    """The one box file of the input ``rel`` (relative to the input folder)."""
    found = [p for p in box_file_candidates(box_dir, rel) if p.is_file()]
    if not found:
        csv_path, tif_path = box_file_candidates(box_dir, rel)
        raise BoxFileError(f"no box file for this image: neither {csv_path} nor {tif_path} exists")
    if len(found) > 1:
        raise BoxFileError(f"two box files for this image: {found[0]} and {found[1]}; keep one")
    return found[0]


def boxes_for_image(box_dir: str | os.PathLike, rel: str, spatial_shape: tuple) -> PlaneBoxes:
    """Boxes ``(N, 4)`` (``x0, y0, x1, y1``, end exclusive) per plane of an image of spatial
    shape ``(Y, X)`` (one plane) or ``(Z, Y, X)``, read from its box file in ``box_dir``."""
    path = find_box_file(box_dir, rel)
    if path.name.endswith(CSV_SUFFIX):
        return read_csv_boxes(path, spatial_shape)
    return PlaneBoxes(read_label_boxes(path, spatial_shape))


def _planes_and_size(spatial_shape: tuple) -> tuple[int, int, int]:
    shape = tuple(int(s) for s in spatial_shape)
    if len(shape) not in (2, 3):
        raise ValueError(f"box files are for YX images and ZYX stacks, not shape {shape}")
    return (shape[0] if len(shape) == 3 else 1), shape[-2], shape[-1]


def read_csv_boxes(path: str | os.PathLike, spatial_shape: tuple,
                   default_plane: int | None = None) -> PlaneBoxes:
    """Boxes per plane from a CSV box file (format in the module docstring, read by
    :func:`read_box_csv`); every line is checked: numbers, ``x0 < x1``, ``y0 < y1``, inside
    the image, a plane that exists. A file without a plane column is for a 2D image, or for
    ``default_plane`` of a stack (the plane on screen); else it is an error. Exact copies
    of an earlier box (same plane and corners) are dropped; ``notes`` says how many."""
    path = Path(path)
    n_planes, h, w = _planes_and_size(spatial_shape)
    stack = len(spatial_shape) == 3
    try:
        found = read_box_csv(path)
    except ValueError as exc:
        raise BoxFileError(str(exc)) from exc
    planes: list[list[list[float]]] = [[] for _ in range(n_planes)]
    seen: set[tuple] = set()
    copies = 0
    for k, (x0, y0, x1, y1) in enumerate(found.boxes.tolist()):

        def bad(why: str) -> BoxFileError:
            return BoxFileError(f"{path}, line {found.lines[k]}: {why}: {found.texts[k]!r}")

        if not (x0 < x1 and y0 < y1):
            raise bad("empty or reversed box (needs x0 < x1 and y0 < y1)")
        if x1 <= 0 or y1 <= 0 or x0 >= w or y0 >= h:
            raise bad(f"box outside the image ({w} x {h} px)")
        if found.planes is not None:
            z = float(found.planes[k])
            if z != int(z) or not 0 <= z < n_planes:
                where = (f"the stack has planes 0..{n_planes - 1}" if stack
                         else "the image is 2D: the plane must be 0")
                raise bad(f"plane {z:g} does not exist ({where})")
            z = int(z)
        elif default_plane is not None and stack:
            z = int(default_plane)
        elif stack and n_planes > 1:
            raise bad(f"no z/frame column, but the image is a stack of {n_planes} planes")
        else:
            z = 0
        if (z, x0, y0, x1, y1) in seen:
            copies += 1
            continue
        seen.add((z, x0, y0, x1, y1))
        planes[z].append([x0, y0, x1, y1])
    out = PlaneBoxes(np.asarray(b, dtype=np.float64).reshape(-1, 4) for b in planes)
    if copies:
        out.notes = f"{copies} duplicate box(es) dropped (exact copies of an earlier line of {path.name})"
    return out


def boxes_for_planes(path: str | os.PathLike, lead_shape: tuple, image_hw: tuple,
                     indices: list[tuple]) -> list[np.ndarray]:
    """Boxes ``(N, 4)`` for each plane index of ``indices`` (tuples over the leading axes
    ``lead_shape`` of a stack, ``()`` for a 2D image), from a CSV box file checked against
    the whole stack: the plane column numbers planes in C order over the leading axes. With
    one plane asked for, a file without a plane column gives that plane's boxes."""
    lead = tuple(int(s) for s in lead_shape)
    n = int(np.prod(lead)) if lead else 1
    flat = [int(np.ravel_multi_index(idx, lead)) if lead else 0 for idx in indices]
    shape = ((n,) if lead else ()) + tuple(int(s) for s in image_hw)
    planes = read_csv_boxes(path, shape, default_plane=flat[0] if len(flat) == 1 else None)
    return [planes[k] for k in flat]


def read_label_boxes(path: str | os.PathLike, spatial_shape: tuple) -> list[np.ndarray]:
    """Boxes per plane around the objects of a label image of the image's spatial shape."""
    import tifffile


    path = Path(path)
    shape = tuple(int(s) for s in spatial_shape)
    n_planes, _h, _w = _planes_and_size(shape)
    try:
        labels = np.asarray(tifffile.imread(path))
    except Exception as exc:  # noqa: BLE001 - any reader failure is a bad box file
        raise BoxFileError(f"{path}: not a readable TIFF label image ({type(exc).__name__}: {exc})") from exc
    if labels.shape != shape:
        squeezed = labels.reshape([s for s in labels.shape if s != 1])
        if squeezed.shape != tuple(s for s in shape if s != 1):
            raise BoxFileError(f"{path}: label image of shape {labels.shape} for an image of shape {shape}")
        labels = squeezed.reshape(shape)
    if labels.dtype.kind == "f":
        if not np.all(np.isfinite(labels)) or np.any(labels != np.round(labels)):
            raise BoxFileError(f"{path}: not a label image (non-integer values)")
        labels = labels.astype(np.int64)
    elif labels.dtype.kind not in "uib":
        raise BoxFileError(f"{path}: not a label image (dtype {labels.dtype})")
    if labels.dtype.kind == "i" and labels.size and labels.min() < 0:
        raise BoxFileError(f"{path}: not a label image (negative values)")
    planes = labels.reshape((n_planes,) + labels.shape[-2:])
    return [boxes_from_labels(p) for p in planes]
