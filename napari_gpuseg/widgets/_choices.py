"""Choices several docks offer: SAM models (with a *Browse* entry) and layers by kind."""
from __future__ import annotations

import functools
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


def adapted_label(entry: dict) -> str:
    """How the model lists show an adapted decoder: its name and the image it came from."""
    image = entry.get("image")
    return f"{entry['name']} (from {Path(str(image)).name})" if image else str(entry["name"])


def adapted_sam_choices(folder=None) -> list[tuple[str, str]]:
    """``(label, path)`` of the user's adapted decoders (``engine.sam.training.adapt.adapted_models``),
    newest first."""
    try:
        from ..engine.sam.training.adapt import adapted_models

        entries = adapted_models(folder)
    except Exception:  # an unreadable list must not break the dock
        logger.exception("could not list the adapted SAM decoders")
        return []
    return [(adapted_label(e), e["path"]) for e in entries]


_SAM_COMBOS: "weakref.WeakSet" = weakref.WeakSet()


def fill_sam_models(combo: QComboBox, browse: bool = True) -> None:
    """The SAM model list every dock shows: the known models (the default first), the user's
    adapted decoders newest first (shown as ``name (from image)``, the file as the item's
    data: :func:`chosen_sam_model`), then *Browse* (with ``browse``). A decoder adapted
    later joins every list filled here (:func:`offer_adapted_sam`)."""
    combo.addItems(sam_model_names())
    for label, path in adapted_sam_choices():
        combo.addItem(label, path)
    if browse:
        combo.addItem(BROWSE)
    _SAM_COMBOS.add(combo)


def chosen_sam_model(combo: QComboBox) -> str:
    """The model a list from :func:`fill_sam_models` has chosen: a name, or a file (an
    adapted decoder's entry shows its name and holds its file)."""
    return combo.currentData() or combo.currentText()


def add_adapted_choice(combo: QComboBox, path: str, label: str) -> int:
    """Put the adapted decoder ``path`` in ``combo`` as ``label``, first of the adapted ones
    (the newest), unless it is there; its index. The current choice stays (no signals)."""
    index = combo.findData(path)
    if index >= 0:
        return index
    first = next((i for i in range(combo.count()) if combo.itemData(i)), combo.findText(BROWSE))
    first = first if first >= 0 else combo.count()
    combo.blockSignals(True)
    try:
        combo.insertItem(first, label, path)
    finally:
        combo.blockSignals(False)
    return first


def offer_adapted_sam(path: str, label: str) -> int:
    """A decoder adapted just now joins every open model list (:func:`fill_sam_models`),
    none of them switching to it; how many took it."""
    n = 0
    for combo in list(_SAM_COMBOS):
        try:
            add_adapted_choice(combo, path, label)
            n += 1
        except RuntimeError:  # a combo whose Qt object is gone
            logger.debug("a closed model list missed adapted decoder %s", path)
    return n


def withdraw_adapted_sam(path: str) -> int:
    """A forgotten adapted decoder (``engine.sam.training.adapt.forget_adapted``) leaves every
    open model list (:func:`fill_sam_models`); a list that had it chosen goes to the default
    model as if the user picked it, so its dock applies it. How many lists held it."""
    n = 0
    for combo in list(_SAM_COMBOS):
        try:
            index = combo.findData(path)
            if index < 0:
                continue
            chosen = combo.currentIndex() == index
            combo.removeItem(index)
            n += 1
            if chosen:
                default = max(0, combo.findText(DEFAULT_MODEL))
                combo.setCurrentIndex(default)
                combo.activated.emit(default)
        except RuntimeError:  # a combo whose Qt object is gone
            logger.debug("a closed model list still held adapted decoder %s", path)
    return n


def model_kind(model: str) -> str:
    """How a SAM model name or file takes prompts, judged without building the network:
    ``"boxes"`` (LiteMedSAM as published), ``"tuned"`` (a decoder tuned to clicks on
    microscopy: ``nuclei_sam``, a file Adapt SAM or ``train-sam`` wrote) or ``"points"``.
    A file is read once per modification, not on every redraw of a dock."""
    path = Path(str(model))
    stamp = path.stat().st_mtime_ns if path.is_file() else None
    return _model_kind(str(model), stamp)


