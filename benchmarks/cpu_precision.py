"""The device policy's precision on this CPU, and what it buys: the default model's encoder
(LiteMedSAM's TinyViT, one 256 px view, random input) in fp32 and in bf16 through the
policy's autocast, interleaved in one process.

    OMP_NUM_THREADS=2 python benchmarks/cpu_precision.py [--rounds 7] [--batch 1]

Prints the CPU, its flags, torch's version, whether the CPU computes bf16 natively
(``models/cpu_bf16.cpu_has_fast_bf16``: torch's own query; a torch without one, as 2.3,
gets fp32), the precision ``auto`` picks, the median time per batch in each
precision, the ratio fp32 / bf16 and the largest difference between the two outputs. On a
CPU without AVX512-BF16 or AMX bf16 is emulated and slower: the policy keeps fp32 there.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import cpu_flags, cpu_name  # noqa: E402
from napari_gpuseg.engine.runtime.device import make_policy  # noqa: E402
from napari_gpuseg.engine.sam.loader import load_sam_model  # noqa: E402
from napari_gpuseg.models.cpu_bf16 import cpu_has_fast_bf16  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args(argv)
    print(f"{cpu_name()} ({cpu_flags()}), {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d')}")
    print(f"fast bf16: {cpu_has_fast_bf16()}; the policy picks {make_policy('cpu').precision}")
    enc = load_sam_model("lite_medsam", torch.device("cpu")).image_encoder.eval()
    x = torch.rand(args.batch, 3, 256, 256, generator=torch.Generator().manual_seed(0))
    policies = {p: make_policy("cpu", p) for p in ("fp32", "bf16")}
    times: dict[str, list[float]] = {p: [] for p in policies}
    out = {}
    with torch.inference_mode():
        for p, pol in policies.items():  # warm-up: oneDNN builds its kernels on the first call
            with pol.autocast():
                out[p] = enc(x).float()
        for _ in range(args.rounds):
            for p, pol in policies.items():
                t0 = time.perf_counter()
                with pol.autocast():
                    enc(x)
                times[p].append(time.perf_counter() - t0)
    med = {p: statistics.median(v) for p, v in times.items()}
    diff = (out["fp32"] - out["bf16"]).abs().max().item()
    print(f"encoder, batch {args.batch}: fp32 {med['fp32'] * 1000:.0f} ms, bf16 {med['bf16'] * 1000:.0f} ms "
          f"(medians of {args.rounds}); fp32 / bf16 {med['fp32'] / med['bf16']:.2f}x; "
          f"largest output difference {diff:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
