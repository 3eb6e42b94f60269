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
    again when their dimensionality or shape does not fit) and ``<image> SAM labels``
    (kept; a differently shaped one of the same name gets a new layer beside it)."""
    shape = spatial_shape(image)
    ndim = len(shape)
    layers = viewer.layers
    place = {"scale": image.scale[-ndim:], "translate": image.translate[-ndim:]}

    def shared(name: str, fits: Callable[[Layer], bool], make: Callable[[], Layer]) -> Layer:
        if name in layers and not fits(layers[name]):
            layers.remove(name)
        if name not in layers:
            make()
        return layers[name]

    def same_ndim(ly):
        return ly.ndim == ndim

    def same_shape(ly):
        return ly.data.shape == shape

    pos = shared(POSITIVE, same_ndim,
                 lambda: viewer.add_points(ndim=ndim, name=POSITIVE, face_color="lime", size=8))
    neg = shared(NEGATIVE, same_ndim,
                 lambda: viewer.add_points(ndim=ndim, name=NEGATIVE, face_color="red", size=8))
    boxes = shared(BOXES, same_ndim,
                   lambda: viewer.add_shapes(ndim=ndim, name=BOXES, edge_color="yellow",
                                             face_color="transparent", edge_width=2))
    label_name = f"{image.name} SAM labels"
    if label_name in layers and not same_shape(layers[label_name]):
        label_name = f"{label_name} {shape}"
    if label_name not in layers:
        viewer.add_labels(np.zeros(shape, np.int32), name=label_name, **place)
    preview = shared(PREVIEW, same_shape,
                     lambda: viewer.add_labels(np.zeros(shape, np.uint8), name=PREVIEW,
                                               opacity=0.6, **place))
    return AnnotationLayers(pos, neg, boxes, layers[label_name], preview)


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
