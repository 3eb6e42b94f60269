"""Training examples for SAM decoder fine-tuning: embedded views and their objects.

Each example is one of the engine's own views of a training image (the native-resolution
tiles a click is decoded in), embedded once by the frozen image encoder through
:meth:`SamEngine.embed` (so a disk-backed embedding cache makes a rerun skip the encoder),
with the instance labels cut and resized the way the view's pixels were: a model is
trained on exactly the inputs it sees in the annotator.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ...runtime.cancel import CancelToken, ProgressFn, check
from ..interactive.views import View, zoom_grid

MIN_AREA = 12  # px at the model input: smaller objects are not training targets


@dataclass
class TrainView:
    """One embedded view: ``embedding`` (C, h, w) fp16 on the CPU (or, where the encoder's
    last stages train, the encoder trunk's output (L, C'), see :func:`trunk_features`),
    ``labels`` (S, S) int32 instance ids at the model input (0 outside the image), ``ids``
    the objects that lie whole inside the view (the training targets), ``source`` the
    image's index."""

    embedding: torch.Tensor
    labels: np.ndarray
    ids: np.ndarray
    source: int
    view: View


def check_pair(image: np.ndarray, labels: np.ndarray, where: str) -> np.ndarray:
    """Instance labels for ``image`` as int64; ``ValueError`` naming ``where`` when the
    shapes differ or the labels are not whole non-negative numbers."""
    lab = np.asarray(labels)
    img = np.asarray(image)
    if lab.ndim != 2:
        raise ValueError(f"{where}: labels must be 2D (Y, X), got shape {lab.shape}")
    if img.shape[:2] != lab.shape:
        raise ValueError(f"{where}: image {img.shape} and labels {lab.shape} differ in size")
    if lab.dtype.kind == "f":
        if not np.isfinite(lab).all() or (lab != np.round(lab)).any():
            raise ValueError(f"{where}: labels hold non-integer values (need instance ids)")
    elif lab.dtype.kind not in "iub":
        raise ValueError(f"{where}: labels dtype {lab.dtype} is not an integer type")
    if lab.dtype.kind in "if" and (lab < 0).any():
        raise ValueError(f"{where}: labels hold negative ids")
    if lab.dtype == np.uint64 and lab.size and lab.max() > np.iinfo(np.int64).max:
        _, lab = np.unique(lab, return_inverse=True)  # keep every id, sequentially
        lab = lab.reshape(np.asarray(labels).shape)
    return lab.astype(np.int64)


def view_labels(labels: np.ndarray, view: View) -> np.ndarray:
    """Labels of ``view`` at the model input: cropped, resized (nearest) to the view's
    resized size, zero-padded to (S, S), as :func:`inputs.view_input` does to pixels."""
    crop = labels[view.y0:view.y1, view.x0:view.x1]
    rh, rw = view.resized_hw
    if (rh, rw) != crop.shape:
        rows = np.minimum(((np.arange(rh) + 0.5) * crop.shape[0] / rh).astype(int), crop.shape[0] - 1)
        cols = np.minimum(((np.arange(rw) + 0.5) * crop.shape[1] / rw).astype(int), crop.shape[1] - 1)
        crop = crop[rows][:, cols]
    s = view.input_size
    out = np.zeros((s, s), dtype=np.int32)
    out[:rh, :rw] = crop
    return out


def whole_objects(labels: np.ndarray, view: View, image_shape: tuple[int, int],
                  input_labels: np.ndarray) -> np.ndarray:
    """Ids of objects that lie whole inside ``view`` (cut only by the image's own border)
    and cover at least :data:`MIN_AREA` input pixels."""
    crop = labels[view.y0:view.y1, view.x0:view.x1]
    cut = set()
    if view.y0 > 0:
        cut.update(np.unique(crop[0]))
    if view.y1 < image_shape[0]:
        cut.update(np.unique(crop[-1]))
    if view.x0 > 0:
        cut.update(np.unique(crop[:, 0]))
    if view.x1 < image_shape[1]:
        cut.update(np.unique(crop[:, -1]))
    ids, counts = np.unique(input_labels, return_counts=True)
    keep = (ids != 0) & (counts >= MIN_AREA)
    return np.array([i for i in ids[keep] if i not in cut], dtype=np.int64)


POLARITIES = ("as-is", "both", "invert", "random")


def invert_image(image: np.ndarray) -> np.ndarray:
    """The image with dark and light swapped over its own range (``lo + hi - x``; 255 - x
    for uint8, which the engine divides by 255), in its dtype: the engine's min-max
    normalisation then sees exactly the inverted picture. NaNs stay NaN."""
    a = np.asarray(image)
    if a.dtype == bool:
        return ~a
    if a.dtype == np.uint8:
        return 255 - a
    if a.dtype.kind == "f":
        lo, hi = np.nanmin(a), np.nanmax(a)
        return (lo + hi - a).astype(a.dtype)
    lo, hi = int(a.min()), int(a.max())
    return (lo + hi - a.astype(np.int64)).astype(a.dtype)


