"""Small OME-Zarr inputs built from real BBBC039 fields and the synthetic 3D volume."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _mosaic import field_files, write_mosaic  # noqa: E402

__all__ = ["field_files", "write_mosaic", "volume_zarr"]


def volume_zarr(shared_data: Path, out: Path, reps=(2, 2, 2), zarr_format: int = 2) -> Path:
    """An OME-Zarr ZYX volume: the synthetic 3D nuclei tiled ``reps`` times."""
    import tifffile
    import zarr
    from ome_zarr.format import FormatV04, FormatV05
    from ome_zarr.writer import write_multiscales_metadata

    vol = np.tile(tifffile.imread(shared_data / "synthetic3d" / "image.tif"), reps)
    root = zarr.open_group(str(out), mode="w", zarr_format=zarr_format)
    root.create_array("0", data=vol, chunks=(16, 64, 64))
    fmt = FormatV05() if zarr_format == 3 else FormatV04()
    write_multiscales_metadata(root, [{"path": "0", "coordinateTransformations": [
        {"type": "scale", "scale": [1.0, 1.0, 1.0]}]}], fmt=fmt, axes=["z", "y", "x"], name="volume")
    return out
