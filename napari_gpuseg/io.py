"""Reading and writing images, label files and object tables; folder scans.

GUI-free and torch-free. Every user-caused read problem raises a subclass of
:class:`ImageReadError` whose message says what is wrong with which file, so a folder job
can record it and move on.

Writes are atomic: the data goes to a hidden temp file in the destination folder (prefix
:data:`TEMP_PREFIX`), is flushed and fsynced, then renamed over the target with
``os.replace``. A crash or SIGKILL therefore leaves either the old file, no file, or a
temp file that :func:`remove_temp_files` cleans up, never a truncated file under the real
name.
"""
from __future__ import annotations

import contextlib
import csv
import fnmatch
import io as _io
import logging
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np

TIFF_SUFFIXES = (".tif", ".tiff")
TEMP_PREFIX = ".gpuseg-tmp-"
MAX_NDIM = 4  # YX, ZYX, TZYX (+ a trailing RGB(A) channel axis)
logger = logging.getLogger(__name__)


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
    """Luminance (ITU-R 601) of a YXC RGB(A) image as float32; other images unchanged."""
    if not is_rgb(image):
        return image
    weights = np.array([0.299, 0.587, 0.114], dtype=np.float32)
    return image[..., :3].astype(np.float32) @ weights


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


# ----------------------------------------------------------------------------- writing
def _temp_path(target: Path) -> tuple[int, str]:
    """A new hidden temp file beside ``target`` (mode 0666 minus the umask, like open()).

    The name carries the writing process id (``.gpuseg-tmp-NAME.PID-RANDOM.tmp``), so a
    clean-up never deletes the temp file of another live process writing the same folder."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    while True:
        tmp = target.parent / f"{TEMP_PREFIX}{target.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
        try:
            return os.open(tmp, flags, 0o666), str(tmp)
        except FileExistsError:
            continue


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (temp file in the same folder, fsync, rename)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _temp_path(target)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return target


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def label_dtype(labels: np.ndarray) -> np.dtype:
    """The smallest unsigned dtype that holds every label id."""
    top = int(labels.max()) if labels.size else 0
    for dt in (np.uint8, np.uint16, np.uint32):
        if top <= np.iinfo(dt).max:
            return np.dtype(dt)
    return np.dtype(np.uint64)


OUTPUT_TAG = "napari_gpuseg"  # key in a label TIFF's metadata: written by this program


def write_labels(path: str | os.PathLike, labels: np.ndarray, info: Mapping | None = None) -> Path:
    """Write an instance label image as a zlib-compressed TIFF, atomically.

    The TIFF's metadata says it was written here (``OUTPUT_TAG``), with ``info`` (e.g. the
    method and model): :func:`output_info` reads it back."""
    import tifffile

    labels = np.asarray(labels)
    if labels.dtype.kind not in "ui" and labels.dtype != bool:
        raise TypeError(f"labels must be integers, got {labels.dtype}")
    buf = _io.BytesIO()
    meta = {OUTPUT_TAG: 1, **{k: v for k, v in (info or {}).items() if k != "shape"}}
    tifffile.imwrite(buf, labels.astype(label_dtype(labels), copy=False), compression="zlib",
                     metadata=meta)
    return atomic_write_bytes(path, buf.getvalue())


def output_info(path: str | os.PathLike) -> dict | None:
    """The metadata :func:`write_labels` stored in ``path`` (None when another program
    wrote the file, or it is not a readable TIFF). Reads the header only."""
    try:
        import tifffile

        with tifffile.TiffFile(path) as tf:
            meta = tf.shaped_metadata
            if meta and isinstance(meta[0], dict) and OUTPUT_TAG in meta[0]:
                return {k: v for k, v in meta[0].items() if k != "shape"}
    except Exception as exc:  # noqa: BLE001 - not ours
        logger.debug("%s: no napari-gpuseg output metadata (%s: %s)", path, type(exc).__name__, exc)
    return None


def read_output(path: str | os.PathLike) -> tuple[np.ndarray, dict | None] | None:
    """(labels, :func:`output_info`) of a complete label file, or None when ``path`` is
    missing, empty or not fully readable (the same test as :func:`is_valid_output`)."""
    path = Path(path)
    try:
        if not path.is_file() or path.stat().st_size == 0:
            return None
        import tifffile

        with tifffile.TiffFile(path) as tf:
            if not tf.pages:
                return None
            labels = tf.asarray()
            meta = tf.shaped_metadata
        info = meta[0] if meta and isinstance(meta[0], dict) and OUTPUT_TAG in meta[0] else None
        return labels, ({k: v for k, v in info.items() if k != "shape"} if info else None)
    except Exception:  # noqa: BLE001 - anything unreadable is not a valid output
        return None


def check_writable_dir(folder: str | os.PathLike) -> Path:
    """Create ``folder`` if needed and prove it is writable (a probe file is written,
    fsynced and removed). Raises ``OSError`` with a one-line message saying why not."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(f"output folder {folder} is an existing file, not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OSError(exc.errno, f"output folder {folder} cannot be created: "
                                 f"{exc.strerror or exc}") from exc
    try:
        fd, tmp = _temp_path(folder / "write-probe")  # a name of its own: runs may overlap
        try:
            os.write(fd, b"probe")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(tmp)
    except OSError as exc:
        raise OSError(exc.errno, f"output folder {folder} is not writable: "
                                 f"{exc.strerror or exc}") from exc
    return folder


