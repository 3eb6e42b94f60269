"""CPU encoder variants, A/B in one process: LiteMedSAM's TinyViT encoder (256x256 random
input) run as

* ``plain``: the ops as written, NCHW (``NAPARI_GPUSEG_CPU_FUSION=0``; the encoder as it was);
* ``channels_last``: plain ops, channels-last input (oneDNN picks NHWC convolutions);
* ``fused_nchw``: GELU fused as below, convolutions on NCHW tensors;
* ``fused``: the default: GELU fused into the convolutions and linear layers before it
  (oneDNN post-ops), channels-last convolutions (``models/sam/cpu_fused.py``).

Rounds interleave the variants; prints the median wall and process CPU seconds per batch,
the ratio to ``plain`` and the largest difference to ``plain``'s output.

``--precision bf16`` runs every variant inside a CPU bf16 autocast (the device policy's
precision on a CPU with AVX512-BF16 or AMX; the fused variants then take bf16 operands).

    python benchmarks/encoder_cpu.py [--threads 1,2] [--rounds 5] [--batch 1] [--size 256,256]
                                     [--precision fp32|bf16]
"""
import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from napari_gpuseg.engine.sam.loader import load_sam_model  # noqa: E402
from napari_gpuseg.models.sam import cpu_fused  # noqa: E402

from _machine import cpu_flags, cpu_name  # noqa: E402  (benchmarks/, the script's folder)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--size", default="256,256", help="input H,W (box mode embeds whole fields: 520,696)")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    args = ap.parse_args()

    def precision():
        if args.precision == "bf16":
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()
    enc = load_sam_model("lite_medsam", "cpu").image_encoder.eval()
    h, w = (int(v) for v in args.size.split(","))
    x = torch.rand(args.batch, 3, h, w)
    variants = {
        "plain": (False, x),
        "channels_last": (False, x.contiguous(memory_format=torch.channels_last)),
        "fused_nchw": ("nchw", x),
        "fused": (True, x),
    }
    print(f"{cpu_name()} ({cpu_flags()}), torch {torch.__version__}, "
          f"oneDNN fused kernels available: {cpu_fused._available}, batch {args.batch}, "
          f"input {h}x{w}, {args.precision}")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        res: dict = {k: [] for k in variants}
        outs = {}
        with torch.inference_mode(), precision():
            for name, (fused, inp) in variants.items():  # warm-up, outputs
                cpu_fused.set_enabled(bool(fused))
                cpu_fused.set_channels_last(fused != "nchw")
                outs[name] = enc(inp).float()
            for _ in range(args.rounds):
                for name, (fused, inp) in variants.items():
                    cpu_fused.set_enabled(bool(fused))
                    cpu_fused.set_channels_last(fused != "nchw")
                    t0, c0 = time.perf_counter(), time.process_time()
                    enc(inp)
                    res[name].append((time.perf_counter() - t0, time.process_time() - c0))
        cpu_fused.set_enabled(True)
        cpu_fused.set_channels_last(True)
        base = sorted(w for w, _ in res["plain"])[args.rounds // 2]
        for name, v in res.items():
            wall = sorted(w for w, _ in v)[args.rounds // 2]
            cpu = sorted(c for _, c in v)[args.rounds // 2]
            diff = (outs[name] - outs["plain"]).abs().max().item()
            print(f"threads {threads} {name:>13}: wall {wall:.3f} s, CPU {cpu:.3f} s per batch, "
                  f"{base / wall:.2f}x plain, max |diff| {diff:.1e}", flush=True)


if __name__ == "__main__":
    main()
