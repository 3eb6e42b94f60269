"""Pause points all through a SAM image encoder: a queued prompt waits a fraction of a block.

The annotator embeds an image in a background worker job; :func:`worker.pause_point` lets a
prompt (or a cancel) in between two modules, so the encoder's forward pass is cut into about
a hundred pieces instead of being one uninterruptible call. A prompt whose own view is the
one being computed is better served when that view is done (:func:`waits_for_encoder`).
"""
from __future__ import annotations

import re

import torch

from ...runtime.worker import pause_point
from .inputs import PreparedImage

# before each block, its attention (and its qkv / output projections), MLP (and its layers),
# convolutions and activations (a GELU fused into its convolution or linear layer has none of
# its own), each band of rows of an MBConv block run band by band (``rows``), each
# downsampling and its layers, each layer of the neck and of the patch embedding: about 110
# points per TinyViT forward (at 256 px the MBConv stage and the neck run on large maps), so
# a queued prompt waits a fraction of a block
_PAUSE_AT = re.compile(
    r"(^|\.)(blocks\.\d+(\.(attn|mlp|local_conv|conv\d|act\d|rows|(attn|mlp)\.\w+))?"
    r"|downsample(\.\w+)?|neck(\.\d+)?|patch_embed(\.seq\.\d+)?)$")


def pause_modules(encoder: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules a pause point comes before (see :data:`_PAUSE_AT`)."""
    return [module for name, module in encoder.named_modules() if _PAUSE_AT.search(name)]


def add_pause_points(encoder: torch.nn.Module) -> None:
    """Call :func:`worker.pause_point` all through the encoder, so queued prompts are
    answered (and a cancel takes effect) within a fraction of a block, not after a batch."""
    if getattr(encoder, "_gpuseg_pause_points", False):
        return
    for module in pause_modules(encoder):
        module.register_forward_pre_hook(lambda _m, _a: pause_point())
    encoder._gpuseg_pause_points = True


def waits_for_encoder(engine, image, prompt) -> bool:
    """True while ``engine``'s encoder is computing a view ``prompt`` is decoded in, in a
    call a pause point interrupted (ask in the worker thread): the prompt is served sooner
    once that view is done than by embedding it again at the pause point (``Job.defer``)."""
    if not engine._encoding or not isinstance(image, PreparedImage):
        return False
    views = {engine.route(image, engine._into_click_view(image, prompt))}  # as predict routes it
    if prompt.mask_input is None and prompt.box is None and prompt.points is not None:
        views.add(engine.route(image, prompt, zoom=False))  # a first click tries both scales
    return engine.is_encoding(image, list(views))
