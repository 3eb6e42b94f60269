"""Writing outputs safely: atomic writes, label TIFFs that say who wrote them, checks that
an output is complete, and the clean-up of temp files left by interrupted runs.

Writes are atomic: the data goes to a hidden temp file in the destination folder (prefix
:data:`TEMP_PREFIX`), is flushed and fsynced, then renamed over the target with
``os.replace``. A crash or SIGKILL therefore leaves either the old file, no file, or a
temp file that :func:`remove_temp_files` cleans up, never a truncated file under the real
name. GUI-free and torch-free.
"""
from __future__ import annotations

import contextlib
import io as _io
import logging
import os
import secrets
from pathlib import Path
from typing import Iterable, Mapping

import numpy as np

TEMP_PREFIX = ".gpuseg-tmp-"
OUTPUT_TAG = "napari_gpuseg"  # key in a label TIFF's metadata: written by this program
logger = logging.getLogger(__name__)


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


def _our_info(tf) -> dict | None:
    """The metadata :func:`write_labels` stored in an open ``tifffile.TiffFile`` (None when
    another program wrote it)."""
    meta = tf.shaped_metadata
    if meta and isinstance(meta[0], dict) and OUTPUT_TAG in meta[0]:
        return {k: v for k, v in meta[0].items() if k != "shape"}
    return None


def output_info(path: str | os.PathLike) -> dict | None:
    """The metadata :func:`write_labels` stored in ``path`` (None when another program
    wrote the file, or it is not a readable TIFF). Reads the header only."""
    try:
        import tifffile

        with tifffile.TiffFile(path) as tf:
            return _our_info(tf)
    except Exception as exc:  # noqa: BLE001 - not ours
        logger.debug("%s: no napari-gpuseg output metadata (%s: %s)", path, type(exc).__name__, exc)
    return None


def read_output(path: str | os.PathLike) -> tuple[np.ndarray, dict | None] | None:
    """(labels, :func:`output_info`) of a complete label file, or None when ``path`` is
    missing, empty or not fully readable (all pixel data must decode)."""
    path = Path(path)
    try:
        if not path.is_file() or path.stat().st_size == 0:
            return None
        import tifffile

        with tifffile.TiffFile(path) as tf:
            if not tf.pages:
                return None
            return tf.asarray(), _our_info(tf)
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
    return read_output(path) is not None


def temp_owner(temp: str | os.PathLike) -> int | None:
    """The id of the process that created a temp file (None for names without one)."""
    tag = Path(temp).name.rsplit(".", 2)[-2] if Path(temp).name.count(".") >= 2 else ""
    pid, sep, _ = tag.partition("-")
    return int(pid) if sep and pid.isdigit() else None


def _process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (owned by anyone). ``psutil.pid_exists``, never
    ``os.kill(pid, 0)``: on Windows signal 0 is ``CTRL_C_EVENT``, which would say "alive"
    for every id and could send Ctrl-C to a console process."""
    import psutil

    try:
        return bool(psutil.pid_exists(pid))
    except Exception:  # noqa: BLE001 - cannot tell: keep the file (it may be a write in progress)
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
