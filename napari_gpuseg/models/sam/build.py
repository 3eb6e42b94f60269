# Derived from segment-anything (Meta Platforms, Inc. and affiliates, Apache-2.0);
#   MobileSAM (Apache-2.0); LiteMedSAM (Apache-2.0).
# Licence texts: LICENSES/; details: NOTICE. Modifications: BSD-3-Clause, see LICENSE.
"""Build the SAM family by architecture name and load checkpoints into it strictly."""
from __future__ import annotations

import os
from typing import Mapping, Optional, Union

import torch

from ..state_dict_loading import CheckpointError, describe_source, compare_state_dict, mismatch_summary, read_state_dict
from .image_encoder import ImageEncoderViT
from .mask_decoder import MaskDecoder
from .prompt_encoder import PromptEncoder
from .sam import SAM_PIXEL_MEAN, SAM_PIXEL_STD, Sam
from .tiny_vit import TinyViT
from .transformer import TwoWayTransformer

PROMPT_EMBED_DIM = 256

_VIT = {
    # embed_dim, depth, heads, global attention blocks (official configs)
    "vit_b": (768, 12, 12, (2, 5, 8, 11)),
    "vit_l": (1024, 24, 16, (5, 11, 17, 23)),
    "vit_h": (1280, 32, 16, (7, 15, 23, 31)),
}
ARCHS = ("vit_b", "vit_l", "vit_h", "vit_t", "lite_medsam")
DEFAULT_IMAGE_SIZE = {"vit_b": 1024, "vit_l": 1024, "vit_h": 1024, "vit_t": 1024, "lite_medsam": 256}
# input pixels per embedding pixel
_REDUCTION = {"vit_b": 16, "vit_l": 16, "vit_h": 16, "vit_t": 16, "lite_medsam": 4}


def _check_arch(arch: str) -> str:
    if arch not in ARCHS:
        raise ValueError(f"unknown SAM architecture {arch!r}; expected one of {ARCHS}")
    return arch


def build_sam(arch: str, image_size: Optional[int] = None, attn_impl: str = "auto") -> Sam:
    """A randomly initialised SAM of architecture ``arch`` (eval mode).

    arch: ``"vit_b" | "vit_l" | "vit_h" | "vit_t" | "lite_medsam"``.
    image_size: encoder input side in px (default: 1024, LiteMedSAM 256); must be a
    multiple of 16 (ViT/vit_t) or 4 (LiteMedSAM). Official weights need the default.
    attn_impl: ViT attention kernel (``"auto" | "math" | "sdpa" | "sdpa_decomposed"``).
    """
    _check_arch(arch)
    size = int(image_size or DEFAULT_IMAGE_SIZE[arch])
    red = _REDUCTION[arch]
    if size % red:
        raise ValueError(f"image_size for {arch} must be a multiple of {red}, got {size}")
    grid = size // red
    if arch in _VIT:
        dim, depth, heads, glob = _VIT[arch]
        encoder = ImageEncoderViT(
            img_size=size,
            patch_size=16,
            embed_dim=dim,
            depth=depth,
            num_heads=heads,
            mlp_ratio=4.0,
            out_chans=PROMPT_EMBED_DIM,
            qkv_bias=True,
            use_rel_pos=True,
            window_size=14,
            global_attn_indexes=glob,
            attn_impl=attn_impl,
        )
    else:
        lite = arch == "lite_medsam"
        encoder = TinyViT(
            img_size=size,
            embed_dims=(64, 128, 160, 320),
            depths=(2, 2, 6, 2),
            num_heads=(2, 4, 5, 10),
            window_sizes=(7, 7, 14, 7),
            patch_embed="conv1x1" if lite else "conv3x3",
            num_classes=0 if lite else 1000,
            out_chans=PROMPT_EMBED_DIM,
        )
    prompt_encoder = PromptEncoder(
        embed_dim=PROMPT_EMBED_DIM,
        image_embedding_size=(grid, grid),
        input_image_size=(size, size),
        mask_in_chans=16,
    )
    mask_decoder = MaskDecoder(
        num_multimask_outputs=3,
        transformer=TwoWayTransformer(depth=2, embedding_dim=PROMPT_EMBED_DIM, mlp_dim=2048, num_heads=8),
        transformer_dim=PROMPT_EMBED_DIM,
        iou_head_depth=3,
        iou_head_hidden_dim=256,
    )
    if arch == "lite_medsam":
        mean, std, norm = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0), "minmax"
    else:
        mean, std, norm = SAM_PIXEL_MEAN, SAM_PIXEL_STD, "sam"
    sam = Sam(encoder, prompt_encoder, mask_decoder, mean, std, arch=arch, normalization=norm)
    return sam.eval()


