"""Where the benchmarks find the real data: ``../shared/data`` beside the checkout, or
``$NAPARI_GPUSEG_SHARED_DATA`` (the rule the tests use)."""
import os
from pathlib import Path


def shared_data() -> Path:
    env = os.environ.get("NAPARI_GPUSEG_SHARED_DATA")
    path = Path(env) if env else Path(__file__).resolve().parents[1].parent / "shared" / "data"
    if not path.is_dir():
        raise SystemExit(f"real data not found at {path} (set NAPARI_GPUSEG_SHARED_DATA)")
    return path


def bbbc039_validation() -> list[tuple[Path, Path]]:
    """The last 8 BBBC039 fields (image, mask): never used for training."""
    d = shared_data() / "bbbc039"
    return [(p, d / "masks" / p.name) for p in sorted((d / "images").glob("*.tif"))[-8:]]


def dsb2018_field():
    """(image, mask) arrays of the DSB2018 validation field (``dsb2018/``)."""
    import tifffile

    d = shared_data() / "dsb2018"
    return tifffile.imread(d / "image.tif"), tifffile.imread(d / "mask.tif")
