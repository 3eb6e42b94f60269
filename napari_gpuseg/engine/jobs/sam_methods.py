"""Folder-job methods for SAM: ``sam-boxes`` (detector + SAM) and ``sam-everything``.

Registered by name in :mod:`napari_gpuseg.engine.jobs.method_registry`; used like every method::

    seg = create_method("sam-boxes", model=None, batch_size=None, detector="auto")  # the annotator's model
    seg.load(policy)                 # in the device worker thread
    seg.segment([img1, img2, ...])   # same-shape images: one batched encoder pass, boxes batched

2D images (gray or RGB) and stacks (ZYX, per slice) are accepted.
"""
from __future__ import annotations

import abc
import os
from dataclasses import fields
from pathlib import Path

import numpy as np

from ..stacks import label_offsets, stack_labels
from .method_registry import BYTES_PER_VALUE, Option, OptionError, Segmenter, SegResult, default_sam_model


class _Any(Option):
    def accepts(self, v) -> bool:
        return True


_ANY = _Any("str")


class _Folder(Option):
    def accepts(self, v) -> bool:
        return isinstance(v, (str, os.PathLike)) and Path(v).is_dir()

    def describe(self) -> str:
        return "an existing folder"


def _planes(image: np.ndarray, rgb: bool) -> tuple[list[np.ndarray], tuple]:
    """2D planes of an image or stack (YX, YXC, ZYX, ZYXC, TZYX...) and the leading shape."""
    spatial = image.shape[:-1] if rgb else image.shape
    lead = spatial[:-2]
    flat = image.reshape((-1,) + image.shape[len(lead):]) if lead else image[None]
    return list(flat), tuple(lead)


class _SamSegmenter(Segmenter, metaclass=abc.ABCMeta):
    spatial_ndims = (2, 3)
    accepts_rgb = True
    bytes_per_value = BYTES_PER_VALUE["sam"]

    def __init__(self, model: str | None = None, batch_size: int | None = None, **options):
        super().__init__(model=model or default_sam_model(), batch_size=batch_size, **options)
        self.engine = None

    # (model, policy) -> SamEngine; None loads one for this segmenter. Dask workers share one
    # engine per model between methods and option sets (worker_cache.shared_sam_engine).
    engine_source = None

    def load(self, policy) -> None:
        from ..sam.loader import load_engine

        super().load(policy)
        if self.engine_source is not None:
            self.engine = self.engine_source(self.model, policy)
        else:
            self.engine = load_engine(self.model, policy=policy)

    def unload(self) -> None:
        self.engine = None

    def prepare(self, image: np.ndarray, rgb: bool | None = None) -> np.ndarray:
        """Checks the shape; gray stacks get a trailing channel axis so that the dimension
        count tells the layout: 2 = gray YX, 3 = colour YXC, 4 = stack ZYXC."""
        from ...io import is_rgb

        rgb = is_rgb(image) if rgb is None else rgb
        image = super().prepare(image, rgb)
        return image[..., None] if (not rgb and image.ndim == 3) else image

    def _split(self, images):
        planes, leads = [], []
        for img in images:
            img = np.asarray(img)
            p, lead = _planes(img, rgb=img.ndim >= 3)
            planes.append(p)
            leads.append(lead)
        return planes, leads

    def segment(self, images):
        planes, leads = self._split(images)
        flat = [p for ps in planes for p in ps]
        results = self._segment_planes(flat)
        out, k = [], 0
        for ps, lead in zip(planes, leads):
            part = results[k:k + len(ps)]
            k += len(ps)
            labels = stack_labels([r.labels for r in part], lead)
            scores = {}  # label id (unique across the stack) -> predicted IoU
            for r, offset in zip(part, label_offsets([r.labels for r in part])):
                scores.update({int(i) + offset: float(s) for i, s in zip(r.ids, r.scores) if i > 0})
            out.append(SegResult(labels, scores))
        return out

    @abc.abstractmethod
    def _segment_planes(self, planes) -> list:
        """One result (``.labels``, ``.ids``, ``.scores``) per 2D plane, all planes at once."""


