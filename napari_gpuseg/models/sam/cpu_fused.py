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
from typing import Optional, Sequence

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


def set_channels_last(flag: bool) -> bool:
    """Run fused convolutions on channels-last (True) or NCHW tensors; returns the previous setting."""
    global _channels_last
    prev, _channels_last = _channels_last, bool(flag)
    return prev


def channels_last() -> bool:
    return _channels_last


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
