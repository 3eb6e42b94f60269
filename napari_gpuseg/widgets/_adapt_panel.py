"""Adapt panel of the SAM annotator: "Adapt to these objects" adapts the model's decoder to
the objects committed on the image (``engine.annotate.adapting.SessionAdaptation``) in the
training thread, with a live loss, Cancel and a time budget; once done the annotator
annotates on with the adapted decoder, which joins its model list. "Forget" takes the
adapted decoder in use off the list and deletes its file. The panel only wires the buttons
and the plot: what is learnt from, the training, the saving and the forgetting are the
engine's."""
from __future__ import annotations

from qtpy.QtWidgets import QDoubleSpinBox, QFormLayout, QGroupBox, QHBoxLayout, QPushButton

from ..engine.annotate.adapting import MIN_OBJECTS, SessionAdaptation, adapt_blocker
from ..engine.sam.training.adapt import FEW_OBJECT_VISITS, adapted_entry
from ..engine.runtime.cancel import CancelToken
from ._bridge import on_gui, submit
from ._choices import adapted_label, image_file
from ._plot import HistoryPlot
from ._unet_jobs import train_worker

LOSS = "train loss"
DEFAULT_MINUTES = 4.0
PLOT_STEPS = 120  # the plot spans the last this many steps (a CPU makes tens in a few minutes)
READY_TIP = ("Train SAM's decoder on the objects committed on this image (a copy of the model: "
             "annotating goes on meanwhile), then annotate with it. Kept in the model list.")


class AdaptPanel(QGroupBox):
    """Takes what it uses of the annotator as arguments: ``session``, ``image_layer()`` (the
    layer on display), ``image_alive()``, ``set_status(text)``, ``on_progress(done, total)``,
    ``on_error(exc)``, ``use_adapted(path, label, message)`` (switch the annotator to the
    adapted decoder) and ``forget()`` (take the adapted decoder in use off the list)."""

    def __init__(self, session, *, image_layer, image_alive, set_status, on_progress, on_error,
                 use_adapted, forget, parent=None):
        super().__init__("Adapt to these objects", parent)
        self.session = session
        self._image_layer, self._image_alive = image_layer, image_alive
        self._set_status, self._on_progress, self._on_error = set_status, on_progress, on_error
        self._use_adapted, self._forget = use_adapted, forget
        self.job = None
        self._mine: dict | None = None  # the list's entry of the model in use (Forget), if adapted
        self._token: CancelToken | None = None
        self.adaptation: SessionAdaptation | None = None
        self.result = None  # the last AdaptResult that saved a decoder
        self.minutes = QDoubleSpinBox()
        self.minutes.setRange(0.5, 60.0)
        self.minutes.setSingleStep(0.5)
        self.minutes.setDecimals(1)
        self.minutes.setValue(DEFAULT_MINUTES)
        self.minutes.setSuffix(" min")
        self.minutes.setToolTip("At most this much training (embedding the image is not counted). "
                                f"Adapting shows each object {FEW_OBJECT_VISITS} times, which ends sooner "
                                "on a GPU; when the time runs out first, the decoder trained so far is kept")
        self.adapt_btn = QPushButton("Adapt to these objects")
        self.cancel_btn = QPushButton("Cancel")
        self.cancel_btn.setToolTip("Stop adapting: the model stays as it was, nothing is saved")
        self.cancel_btn.setEnabled(False)
        self.forget_btn = QPushButton("Forget")
        self.adapt_btn.clicked.connect(self.adapt)
        self.cancel_btn.clicked.connect(self.cancel)
        self.forget_btn.clicked.connect(lambda: self._forget())
        self.plot = HistoryPlot((LOSS,), maxlen=PLOT_STEPS)
        self.plot.setVisible(False)  # shown from the first run on
        form = QFormLayout(self)
        form.addRow("Time budget", self.minutes)
        row = QHBoxLayout()
        row.addWidget(self.adapt_btn)
        row.addWidget(self.cancel_btn)
        row.addWidget(self.forget_btn)
        form.addRow(row)
        form.addRow(self.plot)
        self.model_changed()

    @property
    def running(self) -> bool:
        return self.job is not None

    def model_changed(self) -> None:
        """The annotator switched models: whether *Forget* applies is asked of the user's list
        once here, not at every refresh (commits, undo, each step through a stack)."""
        self._mine = adapted_entry(self.session.model)
        self.refresh()

    def refresh(self) -> None:
        """Enable the button when the image has enough committed objects; the tooltip says why not."""
        why = "adapting now" if self.running else (
            adapt_blocker(self.session, MIN_OBJECTS) if self._image_alive() else "open an image first")
        self.adapt_btn.setEnabled(why is None)
        self.adapt_btn.setToolTip(READY_TIP if why is None else f"Not now: {why}.")
        self.cancel_btn.setEnabled(self.running)
        self.minutes.setEnabled(not self.running)
        mine = self._mine
        self.forget_btn.setEnabled(mine is not None and not self.running)
        self.forget_btn.setToolTip(
            "Not now: adapting now" if self.running
            else f"Delete {mine['name']}, the adapted model in use, and take it off the model lists" if mine
            else "Not now: the model in use is not one of your adapted models")

    # -- the job ------------------------------------------------------------------------------
    def adapt(self):
        """Start adapting to the objects committed on the image on display; the job, or None
        (with the reason in the status line)."""
        if self.running or not self._image_alive():
            return None
        layer = self._image_layer()
        try:
            self.adaptation = SessionAdaptation(self.session, self.minutes.value(),
                                                image_name=image_file(layer) or layer.name)
        except ValueError as exc:
            self._set_status(str(exc))
            return None
        self.plot.clear()
        self.plot.setVisible(True)
        self._on_progress(0, 1)
        self._set_status(f"adapting to {self.adaptation.objects} objects: embedding the image…")
        worker = train_worker()
        # a token of its own, not the job's: a cancel that comes as training ends still gets
        # the job's result (saved, or not), never a "cancelled" for a decoder that was saved
        self._token = CancelToken()
        self.job = submit(self.adaptation.run, worker=worker, inference=False, owner=self,
                          on_result=self._done, on_error=self._failed, on_progress=self._on_progress,
                          on_cancelled=self._cancelled, on_event=on_gui(self._on_event, self),
                          cancel=self._token, policy=worker.policy)
        self.refresh()
        return self.job

    def cancel(self) -> None:
        if self.job is not None:
            self._token.cancel()
            self._set_status("cancelling the adaptation…")

    def _on_event(self, ev) -> None:
        if self.job is None:
            return
        self.plot.append(**{LOSS: ev.loss})
        budget = 60.0 * self.adaptation.minutes
        self._set_status(f"adapting: step {ev.step} of {ev.total}, loss {ev.loss:.3f} "
                              f"({ev.seconds:.0f} s; at most {budget:.0f} s)")

    def _done(self, result) -> None:
        self.job = None
        if result.path is None:
            self._cancelled()
            return
        self.result = result
        label = adapted_label({"name": result.name, "image": self.adaptation.image_name})
        self._use_adapted(result.path, label,
                              f"adapted to {result.objects} objects ({result.steps} steps, "
                              f"{result.seconds:.0f} s): annotating with {result.name} now")
        self.refresh()

    def _cancelled(self) -> None:
        self.job = None
        self._set_status("adapting cancelled: the model is unchanged, nothing was saved")
        self.refresh()

    def _failed(self, exc: BaseException) -> None:
        self.job = None
        self.refresh()
        self._on_error(exc)
