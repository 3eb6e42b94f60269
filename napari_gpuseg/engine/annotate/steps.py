"""The work an :class:`~.session.AnnotationSession` runs on its inference worker: plain
functions of what they need (the engine, the image, the prompt), run in the worker's thread.
Stepped ones are generators: the worker serves prompts between their steps, and inside an
encoder call at its pause points."""
from __future__ import annotations

import logging
import time

from ..runtime.cancel import Cancelled, check
from ..runtime.device import synchronize
from ..sam.interactive.crop_look import crop_look, supports_look
from ..sam.interactive.gpu_warmup import warm_gpu
from ..sam.interactive.stack_embed_order import stack_steps

logger = logging.getLogger(__name__)

FIRST_LOOK_PAINT_WAIT_S = 0.3
"""The longest a full decode waits for its prompt's first look (a first click's, a box's)
to be shown."""


def wait_shown(look, cancel=None, limit: float = FIRST_LOOK_PAINT_WAIT_S) -> bool:
    """Wait (at most ``limit`` s, cancellable) for a first look to be on screen; True when it
    is. The full decode right after it embeds the prompt's own views, and in this process the
    encoder's operators take Python's lock from the GUI thread every few milliseconds, which
    slows a paint beside it down (first look on screen 148 ms after a click instead of
    127 ms, median, on a 2-core Xeon; ``benchmarks/click_first_look.py``)."""
    end = time.monotonic() + limit
    while not look.wait(0.005):
        check(cancel)
        if time.monotonic() > end:
            return False
    return True


def load(engine_of) -> float:
    """The model loaded (and on a GPU warmed: kernels, cuDNN's autotuning); the seconds."""
    t0 = time.perf_counter()
    warm_gpu(engine_of())
    return time.perf_counter() - t0


def tiles(engine_of, img, step, focus, keep_early, progress=None, cancel=None):
    """Every view of one plane, one encoder batch per step: the grid first (boxes, and the
    first mask after a drop), then the click views, those nearest ``focus()`` first.
    ``keep_early(prepared)`` receives the prepared image before the first step (prompts until
    the last tile reuse it). Returns ``(prepared, seconds)``."""
    engine = engine_of()
    t0 = time.perf_counter()
    image = engine.prepare(img)
    keep_early(image)
    grid = engine.views(image)
    extra = engine.prompt_views(image)[len(grid):]
    total = len(grid) + len(extra)
    for before, views in ((0, grid), (len(grid), extra)):
        report = None if progress is None else (lambda done, _n, b=before: progress(b + done, total))
        image = yield from engine.embed_steps(image, views, step=step, focus=focus, progress=report,
                                              cancel=cancel)
    synchronize(engine.policy.device)  # the time includes the GPU work, not just its launch
    return image, time.perf_counter() - t0


def stack(engine_of, planes: dict, centre, step, done, progress=None, cancel=None):
    """Every plane of a stack, the one ``centre()`` names first, then its neighbours outwards."""
    return (yield from stack_steps(engine_of(), planes, centre, step, done, progress, cancel))


def warm(engine_of, image, cancel=None) -> int:
    """The decoder's image-only work for ``image``'s first views, before the first prompt."""
    return engine_of().warm_decoder(image, cancel=cancel)


def decode(engine_of, image, prompt, multimask: bool, look=None, cancel=None):
    """The current object's mask. A box holds its object: its mask is computed near the box
    (as box mode does). With ``look`` (a first look's event), waits for it to be shown first."""
    if look is not None:
        wait_shown(look, cancel)
    return engine_of().predict(image, [prompt], multimask=multimask, cancel=cancel, near_box=True)[0]


def first_look(engine_of, image, prompt, look=None, cancel=None):
    """A quick mask while the view a box or a first click is decoded in is not embedded yet
    (right after a new image): from a small crop around the prompt where its native view is
    not embedded either (``crop_look``: a quarter of a view's encoder work, on a CPU), else a
    first click's from its native tile alone (its finer click view is the one missing). None
    when the prompt's view is ready (the full decode is as quick then); ``look`` (the event
    the full decode waits for) is then set here, so the decode goes on at once."""
    res = None
    try:
        res = _first_look(engine_of(), image, prompt, cancel)
        return res
    finally:
        if res is None and look is not None:
            look.set()


def _first_look(engine, image, prompt, cancel):
    image = engine.prepare(image)
    click = prompt.box is None
    if engine.is_embedded(image, [engine.route(image, prompt)]):
        return None
    native = engine.route(image, prompt, zoom=False) if click else None
    if supports_look(engine) and (native is None or not engine.is_embedded(image, [native])):
        try:
            return crop_look(engine, image, prompt, click)
        except Cancelled:
            raise
        except Exception:  # noqa: BLE001 - a look is optional: the full decode reports
            logger.warning("a first look failed; the full mask follows", exc_info=True)
            return None
    if click and engine.click_zoom > 1:
        return engine.predict(image, [prompt], multimask=True, cancel=cancel, zoom=False)[0]
    return None


def boxes(engine_of, image, xyxy, cancel=None):
    """One mask per box, all boxes routed, embedded and decoded in batches."""
    return engine_of().predict_boxes(image, xyxy, cancel=cancel)
