"""Does the GPU monitor dock slow inference? Same inference loop with and without it.

    QT_QPA_PLATFORM=offscreen python benchmarks/monitor.py

Runs a U-Net-sized convolution stack in the inference worker while the Qt event loop spins,
once with the GPU monitor dock refreshing at 2 Hz and once without (alternating, 3 rounds),
and prints the per-call cost of one refresh and the inference-time ratio.
"""
from __future__ import annotations

import os
import statistics
import time

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("OMP_NUM_THREADS", "2")

import torch  # noqa: E402
from qtpy.QtWidgets import QApplication  # noqa: E402

from napari_gpuseg.engine.runtime.device import get_policy  # noqa: E402
from napari_gpuseg.engine.runtime.worker import InferenceWorker  # noqa: E402


def main() -> None:
    app = QApplication.instance() or QApplication([])
    from napari_gpuseg.widgets.gpu_monitor import GpuMonitorWidget

    policy = get_policy()
    net = torch.nn.Sequential(*[torch.nn.Conv2d(32, 32, 3, padding=1) for _ in range(6)]).to(policy.device)
    x = torch.randn(4, 32, 256, 256, device=policy.device)
    worker = InferenceWorker(policy)

    def infer(n=8):
        for _ in range(n):
            net(x)
        if policy.device.type == "cuda":
            torch.cuda.synchronize()

    def timed(with_monitor: bool) -> float:
        mon = GpuMonitorWidget() if with_monitor else None
        t0 = time.perf_counter()
        job = worker.submit(infer)
        while not job.wait(0.005):
            app.processEvents()
        dt = time.perf_counter() - t0
        if mon is not None:
            mon.timer.stop()
            mon.deleteLater()
        return dt

    timed(False)  # warm-up
    off, on = [], []
    for _ in range(3):
        off.append(timed(False))
        on.append(timed(True))
    mon = GpuMonitorWidget()
    t0 = time.perf_counter()
    for _ in range(200):
        mon.refresh()
    refresh_ms = (time.perf_counter() - t0) / 200 * 1000
    print(f"device: {policy.describe()}")
    print(f"one monitor refresh: {refresh_ms:.2f} ms (2 per second)")
    print(f"inference without monitor: {statistics.median(off):.2f} s, with: {statistics.median(on):.2f} s, "
          f"ratio {statistics.median(on) / statistics.median(off):.3f}")
    worker.shutdown()


if __name__ == "__main__":
    main()
