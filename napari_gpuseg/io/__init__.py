"""Reading images and folder scans.

GUI-free and torch-free. Every user-caused read problem raises a subclass of
:class:`ImageReadError` whose message says what is wrong with which file, so a folder job
can record it and move on. Writing label files (atomically) is
:mod:`napari_gpuseg.io.label_files`; object tables are :mod:`napari_gpuseg.io.tables`.
"""
from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

TIFF_SUFFIXES = (".tif", ".tiff")
# the folder jobs' file pattern unless one is given (the dock, the CLI, the engine)
DEFAULT_PATTERN = "*.tif*,*.png"
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


class ChannelError(ImageReadError):
    """A multichannel image without a chosen channel, or a channel it does not have."""

    kind = "channels"


@dataclass
class LoadedImage:
    """An image as read from disk, validated and cleaned.

    ``data`` is YX, YXC (``rgb`` True, C == 3), ZYX or TZYX with a numeric real dtype and
    no NaN/inf, or one of these with a trailing axis of ``channels`` (> 0) non-colour
    channels (see :func:`select_channel`); ``notes`` says what was changed on the way
    (NaNs replaced, alpha dropped, series not read).
    """

    data: np.ndarray
    path: str
    rgb: bool = False
    notes: list[str] = field(default_factory=list)
    channels: int = 0  # > 0: the last axis holds this many channels (not colour)


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


@dataclass
class _Raw:
    data: np.ndarray
    axes: str | None = None  # TIFF/OME metadata axes (tifffile codes), None when unknown
    colour: bool | None = None  # the file says colour (RGB photometric; PNG/JPEG)
    notes: list[str] = field(default_factory=list)


def _shape_text(shape, dtype=None) -> str:
    return "x".join(str(int(s)) for s in shape) + (f" {np.dtype(dtype)}" if dtype is not None else "")


def _read_tiff(path: Path) -> _Raw:
    """Series 0 of a TIFF with its axes; a note names the other series (not read)."""
    import tifffile

    with tifffile.TiffFile(path) as tf:
        series = tf.series
        first = series[0]
        data = np.asarray(first.asarray())
        axes = first.axes if len(first.axes) == data.ndim else None  # Q, I: unknown axes
        photometric = getattr(tf.pages[0], "photometric", None)
        colour = getattr(photometric, "name", "") in ("RGB", "YCBCR")
        notes = []
        if len(series) > 1:
            others = ", ".join(f"{k} ({_shape_text(s.shape, s.dtype)})" for k, s in enumerate(series)
                               if k > 0)
            notes.append(f"the file holds {len(series)} image series: series 0 "
                         f"({_shape_text(first.shape, first.dtype)}) was read; series {others} "
                         "not (save each series as its own file to segment it)")
    return _Raw(data, axes, colour, notes)


def _read_raw(path: Path) -> _Raw:
    if path.suffix.lower() in TIFF_SUFFIXES:
        try:
            return _read_tiff(path)
        except MemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - tifffile raises many types
            raise NotAnImageError(
                path, f"not a readable TIFF (corrupt, truncated or not a TIFF): {exc}"
            ) from exc
    try:
        import imageio.v3 as iio

        return _Raw(np.asarray(iio.imread(path)), None, True)
    except MemoryError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise NotAnImageError(path, f"not a readable image: {exc}") from exc


def _squeeze(data: np.ndarray, axes: str | None = None) -> tuple[np.ndarray, str | None]:
    """Drop length-1 axes (and their names), keeping at least 2 dimensions."""
    keep = [i for i, s in enumerate(data.shape) if s != 1]
    if len(keep) < 2:
        keep = list(range(data.ndim))[-2:]
    if axes is not None:
        axes = "".join(axes[i] for i in keep)
    return data.reshape([data.shape[i] for i in keep]), axes


