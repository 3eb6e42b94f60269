"""The SAM annotator's preview: a decode's mask shown (or dropped when stale), and how a
click follows up the mask on display."""
from __future__ import annotations

from ._prompts import follow_up


class PreviewDisplay:
    """Mixed into :class:`~.sam_annotator.SamAnnotatorWidget`."""

    def _on_preview_error(self, exc: BaseException) -> None:
        self.redraw.release()
        self.worker.release_background()
        self._on_error(exc)

    def _follow_up(self, prompt, index: tuple):
        """(prompt, multimask): a click added to the shown mask's prompt refines that mask
        (its logits go back as mask input); an object's first click takes the best of
        the candidate masks (the "best of the candidates" box); anything else starts over."""
        shown = self._preview
        if shown is not None and shown[0] is self.image_layer and shown[1] == index:
            refined = follow_up(prompt, self._preview_prompt, shown[3])
            if refined is not prompt:
                return refined, False
        one_click = prompt.box is None and prompt.points is not None and len(prompt.points) == 1
        return prompt, one_click and self.multimask.isChecked()

    def _show_preview(self, layer, index, generation, result, prompt=None, final: bool = True) -> None:
        if layer is not self.image_layer or generation != self._generation:
            return  # stale: the image, slice or prompts changed since
        if not final and self._preview is not None and self._preview[2] == generation:
            return  # a first look after the full decode: never replaces it
        self._preview = (layer, index, generation, result)
        self._preview_prompt = prompt
        data = self.preview_layer.data
        target = data[index] if index else data
        if index:
            data[...] = 0
        target[...] = result.full(target.shape)
        self.preview_layer.refresh()
        what = "preview" if final else "first look"  # a first look: the full mask follows
        self._set_status(f"{what}: {result.area} px, predicted IoU {result.score:.2f}")
        self.redraw.release()
        self._after_repaint.post()  # background embedding goes on once the mask is drawn
        self._rest_soon()

    def _show_first_look(self, layer, index, generation, result, prompt, look) -> None:
        """A first look (``result``: a box's or a first click's mask from a small crop, or a
        first click's from its native tile; None: nothing to show, and the job has set
        ``look`` already). ``look`` is set once the window has painted the mask: the
        full decode waits for that (``_annotator_jobs.wait_painted``)."""
        if result is None:
            look.set()
            return
        self._show_preview(layer, index, generation, result, prompt, final=False)
        self._looks_waiting.append(look)
        self._look_painted.post()  # after the repaint _show_preview asked for

    def _on_look_painted(self) -> None:
        waiting, self._looks_waiting = self._looks_waiting, []
        for look in waiting:
            look.set()

    def _clear_preview(self) -> None:
        self._preview = self._preview_prompt = None
        self.redraw.release()
        self.worker.release_background()
        if self.preview_layer is not None and self.preview_layer.data.any():
            self.preview_layer.data[...] = 0
            self.preview_layer.refresh()

    def has_preview(self) -> bool:
        return self._preview is not None
