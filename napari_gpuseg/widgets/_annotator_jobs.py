"""The SAM annotator's engine jobs: their bodies run in the inference worker's thread
(the dock submits them and shows what they return on the GUI thread); and the stack
precompute, which submits one of them in the background."""
from __future__ import annotations

import logging
import time

import numpy as np

from ..engine.runtime.cancel import Cancelled, check
from ..engine.runtime.device import synchronize
from ..engine.runtime.worker import IDLE
from ..engine.sam.crop_look import crop_look, supports_look
from ..engine.sam.loader import load_engine
from ..engine.sam.encoder_pauses import waits_for_encoder
from ..engine.sam.gpu_warmup import warm_gpu
from ..engine.sam.schedule import stack_steps
from ._prompts import plane

logger = logging.getLogger(__name__)

FIRST_LOOK_PAINT_WAIT_S = 0.3
"""The longest a full decode waits for its prompt's first look (a first click's, a box's)
to be painted."""


def wait_painted(look, cancel=None) -> None:
    """Wait (at most :data:`FIRST_LOOK_PAINT_WAIT_S`, cancellable) for a first look (a
    first click's, a box's) to be on screen. The full decode right after it embeds the
    prompt's own views, and in this process the encoder's operators take Python's lock
    from the GUI thread every few milliseconds, which slows a paint beside it down (first look on
    screen 148 ms after a click instead of 127 ms, median, on a 2-core Xeon;
    ``benchmarks/click_first_look.py``)."""
    end = time.monotonic() + FIRST_LOOK_PAINT_WAIT_S
    while not look.wait(0.005):
        check(cancel)
        if time.monotonic() > end:
            return


