"""Images too big to annotate whole (a mosaic, a whole slide, a big plane of a stack).

The annotator prepares and embeds the whole plane it works on: for a 16384 x 16384 image that
is 3 GiB of normalised pixels, about 23,000 tiles, and 42 s before a first mask on a 2-core
CPU (``benchmarks/big_image.py``). Above :data:`MAX_PLANE_PX` the annotator does not start that:
it annotates a region of the image (at most :data:`REGION_SIDE` pixels a side, at least
:data:`MIN_REGION_SIDE`), read lazily (dask, zarr, a pyramid's full-resolution level stay
lazy; a region is read a plane at a time when it is needed).
"""
from __future__ import annotations

import numpy as np

MAX_PLANE_PX = 8192 * 8192
REGION_SIDE = 4096
MIN_REGION_SIDE = 512


def too_big(spatial_shape: tuple) -> bool:
    """Whether a plane of an image of ``spatial_shape`` (..., Y, X) is too big to annotate whole."""
    h, w = spatial_shape[-2:]
    return int(h) * int(w) > MAX_PLANE_PX


def span(lo: float, hi: float, size: int) -> tuple[int, int]:
    """``[lo, hi)`` as whole pixels inside ``[0, size)``, at most :data:`REGION_SIDE` long
    (kept around its centre) and at least :data:`MIN_REGION_SIDE` (or the whole axis)."""
    centre = (lo + hi) / 2
    side = int(np.clip(np.ceil(hi - lo), min(MIN_REGION_SIDE, size), min(REGION_SIDE, size)))
    start = int(np.clip(round(centre - side / 2), 0, size - side))
    return start, start + side


def lazy(data):
    """Slicing ``data`` must not read more than the region: numpy slices are views, dask
    stays lazy, anything else (zarr, a pyramid level) is wrapped in dask first."""
    if isinstance(data, np.ndarray) or type(data).__module__.startswith("dask"):
        return data
    import dask.array as da

    return da.from_array(data, chunks=getattr(data, "chunks", "auto"))


def cut(data, region: tuple[int, int, int, int], rgb: bool = False):
    """``data``'s pixels in ``region`` (y0, y1, x0, x1), every plane, lazily."""
    y0, y1, x0, x1 = region
    tail = (slice(None),) if rgb else ()
    return lazy(data)[(Ellipsis, slice(y0, y1), slice(x0, x1)) + tail]
