"""Device and precision policy: the one place that decides where and how networks run.

Everything that runs a network asks :func:`get_policy` (or takes a :class:`Policy`
argument); users override with :func:`set_policy` or the ``NAPARI_GPUSEG_DEVICE`` /
``NAPARI_GPUSEG_PRECISION`` environment variables.
"""
from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass, field

import torch

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def cpu_has_fast_bf16() -> bool:
    """True when the CPU runs bf16 matmuls natively (AMX tiles or AVX512-BF16)."""
    checks = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    for name in checks:
        fn = getattr(torch.cpu, name, None)
        try:
            if fn is not None and fn():
                return True
        except Exception:  # pragma: no cover - exotic builds
            continue
    return False


def mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def pick_device(requested: str | None = None) -> torch.device:
    """``cuda > mps > cpu`` unless ``requested`` names one ("auto" or None = pick)."""
    requested = requested or os.environ.get("NAPARI_GPUSEG_DEVICE") or "auto"
    if requested != "auto":
        dev = torch.device(requested)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(
                f"Device {requested!r} was requested but no CUDA GPU is available "
                "(is a CUDA build of torch installed?). Use 'cpu' or 'auto'."
            )
        if dev.type == "mps" and not mps_available():
            raise RuntimeError(f"Device {requested!r} was requested but MPS is not available.")
        return dev
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if mps_available():
        return torch.device("mps")
    return torch.device("cpu")


def pick_precision(device: torch.device, requested: str | None = None) -> str:
    """Decide the autocast precision for ``device``.

    CUDA: bf16 on compute capability >= 8.0, fp16 on >= 7.0, fp32 below.
    CPU: bf16 where the CPU has fast bf16 (AMX / AVX512-BF16), fp32 otherwise.
    MPS: fp16.
    """
    requested = requested or os.environ.get("NAPARI_GPUSEG_PRECISION") or "auto"
    if requested not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {requested!r}")
    if requested != "auto":
        return requested
    if device.type == "cuda":
        major, _minor = torch.cuda.get_device_capability(device)
        if major >= 8:
            return "bf16"
        if major >= 7:
            return "fp16"
        return "fp32"
    if device.type == "mps":
        return "fp16"
    return "bf16" if cpu_has_fast_bf16() else "fp32"


def configure_backends(device: torch.device) -> None:
    """cuDNN autotuning and TF32 matmuls on CUDA (no-op elsewhere)."""
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


@dataclass(frozen=True)
class Policy:
    """Where networks run and in which precision."""

    device: torch.device
    precision: str = "fp32"
    reason: str = field(default="", compare=False)

    @property
    def dtype(self) -> torch.dtype:
        """The autocast dtype (float32 means no autocast)."""
        return _DTYPES[self.precision]

    @property
    def uses_autocast(self) -> bool:
        return self.precision != "fp32"

    def autocast(self):
        """Autocast context for this policy; enter it *inside* the thread that runs the net.

        Autocast keeps LayerNorm, softmax and reductions in fp32 on CUDA (fp16 and bf16).
        """
        if not self.uses_autocast:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def describe(self) -> str:
        name = device_name(self.device)
        return f"{name} · {self.precision}"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} ({device})"
    if device.type == "mps":
        return "Apple GPU (mps)"
    import platform

    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def make_policy(device: str | None = "auto", precision: str | None = "auto") -> Policy:
    dev = pick_device(device)
    prec = pick_precision(dev, precision)
    if dev.type == "cpu" and prec == "fp16":
        raise ValueError("fp16 is not supported on CPU; use fp32 or bf16")
    configure_backends(dev)
    if dev.type == "cuda":
        cc = torch.cuda.get_device_capability(dev)
        reason = f"compute capability {cc[0]}.{cc[1]}"
    elif dev.type == "cpu":
        reason = "CPU with fast bf16" if cpu_has_fast_bf16() else "CPU without fast bf16"
    else:
        reason = dev.type
    return Policy(dev, prec, reason)


_lock = threading.Lock()
_policy: Policy | None = None


def get_policy() -> Policy:
    """The process-wide policy (decided on first use)."""
    global _policy
    with _lock:
        if _policy is None:
            _policy = make_policy()
        return _policy


def set_policy(device: str | None = "auto", precision: str | None = "auto") -> Policy:
    """Override the process-wide policy; returns the new policy."""
    global _policy
    new = make_policy(device, precision)
    with _lock:
        _policy = new
    return new


def reset_policy() -> None:
    global _policy
    with _lock:
        _policy = None
