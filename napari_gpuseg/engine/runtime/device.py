"""Device and precision policy: the one place that decides where and how networks run.

Everything that runs a network asks :func:`get_policy` (or takes a :class:`Policy`
argument); users override with :func:`set_policy` or the ``NAPARI_GPUSEG_DEVICE`` /
``NAPARI_GPUSEG_PRECISION`` environment variables (read whenever no explicit choice is
passed; a bogus value is a ``ValueError`` naming the variable).

Precision rules (see README, "Device, precision and memory"): bf16 on CUDA compute
capability >= 8.0; fp16 on 7.x cards with tensor cores; fp32 on GTX 16xx (fp16
convolutions give NaN there), on older cards and on MPS with torch < 2.5 (autocast on
MPS raises there). A non-finite network output under autocast re-runs in fp32 and pins
fp32 for that device (:func:`guard_finite`). TF32 and ``cudnn.benchmark`` are never
switched on for the process: :meth:`Policy.autocast` scopes them to our own calls.
"""
from __future__ import annotations

import contextlib
import os
import re
import threading
import warnings
from dataclasses import dataclass, field

import torch

from ...models.cpu_bf16 import cpu_has_fast_bf16
from .cpu_name import cpu_model_name

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ENV_DEVICE = "NAPARI_GPUSEG_DEVICE"
ENV_PRECISION = "NAPARI_GPUSEG_PRECISION"
_DEVICE_RE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")


def torch_version() -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", torch.__version__)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def mps_autocast_ok() -> bool:
    """``torch.autocast("mps", ...)`` raises before torch 2.5, even with ``enabled=False``."""
    return torch_version() >= (2, 5)


def autocast_off(device: torch.device | str):
    """A context that turns autocast off on ``device``; a no-op where autocast does not exist."""
    dev_type = torch.device(device).type
    if dev_type == "mps" and not mps_autocast_ok():
        return contextlib.nullcontext()
    try:
        return torch.autocast(dev_type, enabled=False)
    except RuntimeError:  # a device type autocast does not know
        return contextlib.nullcontext()


def wide_float(device: torch.device | str) -> torch.dtype:
    """float64 where the device has it; float32 on MPS (no float64 there)."""
    return torch.float32 if torch.device(device).type == "mps" else torch.float64


# Turing GPUs without tensor cores (TU116, TU117): the GeForce GTX 16xx, the laptop MX450 /
# MX550 and the workstation T400, T500, T550, T600, T1000, T1200 and T2000 (also "Quadro ...")
_NO_TENSOR_CORE_NAMES = re.compile(
    r"GTX\s*16\d\d|\bMX\s*[45]50\b|\bT(400|500|550|600|1000|1200|2000)\b", re.IGNORECASE)
TURING_TENSOR_CORE_MIN_SMS = 30  # the smallest Turing chip with tensor cores (TU106) has 30 or more


def _no_tensor_cores(name: str, capability: tuple[int, int] | None = None,
                     sm_count: int | None = None) -> bool:
    """Turing (compute capability 7.5) cards without tensor cores, where fp16 convolutions
    give NaN: named in :data:`_NO_TENSOR_CORE_NAMES`, or (for names not listed) a 7.5 card
    with fewer multiprocessors than any Turing chip with tensor cores has."""
    if _NO_TENSOR_CORE_NAMES.search(name) is not None:
        return True
    return (capability == (7, 5) and sm_count is not None and sm_count < TURING_TENSOR_CORE_MIN_SMS
            and "RTX" not in name.upper())


def cuda_no_tensor_cores(device: torch.device) -> bool:
    """:func:`_no_tensor_cores` for a CUDA ``device`` (its name, capability and SM count)."""
    name = torch.cuda.get_device_name(device)
    cc = tuple(torch.cuda.get_device_capability(device))
    try:
        sms = int(torch.cuda.get_device_properties(device).multi_processor_count)
    except Exception:  # noqa: BLE001 - a probe that fails: decide by the name alone
        sms = None
    return _no_tensor_cores(name, cc, sms)


def mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def pick_device(requested: str | None = None) -> torch.device:
    """``cuda > mps > cpu`` unless ``requested`` names one ("auto" or None = pick)."""
    from_env = not requested
    requested = (requested or os.environ.get(ENV_DEVICE) or "auto").strip()
    if not _DEVICE_RE.match(requested):
        src = f"{ENV_DEVICE}={requested!r}" if from_env else f"device {requested!r}"
        raise ValueError(f"{src} is not a device: use auto, cpu, cuda, cuda:N or mps")
    if requested != "auto":
        dev = torch.device(requested)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(
                f"Device {requested!r} was requested but no CUDA GPU is available "
                "(is a CUDA build of torch installed?). Use 'cpu' or 'auto'."
            )
        if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
            raise RuntimeError(f"Device {requested!r} was requested but only "
                               f"{torch.cuda.device_count()} CUDA GPU(s) are visible.")
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

    CUDA: bf16 on compute capability >= 8.0, fp16 on 7.x with tensor cores, fp32 on
    GTX 16xx and below 7.0. CPU: bf16 where the CPU has fast bf16 (AMX / AVX512-BF16),
    fp32 otherwise. MPS: fp16 (fp32 with torch < 2.5). An explicit choice is checked
    with :func:`check_precision` (``ValueError`` with the reason when the device cannot).
    """
    from_env = not requested
    requested = (requested or os.environ.get(ENV_PRECISION) or "auto").strip()
    if requested not in PRECISIONS:
        src = f"{ENV_PRECISION}={requested!r}" if from_env else f"precision {requested!r}"
        raise ValueError(f"{src} is not a precision: use one of {', '.join(PRECISIONS)}")
    if requested != "auto":
        check_precision(device, requested)
        return requested
    if device.type == "cuda":
        major, _minor = torch.cuda.get_device_capability(device)
        if major >= 8:
            return "bf16"
        if major >= 7 and not cuda_no_tensor_cores(device):
            return "fp16"
        return "fp32"
    if device.type == "mps":
        return "fp16" if mps_autocast_ok() else "fp32"
    return "bf16" if cpu_has_fast_bf16() else "fp32"


def check_precision(device: torch.device, precision: str) -> None:
    """Refuse a precision the device cannot run well, with the reason (one line)."""
    if precision == "fp32":
        return
    if device.type == "cpu" and precision == "fp16":
        raise ValueError("fp16 is not supported on CPU; use fp32 or bf16")
    if device.type == "mps":
        if not mps_autocast_ok():
            raise ValueError(f"{precision} on MPS needs torch >= 2.5 (autocast on MPS), this is "
                             f"torch {torch.__version__}; use fp32")
        if precision == "bf16":
            raise ValueError("bf16 is not supported on MPS; use fp16 or fp32")
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        name = torch.cuda.get_device_name(device)
        if precision == "bf16" and major < 8:
            raise ValueError(f"bf16 needs compute capability >= 8.0 (Ampere); {name} is "
                             f"{major}.{minor}: use fp16 or fp32")
        if precision == "fp16" and (major < 7 or cuda_no_tensor_cores(device)):
            raise ValueError(f"fp16 on {name} (compute capability {major}.{minor}, no tensor "
                             "cores) is slow or gives NaN in convolutions: use fp32")


_pinned: dict[str, str] = {}  # device -> why fp32 was pinned
_pinned_lock = threading.Lock()


def pin_fp32(device: torch.device | str, reason: str) -> None:
    """Run everything on ``device`` in fp32 from now on; warns once per device."""
    key = str(torch.device(device))
    with _pinned_lock:
        if key in _pinned:
            return
        _pinned[key] = reason
    warnings.warn(f"napari-gpuseg: {reason} on {key}; re-ran in fp32 and using fp32 on this "
                  "device from now on", RuntimeWarning, stacklevel=2)


def fp32_pinned(device: torch.device | str) -> str | None:
    with _pinned_lock:
        return _pinned.get(str(torch.device(device)))


def unpin_all() -> None:
    with _pinned_lock:
        _pinned.clear()


def all_finite(out) -> bool:
    """True when every floating tensor in ``out`` (a tensor, or a list/tuple/dict of them) is finite."""
    if isinstance(out, torch.Tensor):
        return not out.is_floating_point() or bool(torch.isfinite(out).all())
    if isinstance(out, dict):
        return all(all_finite(v) for v in out.values())
    if isinstance(out, (list, tuple)):
        return all(all_finite(v) for v in out)
    return True


def guard_finite(policy: "Policy", compute, what: str = "network output"):
    """``compute()`` (which enters ``policy.autocast()`` itself); when it ran in reduced
    precision and gave a non-finite result, pin fp32 for the device and run it again."""
    reduced = policy.uses_autocast
    out = compute()
    if reduced and not all_finite(out):
        pin_fp32(policy.device, f"non-finite {what} in {policy.precision}")
        out = compute()
    return out


_flags_lock = threading.Lock()
_flags_saved: tuple | None = None  # the process's flags before the first open scope
_flags_scopes: list[tuple[int, bool, bool]] = []  # (thread, benchmark, tf32) of every open scope


def _apply_scopes() -> None:
    """Set the flags for the open scopes (under ``_flags_lock``): a thread wants what its
    innermost scope asks for; TF32 and autotuning are on only while every thread with an
    open scope wants them; the saved flags come back once the last scope closes."""
    global _flags_saved
    mm, cd = torch.backends.cuda.matmul, torch.backends.cudnn
    if _flags_scopes:
        wants = {t: (b, f) for t, b, f in _flags_scopes}  # the last (innermost) per thread
        bench = all(b for b, _f in wants.values())
        tf32 = all(f for _b, f in wants.values())
        mm.allow_tf32, cd.allow_tf32, cd.benchmark = tf32, tf32, bench
    elif _flags_saved is not None:
        mm.allow_tf32, cd.allow_tf32, cd.benchmark = _flags_saved
        _flags_saved = None


@contextlib.contextmanager
def scoped_backends(device: torch.device, benchmark: bool = False, tf32: bool = False):
    """Set TF32 and ``cudnn.benchmark`` for our own CUDA calls only and restore them after.

    Defaults: no TF32 ("fp32" means fp32, also on A100/H100) and no autotuning (every
    new U-Net window shape would re-tune every convolution); the SAM encoder, which
    always sees one input shape, asks for ``benchmark=True``. No-op off CUDA.

    The flags are process-wide and scopes overlap across threads (the inference worker,
    the training worker, one thread per GPU in folder jobs): open scopes are counted under
    a lock, the flags are saved when the first opens and restored when the last closes;
    nested scopes of one thread: the innermost decides; several threads: TF32 and
    autotuning are on only while all of them ask for it.
    """
    global _flags_saved
    if device.type != "cuda":
        yield
        return
    entry = (threading.get_ident(), bool(benchmark), bool(tf32))
    with _flags_lock:
        if not _flags_scopes:
            mm, cd = torch.backends.cuda.matmul, torch.backends.cudnn
            _flags_saved = (mm.allow_tf32, cd.allow_tf32, cd.benchmark)
        _flags_scopes.append(entry)
        _apply_scopes()
    try:
        yield
    finally:
        with _flags_lock:
            del _flags_scopes[len(_flags_scopes) - 1 - _flags_scopes[::-1].index(entry)]  # the innermost
            _apply_scopes()


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
    def active_precision(self) -> str:
        """``precision``, or fp32 once a non-finite output pinned fp32 for the device."""
        return "fp32" if self.precision != "fp32" and fp32_pinned(self.device) else self.precision

    @property
    def uses_autocast(self) -> bool:
        return self.active_precision != "fp32"

    def autocast(self, benchmark: bool = False):
        """Autocast context for this policy; enter it *inside* the thread that runs the net.

        Also scopes TF32 (off) and ``cudnn.benchmark`` (``benchmark``) to the block, and
        makes the thread's current CUDA device the policy's. In fp32 (or once fp32 is
        pinned) it turns autocast *off*, so an fp32 re-run inside a job's outer autocast
        (the worker enters one per job) really runs in fp32. Autocast keeps LayerNorm,
        softmax and reductions in fp32 on CUDA (fp16 and bf16).
        """
        stack = contextlib.ExitStack()
        if self.device.type == "cuda" and self.device.index is not None and torch.cuda.is_available():
            stack.enter_context(torch.cuda.device(self.device))
        stack.enter_context(scoped_backends(self.device, benchmark=benchmark))
        if self.uses_autocast and (self.device.type != "mps" or mps_autocast_ok()):
            stack.enter_context(torch.autocast(self.device.type, dtype=_DTYPES[self.active_precision]))
        else:  # fp32 (chosen, or pinned after a non-finite output): off, also inside an outer autocast
            stack.enter_context(autocast_off(self.device))
        return stack

    def describe(self) -> str:
        name = device_name(self.device)
        return f"{name} · {self.precision}"


def synchronize(device: torch.device | str) -> None:
    """Wait for queued work on ``device`` (for honest timings); no-op on the CPU."""
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize(dev)
    elif dev.type == "mps" and mps_available():
        torch.mps.synchronize()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} ({device})"
    if device.type == "mps":
        return "Apple GPU (mps)"
    return f"CPU ({cpu_model_name()}, {torch.get_num_threads()} threads)"


def make_policy(device: str | None = None, precision: str | None = None) -> Policy:
    """None (or "" ) reads ``NAPARI_GPUSEG_DEVICE`` / ``NAPARI_GPUSEG_PRECISION``, then "auto"."""
    device = None if device == "auto" and os.environ.get(ENV_DEVICE) else device
    precision = None if precision == "auto" and os.environ.get(ENV_PRECISION) else precision
    dev = pick_device(device)
    prec = pick_precision(dev, precision)
    if dev.type == "cuda":
        cc = torch.cuda.get_device_capability(dev)
        reason = f"compute capability {cc[0]}.{cc[1]}"
        if cc[0] == 7 and cuda_no_tensor_cores(dev):
            reason += ", no tensor cores (fp32)"
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


def resolve_policy(policy: Policy | None = None) -> Policy:
    """``policy`` when given, else the process-wide policy of :func:`get_policy` (the one
    place where an engine call without an explicit policy picks the session's choice)."""
    return policy if policy is not None else get_policy()


def set_policy(device: str | None = None, precision: str | None = None) -> Policy:
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
