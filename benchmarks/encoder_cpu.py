"""CPU encoder variants, A/B in one process: LiteMedSAM's TinyViT encoder as is vs with
``channels_last`` weights and input (batch of 2 random 256x256 inputs, rounds interleaved,
median process CPU seconds and wall seconds per batch; outputs compared).

    python benchmarks/encoder_cpu.py [THREADS] [ROUNDS]
"""
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from napari_gpuseg.engine.sam.loader import load_sam_model  # noqa: E402

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
enc = load_sam_model("lite_medsam", "cpu").image_encoder.eval()
enc_cl = copy.deepcopy(enc).to(memory_format=torch.channels_last)
x = torch.rand(2, 3, 256, 256)
x_cl = x.contiguous(memory_format=torch.channels_last)
with torch.inference_mode():
    print("max abs diff", (enc(x) - enc_cl(x_cl)).abs().max().item(), flush=True)
    res = {"default": [], "channels_last": []}
    for _ in range(rounds):
        for name, m, inp in (("default", enc, x), ("channels_last", enc_cl, x_cl)):
            t0, c0 = time.perf_counter(), time.process_time()
            m(inp)
            res[name].append((time.process_time() - c0, time.perf_counter() - t0))
    for k, v in res.items():
        cpu, wall = sorted(c for c, _ in v), sorted(w for _, w in v)
        print(f"{k}: CPU s per batch of 2 {cpu[len(cpu) // 2]:.2f}, wall {wall[len(wall) // 2]:.2f}")
