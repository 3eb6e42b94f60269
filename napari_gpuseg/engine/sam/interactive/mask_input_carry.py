"""Carrying a mask input into another view: a corrective click after a first mask that won
at native scale is decoded in the finer click view the decoder learned clicks at, with the
previous logits resampled there (measured: docs/benchmarks.md, *Clicks*). No Qt, no napari."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
import torch.nn.functional as F

from .prompt_types import Prompt
from .views import View, route_click


def carry_logits(low_res: torch.Tensor, src: View, dst: View) -> torch.Tensor:
    """(L, L) low-res logits of view ``src`` -> the same mask as (L, L) logits of view
    ``dst`` (another scale or crop of the image), sampled bilinearly at the image position
    of each of ``dst``'s cells. Cells outside ``src``'s image region get ``low_res``'s
    minimum (background), so a mask input carried into a larger view adds nothing there."""
    n = low_res.shape[-1]
    src_h, src_w = src.resized_hw
    dst_h, dst_w = dst.resized_hw
    centres = (torch.arange(n, dtype=torch.float64) + 0.5) * dst.input_size / n  # dst input px
    # dst input px -> image px -> src input px
    ys = (dst.y0 + centres * dst.h / dst_h - src.y0) * src_h / src.h
    xs = (dst.x0 + centres * dst.w / dst_w - src.x0) * src_w / src.w
    gy, gx = torch.meshgrid(2 * ys / src.input_size - 1, 2 * xs / src.input_size - 1, indexing="ij")
    grid = torch.stack([gx, gy], -1)[None].to(low_res.device, torch.float32)
    fill = low_res.float().amin()
    out = F.grid_sample((low_res.float() - fill)[None, None], grid, mode="bilinear",
                        padding_mode="zeros", align_corners=False)[0, 0] + fill
    inside = ((ys >= 0) & (ys <= src_h))[:, None] & ((xs >= 0) & (xs <= src_w))[None, :]
    return torch.where(inside.to(out.device), out, fill)


def into_click_view(prompt: Prompt, click_views: list[View]) -> Prompt:
    """A corrective click (points and a mask input with logits, no box) refining a mask
    decoded outside ``click_views``, carried into the click view holding its points and
    that mask, its mask input's logits resampled there (:func:`carry_logits`); the prompt
    itself otherwise (no such view, or nothing to carry)."""
    prev = prompt.mask_input
    if (prev is None or prev.low_res is None or prompt.box is not None or prompt.points is None
            or not click_views or prev.view in click_views):
        return prompt
    held = prompt.points
    ys, xs = np.nonzero(prev.mask)
    if len(ys):  # the view must hold the previous mask as well as the points
        corners = np.array([[xs.min(), ys.min()], [xs.max(), ys.max()]], float) + [prev.x0, prev.y0]
        held = np.concatenate([held, corners])
    view = route_click(held, click_views)
    if view is None:
        return prompt
    # the carried mask input keeps its image-space mask (y0, x0); only its logits and view
    # change, and it is never returned to the caller
    carried = replace(prev, low_res=carry_logits(prev.low_res, prev.view, view), view=view)
    return replace(prompt, mask_input=carried)
