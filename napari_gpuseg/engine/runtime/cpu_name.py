"""The CPU's model name, for the device line of the docks, the CLI and the benchmarks."""
from __future__ import annotations

import functools
import platform


@functools.lru_cache(maxsize=4)
def cpu_model_name(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model name (Linux: ``model name`` in ``cpuinfo``), else what ``platform``
    knows (the architecture, e.g. ``x86_64``, where it knows nothing more). Read once."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("model name") and ":" in line:
                    name = " ".join(line.split(":", 1)[1].split())
                    if name:
                        return name
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"
