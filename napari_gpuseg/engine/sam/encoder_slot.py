"""Which process embeds a new image's first tile: the dock's :class:`EncoderSlot` holds at
most one :class:`.encoder_process.EncoderProcess` (for the model in use) and hands it that tile
while :func:`worth_it` says the second process ends it sooner."""
from __future__ import annotations

import threading
from typing import Callable

import torch

from .encoder_process import EncoderProcess, time_tile, wanted, warm_tile


FIRST_WINDOW_S = 0.35
"""The window's work after a drop, taken before a drop has measured it (0.36-0.45 s measured
on a 2-core Xeon under Xvfb, 0.25-0.30 s on a 2-core Zen 3): the first drop decides with it."""


def worth_it(there: float | None, here: float | None, window: float | None) -> bool:
    """Whether the second process, whose tile takes ``there`` seconds alone, ends a new
    image's first tile sooner than this process: here the tile (``here`` s alone) gets going
    only once the window's work after the drop (``window`` s, last measured; before the first
    drop :data:`FIRST_WINDOW_S`) lets go of the interpreter lock. The drops whose tile stayed
    here measure it. (Xeon AMX, 2 cores, bf16: 0.50-0.56 s there with one thread, 0.26-0.31 s
    here, 0.4-0.5 s of window work: used. fp32 with AVX2 kernels: 1.23, 0.67 and 0.41 s, and
    fp32 on a Zen 3: 1.10, 0.60 and 0.25-0.30 s: not used, the first drop included.)"""
    if there is None or here is None:
        return False
    return there < here + (FIRST_WINDOW_S if window is None else window)


class EncoderSlot:
    """One :class:`EncoderProcess` at a time, for the model a dock uses now."""

    def __init__(self) -> None:
        self.process: EncoderProcess | None = None
        self._lock = threading.Lock()
        self.here_seconds: float | None = None  # this process's tile time, measured at load
        self._here_model: str | None = None  # the model it was measured with
        self.window_seconds: float | None = None  # the window's work after the last drop
        self.deferred: str | None = None  # a model whose process start waits for idle time
        self.hold_for_prompts = True  # the process waits while a prompt is served (benchmarks: off)

    @staticmethod
    def warm(engine) -> None:
        """Where a process is :func:`wanted` for ``engine``: one tile through its encoder now
        (the model's load job), so neither the first drop nor :meth:`ensure`'s timing pays
        the first call's one-off costs."""
        if wanted(engine.sam.image_encoder, engine.policy.device):
            warm_tile(engine)

    def ensure(self, model: str, engine) -> None:
        """A process for ``model`` (a :class:`.predictor.SamEngine` loaded in this process)
        when :func:`wanted`, after timing a tile here (the faster of two calls); the one for
        another model is closed. The annotator calls it in an idle-priority job once the
        model is ready, so neither the timing nor the start delays "ready"."""
        with self._lock:
            old = self.process
            if old is not None and old.model == str(model) and old.state in ("starting", "ready"):
                return
            want = wanted(engine.sam.image_encoder, engine.policy.device)
            if old is not None:
                old.close()
            self.process, self.deferred = None, None
            if want:  # this process's tile time first, on cores the new process does not share yet
                if self._here_model != str(model):
                    self.here_seconds, self._here_model = time_tile(engine, warm=False), str(model)
                self.process = EncoderProcess(str(model), engine.policy.active_precision)

    def defer_start(self) -> None:
        """A drop while the process is still starting: it is ended, and :meth:`resume` starts
        it again later. Its start (loading torch and the model, timing tiles: 2-4 s of CPU)
        would otherwise compete with the drop's work for the cores: on 2 cores the first
        mask came 1.9 s after such a drop instead of 0.97 s."""
        with self._lock:
            proc = self.process
            if proc is None or proc.ready or proc.state != "starting":
                return
            proc.kill()
            self.process, self.deferred = None, proc.model

    def resume(self, model: str, engine) -> None:
        """Start the process :meth:`defer_start` ended, once the dock is idle (the image's
        tiles are all embedded)."""
        if self.deferred is not None and self.deferred == str(model):
            self.ensure(model, engine)

    def look_encoder(self, model: str) -> Callable[[torch.Tensor], torch.Tensor | None] | None:
        """:meth:`.EncoderProcess.look` of the process for ``model`` (it answers only while
        that process embeds a tile for this one), else None."""
        proc = self.process
        if proc is None or proc.model != str(model) or proc.state != "ready":
            return None
        return proc.look

    def offload(self, model: str) -> Callable[[torch.Tensor], torch.Tensor | None] | None:
        """``encode`` of the process for ``model`` once it is ready, else None. Queued
        prompts run at a worker's pause points while it waits, the process's encoder held
        meanwhile (:meth:`.EncoderProcess.held`) unless :attr:`hold_for_prompts` is False."""
        from ..runtime.worker import pause_point

        proc = self.process
        if proc is None or proc.model != str(model) or not proc.ready:
            return None
        if not worth_it(proc.tile_seconds, self.here_seconds, self.window_seconds):
            return None
        hold = proc.held if self.hold_for_prompts else None
        return lambda batch: proc.encode(batch, wait=lambda: pause_point(hold))

    def handover(self, model: str) -> threading.Event | None:
        """None unless :meth:`offload` would hand ``model``'s next tile over; else the
        process's :attr:`EncoderProcess.sent` event, cleared now: set once it is handed over."""
        if self.offload(model) is None:
            return None
        self.process.sent.clear()
        return self.process.sent

    def close(self) -> None:
        with self._lock:
            if self.process is not None:
                self.process.close()
                self.process = None
