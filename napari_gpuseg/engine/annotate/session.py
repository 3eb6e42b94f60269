"""Interactive SAM annotation of one image, without a window (both names below are in
``napari_gpuseg.engine``):

    s = AnnotationSession(load_engine())      # the default model
    s.set_image(image)                        # YX, YXC (RGB) or a stack; s.set_plane(z) for stacks
    mask = s.click(x, y)                      # bool (H, W): the current object
    mask = s.click(x2, y2, positive=False)    # refines it (previous logits as mask input)
    mask = s.box(x0, y0, x1, y1)              # a new current object from a box
    obj = s.commit()                          # id written into s.labels (same spatial shape as the image)
    s.undo()                                  # removes the last committed object
    s.adapt(minutes=3, image_name="cells.tif")  # adapt the decoder to the objects committed, use it

An ``AnnotationSession`` owns the image (a plane at a time for stacks), its embeddings (the prepared planes,
the background tiles), the current object (its prompt, and its mask with the logits a next
click refines), the label image and its undo history, and the work it schedules on an
:class:`~napari_gpuseg.engine.runtime.worker.InferenceWorker`: a prompt's decode is
``INTERACTIVE`` and runs before the plane's remaining tiles (``BACKGROUND``, those nearest
:attr:`focus` first), which run before a stack's other planes (``IDLE``).

Every method above waits for its result. The ``*_async`` forms return the worker's
:class:`~napari_gpuseg.engine.runtime.job.Job` and report through callbacks (the SAM annotator
dock passes a ``submit`` that delivers them on the GUI thread); a result that no longer
matches what the session holds (the image, plane or prompt changed since) is dropped.
Coordinates are (x, y) pixels of the plane, as in :class:`~napari_gpuseg.engine.Prompt`.
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Callable

import numpy as np

from ..runtime.job import BACKGROUND, IDLE, INTERACTIVE
from .label_commits import LabelCommitter
from ..sam.interactive.cache import EmbeddingCache
from ..sam.interactive.encoder_pauses import waits_for_encoder
from ..sam.interactive.prompt_types import MaskResult, Prompt
from . import region as regions
from . import steps
from .effort import CommitEffort
from .refine import follow_up, is_first_look_prompt, prompt_focus


def _channels_last(image, rgb: bool | None) -> bool:
    """Whether a YXC numpy image may hold channels rather than colour (a last axis of 2, or of 4
    with no ``rgb`` said): such an image goes through the folder jobs' channel choice."""
    return (rgb is None and isinstance(image, np.ndarray) and image.ndim == 3
            and image.shape[-1] in (2, 4))