def infer_arch(state: Mapping[str, torch.Tensor]) -> Optional[str]:
    """Guess the architecture of a (unwrapped) SAM state dict from key names and shapes."""
    w = state.get("image_encoder.patch_embed.proj.weight")
    if w is not None:
        return {768: "vit_b", 1024: "vit_l", 1280: "vit_h"}.get(int(w.shape[0]))
    w = state.get("image_encoder.patch_embed.seq.0.c.weight")
    if w is not None:
        return {3: "vit_t", 1: "lite_medsam"}.get(int(w.shape[-1]))
    return None


def infer_image_size(state: Mapping[str, torch.Tensor], arch: str) -> int:
    """Encoder input size stored in a ViT state dict (``pos_embed``); defaults otherwise."""
    pos = state.get("image_encoder.pos_embed")
    if arch in _VIT and pos is not None:
        return int(pos.shape[1]) * 16
    return DEFAULT_IMAGE_SIZE[arch]


def _build_for_state(arch: str, size: int, attn_impl: str, state: Mapping[str, torch.Tensor], owned: bool,
                     hint: str, describe: str) -> Sam:
    """``arch`` holding the weights of ``state``, without the random initialisation the
    checkpoint would overwrite (TinyViT's ``trunc_normal_`` alone took about 1.6 s of every
    LiteMedSAM load; ``benchmarks/model_load.py``): the modules are built on the meta device
    (shapes only), checked strictly against ``state``, then given its tensors
    (``load_state_dict(assign=True)``), cast to the model's dtypes. ``owned``: the tensors
    were read for this model and may become its weights; else they are copied, so the
    caller's mapping never shares memory with the model. The non-persistent buffers
    (``pixel_mean``, TinyViT's bias indices) are made on the CPU at construction."""
    with torch.device("meta"):
        model = build_sam(arch, image_size=size, attn_impl=attn_impl)
    missing, unexpected, mismatched = compare_state_dict(model, state)
    if missing or unexpected or mismatched:
        msg = (f"checkpoint {describe} does not fit {type(model).__name__}: "
               + mismatch_summary(missing, unexpected, mismatched))
        raise CheckpointError(msg + (f". {hint}" if hint else ""), missing, unexpected, mismatched)
    own = model.state_dict()
    weights = {}
    for key, ref in own.items():
        t = state[key]
        weights[key] = t.to(ref.dtype, copy=True) if not owned or t.dtype != ref.dtype else t
    model.load_state_dict(weights, strict=True, assign=True)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:  # a tensor neither in the checkpoint nor made on a real device
        raise RuntimeError(f"SAM {arch}: no values for {', '.join(left[:5])} after loading")
    return model


def load_sam(
    arch: Optional[str],
    checkpoint_path: Union[str, os.PathLike, Mapping[str, torch.Tensor]],
    device: Union[str, torch.device] = "cpu",
    attn_impl: str = "auto",
    image_size: Optional[int] = None,
) -> Sam:
    """Build ``arch`` (``None``: infer it from the checkpoint) and load the checkpoint strictly.

    The file is read with ``torch.load(map_location="cpu", weights_only=True)``; the
    model is moved to ``device`` and returned in eval mode. Raises
    :class:`~napari_gpuseg.models.state_dict_loading.CheckpointError` naming what did not match.
    """
    state = read_state_dict(checkpoint_path, map_location="cpu")
    guessed = infer_arch(state)
    if arch is None:
        if guessed is None:
            raise CheckpointError(
                "cannot tell which SAM architecture this checkpoint is for (no SAM image-encoder "
                f"keys found; first keys: {', '.join(list(state)[:5])}). Pass arch= explicitly."
            )
        arch = guessed
    _check_arch(arch)
    size = image_size or infer_image_size(state, arch)
    hint = f"This looks like a {guessed!r} checkpoint, not {arch!r}" if guessed and guessed != arch else ""
    model = _build_for_state(arch, size, attn_impl, state, owned=not isinstance(checkpoint_path, Mapping), hint=hint,
                             describe=describe_source(checkpoint_path))
    # inference weights: no grad, so autocast does not keep low-precision weight copies
    return model.requires_grad_(False).to(device).eval()
