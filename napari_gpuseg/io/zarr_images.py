"""Reading zarr and OME-Zarr images lazily, block by block.

:func:`open_zarr` opens an OME-Zarr image (NGFF 0.4 on zarr v2 or 0.5 on zarr v3: the
full-resolution level of its multiscales), a zarr group holding one array, or a bare zarr
array, and returns a :class:`ZarrImage`: the spatial image (YX or ZYX, one channel, one
time point) as a picklable reader of regions, so that dask workers reopen it themselves.
Layouts that cannot be read as such an image (a plate, several arrays and no metadata, a
time series, an unknown axis) raise :class:`ZarrLayoutError` with a one-line reason.
GUI-free and torch-free.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import ImageReadError

ZARR_MARKERS = (".zgroup", ".zarray", "zarr.json")


class ZarrLayoutError(ImageReadError):
    """A zarr store this program cannot read as a YX or ZYX image."""

    kind = "zarr-layout"


def is_zarr(path: str | os.PathLike) -> bool:
    """True for a folder that is a zarr group or array (v2 or v3)."""
    p = Path(path)
    return p.is_dir() and any((p / m).is_file() for m in ZARR_MARKERS)


def find_stores(folder: str | os.PathLike, recursive: bool = False, exclude=()) -> list[Path]:
    """The zarr stores inside ``folder`` (its subfolders too with ``recursive``; never inside
    a store, nor in the ``exclude`` folders), sorted by path."""
    root = Path(folder)
    skip = {Path(e).resolve() for e in exclude}
    found: list[Path] = []

    def walk(d: Path) -> None:
        try:
            children = sorted(c for c in d.iterdir() if c.is_dir())
        except OSError:
            return
        for c in children:
            if c.resolve() in skip:
                continue
            if is_zarr(c):
                found.append(c)
            elif recursive:
                walk(c)

    if root.is_dir() and not is_zarr(root):
        walk(root)
    return found


def _axis_names(axes) -> list[str]:
    return [a["name"] if isinstance(a, dict) else str(a) for a in axes]


def _ome_attrs(attrs: dict) -> dict:
    return attrs.get("ome", attrs) if isinstance(attrs.get("ome"), dict) else attrs


@dataclass(frozen=True)
class ZarrImage:
    """A spatial image inside a zarr store.

    ``array_path``: the array within the store (e.g. ``"0"``); ``axes``: the array's axis
    names; ``lead``: the fixed index of each non-spatial axis (channel, time);
    ``spatial_axes``: the positions of the z/y/x axes. ``ome``: True for OME-Zarr (labels
    then go to its ``labels/`` group); ``zarr_format``: 2 or 3; ``ngff``: the NGFF version.
    """

    path: str
    array_path: str
    axes: tuple[str, ...]
    full_shape: tuple[int, ...]
    lead: tuple[tuple[int, int], ...]  # (axis position, index)
    spatial_axes: tuple[int, ...]
    dtype: str
    ome: bool = False
    zarr_format: int = 2
    ngff: str = ""
    scale: tuple[float, ...] = ()
    translation: tuple[float, ...] = ()  # with scale: pixel -> world of the level read (all axes)
    units: tuple[str, ...] = ()  # each axis's unit ("" when none)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.full_shape[a] for a in self.spatial_axes)

    @property
    def spatial_names(self) -> tuple[str, ...]:
        return tuple(self.axes[a] for a in self.spatial_axes)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize

    def array(self):
        """The zarr array (opened read-only)."""
        import zarr

        return zarr.open_array(self.path, path=self.array_path or None, mode="r")

    def read(self, region: tuple[slice, ...], array=None) -> np.ndarray:
        """The spatial ``region`` (slices over :attr:`shape`) as a numpy array."""
        arr = self.array() if array is None else array
        index: list = [slice(None)] * len(self.full_shape)
        for pos, i in self.lead:
            index[pos] = i
        for pos, sl in zip(self.spatial_axes, region):
            index[pos] = sl
        return np.asarray(arr[tuple(index)])

    def identity(self) -> dict:
        """What a resumed block run must find unchanged: the store (its resolved path), the
        array and the channel/time point read, and the name, size and modification time of
        every file of the array (its chunks: rewritten pixels change them). Reads no pixels."""
        root = Path(self.path).resolve()
        top = root / self.array_path if self.array_path else root
        digest = hashlib.sha1()
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames.sort()
            for name in sorted(filenames):
                f = os.path.join(dirpath, name)
                try:
                    st = os.stat(f)
                except OSError:
                    continue
                digest.update(f"{os.path.relpath(f, top)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        return {"store": str(root), "array": self.array_path, "lead": [list(p) for p in self.lead],
                "dtype": self.dtype, "files": digest.hexdigest()}

    def to_dask(self):
        """The spatial image as a lazy dask array (chunks of the store)."""
        import dask.array as da

        arr = da.from_zarr(self.array())
        index: list = [slice(None)] * len(self.full_shape)
        for pos, i in self.lead:
            index[pos] = i
        return arr[tuple(index)]


def _fail(path, reason: str):
    raise ZarrLayoutError(path, f"unsupported zarr layout: {reason}")


def _transforms(transforms, n: int) -> tuple[list[float], list[float]]:
    """(scale, translation) of a list of NGFF coordinate transformations on ``n`` axes."""
    scale, shift = [1.0] * n, [0.0] * n
    for t in transforms or []:
        if t.get("type") == "scale" and len(t.get("scale") or []) == n:
            s = [float(v) for v in t["scale"]]
            scale = [a * b for a, b in zip(scale, s)]
            shift = [a * b for a, b in zip(shift, s)]
        elif t.get("type") == "translation" and len(t.get("translation") or []) == n:
            shift = [a + float(b) for a, b in zip(shift, t["translation"])]
    return scale, shift


def _from_axes(path, array_path, arr, names, channel, scale, ome, fmt, ngff, translation=(),
               units=()) -> ZarrImage:
    names = [n.lower() for n in names]
    if len(names) != arr.ndim:
        _fail(path, f"{len(names)} axes in the metadata for a {arr.ndim}-D array")
    unknown = [n for n in names if n not in ("t", "c", "z", "y", "x")]
    if unknown:
        _fail(path, f"axis {unknown[0]!r} (only t, c, z, y, x are read)")
    lead = []
    for pos, n in enumerate(names):
        size = int(arr.shape[pos])
        if n == "t":
            if size > 1:
                _fail(path, f"a time series of {size} points (open one time point as its own image)")
            lead.append((pos, 0))
        elif n == "c":
            c = 0 if channel is None else int(channel)
            if not 0 <= c < size:
                _fail(path, f"channel {c} asked for, the image has {size}")
            lead.append((pos, c))
    if "c" not in names and channel is not None and int(channel) != 0:  # as a gray TIFF: only 0
        _fail(path, f"channel {int(channel)} asked for, the image has 1")
    spatial = tuple(pos for pos, n in enumerate(names) if n in ("z", "y", "x"))
    if [names[p] for p in spatial] not in (["y", "x"], ["z", "y", "x"]):
        _fail(path, f"spatial axes {''.join(names[p] for p in spatial)} (need yx or zyx)")
    if np.dtype(arr.dtype).kind not in "uif":
        _fail(path, f"data type {arr.dtype}")
    return ZarrImage(str(path), array_path, tuple(names), tuple(int(s) for s in arr.shape), tuple(lead),
                     spatial, str(np.dtype(arr.dtype)), ome, fmt, ngff, tuple(scale), tuple(translation),
                     tuple(units))


def open_zarr(path: str | os.PathLike, channel: int | None = None) -> ZarrImage:
    """Open the image in the zarr store at ``path`` (see the module docstring).
    ``channel``: which channel of a multi-channel image (default 0)."""
    import zarr

    path = Path(path)
    if not path.exists():
        raise ZarrLayoutError(path, "no such zarr store")
    if not is_zarr(path):
        _fail(path, "not a zarr store (no .zgroup, .zarray or zarr.json)")
    try:
        node = zarr.open(str(path), mode="r")
    except Exception as exc:  # noqa: BLE001 - damaged metadata
        _fail(path, f"cannot be opened ({type(exc).__name__}: {exc})")
    fmt = int(node.metadata.zarr_format)
    if isinstance(node, zarr.Array):
        names = {2: "yx", 3: "zyx"}.get(node.ndim)
        if names is None:
            _fail(path, f"a bare {node.ndim}-D array without axis metadata (need 2-D YX or 3-D ZYX)")
        return _from_axes(path, "", node, list(names), channel, (1.0,) * node.ndim, False, fmt, "")
    attrs = _ome_attrs(dict(node.attrs))
    if "plate" in attrs or "well" in attrs:
        _fail(path, "an HCS plate or well (open one field's image group)")
    ms = attrs.get("multiscales")
    if ms:
        m = ms[0]
        ds = m.get("datasets") or []
        if not ds:
            _fail(path, "multiscales without datasets")
        level = ds[0]["path"]
        try:
            arr = node[level]
        except KeyError:
            _fail(path, f"multiscales level {level!r} is missing")
        axes = m.get("axes") or []
        names = _axis_names(axes) or list("tczyx"[-arr.ndim:])
        units = [str(a.get("unit") or "") if isinstance(a, dict) else "" for a in axes] or [""] * arr.ndim
        # the level's transformations, then the multiscales' own: pixel -> world in one
        scale, shift = _transforms(ds[0].get("coordinateTransformations"), arr.ndim)
        m_scale, m_shift = _transforms(m.get("coordinateTransformations"), arr.ndim)
        scale = [a * b for a, b in zip(scale, m_scale)]
        shift = [a * b + c for a, b, c in zip(shift, m_scale, m_shift)]
        ngff = str(m.get("version") or attrs.get("version") or "")
        return _from_axes(path, level, arr, names, channel, scale, True, fmt, ngff, shift, units)
    arrays = [k for k, _ in node.arrays()]
    if len(arrays) != 1:
        _fail(path, f"a group of {len(arrays)} arrays without OME multiscales metadata "
                    "(cannot tell which is the image)")
    arr = node[arrays[0]]
    names = {2: "yx", 3: "zyx"}.get(arr.ndim)
    if names is None:
        _fail(path, f"a {arr.ndim}-D array without axis metadata (need 2-D YX or 3-D ZYX)")
    return _from_axes(path, arrays[0], arr, list(names), channel, (1.0,) * arr.ndim, False, fmt, "")
