"""Wall time of one call, the device's queued work included."""
import time

from napari_gpuseg.engine.runtime.device import synchronize


def timed(fn, device):
    """(seconds, result) of ``fn()``, with the device synchronised before and after."""
    synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    synchronize(device)
    return time.perf_counter() - t0, out
