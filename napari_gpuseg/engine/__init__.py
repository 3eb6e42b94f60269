"""napari-gpuseg's engine as a Python API (no Qt, no napari).

SAM (Segment Anything):

- ``load_engine(model=DEFAULT_MODEL, policy=None)`` -> :class:`SamEngine`: load a SAM
  checkpoint (the default, ``cells_nuclei_sam`` or None, is LiteMedSAM's encoder with the
  shipped decoder tuned on whole cells and nuclei; ``"nuclei_sam"`` the nuclei-only decoder
  before it; ``"lite_medsam"`` the published model) onto the policy's device.
- ``SamEngine``: one SAM model on one device; ``engine.predict(image, [Prompt(...)])``
  returns one :class:`MaskResult` per prompt.
- ``Prompt``: one object's prompt: points ``(K, 2)`` x, y with labels, and/or a box
  ``x0, y0, x1, y1``.
- ``MaskResult``: a mask with its predicted IoU; ``result.full((H, W))`` gives the
  full-size boolean mask.
- ``AnnotationSession(engine)``: annotate an image object by object without a window:
  ``set_image``, ``click(x, y)``, ``box(x0, y0, x1, y1)``, ``commit()``, ``undo()``,
  ``set_plane(z)``, ``labels``; asynchronous forms for a GUI (the SAM annotator dock is one).
- ``FolderAnnotation(AnnotationSession(engine), in_dir, out_dir)``: go through a folder of
  images with the annotator:
  ``next()``, ``previous()``, ``skip()``, ``goto(i)``, ``commit()``, ``undo()``; labels saved to
  ``OUT/<name>_labels.tif`` as they change, progress kept in ``OUT``, reopening resumes; the next
  image is read and embedded in the background.
- ``segment_everything(engine, image, channel=None)``: instance labels of everything SAM
  finds from a grid of point prompts.
- ``segment_boxes(engine, image, boxes, channel=None)``: instance labels from box prompts ``(N, 4)``.

Every entry point that takes an image (these two, ``predict_probabilities``,
``predict_labels``) takes it as folder jobs take an image file: colour is detected (a last
axis of 3 or 4 values), ``channel=N`` picks one channel of a multichannel image, and a
multichannel image without it is refused with the same one-line message.

- ``finetune_sam(images, labels, model="nuclei_sam", config=None, out_path=None)`` with
  ``SamTuneConfig`` (steps, objects per step, learning rate, time limit, ...):
  fine-tune the decoder (prompt encoder + mask decoder) on your labelled images with
  simulated clicks; the saved decoder file loads with ``load_engine(path)``.

U-Net:

- ``load_unet(path=None, device=None)``: a U-Net checkpoint (None = the bundled nuclei
  model) ready for prediction.
- ``load_checkpoint(path)``: read a U-Net checkpoint file (``weights_only=True``) as a dict.
- ``predict_probabilities(model, image)``: background / interior / boundary probabilities
  for a 2D/3D image or stack of any size (tiled sliding-window inference).
- ``probabilities_to_labels(probs)``: instance labels from those probabilities.
- ``predict_labels(model, image)``: both steps at once.
- ``train_unet(images, labels, config=None, out_path=None)``: train a U-Net on image /
  label pairs and save the best checkpoint.

Folders, devices, background work:

- ``run_folder(in_dir, out_dir, method="unet", cluster=None)``: segment every image of a
  folder into label TIFFs, per-object CSVs and a report; returns the run's report. ``cluster``:
  None (this process), ``"local"`` (a LocalCluster on 127.0.0.1), ``"slurm"``, a scheduler
  address ``"tcp://HOST:PORT"``, a ``ClusterSpec`` or a ``distributed.Client``: the same
  per-file step runs either way, so the outputs are the same.
- ``run_folder_dask(client, in_dir, out_dir, method="unet")``: the same folder job with
  its files spread over a Dask cluster (``connect_cluster`` gives the client).
- ``connect_cluster(cluster="local" | "slurm", scheduler=None, config=None)`` (or
  ``ClusterSpec``): a Dask client
  on a LocalCluster, an existing scheduler or SLURM (dask-jobqueue).
- ``run_blocks(image, out_dir, method="unet", cluster=None)``: a big image (a zarr
  store's path, ``napari_gpuseg.io.zarr_images.open_zarr(path)``, or any
  array via ``engine.blocks.ArraySource``) segmented in blocks with a halo, seams stitched, labels written
  block by block to OME-Zarr with the per-object table.
- ``get_policy()``: the process-wide device and precision in use.
- ``make_policy(device=None, precision=None)``: a device/precision policy (e.g. ``"cpu"``,
  ``"cuda:1"``; ``"fp32"``, ``"bf16"``, ``"fp16"``).
- ``InferenceWorker``: one background thread that owns models and runs submitted jobs
  by priority.
- ``CancelToken``: a thread-safe flag that stops a long operation between steps.
- ``configure_allocator()``: on Linux with glibc, keep freed memory in the process heap
  (``mallopt``), as the CLI and the plugin's workers do on a CPU. A script that runs the
  engine on a CPU calls it once at its start: box mode over 8 whole 520x696 fields ran
  1.37x faster with it on a 2-core AVX2 CPU (docs/benchmarks.md). It changes the whole process
  and cannot be undone, so importing the package never does it.

Every name is imported on first use, so ``import napari_gpuseg.engine`` stays cheap.
"""
from __future__ import annotations

import importlib

# public name -> (module relative to this package, attribute name there)
_EXPORTS: dict[str, tuple[str, str]] = {
    "SamEngine": (".sam.interactive.predictor", "SamEngine"),
    "Prompt": (".sam.interactive.predictor", "Prompt"),
    "MaskResult": (".sam.interactive.predictor", "MaskResult"),
    "load_engine": (".sam.loader", "load_engine"),
    "segment_everything": (".sam_api", "segment_everything"),
    "segment_boxes": (".sam_api", "segment_boxes"),
    "AnnotationSession": (".annotate.session", "AnnotationSession"),
    "FolderAnnotation": (".annotate.folder", "FolderAnnotation"),
    "finetune_sam": (".sam.training.finetune", "finetune_sam"),
    "SamTuneConfig": (".sam.training.tune_config", "SamTuneConfig"),
    "load_unet": (".unet.unet_checkpoint", "load_unet"),
    "load_checkpoint": (".unet.unet_checkpoint", "load_checkpoint"),
    "predict_probabilities": (".unet.predict", "predict_probabilities"),
    "probabilities_to_labels": (".unet.predict", "probabilities_to_labels"),
    "predict_labels": (".unet.predict", "predict_labels"),
    "train_unet": (".unet.training", "train_unet"),
    "run_folder": (".jobs.pipeline", "run_folder"),
    "run_folder_dask": (".jobs.dask_runner", "run_folder_dask"),
    "connect_cluster": (".jobs.clusters", "connect"),
    "ClusterSpec": (".jobs.clusters", "ClusterSpec"),
    "run_blocks": (".jobs.block_jobs", "run_blocks"),
    "get_policy": (".runtime.device", "get_policy"),
    "make_policy": (".runtime.device", "make_policy"),
    "InferenceWorker": (".runtime.worker", "InferenceWorker"),
    "CancelToken": (".runtime.cancel", "CancelToken"),
    "configure_allocator": (".runtime.allocator", "configure_allocator"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    try:
        module, attr = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module, __name__), attr)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
