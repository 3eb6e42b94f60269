"""The SAM encoder in a background thread while another thread runs Python: how much slower?

The annotator embeds in a worker thread while napari builds layers on the GUI thread (the
first second after a drop). PyTorch's eager ops release Python's lock (the GIL) while they
compute and take it back to return, so every op of the encoder's forward waits for the
other thread to hand the lock over: by default after Python's switch interval (5 ms).
This script times one encoder call (the default model's encoder, one 256x256 view, the
device policy's precision) in a worker thread, alone and beside a thread that runs pure
Python, with 2 and 1 intra-op threads and with Python's switch interval at its default
(5 ms) and at 0.2 ms; rounds interleave the cases, medians are printed with the ratio to
the encoder alone at the same thread count.

    OMP_NUM_THREADS=2 python benchmarks/encoder_contention.py [--rounds 3]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from napari_gpuseg.engine.sam.loader import load_engine  # noqa: E402

from _machine import machine_line  # noqa: E402  (benchmarks/, the script's folder)


def _busy(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(i * i for i in range(1000))


def one_call(engine, x: torch.Tensor, threads: int, busy: bool, switch: float) -> float:
    """Seconds for one encoder call in a fresh thread (as the worker's), with ``threads``
    intra-op threads, beside a pure-Python thread if ``busy``."""
    out: list[float] = []

    def run() -> None:
        torch.set_num_threads(threads)
        t0 = time.perf_counter()
        engine.encode(x)
        out.append(time.perf_counter() - t0)

    old = sys.getswitchinterval()
    sys.setswitchinterval(switch)
    stop = threading.Event()
    other = threading.Thread(target=_busy, args=(stop,)) if busy else None
    try:
        if other is not None:
            other.start()
        worker = threading.Thread(target=run)
        worker.start()
        worker.join()
    finally:
        stop.set()
        if other is not None:
            other.join()
        sys.setswitchinterval(old)
    return out[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", default=None, help="SAM model (default: the default model)")
    args = ap.parse_args()
    threads0 = torch.get_num_threads()
    print(machine_line())
    engine = load_engine(args.model) if args.model else load_engine()
    print(f"{engine.info.name} encoder, {engine.policy.device.type} {engine.policy.precision}, "
          f"one 256x256 view, {args.rounds} rounds")
    x = torch.randn(1, 3, 256, 256)
    for _ in range(2):
        engine.encode(x)  # kernels chosen, memory allocated
    thread_counts = sorted({threads0, max(1, threads0 - 1)}, reverse=True)
    cases = [(t, busy, sw) for t in thread_counts for busy, sw in
             ((False, 0.005), (True, 0.005), (True, 0.0002))]
    times: dict[tuple, list[float]] = {c: [] for c in cases}
    for _ in range(args.rounds):
        for c in cases:
            times[c].append(one_call(engine, x, *c))
    torch.set_num_threads(threads0)
    print("| intra-op threads | beside | switch interval | median s | ratio to alone |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for t, busy, sw in cases:
        med = statistics.median(times[(t, busy, sw)])
        alone = statistics.median(times[(t, False, 0.005)])
        print(f"| {t} | {'a pure-Python thread' if busy else 'nothing'} | {sw * 1000:g} ms | "
              f"{med:.3f} | {med / alone:.2f}x |")


if __name__ == "__main__":
    main()