@functools.lru_cache(maxsize=32)
def _model_kind(model: str, _stamp) -> str:
    try:
        from ..models import registry

        if model in registry.MODELS:
            spec = registry.get_spec(model)
            return "boxes" if spec.prompts == "boxes" else "tuned" if spec.base is not None else "points"
        if registry.read_if_decoder(model) is not None:
            return "tuned"
    except Exception:  # noqa: BLE001 - an unreadable file: judge by the name
        logger.debug("could not inspect model %s", model, exc_info=True)
    return "boxes" if "medsam" in model.lower() else "points"


def is_box_trained(model: str) -> bool:
    """Whether a model responds to boxes only, so the docks steer users to boxes."""
    return model_kind(model) == "boxes"


def is_decoder_tuned(model: str) -> bool:
    """Whether a model is a decoder tuned to clicks, whose segment-everything settings differ."""
    return model_kind(model) == "tuned"


def automatic_defaults(model: str):
    """Segment-everything settings for a model name or file (``AutomaticParams.for_model``)."""
    from ..engine.sam.automatic.everything import AutomaticParams

    kind = model_kind(model)
    return AutomaticParams.for_model(kind == "boxes", kind == "tuned")


def image_file(layer) -> str | None:
    """The file an image layer was opened from, if any."""
    path = getattr(getattr(layer, "source", None), "path", None)
    return str(path) if path and Path(str(path)).is_file() else None


def layer_array(layer) -> np.ndarray:
    """The full-resolution pixels of a layer as a numpy array (multiscale: level 0)."""
    data = layer.data[0] if getattr(layer, "multiscale", False) else layer.data
    return np.asarray(data)


def _layer_class(kind):
    """The napari layer class named ``kind`` ("Image", "Labels", "Shapes"), or ``kind`` itself."""
    if isinstance(kind, str):
        import napari.layers

        return getattr(napari.layers, kind)
    return kind


def layer_names(viewer, kind) -> list[str]:
    """Names of the viewer's layers of ``kind`` (a napari layer class, or its name), subclasses
    included."""
    if viewer is None:
        return []
    cls = _layer_class(kind)
    return [lyr.name for lyr in viewer.layers if isinstance(lyr, cls)]


def fill_layer_combos(viewer, pairs, prefer_active: bool = False) -> None:
    """Refill each (combo box, layer kind) with the viewer's layer names of that kind,
    keeping the current choice where that layer still exists (no change signals while
    refilling). With ``prefer_active`` a combo without a choice takes the active layer when
    it is of that kind, else the newest one."""
    for combo, kind in pairs:
        current = combo.currentText()
        names = layer_names(viewer, kind)
        combo.blockSignals(True)
        try:
            combo.clear()
            combo.addItems(names)
            if current in names:
                combo.setCurrentText(current)
            elif names and prefer_active:
                active = viewer.layers.selection.active
                combo.setCurrentText(active.name if isinstance(active, _layer_class(kind)) else names[-1])
        finally:
            combo.blockSignals(False)


def watch_layers(viewer, callback) -> None:
    """Call ``callback`` now and whenever a layer is added to or removed from ``viewer``."""
    if viewer is not None:
        for ev in (viewer.layers.events.inserted, viewer.layers.events.removed):
            ev.connect(callback)
    callback()


_MODEL_USERS: dict[str, "weakref.WeakSet"] = {"sam": weakref.WeakSet(), "unet": weakref.WeakSet()}


def take_sam_models(dock) -> None:
    """Register ``dock`` (which has ``use_sam_model(path)``) for SAM models other docks make."""
    _MODEL_USERS["sam"].add(dock)


def take_unet_models(dock) -> None:
    """Register ``dock`` (which has ``use_model(path)``) for U-Net checkpoints other docks make."""
    _MODEL_USERS["unet"].add(dock)


def _offer(kind: str, method: str, path: str) -> int:
    n = 0
    for dock in list(_MODEL_USERS[kind]):
        try:
            getattr(dock, method)(path)
            n += 1
        except RuntimeError:  # a dock whose Qt object is gone
            logger.debug("a closed dock missed model %s", path)
    return n


def offer_sam_model(path: str) -> int:
    """Hand a new SAM checkpoint (e.g. from Adapt SAM) to every registered dock; returns
    how many took it."""
    return _offer("sam", "use_sam_model", path)


def offer_unet_model(path: str) -> int:
    """Hand a new U-Net checkpoint (e.g. from Adapt U-Net) to every registered dock: U-Net
    predict selects it, Batch folder takes it when its method is a U-Net method."""
    return _offer("unet", "use_model", path)
