"""A SAM image encoder in a second process, for a new image's first tile on a CPU.

Right after a drop, two things run at once on a CPU: napari builds the new image's layers
and draws them (0.4-0.7 s of Python on the GUI thread on a 2-core machine), and the
encoder embeds the tile under the view, which the first prompt needs. In one process they
share Python's interpreter lock: the encoder's few hundred operators each wait for the GUI
thread to hand the lock over (every 5 ms) before they can start, so the tile is done only
after the window is idle again, one after the other. A second process has its own
interpreter, and with one intra-op thread it takes one core and leaves the other to the
window, so both run side by side (``benchmarks/first_mask.py --encoder-process alternate``).
After the first tile the dock's own encoder (all cores, pause points for prompts) is faster
again, so only that tile goes here, and only while :func:`.encoder_slot.worth_it` says the
second process ends it sooner (measured tile times of both, and the window's work after the
last drop).

:class:`EncoderProcess` starts ``python -m napari_gpuseg.engine.sam.encoder_process`` with
the model's name and the precision, and talks to it over its stdin and stdout: length-framed
pickles of ``(request id, tensor)`` both ways. Anything that goes wrong there (the process
could not start or load the model, died, timed out, answered with an error) makes
:meth:`EncoderProcess.encode` return None, and the caller embeds the tile itself: this
process only ever makes things faster, never breaks them. The process ends when its stdin
closes: :meth:`EncoderProcess.close`, or this process ending for any reason. While a prompt
is served here at a pause point, the process's encoder waits (:meth:`EncoderProcess.held`,
:mod:`.encoder_gate`): the prompt has the cores, the speculative tile comes after it. A
prompt's small crop (``crop_look``) sent meanwhile is embedded there first
(:meth:`EncoderProcess.look`, :mod:`.encoder_serve`).
"""
from __future__ import annotations

import contextlib
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from typing import Callable

import psutil
import torch

from .encoder_frames import pack, read, unpack, write
from .encoder_gate import Gate

logger = logging.getLogger(__name__)

ENV = "NAPARI_GPUSEG_ENCODER_PROCESS"
"""Set to 0 to keep every encoder call in the napari process."""

MAX_PARAMS = 50_000_000
"""Encoders up to this size get a copy in a second process (TinyViT: 6 M; SAM ViT-B's
86 M and larger would double a large memory footprint for a tile that a GPU makes moot)."""

MIN_AVAILABLE_BYTES = 1 << 30
"""Memory that must be available before the second process starts: it holds about 420 MB
(torch, the encoder and its working buffers), and a machine short of memory needs it more
for the images than for a faster first tile."""


def wanted(encoder: torch.nn.Module, device: torch.device) -> bool:
    """Whether a second process would help: a CPU device, a small encoder, at least
    :data:`MIN_AVAILABLE_BYTES` of memory available, and not switched off through
    ``NAPARI_GPUSEG_ENCODER_PROCESS=0``."""
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if device.type != "cpu" or sum(p.numel() for p in encoder.parameters()) > MAX_PARAMS:
        return False
    available = psutil.virtual_memory().available
    if available < MIN_AVAILABLE_BYTES:
        logger.info("no second encoder process: %.0f MB of memory available, %.0f MB wanted",
                    available / 2**20, MIN_AVAILABLE_BYTES / 2**20)
        return False
    return True


def default_threads() -> int:
    """Intra-op threads of the second process: all of this process's but one, which stays
    with the window (napari's GUI thread); one on a 2-core machine."""
    return max(1, torch.get_num_threads() - 1)


def warm_tile(engine) -> None:
    """One untimed encoder call on a blank tile: the first call's one-off costs, paid now."""
    n = engine.input_size
    engine.encode(torch.zeros(1, 3, n, n))


def time_tile(engine, repeats: int = 2, warm: bool = True) -> float:
    """Seconds of a warm encoder call on a blank tile alone: the fastest of ``repeats``
    (after an untimed call that pays the first call's one-off costs, unless ``warm`` is
    False: the engine has made one already)."""
    n = engine.input_size
    x = torch.zeros(1, 3, n, n)
    if warm:
        warm_tile(engine)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        engine.encode(x)
        best = min(best, time.perf_counter() - t0)
    return best


