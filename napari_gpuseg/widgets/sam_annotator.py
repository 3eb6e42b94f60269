"""SAM annotator dock: click or box objects, see the mask at once, commit labels.

A view over an :class:`~napari_gpuseg.engine.annotate.session.AnnotationSession`: the dock
maps layer events to session calls (the image layer it follows, the plane on display, the
prompts in SAM positive / SAM negative / SAM boxes, the buttons) and paints what the session
reports (the current object in SAM preview, commits in ``<image> SAM labels``, the status
line). The session schedules the work on the shared inference worker; its callbacks come
back on the GUI thread (``_bridge``). What stays here is the window's side of latency: a
prompt and its mask are painted in one repaint (``JointRepaint``), background embedding waits
until the mask is on screen (``AfterRepaint``), and a first look is reported shown once
painted. All five layers are made while the dock follows a drop, when napari is busy adding
the image anyway: made later, once the first prompt rested, each was a freeze of half a second
while the tiles embedded, for a first mask only 1.23x sooner (``docs/benchmarks.md``, SAM
annotator). The Adapt panel
(``_adapt_panel``) adapts the model to the objects committed; the model list holds the user's
adapted decoders (named with the image each came from).
"""
from __future__ import annotations

import logging
import weakref

from napari.layers import Image
from napari.utils.notifications import show_info
from qtpy.QtWidgets import (
    QCheckBox, QComboBox, QFormLayout, QHBoxLayout, QLabel, QMessageBox, QPushButton, QVBoxLayout, QWidget,
)

from ..engine.annotate import region as regions
from ..engine.annotate.adapting import adapt_offer
from ..engine.annotate.session import AnnotationSession
from ..engine.runtime.device import get_policy
from ..engine.runtime.worker import InferenceWorker, default_worker
from ..engine.sam.loader import DEFAULT_MODEL
from ..engine.sam.training.adapt import adapted_entry, forget_adapted
from ._annotation_layers import (add_rest, ensure_layers, paint_preview, remove_on_plane, select_prompt_tool,
                                 spatial_shape, toggle_click_sign)
from ._annotator_region import REGION_BUTTON, add_region, region_in_view, too_big
from ._choices import (adapted_label, add_adapted_choice, browse_checkpoint, chosen_sam_model, fill_sam_models,
                       is_box_trained, offer_adapted_sam, take_sam_models, withdraw_adapted_sam)
from ._dock import DockWidget, auto_spin, let_go_of_key, scrollable, short_name
from ._first_layer import warm_up
from ._prompts import boxes_xyxy, current_prompt, plane_index, view_focus
from ._joint_repaint import AfterRepaint, JointRepaint, PostedCall
from ._mesh_shader import hold as keep_mesh_shaders

logger = logging.getLogger(__name__)

BACKGROUND_HOLD_S = 0.3
"""At most this long after a preview's decode, background embedding waits for the window
to show the mask (it is released as soon as the repaint is done)."""


def drag_hold(dock):
    """A mouse-drag callback for the prompt layers: from the press to the release of a drag
    that edits prompts (not a pan), background embedding stays parked, each move extending
    the dock's ``hold_background_s``. napari tells the layer's data listeners of a drag only
    at its first move ("changing") and at the release ("changed"): without this, the tiles
    went on from 0.3 s into a drag, competing with the canvas's redraws at each move. Holds the
    dock weakly: the layers outlive a closed dock."""
    ref = weakref.ref(dock)

    def hold() -> None:
        d = ref()
        if d is not None and d.hold_while_dragging and d.hold_background_s > 0:
            d.session.hold_background(d.hold_background_s)

    def on_drag(layer, event):
        if layer.mode == "pan_zoom":
            return
        hold()
        yield
        while event.type == "mouse_move":
            hold()
            yield

    return on_drag


