"""How a new prompt relates to the object on display: a refinement of it (one more click, the
shown mask's logits as mask input) or a new start. No Qt, no napari."""
from __future__ import annotations

import numpy as np

from ..sam.interactive.prompt_types import Prompt


def follow_up(prompt: Prompt, previous: Prompt | None, result) -> Prompt:
    """``prompt`` as a refinement of ``previous`` when it is ``previous`` plus one click
    (same box or none): the points keep click order and ``result`` (the mask shown for
    ``previous``) goes back as mask input, so the click corrects that mask instead of
    starting over. Any other change (a point moved or deleted, a new box) starts over.
    A previous mask from a box prompt is not fed back (it was decoded near its box only)."""
    if (previous is None or result is None or getattr(result, "low_res", None) is None
            or prompt.points is None or previous.box is not None):
        return prompt
    if prompt.box is not None:
        return prompt
    prev_pts = previous.points if previous.points is not None else np.zeros((0, 2))
    prev_labels = previous.labels if previous.labels is not None else np.zeros(0, int)
    if len(prompt.points) != len(prev_pts) + 1:
        return prompt
    left = list(range(len(prompt.points)))
    for pt, lab in zip(prev_pts, prev_labels):
        match = next((i for i in left if prompt.labels[i] == lab
                      and np.allclose(prompt.points[i], pt)), None)
        if match is None:
            return prompt
        left.remove(match)
    new = left[0]
    return Prompt(points=np.concatenate([prev_pts, prompt.points[new:new + 1]]),
                  labels=np.append(prev_labels, prompt.labels[new]), mask_input=result)


def prompt_focus(prompt: Prompt) -> tuple[float, float]:
    """The (x, y) a prompt is about: its box centre, or the mean of its positive points."""
    if prompt.box is not None:
        b = prompt.box
        return float(b[0] + b[2]) / 2, float(b[1] + b[3]) / 2
    pos = prompt.points[prompt.labels == 1]
    pts = pos if len(pos) else prompt.points
    return float(pts[:, 0].mean()), float(pts[:, 1].mean())


def is_first_look_prompt(prompt: Prompt, multimask: bool) -> bool:
    """Whether a quick first mask can come before the full decode: an object's first click
    (best of the candidates) or a box alone, neither refining a shown mask."""
    if prompt.mask_input is not None:
        return False
    first_click = multimask and prompt.box is None
    first_box = prompt.box is not None and prompt.points is None
    return first_click or first_box
