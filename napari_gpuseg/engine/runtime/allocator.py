"""glibc's allocator told to keep its memory, so CPU inference does not live in the kernel.

With glibc's defaults every freed block of more than a few MiB goes back to the OS (``munmap``
or a heap trim) and the next operator page-faults fresh, zeroed pages: embedding a
520 x 696 BBBC039 field with LiteMedSAM on a 2-core CPU spent much of its CPU time in the
kernel (numbers: docs/benchmarks.md). :func:`configure_allocator` sets, through ``mallopt``, what
``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` / ``MALLOC_TOP_PAD_`` would, and one
thing more (measured in ``benchmarks/allocator.py``):

* ``M_MMAP_THRESHOLD`` 32 MiB (the most every glibc's ``mallopt`` takes on 64-bit; 2.36
  takes more) so tensors below it come from the heap and are reused there;
* ``M_TRIM_THRESHOLD`` huge: freed heap memory is not given back after every large free;
* ``M_TOP_PAD`` 1 GiB: the heap grows in big steps (few ``brk`` calls and page faults);
* ``M_MMAP_MAX`` 0: blocks above the threshold are heap blocks too (no ``mmap`` /
  ``munmap`` per tensor), which is what makes the difference for the encoder's largest
  activations;
* ``M_ARENA_MAX`` 1: every thread allocates from the main heap. A thread's own arena is
  made of 64 MiB heaps that glibc maps and unmaps by itself, so the settings above did not
  help the GUI's worker thread (embedding in a second thread: kernel time as high with them
  as with the ``MALLOC_*`` variables, next to none with one arena; docs/benchmarks.md).

The set-up is process-wide and cannot be undone, so it is applied only where it was
measured to help: by ``napari-gpuseg batch`` and ``train`` at start, and by the inference
and training workers on the CPU, before their thread starts (``worker.py``); importing the
package changes nothing, and napari on a GPU machine keeps glibc's defaults. Memory is still returned after
large work: :func:`trim` (``malloc_trim``) runs when a worker goes idle, once the set-up is
on and more than :data:`TRIM_MIN_FREE` bytes lie free in the heap. It does nothing off
Linux, off glibc, when the user set any ``MALLOC_*`` variable or a ``glibc.malloc`` tunable
(their choice wins), or with ``NAPARI_GPUSEG_MALLOC=0``. Idempotent.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -2, -3, -4, -8
MMAP_THRESHOLD = 32 * 2**20  # older glibc's maximum through mallopt on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int
TOP_PAD = 2**30
SETTINGS = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
            (M_TOP_PAD, TOP_PAD), (M_MMAP_MAX, 0), (M_ARENA_MAX, 1))

TRIM_MIN_FREE = 64 * 2**20  # free heap bytes worth a malloc_trim when a worker goes idle

_state: dict = {}  # "result": what the first call decided; "libc": glibc once configured


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _user_choice(environ) -> str | None:
    if str(environ.get("NAPARI_GPUSEG_MALLOC", "")).strip().lower() in ("0", "off", "no", "false"):
        return "NAPARI_GPUSEG_MALLOC=0"
    names = sorted(k for k in environ if k.startswith("MALLOC_"))
    if names:
        return f"{names[0]} is set"
    if "glibc.malloc" in environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES sets glibc.malloc"
    return None


def _glibc():
    """The C library if it is glibc (a ``mallopt`` we know), else None."""
    if platform.system() != "Linux":
        return None
    name, _version = platform.libc_ver()
    if name != "glibc":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        getattr(libc, "gnu_get_libc_version")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return libc


def configure_allocator(environ=None) -> str:
    """Set glibc's malloc to keep freed memory (see the module text). Returns what was done:
    ``"configured"`` or ``"skipped: <why>"``; later calls return the first call's answer."""
    if "result" in _state:
        return _state["result"]
    environ = os.environ if environ is None else environ
    why = _user_choice(environ)
    libc = None if why else _glibc()
    if why is None and libc is None:
        why = f"not glibc on Linux ({platform.system()} {'/'.join(platform.libc_ver())})"
    if why is not None:
        result = f"skipped: {why}"
    else:
        failed = [param for param, value in SETTINGS if libc.mallopt(param, value) != 1]
        result = "configured" if not failed else f"configured (mallopt refused {failed})"
        _state["libc"] = libc
    _state["result"] = result
    return result


def free_heap_bytes() -> int | None:
    """Free bytes inside glibc's heap (``mallinfo2().fordblks``); None where unknown."""
    libc = _state.get("libc")
    fn = getattr(libc, "mallinfo2", None) if libc is not None else None
    if fn is None:
        return None
    fn.restype = _Mallinfo2
    fn.argtypes = []
    return int(fn().fordblks)


def trim(min_free: int = TRIM_MIN_FREE) -> bool:
    """Give freed heap memory back to the OS (``malloc_trim(0)``) when the set-up is on and
    at least ``min_free`` bytes are free (always where glibc cannot say). Returns whether
    it trimmed. Without the set-up glibc trims by itself and this does nothing."""
    libc = _state.get("libc")
    if libc is None:
        return False
    free = free_heap_bytes()
    if free is not None and free < min_free:
        return False
    libc.malloc_trim(ctypes.c_size_t(0))
    return True
