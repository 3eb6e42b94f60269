"""Choices several docks offer: SAM models (with a *Browse* entry) and layers by kind."""
from __future__ import annotations

import logging
import weakref
from pathlib import Path

import numpy as np
from qtpy.QtWidgets import QComboBox, QFileDialog, QWidget

from ..engine.sam.loader import DEFAULT_MODEL

logger = logging.getLogger("napari_gpuseg.widgets")

BROWSE = "Browse for a checkpoint…"


def browse_checkpoint(combo: QComboBox, parent: QWidget) -> bool:
    """If ``combo`` shows the *Browse* entry, ask for a checkpoint file and select it.
    False when the user cancelled (the combo is back on the default model)."""
    if combo.currentText() != BROWSE:
        return True
    path, _ = QFileDialog.getOpenFileName(parent, "SAM checkpoint", "", "Checkpoints (*.pth *.pt)")
    if not path:
        combo.setCurrentIndex(0)
        return False
    combo.insertItem(0, path)
    combo.setCurrentIndex(0)
    return True


def sam_model_names(default: str = DEFAULT_MODEL) -> list[str]:
    """``default`` (the annotator's default SAM model) first, then the other known ones."""
    try:
        from ..models import registry

        names = list(registry.list_models())
    except Exception:  # registry problems must not break the dock
        logger.exception("could not list the known SAM models")
        names = []
    if default in names:
        names.remove(default)
    return [default] + names


def is_box_trained(model: str) -> bool:
    """Whether a model name or file responds to boxes only (LiteMedSAM as published), so
    the docks steer users to boxes; judged without building the network."""
    try:
        from ..models import registry

        if model in registry.MODELS:
            return registry.get_spec(model).prompts == "boxes"
        if registry.read_if_decoder(model) is not None:  # a tuned decoder learnt clicks
            return False
    except Exception:  # noqa: BLE001 - an unreadable file: judge by the name
        logger.debug("could not inspect model %s", model, exc_info=True)
    return "medsam" in str(model).lower()


def image_file(layer) -> str | None:
    """The file an image layer was opened from, if any."""
    path = getattr(getattr(layer, "source", None), "path", None)
    return str(path) if path and Path(str(path)).is_file() else None


def layer_array(layer) -> np.ndarray:
    """The full-resolution pixels of a layer as a numpy array (multiscale: level 0)."""
    data = layer.data[0] if getattr(layer, "multiscale", False) else layer.data
    return np.asarray(data)


def layer_names(viewer, kind: str) -> list[str]:
    """Names of the viewer's layers of class ``kind`` ("Image", "Labels")."""
    if viewer is None:
        return []
    return [lyr.name for lyr in viewer.layers if lyr.__class__.__name__ == kind]


def fill_layer_combos(viewer, pairs) -> None:
    """Refill each (combo box, layer kind) with the viewer's layer names of that kind,
    keeping the current choice where that layer still exists."""
    for combo, kind in pairs:
        current = combo.currentText()
        combo.clear()
        names = layer_names(viewer, kind)
        combo.addItems(names)
        if current in names:
            combo.setCurrentText(current)


def watch_layers(viewer, callback) -> None:
    """Call ``callback`` now and whenever a layer is added to or removed from ``viewer``."""
    if viewer is not None:
        for ev in (viewer.layers.events.inserted, viewer.layers.events.removed):
            ev.connect(callback)
    callback()


_SAM_MODEL_USERS: "weakref.WeakSet" = weakref.WeakSet()


def take_sam_models(dock) -> None:
    """Register ``dock`` (which has ``use_sam_model(path)``) for models other docks make."""
    _SAM_MODEL_USERS.add(dock)


def offer_sam_model(path: str) -> int:
    """Hand a new SAM checkpoint (e.g. from Adapt SAM) to every registered dock; returns
    how many took it."""
    n = 0
    for dock in list(_SAM_MODEL_USERS):
        try:
            dock.use_sam_model(path)
            n += 1
        except RuntimeError:  # a dock whose Qt object is gone
            logger.debug("a closed dock missed model %s", path)
    return n
