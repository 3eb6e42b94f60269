"""Every way boxes are made for box-prompted SAM, in one place and one convention.

All functions return ``(N, 4)`` float64 arrays of ``x0, y0, x1, y1`` boxes in pixels,
end exclusive (a one-pixel object at (y, x) is ``x, y, x + 1, y + 1``)::

    boxes = detect_boxes(image, "threshold")   # or "unet", "auto", or a label image
    boxes = boxes_from_labels(labels)           # the objects of a 2D label image
    boxes = boxes_from_csv("boxes.csv")         # x0, y0, x1, y1 columns

RGB(A) images are turned to gray by :func:`napari_gpuseg.io.to_gray` (luminance), the
same conversion the U-Net folder method uses.
"""
from __future__ import annotations

import math
import re
import threading
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..io import is_rgb, to_gray

_UNET_MODELS: dict = {}  # the bundled U-Net detector, loaded once per device
_UNET_LOCK = threading.Lock()
BOX_COLUMNS = ("x0", "y0", "x1", "y1")
PLANE_COLUMNS = ("z", "frame", "t", "slice", "plane")  # the 0-based plane of a box in a stack
_CSV_SPLIT = re.compile(r"[,\t]")


def _as_boxes(rows) -> np.ndarray:
    return np.asarray(rows, dtype=np.float64).reshape(-1, 4)


def sequential_labels(labels: np.ndarray) -> np.ndarray:
    """``labels`` with its ids renumbered 1..N in increasing order (0 stays background),
    as int64: ids of any size (uint64 >= 2**63 too) keep their objects and their order.
    Returned as they are when the ids are already small."""
    labels = np.asarray(labels)
    if labels.size == 0:
        return labels.astype(np.int64)
    if int(labels.max()) <= max(labels.size, 2**16):  # find_objects: one slot per id value
        return labels.astype(np.int64, copy=False)
    ids, inverse = np.unique(labels, return_inverse=True)
    if ids[0] != 0:
        inverse = inverse + 1
    return inverse.reshape(labels.shape).astype(np.int64, copy=False)


def boxes_from_labels(labels: np.ndarray) -> np.ndarray:
    """Boxes of the objects of a 2D label image, in increasing label order (any ids: a
    large or uint64 id costs no memory per id value)."""
    from scipy import ndimage as ndi

    return _as_boxes([(s[1].start, s[0].start, s[1].stop, s[0].stop)
                      for s in ndi.find_objects(sequential_labels(labels)) if s is not None])


def threshold_boxes(image: np.ndarray, **kwargs) -> np.ndarray:
    """Boxes of the objects of :func:`napari_gpuseg.engine.classical.classical_segment`
    (blur + Otsu + watershed) on a 2D image; ``kwargs`` go to it."""
    from .classical import classical_segment

    return boxes_from_labels(classical_segment(image, **kwargs))


def unet_available() -> bool:
    """True when the U-Net engine and its bundled nuclei model are installed."""
    try:
        from .unet import predict as unet
    except Exception:  # noqa: BLE001 - the U-Net engine is optional here
        return False
    return unet.bundled_model_path().is_file()


def _bundled_unet(device):
    """The bundled U-Net, loaded once per device (thread-safe)."""
    from .unet import predict as unet

    dev = str(device)
    with _UNET_LOCK:
        if dev not in _UNET_MODELS:
            _UNET_MODELS[dev] = unet.load_model(None, device=dev)
        return _UNET_MODELS[dev]


def unet_boxes(image: np.ndarray, model=None, **kwargs) -> np.ndarray:
    """Boxes of the objects the U-Net finds in a 2D image (``model`` None = the bundled
    nuclei model, loaded once per device; a path = that checkpoint); ``kwargs`` go to
    :func:`napari_gpuseg.engine.unet.predict.predict_labels`."""
    from .runtime.device import resolve_policy
    from .unet import predict as unet

    device = resolve_policy(kwargs.get("policy")).device
    if model is None:
        model = _bundled_unet(device)
    elif isinstance(model, (str, Path)):
        model = unet.load_model(model, device=device)
    return boxes_from_labels(unet.predict_labels(model, image, **kwargs))


def _gray(image: np.ndarray, rgb: bool | None) -> np.ndarray:
    image = np.asarray(image)
    if image.ndim == 3 and image.shape[-1] == 1:
        return image[..., 0]
    return to_gray(image) if (is_rgb(image) if rgb is None else rgb) else image


def detect_boxes(image: np.ndarray, detector="threshold", rgb: bool | None = None,
                 policy=None, **kwargs) -> np.ndarray:
    """Boxes proposed by a detector for one 2D image (gray or RGB).

    ``detector``: ``"threshold"`` (:func:`threshold_boxes`), ``"unet"``
    (:func:`unet_boxes`; falls back to the threshold detector when the U-Net is not
    installed), ``"auto"`` (U-Net when available), or a label image whose objects give
    the boxes. ``kwargs`` go to the detector.
    """
    if isinstance(detector, np.ndarray):
        return boxes_from_labels(detector)
    gray = _gray(image, rgb)
    if gray.ndim != 2:
        raise ValueError(f"detect_boxes takes one 2D image, got shape {np.shape(image)}")
    if detector == "auto":
        detector = "unet" if unet_available() else "threshold"
    if detector == "unet" and unet_available():
        if policy is not None:
            kwargs.setdefault("policy", policy)
        return unet_boxes(gray, **kwargs)
    if detector not in ("threshold", "unet"):
        raise ValueError(f"unknown detector {detector!r}: use 'threshold', 'unet', 'auto' or labels")
    return threshold_boxes(gray, **kwargs)


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


def boxes_from_csv(path, plane: int | None = None) -> np.ndarray:
    """Boxes from a CSV box file (format: :func:`read_box_csv`).

    With ``plane`` given and a plane column present, only that plane's rows are returned.
    """
    found = read_box_csv(path)
    if plane is None or found.planes is None:
        return found.boxes
    return found.boxes[found.planes.astype(np.int64) == int(plane)]
