"""The napari layers the SAM annotator works in: prompts, committed labels, preview."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
from napari.layers import Layer, Shapes

POSITIVE, NEGATIVE, BOXES, PREVIEW = "SAM positive", "SAM negative", "SAM boxes", "SAM preview"


@dataclass
class AnnotationLayers:
    pos: Layer
    neg: Layer | None  # None or gone from the viewer: made again by :func:`add_rest` when needed
    boxes: Shapes
    labels: Layer | None  # idem
    preview: Layer


def spatial_shape(image) -> tuple:
    """Shape of an image layer without its RGB(A) channel axis."""
    data = image.data
    return tuple(data.shape[:-1] if image.rgb else data.shape)


def _shared(viewer, name: str, ndim: int, make: Callable[[], Layer] | None) -> Layer | None:
    """The layer ``name`` if it fits ``ndim`` (one that does not is removed), else a new
    one from ``make`` (None: none is made)."""
    layers = viewer.layers
    if name in layers and layers[name].ndim != ndim:
        layers.remove(name)
    if name not in layers:
        if make is None:
            return None
        make()
    return layers[name]


def _labels_name(layers, image, shape: tuple) -> str:
    name = f"{image.name} SAM labels"
    if name in layers and layers[name].data.shape != shape:
        name = f"{name} {shape}"
    return name


def _place(image) -> dict:
    ndim = len(spatial_shape(image))
    return {"scale": image.scale[-ndim:], "translate": image.translate[-ndim:]}


def _put(layer: Layer | None, place: dict) -> None:
    """Give a shared layer the image's pixel size and offset, so that its data coordinates
    are the image's pixels (a prompt on a scaled image lands on the object clicked)."""
    for key, value in place.items():
        if layer is not None and not np.array_equal(getattr(layer, key), value):
            setattr(layer, key, value)


def _make_neg(viewer, ndim: int):
    return lambda: viewer.add_points(ndim=ndim, name=NEGATIVE, face_color="red", size=8)


def ensure_layers(viewer, image) -> AnnotationLayers:
    """The annotator's layers for ``image``: the shared prompt and preview layers (made
    again only when their dimensionality does not fit; the preview takes a new shape in
    place) and ``<image> SAM labels`` (kept; a differently shaped one of the same name gets
    a new layer beside it). They end above ``image``, in the order a first drop makes them.

    Making a layer is the slow part of following a new image (napari builds its visuals
    and overlays on the GUI thread: 0.2-0.75 s per layer on a 2-core AVX2 CPU), so a layer
    that can serve the new image is kept rather than made again. :func:`add_rest` makes SAM
    negative and the labels layer again if the user deletes them later."""
    shape = spatial_shape(image)
    ndim = len(shape)
    layers = viewer.layers
    place = _place(image)
    pos = _shared(viewer, POSITIVE, ndim,
                  lambda: viewer.add_points(ndim=ndim, name=POSITIVE, face_color="lime", size=8))
    neg = _shared(viewer, NEGATIVE, ndim, _make_neg(viewer, ndim))
    boxes = _shared(viewer, BOXES, ndim, lambda: viewer.add_shapes(
        ndim=ndim, name=BOXES, edge_color="yellow", face_color="transparent", edge_width=2))
    label_name = _labels_name(layers, image, shape)
    if label_name not in layers:
        viewer.add_labels(np.zeros(shape, np.int32), name=label_name, **place)
    labels = layers[label_name] if label_name in layers else None
    preview = _shared(viewer, PREVIEW, ndim, lambda: viewer.add_labels(
        np.zeros(shape, np.uint8), name=PREVIEW, opacity=0.6, **place))
    if preview.data.shape != shape:
        preview.data = np.zeros(shape, np.uint8)
        preview.metadata.pop(PAINTED, None)
    for layer in (pos, neg, boxes, preview):
        _put(layer, place)
    lay = AnnotationLayers(pos, neg, boxes, labels, preview)
    raise_above(layers, image, [ly for ly in (pos, neg, boxes, labels, preview) if ly is not None])
    return lay


def add_rest(viewer, image, lay: AnnotationLayers, neg: bool = True, labels: bool = True) -> AnnotationLayers:
    """``lay`` with SAM negative (``neg``) and ``<image> SAM labels`` (``labels``) made
    where a first drop puts them (negative above positive, the labels under the preview),
    and the layer that was active (the user's tool) active again."""
    layers = viewer.layers
    active = layers.selection.active
    shape = spatial_shape(image)
    make_neg, make_labels = neg, labels
    neg, labels = lay.neg, lay.labels
    if make_neg and (neg is None or neg not in layers):
        neg = _shared(viewer, NEGATIVE, len(shape), _make_neg(viewer, len(shape)))
        _put(neg, _place(image))
        if lay.pos in layers:
            _move_to(layers, neg, layers.index(lay.pos) + 1)
    if make_labels and (labels is None or labels not in layers):
        name = _labels_name(layers, image, shape)
        if name not in layers:
            viewer.add_labels(np.zeros(shape, np.int32), name=name, **_place(image))
        labels = layers[name]
        if lay.preview in layers:
            _move_to(layers, labels, layers.index(lay.preview))
    if active is not None and active in layers and layers.selection.active is not active:
        layers.selection.active = active
    return AnnotationLayers(lay.pos, neg, lay.boxes, labels, lay.preview)


