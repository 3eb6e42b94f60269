"""Fine-tuned SAM decoders: a small checkpoint that holds only what changed.

A decoder checkpoint is a plain dict (``format: napari-gpuseg-sam-decoder``) with the
prompt encoder's and mask decoder's tensors (floats stored as fp16: about 8 MB for SAM's
4 M decoder parameters), the base model it was trained on (registry name and sha256 of
that checkpoint), and training facts (config, data, metrics). It may also carry tuned
tensors of the base's image encoder (keys ``image_encoder.*``, e.g. TinyViT's last stage
and neck, :data:`ENCODER`): those replace the base's, and the network then names its
encoder by a digest of them (``encoder_id``), so that no embedding of the base's own encoder
is ever served for it. It loads with
``torch.load(..., weights_only=True)``; :func:`check_decoder` refuses malformed fields and
non-finite weights, :func:`check_base` a base of another architecture or hash, and
:func:`apply_decoder` checks every key against the base network and names what does not
match. Pure torch: no engine, no Qt.
"""
from __future__ import annotations

import hashlib
import math
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from ..state_dict_loading import CheckpointError, compare_state_dict, mismatch_summary, safe_torch_load

FORMAT = "napari-gpuseg-sam-decoder"
PARTS = ("prompt_encoder", "mask_decoder")
ENCODER = "image_encoder"  # the prefix of tuned image-encoder tensors a checkpoint may carry
ARCHS = ("vit_b", "vit_l", "vit_h", "vit_t", "lite_medsam")  # as models.sam.build.ARCHS
CLICK_ZOOM = (1.0, 4.0)  # the click scales a decoder may be trained at (finetune's limits)
CANDIDATES = 4  # a tuned decoder's first-click candidates: its single-mask output, then SAM's three
CLICK_THRESHOLD = (-8.0, 8.0)  # the logits a first click's mask may be cut at (0: SAM's own)
_SHA256 = re.compile(r"[0-9a-f]{64}")


def decoder_state(sam: nn.Module, dtype: torch.dtype = torch.float16,
                  encoder_parts: Sequence[str] = ()) -> dict[str, torch.Tensor]:
    """The prompt encoder's and mask decoder's state, and the image encoder's tensors whose
    names start with one of ``encoder_parts`` (e.g. ``("layers.3.", "neck.")``), floats cast
    to ``dtype``, on the CPU."""
    out = {}
    parts = [(part, getattr(sam, part).state_dict().items()) for part in PARTS]
    if encoder_parts:
        parts.append((ENCODER, [(k, v) for k, v in sam.image_encoder.state_dict().items()
                                if k.startswith(tuple(encoder_parts))]))
    for part, items in parts:
        for k, v in items:
            v = v.detach().to("cpu")
            out[f"{part}.{k}"] = v.to(dtype) if v.is_floating_point() else v.clone()
    return out


