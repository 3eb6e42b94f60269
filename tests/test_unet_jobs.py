"""The U-Net docks' prediction job in the shared worker: one U-Net model kept at a time."""
from __future__ import annotations

import types

import numpy as np

from napari_gpuseg.engine.runtime.worker import default_worker
from napari_gpuseg.engine.unet import unet_checkpoint as unet_ckpt, predict as unet
from napari_gpuseg.widgets._unet_jobs import predict_job


def test_another_checkpoint_releases_the_unet_loaded_before(monkeypatch):
    loads = []

    def load_unet(path, device=None):
        loads.append(path)
        return types.SimpleNamespace(config=types.SimpleNamespace(spatial_dims=2), meta={})

    monkeypatch.setattr(unet_ckpt, "load_unet", load_unet)
    monkeypatch.setattr(unet, "predict_probabilities", lambda *a, **k: np.zeros((3, 8, 8), np.float32))
    worker = default_worker()

    def unets():
        return [k for k in worker.loaded_models() if isinstance(k, tuple) and k[0] == "unet"]

    for key in unets():  # other models the shared worker holds (SAM) are left alone
        worker.unload(key)
    try:
        for path in ("a.pt", "b.pt", "b.pt", "c.pt"):
            worker.submit(predict_job, np.zeros((8, 8)), path, False, ("probabilities",), 1, 0.25, 0).result(30)
        assert unets() == [("unet", "c.pt")]  # a.pt and b.pt no longer held (GPU memory)
        assert loads == ["a.pt", "b.pt", "c.pt"]  # the same checkpoint again: cached
    finally:
        for key in unets():
            worker.unload(key)
