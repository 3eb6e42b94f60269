"""Peak memory of each folder-job method per input pixel value (the memory guard's estimate).

Each method runs in a fresh process: load, warm up on a small image, then segment one
large uint16 image (BBBC039 tiled) while a thread samples the RSS every 2 ms. Prints
(peak RSS - RSS before) / pixel values, and the raw bytes the guard used to compare.

    python benchmarks/method_memory.py [--size 2048] [--methods threshold,unet,sam-boxes]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from _data import shared_data  # noqa: E402  (benchmarks/, the script's folder)
DATA = shared_data() / "bbbc039" / "images"

CHILD = r"""
import json, sys, threading, time
import numpy as np, psutil, tifffile, torch
from pathlib import Path
from napari_gpuseg.engine.jobs.method_registry import create_method
from napari_gpuseg.engine.runtime.device import Policy
torch.set_num_threads(2)
name, size, src = sys.argv[1], int(sys.argv[2]), sys.argv[3]
tile = tifffile.imread(src)
reps = (size // tile.shape[0] + 1, size // tile.shape[1] + 1)
big = np.ascontiguousarray(np.tile(tile, reps)[:size, :size])
seg = create_method(name)
seg.load(Policy(torch.device("cpu"), "fp32"))
def run(img):
    x = seg.prepare(img, False)
    return [seg.finish(r) for r in seg.segment([x])]
run(tile[:256, :256])
proc = psutil.Process()
base = proc.memory_info().rss
peak = [base]
stop = threading.Event()
def sample():
    while not stop.is_set():
        peak[0] = max(peak[0], proc.memory_info().rss)
        time.sleep(0.002)
t = threading.Thread(target=sample); t.start()
t0 = time.perf_counter(); run(big); dt = time.perf_counter() - t0
stop.set(); t.join()
print(json.dumps({"method": name, "values": int(big.size), "raw_bytes": int(big.nbytes),
                  "peak_delta": int(peak[0] - base), "seconds": round(dt, 2)}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=2048)
    ap.add_argument("--methods", default="threshold,unet,sam-boxes")
    args = ap.parse_args()
    src = sorted(DATA.glob("*.tif"))[0]
    print(f"{'method':12s} {'image':>12s} {'raw MiB':>8s} {'peak MiB':>9s} {'B/value':>8s} {'x raw':>6s}")
    for name in args.methods.split(","):
        out = subprocess.run([sys.executable, "-c", CHILD, name, str(args.size), str(src)],
                             capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        r = json.loads(out)
        per = r["peak_delta"] / r["values"]
        print(f"{name:12s} {args.size:>5d}x{args.size:<6d} {r['raw_bytes'] / 2**20:8.1f} "
              f"{r['peak_delta'] / 2**20:9.1f} {per:8.1f} {r['peak_delta'] / r['raw_bytes']:6.1f}")


if __name__ == "__main__":
    main()
