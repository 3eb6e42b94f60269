"""The annotator's preview on a stack: one edit's paint, the plane last painted kept on record vs
every other plane read and cleared (the rule before), in the same run.

    python benchmarks/preview_stack.py [--shape 60 1024 1024] [--edits 40]

A napari Labels layer (no window) holds a uint8 preview of ``--shape``. Each edit paints a
disk that moved by a pixel or two on the current plane, and every tenth edit the user is on
the next plane (the mask painted there, the plane before cleared), as when a user walks
through a stack clicking objects. The two rules alternate edit by edit (A B A B) on their own
layers; medians per edit and their ratio. The rule before is the same function with the
layer's record removed before each edit (:data:`PAINTED`), so it reads every other plane.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import machine_line  # noqa: E402
from napari.layers import Labels  # noqa: E402

from napari_gpuseg.widgets._annotation_layers import PAINTED, paint_preview  # noqa: E402


def disk(shape, cy, cx, r):
    yy, xx = np.ogrid[:shape[0], :shape[1]]
    return (yy - cy) ** 2 + (xx - cx) ** 2 <= r * r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", type=int, nargs=3, default=[60, 1024, 1024], metavar=("Z", "Y", "X"))
    ap.add_argument("--edits", type=int, default=40)
    args = ap.parse_args(argv)
    shape = tuple(args.shape)
    print(machine_line())
    print(f"preview {shape} uint8 ({np.prod(shape) / 2**20:.0f} MiB), {args.edits} edits per rule")
    layers = {rule: Labels(np.zeros(shape, np.uint8), name=f"SAM preview ({rule})")
              for rule in ("record", "every plane")}
    times = {rule: [] for rule in layers}
    rng = np.random.default_rng(0)
    cy, cx = shape[1] // 2, shape[2] // 2
    for k in range(args.edits):
        z = (k // 10) % shape[0]
        cy += int(rng.integers(-2, 3))
        cx += int(rng.integers(-2, 3))
        mask = disk(shape[1:], cy, cx, 25)
        order = list(layers) if k % 2 == 0 else list(layers)[::-1]
        for rule in order:
            layer = layers[rule]
            if rule == "every plane":
                layer.metadata.pop(PAINTED, None)
            t0 = time.perf_counter()
            paint_preview(layer, (z,), mask)
            times[rule].append(time.perf_counter() - t0)
    a, b = (statistics.median(times[r]) * 1e3 for r in ("record", "every plane"))
    assert np.array_equal(layers["record"].data, layers["every plane"].data)
    print("| rule | ms per edit (median) |")
    print("| --- | ---: |")
    print(f"| the plane last painted on record | {a:.2f} |")
    print(f"| every other plane read (before) | {b:.2f} |")
    print(f"ratio: {b / a:.1f}x faster with the record; both layers end with the same data")
    return 0


if __name__ == "__main__":
    sys.exit(main())