def gamma_image(image: np.ndarray, gamma: float) -> np.ndarray:
    """Contrast changed by ``gamma`` on the image's own range (uint8 stays uint8 on 0-255,
    every other dtype becomes float32 in [0, 1], which the engine reads the same way)."""
    a = np.asarray(image)
    if a.dtype == np.uint8:
        return np.clip(np.round(255.0 * (a / 255.0) ** gamma), 0, 255).astype(np.uint8)
    f = a.astype(np.float32)
    lo, hi = np.nanmin(f), np.nanmax(f)
    n = np.clip((f - lo) / max(float(hi - lo), 1e-12), 0, 1)
    return (n ** gamma).astype(np.float32)


def intensity_variants(image: np.ndarray, polarity: str, contrast_jitter: float,
                       rng: np.random.Generator) -> list[np.ndarray]:
    """The pictures of one training image that are embedded: ``polarity`` "as-is" (the
    image), "invert" (dark and light swapped), "both" (the two) or "random" (one of the
    two, evenly); with ``contrast_jitter`` g > 1 each gets a random gamma in [1/g, g]
    (log-uniform). The encoder stays frozen, so a variant is one more embedded picture."""
    if polarity not in POLARITIES:
        raise ValueError(f"polarity must be one of {', '.join(POLARITIES)}, got {polarity!r}")
    flip = rng.random() < 0.5  # drawn always, so the draws do not depend on the option
    out = []
    if polarity in ("as-is", "both") or (polarity == "random" and not flip):
        out.append(image)
    if polarity in ("invert", "both") or (polarity == "random" and flip):
        out.append(invert_image(image))
    if contrast_jitter and contrast_jitter > 1:
        gammas = np.exp(rng.uniform(-1, 1, size=len(out)) * np.log(contrast_jitter))
        out = [gamma_image(im, float(g)) for im, g in zip(out, gammas)]
    return out


ORIENTATIONS = 8  # the square's symmetries: four quarter turns, each mirrored or not


