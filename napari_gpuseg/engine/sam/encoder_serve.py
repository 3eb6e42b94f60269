"""The second encoder process's side (``python -m napari_gpuseg.engine.sam.encoder_process``):
load the model, then answer frames until stdin ends.

Two kinds of request: ``encode`` (a new image's first tile, the one napari's process hands
over after a drop) and ``look`` (a prompt's small crop, ``crop_look``, sent while that tile is
under way). A look goes first: the tile's encoder serves it at its next pause point (the
same points as the worker's, a few milliseconds apart) and goes on afterwards. In this
process it runs beside napari's GUI thread without sharing Python's lock with it; in
napari's process each of its operators waits for that lock while the window paints the new
image's layers. While the flag in ``gate`` is up (a prompt served in napari's process,
:mod:`.encoder_gate`), the tile waits, and looks are still served.
"""
from __future__ import annotations

import collections
import os
import queue
import threading

import torch

from .encoder_frames import pack, read, unpack, write
from .encoder_gate import GateReader


class _Server:
    def __init__(self, engine, stdout, inbox: queue.Queue, reader: GateReader | None) -> None:
        self.engine, self.stdout, self.inbox, self.reader = engine, stdout, inbox, reader
        self.pending: collections.deque = collections.deque()  # tiles that came during a tile
        self.in_look = False
        self.threads = torch.get_num_threads()
        # a look has every core: the tile it interrupts waits, and napari's worker too
        self.look_threads = self.threads + 1

    def pause(self) -> None:
        """The tile's encoder at a pause point: looks first, then the flag's wait."""
        if self.in_look:
            return
        self.take_looks()
        if self.reader is not None:
            self.reader.wait(while_waiting=self.take_looks)

    def take_looks(self) -> None:
        while True:
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                return
            if msg is not None and msg[0] == "look":
                self.answer(msg)
            else:
                self.pending.append(msg)

    def answer(self, msg) -> None:
        kind, rid, *packed = msg
        self.in_look = kind == "look"  # a look never waits, for the flag or at its own pauses
        if self.in_look:
            torch.set_num_threads(self.look_threads)
        try:
            waited = self.reader.waited if self.reader is not None else 0.0
            out = self.engine.encode(unpack(*packed))
            waited = (self.reader.waited if self.reader is not None else 0.0) - waited
            write(self.stdout, ("result", rid, 0.0 if self.in_look else waited, *pack(out)))
        except Exception as exc:  # noqa: BLE001 - one failed request, the parent embeds it
            write(self.stdout, ("failed", rid, f"{type(exc).__name__}: {exc}"))
        finally:
            if self.in_look:
                torch.set_num_threads(self.threads)
            self.in_look = False

    def run(self) -> None:
        while True:
            msg = self.pending.popleft() if self.pending else self.inbox.get()
            if msg is None:
                return
            self.answer(msg)


def _read_all(stdin, inbox: queue.Queue) -> None:
    while True:
        try:
            msg = read(stdin)
        except Exception:  # noqa: BLE001 - a broken frame ends the conversation
            msg = None
        inbox.put(msg)
        if msg is None:
            return


def serve(model: str, precision: str, threads: int, stdin, stdout, gate: str | None = None) -> None:
    """Load ``model``, then answer ``encode`` and ``look`` frames until stdin ends; the
    tile's encoder waits at its pause points while the flag in the file ``gate`` is up."""
    torch.set_num_threads(max(1, threads))
    from ..runtime.device import make_policy
    from .encoder_pauses import pause_modules
    from .encoder_process import time_tile
    from .loader import load_engine

    try:
        engine = load_engine(model, make_policy("cpu", precision))
        seconds = time_tile(engine, repeats=3)  # and the first call's one-off costs paid now
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which goes on without
        write(stdout, ("error", f"could not load {model}: {type(exc).__name__}: {exc}"))
        return
    reader = None
    if gate:
        try:
            reader = GateReader(gate)
        except (OSError, ValueError):  # no flag to read: tiles are never held for prompts
            pass
    inbox: queue.Queue = queue.Queue()
    server = _Server(engine, stdout, inbox, reader)
    for module in pause_modules(engine.sam.image_encoder):
        module.register_forward_pre_hook(lambda _m, _a: server.pause())
    threading.Thread(target=_read_all, args=(stdin, inbox), daemon=True).start()
    write(stdout, ("ready", os.getpid(), seconds))
    server.run()
