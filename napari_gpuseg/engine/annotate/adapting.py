""""Adapt to these objects": adapt the annotator's SAM decoder to the objects committed on
the image being annotated, then annotate on with the adapted decoder.

    job = SessionAdaptation(session, minutes=3, image_name="t00.tif")  # takes the plane and its objects now
    result = job.run()        # trains (any thread: on_event, progress, cancel), saves into adapted_models()
    job.finish(result)        # the session uses the adapted decoder (call it where the session lives)

or, waiting, ``session.adapt(minutes=3, image_name="t00.tif")``. Training runs on a fresh
copy of the session's model (:func:`~napari_gpuseg.engine.sam.training.adapt.adapt_to_objects`), so
the session keeps annotating with its model meanwhile, and a cancel leaves it in place with
nothing written. The copy shares the session's embedding cache: the views the session
embedded serve the first clicks measured before training without being embedded again (the
encoder's last stage trains on its first stages' output, computed for the training views).
The adapted model's encoder is its own, so the session embeds the image again once it
switches. The adapted decoder joins the user's list
(:func:`~napari_gpuseg.engine.sam.training.adapt.adapted_models`) with the image's name.
"""
from __future__ import annotations

import numpy as np

from ..runtime.cancel import Cancelled
from ..sam.training import adapt as sam_adapt
from ..sam.training.adapt import AdaptResult

MIN_OBJECTS = 3
"""Committed objects on the plane before the annotator offers to adapt."""


def committed_objects(session) -> int:
    """How many objects are committed on the session's current plane."""
    if session.image is None or session.too_big or not session.has_labels:
        return 0
    labels = session.labels
    plane = labels[session.plane] if session.plane else labels
    plane = np.asarray(plane)
    return int(len(np.unique(plane[plane > 0])))


def adapt_blocker(session, min_objects: int = MIN_OBJECTS) -> str | None:
    """Why the session cannot adapt now (one line), or None when it can."""
    if session.image is None:
        return "open an image first"
    if session.too_big:
        return "choose the part of the image to annotate first"
    n = committed_objects(session)
    if n < min_objects:
        return (f"commit at least {min_objects} objects on this image first "
                f"({n} committed): the decoder learns from them")
    return None


def adapt_offer(session, min_objects: int = MIN_OBJECTS) -> str | None:
    """The status-line suggestion to adapt, when the recent commits were hard work (the first
    masks unsure, or several corrective clicks each: :class:`~.effort.CommitEffort`) and
    there are enough objects to learn from; None otherwise. A model already adapted
    (``session.adapted``) is not offered adapting again: a box around each object is."""
    why = session.effort.struggling()
    if why is None:
        return None
    if getattr(session, "adapted", False):
        return f"{why}: try a box around each object"
    if adapt_blocker(session, min_objects) is not None:
        return None
    return f"{why}: try 'Adapt to these objects'"


class SessionAdaptation:
    """One adaptation of ``session``'s decoder to the objects committed on its current plane.

    The plane's pixels and a copy of its labels are taken when it is made (later commits
    and edits do not change what it learns); ``minutes`` bounds the training (embedding not
    counted); ``config`` replaces :func:`~napari_gpuseg.engine.sam.training.adapt.few_object_config`'s
    schedule; ``folder`` replaces the user's adapted-decoders folder. ``ValueError`` (one
    line, :func:`adapt_blocker`) when there is too little to learn from."""

    def __init__(self, session, minutes: float = 4.0, image_name: str | None = None, folder=None,
                 config=None, min_objects: int = MIN_OBJECTS) -> None:
        why = adapt_blocker(session, min_objects)
        if why is not None:
            raise ValueError(f"cannot adapt: {why}")
        if not minutes > 0:
            raise ValueError(f"the time budget must be positive, got {minutes} min")
        self.session = session
        self.minutes = float(minutes)
        self.image_name = image_name
        self.folder = folder
        self.config = config
        labels = session.labels
        self.image = session.plane_image()
        self.labels = np.array(labels[session.plane] if session.plane else labels, copy=True)
        self.objects = committed_objects(session)
        self.model = session.model  # the model adapted (the session's when this was made)
        self.policy = session.worker.policy
        self.cache = session.embedding_cache()  # the embeddings the session made, for the copy trained

    def _base(self):
        """A name or file the training loads afresh (never the session's own engine: its
        decoder would change under the session's clicks, and a cancel would not undo it)."""
        if isinstance(self.model, str):
            return self.model
        return str(self.model.info.name)

    def run(self, on_event=None, progress=None, cancel=None, policy=None) -> AdaptResult:
        """Train and save (runs in any thread; the session is not touched, its embedding cache,
        which is thread-safe, is shared). ``on_event``: every
        training step (live loss); ``cancel``: a token that stops it with nothing saved
        (``result.path`` None)."""
        config = self.config
        if config is None:
            config = sam_adapt.few_object_config(self.objects, self.minutes)
        from ..sam.loader import load_engine

        # a fresh copy of the model on the session's embedding cache: it learns apart from the
        # session's, and the views the session embedded (the clicks on the committed objects
        # measured before training) are not embedded again
        engine = load_engine(self._base(), policy or self.policy, cache=self.cache)
        try:
            return sam_adapt.adapt_to_objects(self.image, self.labels, model=engine, minutes=self.minutes,
                                              image_name=self.image_name, folder=self.folder, config=config,
                                              on_event=on_event, progress=progress, cancel=cancel,
                                              policy=policy or self.policy)
        except Cancelled:  # while the views were embedded: nothing trained, nothing written
            return AdaptResult(None, None, self.objects, 0, 0.0, "cancelled", None)

    def finish(self, result: AdaptResult) -> bool:
        """Switch the session to the adapted decoder (call it in the session's thread); False
        when nothing was saved (cancelled: the session keeps its model)."""
        if result is None or result.path is None:
            return False
        self.session.set_model(result.path)
        return True
