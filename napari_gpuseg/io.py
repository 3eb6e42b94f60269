"""Reading images and folder scans.

GUI-free and torch-free. Every user-caused read problem raises a subclass of
:class:`ImageReadError` whose message says what is wrong with which file, so a folder job
can record it and move on. Writing label files (atomically) is
:mod:`napari_gpuseg.label_files`; object tables are :mod:`napari_gpuseg.tables`.
"""
from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

TIFF_SUFFIXES = (".tif", ".tiff")
MAX_NDIM = 4  # YX, ZYX, TZYX (+ a trailing RGB(A) channel axis)


class ImageReadError(ValueError):
    """A file could not be used as an image; the message is meant for the user."""

    kind = "unreadable"

    def __init__(self, path: str | os.PathLike, message: str) -> None:
        self.path = str(path)
        self.message = message
        super().__init__(f"{Path(path).name}: {message}")


class EmptyFileError(ImageReadError):
    kind = "empty"


class NotAnImageError(ImageReadError):
    kind = "not-an-image"


class UnsupportedDimensionsError(ImageReadError):
    kind = "dimensions"


class UnsupportedDtypeError(ImageReadError):
    kind = "dtype"


class AllNaNError(ImageReadError):
    kind = "all-nan"


class TooLargeError(ImageReadError):
    kind = "too-large"


@dataclass
class LoadedImage:
    """An image as read from disk, validated and cleaned.

    ``data`` is YX, YXC (``rgb`` True, C == 3), ZYX or TZYX with a numeric real dtype and
    no NaN/inf; ``notes`` says what was changed on the way (NaNs replaced, alpha dropped).
    """

    data: np.ndarray
    path: str
    rgb: bool = False
    notes: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------- reading
def _peek_size(path: Path) -> tuple[int, int] | None:
    """(values, bytes) of a TIFF's first series without reading pixels (None if unknown)."""
    if path.suffix.lower() not in TIFF_SUFFIXES:
        return None
    try:
        import tifffile

        with tifffile.TiffFile(path) as tf:
            series = tf.series[0]
            n = int(np.prod(series.shape))
            return n, n * np.dtype(series.dtype).itemsize
    except Exception:  # noqa: BLE001 - the real read reports the problem
        return None


def memory_needed(values: int, nbytes: int, bytes_per_value: float | None = None) -> int:
    """Bytes an image needs while it is segmented: its pixels, or ``bytes_per_value`` per
    pixel value when the method's peak is known (measured: docs/benchmarks.md)."""
    return int(max(nbytes, values * (bytes_per_value or 0)))


def _check_memory(path: Path, values: int, nbytes: int, max_bytes: int,
                  bytes_per_value: float | None) -> None:
    need = memory_needed(values, nbytes, bytes_per_value)
    if need > max_bytes:
        how = (f" ({nbytes / 2**30:.2f} GiB of pixels; the method peaks at about "
               f"{bytes_per_value:g} bytes per pixel value)" if need > nbytes else "")
        raise TooLargeError(
            path,
            f"needs {need / 2**30:.2f} GiB in memory{how}, more than the limit "
            f"{max_bytes / 2**30:.2f} GiB; split it into tiles first",
        )


def _read_raw(path: Path) -> np.ndarray:
    if path.suffix.lower() in TIFF_SUFFIXES:
        import tifffile

        try:
            return np.asarray(tifffile.imread(path))
        except Exception as exc:  # noqa: BLE001 - tifffile raises many types
            raise NotAnImageError(
                path, f"not a readable TIFF (corrupt, truncated or not a TIFF): {exc}"
            ) from exc
    try:
        import imageio.v3 as iio

        return np.asarray(iio.imread(path))
    except Exception as exc:  # noqa: BLE001
        raise NotAnImageError(path, f"not a readable image: {exc}") from exc


def _squeeze(data: np.ndarray) -> np.ndarray:
    """Drop length-1 axes, keeping at least 2 dimensions."""
    shape = [s for s in data.shape if s != 1]
    if len(shape) < 2:
        shape = list(data.shape[-2:])
    return data.reshape(shape)


def _clean_dtype(path: Path, data: np.ndarray, notes: list[str]) -> np.ndarray:
    kind = data.dtype.kind
    if kind == "b":
        notes.append("boolean image converted to uint8")
        return data.astype(np.uint8)
    if kind in "ui":
        return data
    if kind == "f":
        if data.dtype.itemsize < 4:
            data = data.astype(np.float32)
        finite = np.isfinite(data)
        if not finite.all():
            n_bad = int(data.size - np.count_nonzero(finite))
            if n_bad == data.size:
                raise AllNaNError(path, "every pixel is NaN or infinite: nothing to segment")
            fill = float(np.min(data[finite]))
            data = np.where(finite, data, data.dtype.type(fill))
            notes.append(f"{n_bad} NaN/inf pixels replaced by the image minimum ({fill:g})")
        return data
    raise UnsupportedDtypeError(
        path,
        f"unsupported pixel type {data.dtype} (use integer or real floating-point images)",
    )


