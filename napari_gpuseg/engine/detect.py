"""Every way boxes are made for box-prompted SAM, in one place and one convention.

All functions return ``(N, 4)`` float64 arrays of ``x0, y0, x1, y1`` boxes in pixels,
end exclusive (a one-pixel object at (y, x) is ``x, y, x + 1, y + 1``)::

    boxes = detect_boxes(image, "threshold")   # or "unet", "auto", or a label image
    boxes = boxes_from_labels(labels)           # the objects of a 2D label image

Box files (CSV, label images) are read by :mod:`.box_files`.
RGB(A) images are turned to gray by :func:`napari_gpuseg.io.to_gray` (luminance), the
same conversion the U-Net folder method uses.
"""
from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from ..io import is_rgb, to_gray

_UNET_MODELS: dict = {}  # the bundled U-Net detector, loaded once per device
_UNET_LOCK = threading.Lock()


def _as_boxes(rows) -> np.ndarray:
    return np.asarray(rows, dtype=np.float64).reshape(-1, 4)


def sequential_labels(labels: np.ndarray) -> np.ndarray:
    """``labels`` with its ids renumbered 1..N in increasing order (0 stays background),
    as int64: ids of any size (uint64 >= 2**63 too) keep their objects and their order.
    Returned as they are when the ids are already small."""
    labels = np.asarray(labels)
    if labels.size == 0:
        return labels.astype(np.int64)
    if int(labels.max()) <= max(labels.size, 2**16):  # find_objects: one slot per id value
        return labels.astype(np.int64, copy=False)
    ids, inverse = np.unique(labels, return_inverse=True)
    if ids[0] != 0:
        inverse = inverse + 1
    return inverse.reshape(labels.shape).astype(np.int64, copy=False)


def boxes_from_labels(labels: np.ndarray) -> np.ndarray:
    """Boxes of the objects of a 2D label image, in increasing label order (any ids: a
    large or uint64 id costs no memory per id value)."""
    from scipy import ndimage as ndi

    return _as_boxes([(s[1].start, s[0].start, s[1].stop, s[0].stop)
                      for s in ndi.find_objects(sequential_labels(labels)) if s is not None])


def threshold_boxes(image: np.ndarray, **kwargs) -> np.ndarray:
    """Boxes of the objects of :func:`napari_gpuseg.engine.classical.classical_segment`
    (blur + Otsu + watershed) on a 2D image; ``kwargs`` go to it."""
    from .classical import classical_segment

    return boxes_from_labels(classical_segment(image, **kwargs))


def unet_available() -> bool:
    """True when the U-Net engine and its bundled nuclei model are installed."""
    try:
        from .unet import unet_checkpoint as unet_ckpt
    except Exception:  # noqa: BLE001 - the U-Net engine is optional here
        return False
    return unet_ckpt.bundled_model_path().is_file()


def _bundled_unet(device):
    """The bundled U-Net, loaded once per device (thread-safe)."""
    from .unet import unet_checkpoint as unet_ckpt

    dev = str(device)
    with _UNET_LOCK:
        if dev not in _UNET_MODELS:
            _UNET_MODELS[dev] = unet_ckpt.load_unet(None, device=dev)
        return _UNET_MODELS[dev]


def unet_boxes(image: np.ndarray, model=None, **kwargs) -> np.ndarray:
    """Boxes of the objects the U-Net finds in a 2D image (``model`` None = the bundled
    nuclei model, loaded once per device; a path = that checkpoint); ``kwargs`` go to
    :func:`napari_gpuseg.engine.unet.predict.predict_labels`."""
    from .runtime.device import resolve_policy
    from .unet import unet_checkpoint as unet_ckpt, predict as unet

    device = resolve_policy(kwargs.get("policy")).device
    if model is None:
        model = _bundled_unet(device)
    elif isinstance(model, (str, Path)):
        model = unet_ckpt.load_unet(model, device=device)
    return boxes_from_labels(unet.predict_labels(model, image, **kwargs))


def _gray(image: np.ndarray, rgb: bool | None) -> np.ndarray:
    image = np.asarray(image)
    if image.ndim == 3 and image.shape[-1] == 1:
        return image[..., 0]
    return to_gray(image) if (is_rgb(image) if rgb is None else rgb) else image


def detect_boxes(image: np.ndarray, detector="threshold", rgb: bool | None = None,
                 policy=None, **kwargs) -> np.ndarray:
    """Boxes proposed by a detector for one 2D image (gray or RGB).

    ``detector``: ``"threshold"`` (:func:`threshold_boxes`), ``"unet"``
    (:func:`unet_boxes`; falls back to the threshold detector when the U-Net is not
    installed), ``"auto"`` (U-Net when available), or a label image whose objects give
    the boxes. ``kwargs`` go to the detector.
    """
    if isinstance(detector, np.ndarray):
        return boxes_from_labels(detector)
    gray = _gray(image, rgb)
    if gray.ndim != 2:
        raise ValueError(f"detect_boxes takes one 2D image, got shape {np.shape(image)}")
    if detector == "auto":
        detector = "unet" if unet_available() else "threshold"
    if detector == "unet" and unet_available():
        if policy is not None:
            kwargs.setdefault("policy", policy)
        return unet_boxes(gray, **kwargs)
    if detector not in ("threshold", "unet"):
        raise ValueError(f"unknown detector {detector!r}: use 'threshold', 'unet', 'auto' or labels")
    return threshold_boxes(gray, **kwargs)
