"""Segmentation methods for folder jobs: one small interface, a registry by name.

The interface (:class:`Segmenter`, :class:`SegResult`, option specs and validation) and
the registry live here; the built-in methods in :mod:`.builtin_methods` (threshold,
U-Net) and :mod:`.sam_methods` (SAM boxes, SAM everything).

A method is a :class:`Segmenter`. The pipeline uses it like this::

    seg = create_method("threshold", model=None, batch_size=None)   # cheap: no weights yet
    x = seg.prepare(image, rgb)          # reader threads: CPU-side checks / conversion
    seg.load(policy)                     # once, inside the device worker thread
    raws = seg.segment([x1, x2, ...])    # same-shape images, one device call
    result = seg.finish(raws[0])         # writer threads: CPU post-processing -> SegResult

Adding a method (the U-Net and SAM engines do this)::

    register_method("sam-boxes", "napari_gpuseg.engine.jobs.sam_methods:SamBoxSegmenter",
                    "LiteMedSAM refines threshold/U-Net boxes")

``factory`` is a callable ``factory(**options) -> Segmenter`` or a ``"module:attribute"``
string resolved on first use, so listing methods never imports torch models. Options
are ``model`` (registry name or file), ``batch_size`` (prompts/tiles per device call,
None = automatic) and method-specific keywords. Constructing a segmenter must be cheap;
weights load in :meth:`Segmenter.load`. Third-party code can register methods from a
module given to ``napari-gpuseg batch --plugin``.

GUI-free: no Qt or napari imports here.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ...io import UnsupportedDimensionsError, is_rgb, to_gray
from ..runtime.cancel import CancelToken

# the method of folder jobs when none is named (terminal, dock, Python): the bundled U-Net
# (F1 0.93 on BBBC039 against 0.85 for the classical threshold baseline, README)
DEFAULT_FOLDER_METHOD = "unet"



def default_sam_model() -> str:
    """The SAM model of every SAM method when none is named: the annotator's
    (:data:`napari_gpuseg.engine.sam.loader.DEFAULT_MODEL`, read where it is defined)."""
    from ..sam import loader

    return loader.DEFAULT_MODEL


# measured peak memory per input pixel value while one image is segmented (bytes), for
# the memory guard of folder jobs: benchmarks/method_memory.py (docs/benchmarks.md)
BYTES_PER_VALUE = {"threshold": 40.0, "unet": 115.0, "sam": 40.0}


@dataclass(frozen=True)
class Option:
    """What a method option accepts: ``kind`` "int", "float", "bool", "str", "dict" or
    "size" (an int or a list of ints), an inclusive range, fixed ``choices``, or None."""

    kind: str
    lo: float | None = None
    hi: float | None = None
    choices: tuple = ()
    none_ok: bool = False

    def accepts(self, v) -> bool:
        if v is None:
            return self.none_ok
        if self.choices:
            return v in self.choices
        num = isinstance(v, (int, float)) and not isinstance(v, bool)
        ok = {"int": isinstance(v, int) and not isinstance(v, bool),
              "float": num, "bool": isinstance(v, bool), "str": isinstance(v, str),
              "dict": isinstance(v, dict),
              "size": (isinstance(v, int) and not isinstance(v, bool)) or (
                  isinstance(v, (list, tuple)) and bool(v)
                  and all(isinstance(x, int) and not isinstance(x, bool) for x in v))}[self.kind]
        if not ok:
            return False
        values = v if isinstance(v, (list, tuple)) else [v] if num else []
        return all((self.lo is None or x >= self.lo) and (self.hi is None or x <= self.hi)
                   for x in values)

    def describe(self) -> str:
        if self.choices:
            text = "one of " + ", ".join(map(str, self.choices))
        else:
            text = {"int": "an integer", "float": "a number", "bool": "true or false",
                    "str": "a text", "dict": "a JSON object ({...})",
                    "size": "an integer or a list of integers"}[self.kind]
            if self.lo is not None and self.hi is not None:
                text += f" in [{self.lo:g}, {self.hi:g}]"
            elif self.lo is not None:
                text += f" >= {self.lo:g}"
        return text + (" (or null)" if self.none_ok else "")


class OptionError(ValueError, TypeError):
    """A method option that the method does not take (name, type or range)."""


def check_options(method: str, options: Mapping[str, Any], spec: Mapping[str, Option]) -> None:
    """Raise :class:`OptionError` naming the first option ``spec`` does not accept (unknown name,
    wrong type, out of range): checked when a method is created, before any work."""
    unknown = sorted(set(options) - set(spec))
    if unknown:
        raise OptionError(f"{method} method: unknown option(s) {unknown}; known: {sorted(spec)}")
    for key, value in options.items():
        if not spec[key].accepts(value):
            raise OptionError(f"{method} method: option {key}={value!r} must be {spec[key].describe()}")


@dataclass
class SegResult:
    """Instance labels for one image (0 = background) and optional per-object scores.

    ``scores`` maps label id -> score, or is an array with ``scores[id - 1]``; ``notes``
    (e.g. how 3D instances were made) goes to the report row's notes.
    """

    labels: np.ndarray
    scores: Mapping[int, float] | np.ndarray | None = None
    notes: str = ""


class Segmenter:
    """Base class of a folder-job method. Subclasses override :meth:`segment` (and
    :meth:`load` when they have weights).

    Class attributes describe what the method accepts:

    - ``spatial_ndims``: spatial dimensionalities handled (2 = YX, 3 = ZYX);
    - ``accepts_rgb``: True to receive YXC RGB images as they are (SAM); False to get
      them converted to gray by :meth:`prepare` (U-Net, threshold).

    Every method takes the option ``channel`` (kept as ``self.channel``): folder jobs
    segment that channel of multichannel (and colour) images
    (:func:`napari_gpuseg.io.select_channel`).
    """

    name = "segmenter"
    spatial_ndims: tuple[int, ...] = (2,)
    accepts_rgb = False
    # the options the method takes (checked at creation, before any work); None: unchecked
    options_spec: Mapping[str, Option] | None = None
    # peak memory while one image is segmented, in bytes per pixel value of the input
    # (the memory guard of folder jobs); None: the raw pixel bytes
    bytes_per_value: float | None = None

    def __init__(self, model: str | None = None, batch_size: int | None = None, **options: Any):
        self.model = model
        self.batch_size = batch_size
        # every method takes ``channel``: the channel of multichannel images to segment
        self.channel = options.pop("channel", None)
        if self.channel is not None and not (isinstance(self.channel, int)
                                             and not isinstance(self.channel, bool) and self.channel >= 0):
            raise OptionError(f"{self.name} method: option channel={self.channel!r} must be an "
                              "integer >= 0 (the 0-based channel of multichannel images to segment)")
        self.options = options
        spec = self.option_spec()
        if spec is not None:
            check_options(self.name, options, spec)
        self.policy = None
        self.cancel: CancelToken | None = None  # set by the pipeline; check it in long loops

    # -- lifecycle ----------------------------------------------------------------
    def option_spec(self) -> Mapping[str, Option] | None:
        """The options this method accepts (default: ``options_spec``)."""
        return self.options_spec

    def load(self, policy) -> None:
        """Load weights onto ``policy.device``. Called once, in the device worker thread."""
        self.policy = policy

    def unload(self) -> None:
        """Release device memory (called when the worker thread ends)."""

    # -- per image ----------------------------------------------------------------
    def prepare(self, image: np.ndarray, rgb: bool | None = None) -> np.ndarray:
        """CPU-side conversion run in the reader threads; raises
        :class:`~napari_gpuseg.io.UnsupportedDimensionsError` for shapes it cannot take."""
        rgb = is_rgb(image) if rgb is None else rgb
        if rgb and not self.accepts_rgb:
            image, rgb = to_gray(image), False
        spatial = image.ndim - 1 if rgb else image.ndim
        if spatial not in self.spatial_ndims:
            names = {2: "YX", 3: "ZYX", 4: "TZYX"}
            ok = ", ".join(names.get(n, f"{n}-D") for n in self.spatial_ndims)
            raise UnsupportedDimensionsError(
                "image", f"method {self.name!r} takes {ok} images, got shape {tuple(image.shape)}"
            )
        return image

    def segment(self, images: Sequence[np.ndarray]) -> list:
        """Segment same-shape images (one device call where the method can).

        Returns one :class:`SegResult` per image, or one raw output per image that
        :meth:`finish` turns into a :class:`SegResult`. Every method defines it (the base
        class is the plug-in interface for user methods, which may be partly written).
        """
        raise TypeError(f"segmentation method {type(self).__name__!r} does not define segment()")

    def finish(self, raw) -> SegResult:
        """CPU post-processing of one :meth:`segment` output (e.g. probabilities ->
        instances). The pipeline runs it in its writer threads, on an unloaded instance,
        so the device worker moves on to the next batch: it must not use the weights and
        must be thread-safe. Default: ``raw`` is already a :class:`SegResult`."""
        return raw

    def describe(self) -> str:
        return self.name if not self.model else f"{self.name} ({self.model})"


class FunctionSegmenter(Segmenter):
    """Wraps ``fn(image) -> labels`` (or ``-> (labels, scores)``) as a method."""

    def __init__(self, fn: Callable, name: str = "function", spatial_ndims=(2,), **options):
        super().__init__(**options)
        self.fn = fn
        self.name = name
        self.spatial_ndims = tuple(spatial_ndims)

    def segment(self, images):
        out = []
        for img in images:
            if self.cancel is not None:
                self.cancel.check()
            res = self.fn(img, **self.options)
            out.append(res if isinstance(res, SegResult) else
                       SegResult(*res) if isinstance(res, tuple) else SegResult(res))
        return out


# ----------------------------------------------------------------------------- registry
@dataclass
class MethodSpec:
    name: str
    factory: Callable[..., Segmenter] | str
    description: str = ""
    requires: str | None = None  # module that must be importable for the method to be offered


class MethodUnavailable(RuntimeError):
    """The method is unknown or its engine module is not installed/importable."""


_registry: dict[str, MethodSpec] = {}
_lock = threading.Lock()


def register_method(
    name: str,
    factory: Callable[..., Segmenter] | str,
    description: str = "",
    requires: str | None = None,
) -> None:
    """Register (or replace) a method. ``factory``: ``callable(**options)`` or "module:attr".

    ``requires``: a module name; the method is listed only when it can be imported
    (defaults to the module of a string factory).
    """
    if isinstance(factory, str) and requires is None:
        requires = factory.split(":", 1)[0]
    with _lock:
        _registry[name] = MethodSpec(name, factory, description, requires)


def unregister_method(name: str) -> None:
    with _lock:
        _registry.pop(name, None)


def _importable(module: str | None) -> bool:
    if not module:
        return True
    if module in sys.modules:
        return True
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def available_methods(all_registered: bool = False) -> list[str]:
    """Names of methods that can be created now (or every registered name)."""
    with _lock:
        specs = list(_registry.values())
    return [s.name for s in specs if all_registered or _importable(s.requires)]


def method_description(name: str) -> str:
    with _lock:
        spec = _registry.get(name)
    return spec.description if spec else ""


def _resolve(factory: Callable[..., Segmenter] | str) -> Callable[..., Segmenter]:
    if callable(factory):
        return factory
    module, _, attr = factory.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def method_factory(name: str, **options: Any) -> Callable[[], Segmenter]:
    """A zero-argument factory for ``name`` (the pipeline makes one segmenter per device).

    ``None`` options are dropped so method defaults apply.
    """
    with _lock:
        spec = _registry.get(name)
    if spec is None:
        known = ", ".join(available_methods()) or "none"
        raise MethodUnavailable(f"unknown method {name!r}; available: {known}")
    if not _importable(spec.requires):
        raise MethodUnavailable(
            f"method {name!r} needs module {spec.requires!r}, which is not available"
        )
    try:
        make = _resolve(spec.factory)
    except (ImportError, AttributeError) as exc:
        raise MethodUnavailable(f"method {name!r} could not be loaded: {exc}") from exc
    opts = {k: v for k, v in options.items() if v is not None}

    def build() -> Segmenter:
        seg = make(**opts)
        if not isinstance(seg, Segmenter):
            raise TypeError(f"factory of {name!r} returned {type(seg).__name__}, not a Segmenter")
        return seg

    return build


def create_method(name: str, **options: Any) -> Segmenter:
    """Construct (not load) the method ``name`` with ``options``."""
    return method_factory(name, **options)()


def parse_options(items: str | Sequence[str] | None) -> dict[str, Any]:
    """``"detector=unet, points_per_side=32"`` (or a list of ``KEY=VALUE``) -> a dict;
    values are read as JSON where they parse (numbers, true/false, null), else strings."""
    import json

    if not items:
        return {}
    if isinstance(items, str):
        items = items.split(",")
    out: dict[str, Any] = {}
    for item in items:
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"method option must look like KEY=VALUE, got {item!r}")
        try:
            out[key.strip()] = json.loads(value.strip())
        except ValueError:
            out[key.strip()] = value.strip()
    return out


def load_plugin(spec: str) -> None:
    """Import a module that registers methods: a dotted module name or a ``.py`` path."""
    if spec.endswith(".py") or Path(spec).is_file():
        path = Path(spec).resolve()
        mod_name = f"napari_gpuseg_plugin_{path.stem}"
        module_spec = importlib.util.spec_from_file_location(mod_name, path)
        if module_spec is None or module_spec.loader is None:
            raise ImportError(f"cannot import plugin file {path}")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[mod_name] = module
        module_spec.loader.exec_module(module)
    else:
        importlib.import_module(spec)


# Built-in methods; string factories are imported on first use, and a method is listed
# only while the module it needs imports (the U-Net and SAM engines).
register_method("threshold", "napari_gpuseg.engine.jobs.builtin_methods:ThresholdSegmenter",
                "classical: Gaussian blur, Otsu threshold, distance-transform watershed (CPU)")
register_method("unet", "napari_gpuseg.engine.jobs.builtin_methods:UNetSegmenter", "U-Net (bundled nuclei model or a checkpoint file)",
                requires="napari_gpuseg.engine.unet.predict")
register_method("sam-boxes", "napari_gpuseg.engine.jobs.sam_methods:SamBoxSegmenter",
                "SAM (default: the annotator's model) refines detector boxes: U-Net when installed, else threshold")
register_method("sam-everything", "napari_gpuseg.engine.jobs.sam_methods:SamEverythingSegmenter",
                "SAM segment-everything from a grid of point prompts (SamAutomaticMaskGenerator parameters)")