class EncoderProcess:
    """A second process holding ``model``'s image encoder (on the CPU, at ``precision``,
    ``threads`` intra-op threads, default :func:`default_threads`). Starting it does not
    wait: :attr:`ready` turns true once the model is loaded and warm (a few seconds)."""

    def __init__(self, model: str, precision: str, threads: int | None = None,
                 command: list[str] | None = None) -> None:
        if threads is None:
            threads = default_threads()
        self.model, self.precision = str(model), precision
        self.state = "starting"  # -> "ready" | "failed" | "closed"
        self.error: str | None = None
        self.calls = 0  # tiles embedded here
        self.tile_seconds: float | None = None  # its tile time alone, measured as it starts
        self.held_seconds = 0.0  # its encoder's waits while prompts were served here
        self._replies: queue.Queue = queue.Queue()
        # one reader of the replies at a time; the same thread again for a look sent from
        # a pause point while it waits for a tile (:meth:`look`)
        self._consume = threading.RLock()
        self._awaiting: set[int] = set()  # requests whose replies are waited for
        self._stash: dict[int, tuple] = {}  # their replies, read while waiting for another
        self.looks = 0  # prompts' crops embedded here (:meth:`look`)
        self._busy = False  # an encode under way (a nested call from a pause point gets None)
        self._next_id = 0
        self.sent = threading.Event()  # set each time a tile is handed over
        try:
            self._gate: Gate | None = Gate()
        except (OSError, ValueError) as exc:  # no shared flag: the process never waits for prompts
            logger.info("encoder process: no pause flag (%s)", exc)
            self._gate = None
        cmd = command or [sys.executable, "-m", __name__, self.model, precision, str(threads),
                          *([self._gate.path] if self._gate is not None else [])]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        flags = getattr(subprocess, "CREATE_NO_WINDOW", 0)  # Windows: no console window
        try:
            self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, env=env, creationflags=flags)
        except OSError as exc:
            self._proc = None
            self._fail(f"could not start: {exc}")
            return
        threading.Thread(target=self._read_replies, name="napari-gpuseg-encoder-process",
                         daemon=True).start()

    def _read_replies(self) -> None:
        out = self._proc.stdout
        while True:
            try:
                msg = read(out)
            except Exception as exc:  # noqa: BLE001 - a broken frame ends the conversation
                msg = ("error", f"unreadable reply: {exc}")
            if msg is None:
                self._replies.put(("eof",))
                return
            self._replies.put(msg)

    def _fail(self, reason: str) -> None:
        if self.state in ("failed", "closed"):
            return
        self.state, self.error = "failed", reason
        logger.warning("encoder process for %s: %s (tiles are embedded in this process)",
                       self.model, reason)
        self._stop()

    def _handle(self, msg) -> None:
        """A message that is not the reply awaited: status, or a late reply (dropped)."""
        kind = msg[0]
        if kind == "ready" and self.state == "starting":
            self.state, self.tile_seconds = "ready", msg[2]
            if self._gate is not None:  # mapped there by now: its file can go
                self._gate.unlink()
        elif kind == "error":
            self._fail(msg[1])
        elif kind == "eof":
            self._fail("the process ended")

    def _drain(self) -> None:
        while True:
            try:
                self._handle(self._replies.get_nowait())
            except queue.Empty:
                return

    def held(self):
        """A context in which the process's encoder waits at its pause points (at most
        :data:`.encoder_gate.MAX_WAIT_S`): entered around each job a worker's pause point
        serves while this process embeds a tile (:meth:`.encoder_slot.EncoderSlot.offload`)."""
        if self._gate is None or self.state != "ready":
            return contextlib.nullcontext()
        return self._gate.raised()

    @property
    def ready(self) -> bool:
        """True while the process has the model loaded and answers."""
        if self.state in ("starting", "ready") and self._consume.acquire(blocking=False):
            try:
                self._drain()  # news of its start, or of its end
            finally:
                self._consume.release()
        return self.state == "ready"

    def wait_ready(self, timeout: float) -> bool:
        """Block up to ``timeout`` s for :attr:`ready` (tests, benchmarks)."""
        end = time.monotonic() + timeout
        with self._consume:
            while self.state == "starting" and time.monotonic() < end:
                try:
                    self._handle(self._replies.get(timeout=0.05))
                except queue.Empty:
                    pass
        return self.ready

    def encode(self, batch: torch.Tensor, wait: Callable[[], None] | None = None,
               timeout: float = 60.0) -> torch.Tensor | None:
        """The encoder's output for ``batch`` computed in the second process, or None (not
        ready, busy with another call, or failed: the caller computes it itself). While
        waiting, ``wait()`` is called every 10 ms (a worker's pause point: queued prompts
        run meanwhile; an exception from it abandons the call, whose late reply is dropped)."""
        if self._busy or not self._consume.acquire(blocking=False):
            return None
        self._busy = True
        try:
            self._drain()
            if self.state != "ready":
                return None
            rid = self._send("encode", batch)
            if rid is None:
                return None
            self.sent.set()
            out = self._await(rid, timeout, wait)
            if isinstance(out, str):  # "timeout"
                self._fail(f"no answer within {timeout:.0f} s")
                return None
            if out is not None:
                self.calls += 1
            return out
        finally:
            self._busy = False
            self._consume.release()

    def look(self, batch: torch.Tensor, timeout: float = 2.0) -> torch.Tensor | None:
        """The encoder's output for a prompt's small crop (``crop_look``), computed here while
        this process waits for a tile from the second process: a worker's pause point
        serves the look job inside that wait, and the second process serves the look at its
        encoder's next pause point, before the rest of the tile. None at any other time (or
        on any failure, or after ``timeout`` s): the caller embeds the crop itself."""
        if not self._busy or self.state != "ready" or not self._consume.acquire(blocking=False):
            return None
        try:
            rid = self._send("look", batch)
            out = None if rid is None else self._await(rid, timeout, None)
            if out is None or isinstance(out, str):  # failed, or "timeout"
                return None
            self.looks += 1
            return out
        finally:
            self._consume.release()

    def _send(self, kind: str, batch: torch.Tensor) -> int | None:
        self._next_id += 1
        rid = self._next_id
        try:
            write(self._proc.stdin, (kind, rid, *pack(batch)))
        except (OSError, ValueError) as exc:  # a closed pipe: the process is gone
            self._fail(f"could not send a {kind}: {exc}")
            return None
        return rid

    def _await(self, rid: int, timeout: float, wait: Callable[[], None] | None):
        """The reply to request ``rid``: its tensor, None (it failed there, or the process
        did) or ``"timeout"``. Replies to other requests waited for meanwhile (a tile's,
        while a look waits) are kept for them; late ones are dropped."""
        self._awaiting.add(rid)
        try:
            end = time.monotonic() + timeout
            while True:
                msg = self._stash.pop(rid, None)
                if msg is None:
                    try:
                        msg = self._replies.get(timeout=0.01)
                    except queue.Empty:
                        if time.monotonic() > end:
                            return "timeout"
                        if wait is not None:
                            wait()
                        continue
                if msg[0] in ("result", "failed") and msg[1] != rid:
                    if msg[1] in self._awaiting:
                        self._stash[msg[1]] = msg
                    continue
                if msg[0] == "result":
                    self.held_seconds += msg[2]
                    return unpack(*msg[3:])
                if msg[0] == "failed":
                    logger.warning("encoder process: %s (embedded here instead)", msg[2])
                    return None
                self._handle(msg)
                if self.state != "ready":
                    return None
        finally:
            self._awaiting.discard(rid)

    def _stop(self) -> None:
        """Close the process's input (it exits at its end) and reap it in a daemon thread
        (killed after 5 s): nobody waits, not the GUI thread closing a dock."""
        proc, gate = self._proc, self._gate
        if proc is None or proc.poll() is not None:
            if gate is not None:
                gate.close()
            return
        try:
            proc.stdin.close()
        except (OSError, ValueError):
            pass

        def reap() -> None:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            finally:
                if gate is not None:  # once the process no longer maps its file
                    gate.close()

        threading.Thread(target=reap, name="napari-gpuseg-encoder-reaper", daemon=True).start()

    def kill(self) -> None:
        """End the process now, mid-start or mid-tile (:meth:`close` waits for it to read
        its input's end, which a starting process does only once loaded)."""
        if self.state != "closed":
            self.state = "closed"
            proc, gate = self._proc, self._gate
            if proc is not None and proc.poll() is None:
                proc.kill()

                def reap() -> None:
                    proc.wait()
                    if gate is not None:
                        gate.close()

                threading.Thread(target=reap, daemon=True).start()
            elif gate is not None:
                gate.close()

    def close(self) -> None:
        """End the process (see :meth:`_stop`); returns at once."""
        if self.state != "closed":
            self._stop()
            self.state = "closed"

    def __del__(self):  # a dock that went without closing it
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def main(argv: list[str] | None = None) -> None:
    args = argv if argv is not None else sys.argv[1:]
    model, precision, threads = args[:3]
    stdin = sys.stdin.buffer
    stdout = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints never reach the frames
    from .encoder_serve import serve

    serve(model, precision, int(threads), stdin, stdout, args[3] if len(args) > 3 else None)


if __name__ == "__main__":
    main()
