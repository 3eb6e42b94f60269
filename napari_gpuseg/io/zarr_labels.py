"""Writing label images to OME-Zarr block by block.

:func:`create_labels` makes (or reopens, to resume) an empty uint32 labels array whose
chunks are the blocks' cores, so each block writes whole chunks of its own and no two
writers touch one chunk: into the input's ``labels/<name>`` group when the input is
OME-Zarr (NGFF "image-label", in the input's zarr format), else as a labels image of its
own. The array's attributes say who wrote it and whether it is complete. GUI-free,
torch-free.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .label_files import OUTPUT_TAG


@dataclass(frozen=True)
class LabelsTarget:
    """Where a labels image goes: the store, the group inside it, and its shape."""

    store: str  # the zarr store (the input's, or a new one)
    group: str  # the labels image group within the store ("" = the root)
    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    axes: tuple[str, ...]
    scale: tuple[float, ...]
    zarr_format: int = 2
    translation: tuple[float, ...] = ()  # the image's, so the labels lie on it in a viewer
    units: tuple[str, ...] = ()  # each axis's unit ("" when none)

    @property
    def array_path(self) -> str:
        return f"{self.group}/0" if self.group else "0"

    def open(self, mode: str = "r+"):
        import zarr

        return zarr.open_array(self.store, path=self.array_path, mode=mode)

    def location(self) -> str:
        return str(Path(self.store) / self.group) if self.group else self.store


def _fmt(zarr_format: int):
    from ome_zarr.format import FormatV04, FormatV05

    return FormatV05() if zarr_format == 3 else FormatV04()


def store_stem(path) -> str:
    """The name of a store's outputs: its folder name without ``.ome.zarr`` / ``.zarr``
    (``mosaic.v3.zarr`` -> ``mosaic.v3``, ``m.ome.zarr`` -> ``m``); "image" without a path."""
    name = Path(str(path)).name if path else ""
    low = name.lower()
    for suffix in (".ome.zarr", ".zarr"):
        if low.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)]
    return name or "image"


def labels_target(image, out_dir: str | os.PathLike, name: str, chunks, into_input: bool = True) -> LabelsTarget:
    """The target for labels of ``image`` (a :class:`~napari_gpuseg.io.zarr_images.ZarrImage` or
    anything with ``shape``): ``IMAGE/labels/NAME`` for OME-Zarr input when ``into_input``,
    else ``OUT/<stem>_labels.ome.zarr``."""
    shape = tuple(int(s) for s in image.shape)
    axes = tuple(getattr(image, "spatial_names", ("z", "y", "x")[-len(shape):]))
    ome = bool(getattr(image, "ome", False))
    sp = getattr(image, "spatial_axes", None)

    def spatial(values, default):
        values = tuple(values or ())
        if len(values) == len(shape):
            return values
        return tuple(values[a] for a in sp) if sp and len(values) > max(sp) else (default,) * len(shape)

    scale = spatial(getattr(image, "scale", ()), 1.0)
    shift = spatial(getattr(image, "translation", ()), 0.0)
    units = spatial(getattr(image, "units", ()), "")
    fmt = int(getattr(image, "zarr_format", 2) or 2)
    if ome and into_input:
        return LabelsTarget(str(image.path), f"labels/{name}", shape, tuple(chunks), axes, scale, fmt, shift, units)
    stem = store_stem(getattr(image, "path", None))
    return LabelsTarget(str(Path(out_dir) / f"{stem}_labels.ome.zarr"), "", shape, tuple(chunks), axes,
                        scale, fmt, shift, units)


_GROUP_FILES = {".zgroup", ".zattrs", "zarr.json"}


def foreign_labels(target: LabelsTarget) -> str | None:
    """A one-line reason when something this program did not write is at ``target`` (hand
    annotations in the input's ``labels/`` group, another tool's labels image): it is never
    replaced, with or without overwrite. None when nothing is there, an empty group, or our
    own labels array (it carries ``OUTPUT_TAG``)."""
    loc = Path(target.location())
    if not os.path.lexists(loc):
        return None
    if loc.is_dir() and not loc.is_symlink():
        try:
            if {c.name for c in loc.iterdir()} <= _GROUP_FILES and not _has_image_meta(target):
                return None  # an empty group (e.g. a run stopped before its array was made)
        except OSError:
            pass
    try:
        if target.open("r").attrs.get(OUTPUT_TAG):
            return None
    except Exception:  # noqa: BLE001 - no array "0", not zarr, unreadable: not ours
        pass
    if target.group:
        return (f"not overwritten: {target.group} in {Path(target.store).name} exists and was not written by "
                "napari-gpuseg (move it away, or write the labels to the output folder)")
    return (f"not overwritten: {loc.name} exists and was not written by napari-gpuseg "
            "(move it away or choose another output folder)")


def _has_image_meta(target: LabelsTarget) -> bool:
    import zarr

    try:
        attrs = dict(zarr.open_group(target.location(), mode="r").attrs)
    except Exception:  # noqa: BLE001
        return False
    attrs = attrs.get("ome", attrs) if isinstance(attrs.get("ome"), dict) else attrs
    return bool(attrs.get("multiscales") or attrs.get("image-label"))


def create_labels(target: LabelsTarget, info: dict, resume: bool = True):
    """The labels array of ``target``, created empty (fill 0) with its NGFF metadata; an
    existing one with the same shape and chunks is reopened as it is when ``resume``."""
    import zarr
    from ome_zarr.writer import write_label_metadata, write_multiscales_metadata

    root = zarr.open_group(target.store, mode="a", zarr_format=target.zarr_format)
    grp = root.require_group(target.group) if target.group else root
    if "0" in grp and resume:
        arr = grp["0"]
        if tuple(arr.shape) == target.shape and tuple(arr.chunks) == target.chunks:
            return arr
    names = {"dimension_names": list(target.axes)} if target.zarr_format == 3 else {}  # NGFF 0.5 asks for them
    arr = grp.create_array("0", shape=target.shape, chunks=target.chunks, dtype=np.uint32,
                           fill_value=0, overwrite=True, **names)
    fmt = _fmt(target.zarr_format)
    transforms = [{"type": "scale", "scale": [float(v) for v in target.scale]}]
    if any(target.translation):
        transforms.append({"type": "translation", "translation": [float(v) for v in target.translation]})
    axes = [{"name": a, "type": "space", **({"unit": u} if u else {})}
            for a, u in zip(target.axes, target.units or ("",) * len(target.axes))]
    label_name = target.group.split("/")[-1] or "labels"
    try:
        write_multiscales_metadata(grp, [{"path": "0", "coordinateTransformations": transforms}], fmt=fmt,
                                   axes=axes, name=label_name)
    except ValueError:  # a unit the NGFF writer does not take: the axes without units
        write_multiscales_metadata(grp, [{"path": "0", "coordinateTransformations": transforms}], fmt=fmt,
                                   axes=list(target.axes), name=label_name)
    if target.group:
        labels_grp = root["labels"]
        listed = dict(labels_grp.attrs).get("ome", dict(labels_grp.attrs)).get("labels", [])
        name = target.group.split("/")[-1]
        if name in listed:  # rewrite only this image's own metadata
            grp.attrs.update(_image_label(grp, target, fmt))
        else:
            write_label_metadata(labels_grp, name, fmt=fmt, source={"image": "../../"})
    else:
        grp.attrs.update(_image_label(grp, target, fmt))
    set_info(arr, {**info, "complete": False})
    return arr


def _image_label(grp, target, fmt) -> dict:
    attrs = dict(grp.attrs)
    meta = {"version": fmt.version}
    if target.group:  # inside the image's labels/ group: point back at the image
        meta["source"] = {"image": "../../"}
    if target.zarr_format == 3:
        ome = dict(attrs.get("ome", {}))
        ome["image-label"] = meta
        return {"ome": ome}
    return {"image-label": meta}


def set_info(arr, info: dict) -> None:
    arr.attrs[OUTPUT_TAG] = {**dict(arr.attrs.get(OUTPUT_TAG, {})), **info}


def labels_info(target: LabelsTarget) -> dict | None:
    """What this program stored in the labels array (None when it is not there / not ours)."""
    try:
        return dict(target.open("r").attrs.get(OUTPUT_TAG) or {}) or None
    except Exception:  # noqa: BLE001 - missing or not a zarr array
        return None


def open_labels_lazy(target: LabelsTarget):
    """The labels as a dask array (for a lazily read napari layer)."""
    import dask.array as da

    return da.from_zarr(target.open("r"))
