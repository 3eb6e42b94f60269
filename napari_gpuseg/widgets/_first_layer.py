"""napari's first layers after start-up, paid for before the first drop.

The first layer napari makes in a process imports what its layers use (scipy.ndimage,
pandas for point and shape features, parts of scikit-image) and builds pint's unit
registry, all on the GUI thread. On a 2-core AVX2 machine ``add_image`` of the first field
took 0.88 s without this warm-up and 0.17 s with it (``benchmarks/first_layer.py``,
medians). The annotator opens before the drop, usually, so :func:`warm_up` does that work
then:

* :func:`import_layer_modules` runs in the dock's worker thread. A concurrent import of
  the same module on the GUI thread waits for Python's per-module import lock; it never
  runs twice.
* :func:`build_unit_registry` runs on the GUI thread: pint builds its application registry
  lazily and without a lock, so a build in another thread could race napari's own use.
"""
from __future__ import annotations

import importlib
import logging
import time

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


def warm_up(dock) -> None:
    """For an annotator ``dock`` that has just opened: the imports as a background job of
    its worker; the registry by a zero-delay timer, only while the viewer has no layer."""
    dock._submit(import_layer_modules, tag="first-layer", priority=BACKGROUND, inference=False)
    if not len(dock.viewer.layers):
        QTimer.singleShot(0, build_unit_registry)
