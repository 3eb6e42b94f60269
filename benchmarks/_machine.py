"""What the benchmarks print about the machine they ran on."""
from pathlib import Path

FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def cpu_flags() -> str:
    """The CPU's vector and matrix flags that decide CPU precision and kernel choice."""
    try:
        flags = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")).split()
    except (OSError, StopIteration):
        return "flags unknown"
    return ", ".join(f for f in FLAGS if f in flags) or "no avx2"


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    from napari_gpuseg.engine.runtime.cpu_name import cpu_model_name

    return cpu_model_name()


def machine_line() -> str:
    """The line a benchmark starts with: CPU, its flags, threads, torch, date."""
    import time

    import torch

    return (f"{cpu_name()} ({cpu_flags()}), {torch.get_num_threads()} threads, "
            f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