def orient(image: np.ndarray, labels: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``image`` (Y, X[, C]) and its ``labels`` in orientation ``k`` of :data:`ORIENTATIONS`:
    ``k % 4`` quarter turns, mirrored left-right when ``k >= 4`` (k = 0: as they are).
    Microscopy has no up or down, so a turned picture is one more true example; the frozen
    encoder sees it as a new picture (one more embedding)."""
    if not 0 <= int(k) < ORIENTATIONS:
        raise ValueError(f"orientation must be 0-{ORIENTATIONS - 1}, got {k}")
    im, lab = np.rot90(image, int(k) % 4, axes=(0, 1)), np.rot90(labels, int(k) % 4, axes=(0, 1))
    if k >= 4:
        im, lab = im[:, ::-1], lab[:, ::-1]
    return np.ascontiguousarray(im), np.ascontiguousarray(lab)


def orientations_of(n: int, rng: np.random.Generator) -> list[int]:
    """``n`` distinct orientations for one picture: as it is, then ``n - 1`` of the other
    seven at random (no draw when ``n`` is 1)."""
    if not 1 <= int(n) <= ORIENTATIONS:
        raise ValueError(f"orientations must be 1-{ORIENTATIONS}, got {n}")
    if n == 1:
        return [0]
    return [0] + sorted(int(k) for k in rng.permutation(np.arange(1, ORIENTATIONS))[: int(n) - 1])


def candidate_views(engine, prepared, zoom: float) -> list[View]:
    """The views of one image at ``zoom`` (model input px per image px): the engine's grid
    at 1, else a grid of tiles ``input_size / zoom`` px a side, upscaled to the input (the
    views clicks are decoded in when the model's ``click_zoom`` is ``zoom``)."""
    if zoom == 1.0:
        return engine.views(prepared)
    return zoom_grid(prepared.shape, engine.input_size, zoom, capped=True)  # as click views are


def collect_views(engine, images: Sequence[np.ndarray], labels: Sequence[np.ndarray],
                  views_per_image: int | Sequence[int | None] | None = None, rng: np.random.Generator | None = None,
                  progress: ProgressFn = None, cancel: CancelToken | None = None,
                  zooms: Sequence[float] = (1.0,), polarity: str | Sequence[str] = "as-is",
                  contrast_jitter: float = 1.0, trunk: int = 0, orientations: int = 1) -> list[TrainView]:
    """Embedded training views of every image (at most ``views_per_image`` each per zoom,
    chosen at random among the views that hold at least one whole object; None = all; a
    sequence gives one number per image), at every scale in ``zooms`` (see
    :func:`candidate_views`), of each picture :func:`intensity_variants` makes of it
    (``polarity``: one value, or one per image), each in ``orientations`` orientations
    (:func:`orientations_of`: 1 = as it is; up to 8). All pictures of an image share its
    ``source`` index, so a validation split by image keeps them together. ``trunk`` > 0:
    keep the encoder trunk's output before its last ``trunk`` stages instead of the
    embedding (:func:`trunk_features`)."""
    if len(images) != len(labels):
        raise ValueError(f"{len(images)} images but {len(labels)} label images")
    rng = rng or np.random.default_rng(0)
    per = (list(views_per_image) if isinstance(views_per_image, (list, tuple))
           else [views_per_image] * len(images))
    if len(per) != len(images):
        raise ValueError(f"{len(per)} views-per-image numbers for {len(images)} images")
    pol = [polarity] * len(images) if isinstance(polarity, str) else list(polarity)
    if len(pol) != len(images):
        raise ValueError(f"{len(pol)} polarity values for {len(images)} images")
    for i, (image, lab) in enumerate(zip(images, labels)):  # every pair before any embedding
        check_pair(image, lab, f"image {i}")
        if pol[i] not in POLARITIES:
            raise ValueError(f"polarity must be one of {', '.join(POLARITIES)}, got {pol[i]!r}")
    variant_rng = np.random.default_rng(int(rng.integers(1 << 31)) if pol.count("as-is") < len(pol)
                                        or contrast_jitter > 1 else 0)
    orient_rng = np.random.default_rng(int(rng.integers(1 << 31))) if orientations > 1 else None
    out: list[TrainView] = []
    for i, (image, lab) in enumerate(zip(images, labels)):
        check(cancel)
        lab = check_pair(image, lab, f"image {i}")
        pictures = ([image] if pol[i] == "as-is" and not contrast_jitter > 1
                    else intensity_variants(image, pol[i], contrast_jitter, variant_rng))
        for picture in pictures:
            for k in orientations_of(orientations, orient_rng):
                pic, plab = orient(picture, lab, k) if k else (picture, lab)
                out += _embed_picture(engine, pic, plab, i, per[i], rng, zooms, cancel, trunk)
        if progress:
            progress(i + 1, len(images))
    return out


def _embed_picture(engine, image, lab, i, n_views, rng, zooms, cancel, trunk=0) -> list[TrainView]:
    """The embedded views of one picture of image ``i`` (see :func:`collect_views`)."""
    out: list[TrainView] = []
    prepared = engine.prepare(image)
    picked = []
    for zoom in zooms:
        found = []
        for view in candidate_views(engine, prepared, float(zoom)):
            vl = view_labels(lab, view)
            ids = whole_objects(lab, view, prepared.shape, vl)
            if len(ids):
                found.append((view, vl, ids))
        if n_views and len(found) > n_views:
            order = rng.permutation(len(found))[:n_views]
            found = [found[k] for k in sorted(order)]
        picked += found
    if trunk and picked:
        feats = trunk_features(engine, prepared, [v for v, _, _ in picked], cancel, stages=trunk)
        return [TrainView(f, vl, ids, i, view) for f, (view, vl, ids) in zip(feats, picked)]
    if picked:
        engine.embed([prepared], [[v for v, _, _ in picked]], cancel=cancel)
    for view, vl, ids in picked:
        emb = engine.embedding(prepared, view).to("cpu", torch.float16)
        out.append(TrainView(emb, vl, ids, i, view))
    return out


def trunk_features(engine, prepared, views: Sequence[View], cancel: CancelToken | None = None,
                   batch: int = 4, stages: int = 1) -> list[torch.Tensor]:
    """The encoder trunk's output (every stage but the last ``stages``:
    ``image_encoder.trunk``, TinyViT only) for each of ``views``, (L, C') fp16 on the CPU, in
    the policy's precision as the engine embeds: training the last stages starts from these
    (the embedding itself would already hold the stages being trained). Not cached: they
    belong to one training run."""
    from ..interactive.inputs import view_input

    enc, policy = engine.sam.image_encoder, engine.policy
    out = []
    for start in range(0, len(views), batch):
        check(cancel)
        x = torch.stack([view_input(prepared, v, engine.info.normalization) for v in views[start:start + batch]])
        with torch.inference_mode(), policy.autocast():
            tokens, _hw = enc.trunk(x.to(policy.device), stages)
        out += [t.to("cpu", torch.float16).clone() for t in tokens]
    return out
