"""The SAM annotator's commit, clear, undo and "Segment all boxes" actions."""
from __future__ import annotations

import time

import numpy as np
from napari.utils.notifications import show_info

from ._annotation_layers import remove_on_plane
from ._prompts import boxes_xyxy, plane, plane_index


class CommitActions:
    """Mixed into :class:`~.sam_annotator.SamAnnotatorWidget`: committed objects get the
    next free ids in the labels layer (:class:`~napari_gpuseg.engine.sam.annotation.LabelCommitter`)."""

    def _commit_masks(self, index: tuple, masks: list[np.ndarray]) -> list[int]:
        ids = self.committer.commit(self.labels_layer.data, masks, index)
        self.labels_layer.refresh()
        return ids

    def commit(self) -> list[int]:
        if self._preview is None:
            self._set_status("nothing to commit: add a prompt and wait for the preview")
            return []
        layer, index, _gen, result = self._preview
        if layer is not self.image_layer:
            return []
        plane_shape = self._spatial_shape()[-2:]
        ids = self._commit_masks(index, [result.full(plane_shape)])
        self.clear_prompts()
        self._set_status(f"committed object {ids[0] if ids else '(empty)'}")
        return ids

    def clear_prompts(self) -> None:
        if self.image_layer is None:
            return
        index = plane_index(self.image_layer, self.viewer)
        lay = self._layers
        for ly in () if lay is None else (lay.pos, lay.neg, lay.boxes):
            remove_on_plane(ly, index)
        self._generation += 1
        self._clear_preview()

    def undo(self) -> None:
        if self._layers is None or self._layers.labels is None:  # nothing committed yet
            self._set_status("nothing to undo")
            return
        ids = self.committer.undo(self.labels_layer.data)
        self.labels_layer.refresh()
        self._set_status(f"undid object(s) {ids}" if ids else "nothing to undo")

    def segment_all_boxes(self) -> None:
        if not self._image_alive():
            return
        index = plane_index(self.image_layer, self.viewer)
        boxes = boxes_xyxy(self.box_layer, index)
        if len(boxes) == 0:
            show_info("Draw one or more boxes in the 'SAM boxes' layer first.")
            return
        image = self._prepared.get(self._plane_key(index)) or self._early.get(self._plane_key(index))
        if image is None:
            image = np.array(plane(self.image_layer, index), copy=True)
        layer, t0 = self.image_layer, time.perf_counter()
        self._set_status(f"segmenting {len(boxes)} boxes…")

        def done(results):
            if layer is not self.image_layer:
                return
            shape = self._spatial_shape()[-2:]
            ids = self._commit_masks(index, [r.full(shape) for r in results])
            self.clear_prompts()
            self._set_status(f"committed {len(ids)} objects from {len(boxes)} boxes "
                             f"in {time.perf_counter() - t0:.2f} s")

        self._submit(self._job_boxes, self.model_name, image, boxes,
                       tag="boxes", on_result=done, on_error=self._on_error)
