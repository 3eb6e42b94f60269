"""Fused oneDNN kernels for CPU inference (fp32, or a bf16 autocast): convolution or linear
layer plus GELU.

GELU is memory-bound on a CPU: on TinyViT's 256 px stage (256 channels x 256 x 256) each
activation is a separate pass over a 64 MB tensor. oneDNN applies it as a post-op of the
convolution or matrix product instead (the ops PyTorch's own CPU compiler emits,
``torch.ops.mkldnn._convolution_pointwise`` / ``_linear_pointwise``), and convolutions run
on channels-last tensors, where oneDNN's depthwise kernels are much faster.

Used only where it cannot change what a caller sees: CPU tensors, no autograd, a PyTorch
built with oneDNN, and either float32 without autocast or a CPU bf16 autocast on a CPU with
AVX512-BF16 or AMX (where the policy picks bf16; the operands go to bf16 as autocast would
send them, and the result is bf16). Anything else takes the plain ops.
If a fused call fails once (an older or unusual build), the plain ops are used from then on.

TinyViT's first stage (MBConv blocks on the full-resolution grid, 64 -> 256 -> 64 channels)
is bound by memory traffic rather than arithmetic: each of its 256-channel activations is
64 MB for one 256 px view, far over any cache. In fp32, :func:`inverted_residual_rows` runs a
block band of rows by band (each band's expanded activations stay in the cache) and adds the
residual inside the last convolution (oneDNN adds it into the output); same arithmetic, other order of
the final additions. With the attention run a few windows at a time (``tiny_vit``), LiteMedSAM's
encoder ran 1.15-1.30x faster than the same fused kernels over the whole grid on a 2-core
AVX2-only AMD EPYC (one 256 px view; a 520x696 field 1.28x), whose core streams about 3-4 GB/s.

On by default where the kernels exist; ``NAPARI_GPUSEG_CPU_FUSION=0`` turns it off.
Measured with ``benchmarks/encoder_cpu.py`` (``docs/benchmarks.md``). fp32, on two 2-core
AVX2 CPUs: LiteMedSAM's encoder ran 1.41x faster with two threads on one (1.31x with one
thread) and within the run-to-run noise (0.92-1.04x) on the other, where the plain ops were
already twice as fast. The CPU's flags do not tell the two apart, so the kernels' presence
decides. bf16 autocast (``--precision bf16``), on a 2-core AMD EPYC Zen 4 with AVX512-BF16:
1.42-1.48x on one view, two views and a whole 520x696 field (channels-last alone 1.22-1.35x).
"""
from __future__ import annotations

import logging
import os
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from ..cpu_bf16 import cpu_has_fast_bf16

log = logging.getLogger(__name__)

def enabled_by(value: str | None) -> bool:
    """Whether a ``NAPARI_GPUSEG_CPU_FUSION`` value leaves the fused path on (default: on;
    ``0``, ``false``, ``no`` or ``off`` turn it off)."""
    return (value or "").strip().lower() not in ("0", "false", "no", "off")


_enabled = enabled_by(os.environ.get("NAPARI_GPUSEG_CPU_FUSION"))


def _ops_present() -> bool:
    try:
        ops = torch.ops.mkldnn
        return (torch.backends.mkldnn.is_available()
                and hasattr(ops, "_convolution_pointwise") and hasattr(ops, "_linear_pointwise"))
    except (AttributeError, RuntimeError):
        return False


_available = _ops_present()
_fast_bf16 = cpu_has_fast_bf16()  # bf16 operands only where the CPU computes them natively
_channels_last = True  # fused convolutions on channels-last tensors (False: as they come, NCHW)
_row_bands = True  # MBConv blocks band of rows by band (inverted_residual_rows)
ROW_BAND_BYTES = 8 << 20  # one band's expanded activations (fits a CPU's last-level cache)


def set_channels_last(flag: bool) -> bool:
    """Run fused convolutions on channels-last (True) or NCHW tensors; returns the previous setting."""
    global _channels_last
    prev, _channels_last = _channels_last, bool(flag)
    return prev


def channels_last() -> bool:
    return _channels_last


def set_row_bands(flag: bool) -> bool:
    """Run MBConv blocks band by band (True) or whole (False); returns the previous setting."""
    global _row_bands
    prev, _row_bands = _row_bands, bool(flag)
    return prev


def set_enabled(flag: bool) -> bool:
    """Turn the fused path on or off for this process; returns the previous setting."""
    global _enabled
    prev, _enabled = _enabled, bool(flag)
    return prev


def _cpu_autocast() -> bool:
    try:
        return torch.is_autocast_enabled("cpu")
    except TypeError:  # torch < 2.4
        return torch.is_autocast_cpu_enabled()


def _autocast_dtype() -> torch.dtype:
    try:
        return torch.get_autocast_dtype("cpu")
    except (AttributeError, TypeError):  # torch < 2.4
        return torch.get_autocast_cpu_dtype()


def _bf16_autocast() -> bool:
    """Inside a CPU autocast whose dtype is bf16 (the policy's on AVX512-BF16 or AMX)."""
    return _cpu_autocast() and _autocast_dtype() == torch.bfloat16


def active(x: torch.Tensor) -> bool:
    """Whether the fused kernels serve this input (see the module docstring)."""
    if not (_enabled and _available and x.device.type == "cpu") or torch.is_grad_enabled():
        return False
    if _cpu_autocast():
        return _fast_bf16 and _bf16_autocast() and x.dtype in (torch.float32, torch.bfloat16)
    return x.dtype == torch.float32


