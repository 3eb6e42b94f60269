"""A prompt's first look: its mask from a small native crop around it, while the view it is
decoded in is not embedded yet (a box, or a first click whose native tile is not).

On a CPU, a prompt right after a drop outside the tile the background embeds first waits
for a whole view (256 px for the default model: 0.36 s alone on 2 cores, 0.45-0.6 s beside
napari building the new image's layers). A size-agnostic encoder (TinyViT: convolutions and
windowed attention, no absolute position embedding) embeds a 128 px crop in about a third of
that. The decoder reads the crop's embedding (32 x 32 instead of 64 x 64) with the matching
corner of its position grid: the crop lies in the model input as a small image lies in a
padded one, at the top left, with the prompt's coordinates in the same frame.

Held-out nuclei, ``nuclei_sam``, bf16, 2-core Xeon (``benchmarks/crop_look.py``): boxes
(BBBC039's 8 validation fields, 160 tight boxes) mean IoU 0.907 from the crop against the
full view's 0.902, ``dsb2018/`` (125) 0.818 against 0.784, 106 ms instead of 362 ms with
nothing embedded; first clicks 0.855 against the native tile's 0.865 and 0.766 against
0.741, 121 ms instead of 353 ms. LiteMedSAM's boxes 0.730 against 0.791. The full mask still
follows and replaces it (the annotator's first look).
"""
from __future__ import annotations

import numpy as np
import torch

from .decode_call import keep_best, module_outputs, prompt_tensors, render_masks
from .prompt_types import MaskResult, Prompt
from .views import View, prompt_box

SIDE_FRACTION = 2
"""The crop's side is the model input's over this (128 px for a 256 px input)."""

ALIGN = 16
"""Crops start on multiples of this (px): the prompt's centre lies within 8 px of theirs."""

MAX_BOX_FRACTION = 0.75
"""The largest box (its longer side) a crop serves, as a fraction of the crop's side: the
object needs context around it."""


def look_view(box: np.ndarray, shape: tuple[int, int], input_size: int) -> View | None:
    """The native-scale crop (``input_size // SIDE_FRACTION`` px) centred on ``box`` (to
    :data:`ALIGN` px), shifted inside the image; None when the box is too large for it or
    the image smaller."""
    side = input_size // SIDE_FRACTION
    h, w = shape
    x0, y0, x1, y1 = (float(v) for v in box)
    if h < side or w < side or max(x1 - x0, y1 - y0) > MAX_BOX_FRACTION * side:
        return None
    # on a grid of ALIGN px, so a prompt moved by a few pixels reuses the crop's embedding
    top = int(np.clip(round(((y0 + y1) / 2 - side / 2) / ALIGN) * ALIGN, 0, h - side))
    left = int(np.clip(round(((x0 + x1) / 2 - side / 2) / ALIGN) * ALIGN, 0, w - side))
    return View(top, left, side, side, side)


MAX_INPUT = 256
"""The largest model input a look is used for: the 256 px models (``nuclei_sam``,
``lite_medsam`` and decoders tuned on them), where its quality is measured
(``benchmarks/crop_look.py``); MobileSAM's 1024 px input is not."""


def supports_look(engine) -> bool:
    """Whether ``engine`` gains from a crop's look: a size-agnostic encoder with a
    :data:`MAX_INPUT` input, on a CPU (on a GPU a whole view takes milliseconds)."""
    return (engine.policy.device.type == "cpu"
            and getattr(engine.sam.image_encoder, "size_agnostic", False)
            and engine.input_size <= MAX_INPUT)


def crop_look(engine, image, prompt: Prompt, multimask: bool = False) -> MaskResult | None:
    """The mask of ``prompt`` (a box, or points: a first click; no mask input) from
    :func:`look_view`'s crop around it (embedded and cached like any view), or None where no
    crop serves it. ``image``: a prepared image. ``multimask``: the best of the decoder's
    candidates (a first click), as :meth:`.predictor.SamEngine.predict` takes it.
    The result keeps no logits (``low_res`` None): a click added while it is on display
    starts over rather than refine a mask of another view size."""
    if prompt.mask_input is not None or (prompt.box is None) == (prompt.points is None):
        return None
    prompt.check_inside(image.shape)  # what SamEngine.predict refuses, refused here too
    view = look_view(prompt_box(prompt.points, prompt.box), image.shape, engine.input_size)
    if view is None:
        return None
    emb = engine.embedding(image, view)
    side = emb.shape[-1]
    dev = engine.policy.device
    points, boxes, _masks, _roi = prompt_tensors(view, [prompt], dev, engine.input_size, side)
    with torch.inference_mode(), engine.policy.autocast():
        sparse, dense = engine.sam.prompt_encoder(points=points, boxes=boxes, masks=None)
        low_res, iou = module_outputs(engine.sam, dev, emb, sparse, dense[..., :side, :side],
                                      engine.candidates if multimask else "single", side=side)
    chosen, scores = keep_best(low_res.float(), iou.float(), multimask, engine.click_output,
                               engine.blend_for(multimask))
    chosen = engine.first_click_logits(chosen, multimask)
    mask = render_masks(chosen, view, engine.MASK_RENDER_BYTES)[0]
    return MaskResult(mask, view.y0, view.x0, float(scores[0]), None, view,
                      iou.float().cpu().numpy()[0])