def save_decoder(path: str | os.PathLike, sam: nn.Module, base: str, base_sha256: str | None,
                 encoder_parts: Sequence[str] = (), **meta: Any) -> Path:
    """Write ``sam``'s decoder (and the image encoder's ``encoder_parts``, see
    :func:`decoder_state`) as a decoder checkpoint at ``path`` (atomically: a temp file in
    the same folder, then a rename). ``meta`` (plain types) is stored alongside."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"format": FORMAT, "version": 1, "base": str(base), "base_sha256": base_sha256,
           "arch": str(getattr(sam, "arch", "")), "image_size": int(getattr(sam, "image_size", 0)),
           "state": decoder_state(sam, encoder_parts=encoder_parts), **meta}
    return _write(path, doc)


def encoder_tensors(doc: Mapping) -> dict[str, torch.Tensor]:
    """The image-encoder tensors a decoder checkpoint carries, named inside the encoder
    (``layers.3.…``); empty for a decoder-only file."""
    prefix = ENCODER + "."
    return {k[len(prefix):]: v for k, v in doc["state"].items() if k.startswith(prefix)}


def encoder_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """12 hex digits that change with any of ``tensors`` (names, shapes, values)."""
    h = hashlib.sha256()
    for k in sorted(tensors):
        t = tensors[k].detach().to("cpu").contiguous()
        h.update(f"{k}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:12]


def set_decoder_fields(path: str | os.PathLike, **fields: Any) -> Path:
    """Rewrite the decoder checkpoint at ``path`` with ``fields`` (plain types) set, the
    tensors unchanged (checked by :func:`check_decoder` first; written atomically)."""
    doc = read_decoder(path)
    doc.update(fields)
    return _write(Path(path), check_decoder(doc, path))


def _write(path: Path, doc: dict) -> Path:
    """``doc`` to ``path`` through a temp file in the same folder and a rename."""
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
    """A decoder checkpoint as a dict (``weights_only=True``), checked by
    :func:`check_decoder`; :class:`CheckpointError` when the file is another kind of
    checkpoint or a field is malformed."""
    doc = safe_torch_load(path, map_location="cpu")
    if not is_decoder_checkpoint(doc):
        raise CheckpointError(f"{path} is not a SAM decoder checkpoint (format {FORMAT!r})")
    return check_decoder(doc, path)


def _bad(source, what: str) -> CheckpointError:
    return CheckpointError(f"decoder checkpoint {_name(source)}: {what}")


def _name(source) -> str:
    return f"'{source}'" if source is not None else "(given as a dict)"


def check_decoder(doc: Mapping, source=None) -> dict:
    """``doc`` as a plain dict when every field a loader reads is well formed: ``base`` a
    non-empty string, ``base_sha256`` None or 64 hex digits, ``arch`` empty or a known
    architecture, ``image_size`` a positive integer (0 or None: unknown), ``click_zoom`` a number
    in :data:`CLICK_ZOOM`, ``click_output`` None or a candidate index (0 the single-mask
    output, 1-3 SAM's three), ``click_blend`` None or a number in (0, 100], ``click_threshold``
    None or a logit in :data:`CLICK_THRESHOLD`, ``state`` a
    non-empty mapping of names to tensors, all of them finite. Else :class:`CheckpointError`
    naming the file and the field. ``source``: the file, for the message."""
    if not is_decoder_checkpoint(doc):
        raise _bad(source, f"not a SAM decoder checkpoint (format {FORMAT!r})")
    base = doc.get("base")
    if not isinstance(base, str) or not base.strip():
        raise _bad(source, f"'base' must name the SAM checkpoint it was trained on (a registry "
                           f"name or a file), got {base!r:.80}")
    sha = doc.get("base_sha256")
    if sha is not None and not (isinstance(sha, str) and _SHA256.fullmatch(sha.lower())):
        raise _bad(source, f"'base_sha256' must be 64 hex digits or None, got {sha!r:.80}")
    arch = doc.get("arch")
    if arch not in (None, "") and arch not in ARCHS:
        raise _bad(source, f"'arch' must be one of {', '.join(ARCHS)}, got {arch!r:.80}")
    size = doc.get("image_size")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
        raise _bad(source, f"'image_size' must be a positive whole number of pixels, got {size!r:.80}")
    zoom = doc.get("click_zoom", 1.0)
    lo, hi = CLICK_ZOOM
    if (isinstance(zoom, bool) or not isinstance(zoom, (int, float)) or not math.isfinite(zoom)
            or not lo <= zoom <= hi):
        raise _bad(source, f"'click_zoom' must be a number from {lo:g} to {hi:g}, got {zoom!r:.80}")
    out = doc.get("click_output")
    if out is not None and (isinstance(out, bool) or not isinstance(out, int) or not 0 <= out < CANDIDATES):
        raise _bad(source, f"'click_output' must be None or a candidate index from 0 to {CANDIDATES - 1}, "
                           f"got {out!r:.80}")
    blend = doc.get("click_blend")
    if blend is not None and (isinstance(blend, bool) or not isinstance(blend, (int, float))
                              or not math.isfinite(blend) or not 0 < blend <= 100):
        raise _bad(source, f"'click_blend' must be None or a number above 0 and at most 100, got {blend!r:.80}")
    thr = doc.get("click_threshold")
    lo, hi = CLICK_THRESHOLD
    if thr is not None and (isinstance(thr, bool) or not isinstance(thr, (int, float))
                            or not math.isfinite(thr) or not lo <= thr <= hi):
        raise _bad(source, f"'click_threshold' must be None or a logit from {lo:g} to {hi:g}, got {thr!r:.80}")
    state = doc.get("state")
    if not isinstance(state, Mapping) or not state:
        raise _bad(source, f"'state' must map parameter names to tensors, got {type(state).__name__}")
    odd = [str(k) for k, v in state.items() if not isinstance(k, str) or not torch.is_tensor(v)]
    if odd:
        raise _bad(source, f"'state' holds {len(odd)} entries that are not named tensors "
                           f"(first: {odd[0]!r:.60})")
    bad = [k for k, v in state.items() if v.is_floating_point() and not _finite(v)]
    if bad:
        whole = len(bad) == len([v for v in state.values() if v.is_floating_point()])
        raise _bad(source, f"{'every' if whole else len(bad)} weight tensor(s) hold NaN or infinite "
                           f"values (first: {bad[0]}); the file is damaged or its training diverged")
    return dict(doc)


def _finite(t: torch.Tensor) -> bool:
    """All values finite (numpy: torch's own check spreads 137 small tensors over threads
    and took seconds on a busy 2-core CPU; numpy takes milliseconds)."""
    t = t.detach().cpu()
    if t.dtype not in (torch.float16, torch.float32, torch.float64):
        t = t.float()
    return bool(np.isfinite(t.numpy()).all())


def check_base(doc: Mapping, source, base: str, arch: str | None, image_size: int | None,
               sha256: str | None) -> None:
    """:class:`CheckpointError` when the decoder ``doc`` was trained on another model than
    ``base`` (registry facts ``arch``, ``image_size``, ``sha256``; None: unknown, not
    compared). Cheap, so a loader calls it before downloading or building the base."""
    want = doc.get("arch") or None
    if want and arch and want != arch:
        raise _bad(source, f"it was trained on a {want} model, but its base {base!r} is {arch}")
    size = doc.get("image_size") or None
    if size and image_size and int(size) != int(image_size):
        raise _bad(source, f"it was trained at {size} px input, but its base {base!r} takes {image_size} px")
    mine = doc.get("base_sha256")
    if mine and sha256 and mine.lower() != sha256.lower():
        raise _bad(source, f"its base {base!r} is not the checkpoint it was trained on (sha256 "
                           f"{sha256.lower()[:12]}... instead of {mine.lower()[:12]}...): its masks "
                           "would come from another encoder's embeddings")


def apply_decoder(sam: nn.Module, doc: Mapping, source: str | os.PathLike | None = None) -> nn.Module:
    """Load a decoder checkpoint's tensors into ``sam`` (strict: every prompt encoder and
    mask decoder key, same shapes). Marks the network ``decoder_tuned``.

    Image-encoder tensors in the file (:func:`encoder_tensors`) must each name a tensor of
    ``sam.image_encoder`` of the same shape; they are checked before anything is loaded, then
    replace the base's, and ``sam.encoder_id`` (the base's name and :func:`encoder_digest`)
    and ``sam.encoder_source`` (``source``: the registry name or file that carries them, the
    base a decoder tuned on top of this network must name) are set. A decoder-only file
    keeps both as they were."""
    doc = check_decoder(doc)
    enc = encoder_tensors(doc)
    if enc:
        ref_enc = sam.image_encoder.state_dict()
        _others, unexpected, mismatched = compare_state_dict(sam.image_encoder, enc)  # a part: none missing
        if unexpected or mismatched:
            raise CheckpointError("decoder checkpoint does not fit the image_encoder: "
                                  + mismatch_summary([], unexpected, mismatched), [], unexpected, mismatched)
    state = doc["state"]
    arch = doc.get("arch")
    if arch and getattr(sam, "arch", arch) != arch:
        raise CheckpointError(f"decoder was trained on a {arch} model, not {sam.arch}")
    size = doc.get("image_size")
    if size and int(getattr(sam, "image_size", size)) != int(size):
        raise CheckpointError(f"decoder was trained at {size} px input, not {sam.image_size} px")
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
    if enc:
        sam.image_encoder.load_state_dict({k: v.to(ref_enc[k].dtype) for k, v in enc.items()}, strict=False)
        sam.encoder_id = f"{doc.get('base')}+{encoder_digest(enc)}"
        sam.encoder_source = str(source) if source is not None else None
    sam.decoder_tuned = True
    sam.click_zoom = float(doc.get("click_zoom", 1.0))  # the scale its clicks were trained at
    sam.click_output = doc.get("click_output")  # the candidate a first click keeps (None: the head's)
    sam.click_blend = doc.get("click_blend")  # None, or the temperature its candidates are blended with
    sam.click_threshold = doc.get("click_threshold")  # None (0), or the logit a first click's mask is cut at
    sam.decoder_base = doc.get("base")
    return sam
