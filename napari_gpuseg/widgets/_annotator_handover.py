"""The annotator's handover of a new image's first tile to the second encoder process
(engine/sam/encoder_process.py), and the measurement of the window's work after a drop that
decides whether that process is used (engine/sam/encoder_slot.py, ``worth_it``)."""
from __future__ import annotations

import time

HANDOVER_WAIT_S = 0.1
"""At most this long, after a drop, the GUI thread waits for the worker to hand the first
tile to the second encoder process before it builds the new layers: the worker's Python
(preparing the image) then runs without waiting for the interpreter lock, and the tile
starts that much sooner."""


class FirstTileHandover:
    """Mixin of the SAM annotator: follows a drop by starting the tiles, then the layers."""

    def _embed_then_layers(self) -> None:
        """Start the new image's tiles, then make the prompt layers (the slow part of
        following a new image, napari's). With a second encoder process ready, the GUI thread
        first waits (at most ``handover_wait_s``) for the worker to hand it the first tile.
        The window's work after the drop is measured for ``worth_it``
        (engine/sam/encoder_slot.py): from the new layer's activation to the first repaint
        with the layers made, the wait not counted. It is what delays a tile embedded here,
        so a drop whose tile went to the second process (and left the window less to contend
        with) only gives a first estimate."""
        slot = self._encoder_slot
        slot.defer_start()  # a process still starting waits for idle time
        elsewhere = slot.offload(self.model_name) is not None
        handover = slot.handover(self.model_name) if self.handover_wait_s > 0 else None
        t_wait = time.perf_counter()
        if self._embed_current() and handover is not None:
            handover.wait(self.handover_wait_s)
        waited = time.perf_counter() - t_wait
        self._ensure_layers(rest=False)  # the others once a first prompt has its mask
        noticed, self._drop_noticed = self._drop_noticed, None
        if noticed is not None:
            self._followed = (noticed, waited, elsewhere)
            self._painted.post()

    def _on_followed_painted(self) -> None:
        followed, self._followed = self._followed, None
        slot = self._encoder_slot
        if followed is not None:
            noticed, waited, elsewhere = followed
            if not elsewhere or slot.window_seconds is None:
                slot.window_seconds = time.perf_counter() - noticed - waited
