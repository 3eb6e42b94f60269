"""SAM annotator dock: click or box objects, see the mask at once, commit labels.

All network work runs in the shared inference worker; this dock only reads prompts from
layers, submits jobs, and shows results that still match what the user is looking at.
A prompt's decode is interactive work: it embeds just the view it needs and runs before
the rest of the image's tiles, which are embedded in the background ("5/12 tiles"), those
at the canvas centre first (then those near the last prompt). When a preview's decode
ends, the worker holds that background work (``hold_after``) until the window has
repainted with the mask, so the repaint does not share the cores with the encoder.
"""
from __future__ import annotations

import logging
import threading
import time

import numpy as np
from napari.layers import Image
from qtpy.QtWidgets import (
    QCheckBox, QComboBox, QFormLayout, QHBoxLayout, QLabel, QPushButton, QVBoxLayout, QWidget,
)

from ..engine.sam.annotation import LabelCommitter
from ..engine.runtime.device import get_policy
from ..engine.sam.cache import EmbeddingCache
from ..engine.sam.encoder_slot import EncoderSlot
from ..engine.runtime.worker import BACKGROUND, IDLE, INTERACTIVE, InferenceWorker, default_worker
from ._choices import BROWSE, browse_checkpoint, is_box_trained, sam_model_names, take_sam_models
from ._dock import DockWidget, auto_spin, scrollable
from ._annotation_layers import ensure_layers, select_prompt_tool, spatial_shape
from ._first_layer import warm_up
from ._prompts import current_prompt, plane, plane_index, prompt_focus, view_focus
from ._redraw_hold import AfterRepaint, PostedCall, RedrawHold
from ._annotator_commit import CommitActions
from ._annotator_jobs import AnnotatorJobs
from ._annotator_later import LaterLayers
from ._annotator_handover import HANDOVER_WAIT_S, FirstTileHandover
from ._annotator_preview import PreviewDisplay
from ._annotator_region import RegionActions

logger = logging.getLogger(__name__)

BACKGROUND_HOLD_S = 0.3
"""At most this long after a preview's decode, background embedding waits for the window
to show the mask (it is released as soon as the repaint is done)."""