def load_image(path: str | os.PathLike, max_bytes: int | None = None,
               bytes_per_value: float | None = None) -> LoadedImage:
    """Read and validate one image file.

    Raises an :class:`ImageReadError` subclass for a missing or zero-byte file, a broken
    symbolic link, a file that is not a (readable) image, more than 4 dimensions, a
    complex/object dtype, an all-NaN image, or an image that needs more than ``max_bytes``
    of memory (its pixels, or ``bytes_per_value`` per pixel value: see
    :func:`memory_needed`).
    """
    path = Path(path)
    if not path.is_file():
        if path.is_symlink():
            raise ImageReadError(path, f"broken symbolic link (target {os.readlink(path)!r} "
                                       "missing, or a link loop)")
        raise ImageReadError(path, "file not found")
    if path.stat().st_size == 0:
        raise EmptyFileError(path, "zero-byte file (empty or interrupted copy)")
    if max_bytes is not None:
        size = _peek_size(path)
        if size is not None:
            _check_memory(path, *size, max_bytes, bytes_per_value)
    try:
        data = _read_raw(path)
    except MemoryError as exc:
        raise TooLargeError(path, "too large to load into memory; split it into tiles first") from exc
    if max_bytes is not None and path.suffix.lower() not in TIFF_SUFFIXES:
        _check_memory(path, int(data.size), int(data.nbytes), max_bytes, bytes_per_value)
    if data.dtype == object or data.size == 0:
        raise NotAnImageError(path, f"no pixel data (shape {data.shape}, dtype {data.dtype})")
    notes: list[str] = []
    data = _squeeze(data)
    rgb = data.ndim >= 3 and data.shape[-1] in (3, 4)
    spatial = data.ndim - 1 if rgb else data.ndim
    if spatial > MAX_NDIM or (rgb and spatial > 3):
        raise UnsupportedDimensionsError(
            path,
            f"unsupported shape {tuple(data.shape)}: {data.ndim}-D; expected YX, YXC (RGB), "
            "ZYX or TZYX",
        )
    if rgb and data.shape[-1] == 4:
        data = data[..., :3]
        notes.append("alpha channel dropped")
    data = _clean_dtype(path, data, notes)
    return LoadedImage(np.ascontiguousarray(data), str(path), rgb, notes)


def read_image(path: str | os.PathLike, max_bytes: int | None = None) -> np.ndarray:
    """The pixel array of :func:`load_image`."""
    return load_image(path, max_bytes=max_bytes).data


def is_rgb(image: np.ndarray) -> bool:
    return image.ndim >= 3 and image.shape[-1] in (3, 4)


def to_gray(image: np.ndarray) -> np.ndarray:
    """Luminance of a YXC RGB(A) image as float32 (the shared conversion,
    :func:`napari_gpuseg.engine.normalize.to_gray`); other images unchanged."""
    if not is_rgb(image):
        return image
    from .engine.normalize import to_gray as luminance  # numpy only: no import cycle

    return luminance(image)


# ----------------------------------------------------------------------------- scans
def _patterns(pattern: str | Sequence[str]) -> list[str]:
    if isinstance(pattern, str):
        parts = pattern.replace(";", ",").split(",")
    else:
        parts = list(pattern)
    return [p.strip() for p in parts if p.strip()] or ["*"]


def scan_folder(
    folder: str | os.PathLike,
    pattern: str | Sequence[str] = "*.tif*",
    recursive: bool = False,
    exclude: Iterable[str | os.PathLike] = (),
) -> list[Path]:
    """Files in ``folder`` whose name matches ``pattern`` (comma-separated globs allowed).

    Sorted by their path relative to ``folder`` (POSIX form), so the order is the same on
    every machine. Hidden files, our temp files and anything under ``exclude`` (for
    example an output folder inside the input folder) are left out. Symbolic links are
    followed; a broken one (or a link loop) is listed, so that reading it reports it.
    """
    root = Path(folder)
    if not root.is_dir():
        raise NotADirectoryError(f"input folder not found: {root}")
    pats = [p.lower() for p in _patterns(pattern)]
    excluded = [Path(e).resolve() for e in exclude]
    found: list[Path] = []
    walker = os.walk(root) if recursive else [(str(root), [], os.listdir(root))]
    for dirpath, dirnames, filenames in walker:
        here = Path(dirpath)
        dirnames[:] = [
            d for d in dirnames
            if not d.startswith(".") and (here / d).resolve() not in excluded
        ]
        for name in filenames:
            if name.startswith("."):
                continue
            full = here / name
            if not any(fnmatch.fnmatch(name.lower(), p) for p in pats):
                continue
            if not full.is_file() and not (full.is_symlink() and not full.is_dir()):
                continue
            found.append(full)
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())
