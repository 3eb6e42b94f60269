"""What the CPU can do fast, asked of torch (no GUI, no engine: the networks' layer)."""
from __future__ import annotations

import torch


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
