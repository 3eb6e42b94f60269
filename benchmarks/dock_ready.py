"""Dock open -> "ready", and -> its second encoder process ready, in a fresh napari process.

    xvfb-run -a python benchmarks/dock_ready.py

One measurement per process (the first dock of a process is the one users open). To compare
two versions, run it alternately from each tree (for instance an older commit checked out
with ``git worktree add`` and put first on ``PYTHONPATH``) and compare the medians.
"""
import os
import sys
import time
from pathlib import Path

os.environ["NAPARI_GPUSEG_ENCODER_PROCESS"] = "1"
os.environ.setdefault("OMP_NUM_THREADS", "2")
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    import napari
    from qtpy.QtWidgets import QApplication

    import napari_gpuseg
    from _machine import machine_line
    from _viewer import pump

    viewer = napari.Viewer(show=True)
    app = QApplication.instance()
    t0 = time.perf_counter()
    _dock, w = viewer.window.add_plugin_dock_widget("napari-gpuseg", "SAM annotator")
    pump(app, lambda: "ready" in w.status.text(), 300)
    ready = time.perf_counter() - t0
    slot = w._encoder_slot
    pump(app, lambda: slot.process is not None and (slot.process.ready or slot.process.state != "starting"), 300)
    proc = time.perf_counter() - t0
    print(machine_line())
    print(f"{Path(napari_gpuseg.__file__).parent}: ready {ready:.2f} s ({w.status.text()}); "
          f"second process {slot.process.state if slot.process else 'none'} {proc:.2f} s; "
          f"tile here {slot.here_seconds or float('nan'):.3f} s, there "
          f"{(slot.process.tile_seconds if slot.process else None) or float('nan'):.3f} s", flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
