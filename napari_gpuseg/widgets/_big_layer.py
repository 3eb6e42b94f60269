"""Lazily opened big images in the docks: a dask-backed (or zarr) image layer runs in
blocks through the engine's front door for block jobs
(:func:`napari_gpuseg.engine.jobs.block_jobs.run_blocks`) without being loaded whole,
and its result comes back as a lazily read labels layer."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

_METHODS: dict = {}  # methods loaded for block runs in this process (one load per model)


def lazy_data(layer):
    """The full-resolution data of ``layer`` when it is lazy (dask, zarr; not numpy), else None."""
    data = layer.data[0] if getattr(layer, "multiscale", False) else layer.data
    return None if isinstance(data, np.ndarray) else data


def block_source(layer, data):
    """The OME-Zarr image the layer was opened from when it is one of the same shape
    (labels then go to its ``labels/`` group), else the array itself."""
    from ..engine.blocks import ArraySource
    from ..io.zarr_images import ZarrLayoutError, is_zarr, open_zarr

    path = getattr(getattr(layer, "source", None), "path", None)
    if path and is_zarr(path):
        try:
            img = open_zarr(path)
            if img.shape == tuple(data.shape):
                return img
        except ZarrLayoutError:
            pass
    return ArraySource(data)


def out_folder(layer) -> Path:
    from platformdirs import user_data_dir

    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", layer.name) or "image"
    return Path(user_data_dir("napari-gpuseg")) / "blocks" / safe


def blocks_job(source, out_dir, method, options, name, policy, progress=None, cancel=None):
    """Runs in the inference worker: the image in blocks; returns the run's report."""
    from ..engine.jobs.block_jobs import run_blocks

    if getattr(source, "nbytes", None) is None and len(source.shape) not in (2, 3):
        raise ValueError(f"blocks take YX or ZYX images, got shape {source.shape}")
    step = (lambda phase, done, total: progress(done, total)) if progress is not None else None
    from ..engine.blocks import ArraySource

    fresh = isinstance(source, ArraySource)  # an array has no identity on disk: never resume it
    return run_blocks(source, out_dir, method, options, name=name, devices=str(policy.device),
                      precision=policy.precision, progress=step, cancel=cancel, methods=_METHODS,
                      overwrite=fresh)


def add_lazy_labels(viewer, report, layer, name: str):
    """Add (or replace) the labels layer ``name`` reading the run's labels lazily."""
    import dask.array as da

    data = da.from_zarr(report.open_labels())
    if name in viewer.layers:
        viewer.layers.remove(name)
    nd = data.ndim
    return viewer.add_labels(data, name=name, scale=layer.scale[-nd:], translate=layer.translate[-nd:])


def run_sam_blocks(dock, layer):
    """The SAM automatic dock on a lazily opened image: ``sam-boxes`` (detector boxes) or
    ``sam-everything`` per block; labels come back as a lazily read layer."""
    from dataclasses import asdict

    if dock.mode == "boxes":
        if dock.source not in ("auto", "threshold", "unet"):
            dock._set_status("a big (lazily opened) image takes detector boxes only, not shapes or CSV boxes")
            return None
        method = "sam-boxes"
        options = {"detector": dock.source, "padding": float(dock.padding_spin.value()),
                   "min_area": int(dock.min_area_spin.value())}
    else:
        method = "sam-everything"
        options = {k: v for k, v in asdict(dock.params()).items() if isinstance(v, (int, float, bool, str))}
    options.update(model=dock.model_name, batch_size=dock.prompt_batch_spin.value() or None,
                   embed_batch_size=dock.embed_batch_spin.value() or None)
    data = lazy_data(layer)
    dock._set_status(f"running {dock.mode} on {tuple(data.shape)} in blocks…")
    dock._set_busy(True, toggle_cancel=False)

    def done(report):
        dock._set_busy(False, toggle_cancel=False)
        if report.cancelled:
            dock._set_status("cancelled (finished blocks are kept; run again to resume)")
            return
        dock.labels_layer = add_lazy_labels(dock.viewer, report, layer, f"{layer.name} SAM automatic")
        dock.last_result = report
        dock._set_status(f"{report.objects} objects in {report.blocks} blocks, {report.seconds:.1f} s")

    dock._job = dock._submit_job(
        blocks_job, block_source(layer, data), out_folder(layer), method,
        {k: v for k, v in options.items() if v is not None}, method, dock.worker.policy,
        tag="sam-automatic", on_result=done, on_error=dock._on_error, on_progress=dock._on_progress,
        on_cancelled=dock._on_cancelled)
    return dock._job
