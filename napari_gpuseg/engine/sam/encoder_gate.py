"""A one-byte flag shared with the second encoder process: while it is up, that process's
encoder waits at its pause points, so a prompt served in this process meanwhile has the cores.

On a 2-core machine, a box drawn right after a drop outside the tile the second process is
embedding needs its own view, embedded here at a worker's pause point, beside the second
process's tile (one thread) and napari's work on the GUI thread. With that process waiting
meanwhile, box to mask took 391 ms instead of 507 ms (median, Xeon AMX, bf16;
``benchmarks/first_mask.py --box-at corner --hold-process alternate``). The prompt comes
first, the speculative tile after it: :class:`Gate` is raised around each job a pause point serves while the second
process works (:meth:`.encoder_process.EncoderProcess.held`), and that process's encoder waits
between its blocks (:class:`GateReader`, the same pause points as the worker's).

The flag is a byte of a memory-mapped temporary file (the same pages in both processes, on
every platform): 0 while down, else a number that changes with each raise. The second process
waits at most :data:`MAX_WAIT_S` for one raise, so it never waits for good, even when this
process ends while the flag is up.
"""
from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
import threading
import time
import weakref
from typing import Callable

MAX_WAIT_S = 2.0
"""The longest the second process waits for one raise of the flag (a prompt's view takes
0.3-0.6 s on 2 cores)."""


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


class Gate:
    """The writing end, in napari's process: :meth:`raised` holds the flag up (nested
    raises count); :attr:`path` goes to the second process."""

    def __init__(self) -> None:
        fd, self.path = tempfile.mkstemp(prefix="napari-gpuseg-gate-")
        try:
            os.write(fd, b"\0")
            self._map: mmap.mmap | None = mmap.mmap(fd, 1)
        except (OSError, ValueError):
            self.unlink()
            raise
        finally:
            os.close(fd)
        self._depth = 0
        self._lock = threading.Lock()
        self.raises = 0  # times the flag went up
        # the file goes when this gate does, or when Python exits (napari closed while the
        # second process was still starting, before it could map the file)
        self._remove_at_exit = weakref.finalize(self, _remove, self.path)

    @contextlib.contextmanager
    def raised(self):
        with self._lock:
            self._depth += 1
            if self._depth == 1 and self._map is not None:
                self.raises += 1
                self._map[0] = 1 + self.raises % 255  # a new number: a new raise
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0 and self._map is not None:
                    self._map[0] = 0

    def unlink(self) -> None:
        """Remove the file once the other process has mapped it (the mapping lives on; no
        file is left behind, however this process ends). Where the platform refuses while
        it is mapped (Windows), :meth:`close` tries again."""
        _remove(self.path)

    def close(self) -> None:
        """Lower the flag, unmap it and remove the file if it is still there."""
        with self._lock:
            if self._map is not None:
                self._map[0] = 0
                self._map.close()
                self._map = None
        self.unlink()
        self._remove_at_exit.detach()


class GateReader:
    """The reading end, in the second process: :meth:`wait` returns at once while the flag
    is down; else when it goes down, or after :data:`MAX_WAIT_S`."""

    def __init__(self, path: str) -> None:
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 1, access=mmap.ACCESS_READ)
        self.waited = 0.0  # seconds spent waiting, all raises together
        self._outlasted = 0  # the raise whose wait ran out: not waited for again

    def wait(self, while_waiting: Callable[[], None] | None = None) -> None:
        """``while_waiting()`` is called every 2 ms meanwhile (the second process serves a
        prompt's crop then)."""
        token = self._map[0]
        if not token or token == self._outlasted:
            return
        t0 = time.monotonic()
        end = t0 + MAX_WAIT_S
        while self._map[0] == token:
            if time.monotonic() >= end:
                self._outlasted = token
                break
            if while_waiting is not None:
                while_waiting()
            time.sleep(0.002)
        self.waited += time.monotonic() - t0
