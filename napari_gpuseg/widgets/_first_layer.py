"""napari's first layers after start-up, paid for before the first drop.

The first layer napari makes in a process imports what its layers use (scipy.ndimage,
pandas for point and shape features, parts of scikit-image) and builds pint's unit
registry, all on the GUI thread. On a 2-core AVX2 machine ``add_image`` of the first field
took 0.88 s without this warm-up and 0.17 s with it (``benchmarks/first_layer.py``,
medians). The annotator opens before the drop, usually, so :func:`warm_up` does that work
then. The docks that add a labels layer when a run ends (SAM automatic, U-Net predict)
call it as they open too: otherwise the first labels layer of a process paid the same
imports (pandas, scikit-image's colour module) and visuals when the result came in: the
window froze 0.70 s (median) at the end of a segment-everything run, 0.22 s with the
warm-up (EPYC Zen 3, 2 cores, llvmpipe; ``benchmarks/result_stall.py``). Batch folder calls
it too: opening its first result (an image and its labels, often the process's first
layers) froze the window 1.15 s, 0.47 s with the warm-up (``--docks batch``, same machine):

* :func:`import_layer_modules` runs in the dock's worker thread. A concurrent import of
  the same module on the GUI thread waits for Python's per-module import lock; it never
  runs twice.
* :func:`build_unit_registry` runs on the GUI thread: pint builds its application registry
  lazily and without a lock, so a build in another thread could race napari's own use.
* :func:`build_visuals` runs on the GUI thread too (vispy's scene graph is the GUI's): it
  makes and drops one of each vispy visual the dock's labels, points and shapes layers and
  their overlays are built from. The first of each kind in a process pays one-off work that
  later ones reuse: vispy's dash patterns for anti-aliased lines (an ``lru_cache``) and the
  parsing of each visual's shader functions. Nothing is drawn and nothing is added to the
  viewer; a vispy without one of these visuals just skips it.
* :func:`collect_garbage` ends the worker's job when the viewer has no layer yet: one full
  garbage-collector pass over what start-up and these imports left, which the first drop
  otherwise paid (0.25 s) in the middle of making the dock's layers. It holds Python's
  lock while it runs, and its cost grows with everything the process holds, so a dock
  opened beside layers (the first drop is past) skips it.
"""
from __future__ import annotations

import gc
import importlib
import logging
import time

import numpy as np

from qtpy.QtCore import QTimer

from ..engine.runtime.worker import BACKGROUND

logger = logging.getLogger(__name__)

# what napari's first Image, Points, Shapes and Labels layers import (napari 0.9)
LAYER_MODULES = ("scipy.ndimage", "scipy.special", "scipy.linalg", "pandas",
                 "skimage.color", "skimage.exposure", "skimage.util")


def import_layer_modules() -> float:
    """Import :data:`LAYER_MODULES` (each at most once per process); returns the seconds."""
    t0 = time.perf_counter()
    for name in LAYER_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:  # a napari without that dependency: nothing to warm
            logger.debug("not importable, not preloaded: %s", name)
    return time.perf_counter() - t0


def build_unit_registry() -> None:
    """Build pint's application registry now (napari's layer transforms use it)."""
    try:
        import pint

        pint.get_application_registry().pixel  # noqa: B018 - the attribute access builds it
    except Exception:  # noqa: BLE001 - a warm-up: napari builds it itself when it needs it
        logger.debug("pint registry not built ahead", exc_info=True)


_visuals_built = False


def build_visuals() -> float:
    """Make and drop one of each vispy visual napari's labels, points and shapes layers and
    their overlays use (once per process); returns the seconds it took (0 when done before)."""
    global _visuals_built
    if _visuals_built:
        return 0.0
    _visuals_built = True
    t0 = time.perf_counter()
    try:
        from vispy.scene import visuals
    except ImportError:  # pragma: no cover - napari always brings vispy
        return 0.0
    pts = np.array([[0.0, 0.0], [8.0, 0.0], [8.0, 8.0]], np.float32)
    makers = (
        lambda: visuals.Line(pos=pts, method="agg"),
        lambda: visuals.Line(pos=pts, method="gl"),
        lambda: visuals.Markers(pos=pts),
        lambda: visuals.Polygon(pos=pts, border_method="agg"),
        lambda: visuals.Ellipse(center=(0.0, 0.0), radius=(1.0, 1.0)),
        lambda: visuals.Mesh(),
        lambda: visuals.Text("0"),
        lambda: visuals.Compound([visuals.Line(pos=pts), visuals.Markers(pos=pts)]),
    )
    for make in makers:
        try:
            make()
        except Exception:  # noqa: BLE001 - a warm-up: napari makes its visuals itself anyway
            logger.debug("vispy visual not built ahead", exc_info=True)
    return time.perf_counter() - t0


def collect_garbage() -> float:
    """One full garbage-collector pass; returns the seconds it took."""
    t0 = time.perf_counter()
    gc.collect()
    return time.perf_counter() - t0


def _imports_then_collect() -> float:
    return import_layer_modules() + collect_garbage()


def warm_up(dock, submit=None) -> None:
    """For a ``dock`` that has just opened: the imports as a background job of its worker
    (``submit``, default the dock's ``_submit_job``), then (only while the viewer has no
    layer) a garbage-collector pass; the registry (only while the viewer has no layer) and
    the visuals by zero-delay timers."""
    first = not len(dock.viewer.layers)
    job = _imports_then_collect if first else import_layer_modules
    (submit or dock._submit_job)(job, tag="first-layer", priority=BACKGROUND, inference=False)
    if first:
        QTimer.singleShot(0, build_unit_registry)
    QTimer.singleShot(0, build_visuals)
