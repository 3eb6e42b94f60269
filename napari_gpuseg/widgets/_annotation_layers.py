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
    neg: Layer
    boxes: Shapes
    labels: Layer
    preview: Layer


def spatial_shape(image) -> tuple:
    """Shape of an image layer without its RGB(A) channel axis."""
    data = image.data
    return tuple(data.shape[:-1] if image.rgb else data.shape)


def ensure_layers(viewer, image) -> AnnotationLayers:
    """The annotator's layers for ``image``: the shared prompt and preview layers (made
    again only when their dimensionality does not fit; the preview takes a new shape in
    place) and ``<image> SAM labels`` (kept; a differently shaped one of the same name gets
    a new layer beside it). They end above ``image``, in the order a first drop makes them.

    Making a layer is the slow part of following a new image (napari builds its visuals
    and overlays on the GUI thread: 0.2-0.75 s per layer on a 2-core AVX2 CPU), so a layer
    that can serve the new image is kept rather than made again."""
    shape = spatial_shape(image)
    ndim = len(shape)
    layers = viewer.layers
    place = {"scale": image.scale[-ndim:], "translate": image.translate[-ndim:]}

    def shared(name: str, make: Callable[[], Layer]) -> Layer:
        if name in layers and layers[name].ndim != ndim:
            layers.remove(name)
        if name not in layers:
            make()
        return layers[name]

    pos = shared(POSITIVE, lambda: viewer.add_points(ndim=ndim, name=POSITIVE, face_color="lime", size=8))
    neg = shared(NEGATIVE, lambda: viewer.add_points(ndim=ndim, name=NEGATIVE, face_color="red", size=8))
    boxes = shared(BOXES, lambda: viewer.add_shapes(ndim=ndim, name=BOXES, edge_color="yellow",
                                                     face_color="transparent", edge_width=2))
    label_name = f"{image.name} SAM labels"
    if label_name in layers and layers[label_name].data.shape != shape:
        label_name = f"{label_name} {shape}"
    if label_name not in layers:
        viewer.add_labels(np.zeros(shape, np.int32), name=label_name, **place)
    preview = shared(PREVIEW, lambda: viewer.add_labels(np.zeros(shape, np.uint8), name=PREVIEW,
                                                         opacity=0.6, **place))
    if preview.data.shape != shape:
        preview.data = np.zeros(shape, np.uint8)
    for key, value in place.items():
        if not np.array_equal(getattr(preview, key), value):
            setattr(preview, key, value)
    ours = (pos, neg, boxes, layers[label_name], preview)
    raise_above(layers, image, ours)
    return AnnotationLayers(*ours)


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
    return lay is not None and all(ly.name in viewer.layers for ly in (lay.pos, lay.neg, lay.boxes))


def select_prompt_tool(viewer, lay: AnnotationLayers | None, boxes_first: bool) -> None:
    """Every prompt layer ready in its drawing tool (points: add, boxes: rectangle), and the
    one a user starts with active: positive clicks for a model that takes clicks, the box
    tool for a box-only model (LiteMedSAM as published). Choosing another prompt layer in
    the layer list then gives its tool at once. Nothing happens while the prompt layers
    are not (or no longer) in the viewer."""
    if not _prompt_layers_present(viewer, lay):
        return
    lay.pos.mode = "add"
    lay.neg.mode = "add"
    lay.boxes.mode = "add_rectangle"
    viewer.layers.selection.active = lay.boxes if boxes_first else lay.pos


def toggle_click_sign(viewer, lay: AnnotationLayers | None) -> None:
    """Switch the click tool between SAM positive and SAM negative (``Shift-N``): from
    either points layer to the other, from anything else to SAM negative."""
    if not _prompt_layers_present(viewer, lay):
        return
    active = viewer.layers.selection.active
    target = lay.pos if active is not None and active.name == lay.neg.name else lay.neg
    target.mode = "add"
    viewer.layers.selection.active = target
