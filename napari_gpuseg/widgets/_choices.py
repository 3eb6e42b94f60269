"""Choices several docks offer: SAM models (with a *Browse* entry) and layers by kind."""
from __future__ import annotations

import logging

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


def sam_model_names() -> list[str]:
    """The default SAM model first, then the other known ones."""
    try:
        from ..models import registry

        names = list(registry.list_models())
    except Exception:  # registry problems must not break the dock
        logger.exception("could not list the known SAM models")
        names = []
    if DEFAULT_MODEL in names:
        names.remove(DEFAULT_MODEL)
    return [DEFAULT_MODEL] + names


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