class SamAnnotatorWidget(DockWidget):
    TITLE = "SAM annotator"

    def __init__(self, napari_viewer, worker: InferenceWorker | None = None, parent=None):
        super().__init__(parent)
        self._release_mesh_fix = keep_mesh_shaders()  # a dragged box repaints without compiling its shader again
        self._retired = False  # the dock was closed (retire)
        self.viewer = napari_viewer
        self.worker = worker or default_worker()
        self.policy = get_policy()
        self.session = AnnotationSession(None, worker=self.worker, submit=self._submit_job)
        self.image_layer: Image | None = None
        self._layers = None  # the AnnotationLayers of the followed image
        self.pos_layer = self.box_layer = self.preview_layer = None
        self._status_text = "idle"
        self._focus_on_view = True  # the tiles start from the canvas centre until a prompt
        self._region_only = False  # the followed image is too big: no work is started for it
        self._removing = False  # prompts being removed by the dock itself
        self._embed_job = self._stack_job = None
        self.joint_repaint = JointRepaint(self)  # a prompt and its mask appear in one repaint
        # background work waits from a preview's decode until its repaint (0: no hold)
        self.hold_background_s = BACKGROUND_HOLD_S
        self.hold_while_dragging = True  # a drag on a prompt layer parks it from press to release
        self._drag_hold = drag_hold(self)
        self._after_repaint = AfterRepaint(self.session.release_background, self)
        self._looks_waiting: list = []  # ``shown`` callbacks of first looks painted next
        self._look_painted = AfterRepaint(self._on_look_painted, self)
        self._follow = PostedCall(self._follow_active, self)
        self._keep_status = False  # a model switch's message outlives the embedding it starts
        self._build_ui()
        session, release_mesh_fix = self.session, self._release_mesh_fix
        self.destroyed.connect(lambda *_: (self.joint_repaint.finish(), session.close(), release_mesh_fix()))
        self._viewer_hooks = ((self.viewer.layers.selection.events.active, self._on_active_layer),
                              (self.viewer.dims.events.current_step, self._on_step),
                              (self.viewer.camera.events.center, self._on_camera))
        for emitter, callback in self._viewer_hooks:
            emitter.connect(callback)
        self._keys = {}
        for key, fn in (("Shift-C", self.commit), ("Shift-X", self.clear_prompts), ("Shift-Z", self.undo),
                        ("Shift-N", self._toggle_click_sign)):
            self._keys[key] = lambda _v, fn=fn: fn()
            self.viewer.bind_key(key, self._keys[key], overwrite=True)
        self.session.set_model(self.model_name)
        self._preload_model()
        warm_up(self, self.session.schedule)  # napari's one-off work for its first layers, before the first drop
        take_sam_models(self)
        active = self.viewer.layers.selection.active
        if isinstance(active, Image):
            self.set_image_layer(active)
        else:
            images = [ly for ly in self.viewer.layers if isinstance(ly, Image)]
            if images:
                self.set_image_layer(images[-1])

    def on_closed(self) -> None:
        self.retire()

    def retire(self) -> None:
        """The dock was closed: its queued and running work is cancelled (an Adapt to these
        objects run too: nothing of it is saved), the viewer's events,
        its prompt layers and the keys Shift-C/X/Z/N/P no longer reach it (a key another dock
        bound since stays bound), and it lets go of the mesh shader fix. The layers it made and
        the labels stay in the viewer. Idempotent; nothing starts it again."""
        if self._retired:
            return
        self._retired = True
        self.joint_repaint.finish()
        self.adapt_panel.cancel()  # Adapt to these objects: nothing is saved, as with Cancel
        self.session.close()
        self._release_mesh_fix()
        for emitter, callback in self._viewer_hooks:
            try:
                emitter.disconnect(callback)
            except (TypeError, ValueError, RuntimeError):  # already gone
                logger.debug("%r was not connected", callback)
        self._disconnect_prompts(self._layers)
        for key, ours in self._keys.items():
            let_go_of_key(self.viewer, key, ours)
        self.propagate_panel.unbind()

    # -- UI ---------------------------------------------------------------------------
    def _build_ui(self) -> None:
        self.model_combo = QComboBox()
        fill_sam_models(self.model_combo)  # with the user's adapted decoders, newest first
        self.model_combo.activated.connect(self._on_model_chosen)
        self.device_label = QLabel(self.policy.describe())
        self.device_label.setWordWrap(True)
        self.image_label = QLabel("no image layer")
        self.hint_label = QLabel()
        self.hint_label.setWordWrap(True)
        self._make_status_parts()
        self.multimask = QCheckBox("best of the candidate masks for a first click")
        self.multimask.setChecked(True)
        self.multimask.setToolTip("A first click asks the model for its candidate masks and, as its decoder "
                                  "says (measured on labelled objects), blends them by predicted IoU or keeps "
                                  "one, else the one it rates best; unchecked: the single-mask output")
        self.region_btn = QPushButton(REGION_BUTTON)  # shown for an image too big to annotate whole
        self.region_btn.setToolTip("Annotate the part of this image on the canvas as an image layer of its "
                                   "own, placed over it (at most %d px a side)" % regions.REGION_SIDE)
        self.region_btn.clicked.connect(self.annotate_region)
        self.region_btn.setVisible(False)

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
        rows = [QHBoxLayout() for _ in range(3)]
        for row, pair in zip(rows, ((self.commit_btn, self.clear_btn), (self.undo_btn, self.all_boxes_btn),
                                    (self.precompute_btn, self.cancel_btn))):
            row.addWidget(pair[0])
            row.addWidget(pair[1])
        encoder = QFormLayout()
        encoder.addRow("Batch size", self.batch_spin)
        # the rows live in a scroll area: a dock sharing the window's height with others
        # scrolls instead of squeezing its top rows (Model, Image) to nothing
        self.content = QWidget()
        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        outer.addWidget(scrollable(self.content))
        layout = QVBoxLayout(self.content)
        layout.addLayout(form)
        # what a user needs for every object comes first, so that at napari's default window
        # size (the GPU monitor docked below) it shows without scrolling: the status line
        # ("5/12 tiles", the last mask) right under the image it is about, then Commit, Clear,
        # Undo. The hint and the settings that are rarely changed come after them
        layout.addWidget(self.status)
        layout.addWidget(self.progress)
        layout.addWidget(self.region_btn)
        layout.addLayout(rows[0])
        layout.addLayout(rows[1])
        layout.addWidget(self.hint_label)
        layout.addWidget(self.multimask)
        layout.addLayout(encoder)
        layout.addLayout(rows[2])
        from ._propagate import PropagatePanel  # Propagate / Segment all objects in 3D

        from ._adapt_panel import AdaptPanel  # Adapt to these objects

        self.adapt_panel = AdaptPanel(
            self.session, image_layer=lambda: self.image_layer, image_alive=self._image_alive,
            set_status=self._set_status, on_progress=self._on_progress, on_error=self._on_error,
            use_adapted=self.use_adapted, forget=self.forget_model)
        layout.addWidget(self.adapt_panel)
        self.propagate_panel = PropagatePanel(
            self.viewer, self.session, labels_layer=lambda: self.labels_layer, image_alive=self._image_alive,
            has_preview=self.has_preview, clear_prompts=self.clear_prompts, set_status=self._set_status,
            on_progress=self._on_progress, on_error=self._on_error)
        layout.addWidget(self.propagate_panel)
        layout.addStretch(1)
        self._update_hint()

    @property
    def model_name(self) -> str:
        """The model chosen: a name, or a file (an adapted decoder's entry shows its name)."""
        return chosen_sam_model(self.model_combo)

    @property
    def stack_order(self) -> list[tuple]:
        """Planes in the order the last stack precompute took them."""
        return self.session.stack_order

    @property
    def last_embed_seconds(self) -> float | None:
        return self.session.last_embed_seconds

    def _update_hint(self) -> None:
        box_model = is_box_trained(self.model_name)
        self.hint_label.setText(
            "This model was trained with boxes: draw a box around each object "
            "(points alone give poor masks)." if box_model else
            "Click an object (SAM positive is selected for you); Shift-N switches to SAM "
            "negative, whose clicks remove a wrong part, and back; or draw a box in SAM boxes.")

    def use_sam_model(self, path: str) -> None:
        """Switch to a checkpoint made elsewhere (Adapt SAM): it joins the model list."""
        index = self.model_combo.findData(path)
        if index < 0 and self.model_combo.findText(path) < 0:
            self.model_combo.insertItem(0, path)
        self.model_combo.setCurrentIndex(index if index >= 0 else self.model_combo.findText(path))
        self._on_model_chosen(0)
        self._set_status(f"model {path}")

    def use_adapted(self, path: str, label: str, note: str) -> None:
        """Switch to a decoder adapted here: it joins the list (``label``, first of the adapted
        ones) and the status line says ``note`` until the next message of the user's work."""
        combo = self.model_combo
        offer_adapted_sam(path, label)  # the other docks' model lists hold it too
        if self._retired:  # closed as it finished: saved and listed, nothing here starts again
            return
        combo.setCurrentIndex(add_adapted_choice(combo, path, label))
        self._on_model_chosen(combo.currentIndex())
        self._keep_status = True
        self._set_status(note)

    def forget_model(self, confirm: bool = True) -> bool:
        """Forget the adapted decoder in use (the Adapt panel's *Forget*): after a yes to the
        question, the annotator goes on with the default model, the decoder leaves every
        model list and its file is deleted (``forget_adapted``). Whether it was forgotten."""
        path = self.model_name
        entry = adapted_entry(path)
        if entry is None or self.adapt_panel.running:
            return False
        label = adapted_label(entry)
        if confirm and QMessageBox.question(
                self, "Forget adapted model",
                f"Delete {label}? Its file is removed from the cache folder and it leaves the model "
                "lists; the labels made with it stay.") != QMessageBox.StandardButton.Yes:
            return False
        default = max(0, self.model_combo.findText(DEFAULT_MODEL))
        self.model_combo.setCurrentIndex(default)  # the session lets go of the file first
        self._on_model_chosen(default)
        forget_adapted(path)
        withdraw_adapted_sam(path)
        self._keep_status = True
        self._set_status(f"forgot {entry['name']} (its file was deleted): annotating with {self.model_name}")
        return True

    def _on_model_chosen(self, _index: int) -> None:
        if not browse_checkpoint(self.model_combo, self):
            return
        self._update_hint()
        select_prompt_tool(self.viewer, self._layers, is_box_trained(self.model_name))  # the model's tool
        self.session.set_model(self.model_name)  # the current object goes: decoded again below
        self.adapt_panel.model_changed()  # Forget: only for an adapted decoder of the user's list
        self._clear_preview()
        self._preload_model()
        self._embed_current()
        self._on_prompts_changed()

    def _preload_model(self) -> None:
        """Load the model in the worker as soon as it is chosen (the dock opens before the
        user drops an image, usually): the first embedding then starts at once, and loading
        (a one-off GUI hiccup in torch's unpickler and Python's collector) is over
        before any interaction. A missing model is reported now, not at the first prompt."""
        def done(seconds):
            if self.image_layer is None:
                self._set_status(f"model {self.model_name} ready ({seconds:.1f} s)")

        self.session.load_async(on_done=done, on_error=self._on_error)

    def _set_status(self, text: str) -> None:
        self._status_text = text
        tiles = self.session.tiles() if self._image_alive() else None
        if tiles is not None and tiles[0] < tiles[1]:
            text = f"{text} · {tiles[0]}/{tiles[1]} tiles"
        self.status.setText(text)

    # -- the image followed -----------------------------------------------------------------
    def _on_active_layer(self, event=None) -> None:
        # follow the active image once napari has finished the change that made it active:
        # adding our prompt layers from inside a layer-list event (a drop, a deletion)
        # nests model changes in napari's layer list, which Qt cannot always survive. A
        # posted event (not a zero-delay timer) runs before napari's first repaint, so the
        # new image is never drawn alone first: on software OpenGL, napari 0.9 crashed on
        # the third "delete every layer, add an image" round when it was (README)
        self._follow.post()

    def _follow_active(self) -> None:
        if self._retired:  # a follow posted before the dock closed
            return
        layer = self.viewer.layers.selection.active
        if isinstance(layer, Image) and layer is not self.image_layer and layer in self.viewer.layers:
            self.set_image_layer(layer)

    def set_image_layer(self, layer: Image) -> None:
        self.image_layer = layer
        self._keep_status = False  # another image: its embedding's messages are its own
        self.image_label.setText(layer.name)
        data = layer.data[0] if getattr(layer, "multiscale", False) else layer.data
        whole = self.session.set_image(data, rgb=bool(layer.rgb))
        self._offer_region(layer, whole)
        self.adapt_panel.refresh()
        if self._region_only:
            self._clear_preview()
            return
        self.session.set_plane(plane_index(layer, self.viewer))
        self._embed_current()  # the tiles first, then the layers (napari's part, the slow one)
        self._ensure_layers()
        self._clear_preview()

    def _offer_region(self, layer, whole: bool) -> None:
        """Too big to annotate whole: say so and offer the region in view."""
        self._region_only = not whole
        self.region_btn.setVisible(self._region_only)
        if whole:
            self._update_hint()
            return
        h, w = spatial_shape(layer)[-2:]
        self.hint_label.setText(
            f"{h} x {w} px is more than the annotator embeds whole ({regions.MAX_PLANE_PX / 2**20:.0f} Mpx). "
            f"Pan and zoom to the part to annotate, then press '{REGION_BUTTON}' (at most "
            f"{regions.REGION_SIDE} px a side). SAM automatic and U-Net predict run the whole image in blocks.")
        self._set_status(f"{layer.name}: {h} x {w} px, too big to annotate whole")

    def annotate_region(self):
        """Add the region in view as an image layer; the dock follows it (it is active)."""
        layer = self.image_layer
        if layer is None or layer not in self.viewer.layers or not too_big(layer):
            return None
        return add_region(self.viewer, layer, region_in_view(self.viewer, layer))

    def _image_alive(self) -> bool:
        """False before an image is chosen and once the user (or closing the viewer)
        removed it: no work is started for an image that is gone."""
        return self.image_layer is not None and self.image_layer in self.viewer.layers and not self._region_only

    def _on_step(self, event=None) -> None:
        if not self._image_alive():
            return
        index = plane_index(self.image_layer, self.viewer)
        if index == self.session.plane:
            # the viewer's dims also move when another layer's extent changes (the first box
            # drawn into an empty box layer, say): same plane, nothing to redo
            return
        self.session.set_plane(index)
        self._clear_preview()
        self._embed_current()
        self._on_prompts_changed()
        self.adapt_panel.refresh()

    def _on_camera(self, event=None) -> None:
        if self._focus_on_view and self._image_alive():  # panned or zoomed before a prompt
            self.session.focus = view_focus(self.viewer, self.image_layer)

    # -- layers -------------------------------------------------------------------------------
    def _ensure_layers(self) -> None:
        lay = self._layers = ensure_layers(self.viewer, self.image_layer)
        self.pos_layer, self.box_layer, self.preview_layer = lay.pos, lay.boxes, lay.preview
        self._connect_prompts(lay)
        select_prompt_tool(self.viewer, lay, is_box_trained(self.model_name))

    def _connect_prompts(self, lay) -> None:
        self._disconnect_prompts(lay)
        for ly in (lay.pos, lay.neg, lay.boxes):
            if ly is not None:
                ly.events.data.connect(self._on_prompts_changed)
                ly.mouse_drag_callbacks.insert(0, self._drag_hold)  # before the tool's own

    def _disconnect_prompts(self, lay) -> None:
        for ly in () if lay is None else (lay.pos, lay.neg, lay.boxes):
            if ly is None:
                continue
            try:
                ly.events.data.disconnect(self._on_prompts_changed)
            except (TypeError, ValueError, RuntimeError):  # not connected (yet)
                logger.debug("prompt layer %r was not connected", ly.name)
            while self._drag_hold in ly.mouse_drag_callbacks:
                ly.mouse_drag_callbacks.remove(self._drag_hold)

    @property
    def neg_layer(self):
        """SAM negative (made again now if the user deleted it)."""
        self._make_rest(labels=False)
        return None if self._layers is None else self._layers.neg

    @property
    def labels_layer(self):
        """``<image> SAM labels`` (made again now if the user deleted it); the session writes
        into its data."""
        self._make_rest(neg=False)
        layer = None if self._layers is None else self._layers.labels
        if layer is not None and self._image_alive():
            self.session.use_labels(layer.data)
        return layer

    def _missing(self) -> list[str]:
        """Which of SAM negative and the labels layer the followed image still lacks."""
        lay = self._layers
        if lay is None or not self._image_alive():
            return []
        return [k for k in ("neg", "labels")
                if getattr(lay, k) is None or getattr(lay, k) not in self.viewer.layers]

    def _make_rest(self, neg: bool = True, labels: bool = True) -> None:
        missing = self._missing()
        if not (neg and "neg" in missing or labels and "labels" in missing):
            return
        self._layers = add_rest(self.viewer, self.image_layer, self._layers, neg=neg, labels=labels)
        self._connect_prompts(self._layers)
        if neg:
            self._layers.neg.mode = "add"

    def _toggle_click_sign(self) -> None:
        self._make_rest(labels=False)
        toggle_click_sign(self.viewer, self._layers)

    # -- embedding ------------------------------------------------------------------------------
    def _embed_current(self) -> bool:
        """Embed the plane on display in the background; True when its tiles are started."""
        if not self._image_alive():
            return False
        self.session.focus, self._focus_on_view = view_focus(self.viewer, self.image_layer), True
        if self.session.is_embedded():
            self._set_status("embedding cached")
            self.session.embed_async()  # only the decoder's warm-up
            return False
        index = self.session.plane
        plane = f", plane {', '.join(map(str, index))}" if index else ""  # () for a 2D image
        self._set_status(f"embedding {short_name(self.image_layer.name)}{plane} (prompts need not wait)")
        # the image's tiles in the background: a new image or slice replaces this job, and a
        # prompt meanwhile embeds only its own view, ahead of it
        key = self.session.key()
        self._embed_job = self.session.embed_async(
            self.batch_spin.value() or None, on_done=lambda s, key=key: self._on_embedded(key, s),
            on_progress=lambda d, t, key=key: self._on_tiles(key, d, t),
            on_cancelled=lambda key=key: self._on_tiles_cancelled(key), on_error=self._on_error)
        return True

    def _on_tiles(self, key: tuple, done: int, total: int) -> None:
        if key != self.session.key():
            return
        self._on_progress(done, total)
        self._set_status(self._status_text)

    def _on_tiles_cancelled(self, key: tuple) -> None:
        if self._image_alive() and key == self.session.key():  # not replaced: the user cancelled
            self._set_status("embedding cancelled")

    def _on_embedded(self, key: tuple, seconds: float) -> None:
        if key != self.session.key():
            return
        n = (self.session.tiles() or (0, 0))[1]
        if self._keep_status:  # say what the switch did, not that its embedding is ready
            self._keep_status = False
            self._set_status(self._status_text)
        else:
            self._set_status(f"embedding ready ({seconds:.2f} s, {n}/{n} tiles)")
        if not self.has_preview() and not self.session.busy("preview"):
            self._on_prompts_changed()  # a prompt whose decode did not come through

    def precompute_stack(self) -> None:
        if not self._image_alive():
            return
        if len(self.session.shape) <= 2:
            self._embed_current()
            return
        from time import perf_counter

        t0 = perf_counter()
        self._set_status("precomputing the stack's slices…")

        def done(n):
            self._set_status(f"stack ready: {n} slices in {perf_counter() - t0:.1f} s")

        self._stack_job = self.session.embed_stack_async(
            self.batch_spin.value() or None, on_done=done, on_progress=self._on_progress,
            on_cancelled=lambda: self._set_status("precompute cancelled"), on_error=self._on_error)

    def cancel(self) -> None:
        n = self.session.cancel()
        self._set_status(f"cancelled {n} job(s)")

    # -- prompts and the current object ---------------------------------------------------------
    def _on_prompts_changed(self, event=None) -> None:
        if self._removing or self._retired:
            return
        action = str(getattr(event, "action", "") or "")
        if action.endswith("ing"):  # "adding"/"changing"/"removing": wait for the final event
            if self.hold_background_s > 0 and self._image_alive():
                # the encoder parks at its next pause point while napari applies the edit,
                # so the decode submitted at the final event starts at once
                self.session.hold_background(self.hold_background_s)
            return
        if not self._image_alive() or self.pos_layer is None:
            return
        index = self.session.plane
        try:
            prompt = current_prompt(self.pos_layer, self._layers.neg, self.box_layer, index)
        except ValueError:
            prompt = None
        if prompt is None:
            self.session.clear()
            self._clear_preview()
            return
        self._focus_on_view = False  # the tiles near the prompt come next
        self.session.multimask = self.multimask.isChecked()
        self.session.request(prompt, on_mask=self._show_mask, on_look=self._show_look,
                             on_error=self._on_preview_error, hold_after=self.hold_background_s)
        self.joint_repaint.start()

    def _show_mask(self, result, final: bool = True) -> None:
        """Paint the current object (the session checked it is not stale)."""
        if not self._image_alive() or self.preview_layer is None:
            return
        index = self.session.plane
        shape = self.preview_layer.data.shape[len(index):]
        paint_preview(self.preview_layer, index, result.full(shape))
        what = "preview" if final else "first look"  # a first look: the full mask follows
        hint = self.session.unsure() if final else None
        self._set_status(f"{what}: {result.area} px, " + (hint or f"predicted IoU {result.predicted_iou:.2f}"))
        self.joint_repaint.finish()
        self._after_repaint.post()  # background embedding goes on once the mask is drawn

    def _show_look(self, result, shown) -> None:
        """A first look (a box's or a first click's mask from a small crop, or a first click's
        from its native tile): ``shown()`` once the window has painted it; the full decode
        waits for that."""
        self._show_mask(result, final=False)
        self._looks_waiting.append(shown)
        self._look_painted.post()  # after the repaint _show_mask asked for

    def _on_look_painted(self) -> None:
        waiting, self._looks_waiting = self._looks_waiting, []
        for shown in waiting:
            shown()

    def _on_preview_error(self, exc: BaseException) -> None:
        self.joint_repaint.finish()
        self.session.release_background()
        self._on_error(exc)

    def _clear_preview(self) -> None:
        self.joint_repaint.finish()
        self.session.release_background()
        if self.preview_layer is not None:
            paint_preview(self.preview_layer, self.session.plane, None)

    def has_preview(self) -> bool:
        return self.session.result is not None

    # -- commit, clear, undo ---------------------------------------------------------------------
    def commit(self) -> list[int]:
        if not self.has_preview() or not self._image_alive():
            self._set_status("nothing to commit: add a prompt and wait for the preview")
            return []
        labels = self.labels_layer
        obj = self.session.commit()
        labels.refresh()
        self.clear_prompts()
        self.adapt_panel.refresh()
        offer = adapt_offer(self.session)  # the recent objects were hard work: suggest adapting
        self._set_status(f"committed object {obj if obj else '(empty)'}" + (f"; {offer}" if offer else ""))
        return [obj] if obj else []

    def clear_prompts(self) -> None:
        if self.image_layer is None:
            return
        lay, index = self._layers, self.session.plane
        self._removing = True  # one clear below, not one per layer
        try:
            for ly in () if lay is None else (lay.pos, lay.neg, lay.boxes):
                remove_on_plane(ly, index)
        finally:
            self._removing = False
        self.session.clear()
        self._clear_preview()

    def undo(self) -> None:
        if self._layers is None or "labels" in self._missing():  # no labels layer: nothing to undo
            self._set_status("nothing to undo")
            return
        labels = self.labels_layer
        ids = self.session.undo()
        labels.refresh()
        self.adapt_panel.refresh()
        self._set_status(f"undid object(s) {ids}" if ids else "nothing to undo")

    def segment_all_boxes(self) -> None:
        if not self._image_alive():
            return
        boxes = boxes_xyxy(self.box_layer, self.session.plane)
        if len(boxes) == 0:
            show_info("Draw one or more boxes in the 'SAM boxes' layer first.")
            return
        from time import perf_counter

        labels, t0 = self.labels_layer, perf_counter()
        self._set_status(f"segmenting {len(boxes)} boxes…")

        def done(ids):
            labels.refresh()
            self.clear_prompts()
            self.adapt_panel.refresh()
            self._set_status(f"committed {len(ids)} objects from {len(boxes)} boxes in {perf_counter() - t0:.2f} s")

        self.session.segment_boxes_async(boxes, on_done=done, on_error=self._on_error)
