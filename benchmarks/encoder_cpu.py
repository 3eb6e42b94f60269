"""CPU encoder variants, A/B in one process: LiteMedSAM's TinyViT encoder (256x256 random
input) run as

* ``plain``: the ops as written, NCHW (``NAPARI_GPUSEG_CPU_FUSION=0``; the encoder as it was);
* ``channels_last``: plain ops, channels-last input (oneDNN picks NHWC convolutions);
* ``fused_nchw``: GELU fused as below, convolutions on NCHW tensors;
* ``fused_whole``: GELU fused into the convolutions and linear layers before it (oneDNN
  post-ops), channels-last convolutions, each MBConv block over the whole grid at once and
  each attention layer over all its windows at once (the encoder before the two below);
* ``fused``: the default: as ``fused_whole``, and in fp32 the MBConv blocks of the first
  stage band of rows by band, the residual added inside the last convolution
  (``models/sam/cpu_fused.py``, ``inverted_residual_rows``), and attention a few windows at a
  time (``models/sam/tiny_vit.py``, ``ATTENTION_CHUNK_BYTES``).

Rounds interleave the variants; prints the median wall and process CPU seconds per batch,
the ratio to ``plain`` and the largest difference to ``plain``'s output.

``--precision bf16`` runs every variant inside a CPU bf16 autocast (the device policy's
precision on a CPU with AVX512-BF16 or AMX; the fused variants then take bf16 operands).
``--precision fp32,bf16`` runs each variant in both, interleaved, every ratio against
``plain`` in fp32: the same-run comparison behind the policy's choice, which is printed
too (``models/cpu_bf16.cpu_has_fast_bf16``: torch's own query; a torch without one, as 2.3,
gets fp32).

    python benchmarks/encoder_cpu.py [--threads 1,2] [--rounds 5] [--batch 1] [--size 256,256]
                                     [--precision fp32|bf16|fp32,bf16] [--variants plain,fused]
"""
import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from napari_gpuseg.engine.sam.loader import load_sam_model  # noqa: E402
from napari_gpuseg.engine.runtime.device import make_policy  # noqa: E402
from napari_gpuseg.models.cpu_bf16 import cpu_has_fast_bf16  # noqa: E402
from napari_gpuseg.models.sam import cpu_fused, tiny_vit  # noqa: E402

from _machine import cpu_flags, cpu_name  # noqa: E402  (benchmarks/, the script's folder)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--size", default="256,256", help="input H,W (box mode embeds whole fields: 520,696)")
    ap.add_argument("--precision", default="fp32", help="fp32, bf16 or both: fp32,bf16")
    ap.add_argument("--variants", default="plain,channels_last,fused_nchw,fused_whole,fused")
    args = ap.parse_args()
    precisions = args.precision.split(",")
    if not precisions or any(p not in ("fp32", "bf16") for p in precisions):
        ap.error(f"--precision takes fp32, bf16 or fp32,bf16, got {args.precision!r}")

    def precision(name):
        if name == "bf16":
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()
    enc = load_sam_model("lite_medsam", "cpu").image_encoder.eval()
    h, w = (int(v) for v in args.size.split(","))
    x = torch.rand(args.batch, 3, h, w)
    every = {
        "plain": (False, x),
        "channels_last": (False, x.contiguous(memory_format=torch.channels_last)),
        "fused_nchw": ("nchw", x),
        "fused_whole": ("whole", x),
        "fused": (True, x),
    }
    names = args.variants.split(",")
    chunk = tiny_vit.ATTENTION_CHUNK_BYTES
    variants = {(v, p): every[v] for v in names for p in precisions}
    base_key = ("plain" if "plain" in names else names[0], precisions[0])
    print(f"{cpu_name()} ({cpu_flags()}), torch {torch.__version__}, "
          f"oneDNN fused kernels available: {cpu_fused._available}, batch {args.batch}, "
          f"input {h}x{w}, {args.precision}; fast bf16: {cpu_has_fast_bf16()}, "
          f"the policy picks {make_policy('cpu').precision}")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        res: dict = {k: [] for k in variants}
        outs = {}
        with torch.inference_mode():
            for rnd in range(args.rounds + 1):  # round 0: warm-up and the outputs
                for key, (fused, inp) in variants.items():
                    cpu_fused.set_enabled(bool(fused))
                    cpu_fused.set_channels_last(fused != "nchw")
                    cpu_fused.set_row_bands(fused is True)
                    tiny_vit.ATTENTION_CHUNK_BYTES = chunk if fused is True else 1 << 62
                    t0, c0 = time.perf_counter(), time.process_time()
                    with precision(key[1]):
                        out = enc(inp)
                    if rnd:
                        res[key].append((time.perf_counter() - t0, time.process_time() - c0))
                    else:
                        outs[key] = out.float()
        cpu_fused.set_enabled(True)
        cpu_fused.set_channels_last(True)
        cpu_fused.set_row_bands(True)
        tiny_vit.ATTENTION_CHUNK_BYTES = chunk
        base = sorted(w for w, _ in res[base_key])[args.rounds // 2]
        for key, v in res.items():
            wall = sorted(w for w, _ in v)[args.rounds // 2]
            cpu = sorted(c for _, c in v)[args.rounds // 2]
            diff = (outs[key] - outs[base_key]).abs().max().item()
            print(f"threads {threads} {key[0]:>13} {key[1]}: wall {wall:.3f} s, CPU {cpu:.3f} s per batch, "
                  f"{base / wall:.2f}x {base_key[0]} {base_key[1]}, max |diff| {diff:.1e}", flush=True)


if __name__ == "__main__":
    main()