class SamBoxSegmenter(_SamSegmenter):
    """Detector boxes refined by SAM (the mode for box-trained models such as LiteMedSAM).

    Options: ``detector`` ("auto" = U-Net when installed, else "threshold"; or
    "threshold" / "unet"), ``padding`` (px added around each box, default 2),
    ``min_area`` (px; holes/islands/objects smaller are cleaned, default 15),
    ``embed_batch_size`` (views per encoder call) and detector keywords as
    ``detector_options``. ``batch_size`` = boxes per decoder call. ``boxes``: a folder of
    box files instead of a detector, one per image (:mod:`..box_files`).
    """

    name = "sam-boxes"
    options_spec = {"detector": Option("str", choices=("auto", "threshold", "unet")),
                    "padding": Option("float", 0), "min_area": Option("int", 0),
                    "embed_batch_size": Option("int", 1, none_ok=True),
                    "detector_options": Option("dict", none_ok=True), "boxes": _Folder("str")}
    _given = None  # boxes per plane from box files, for the current segment() call
    _missed: list = []  # per plane of that call: the given boxes that gave no object

    def __init__(self, model=None, batch_size=None, **options):
        super().__init__(model, batch_size, **options)
        if "boxes" in options and {"detector", "detector_options"} & set(options):
            raise OptionError("sam-boxes method: give either boxes (box files) or a detector, not both")

    def file_inputs(self, path, rel: str, image: np.ndarray):
        """Folder jobs (reader threads): the boxes per plane of the image ``rel`` from the
        ``boxes`` folder (None without that option)."""
        from ..box_files import boxes_for_image

        if self.options.get("boxes") is None:
            return None
        spatial = image.shape[:-1] if image.ndim >= 3 else image.shape  # as prepare() left it
        return boxes_for_image(self.options["boxes"], rel, spatial)

    def segment(self, images, inputs=None):
        if self.options.get("boxes") is not None and inputs is None:
            raise ValueError("option boxes: box files are read per image file by folder jobs")
        self._given = None if inputs is None else [b for per_image in inputs for b in per_image]
        out = super().segment(images)
        if inputs is not None:  # say which given boxes gave no object (a 1-px box, ...)
            missed, k = self._missed, 0
            for res, per_image in zip(out, inputs):
                note = _missed_note(per_image, missed[k:k + len(per_image)], self.options.get("min_area", 15))
                k += len(per_image)
                res.notes = "; ".join(n for n in (res.notes, note) if n)
        return out

    def _segment_planes(self, planes):
        from ..sam.automatic.box_stack import segment_box_planes

        given, self._given = self._given, None
        opts = self.options
        results = segment_box_planes(
            self.engine, planes, given if given is not None else opts.get("detector", "auto"),
            detector_options=opts.get("detector_options"), policy=self.policy,
            padding=opts.get("padding", 2.0), batch_size=self.batch_size,
            embed_batch_size=opts.get("embed_batch_size"), min_area=opts.get("min_area", 15),
            cancel=self.cancel)
        if given is not None:  # label i + 1 is the mask of box i, where one was found
            self._missed = [np.asarray(b).reshape(-1, 4)[~np.isin(np.arange(1, len(b) + 1), r.labels)]
                            for b, r in zip(given, results)]
        return results


def _missed_note(boxes_per_plane, missed_per_plane, min_area) -> str:
    """"2 of 9 boxes gave no object, e.g. 10,10,11,11 (1 x 1 px) ..." or ""."""
    n_all = sum(len(b) for b in boxes_per_plane)
    missed = [b for m in missed_per_plane for b in np.asarray(m).reshape(-1, 4)]
    if not missed:
        return ""
    small = min(missed, key=lambda b: (b[2] - b[0]) * (b[3] - b[1]))
    corners = ",".join(f"{v:g}" for v in small)
    return (f"{len(missed)} of {n_all} given box(es) gave no object, e.g. {corners} "
            f"({small[2] - small[0]:g} x {small[3] - small[1]:g} px): nothing found in them, or "
            f"less than min_area={min_area} px")


class SamEverythingSegmenter(_SamSegmenter):
    """Segment everything from a grid of point prompts (official SamAutomaticMaskGenerator
    parameters as options, e.g. ``points_per_side=32, pred_iou_thresh=0.88``; per-model
    defaults otherwise). ``batch_size`` = point prompts per decoder call."""

    name = "sam-everything"

    def option_spec(self):
        """The fields of :class:`AutomaticParams` (typed by their defaults) and
        ``embed_batch_size``."""
        from ..sam.automatic.everything import AutomaticParams

        kinds = {bool: "bool", int: "int", float: "float", str: "str"}
        spec = {"embed_batch_size": Option("int", 1, none_ok=True),
                "tiling": Option("str", choices=("auto", "crops", "tiles")),
                "label_order": Option("str", choices=("score", "area")),
                "min_object_area": Option("int", 0, none_ok=True), "point_grids": _ANY}
        for f in fields(AutomaticParams):
            kind = kinds.get(type(f.default))
            if f.name not in spec and kind is not None:
                spec[f.name] = Option(kind, 0 if kind in ("int", "float") else None,
                                      none_ok=f.name == "points_per_side")
        return spec

    def _segment_planes(self, planes):
        from ..sam.automatic.everything import AutomaticParams, segment_everything_batch

        names = {f.name for f in fields(AutomaticParams)}
        params = AutomaticParams.for_model(self.engine.info.box_trained, self.engine.info.decoder_tuned,
                                           **{k: v for k, v in self.options.items() if k in names})
        return segment_everything_batch(self.engine, planes, params, batch_size=self.batch_size,
                                        embed_batch_size=self.options.get("embed_batch_size"),
                                        cancel=self.cancel)
