"""Mosaics of real BBBC039 fields written as OME-Zarr (inputs of the block benchmarks and
tests): fields of 520 x 696 uint16 placed side by side, cropped to the size asked for."""
from __future__ import annotations

from pathlib import Path

import numpy as np


def field_files(folder) -> list[Path]:
    return sorted(Path(folder).glob("*.tif"))


def write_mosaic(files, out, shape, chunks=1024, zarr_format: int = 2, scale_factors=()) -> Path:
    """Write an OME-Zarr YX (or ZYX) uint16 mosaic of ``shape`` to ``out``, field by field
    (rows of fields), never holding the whole image."""
    import tifffile
    import zarr
    from ome_zarr.format import FormatV04, FormatV05
    from ome_zarr.writer import write_multiscales_metadata

    fields = [tifffile.imread(f) for f in files]
    fh, fw = fields[0].shape
    root = zarr.open_group(str(out), mode="w", zarr_format=zarr_format)
    chunks = (chunks,) * len(shape) if isinstance(chunks, int) else tuple(chunks)
    arr = root.create_array("0", shape=tuple(shape), chunks=chunks, dtype=np.uint16, fill_value=0)
    ny, nx = shape[-2], shape[-1]
    nz = shape[0] if len(shape) == 3 else 1
    k = 0
    for z in range(nz):
        for y0 in range(0, ny, fh):
            row = np.zeros((min(fh, ny - y0), nx), np.uint16)
            for x0 in range(0, nx, fw):
                f = fields[k % len(fields)]
                k += 1
                row[:, x0:x0 + fw] = f[: row.shape[0], : min(fw, nx - x0)]
            if len(shape) == 3:
                arr[z, y0:y0 + row.shape[0], :] = row
            else:
                arr[y0:y0 + row.shape[0], :] = row
    axes = ["z", "y", "x"][-len(shape):]
    fmt = FormatV05() if zarr_format == 3 else FormatV04()
    write_multiscales_metadata(root, [{"path": "0", "coordinateTransformations": [
        {"type": "scale", "scale": [1.0] * len(shape)}]}], fmt=fmt, axes=axes, name="mosaic")
    return Path(out)
