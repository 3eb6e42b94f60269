"""Box prompts from files beside the images, for ``sam-boxes`` folder jobs (``--set boxes=DIR``).

For an input image ``IN/sub/a.tif`` the box folder ``DIR`` holds one of:

- ``DIR/sub/a.csv``: one box per line, ``x0,y0,x1,y1`` in pixels (x = column, y = row, end
  exclusive), plus a ``z`` (or ``frame``/``t``/``slice``/``plane``) column for stacks: the
  0-based plane of the box. A header line is allowed (then the columns may come in any order
  and other columns are ignored); without one a line has 4 values, or 5 with the plane last.
  Blank lines and lines starting with ``#`` are skipped. A file with no boxes is an image
  with no objects.
- ``DIR/sub/a_labels.tif``: a label image of the image's shape (YX, or ZYX for a stack); every
  object gives the box around it (per plane for a stack). The label files a folder job writes
  are named this way, so the output folder of an earlier run can serve as ``DIR``.

The names follow the output names of folder jobs (``a.ome.tif`` -> ``a``). A missing, doubled
or malformed box file raises :class:`BoxFileError` naming the file (and the line): the folder
job writes it in the image's error row and goes on.

GUI-free and print-free.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..detect import read_box_csv
from .outputs import LABELS_SUFFIX, output_paths

CSV_SUFFIX = ".csv"


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


def read_csv_boxes(path: str | os.PathLike, spatial_shape: tuple) -> PlaneBoxes:
    """Boxes per plane from a CSV box file (format in the module docstring, read by
    :func:`napari_gpuseg.engine.detect.read_box_csv`); every line is checked: numbers,
    ``x0 < x1``, ``y0 < y1``, inside the image, a plane that exists. Exact copies of an
    earlier box (same plane and corners) are dropped; ``notes`` says how many."""
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


def read_label_boxes(path: str | os.PathLike, spatial_shape: tuple) -> list[np.ndarray]:
    """Boxes per plane around the objects of a label image of the image's spatial shape."""
    import tifffile

    from ..detect import boxes_from_labels

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
