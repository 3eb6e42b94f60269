"""Memory and utilisation probes: torch.cuda, NVML (optional), process RSS and system RAM.

Every probe degrades gracefully: no CUDA, no NVML library, no permission: the field is
``None`` and ``nvml_error`` says why. Nothing here raises.
"""
from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field

import psutil
import torch

logger = logging.getLogger(__name__)

@dataclass
class MemorySnapshot:
    device: str
    # torch.cuda allocator (bytes), None on CPU
    allocated: int | None = None
    reserved: int | None = None
    peak: int | None = None
    free: int | None = None
    total: int | None = None
    # NVML (None when unavailable)
    utilization: float | None = None  # percent
    temperature: float | None = None  # deg C
    power: float | None = None  # watts
    nvml_error: str | None = None
    # host
    process_rss: int = 0
    system_used: int = 0
    system_total: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def is_gpu(self) -> bool:
        return self.total is not None


class _Nvml:
    """Lazy NVML access; remembers why it is unavailable instead of raising."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ready: bool | None = None
        self.error: str | None = None
        self._mod = None

    def _init(self) -> bool:
        if self._ready is not None:
            return self._ready
        try:
            import pynvml  # from nvidia-ml-py

            pynvml.nvmlInit()
            self._mod = pynvml
            self._ready = True
        except Exception as exc:  # NVMLError_LibraryNotFound, ImportError, ...
            self.error = f"NVML unavailable: {exc.__class__.__name__}: {exc}".strip()
            self._ready = False
        return self._ready

    def query(self, index: int) -> tuple[float | None, float | None, float | None]:
        with self._lock:
            if not self._init():
                return None, None, None
            nv = self._mod
            try:
                handle = nvml_handle(nv, index)
            except Exception as exc:
                self.error = f"NVML: {exc}"
                return None, None, None
            util = temp = power = None
            try:
                util = float(nv.nvmlDeviceGetUtilizationRates(handle).gpu)
            except Exception as exc:  # a field the GPU or driver does not report
                logger.debug("NVML utilisation of GPU %d unavailable: %s", index, exc)
            try:
                temp = float(nv.nvmlDeviceGetTemperature(handle, nv.NVML_TEMPERATURE_GPU))
            except Exception as exc:
                logger.debug("NVML temperature of GPU %d unavailable: %s", index, exc)
            try:
                power = nv.nvmlDeviceGetPowerUsage(handle) / 1000.0
            except Exception as exc:
                logger.debug("NVML power of GPU %d unavailable: %s", index, exc)
            return util, temp, power


def nvml_handle(nv, index: int):
    """The NVML handle of torch's CUDA device ``index``.

    NVML numbers every GPU of the machine while torch numbers only the visible ones
    (``CUDA_VISIBLE_DEVICES``, set by SLURM): match by UUID, then PCI bus id, then the
    ``CUDA_VISIBLE_DEVICES`` entry; the bare index only when nothing is remapped.
    """
    try:
        props = torch.cuda.get_device_properties(index)
    except Exception as exc:
        logger.debug("no device properties for CUDA device %d: %s", index, exc)
        props = None
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        text = str(uuid)
        try:
            return nv.nvmlDeviceGetHandleByUUID(text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}")
        except Exception as exc:  # next: the PCI bus id
            logger.debug("NVML has no GPU with UUID %s: %s", text, exc)
    bus = getattr(props, "pci_bus_id", None)
    if bus is not None:
        domain, dev = getattr(props, "pci_domain_id", 0), getattr(props, "pci_device_id", 0)
        try:
            return nv.nvmlDeviceGetHandleByPciBusId(f"{domain:08x}:{bus:02x}:{dev:02x}.0")
        except Exception as exc:  # next: CUDA_VISIBLE_DEVICES
            logger.debug("NVML has no GPU at PCI bus %02x: %s", bus, exc)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        if index < len(entries):
            entry = entries[index]
            if entry.isdigit():
                return nv.nvmlDeviceGetHandleByIndex(int(entry))
            return nv.nvmlDeviceGetHandleByUUID(entry)
    return nv.nvmlDeviceGetHandleByIndex(index)


_nvml = _Nvml()


def nvml_status() -> str | None:
    """None when NVML works (or was never needed), else the reason it does not."""
    return _nvml.error


def host_memory() -> tuple[int, int, int]:
    """(process RSS, system used, system total) in bytes."""
    rss = psutil.Process().memory_info().rss
    vm = psutil.virtual_memory()
    return rss, vm.total - vm.available, vm.total


def snapshot(device: torch.device | str | None = None) -> MemorySnapshot:
    """One reading of everything we can measure for ``device`` (default: current policy's)."""
    if device is None:
        from .device import get_policy

        device = get_policy().device
    device = torch.device(device)
    rss, used, total = host_memory()
    snap = MemorySnapshot(str(device), process_rss=rss, system_used=used, system_total=total)
    if device.type == "cuda" and torch.cuda.is_available():
        idx = device.index if device.index is not None else torch.cuda.current_device()
        snap.allocated = torch.cuda.memory_allocated(idx)
        snap.reserved = torch.cuda.memory_reserved(idx)
        snap.peak = torch.cuda.max_memory_allocated(idx)
        snap.free, snap.total = torch.cuda.mem_get_info(idx)
        snap.utilization, snap.temperature, snap.power = _nvml.query(idx)
        snap.nvml_error = _nvml.error
    elif device.type == "mps":
        try:
            snap.allocated = torch.mps.current_allocated_memory()
            snap.reserved = torch.mps.driver_allocated_memory()
        except Exception as exc:  # older torch builds lack these probes
            logger.debug("MPS memory probes unavailable: %s", exc)
    return snap


def reset_peak(device: torch.device | str | None = None) -> None:
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.reset_peak_memory_stats(device if device is not None else None)


def empty_cache(device: torch.device | str | None = None) -> None:
    """Give cached allocator blocks back to the driver: of ``device`` only, or of all devices."""
    dev = torch.device(device) if device is not None else None
    if torch.cuda.is_available() and (dev is None or dev.type == "cuda"):
        if dev is not None and dev.index is not None:
            with torch.cuda.device(dev):
                torch.cuda.empty_cache()
        else:
            torch.cuda.empty_cache()
    if (dev is None or dev.type == "mps") and hasattr(torch, "mps") and \
            getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        torch.mps.empty_cache()


def free_bytes(device: torch.device | str) -> int:
    """Memory a new allocation on a CUDA ``device`` can get: free on the card plus what
    torch has reserved but does not use (its cache). 0 off CUDA."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return 0
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    free, _total = torch.cuda.mem_get_info(idx)
    cached = torch.cuda.memory_reserved(idx) - torch.cuda.memory_allocated(idx)
    return int(free + max(0, cached))


def format_bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
