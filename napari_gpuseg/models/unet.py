"""A configurable 2D/3D U-Net predicting background / object interior / object boundary.

Pure torch. ``UNetConfig`` describes the architecture and round-trips through a plain
dict so that checkpoints hold only primitive types and tensors (``weights_only=True``).
Inputs whose spatial size is not a multiple of ``2**depth`` are padded internally and the
output is cropped back, so the network accepts any size.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

NORMS = ("batch", "instance", "group", "none")
CLASS_NAMES = ("background", "interior", "boundary")


@dataclass
class UNetConfig:
    """Architecture of a :class:`UNet`.

    depth is the number of 2x down-samplings; level ``i`` has ``base * 2**i`` channels.
    """

    spatial_dims: int = 2
    in_channels: int = 1
    out_channels: int = 3
    depth: int = 3
    base: int = 16
    norm: str = "batch"

    def __post_init__(self) -> None:
        if self.spatial_dims not in (2, 3):
            raise ValueError(f"spatial_dims must be 2 or 3, got {self.spatial_dims}")
        if self.norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {self.norm!r}")
        if self.depth < 0 or self.base < 1 or self.in_channels < 1 or self.out_channels < 1:
            raise ValueError(f"invalid U-Net configuration {self}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "UNetConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown U-Net config keys: {sorted(unknown)}")
        return cls(**{k: d[k] for k in known if k in d})

    @property
    def multiple(self) -> int:
        """Spatial sizes the network handles without internal padding."""
        return 2**self.depth


def _norm(kind: str, dims: int, ch: int) -> nn.Module:
    if kind == "batch":
        return (nn.BatchNorm2d if dims == 2 else nn.BatchNorm3d)(ch)
    if kind == "instance":
        return (nn.InstanceNorm2d if dims == 2 else nn.InstanceNorm3d)(ch, affine=True)
    if kind == "group":
        groups = max(g for g in (8, 4, 2, 1) if ch % g == 0)
        return nn.GroupNorm(groups, ch)
    return nn.Identity()


class ConvBlock(nn.Sequential):
    """Two (conv 3 -> norm -> ReLU) layers."""

    def __init__(self, dims: int, cin: int, cout: int, norm: str) -> None:
        conv = nn.Conv2d if dims == 2 else nn.Conv3d
        bias = norm == "none"
        super().__init__(
            conv(cin, cout, 3, padding=1, bias=bias),
            _norm(norm, dims, cout),
            nn.ReLU(inplace=True),
            conv(cout, cout, 3, padding=1, bias=bias),
            _norm(norm, dims, cout),
            nn.ReLU(inplace=True),
        )


class UNet(nn.Module):
    """U-Net: encoder of ``depth`` max-pool stages, transposed-conv decoder with skips."""

    def __init__(self, config: UNetConfig | None = None, **kwargs) -> None:
        super().__init__()
        self.config = config if config is not None else UNetConfig(**kwargs)
        c = self.config
        d = c.spatial_dims
        widths = [c.base * 2**i for i in range(c.depth + 1)]
        self.encoders = nn.ModuleList()
        cin = c.in_channels
        for w in widths:
            self.encoders.append(ConvBlock(d, cin, w, c.norm))
            cin = w
        up = nn.ConvTranspose2d if d == 2 else nn.ConvTranspose3d
        self.ups = nn.ModuleList()
        self.decoders = nn.ModuleList()
        for i in reversed(range(c.depth)):
            self.ups.append(up(widths[i + 1], widths[i], 2, stride=2))
            self.decoders.append(ConvBlock(d, 2 * widths[i], widths[i], c.norm))
        conv = nn.Conv2d if d == 2 else nn.Conv3d
        self.head = conv(widths[0], c.out_channels, 1)
        self.pool = nn.MaxPool2d(2) if d == 2 else nn.MaxPool3d(2)
        #: trade compute for memory in training (large 3D crops)
        self.gradient_checkpointing = False

    def _block(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.gradient_checkpointing and self.training and x.requires_grad:
            return checkpoint(block, x, use_reentrant=False)
        return block(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: (N, C, *spatial) -> logits (N, out_channels, *spatial)."""
        d = self.config.spatial_dims
        if x.ndim != d + 2:
            raise ValueError(f"expected a {d + 2}-D input (N, C, *spatial), got shape {tuple(x.shape)}")
        size = x.shape[2:]
        m = self.config.multiple
        pad = []
        for s in reversed(size):
            pad += [0, (-s) % m]
        if any(pad):
            x = F.pad(x, pad, mode="replicate")
        skips = []
        for i, enc in enumerate(self.encoders):
            x = self._block(enc, x)
            if i < len(self.encoders) - 1:
                skips.append(x)
                x = self.pool(x)
        for up, dec in zip(self.ups, self.decoders):
            x = up(x)
            x = self._block(dec, torch.cat([skips.pop(), x], dim=1))
        x = self.head(x)
        if any(pad):
            x = x[(slice(None), slice(None)) + tuple(slice(0, s) for s in size)]
        return x


def build_unet(config: UNetConfig | dict | None = None) -> UNet:
    if isinstance(config, dict):
        config = UNetConfig.from_dict(config)
    return UNet(config or UNetConfig())


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
