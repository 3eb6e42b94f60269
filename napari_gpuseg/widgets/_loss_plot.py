"""The live training plot of the U-Net train and adapt docks: the train loss of every
iteration and, where the dock validates, the validation score of every epoch."""
from __future__ import annotations

from ._plot import HistoryPlot

TRAIN_LOSS, VAL_SCORE = "train loss", "val score"


class LossPlot(HistoryPlot):
    """A :class:`HistoryPlot` fed with training events (``engine.unet.training.TrainEvent``)."""

    def __init__(self, validation: bool = True, maxlen: int = 400, parent=None):
        super().__init__((TRAIN_LOSS, VAL_SCORE) if validation else (TRAIN_LOSS,), maxlen=maxlen, parent=parent)

    def add_event(self, ev) -> None:
        """Plot one event: its train loss ("iter" events) or validation score (epoch events
        that carry one; ignored without a validation series)."""
        if ev.kind == "iter":
            self.append(**{TRAIN_LOSS: ev.train_loss})
        elif ev.val_score is not None:
            self.append(**{VAL_SCORE: ev.val_score})
