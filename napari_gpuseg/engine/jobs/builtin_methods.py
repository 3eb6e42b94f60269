"""Built-in folder-job methods: ``threshold`` (classical, CPU) and ``unet``.

Registered by name in :mod:`napari_gpuseg.engine.jobs.method_registry`; SAM's methods are in
:mod:`napari_gpuseg.engine.jobs.sam_methods`.
"""
from __future__ import annotations

import numpy as np

from .method_registry import BYTES_PER_VALUE, Option, Segmenter, SegResult


class ThresholdSegmenter(Segmenter):
    """Gaussian blur, Otsu threshold, distance-transform watershed (CPU, 2D and 3D).

    Options: ``sigma``, ``min_distance``, ``min_size``, ``threshold`` (see
    :func:`napari_gpuseg.engine.classical.classical_segment`).
    """

    name = "threshold"
    spatial_ndims = (2, 3)
    options_spec = {"sigma": Option("float", 0), "min_distance": Option("int", 1),
                    "min_size": Option("int", 0), "threshold": Option("float", none_ok=True),
                    "footprint": Option("int", 1, none_ok=True)}
    bytes_per_value = BYTES_PER_VALUE["threshold"]

    def segment(self, images):
        from ..classical import classical_segment

        out = []
        for img in images:
            if self.cancel is not None:
                self.cancel.check()
            out.append(SegResult(classical_segment(img, **self.options)))
        return out


class UNetSegmenter(Segmenter):
    """The U-Net engine: ``model`` = checkpoint file (None = the bundled nuclei model).

    ``batch_size`` = sliding windows per device call (None = adaptive). Same-shape images
    go to the engine as one stack; each object's score is its mean interior probability.
    Options: ``overlap``, ``roi_size`` and the post-processing keywords of
    :func:`napari_gpuseg.engine.unet.predict.probabilities_to_labels`.
    """

    name = "unet"
    spatial_ndims = (2, 3)
    _POST = ("interior_threshold", "foreground_threshold", "min_size", "min_seed")
    options_spec = {"overlap": Option("float", 0, 0.95), "roi_size": Option("size", 8),
                    "tile": Option("int", 16, none_ok=True), "channels_last": Option("bool", none_ok=True),
                    "normalization": Option("dict", none_ok=True),
                    "interior_threshold": Option("float", 0, 1), "foreground_threshold": Option("float", 0, 1),
                    "min_size": Option("int", 0), "min_seed": Option("int", 0)}
    bytes_per_value = BYTES_PER_VALUE["unet"]

    def load(self, policy) -> None:
        from ..unet import unet_checkpoint as unet_ckpt, predict as unet

        super().load(policy)
        self._unet = unet
        self.net = unet_ckpt.load_unet(self.model, device=policy.device)
        self.dims = self.net.config.spatial_dims

    def finish(self, raw) -> SegResult:
        """Probabilities -> instance labels; score = mean interior probability per object."""
        from scipy import ndimage as ndi

        from ..unet import predict as unet

        probs, dims, post = raw
        labels = unet.probabilities_to_labels(probs, spatial_dims=dims, **post)
        n = int(labels.max())
        scores = ndi.mean(probs[1], labels, np.arange(1, n + 1)) if n else np.zeros(0)
        return SegResult(labels, np.asarray(scores, dtype=float))

    def segment(self, images):
        kw = {k: v for k, v in self.options.items() if k not in self._POST}
        kw.update(policy=self.policy, sw_batch_size=self.batch_size, cancel=self.cancel, rgb=False)  # prepared: gray
        user_post = {k: v for k, v in self.options.items() if k in self._POST}
        if images[0].ndim == self.dims:  # one stack of same-shape images, one engine call
            post = {**self.net.meta.get("postprocess", {}), **user_post}
            probs = self._unet.predict_probabilities(self.net, np.stack(images), **kw)
            return [(p, self.dims, post) for p in probs]  # finish() runs in the writers
        return [self._volume(img, user_post, kw) for img in images]  # ZYX volumes for a 2D model

    def _volume(self, img, user_post, kw) -> SegResult:
        """A 2D model on a ZYX volume: labels per slice, linked across slices by overlap."""
        from ..stacks import LINK_NOTE, link_slices

        per_slice = np.asarray(self._unet.predict_labels(self.net, img, postprocess=user_post, **kw))
        if self.dims != 2 or per_slice.ndim != 3:
            return SegResult(per_slice)
        return SegResult(link_slices(per_slice), notes=LINK_NOTE)