def _channel_axis(path: Path, data: np.ndarray, raw: _Raw) -> tuple[int | None, str]:
    """(index of the colour or channel axis or None, ``"colour"``/``"channels"``/``"alpha"``).

    The file's axes decide where it has them (TIFF/OME/ImageJ metadata: ``S`` samples
    last, ``C`` channels); without them a last axis of at most 4 values is one: 3 = RGB colour,
    and for colour formats (PNG, JPEG, ...) 4 = RGBA and 2 = gray + alpha. (An RGBA image
    whose alpha varies is taken as 4 channels by :func:`load_image`.)"""
    axes = raw.axes
    if axes is not None:
        if "C" in axes and axes.endswith("S"):
            raise UnsupportedDimensionsError(
                path, f"two channel axes (axes {axes}, shape {_shape_text(data.shape)}); "
                      "save one channel axis per file")
        if axes.endswith("S"):  # samples of each pixel: RGB(A) when the file says RGB
            colour = bool(raw.colour) and data.shape[-1] in (3, 4)
            return data.ndim - 1, "colour" if colour else "channels"
        if "C" in axes:
            return axes.index("C"), "channels"
        if not set(axes) & set("QI"):  # every axis named and none a channel axis (planar
            return None, ""            # RGB, S first, stays planes as it always was)
    if data.ndim >= 3 and data.shape[-1] <= 4:
        n = data.shape[-1]
        colour_format = path.suffix.lower() not in TIFF_SUFFIXES
        if n == 3 or (n == 4 and colour_format):
            return data.ndim - 1, "colour"
        if n == 2 and colour_format:
            return data.ndim - 1, "alpha"
        return data.ndim - 1, "channels"
    return None, ""


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
        raw = _read_raw(path)
    except MemoryError as exc:
        raise TooLargeError(path, "too large to load into memory; split it into tiles first") from exc
    data = raw.data
    if max_bytes is not None and path.suffix.lower() not in TIFF_SUFFIXES:
        _check_memory(path, int(data.size), int(data.nbytes), max_bytes, bytes_per_value)
    if data.dtype == object or data.size == 0:
        raise NotAnImageError(path, f"no pixel data (shape {data.shape}, dtype {data.dtype})")
    notes: list[str] = list(raw.notes)
    data, raw.axes = _squeeze(data, raw.axes)
    ax, kind = _channel_axis(path, data, raw)
    if ax is not None:
        data = np.moveaxis(data, ax, -1)
    rgb = kind == "colour"
    spatial = data.ndim - 1 if ax is not None else data.ndim
    if spatial > MAX_NDIM or (ax is not None and spatial > 3) or spatial < 2:
        raise UnsupportedDimensionsError(
            path,
            f"unsupported shape {tuple(raw.data.shape)}: {raw.data.ndim}-D; expected YX, YXC (RGB or "
            "channels), ZYX or TZYX",
        )
    if rgb and data.shape[-1] == 4 and data[..., 3].min() != data[..., 3].max():
        rgb, kind = False, "channels"  # a varying 4th "alpha" is data (np.stack of 4 channels)
    if (rgb and data.shape[-1] == 4) or kind == "alpha":
        data = data[..., :-1] if rgb else data[..., 0]
        notes.append("alpha channel dropped")
    data = _clean_dtype(path, data, notes)
    channels = int(data.shape[-1]) if kind == "channels" else 0
    return LoadedImage(np.ascontiguousarray(data), str(path), rgb, notes, channels)


def select_channel(loaded: LoadedImage, channel: int | None) -> LoadedImage:
    """The image to segment: ``loaded`` itself, or its channel ``channel`` (0-based) as a
    gray image. A multichannel image needs a channel (:class:`ChannelError` otherwise);
    colour images may name one too (R, G, B = 0, 1, 2), gray images only 0."""
    n = loaded.channels or (loaded.data.shape[-1] if loaded.rgb else 1)
    if channel is None:
        if loaded.channels:
            shape = _shape_text(loaded.data.shape)
            raise ChannelError(
                loaded.path, f"{n} channels (shape {shape}, channels last): choose the one to "
                f"segment with the option channel=N (0..{n - 1}), e.g. --set channel=0")
        return loaded
    if isinstance(channel, bool) or not isinstance(channel, (int, np.integer)) or not 0 <= channel < n:
        raise ChannelError(loaded.path, f"channel {channel!r} does not exist: the image has {n} "
                                        f"channel(s) (0..{n - 1})")
    if n == 1:
        return loaded
    kind = "colour channel" if loaded.rgb else "channel"
    return LoadedImage(np.ascontiguousarray(loaded.data[..., int(channel)]), loaded.path, False,
                       loaded.notes + [f"{kind} {int(channel)} of {n} segmented"])


def read_image(path: str | os.PathLike, max_bytes: int | None = None,
               channel: int | None = None) -> np.ndarray:
    """The pixel array of :func:`load_image` (of ``channel`` with :func:`select_channel`)."""
    return select_channel(load_image(path, max_bytes=max_bytes), channel).data


def peek_shape(path: str | os.PathLike) -> str:
    """``"YxX dtype"`` of an image file from its header (a TIFF's first series; without
    length-1 axes), or "" when unknown: the report rows of skipped files use it when no
    earlier row has it."""
    try:
        if Path(path).suffix.lower() in TIFF_SUFFIXES:
            import tifffile

            with tifffile.TiffFile(path) as tf:
                shape, dtype = tf.series[0].shape, tf.series[0].dtype
        else:
            import imageio.v3 as iio

            props = iio.improps(path)
            shape, dtype = props.shape, props.dtype
        return _shape_text([s for s in shape if s != 1] or list(shape[-2:]), dtype)
    except Exception:  # noqa: BLE001 - only a hint for the report
        return ""


def is_rgb(image: np.ndarray) -> bool:
    return image.ndim >= 3 and image.shape[-1] in (3, 4)


LUMINANCE = (0.299, 0.587, 0.114)  # ITU-R BT.601


def luminance(image) -> np.ndarray:
    """Luminance (ITU-R BT.601) of a (..., 3|4) RGB(A) image as float32; alpha is ignored.
    The one RGB-to-gray conversion of the package (``engine.normalize.to_gray`` is this)."""
    x = np.asarray(image)
    return x[..., :3].astype(np.float32) @ np.asarray(LUMINANCE, dtype=np.float32)


def to_gray(image: np.ndarray) -> np.ndarray:
    """Luminance of a YXC RGB(A) image as float32 (:func:`luminance`); other images unchanged."""
    if not is_rgb(image):
        return image
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
    pattern: str | Sequence[str] = DEFAULT_PATTERN,
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
