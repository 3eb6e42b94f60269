"""Shared helpers for the batch-folder tests: a folder mixing real and broken images."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import tifffile

# validation images of the BBBC039 split (last 8 sorted by name); small, fast, varied
REAL = ("IXMtest_N11_s4.tif", "IXMtest_O07_s6.tif", "IXMtest_P15_s3.tif")

GOOD = set(REAL) | {"rgb.png", "float_nan.tif"}
BAD = {
    "corrupt.tif": "not a readable TIFF",
    "zero.tif": "zero-byte",
    "text.tif": "not a readable TIFF",
    "five_d.tif": "unsupported shape",
    "all_nan.tif": "NaN",
    "complex.tif": "unsupported pixel type",
}


def bbbc(shared_data: Path, name: str) -> tuple[np.ndarray, np.ndarray]:
    root = shared_data / "bbbc039"
    return tifffile.imread(root / "images" / name), tifffile.imread(root / "masks" / name)


def make_mixed_folder(folder: Path, shared_data: Path) -> dict[str, np.ndarray]:
    """Write the mixed folder; returns ground-truth masks by file name (good images only)."""
    import imageio.v3 as iio

    folder.mkdir(parents=True, exist_ok=True)
    gts: dict[str, np.ndarray] = {}
    for name in REAL:
        shutil.copy(shared_data / "bbbc039" / "images" / name, folder / name)
        gts[name] = bbbc(shared_data, name)[1]
    img, gt = bbbc(shared_data, "IXMtest_M23_s8.tif")
    # RGB PNG: the nuclei in the blue channel, 8-bit
    u8 = np.clip(img.astype(np.float32) / np.percentile(img, 99.9) * 255, 0, 255).astype(np.uint8)
    rgb = np.zeros(img.shape + (3,), np.uint8)
    rgb[..., 2] = u8
    rgb[..., 1] = u8 // 2
    iio.imwrite(folder / "rgb.png", rgb)
    gts["rgb.png"] = gt
    # float image with a NaN stripe and a few infs
    img2, gt2 = bbbc(shared_data, "IXMtest_O18_s7.tif")
    f = img2.astype(np.float32)
    f[:, :8] = np.nan
    f[100, 100] = np.inf
    tifffile.imwrite(folder / "float_nan.tif", f)
    gts["float_nan.tif"] = gt2
    # the broken ones
    raw = (shared_data / "bbbc039" / "images" / REAL[0]).read_bytes()
    (folder / "corrupt.tif").write_bytes(raw[: len(raw) // 3])
    (folder / "zero.tif").write_bytes(b"")
    (folder / "text.tif").write_text("this is a text file, not an image\n")
    tifffile.imwrite(folder / "five_d.tif", np.zeros((2, 3, 2, 16, 16), np.uint8))
    tifffile.imwrite(folder / "all_nan.tif", np.full((32, 32), np.nan, np.float32))
    tifffile.imwrite(folder / "complex.tif", np.ones((16, 16), np.complex64))
    return gts


# -- a slowed method, for kill / cancel tests (also loadable with `batch --plugin FILE`) ----
import os  # noqa: E402
import time  # noqa: E402

from napari_gpuseg.engine.jobs.builtin_methods import ThresholdSegmenter  # noqa: E402
from napari_gpuseg.engine.jobs.method_registry import register_method  # noqa: E402


class SlowThreshold(ThresholdSegmenter):
    """The threshold method plus ``delay`` seconds per image (env NAPARI_GPUSEG_TEST_DELAY),
    sleeping in small steps that honour the cancel token like a real device loop."""

    name = "slow-threshold"

    def __init__(self, delay: float | None = None, **options):
        super().__init__(**options)
        self.delay = float(os.environ.get("NAPARI_GPUSEG_TEST_DELAY", "0.3") if delay is None else delay)

    def segment(self, images):
        for _ in images:
            end = time.monotonic() + self.delay
            while time.monotonic() < end:
                if self.cancel is not None:
                    self.cancel.check()
                time.sleep(0.01)
        return super().segment(images)


register_method("slow-threshold", SlowThreshold, "threshold, slowed down (tests only)")
