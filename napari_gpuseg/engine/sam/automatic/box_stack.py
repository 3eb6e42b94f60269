"""Boxes per plane -> SAM masks per plane: the one box workflow of the SAM automatic dock
and the ``sam-boxes`` folder method.

Each plane gets its boxes either given (``(N, 4)`` float ``x0, y0, x1, y1``, end exclusive,
as :mod:`napari_gpuseg.engine.detect` makes them) or from a detector run on it; all planes
then go through :func:`~napari_gpuseg.engine.sam.automatic.boxes.segment_boxes_batch` in one call
(batched encoder views and decoder prompts). Per-plane results are joined into one label
volume by :func:`napari_gpuseg.engine.stacks.stack_labels`.
"""
from __future__ import annotations

from typing import Sequence, Union

import numpy as np

from ...runtime.cancel import CancelToken, ProgressFn, check

BoxSource = Union[str, Sequence[np.ndarray]]  # a detector name, or one box array per plane


def segment_box_planes(engine, planes: Sequence[np.ndarray], boxes: BoxSource = "auto", *,
                       detector_options: dict | None = None, policy=None, padding: float = 2.0,
                       batch_size: int | None = None, embed_batch_size: int | None = None,
                       min_area: int = 15, progress: ProgressFn = None,
                       cancel: CancelToken | None = None) -> list:
    """One :class:`~napari_gpuseg.engine.sam.automatic.everything.AutomaticResult` per 2D plane.

    ``boxes``: one box array per plane, or a detector (``"auto"``, ``"threshold"``,
    ``"unet"``, see :func:`~napari_gpuseg.engine.detect.detect_boxes`) run on every plane
    with ``detector_options`` and ``policy``. ``padding`` (px around each box),
    ``batch_size`` (boxes per decoder call), ``embed_batch_size`` (views per encoder call)
    and ``min_area`` (px) go to :func:`~napari_gpuseg.engine.sam.automatic.boxes.segment_boxes_batch`.
    ``cancel`` is checked before each plane's detection and inside SAM. The results keep
    no low-res logits (``low_res`` None): a stack of many boxes would hold gigabytes of them.
    """
    from ...detect import detect_boxes
    from .boxes import segment_boxes_batch

    if isinstance(boxes, str):
        detector, per_plane = boxes, []
        for p in planes:
            check(cancel)
            per_plane.append(detect_boxes(p, detector, policy=policy, **(detector_options or {})))
        boxes = per_plane
    elif len(boxes) != len(planes):
        raise ValueError(f"{len(boxes)} box arrays for {len(planes)} planes")
    return segment_boxes_batch(engine, planes, boxes, padding=float(padding), batch_size=batch_size,
                               embed_batch_size=embed_batch_size, min_area=int(min_area),
                               progress=progress, cancel=cancel, keep_logits=False)
