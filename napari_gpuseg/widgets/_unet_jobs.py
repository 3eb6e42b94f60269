"""The U-Net docks' shared parts: the prediction job (runs in the inference worker), the
training worker thread and the default checkpoint path."""
from __future__ import annotations

import time
from pathlib import Path

from ..engine.runtime.worker import InferenceWorker, default_worker

FROM_FILE = "From file…"


def predict_job(image, model_path, rgb, outputs, batch_size, overlap, tile, progress=None, cancel=None):
    """Runs in the worker thread: load (cached) model, probabilities, labels."""
    from ..engine.unet import unet_checkpoint as unet_ckpt, predict as unet

    worker = default_worker()
    key = ("unet", str(model_path or unet_ckpt.bundled_model_path()))
    # one U-Net at a time: another checkpoint releases the one loaded before (GPU memory)
    loaded = worker.model(key, lambda: unet_ckpt.load_unet(model_path, device=worker.policy.device), replace=True)
    d = loaded.config.spatial_dims
    probs = unet.predict_probabilities(loaded, image, rgb=rgb, tile=tile or None, overlap=overlap,
                                       sw_batch_size=batch_size, policy=worker.policy,
                                       progress=progress, cancel=cancel)
    out = {"spatial_dims": d}
    if "labels" in outputs:
        post = loaded.meta.get("postprocess", {})
        out["labels"] = unet.probabilities_to_labels(probs, spatial_dims=d, **post)
    if "probabilities" in outputs:
        out["probabilities"] = probs
    return out


_train_worker: InferenceWorker | None = None


def train_worker() -> InferenceWorker:
    """A dedicated thread for training jobs (one at a time)."""
    global _train_worker
    if _train_worker is None or not _train_worker.alive:
        _train_worker = InferenceWorker(name="napari-gpuseg-train")
    return _train_worker


def default_output() -> Path:
    from platformdirs import user_data_dir

    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path(user_data_dir("napari-gpuseg")) / "models" / f"unet-{stamp}.pt"