def read_labels(path: str | os.PathLike) -> np.ndarray:
    import tifffile

    return np.asarray(tifffile.imread(path))


def is_valid_output(path: str | os.PathLike) -> bool:
    """True if ``path`` is a complete, readable TIFF (all pixel data decodes)."""
    path = Path(path)
    try:
        if not path.is_file() or path.stat().st_size == 0:
            return False
        import tifffile

        with tifffile.TiffFile(path) as tf:
            if not tf.pages:
                return False
            tf.asarray()
        return True
    except Exception:  # noqa: BLE001 - anything unreadable is not a valid output
        return False


def temp_owner(temp: str | os.PathLike) -> int | None:
    """The id of the process that created a temp file (None for names without one)."""
    tag = Path(temp).name.rsplit(".", 2)[-2] if Path(temp).name.count(".") >= 2 else ""
    pid, sep, _ = tag.partition("-")
    return int(pid) if sep and pid.isdigit() else None


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # exists, owned by someone else
    return True


def temp_target(temp: str | os.PathLike) -> Path:
    """The file a temp file of :func:`atomic_write_bytes` was going to become."""
    temp = Path(temp)
    return temp.with_name(temp.name[len(TEMP_PREFIX):].rsplit(".", 2)[0])


def remove_temp_files(
    folder: str | os.PathLike, recursive: bool = True,
    targets: Iterable[str | os.PathLike] | None = None,
) -> int:
    """Delete temp files left by interrupted atomic writes; returns how many.

    ``targets``: only temp files of these destination paths (so concurrent jobs writing
    other files into the same folder, e.g. the shards of a job array, are left alone).
    A temp file whose writing process is still alive (this one included) is never
    deleted: it is a write in progress, maybe of another run into the same folder.
    """
    root = Path(folder)
    if not root.is_dir():
        return 0
    wanted = None if targets is None else {os.path.abspath(t) for t in targets}
    it = root.rglob(TEMP_PREFIX + "*") if recursive else root.glob(TEMP_PREFIX + "*")
    n = 0
    for p in it:
        if wanted is not None and os.path.abspath(temp_target(p)) not in wanted:
            continue
        owner = temp_owner(p)
        if owner is not None and _process_alive(owner):
            continue
        with contextlib.suppress(OSError):
            p.unlink()
            n += 1
    return n


# ----------------------------------------------------------------------------- tables
_AXES = {2: ("y", "x"), 3: ("z", "y", "x"), 4: ("t", "z", "y", "x")}


def object_table(
    labels: np.ndarray, scores: Mapping[int, float] | np.ndarray | None = None
) -> dict[str, np.ndarray]:
    """Per-object area, bounding box (end exclusive) and centroid, and the score when
    given, one row per label id present (the same numbers as skimage's
    ``regionprops_table``, computed in a few vectorised passes).

    ``scores`` maps label id -> score, or is an array with ``scores[id - 1]``.
    """
    from scipy import ndimage as ndi

    labels = np.asarray(labels)
    if labels.dtype.kind not in "ui":
        labels = labels.astype(np.int64)
    nd = labels.ndim
    axes = _AXES.get(nd, tuple(f"d{i}" for i in range(nd)))
    flat = labels.ravel()
    counts = np.bincount(flat) if flat.size else np.zeros(1, np.int64)
    ids = np.nonzero(counts)[0]
    ids = ids[ids > 0]
    area = counts[ids]
    slices = ndi.find_objects(labels) if ids.size else []
    table: dict[str, np.ndarray] = {"label": ids, "area": area}
    for i, ax in enumerate(axes):
        table[f"bbox_{ax}0"] = np.array([slices[k - 1][i].start for k in ids], dtype=np.int64)
    for i, ax in enumerate(axes):
        table[f"bbox_{ax}1"] = np.array([slices[k - 1][i].stop for k in ids], dtype=np.int64)
    for i, ax in enumerate(axes):
        shape = [1] * nd
        shape[i] = labels.shape[i]
        coord = np.broadcast_to(np.arange(labels.shape[i], dtype=np.float64).reshape(shape), labels.shape)
        sums = np.bincount(flat, weights=coord.ravel(), minlength=counts.size)
        table[f"centroid_{ax}"] = sums[ids] / np.maximum(area, 1)
    if scores is not None:
        if isinstance(scores, Mapping):
            table["score"] = np.array([float(scores.get(int(i), np.nan)) for i in ids])
        else:
            arr = np.asarray(scores, dtype=float)
            table["score"] = np.array([arr[i - 1] if 0 < i <= arr.size else np.nan for i in ids])
    return table


def table_to_csv(table: Mapping[str, Sequence]) -> str:
    """CSV text of a column table (floats with 6 significant digits)."""
    buf = _io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    cols = list(table)
    writer.writerow(cols)
    columns = []
    for c in cols:
        values = table[c].tolist() if isinstance(table[c], np.ndarray) else list(table[c])
        columns.append([f"{v:.6g}" if isinstance(v, float) else v for v in values])
    writer.writerows(zip(*columns))
    return buf.getvalue()


def write_object_table(
    path: str | os.PathLike,
    labels: np.ndarray,
    scores: Mapping[int, float] | np.ndarray | None = None,
) -> Path:
    """Write :func:`object_table` as CSV, atomically."""
    return atomic_write_text(path, table_to_csv(object_table(labels, scores)))


def read_csv(path: str | os.PathLike) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))
