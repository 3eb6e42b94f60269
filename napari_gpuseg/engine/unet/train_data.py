"""Training data for the U-Net: three-class targets from instance labels, image/label
pairs normalised and checked, the train/validation split, and random augmented crops."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from scipy import ndimage as ndi
from skimage.segmentation import find_boundaries

from ...models.unet import UNetConfig
from ..normalize import apply_normalization, is_color, model_input

CONTACT = 3  # training-only target value: boundary where two objects touch
IGNORE = 255  # training-only target value: not annotated, left out of the loss (labels < 0)


def contact_zone(labels: np.ndarray, width: int = 2) -> np.ndarray:
    """Object pixels within ``width`` pixels (chessboard) of a different object."""
    size = 2 * width + 1
    lab = labels.astype(np.int64)
    big = int(lab.max()) + 1  # sentinel for background (an int64 max overflows in scipy)
    hi = ndi.maximum_filter(lab, size=size)
    lo = ndi.minimum_filter(np.where(lab > 0, lab, big), size=size)
    return (lab > 0) & (lo != big) & (hi != lo)


def make_targets(labels: np.ndarray, spatial_dims: int | None = None, contact_width: int = 2,
                 mark_contacts: bool = False) -> np.ndarray:
    """Class map (uint8): 0 background, 1 interior, 2 boundary.

    Boundary = the inner one-pixel rim of every object plus, where objects touch, every
    object pixel within ``contact_width`` pixels of the other object, so interiors of
    touching objects stay apart. ``mark_contacts`` labels the contact part 3 (the loss
    weights it up and treats it as boundary).
    """
    labels = np.asarray(labels)
    spatial_dims = spatial_dims or labels.ndim
    if labels.ndim > spatial_dims:
        return np.stack([make_targets(x, spatial_dims, contact_width, mark_contacts) for x in labels])
    fg = labels > 0
    rim = find_boundaries(labels, connectivity=1, mode="inner") & fg
    out = fg.astype(np.uint8)
    out[rim] = 2
    if contact_width > 0:
        out[contact_zone(labels, contact_width)] = CONTACT if mark_contacts else 2
    return out


def prepare_pairs(images, labels, config: UNetConfig, normalization: dict) -> tuple[list, list]:
    """Normalised (C, *spatial) float32 images and class maps; stacks become slices. A
    1-channel model sees every image through :func:`~napari_gpuseg.engine.normalize.model_input`
    (RGB(A) -> luminance, bright backgrounds inverted), as in prediction."""
    d = config.spatial_dims
    xs, ys = [], []
    if len(images) != len(labels):
        raise ValueError(f"{len(images)} images but {len(labels)} label images")
    for k, (img, lab) in enumerate(zip(images, labels)):
        img, lab = np.asarray(img), np.asarray(lab)
        if img.ndim < d or lab.ndim < d:
            raise ValueError(f"pair {k + 1}: a {d}D model needs {d}D images and labels, "
                             f"got {img.shape} and {lab.shape}")
        if config.in_channels == 1:
            img = model_input(img, rgb=is_color(img, lab.shape), axis=tuple(range(-d, 0)))
            img = img[..., None, :, :] if d == 2 else img[..., None, :, :, :]
        if img.shape[-d:] != lab.shape[-d:]:
            raise ValueError(f"pair {k + 1}: image {img.shape} and labels {lab.shape} differ in shape")
        img = img.reshape((-1, config.in_channels) + img.shape[-d:])
        lab = lab.reshape((-1,) + lab.shape[-d:])
        if img.shape[0] != lab.shape[0]:
            raise ValueError("image and labels stacks differ in length")
        norm = apply_normalization(img, normalization, axis=tuple(range(-d, 0)))
        for x, y in zip(norm, lab):
            xs.append(np.ascontiguousarray(x, dtype=np.float32))
            ys.append(y.astype(np.int32))
    return xs, ys


def val_indices(n: int, val_fraction: float, seed: int = 0) -> list[int]:
    """Which of ``n`` (>= 2) images go to validation (seeded permutation)."""
    if n < 2 or val_fraction <= 0:
        return []
    n_val = min(n - 1, max(1, int(round(n * val_fraction))))  # keep one image to train on
    return sorted(np.random.default_rng(seed).permutation(n)[:n_val].tolist())


def split_train_val(xs: list, ys: list, val_fraction: float, seed: int = 0):
    """Whole images to validation when there are several; otherwise the last strip of the
    single image along its longest axis. Returns (train_x, train_y, val_x, val_y)."""
    if val_fraction <= 0:
        return xs, ys, [], []
    n = len(xs)
    if n >= 2:
        val = set(val_indices(n, val_fraction, seed))
        pick = lambda seq, inside: [v for i, v in enumerate(seq) if (i in val) == inside]  # noqa: E731
        return pick(xs, False), pick(ys, False), pick(xs, True), pick(ys, True)
    x, y = xs[0], ys[0]
    axis = int(np.argmax(y.shape))
    cut = int(round(y.shape[axis] * (1 - val_fraction)))
    if y.shape[axis] - cut < 32:
        return xs, ys, [], []
    tx, vx = np.split(x, [cut], axis=axis + 1)
    ty, vy = np.split(y, [cut], axis=axis)
    return [tx], [ty], [vx], [vy]


def train_weights(sample_weights, n_all: int, n_train: int, val_fraction: float, seed: int = 0):
    """The crop-sampling weights of the images :func:`split_train_val` left for training
    (None: sample by pixel count)."""
    if sample_weights is None:
        return None
    w = np.asarray(sample_weights, dtype=np.float64)
    if w.shape != (n_all,):
        raise ValueError(f"sample_weights: {w.shape[0] if w.ndim == 1 else w.shape} values for {n_all} images")
    if n_train == n_all:
        return w
    val = set(val_indices(n_all, val_fraction, seed))
    return np.array([v for i, v in enumerate(w) if i not in val])


def crop_tuple(crop, d: int) -> tuple[int, ...]:
    return tuple(int(c) for c in crop) if isinstance(crop, (tuple, list)) else (int(crop),) * d


def clamp_crop(crop, shapes) -> tuple[int, ...]:
    """The crop edge per dimension, at most the largest extent of ``shapes`` (the training
    images' spatial shapes) in that dimension: a crop bigger than every image would only
    add padding (``--crop 5000`` once padded batches to 5000 x 5000 and ran out of memory)."""
    shapes = [tuple(int(v) for v in sh) for sh in shapes]
    d = len(shapes[0])
    crop = crop_tuple(crop, d)
    if len(crop) != d:
        raise ValueError(f"crop {crop} has {len(crop)} dimensions, the images have {d}")
    return tuple(min(c, max(sh[i] for sh in shapes)) for i, c in enumerate(crop))


class CropDataset(torch.utils.data.Dataset):
    """Random crops with flips, rot90 (in the last two axes) and intensity jitter. The crop
    is clamped to the largest image (:func:`clamp_crop`); smaller images are padded.

    ``weights``: relative sampling weight per image (default: by pixel count).
    ``scale``: (low, high) zoom range, log-uniform; a crop of ``crop / zoom`` pixels is
    resampled to ``crop`` (image linear, labels nearest) and its targets made afresh by
    ``target_fn`` from the resampled instance labels, so ``targets`` are then instance
    labels. ``strong_intensity``: also gamma, Gaussian noise and blur.
    """

    def __init__(self, images: list, targets: list, crop, length: int, weights=None, scale=None,
                 target_fn=None, strong_intensity: bool = False) -> None:
        self.images, self.targets = images, targets
        self.crop = clamp_crop(crop, [t.shape for t in targets])
        self.length = length
        sizes = np.array([t.size for t in targets], dtype=np.float64)
        if weights is not None:
            sizes = np.asarray(weights, dtype=np.float64)
            if sizes.shape != (len(targets),) or not (sizes >= 0).all() or sizes.sum() <= 0:
                raise ValueError("weights: one non-negative number per image, not all 0")
        self.p = sizes / sizes.sum()
        self.scale = None if scale is None else (float(scale[0]), float(scale[1]))
        if self.scale is not None and target_fn is None:
            raise ValueError("scale augmentation needs target_fn (instance labels -> targets)")
        self.target_fn = target_fn
        self.strong_intensity = strong_intensity

    def __len__(self) -> int:
        return self.length

    def _window(self, rng, x, y, crop):
        pads = [(0, max(0, c - s)) for c, s in zip(crop, y.shape)]
        if any(p[1] for p in pads):
            x = np.pad(x, [(0, 0)] + pads, mode="reflect" if min(y.shape) > 1 else "constant")
            y = np.pad(y, pads, mode="constant")
        starts = [int(rng.integers(0, s - c + 1)) for s, c in zip(y.shape, crop)]
        sl = tuple(slice(a, a + c) for a, c in zip(starts, crop))
        return x[(slice(None),) + sl], y[sl]

    def __getitem__(self, index: int):
        rng = np.random.default_rng(int(torch.randint(0, 2**62, (1,)).item()))
        k = int(rng.choice(len(self.images), p=self.p))
        x, y = self.images[k], self.targets[k]
        if self.scale is None:
            x, y = self._window(rng, x, y, self.crop)
        else:
            zoom = float(np.exp(rng.uniform(np.log(self.scale[0]), np.log(self.scale[1]))))
            region = tuple(max(4, int(round(c / zoom))) for c in self.crop)
            x, y = self._window(rng, x, y, region)
            f = [c / r for c, r in zip(self.crop, region)]
            x = ndi.zoom(x, [1.0] + f, order=1, grid_mode=True, mode="grid-mirror")
            y = ndi.zoom(y, f, order=0, grid_mode=True, mode="nearest")
            x, y = x[(slice(None),) + tuple(slice(0, c) for c in self.crop)], y[tuple(slice(0, c) for c in self.crop)]
            y = self.target_fn(y)
        for ax in range(y.ndim):
            if rng.random() < 0.5:
                x, y = np.flip(x, ax + 1), np.flip(y, ax)
        if self.crop[-1] == self.crop[-2]:
            k90 = int(rng.integers(0, 4))
            x, y = np.rot90(x, k90, axes=(-2, -1)), np.rot90(y, k90, axes=(-2, -1))
        if self.strong_intensity:
            x = _intensity(rng, np.asarray(x, dtype=np.float32))
        x = x * rng.uniform(0.8, 1.2) + rng.uniform(-0.1, 0.1)
        return (torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)),
                torch.from_numpy(np.ascontiguousarray(y, dtype=np.int64)))


def _intensity(rng, x: np.ndarray) -> np.ndarray:
    """Contrast x0.35-1.3 (log-uniform, half the time: dim nuclei beside a few saturated
    ones), gamma 0.6-1.6 (half), blur sigma 0-1.2 (a third), noise sd 0-0.08 (half)."""
    if rng.random() < 0.5:
        x = x * np.float32(np.exp(rng.uniform(np.log(0.35), np.log(1.3))))
    if rng.random() < 0.5:
        x = np.clip(x, 0, None) ** rng.uniform(0.6, 1.6)
    if rng.random() < 0.33:
        sigma = [0.0] + [rng.uniform(0.0, 1.2)] * (x.ndim - 1)
        x = ndi.gaussian_filter(x, sigma)
    if rng.random() < 0.5:
        x = x + rng.normal(0.0, rng.uniform(0.0, 0.08), x.shape).astype(np.float32)
    return x


@dataclass
class TrainingData:
    """Normalised pairs, their train/validation split, crop weights and 3-class targets."""

    mcfg: UNetConfig
    xs: list
    ys: list
    tx: list
    ty: list
    vx: list
    vy: list
    weights: object
    targets: list
    has_ignore: bool
    to_targets: Callable


def prepare_training_data(images, labels, config, sample_weights) -> TrainingData:
    """The :class:`TrainingData` of ``images``/``labels`` for a :class:`~.train_config.TrainConfig`."""
    mcfg = UNetConfig.from_dict(config.model)
    xs, ys = prepare_pairs(images, labels, mcfg, config.normalization)
    if not xs:
        raise ValueError("no training data")
    if not any(int(y.max()) > 0 for y in ys):
        raise ValueError("the labels contain no objects to learn from")
    tx, ty, vx, vy = split_train_val(xs, ys, config.val_fraction, config.seed)
    weights = train_weights(sample_weights, len(xs), len(tx), config.val_fraction, config.seed)

    def to_targets(y):  # labels < 0: outside the annotated region
        return np.where(y < 0, IGNORE, make_targets(y, contact_width=config.contact_width,
                                                    mark_contacts=True)).astype(np.uint8)

    targets = [to_targets(y) for y in ty]
    has_ignore = any(bool((t == IGNORE).any()) for t in targets)  # decided here: no per-step sync
    return TrainingData(mcfg, xs, ys, tx, ty, vx, vy, weights, targets, has_ignore, to_targets)