class AnnotatorJobs:
    """Mixed into :class:`~.sam_annotator.SamAnnotatorWidget` (uses its ``worker``,
    ``_cache``, ``_early``, ``_focus``, ``_plane`` and ``stack_order``)."""

    def _submit(self, fn, *args, **kwargs):
        job = self._submit_job(fn, *args, **kwargs)
        self._jobs = [j for j in self._jobs if not j.wait(0)] + [job]
        return job

    def _cancel_own_jobs(self) -> int:
        n = 0
        for job in self._jobs:
            if not job.wait(0):
                job.cancel()
                n += 1
        return n

    def _engine(self, model: str):
        policy = self.worker.policy
        # one embedding cache for every model of the dock: a tuned decoder on the same
        # encoder (Adapt SAM) reuses the embeddings already made
        return self.worker.model(("sam", model, policy), lambda: load_engine(model, policy, cache=self._cache),
                                 replace=True)

    def _job_tiles(self, model: str, img: np.ndarray, step: int | None, key: tuple,
                   progress=None, cancel=None):
        """Every tile of one plane, one encoder batch per step (a stepped background job:
        prompts run between steps, and inside an encoder call at its pause points)."""
        engine = self._engine(model)
        t0 = time.perf_counter()
        image = engine.prepare(img)
        self._early[key] = image  # prompts until the last tile reuse it
        # the grid first (boxes, and the first mask after a drop), then the click views
        grid = engine.views(image)
        extra = engine.prompt_views(image)[len(grid):]
        total = len(grid) + len(extra)
        # the first tile in the second process (CPU), beside napari building the new layers
        offload = self._encoder_slot.offload(model)
        for before, views in ((0, grid), (len(grid), extra)):
            report = None if progress is None else (lambda done, _n, b=before: progress(b + done, total))
            image = yield from engine.embed_steps(image, views, step=step, focus=lambda: self._focus,
                                                  progress=report, cancel=cancel, offload_first=offload)
            offload = None
        synchronize(engine.policy.device)  # the time includes the GPU work, not just its launch
        seconds = time.perf_counter() - t0
        self._encoder_slot.resume(model, engine)  # a start a drop deferred, now that all is embedded
        return [image], seconds

    def _job_stack(self, model: str, planes: dict, keys: dict, step: int | None,
                   progress=None, cancel=None):
        """Every plane of a stack, the displayed one first, then its neighbours outwards."""
        out = yield from stack_steps(self._engine(model), planes, lambda: self._plane, step,
                                     self.stack_order.append, progress, cancel)
        return {keys[i]: image for i, image in out.items()}

    def _job_warm(self, model: str, image, cancel=None) -> int:
        return self._engine(model).warm_decoder(image, cancel=cancel)

    def _defer_for(self, model: str, image, prompt):
        """``Job.defer`` of a preview: wait while the background encoder is computing the
        prompt's view rather than embed it a second time at a pause point."""
        def defer() -> bool:
            engine = self.worker.cached_model(("sam", model, self.worker.policy))
            return engine is not None and waits_for_encoder(engine, image, prompt)
        return defer

    def _job_predict(self, model: str, image, prompts, multimask: bool, look=None, cancel=None):
        if look is not None:  # a first look is painted before this decode's encoder runs
            wait_painted(look, cancel)
        engine = self._engine(model)
        # a box holds its object: the mask is computed near the box (as box mode does)
        return engine.predict(image, prompts, multimask=multimask, cancel=cancel, near_box=True)

    def _job_first_look(self, model: str, image, prompt, look=None, cancel=None):
        """A quick mask while the view a box or a first click is decoded in is not embedded
        yet (right after a drop): from a small crop around the prompt where its native view
        is not embedded either (``crop_look``: a quarter of a view's encoder work, on a
        CPU), else a first click's from its native tile alone (its finer click view is the
        one missing). None when the prompt's view is ready (the full decode is as quick
        then). ``look`` (a ``threading.Event``) is set here when there is nothing to show;
        else the dock sets it once the window has painted the mask."""
        res = None
        try:
            engine = self._engine(model)
            image = engine.prepare(image)
            click = prompt.box is None
            if not engine.is_embedded(image, [engine.route(image, prompt)]):
                native = engine.route(image, prompt, zoom=False) if click else None
                if supports_look(engine) and (native is None or not engine.is_embedded(image, [native])):
                    res = self._crop_look(engine, image, prompt, click, model)
                elif click and engine.click_zoom > 1:
                    res = engine.predict(image, [prompt], multimask=True, cancel=cancel, zoom=False)[0]
            return res
        finally:
            if res is None and look is not None:
                look.set()

    def _crop_look(self, engine, image, prompt, multimask: bool, model: str):
        try:
            return crop_look(engine, image, prompt, multimask, self._encoder_slot.look_encoder(model))
        except Cancelled:
            raise
        except Exception:  # noqa: BLE001 - a look is optional: the full decode reports
            logger.warning("a first look failed; the full mask follows", exc_info=True)
            return None

    def _job_boxes(self, model: str, image, boxes, cancel=None):
        return self._engine(model).predict_boxes(image, boxes, cancel=cancel)

    def _job_load(self, model: str) -> float:
        t0 = time.perf_counter()
        engine = self._engine(model)
        # on a GPU, kernel loading and cuDNN's autotuning are paid here, not by the first image
        warm_gpu(engine)
        # on a CPU that will have a second process: the encoder's first call (_job_second_process)
        self._encoder_slot.warm(engine)
        return time.perf_counter() - t0

    def _job_second_process(self, model: str) -> None:
        """On a CPU, a second process for a new image's first tile
        (engine/sam/encoder_process.py), after timing a tile here: an idle-priority job once
        the model is ready, so a drop's tiles come first."""
        if model == self.model_name:
            self._encoder_slot.ensure(model, self._engine(model))

    def precompute_stack(self) -> None:
        if not self._image_alive():
            return
        shape = self._spatial_shape()
        if len(shape) <= 2:
            self._embed_current()
            return
        lead = shape[:-2]
        indices = [tuple(int(i) for i in np.unravel_index(k, lead)) for k in range(int(np.prod(lead)))]
        indices = [i for i in indices if self._plane_key(i) not in self._prepared]
        planes = {i: np.array(plane(self.image_layer, i), copy=True) for i in indices}
        keys = {i: self._plane_key(i) for i in indices}
        t0 = time.perf_counter()
        self._set_status(f"precomputing {len(planes)} slices…")
        self.stack_order = []

        def done(result):
            self._prepared.update(result)
            self._set_status(f"stack ready: {len(result)} slices in {time.perf_counter() - t0:.1f} s")

        self._stack_job = self._submit(
            self._job_stack, self.model_name, planes, keys, self.batch_spin.value() or None,
            tag="stack", priority=IDLE, on_result=done, on_error=self._on_error,
            on_progress=self._on_progress,
            on_cancelled=lambda: self._set_status("precompute cancelled"))
