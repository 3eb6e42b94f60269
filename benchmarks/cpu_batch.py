"""CPU batch size, measured (the batch runner's probe) against the fixed size it replaced.

With no batch size given, the batch runner used to send 4 items per call on a CPU; it now
times one item per call, then doubles while that is at least 10 % faster per item
(``engine/runtime/batching.py: CpuSizeProbe``). Two real workloads, each variant on a fresh
cache, rounds interleaved, median wall:

* ``sam``: every view a prompt may need on a BBBC039 field (520x696), ``nuclei_sam``
  (``SamEngine.embed``): fixed 4 views per encoder call vs the probe (vs 1 per call);
* ``unet``: the bundled U-Net over the same field (``predict_labels``, sliding windows):
  fixed 4 windows per call vs the probe.

Prints the machine line, each variant's median seconds, the size the probe settled at and
the ratio fixed / probe (above 1: the probe is faster).

    OMP_NUM_THREADS=2 python benchmarks/cpu_batch.py [--rounds 3] [--work sam,unet] [--precision auto]

``--precision`` (default fp32): ``auto`` takes the policy's CPU precision (bf16 where the
CPU has AVX512-BF16 or AMX), or name one.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import tifffile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from napari_gpuseg.engine.runtime import batching  # noqa: E402
from napari_gpuseg.engine.runtime.device import make_policy  # noqa: E402

from _data import shared_data  # noqa: E402  (benchmarks/, the script's folder)
from _machine import machine_line  # noqa: E402

POLICY = make_policy("cpu", "fp32")


def _field() -> np.ndarray:
    files = sorted((shared_data() / "bbbc039" / "images").glob("*.tif"))
    return tifffile.imread(files[-1])


def sam_variants(image):
    from napari_gpuseg.engine.sam.interactive.cache import EmbeddingCache
    from napari_gpuseg.engine.sam.loader import load_engine

    engine = load_engine(policy=POLICY)
    views = engine.prompt_views(engine.prepare(image))
    sizes = {}

    def run(batch_size):
        def go():
            batching.forget_batch_sizes()
            engine.cache = EmbeddingCache()
            engine.embed([image], [views], batch_size=batch_size)
            sizes[batch_size] = batching.remembered_batch_size(
                ("sam-encoder", engine.info.name, engine.input_size, POLICY.precision, "cpu"))
        return go

    print(f"sam: {len(views)} views of a {image.shape[0]}x{image.shape[1]} field, {engine.info.name}, "
          f"{POLICY.precision}")
    return {"fixed 4": run(4), "probe": run(None), "fixed 1": run(1)}, sizes


def unet_variants(image):
    from napari_gpuseg.engine.unet import unet_checkpoint as checkpoint, predict

    model = checkpoint.load_unet(None, device="cpu")

    def run(batch_size):
        def go():
            batching.forget_batch_sizes()
            predict.predict_labels(model, image, sw_batch_size=batch_size, policy=POLICY)
        return go

    print(f"unet: the bundled U-Net on a {image.shape[0]}x{image.shape[1]} field")
    return {"fixed 4": run(4), "probe": run(None)}, {}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", default="sam,unet")
    ap.add_argument("--precision", default="fp32", help="fp32 (default), bf16, or auto (the policy's)")
    args = ap.parse_args()
    global POLICY
    POLICY = make_policy("cpu", None if args.precision == "auto" else args.precision)
    print(machine_line())
    image = _field()
    for work in args.work.split(","):
        variants, sizes = (sam_variants if work == "sam" else unet_variants)(image)
        for fn in variants.values():  # one untimed pass each: one-time setup out of the rounds
            fn()
        times = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, fn in variants.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        med = {name: statistics.median(v) for name, v in times.items()}
        for name, v in times.items():
            print(f"  {name:8s} median {med[name]:6.2f} s  ({', '.join(f'{t:.2f}' for t in v)})")
        if sizes.get(None):
            print(f"  the probe settled at {sizes[None]} per call")
        print(f"  ratio fixed 4 / probe: {med['fixed 4'] / med['probe']:.2f}x")


if __name__ == "__main__":
    main()
