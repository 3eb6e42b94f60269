"""The U-Net checkpoint format: one file holds the architecture, the weights, the input
normalisation and the training record, and loads with ``torch.load(weights_only=True)``.

    save_checkpoint("my_unet.pt", model, normalization, training={...})
    loaded = load_unet("my_unet.pt", device="cpu")    # None = the bundled nuclei model

Training writes it (:mod:`.training`), prediction and folder jobs read it (:mod:`.predict`).
"""
from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from ...models.state_dict_loading import CheckpointError, load_state_dict_strict, mismatch_summary, safe_torch_load
from ...models.unet import CLASS_NAMES, UNet, UNetConfig, build_unet
from ..normalize import normalization_spec
from ..runtime.device import get_policy

FORMAT = "napari-gpuseg-unet"
FORMAT_VERSION = 1
BUNDLED_NAME = "unet_nuclei.pt"


def bundled_model_path() -> Path:
    """Path of the nuclei model shipped in the package (see weights/MODEL_CARD.md)."""
    return Path(str(resources.files("napari_gpuseg") / "weights" / BUNDLED_NAME))


def make_checkpoint(model: UNet, normalization: dict | None = None, **meta) -> dict:
    """A checkpoint dict of primitive types and tensors (loads with weights_only=True)."""
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    ckpt = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "config": model.config.to_dict(),
        "classes": list(CLASS_NAMES),
        "normalization": normalization or normalization_spec(),
        "state_dict": state,
    }
    ckpt.update(plain(meta))
    return ckpt


def plain(obj):
    """``obj`` with numpy scalars, paths and other objects turned into primitive types, so
    the checkpoint loads with ``weights_only=True``."""
    if isinstance(obj, dict):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, (bool, type(None))):
        return obj
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        return float(obj)
    return str(obj)


def save_checkpoint(path, model: UNet, normalization: dict | None = None, **meta) -> Path:
    """Write ``model`` and metadata (training summary, metrics, ...) to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        torch.save(make_checkpoint(model, normalization, **meta), tmp)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # no half-written file left behind (disk full, ...)
        raise
    return path


class UNetCheckpointError(CheckpointError, ValueError):
    """A U-Net checkpoint that cannot be read, is not one, or does not fit its architecture
    (a :class:`~napari_gpuseg.models.state_dict_loading.CheckpointError` and a ``ValueError``)."""


def load_checkpoint(path, map_location="cpu") -> dict:
    """Read a checkpoint with ``weights_only=True`` (:func:`models.state_dict_loading.safe_torch_load`)
    and check its format."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"U-Net checkpoint not found: {path}")
    try:
        ckpt = safe_torch_load(path, map_location=map_location)
    except CheckpointError as exc:  # never torch's advice to turn weights_only off
        raise UNetCheckpointError(f"U-Net {exc}") from exc.__cause__
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise UNetCheckpointError(f"{path} is not a napari-gpuseg U-Net checkpoint (no '{FORMAT}' format tag)")
    return ckpt


def load_unet_state(model: UNet, state) -> UNet:
    """Load a U-Net state dict into ``model`` strictly (every key and shape must match,
    :func:`models.state_dict_loading.load_state_dict_strict`); raises :class:`UNetCheckpointError`
    naming what does not match."""
    try:
        return load_state_dict_strict(model, state)
    except CheckpointError as exc:
        detail = mismatch_summary(exc.missing, exc.unexpected, exc.mismatched) or str(exc)
        raise UNetCheckpointError(f"checkpoint does not match the architecture: {detail}",
                                  exc.missing, exc.unexpected, exc.mismatched) from exc


def model_from_checkpoint(ckpt: dict, device="cpu") -> UNet:
    """The U-Net of a checkpoint dict, loaded strictly (:func:`load_unet_state`), frozen
    and in eval mode on ``device``."""
    model = load_unet_state(build_unet(UNetConfig.from_dict(ckpt["config"])), ckpt["state_dict"])
    # inference weights: no grad, so autocast does not keep low-precision weight copies
    return model.requires_grad_(False).to(device).eval()


@dataclass
class LoadedModel:
    model: UNet
    meta: dict
    path: Path

    @property
    def config(self) -> UNetConfig:
        return self.model.config

    @property
    def normalization(self) -> dict:
        return self.meta.get("normalization") or normalization_spec()


def load_unet(path=None, device=None) -> LoadedModel:
    """Load a checkpoint (None = the bundled nuclei model) onto ``device`` (policy default)."""
    path = Path(path) if path else bundled_model_path()
    device = torch.device(device) if device is not None else get_policy().device
    ckpt = load_checkpoint(path)
    model = model_from_checkpoint(ckpt, device)
    meta = {k: v for k, v in ckpt.items() if k != "state_dict"}
    return LoadedModel(model, meta, path)
