"""Fine-tuned SAM decoders: a small checkpoint that holds only what changed.

A decoder checkpoint is a plain dict (``format: napari-gpuseg-sam-decoder``) with the
prompt encoder's and mask decoder's tensors (floats stored as fp16: about 8 MB for SAM's
4 M decoder parameters), the base model it was trained on (registry name and sha256 of
that checkpoint), and training facts (config, data, metrics). It loads with
``torch.load(..., weights_only=True)``; :func:`apply_decoder` checks every key against the
base network and names what does not match. Pure torch: no engine, no Qt.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from ..checkpoint import CheckpointError, compare_state_dict, mismatch_summary, safe_torch_load

FORMAT = "napari-gpuseg-sam-decoder"
PARTS = ("prompt_encoder", "mask_decoder")


def decoder_state(sam: nn.Module, dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """The prompt encoder's and mask decoder's state, floats cast to ``dtype``, on the CPU."""
    out = {}
    for part in PARTS:
        for k, v in getattr(sam, part).state_dict().items():
            v = v.detach().to("cpu")
            out[f"{part}.{k}"] = v.to(dtype) if v.is_floating_point() else v.clone()
    return out


def save_decoder(path: str | os.PathLike, sam: nn.Module, base: str, base_sha256: str | None,
                 **meta: Any) -> Path:
    """Write ``sam``'s decoder as a decoder checkpoint at ``path`` (atomically: a temp file
    in the same folder, then a rename). ``meta`` (plain types) is stored alongside."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"format": FORMAT, "version": 1, "base": str(base), "base_sha256": base_sha256,
           "arch": str(getattr(sam, "arch", "")), "image_size": int(getattr(sam, "image_size", 0)),
           "state": decoder_state(sam), **meta}
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(doc, fh)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as a plain open() would create it (mkstemp makes 0600)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def is_decoder_checkpoint(obj: Any) -> bool:
    return isinstance(obj, Mapping) and obj.get("format") == FORMAT


def read_decoder(path: str | os.PathLike) -> dict:
    """A decoder checkpoint as a dict (``weights_only=True``); :class:`CheckpointError`
    when the file is another kind of checkpoint."""
    doc = safe_torch_load(path, map_location="cpu")
    if not is_decoder_checkpoint(doc):
        raise CheckpointError(f"{path} is not a SAM decoder checkpoint (format {FORMAT!r})")
    return doc


def apply_decoder(sam: nn.Module, doc: Mapping) -> nn.Module:
    """Load a decoder checkpoint's tensors into ``sam`` (strict: every prompt encoder and
    mask decoder key, same shapes). Marks the network ``decoder_tuned``."""
    state = doc["state"]
    arch = doc.get("arch")
    if arch and getattr(sam, "arch", arch) != arch:
        raise CheckpointError(f"decoder was trained on a {arch} model, not {sam.arch}")
    for part in PARTS:
        module = getattr(sam, part)
        prefix = part + "."
        sub = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        missing, unexpected, mismatched = compare_state_dict(module, sub)
        if missing or unexpected or mismatched:
            raise CheckpointError(f"decoder checkpoint does not fit the {part}: "
                                  + mismatch_summary(missing, unexpected, mismatched),
                                  missing, unexpected, mismatched)
        ref = module.state_dict()
        module.load_state_dict({k: v.to(ref[k].dtype) for k, v in sub.items()}, strict=True)
    sam.decoder_tuned = True
    sam.click_zoom = float(doc.get("click_zoom", 1.0))  # the scale its clicks were trained at
    sam.decoder_base = doc.get("base")
    return sam
