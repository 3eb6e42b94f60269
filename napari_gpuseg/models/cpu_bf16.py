"""What the CPU can do fast, asked of torch (no GUI, no engine: the networks' layer)."""
from __future__ import annotations

import torch


def cpu_has_fast_bf16() -> bool:
    """True when the CPU runs bf16 matmuls natively (AMX tiles or AVX512-BF16), as torch
    itself tells. A torch without these queries (2.3 has neither) gets False, whatever the
    CPU's flags say: on a Zen 4 with AVX512-BF16, torch 2.3.1 ran the encoder 1.88x faster in
    bf16, but part-way through the GUI-free tests a bf16 linear layer of the mask decoder
    failed there (oneDNN's "could not create a primitive", once a segmentation fault); in
    fp32 they all pass."""
    checks = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    for name in checks:
        fn = getattr(torch.cpu, name, None)
        try:
            if fn is not None and fn():
                return True
        except Exception:  # pragma: no cover - exotic builds
            continue
    return False
