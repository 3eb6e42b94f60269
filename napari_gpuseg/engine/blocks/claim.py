"""Who writes a block run's outputs: one run at a time, and one input per output name.

A block run holds an exclusive lock on ``OUT/.gpuseg-owner-<stem>.json`` (and, when the
labels go into the input store, on ``<store>/labels/.gpuseg-lock``) from its start to its
end: a second run on the same outputs is refused in one line instead of racing the first
(whose end removes the shared work folder). The owner file also names the input store that
writes ``<stem>_labels.ome.zarr`` / ``<stem>_objects.csv`` in OUT: another store whose name
gives the same stem is refused ("output name ... already used by ..."), as folder jobs refuse
two files with one output name. The locks are the operating system's (``flock``; released
when the process ends, also when it is killed). GUI-free.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

OWNER_PREFIX = ".gpuseg-owner-"
STORE_LOCK = ".gpuseg-lock"


class ClaimError(RuntimeError):
    """The outputs are taken (by a run now, or by another input); one line."""


def _lock(fd: int) -> bool:
    """An exclusive lock on the open file ``fd`` without waiting: True when taken."""
    try:
        import fcntl
    except ImportError:  # Windows
        import msvcrt

        try:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
            return True
        except OSError:
            return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False


class OutputClaim:
    """The locks (and the owner record) of one block run; ``release()`` when done."""

    def __init__(self, out_dir, stem: str, source: str | None, store_labels: str | None = None,
                 overwrite: bool = False):
        self.owner_path = Path(out_dir) / f"{OWNER_PREFIX}{stem}.json"
        self.source = source  # resolved input store path (None: an in-memory array)
        self.store_labels = store_labels  # the input store's labels/ folder when writing there
        self.overwrite = overwrite
        self._fds: list[int] = []

    def acquire(self) -> "OutputClaim":
        try:
            fd = self._open_locked(self.owner_path, f"the outputs of {self.owner_path.name[len(OWNER_PREFIX):-5]} "
                                                    f"in {self.owner_path.parent}")
            self._check_owner(fd)
            if self.store_labels:
                Path(self.store_labels).mkdir(parents=True, exist_ok=True)
                self._open_locked(Path(self.store_labels) / STORE_LOCK,
                                  f"the labels of {Path(self.store_labels).parent.name}")
        except BaseException:
            self.release()
            raise
        return self

    def _open_locked(self, path: Path, what: str) -> int:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        self._fds.append(fd)
        if not _lock(fd):
            raise ClaimError(f"another run is writing {what} now: wait for it to end (or use another "
                             "output folder)")
        return fd

    def _check_owner(self, fd: int) -> None:
        if self.source is None:
            return
        os.lseek(fd, 0, os.SEEK_SET)
        raw = os.read(fd, 1 << 16)
        try:
            owner = json.loads(raw.decode("utf-8")).get("source") if raw.strip() else None
        except (ValueError, UnicodeDecodeError, AttributeError):
            owner = None
        if owner and owner != self.source:
            stem = self.owner_path.name[len(OWNER_PREFIX):-5]
            if os.path.exists(owner) or not self.overwrite:
                gone = "" if os.path.exists(owner) else " (gone now; overwrite replaces its outputs)"
                raise ClaimError(f"output name {stem}_labels.ome.zarr / {stem}_objects.csv in "
                                 f"{self.owner_path.parent} already used by {owner}{gone}: choose another "
                                 "output folder")
        if owner != self.source:
            data = json.dumps({"source": self.source}).encode()
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
            os.write(fd, data)
            os.fsync(fd)

    def release(self) -> None:
        for fd in self._fds:
            try:
                os.close(fd)  # closing the file releases its lock
            except OSError:
                pass
        self._fds = []

    def __enter__(self) -> "OutputClaim":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