class SamAnnotatorWidget(AnnotatorJobs, CommitActions, LaterLayers, PreviewDisplay, FirstTileHandover,
                         RegionActions, DockWidget):
    TITLE = "SAM annotator"

    def __init__(self, napari_viewer, worker: InferenceWorker | None = None, parent=None):
        super().__init__(parent)
        self.viewer = napari_viewer
        self.worker = worker or default_worker()
        self.policy = get_policy()
        self.committer = LabelCommitter()
        self.image_layer: Image | None = None
        self.pos_layer = self.box_layer = self.preview_layer = None
        self._layers, self._generation = None, 0  # layers: the AnnotationLayers of the followed image
        self._plane: tuple | None = None  # the plane of the image on display
        self._prepared: dict[tuple, object] = {}  # plane key -> image with every tile embedded
        self._early: dict[tuple, object] = {}  # plane key -> prepared image, tiles still coming
        self._tiles: dict[tuple, tuple[int, int]] = {}  # plane key -> (tiles ready, tiles)
        self._focus, self._focus_on_view = None, True  # (x, y) the tiles start from: view, then prompt
        self._status_text, self._preview = "idle", None  # preview: (layer, index, generation, MaskResult)
        self._preview_prompt = None  # the prompt that gave the shown mask
        self._cache = EmbeddingCache()
        self._encoder_slot = EncoderSlot()  # a second process for a new image's first tile (CPU)
        self._embed_job = self._stack_job = self._preview_job = None
        self.stack_order: list[tuple] = []  # planes in the order the last precompute took them
        self._embed_started, self.last_embed_seconds, self._jobs = 0.0, None, []  # seconds: last embedding
        self.redraw = RedrawHold(self)  # a prompt and its mask appear in one redraw
        # background work waits from a preview's decode until its repaint (0: no hold)
        self.hold_background_s = BACKGROUND_HOLD_S
        self.handover_wait_s = HANDOVER_WAIT_S  # 0: no wait
        self._after_repaint = AfterRepaint(self.worker.release_background, self)
        self._looks_waiting, self._look_painted = [], AfterRepaint(self._on_look_painted, self)
        self._follow = PostedCall(self._follow_active, self)
        self._drop_noticed: float | None = None  # when a new layer became the active one
        self._followed: tuple | None = None  # (noticed, waited, tile elsewhere) until painted
        self._painted = AfterRepaint(self._on_followed_painted, self)
        self._init_later_layers()
        self._build_ui()
        worker, slot = self.worker, self._encoder_slot
        self.destroyed.connect(lambda *_: (self.redraw.release(), self._cancel_own_jobs(),
                                           worker.release_background(), slot.close()))
        self.viewer.layers.selection.events.active.connect(self._on_active_layer)
        self.viewer.dims.events.current_step.connect(self._on_step)
        self.viewer.camera.events.center.connect(self._on_camera)
        for key, fn in (("Shift-C", self.commit), ("Shift-X", self.clear_prompts), ("Shift-Z", self.undo),
                        ("Shift-N", self._toggle_click_sign)):
            self.viewer.bind_key(key, lambda _v, fn=fn: fn(), overwrite=True)
        self._preload_model()
        warm_up(self, self._submit)  # napari's one-off work for its first layers, before the first drop
        take_sam_models(self)
        active = self.viewer.layers.selection.active
        if isinstance(active, Image):
            self.set_image_layer(active)
        else:
            images = [ly for ly in self.viewer.layers if isinstance(ly, Image)]
            if images:
                self.set_image_layer(images[-1])

    # -- UI ---------------------------------------------------------------------
    def _build_ui(self) -> None:
        self.model_combo = QComboBox()
        self.model_combo.addItems(sam_model_names() + [BROWSE])
        self.model_combo.activated.connect(self._on_model_chosen)
        self.device_label = QLabel(self.policy.describe())
        self.device_label.setWordWrap(True)
        self.image_label = QLabel("no image layer")
        self.hint_label = QLabel()
        self.hint_label.setWordWrap(True)
        self._make_status_parts()
        self.multimask = QCheckBox("best of the candidate masks for a first click")
        self.multimask.setChecked(True)

        self.commit_btn = QPushButton("Commit [Shift-C]")
        self.clear_btn = QPushButton("Clear [Shift-X]")
        self.undo_btn = QPushButton("Undo commit [Shift-Z]")
        self.all_boxes_btn = QPushButton("Segment all boxes")
        self.commit_btn.clicked.connect(self.commit)
        self.clear_btn.clicked.connect(self.clear_prompts)
        self.undo_btn.clicked.connect(self.undo)
        self.all_boxes_btn.clicked.connect(self.segment_all_boxes)

        self.batch_spin = auto_spin("Images (tiles) per encoder call; Auto adapts to memory")
        self.precompute_btn = QPushButton("Precompute stack")
        self.cancel_btn = QPushButton("Cancel")
        self.precompute_btn.clicked.connect(self.precompute_stack)
        self.cancel_btn.clicked.connect(self.cancel)

        form = QFormLayout()
        form.addRow("Model", self.model_combo)
        form.addRow("Device", self.device_label)
        form.addRow("Image", self.image_label)
        form.addRow("Batch size", self.batch_spin)
        rows = [QHBoxLayout() for _ in range(3)]
        for row, pair in zip(rows, ((self.commit_btn, self.clear_btn), (self.undo_btn, self.all_boxes_btn),
                                    (self.precompute_btn, self.cancel_btn))):
            row.addWidget(pair[0])
            row.addWidget(pair[1])
        # the rows live in a scroll area: a dock sharing the window's height with others
        # scrolls instead of squeezing its top rows (Model, Image) to nothing
        self.content = QWidget()
        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        outer.addWidget(scrollable(self.content))
        layout = QVBoxLayout(self.content)
        layout.addLayout(form)
        # the status line ("5/12 tiles", the last mask) right under the image it is about:
        # visible without scrolling at napari's default window size
        layout.addWidget(self.status)
        layout.addWidget(self.progress)
        layout.addWidget(self.hint_label)
        layout.addWidget(self._make_region_button())  # shown for an image too big to annotate whole
        layout.addWidget(self.multimask)
        for row in rows:
            layout.addLayout(row)
        from ._propagate import PropagatePanel  # Propagate / Segment all objects in 3D
        self.propagate_panel = PropagatePanel(self)
        layout.addWidget(self.propagate_panel)
        layout.addStretch(1)
        self._update_hint()

    @property
    def model_name(self) -> str:
        return self.model_combo.currentText()

    def _update_hint(self) -> None:
        box_model = is_box_trained(self.model_name)
        self.hint_label.setText(
            "This model was trained with boxes: draw a box around each object "
            "(points alone give poor masks)." if box_model else
            "Click an object (SAM positive is selected for you); Shift-N switches to SAM "
            "negative, whose clicks remove a wrong part, and back; or draw a box in SAM boxes.")

    def use_sam_model(self, path: str) -> None:
        """Switch to a checkpoint made elsewhere (Adapt SAM): it joins the model list."""
        if self.model_combo.findText(path) < 0:
            self.model_combo.insertItem(0, path)
        self.model_combo.setCurrentText(path)
        self._on_model_chosen(0)
        self._set_status(f"model {path}")

    def _on_model_chosen(self, _index: int) -> None:
        if not browse_checkpoint(self.model_combo, self):
            return
        self._update_hint()
        select_prompt_tool(self.viewer, self._layers, is_box_trained(self.model_name))  # the model's tool
        self._prepared.clear()
        self._preload_model()
        self._embed_current()

    def _preload_model(self) -> None:
        """Load the model in the worker as soon as it is chosen (the dock opens before the
        user drops an image, usually): the first embedding then starts at once, and loading
        (a one-off GUI hiccup in torch's unpickler and Python's collector) is over
        before any interaction. A missing model is reported now, not at the first prompt."""
        model = self.model_name

        def done(seconds):
            if self.image_layer is None:
                self._set_status(f"model {self.model_name} ready ({seconds:.1f} s)")
            slot = self._encoder_slot  # cancelled (the Cancel button): started when next idle
            self._submit(self._job_second_process, model, tag="encoder-process", priority=IDLE,
                         on_cancelled=lambda: setattr(slot, "deferred", model))

        self._submit(self._job_load, model, tag="load", replace=True,
                     on_result=done, on_error=self._on_error)

    def _set_status(self, text: str) -> None:
        self._status_text = text
        tiles = self._tiles.get(self._plane_key()) if self._image_alive() else None
        if tiles is not None and tiles[0] < tiles[1]:
            text = f"{text} · {tiles[0]}/{tiles[1]} tiles"
        self.status.setText(text)

    def _on_tiles(self, key: tuple, done: int, total: int) -> None:
        self._tiles[key] = (done, total)
        if done and self._image_alive() and key == self._plane_key():
            self._rest_soon()
        if key == self._plane_key():
            self._on_progress(done, total)
            self._set_status(self._status_text)

    # -- layers -----------------------------------------------------------------------
    def _on_active_layer(self, event=None) -> None:
        # follow the active image once napari has finished the change that made it active:
        # adding our prompt layers from inside a layer-list event (a drop, a deletion)
        # nests model changes in napari's layer list, which Qt cannot always survive. A
        # posted event (not a zero-delay timer) runs before napari's first repaint, so the
        # new image is never drawn alone first: on software OpenGL, napari 0.9 crashed on
        # the third "delete every layer, add an image" round when it was (README)
        if self._drop_noticed is None and isinstance(self.viewer.layers.selection.active, Image):
            self._drop_noticed = time.perf_counter()
        self._follow.post()

    def _follow_active(self) -> None:
        layer = self.viewer.layers.selection.active
        if isinstance(layer, Image) and layer is not self.image_layer and layer in self.viewer.layers:
            self.set_image_layer(layer)
        self._drop_noticed = None  # measured by set_image_layer, or no new image to follow

    def set_image_layer(self, layer: Image) -> None:
        self.image_layer = layer
        self.image_label.setText(layer.name)
        self._plane = plane_index(layer, self.viewer)
        self._generation += 1
        if self._offer_region(layer):  # too big to annotate whole: a region of it, on request
            self._clear_preview()
            return
        self._embed_then_layers()
        self._rest_pending = bool(self._missing())
        self._clear_preview()

    def _spatial_shape(self) -> tuple:
        return spatial_shape(self.image_layer)

    def _ensure_layers(self, rest: bool = True) -> None:
        lay = self._layers = ensure_layers(self.viewer, self.image_layer, rest=rest)
        self.pos_layer, self.box_layer, self.preview_layer = lay.pos, lay.boxes, lay.preview
        self._connect_prompts(lay)
        select_prompt_tool(self.viewer, lay, is_box_trained(self.model_name))

    def _connect_prompts(self, lay) -> None:
        for ly in (lay.pos, lay.neg, lay.boxes):
            if ly is None:
                continue
            try:
                ly.events.data.disconnect(self._on_prompts_changed)
            except (TypeError, ValueError, RuntimeError):  # not connected yet
                logger.debug("prompt layer %r was not connected yet", ly.name)
            ly.events.data.connect(self._on_prompts_changed)

    # -- embedding --------------------------------------------------------------------
    def _plane_key(self, index=None) -> tuple:
        index = plane_index(self.image_layer, self.viewer) if index is None else index
        return (id(self.image_layer), self.model_name, index)

    def _embed_current(self) -> bool:
        """Embed the plane on display in the background; True when its tiles are started."""
        if not self._image_alive():
            return False
        index = plane_index(self.image_layer, self.viewer)
        key = self._plane_key(index)
        self._focus, self._focus_on_view = view_focus(self.viewer, self.image_layer), True
        if key in self._prepared:
            self._set_status("embedding cached")
            self._submit(self._job_warm, self.model_name, self._prepared[key], tag="warm",
                         replace=True, priority=BACKGROUND)
            return False
        img = np.array(plane(self.image_layer, index), copy=True)
        self._embed_started = time.perf_counter()
        self._set_status(f"embedding {self.image_layer.name} {index or ''} (prompts need not wait)")
        # the image's tiles in the background: a new image or slice replaces this job, and a
        # prompt meanwhile embeds only its own view, ahead of it
        self._embed_job = self._submit(
            self._job_tiles, self.model_name, img, self.batch_spin.value() or None, key,
            tag="embed", replace=True, priority=BACKGROUND,
            on_result=lambda r, key=key: self._on_embedded(key, r),
            on_error=self._on_error, on_progress=lambda d, t, key=key: self._on_tiles(key, d, t),
            on_cancelled=lambda key=key: self._on_tiles_cancelled(key))
        return True

    def _on_tiles_cancelled(self, key: tuple) -> None:
        self._early.pop(key, None)
        if self._image_alive() and key == self._plane_key():  # not replaced: the user cancelled
            self._set_status("embedding cancelled")

    def _on_embedded(self, key: tuple, result) -> None:
        prepared, seconds = result
        self._prepared[key] = prepared[0]
        self._early.pop(key, None)
        self.last_embed_seconds = seconds
        if key == self._plane_key():
            n = self._tiles.get(key, (0, 0))[1]
            self._set_status(f"embedding ready ({seconds:.2f} s, {n}/{n} tiles)")
            # the decoder's image-only work, in the background rather than in the user's
            # first prompt (a prompt meanwhile goes first; the warm-up reuses its work)
            self._submit(self._job_warm, self.model_name, prepared[0], tag="warm", replace=True,
                         priority=BACKGROUND)
            idle = self._preview_job is None or self._preview_job.wait(0)
            if not self.has_preview() and idle:
                self._on_prompts_changed()  # a prompt whose decode did not come through

    def _image_alive(self) -> bool:
        """False before an image is chosen and once the user (or closing the viewer)
        removed it: no work is started for an image that is gone."""
        return self.image_layer is not None and self.image_layer in self.viewer.layers and not self._region_only

    def _on_step(self, event=None) -> None:
        if not self._image_alive():
            return
        index = plane_index(self.image_layer, self.viewer)
        if index == self._plane:
            # the viewer's dims also move when another layer's extent changes (the first box
            # drawn into an empty box layer, say): same plane, nothing to redo
            return
        self._plane = index
        self._generation += 1
        self._clear_preview()
        self._embed_current()
        self._on_prompts_changed()

    def _on_camera(self, event=None) -> None:
        if self._focus_on_view and self._image_alive():  # panned or zoomed before a prompt
            self._focus = view_focus(self.viewer, self.image_layer)

    def cancel(self) -> None:
        n = self._cancel_own_jobs()
        self._set_status(f"cancelled {n} job(s)")

    # -- prompts and preview ------------------------------------------------------------
    def _on_prompts_changed(self, event=None) -> None:
        self._postpone_rest()  # the user is at work: the later layers wait
        action = str(getattr(event, "action", "") or "")
        if action.endswith("ing"):  # "adding"/"changing"/"removing": wait for the final event
            if self.hold_background_s > 0 and self._image_alive():
                # the encoder parks at its next pause point while napari applies the edit,
                # so the decode submitted at the final event starts at once
                self.worker.hold_background(self.hold_background_s)
            return
        if not self._image_alive() or self.pos_layer is None:
            return
        self._generation += 1
        index = plane_index(self.image_layer, self.viewer)
        try:
            prompt = current_prompt(self.pos_layer, self._layers.neg, self.box_layer, index)
        except ValueError:
            prompt = None
        if prompt is None:
            self._clear_preview()
            return
        key = self._plane_key(index)
        image = self._prepared.get(key) or self._early.get(key)
        if image is None:
            image = np.array(plane(self.image_layer, index), copy=True)
        self._focus, self._focus_on_view = prompt_focus(prompt), False  # its tiles come next
        gen, layer = self._generation, self.image_layer
        prompt, multimask = self._follow_up(prompt, index)
        first_click = multimask and prompt.box is None and prompt.mask_input is None
        first_box = prompt.box is not None and prompt.points is None and prompt.mask_input is None
        first_look = first_click or first_box
        look = threading.Event() if first_look else None  # set once the first look is painted
        if first_look:  # a quick mask first (from a small crop, or a click's native tile)
            self._submit(
                self._job_first_look, self.model_name, image, prompt, look, tag="preview", replace=True,
                priority=INTERACTIVE, hold_after=self.hold_background_s,
                defer=self._defer_for(self.model_name, image, prompt),
                on_result=lambda res: self._show_first_look(layer, index, gen, res, prompt, look),
                on_error=self._on_preview_error)  # the job set ``look`` itself
        self._preview_job = self._submit(
            self._job_predict, self.model_name, image, [prompt], multimask, look,
            tag="preview", replace=not first_look, priority=INTERACTIVE, hold_after=self.hold_background_s,
            defer=self._defer_for(self.model_name, image, prompt),
            on_result=lambda res: self._show_preview(layer, index, gen, res[0], prompt),
            on_error=self._on_preview_error)
        self.redraw.hold()
