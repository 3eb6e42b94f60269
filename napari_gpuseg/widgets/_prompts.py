"""Reading SAM prompts for the current plane out of napari Points and Shapes layers."""
from __future__ import annotations

import numpy as np

from ..engine.annotate.refine import follow_up, prompt_focus  # noqa: F401 - re-exported
from ..engine.sam.interactive.predictor import Prompt


def plane_index(image_layer, viewer) -> tuple:
    """Leading (non-YX) index of the displayed plane of ``image_layer``."""
    ndim = image_layer.data.ndim - (1 if image_layer.rgb else 0)
    if ndim <= 2:
        return ()
    step = tuple(viewer.dims.current_step)
    shape = image_layer.data.shape[: ndim - 2]
    if len(step) < ndim:  # the viewer's dims have not caught up with a just-added layer yet
        step = (0,) * (ndim - len(step)) + step
    lead = step[len(step) - ndim: len(step) - 2]
    return tuple(int(min(max(s, 0), n - 1)) for s, n in zip(lead, shape))


def plane(image_layer, index: tuple) -> np.ndarray:
    data = image_layer.data
    if hasattr(data, "__getitem__") and index:
        data = data[index]
    return np.asarray(data)


def _on_plane(coords: np.ndarray, index: tuple) -> np.ndarray:
    """Rows of ``coords`` (N, D) lying on the plane ``index`` (all rows if 2D)."""
    if not index or coords.shape[1] <= 2:
        return np.ones(len(coords), bool)
    lead = np.round(coords[:, : len(index)]).astype(int)
    return np.all(lead == np.asarray(index), axis=1)


def points_xy(layer, index: tuple) -> np.ndarray:
    """(K, 2) xy of the layer's points on the plane."""
    if layer is None or len(layer.data) == 0:
        return np.zeros((0, 2))
    data = np.asarray(layer.data)
    data = data[_on_plane(data, index)]
    return data[:, -2:][:, ::-1].astype(float)  # (row, col) -> (x, y)


def _same_place(layer, image) -> bool:
    return layer.ndim == image.ndim and all(
        np.allclose(np.asarray(getattr(layer, k)), np.asarray(getattr(image, k)))
        for k in ("scale", "translate", "rotate", "shear"))


def in_pixels_of(image, layer, coords) -> np.ndarray:
    """(N, D) data coordinates of ``layer`` as ``image``'s pixel coordinates, through world
    coordinates: a Shapes layer made by hand may have another pixel size or offset than the
    image (a new layer gets scale 1), and a rectangle must mean what it covers on screen."""
    coords = np.asarray(coords, float)
    if image is None or _same_place(layer, image):
        return coords
    return np.array([np.asarray(image.world_to_data(layer.data_to_world(c)), float) for c in coords])


def boxes_xyxy(layer, index: tuple, image=None) -> np.ndarray:
    """(N, 4) boxes (x0, y0, x1, y1) of the layer's rectangles on the plane, in the pixels
    of ``image`` when it is given (else in the layer's own data coordinates)."""
    out = []
    if layer is None:
        return np.zeros((0, 4))
    for verts, kind in zip(layer.data, layer.shape_type):
        verts = np.asarray(verts)
        if kind not in ("rectangle", "polygon") or len(verts) == 0:
            continue
        verts = in_pixels_of(image, layer, verts)
        if index and verts.shape[1] > 2 and not _on_plane(verts[:1], index)[0]:
            continue
        yx = verts[:, -2:]
        out.append([yx[:, 1].min(), yx[:, 0].min(), yx[:, 1].max(), yx[:, 0].max()])
    return np.asarray(out, float).reshape(-1, 4)


def current_prompt(pos_layer, neg_layer, box_layer, index: tuple) -> Prompt | None:
    """One object from all positive/negative points and the last box on the plane."""
    pos, neg = points_xy(pos_layer, index), points_xy(neg_layer, index)
    boxes = boxes_xyxy(box_layer, index)
    box = boxes[-1] if len(boxes) else None
    if len(pos) == 0 and box is None:
        return None  # negative points alone do not define an object
    pts = np.concatenate([pos, neg]) if len(pos) + len(neg) else None
    labels = np.concatenate([np.ones(len(pos)), np.zeros(len(neg))]).astype(int) if pts is not None else None
    return Prompt(points=pts, labels=labels, box=box)


def view_focus(viewer, layer) -> tuple[float, float] | None:
    """The (x, y) pixel of ``layer`` at the centre of the canvas (2D display), where the
    user looks before any prompt: its tiles are embedded first. None in 3D display."""
    if layer is None or viewer.dims.ndisplay != 2:
        return None
    world = np.array(viewer.dims.point, dtype=float)
    shown = list(viewer.dims.displayed)
    world[shown] = np.asarray(viewer.camera.center, dtype=float)[-len(shown):]
    try:
        y, x = np.asarray(layer.world_to_data(world), dtype=float)[-2:]
    except (ValueError, IndexError):  # a layer whose dimensions do not map (mid-change)
        return None
    return float(x), float(y)