def _move_to(layers, layer, dest: int) -> None:
    """Move ``layer`` so that it lies just under what is at index ``dest`` now."""
    src = layers.index(layer)
    if src != dest and src != dest - 1:
        layers.move(src, dest)


def raise_above(layers, image, ours) -> None:
    """Move ``ours`` (in this order) to the top when one of them lies below ``image``: an
    image dropped beside an annotated one lands above the shared prompt layers, and its
    pixels would hide the boxes and points drawn on it."""
    below = layers.index(image)
    if all(layers.index(ly) > below for ly in ours):
        return
    for ly in ours:
        layers.move(layers.index(ly), len(layers))


def remove_on_plane(layer, index: tuple) -> None:
    """Delete the points or shapes of ``layer`` that lie on the plane ``index`` (all of
    them for a 2D image, ``index == ()``)."""
    if layer is None or len(layer.data) == 0:
        return
    shapes = isinstance(layer, Shapes)
    if not index:
        layer.data = [] if shapes else np.zeros((0, layer.ndim))
    elif shapes:
        layer.data = [d for d in layer.data if tuple(np.round(d[0, :len(index)]).astype(int)) != index]
    else:
        d = np.asarray(layer.data)
        lead = np.round(d[:, :len(index)]).astype(int)
        layer.data = d[~np.all(lead == np.asarray(index), axis=1)]


def _prompt_layers_present(viewer, lay: AnnotationLayers | None) -> bool:
    return lay is not None and all(ly.name in viewer.layers for ly in (lay.pos, lay.boxes))


def select_prompt_tool(viewer, lay: AnnotationLayers | None, boxes_first: bool) -> None:
    """Every prompt layer ready in its drawing tool (points: add, boxes: rectangle), and the
    one a user starts with active: positive clicks for a model that takes clicks, the box
    tool for a box-only model (LiteMedSAM as published). Choosing another prompt layer in
    the layer list then gives its tool at once. Nothing happens while the prompt layers
    are not (or no longer) in the viewer."""
    if not _prompt_layers_present(viewer, lay):
        return
    lay.pos.mode = "add"
    if lay.neg is not None:
        lay.neg.mode = "add"
    lay.boxes.mode = "add_rectangle"
    viewer.layers.selection.active = lay.boxes if boxes_first else lay.pos


def toggle_click_sign(viewer, lay: AnnotationLayers | None) -> None:
    """Switch the click tool between SAM positive and SAM negative (``Shift-N``): from
    either points layer to the other, from anything else to SAM negative."""
    if not _prompt_layers_present(viewer, lay) or lay.neg is None or lay.neg.name not in viewer.layers:
        return
    active = viewer.layers.selection.active
    target = lay.pos if active is not None and active.name == lay.neg.name else lay.neg
    target.mode = "add"
    viewer.layers.selection.active = target


def paint_preview(preview: Layer, index: tuple, mask: np.ndarray | None) -> None:
    """Show ``mask`` (bool, the plane's shape; None: nothing) in the preview layer's plane
    ``index`` (``()`` for a 2D image) and clear its other planes, refreshing on screen only
    the pixels that changed: napari's partial labels refresh (``data_setitem``) colours and
    uploads the bounding box of the change, where ``refresh()`` does the whole plane. A box
    edited on a 520x696 field changes an object's worth of pixels: show + repaint 41 -> 35 ms
    median on a 2-core AVX2-only EPYC (``benchmarks/first_mask.py --preview-paint alternate``).
    napari keeps each change in the layer's undo history (its last 100, the changed pixels
    only); the session's undo is the one for commits.

    On a stack, the plane last painted is kept in the layer's metadata (:data:`PAINTED`), so
    only that plane is cleared when the user moves to another: the other planes are not read
    again on every edit (a layer without the record, or with a record that does not fit its
    shape, has all its other planes cleared once)."""
    data = preview.data
    if len(index) != data.ndim - 2:  # the layer holds another image's shape (a switch under way)
        index = ()
    plane = data[index] if index else data
    if mask is not None and mask.shape != plane.shape:
        return
    if index:
        index = tuple(int(i) for i in index)
        painted = preview.metadata.get(PAINTED)
        if _fits(painted, data.shape, len(index)):
            if painted != index:
                data[painted] = 0  # not on screen: napari reads it again when it is shown
        else:
            _clear_other_planes(data, index)
        preview.metadata[PAINTED] = index
    changed = plane != (mask if mask is not None else 0)
    if not changed.any():
        return
    where = np.nonzero(changed)
    value = mask[where].astype(data.dtype) if mask is not None else data.dtype.type(0)
    at = tuple(np.full(where[0].size, i) for i in index) + where
    preview.data_setitem(at, value)


PAINTED = "napari-gpuseg painted plane"
"""The preview layer's metadata key for the stack plane :func:`paint_preview` last painted
(the only plane besides the one on screen that may hold a preview)."""


def _fits(painted, shape: tuple, n: int) -> bool:
    return (isinstance(painted, tuple) and len(painted) == n
            and all(isinstance(i, (int, np.integer)) and 0 <= i < s for i, s in zip(painted, shape)))


def _clear_other_planes(data: np.ndarray, index: tuple) -> None:
    """Zero every plane of ``data`` but ``index`` (views of the array, no copies). They are not
    on screen: napari reads them again when one is shown."""
    if not index:
        return
    i = int(index[0])
    for part in (data[:i], data[i + 1:]):
        if part.any():
            part[...] = 0
    _clear_other_planes(data[i], index[1:])
