"""Load a SAM model by registry name or file into a :class:`SamEngine`."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from ...models.registry import DEFAULT_MODEL  # noqa: F401 - one definition, re-exported here
from ..runtime.device import Policy, resolve_policy
from .interactive.cache import EmbeddingCache
from .interactive.predictor import SamEngine, SamModelInfo


def model_info(name: str, sam) -> SamModelInfo:
    """Engine facts from the built network (input size, normalisation, prompt style).
    A tuned decoder shares its base's encoder, so their embeddings are shared too; a
    network whose checkpoint tuned part of the encoder names it by ``encoder_id`` (its
    embeddings are its own)."""
    tuned = bool(getattr(sam, "decoder_tuned", False))
    encoder = str(getattr(sam, "decoder_base", None) or name) if tuned else name
    return SamModelInfo(
        name=name,
        image_size=int(sam.image_size),
        normalization=str(sam.normalization),
        box_trained=getattr(sam, "arch", "") == "lite_medsam" and not tuned,
        decoder_tuned=tuned,
        encoder=str(getattr(sam, "encoder_id", None) or encoder),
    )


def base_identity(engine) -> tuple[str, str | None]:
    """(name, sha256) of the checkpoint whose encoder ``engine`` runs: a registry name
    with its registry hash, or a file with its own hash. Where a decoder checkpoint tuned
    part of the encoder, that checkpoint (``encoder_source``): a decoder trained on this
    engine loads on it, tuned encoder included."""
    from ...models import registry

    sam = engine.sam
    name = str(getattr(sam, "encoder_source", None) or getattr(sam, "decoder_base", None) or engine.info.name)
    if name in registry.MODELS:
        return name, registry.MODELS[name].sha256
    path = Path(name)
    return name, registry.sha256_file(path) if path.is_file() else None


def load_sam_model(model: str | os.PathLike | None = DEFAULT_MODEL, device="cpu", arch: str | None = None,
                   progress: Callable | None = None):
    """A registry name (found in the cache, an installed package, or downloaded) or a file;
    None: the default model."""
    from ...models.sam import load_sam

    from ...models import registry

    model = DEFAULT_MODEL if model is None else model
    path = Path(model)
    if path.suffix in (".pth", ".pt") or path.exists():
        if not path.exists():
            raise FileNotFoundError(f"SAM checkpoint not found: {path}")
        doc = registry.read_if_decoder(path)
        if doc is not None:  # a tuned decoder: its base (checked first), then the decoder
            return registry.load_decoder_file(path, doc, device=device, progress=progress)[0]
        return load_sam(arch, path, device=device)

    sam, _spec = registry.load_model(str(model), device=device, progress=progress)
    return sam


def load_engine(model: str | os.PathLike | None = DEFAULT_MODEL, policy: Policy | None = None,
                cache: EmbeddingCache | None = None, progress: Callable | None = None,
                arch: str | None = None) -> SamEngine:
    """Resolve (and if needed download) the checkpoint, build the net, wrap it in an engine.
    ``model`` None: the default model (as ``load_unet(None)`` is the bundled U-Net)."""
    model = DEFAULT_MODEL if model is None else model
    policy = resolve_policy(policy)
    sam = load_sam_model(model, policy.device, arch=arch, progress=progress)
    return SamEngine(sam, model_info(str(model), sam), policy=policy, cache=cache)