def _operands(x, weight, bias):
    """In a bf16 autocast, the operands in bf16 (what autocast gives a convolution or a
    matrix product; the fused op is outside its lists); as they are otherwise."""
    if not _cpu_autocast():
        return x, weight, bias
    bf = torch.bfloat16
    return x.to(bf), weight.to(bf), None if bias is None else bias.to(bf)


def channels_last_input(x: torch.Tensor) -> bool:
    """Whether the encoder should take ``x`` as a channels-last tensor (wherever the fused
    kernels serve it, fp32 or bf16)."""
    return _channels_last and active(x)


def _disable(err: Exception) -> None:
    global _available
    _available = False
    log.warning("fused oneDNN kernels unavailable (%s); using the plain ops", err)


def conv2d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
           stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int], groups: int,
           act: Optional[str] = None) -> torch.Tensor:
    """``act(conv2d(x))`` (``act`` None or ``"gelu"``), fused where :func:`active`."""
    if act and active(x):
        try:
            x, weight, bias = _operands(x, weight, bias)
            return torch.ops.mkldnn._convolution_pointwise(
                x.contiguous(memory_format=torch.channels_last) if _channels_last else x, weight, bias,
                list(padding),
                list(stride), list(dilation), groups, act, [None], "none")
        except (RuntimeError, TypeError, AttributeError) as err:  # a build whose op differs
            _disable(err)
    y = F.conv2d(x, weight, bias, stride, padding, dilation, groups)
    return F.gelu(y) if act == "gelu" else y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
           act: Optional[str] = None) -> torch.Tensor:
    """``act(linear(x))``, fused where :func:`active` (any number of leading dims)."""
    if act and active(x):
        try:
            xs, weight, bias = _operands(x, weight, bias)
            y = torch.ops.mkldnn._linear_pointwise(xs.reshape(-1, x.shape[-1]), weight, bias, act, [None], "none")
            return y.view(*x.shape[:-1], weight.shape[0])
        except (RuntimeError, TypeError, AttributeError) as err:  # a build whose op differs
            _disable(err)
    y = F.linear(x, weight, bias)
    return F.gelu(y) if act == "gelu" else y


def rows_active(x: torch.Tensor) -> bool:
    """Whether :func:`inverted_residual_rows` serves ``x``: the fused path in fp32 (no
    autocast), channels-last convolutions, a 4-D batch."""
    return (_row_bands and _channels_last and x.ndim == 4 and x.dtype == torch.float32
            and not _cpu_autocast() and active(x))


def inverted_residual_rows(x: torch.Tensor, expand, depthwise, project, band_bytes: int = ROW_BAND_BYTES,
                           before_band: Optional[Callable[[], object]] = None) -> Optional[torch.Tensor]:
    """``gelu(project(gelu(depthwise(gelu(expand(x))))) + x)`` (TinyViT's MBConv in eval,
    BatchNorms folded) computed a band of rows at a time. ``expand`` and ``project`` are
    1x1 convolutions, ``depthwise`` a stride-1 depthwise convolution with a square kernel
    and ``kernel // 2`` padding, each a ``(weight, bias)`` pair. A band's expanded input
    takes ``kernel // 2`` rows more on each side inside the image; at the image's top and
    bottom the depthwise convolution's own zero padding applies, as on the whole image.
    ``before_band()`` is called before each band (the encoder's pause points). Call where
    :func:`rows_active`. None on a build whose ops differ (the fused path is then off, and the
    caller runs its own plain ops)."""
    (w1, b1), (w2, b2), (w3, b3) = expand, depthwise, project
    k = w2.shape[-1]
    if w2.shape[-2] != k or k % 2 == 0:
        raise ValueError(f"a square odd depthwise kernel is needed, got {tuple(w2.shape[-2:])}")
    halo = k // 2
    _, _, h, w = x.shape
    rows = int(min(h, max(2 * halo + 1, band_bytes // max(1, w * w1.shape[0] * x.element_size()))))
    x = x.contiguous(memory_format=torch.channels_last)
    cl = torch.channels_last
    try:
        out = torch.empty_like(x, memory_format=cl)
        for r0 in range(0, h, rows):
            if before_band is not None:
                before_band()
            r1 = min(h, r0 + rows)
            s0, s1 = max(0, r0 - halo), min(h, r1 + halo)
            y = torch.ops.mkldnn._convolution_pointwise(x[:, :, s0:s1], w1, b1, [0, 0], [1, 1], [1, 1], 1,
                                                        "gelu", [None], "none")
            y = torch.ops.mkldnn._convolution_pointwise(y, w2, b2, [halo, halo], [1, 1], [1, 1], w2.shape[0],
                                                        "gelu", [None], "none")
            y = y[:, :, r0 - s0:r1 - s0].contiguous(memory_format=cl)  # rows whose window lay inside
            band = out[:, :, r0:r1]  # rows of a channels-last tensor: one contiguous block
            band.copy_(x[:, :, r0:r1])
            torch.ops.mkldnn._convolution_pointwise_.binary(band, y, w3, b3, [0, 0], [1, 1], [1, 1], 1,
                                                            "add", None, None, [], None)
            torch.ops.aten.gelu_(band)
        return out
    except (RuntimeError, TypeError, AttributeError) as err:  # a build whose op differs
        _disable(err)
        return None
