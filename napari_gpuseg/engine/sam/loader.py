"""Load a SAM model by registry name or file into a :class:`SamEngine`."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from ..runtime.device import Policy, resolve_policy
from .cache import EmbeddingCache
from .predictor import SamEngine, SamModelInfo

DEFAULT_MODEL = "lite_medsam"


def model_info(name: str, sam) -> SamModelInfo:
    """Engine facts from the built network (input size, normalisation, prompt style)."""
    return SamModelInfo(
        name=name,
        image_size=int(sam.image_size),
        normalization=str(sam.normalization),
        box_trained=getattr(sam, "arch", "") == "lite_medsam",
    )


def load_sam_model(model: str | os.PathLike = DEFAULT_MODEL, device="cpu", arch: str | None = None,
                   progress: Callable | None = None):
    """A registry name (found in the cache, an installed package, or downloaded) or a file."""
    from ...models.sam import load_sam

    path = Path(model)
    if path.suffix in (".pth", ".pt") or path.exists():
        if not path.exists():
            raise FileNotFoundError(f"SAM checkpoint not found: {path}")
        return load_sam(arch, path, device=device)
    from ...models import registry

    sam, _spec = registry.load_model(str(model), device=device, progress=progress)
    return sam


def load_engine(model: str | os.PathLike = DEFAULT_MODEL, policy: Policy | None = None,
                cache: EmbeddingCache | None = None, progress: Callable | None = None,
                arch: str | None = None) -> SamEngine:
    """Resolve (and if needed download) the checkpoint, build the net, wrap it in an engine."""
    policy = resolve_policy(policy)
    sam = load_sam_model(model, policy.device, arch=arch, progress=progress)
    return SamEngine(sam, model_info(str(model), sam), policy=policy, cache=cache)
