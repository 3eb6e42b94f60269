"""A folder's pre-segmenter: a folder-job method by name, called on one image at a time.

    p = Presegmenter("unet", model="OUT/models/unet_1.pt")   # or "sam-everything", "threshold"
    labels = p(image)                                        # what a folder job would write

The same method and options run the folder job of *Segment the rest*
(:meth:`~.folder.FolderAnnotation.segment_rest`), so an image pre-segmented when opened and one
segmented by the job get the same labels.
"""
from __future__ import annotations

import threading

import numpy as np


class Presegmenter:
    """``method``: a registered folder-job method name (``unet``, ``sam-everything``,
    ``threshold``, ...); ``options``: its options (``model``: a checkpoint, None = the method's
    default). The method is created and loaded on first use (in the calling thread)."""

    def __init__(self, method: str, **options) -> None:
        from ..jobs.method_registry import create_method

        self.method = method
        self.options = {k: v for k, v in options.items() if v is not None}
        create_method(method, **self.options)  # a bad name or option fails here, in one line
        self._seg = None
        self._lock = threading.Lock()

    @property
    def model(self):
        return self.options.get("model")

    def describe(self) -> str:
        model = self.model
        return self.method if model is None else f"{self.method} ({model})"

    def __repr__(self) -> str:
        return f"Presegmenter({self.describe()})"

    def __call__(self, image: np.ndarray) -> np.ndarray:
        from ..jobs.method_registry import create_method
        from ..runtime.device import get_policy

        with self._lock:  # one image at a time (the reading thread; a test's direct call)
            if self._seg is None:
                seg = create_method(self.method, **self.options)
                seg.load(get_policy())
                self._seg = seg
            seg = self._seg
            raw = seg.segment([seg.prepare(np.asarray(image))])[0]
            return np.asarray(seg.finish(raw).labels)

    def close(self) -> None:
        with self._lock:
            if self._seg is not None:
                self._seg.unload()
                self._seg = None