class AnnotationSession:
    """One image annotated object by object with a SAM model.

    ``model``: a :class:`~napari_gpuseg.engine.SamEngine`, or a model name or checkpoint path
    (loaded in the worker, on its policy's device, when first needed). ``worker``: the
    :class:`~napari_gpuseg.engine.InferenceWorker` that runs the work (default: the shared
    one; a private one when ``model`` is an engine on another policy). ``submit``: how jobs are
    queued (default ``worker.submit``; callbacks then run in the worker's thread)."""

    def __init__(self, model=None, worker=None, submit: Callable | None = None,
                 cache: EmbeddingCache | None = None) -> None:
        from ..runtime.worker import InferenceWorker, default_worker

        self.cache = cache if cache is not None else EmbeddingCache()
        self.worker = worker or self._worker_for(model, default_worker, InferenceWorker)
        self._submit_fn = submit or self.worker.submit
        self.multimask = True  # an object's first click uses the candidate masks (SamEngine.predict)
        self.focus: tuple[float, float] | None = None  # (x, y) the background tiles start from
        self.stack_order: list[tuple] = []  # planes in the order the last stack embedding took them
        self.last_embed_seconds: float | None = None
        self._jobs: list = []
        self._generation = 0  # bumped whenever a shown mask would become stale
        self._image_id = 0
        self._image = self._full = None
        self.rgb = False
        self.region: tuple[int, int, int, int] | None = None  # (y0, y1, x0, x1) of a too-big image
        self._plane: tuple = ()
        self._prepared: dict[tuple, object] = {}  # plane key -> image with every view embedded
        self._early: dict[tuple, object] = {}  # plane key -> prepared image, tiles still coming
        self._tiles: dict[tuple, tuple[int, int]] = {}  # plane key -> (tiles ready, tiles)
        self._labels: np.ndarray | None = None
        self.committer = LabelCommitter()
        self._propagated: deque = deque()  # (object index, z, mask) from the worker's thread
        self.propagate_ids: list[int] = []
        self.prompt: Prompt | None = None  # the current object's prompt (refinements: in click order)
        self.result: MaskResult | None = None  # its mask, with logits for the next click
        self.final = False  # False while :attr:`result` is a first look (the full mask follows)
        self.decode_job = None
        self.effort = CommitEffort()  # how hard this image's last commits were (adapting.adapt_offer)
        self._first_unsure = False  # the current object's first mask was rated unsure
        # called (no argument) after every change this object makes to :attr:`labels` (a
        # commit, an undo, boxes, propagated slices) and after :meth:`labels_edited`
        self.labels_listeners: list[Callable[[], None]] = []
        self._model = None
        self.set_model(model)

    @staticmethod
    def _worker_for(model, default_worker, make):
        policy = getattr(model, "policy", None)
        if policy is None:
            return default_worker()
        worker = default_worker()
        return worker if worker.policy == policy else make(policy, name="napari-gpuseg-session")

    # -- the model ------------------------------------------------------------------------
    @property
    def model(self):
        """The model name (or the engine given)."""
        return self._model

    def set_model(self, model=None) -> None:
        """Use ``model`` (an engine, a name or a checkpoint path; None: the default model) from
        now on: the current object is dropped (its logits belong to the old decoder), the
        embeddings of an engine on the same encoder are reused through the cache."""
        from ..sam.loader import DEFAULT_MODEL

        self._model = DEFAULT_MODEL if model is None else model
        self._adapted = None  # whether it is an adapted decoder: asked when first needed
        self._prepared.clear()
        self._early.clear()
        self._tiles.clear()
        self.effort.clear()  # the new model's own effort counts from here
        self.clear()

    @property
    def adapted(self) -> bool:
        """Whether the model is a decoder already adapted to the user's objects
        (:func:`~napari_gpuseg.engine.sam.training.adapt.is_adapted`; judged once per model)."""
        if self._adapted is None:
            from ..sam.training.adapt import is_adapted

            self._adapted = is_adapted(self._model)
        return self._adapted

    @property
    def _model_key(self):
        return self._model if isinstance(self._model, str) else id(self._model)

    def engine(self, model=None):
        """The :class:`~napari_gpuseg.engine.SamEngine` of ``model`` (default: the session's),
        loaded on first use (call it in the worker's thread, as the work does)."""
        model = self._model if model is None else model
        if not isinstance(model, str):
            return model
        from ..sam.loader import load_engine

        policy = self.worker.policy
        # one embedding cache for every model of the session: a tuned decoder on the same
        # encoder (Adapt SAM) reuses the embeddings already made
        return self.worker.model(("sam", model, policy), lambda: load_engine(model, policy, cache=self.cache),
                                 replace=True)

    def embedding_cache(self):
        """The embedding cache of the model in use: the loaded engine's (an engine the
        worker loaded earlier for another annotation keeps its own cache), else :attr:`cache`."""
        engine = self._engine_ready()
        cache = getattr(engine, "cache", None)
        return cache if cache is not None else self.cache

    def _engine_ready(self):
        """The engine when it is loaded, else None (never loads; any thread)."""
        if not isinstance(self._model, str):
            return self._model
        return self.worker.cached_model(("sam", self._model, self.worker.policy))

    def load_async(self, on_done=None, on_error=None):
        """Load the model (and warm it on a GPU) in the worker; ``on_done(seconds)``."""
        return self._submit(steps.load, self._bound_engine(), tag="load", replace=True,
                            on_result=on_done, on_error=on_error)

    def _bound_engine(self) -> Callable:
        """``engine()`` of the model chosen now (a job queued before a model switch keeps its model)."""
        model = self._model
        return lambda: self.engine(model)

    # -- the image --------------------------------------------------------------------------
    def set_image(self, image, rgb: bool | None = None, labels: np.ndarray | None = None,
                  channel: int | None = None) -> bool:
        """Annotate ``image``: YX, YXC with ``rgb`` (default: a last axis of 3 or 4), or a
        stack (..., Y, X) annotated a plane at a time (:meth:`set_plane`). ``labels``: the label
        image to write into (default: zeros, made when first needed). False when a plane is too
        big to annotate whole (:meth:`set_region` then picks the part to annotate).

        An in-memory YXC array is taken as folder jobs and the other entry points take it
        (:func:`~napari_gpuseg.engine.normalize.image_input`): ``channel=N`` picks one channel
        of a multichannel (or colour) image, and a multichannel image (a last axis of 2, or 4
        with a varying 4th) without it is refused with the folder jobs' one-line message."""
        if channel is not None or _channels_last(image, rgb):
            from ..normalize import image_input

            image, rgb = image_input(image, channel, rgb)
        shape = tuple(getattr(image, "shape", ()))
        if rgb is None:
            rgb = len(shape) == 3 and shape[-1] in (3, 4)
        if len(shape) - bool(rgb) < 2:
            raise ValueError(f"an image needs at least two spatial axes (Y, X), got shape {shape}")
        if image is not self._full or bool(rgb) != self.rgb:
            self._image_id += 1
            self._prepared.clear()
            self._early.clear()
            self._tiles.clear()
            self._full = self._image = image
            self.rgb = bool(rgb)
            self.region = None
            self._labels = None
            self.committer = LabelCommitter()
            self.effort.clear()
        self._plane = (0,) * (len(self.shape) - 2)
        self.clear()
        if labels is not None:
            self.use_labels(labels)
        return not self.too_big

    @property
    def image_id(self) -> int:
        """A number that changes whenever :meth:`set_image` takes another image."""
        return self._image_id

    @property
    def image(self):
        """The image being annotated (the region of a too-big one, once chosen)."""
        return self._image

    @property
    def shape(self) -> tuple:
        """Spatial shape of :attr:`image` (without an RGB axis)."""
        shape = tuple(self._image.shape) if self._image is not None else ()
        return shape[:-1] if self.rgb else shape

    @property
    def too_big(self) -> bool:
        """True while a plane is too big to annotate whole (no region chosen)."""
        return self._image is not None and regions.too_big(self.shape)

    def set_region(self, y0: int, y1: int, x0: int, x1: int) -> None:
        """Annotate the part ``[y0:y1, x0:x1]`` (of every plane) of a too-big image; it is
        read lazily, and coordinates and :attr:`labels` are the region's from now on."""
        full = self._full
        if full is None:
            raise ValueError("set_image first")
        h, w = (full.shape[:-1] if self.rgb else full.shape)[-2:]
        if not (0 <= y0 < y1 <= h and 0 <= x0 < x1 <= w):
            raise ValueError(f"region y {y0}:{y1}, x {x0}:{x1} is not inside the {h} x {w} image")
        if regions.too_big((y1 - y0, x1 - x0)):
            raise ValueError(f"region {y1 - y0} x {x1 - x0} px is itself too big (at most "
                             f"{regions.MAX_PLANE_PX} px)")
        self._image_id += 1
        self._image = regions.cut(full, (y0, y1, x0, x1), self.rgb)
        self.region = (y0, y1, x0, x1)
        self._labels = None
        self.committer = LabelCommitter()
        self.effort.clear()
        self.clear()

    @property
    def plane(self) -> tuple:
        """Leading index of the plane being annotated (``()`` for a 2D image)."""
        return self._plane

    def set_plane(self, index) -> None:
        """Annotate plane ``index`` (an int or a tuple over the leading axes) of a stack."""
        index = (int(index),) if np.isscalar(index) else tuple(int(i) for i in index)
        lead = self.shape[:-2]
        if len(index) != len(lead) or any(not 0 <= i < n for i, n in zip(index, lead)):
            raise ValueError(f"plane {index} is not in a stack of {lead} planes")
        if index != self._plane:
            self._plane = index
            self.clear()

    def plane_image(self, index: tuple | None = None) -> np.ndarray:
        """The pixels of a plane (default: the current one), read now."""
        index = self._plane if index is None else index
        data = self._image[index] if index else self._image
        return np.array(data, copy=True)

    def key(self, index: tuple | None = None) -> tuple:
        """Identifies a plane's embedding: image, model and plane."""
        return (self._image_id, self._model_key, self._plane if index is None else tuple(index))

    def prepared(self, index: tuple | None = None):
        """The plane prepared for the model (every view embedded, or its tiles under way), or
        its pixels when neither has started."""
        key = self.key(index)
        image = self._prepared.get(key) or self._early.get(key)
        return image if image is not None else self.plane_image(index)

    def is_embedded(self, index: tuple | None = None) -> bool:
        return self.key(index) in self._prepared

    def tiles(self, index: tuple | None = None) -> tuple[int, int] | None:
        """(views ready, views) of a plane being embedded in the background, else None."""
        return self._tiles.get(self.key(index))

    def _check_image(self) -> None:
        if self._image is None:
            raise ValueError("no image: call set_image(image) first")
        if self.too_big:
            h, w = self.shape[-2:]
            raise ValueError(f"{h} x {w} px is more than a plane annotated whole "
                             f"({regions.MAX_PLANE_PX} px): choose a part with set_region(y0, y1, x0, x1)")

    # -- the label image --------------------------------------------------------------------
    @property
    def labels(self) -> np.ndarray:
        """The label image being built (int32, :attr:`shape`); made on first use."""
        if self._labels is None:
            self._check_image()
            self._labels = np.zeros(self.shape, np.int32)
        return self._labels

    @property
    def has_labels(self) -> bool:
        """Whether the label image exists yet (:attr:`labels` makes it on first use)."""
        return self._labels is not None

    def use_labels(self, labels: np.ndarray) -> None:
        """Write into ``labels`` (an array of :attr:`shape`, such as a viewer's labels layer's
        data) from now on. Its undo history starts empty when it is another array."""
        labels = np.asarray(labels)
        if tuple(labels.shape) != self.shape:
            raise ValueError(f"labels of shape {labels.shape} do not fit an image of shape {self.shape}")
        if labels is not self._labels:
            self._labels = labels
            self.committer = LabelCommitter()

    # -- background embedding -------------------------------------------------------------
    def embed_async(self, step: int | None = None, on_done=None, on_progress=None, on_cancelled=None,
                    on_error=None):
        """Embed every view of the current plane in the background (``BACKGROUND``: prompts go
        first; a new plane or image replaces it). ``on_done(seconds)``, ``on_progress(ready,
        views)``. None when the plane is embedded already (its decoder warm-up is queued)."""
        self._check_image()
        key = self.key()
        if key in self._prepared:
            self._warm(self._prepared[key])
            return None
        img = self.plane_image()

        def keep_early(image):
            self._early[key] = image

        def progress(done, total):
            self._tiles[key] = (done, total)
            if on_progress is not None:
                on_progress(done, total)

        def cancelled():
            self._early.pop(key, None)
            if on_cancelled is not None:
                on_cancelled()

        def done(result):
            self._embedded(key, result)
            if on_done is not None:
                on_done(result[1])

        return self._submit(steps.tiles, self._bound_engine(), img, step, lambda: self.focus, keep_early,
                            tag="embed", replace=True, priority=BACKGROUND, on_result=done,
                            on_error=on_error, on_progress=progress, on_cancelled=cancelled)

    def embed(self, step: int | None = None) -> float:
        """Embed every view of the current plane now; the seconds it took (0: embedded before)."""
        job = self.embed_async(step)
        if job is None:
            return 0.0
        result = job.result()
        self._embedded(self.key(), result)
        return result[1]

    def _embedded(self, key: tuple, result) -> None:
        prepared, seconds = result
        self._prepared[key] = prepared
        self._early.pop(key, None)
        n = self._tiles.get(key, (0, 0))[1]
        self._tiles[key] = (n, n)
        self.last_embed_seconds = seconds
        if key == self.key():
            self._warm(prepared)

    def _warm(self, prepared) -> None:
        """The decoder's image-only work in the background rather than in the first prompt (a
        prompt meanwhile goes first; the warm-up reuses its work)."""
        self._submit(steps.warm, self._bound_engine(), prepared, tag="warm", replace=True, priority=BACKGROUND)

    def embed_stack_async(self, step: int | None = None, on_done=None, on_progress=None,
                          on_cancelled=None, on_error=None):
        """Embed every plane of a stack not embedded yet (``IDLE``), the current plane first,
        then its neighbours outwards (as :attr:`plane` moves). ``on_done(planes)``."""
        self._check_image()
        lead = self.shape[:-2]
        if not lead:
            return self.embed_async(step, on_error=on_error)
        indices = [tuple(int(i) for i in np.unravel_index(k, lead)) for k in range(int(np.prod(lead)))]
        indices = [i for i in indices if self.key(i) not in self._prepared]
        planes = {i: self.plane_image(i) for i in indices}
        keys = {i: self.key(i) for i in indices}
        self.stack_order = []

        def done(result):
            self._prepared.update({keys[i]: image for i, image in result.items()})
            if on_done is not None:
                on_done(len(result))

        return self._submit(steps.stack, self._bound_engine(), planes, lambda: self._plane, step,
                            self.stack_order.append, tag="stack", priority=IDLE, on_result=done,
                            on_error=on_error, on_progress=on_progress, on_cancelled=on_cancelled)

    # -- the current object --------------------------------------------------------------
    def request(self, prompt: Prompt | None, on_mask=None, on_look=None, on_error=None,
                hold_after: float = 0.0):
        """Decode ``prompt`` as the current object, asynchronously (``INTERACTIVE``). A prompt
        that is the current one plus one click refines its mask (the shown logits go back as
        mask input). ``on_mask(result)``: the mask (a :class:`MaskResult`; :attr:`mask` gives
        it full size), unless stale by then. ``on_look(result, shown)``: a quick first mask
        (an object's first click or a box, while its view is not embedded): the full decode
        waits (briefly) until ``shown()`` is called, once the look is on screen. ``hold_after``:
        background work waits that long after each decode (``InferenceWorker.hold_background``)
        unless released. Returns the full decode's job (None for a None prompt: cleared)."""
        self._check_image()
        if prompt is None:
            self.clear()
            return None
        return self._request(prompt, on_mask, on_look, on_error, hold_after, sync=False)

    def _request(self, given: Prompt, on_mask, on_look, on_error, hold_after: float, sync: bool):
        self._generation += 1
        gen = self._generation
        image = self.prepared()
        self.focus = prompt_focus(given)  # the tiles around the prompt come next
        prompt, multimask = self._follow_up(given)
        look = None
        defer = self._defer_for(image, prompt)
        engine_of = self._bound_engine()
        if on_look is not None and is_first_look_prompt(prompt, multimask):
            look = threading.Event()  # set once the first look is shown (or there is none)
            self._submit(steps.first_look, engine_of, image, prompt, look, tag="preview", replace=True,
                         priority=INTERACTIVE, hold_after=hold_after, defer=defer,
                         on_result=lambda res: self._looked(gen, res, prompt, look, on_look),
                         on_error=lambda exc: (look.set(), on_error and on_error(exc)),
                         on_cancelled=look.set)
        job = self._submit(steps.decode, engine_of, image, prompt, multimask, look, tag="preview",
                           replace=look is None, priority=INTERACTIVE, hold_after=hold_after, defer=defer,
                           on_result=None if sync else (lambda res: self._decoded(gen, res, prompt, on_mask)),
                           on_error=on_error)
        self.decode_job = job
        if sync:
            self._decoded(gen, job.result(), prompt, None)
        return job

    def _follow_up(self, prompt: Prompt) -> tuple[Prompt, bool]:
        """(prompt, multimask): a click added to the current object's prompt refines its mask;
        an object's first click takes the best of the candidate masks (:attr:`multimask`);
        anything else starts over."""
        if self.result is not None:
            refined = follow_up(prompt, self.prompt, self.result)
            if refined is not prompt:
                return refined, False
        one_click = prompt.box is None and prompt.points is not None and len(prompt.points) == 1
        return prompt, one_click and self.multimask

    def _defer_for(self, image, prompt):
        """``Job.defer`` of a decode: wait while the background encoder is computing the
        prompt's view rather than embed it a second time at a pause point."""
        def defer() -> bool:
            engine = self._engine_ready()
            return engine is not None and waits_for_encoder(engine, image, prompt)
        return defer

    def _decoded(self, gen: int, result: MaskResult, prompt: Prompt, on_mask) -> None:
        if gen != self._generation:
            return  # stale: the image, plane or prompt changed since
        self.prompt, self.result, self.final = prompt, result, True
        if prompt.points is None or len(prompt.points) + (prompt.box is not None) == 1:
            self._first_unsure = self.unsure() is not None  # an object's first prompt
        if on_mask is not None:
            on_mask(result)

    def unsure(self) -> str | None:
        """The status-line hint when the current object is a first click (one positive point,
        no box) whose mask the model itself rates low (:func:`~napari_gpuseg.engine.sam.training.adapt.unsure_hint`:
        predicted IoU, clamped to [0, 1], under ``UNSURE_IOU``); None otherwise. Boxes and
        refined objects get no hint. With a model already adapted (:attr:`adapted`) the hint
        offers a box or corrective clicks, not adapting again."""
        from ..sam.training.adapt import unsure_hint

        p, r = self.prompt, self.result
        if p is None or r is None or p.box is not None or p.points is None or len(p.points) != 1:
            return None
        if p.labels is not None and int(np.asarray(p.labels).ravel()[0]) != 1:
            return None
        return unsure_hint(r.predicted_iou, adapted=self.adapted)

    def _looked(self, gen: int, result, prompt: Prompt, look: threading.Event, on_look) -> None:
        if result is None or gen != self._generation or self.final and self.prompt is prompt:
            look.set()  # nothing to show, stale, or the full mask came first
            return
        self.prompt, self.result, self.final = prompt, result, False
        on_look(result, look.set)

    def set_prompt(self, prompt: Prompt) -> np.ndarray:
        """Decode ``prompt`` as the current object now (a refinement when it is the current
        prompt plus one click); its full-size mask."""
        self._check_image()
        self._request(prompt, None, None, None, 0.0, sync=True)
        return self.mask

    def click(self, x: float, y: float, positive: bool = True) -> np.ndarray:
        """Add a click to the current object (a new object when there is none) and decode it;
        the object's bool (H, W) mask."""
        prev = self.prompt
        points = prev.points if prev is not None and prev.points is not None else np.zeros((0, 2))
        labels = prev.labels if prev is not None and prev.labels is not None else np.zeros(0, int)
        if not positive and not (labels == 1).any() and (prev is None or prev.box is None):
            raise ValueError("a negative click needs an object: click it (positive) or draw a box first")
        return self.set_prompt(Prompt(points=np.concatenate([points, [[float(x), float(y)]]]),
                                      labels=np.append(labels, int(bool(positive))),
                                      box=None if prev is None else prev.box))

    def box(self, x0: float, y0: float, x1: float, y1: float) -> np.ndarray:
        """A new current object from a box (x0, y0, x1, y1); its bool (H, W) mask."""
        prompt = Prompt(box=[x0, y0, x1, y1])
        prompt.check_inside(self.shape[-2:])
        self.clear()
        return self.set_prompt(prompt)

    @property
    def mask(self) -> np.ndarray | None:
        """The current object's full-size bool mask (None when there is none)."""
        return None if self.result is None else self.result.full(self.shape[-2:])

    def clear(self) -> None:
        """Drop the current object (its prompt and mask); a decode under way is stale."""
        self._generation += 1
        self.prompt = self.result = None
        self.final = False
        self._first_unsure = False

    # -- commit and undo ---------------------------------------------------------------------
    def commit(self) -> int | None:
        """Write the current object into :attr:`labels` with the next free id (over background
        pixels only) and drop it; the id, or None when there was nothing to write."""
        if self.result is None:
            return None
        p = self.prompt
        prompts = (0 if p.points is None else len(p.points)) + (p.box is not None)
        self.effort.record(self._first_unsure, prompts - 1)
        ids = self.committer.commit(self.labels, [self.mask], self._plane)
        self.clear()
        if ids:
            self.labels_edited()
        return ids[0] if ids else None

    def undo(self) -> list[int]:
        """Remove the last commit (an object, a "segment all boxes", a propagation); its ids."""
        if self._labels is None:
            return []
        ids = self.committer.undo(self._labels)
        if ids:
            self.labels_edited()
        return ids

    def labels_edited(self) -> None:
        """Tell :attr:`labels_listeners` that :attr:`labels` changed (this object's edits call
        it; a view calls it after an edit of its own, such as a painted stroke)."""
        for fn in list(self.labels_listeners):
            fn()

    # -- adapting the model ---------------------------------------------------------------
    def adapt(self, minutes: float = 4.0, image_name: str | None = None, folder=None, config=None,
              on_event=None, cancel=None):
        """Adapt the model's decoder to the objects committed on the current plane (at least
        :data:`~.adapting.MIN_OBJECTS`) for at most ``minutes`` of training, save it into the
        user's adapted decoders (with ``image_name``) and annotate on with it; waits. Returns
        the :class:`~napari_gpuseg.engine.sam.training.adapt.AdaptResult` (``path`` None when
        ``cancel`` stopped it: the model is unchanged). See :mod:`.adapting`."""
        from .adapting import SessionAdaptation

        job = SessionAdaptation(self, minutes, image_name=image_name, folder=folder, config=config)
        result = job.run(on_event=on_event, cancel=cancel)
        job.finish(result)
        return result

    def segment_boxes_async(self, xyxy, on_done=None, on_error=None, _sync: bool = False):
        """One object per box (N, 4) on the current plane, committed together (one undo);
        ``on_done(ids)``."""
        self._check_image()
        xyxy = np.asarray(xyxy, float).reshape(-1, 4)
        image_id, index = self._image_id, self._plane

        def done(results):
            if self._image_id != image_id:
                return []
            ids = self.committer.commit(self.labels, [r.full(self.shape[-2:]) for r in results], index)
            if ids:
                self.labels_edited()
            if on_done is not None:
                on_done(ids)
            return ids

        job = self._submit(steps.boxes, self._bound_engine(), self.prepared(), xyxy, tag="boxes",
                           on_result=None if _sync else done, on_error=on_error)
        return done(job.result()) if _sync else job

    def segment_boxes(self, xyxy) -> list[int]:
        """One object per box (N, 4) on the current plane, committed together; the ids written."""
        return self.segment_boxes_async(xyxy, _sync=True)

    # -- propagation -------------------------------------------------------------------------
    def propagation_starts(self, every: bool = False) -> tuple[list[np.ndarray], list[int | None]]:
        """What a propagation from the current plane starts from: the current object (its id
        None: the next free one), else the object committed last on this plane; or with
        ``every``, each object on this plane. ``ValueError`` when there is none."""
        if len(self.shape) != 3:
            raise ValueError("propagation needs a stack (Z, Y, X): this image has no slices")
        z = self._plane[0]
        plane = self.labels[z]
        if every:
            ids = [int(i) for i in np.unique(plane) if i != 0]
            if not ids:
                raise ValueError("segment all in 3D: commit objects on this slice first")
            return [plane == i for i in ids], ids
        if self.result is not None:
            return [self.mask], [None]
        last = next((c for c in reversed(self.committer.history) if c.index == (z,)), None)
        if last is None:
            raise ValueError("propagate: show or commit an object on this slice first")
        return [plane == last.ids[-1]], [last.ids[-1]]

    def propagate_async(self, every: bool = False, options=None, on_done=None, on_progress=None,
                        on_cancelled=None, on_error=None):
        """Grow the current object (or the last committed one, or with ``every`` each object
        of this plane) through the stack. Masks are written into :attr:`labels` by
        :meth:`take_propagated` (call it as they come: from a timer, or once done); a cancel
        keeps what is done, and one undo removes the whole propagation."""
        from ..sam.propagation.propagate import propagate_all

        starts, ids = self.propagation_starts(every)
        if self.result is not None and not every:
            self.clear()
        labels = self.labels
        self.committer.open_group(labels)
        nxt = self.committer.next_id(labels)
        self.propagate_ids = []
        for i in ids:
            self.propagate_ids.append(i if i is not None else nxt)
            nxt += i is None
        self._propagated.clear()
        z, volume, queue = self._plane[0], self._image, self._propagated

        def run(engine_of, progress=None, cancel=None):
            return propagate_all(engine_of(), volume, z, starts, options,
                                 on_slice=lambda i, zz, m: queue.append((i, zz, m)),
                                 progress=progress, cancel=cancel)

        return self._submit(run, self._bound_engine(), tag="propagate", on_result=on_done,
                            on_error=on_error, on_progress=on_progress, on_cancelled=on_cancelled)

    def take_propagated(self) -> int:
        """Write the propagated masks found so far into :attr:`labels`; how many."""
        n = 0
        while self._propagated:
            i, z, mask = self._propagated.popleft()
            self.committer.commit_slice(self.labels, z, mask, self.propagate_ids[i])
            n += 1
        if n:
            self.labels_edited()
        return n

    def propagate(self, every: bool = False, options=None) -> list[int]:
        """:meth:`propagate_async`, waiting; the ids of the objects grown."""
        job = self.propagate_async(every, options)
        job.wait()
        self.take_propagated()
        if job.error is not None:
            raise job.error
        return list(self.propagate_ids)

    # -- scheduling -----------------------------------------------------------------------------
    def schedule(self, fn, *args, **kwargs):
        """Queue other work with the session's (``InferenceWorker.submit``'s keywords): it is
        cancelled with the session's (a dock's one-off warm-up, say)."""
        return self._submit(fn, *args, **kwargs)

    def _submit(self, fn, *args, **kwargs):
        job = self._submit_fn(fn, *args, **kwargs)
        self._jobs = [j for j in self._jobs if not j.wait(0)] + [job]
        return job

    def busy(self, tag: str | None = None) -> bool:
        """Whether work of this annotator (with ``tag``: "embed", "preview", "stack", ...) is
        queued or running."""
        return any(not j.wait(0) and (tag is None or j.tag == tag) for j in self._jobs)

    def cancel(self) -> int:
        """Cancel this annotator's queued and running work; how many jobs."""
        n = 0
        for job in self._jobs:
            if not job.wait(0):
                job.cancel()
                n += 1
        return n

    def hold_background(self, seconds: float) -> None:
        """Park background work for at most ``seconds`` (a prompt is being edited: its decode
        starts at once when it comes)."""
        self.worker.hold_background(seconds)

    def release_background(self) -> None:
        self.worker.release_background()

    def close(self) -> None:
        """Cancel the work and let background work go on."""
        self.cancel()
        self.worker.release_background()
