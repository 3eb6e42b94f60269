"""Shared pieces of the GPU-correctness tests (no GPU needed): CPU policies, a LiteMedSAM
with a cheap stand-in encoder, a test image and an autocast probe."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from napari_gpuseg.engine.runtime import batching, device as dev
from napari_gpuseg.engine.runtime.device import Policy
from napari_gpuseg.engine.runtime.worker import InferenceWorker

FP32 = Policy(torch.device("cpu"), "fp32")
BF16 = Policy(torch.device("cpu"), "bf16")


@pytest.fixture(autouse=True)
def _clean_pins():
    """No fp32 pin or remembered batch size leaks between tests (autouse where imported)."""
    dev.unpin_all()
    batching.forget_batch_sizes()
    yield
    dev.unpin_all()


@pytest.fixture
def worker_bf16():
    w = InferenceWorker(BF16, name="test-worker")
    yield w
    w.shutdown()


def stub_lite_sam():
    """A LiteMedSAM (random weights) whose image encoder is a cheap stand-in of the same
    output shape (the real encoder costs seconds per tile on a busy CPU)."""
    from napari_gpuseg.models.sam.build import build_sam

    torch.manual_seed(0)
    sam = build_sam("lite_medsam", image_size=256).eval().requires_grad_(False)
    proj = torch.nn.Conv2d(3, 256, 1).requires_grad_(False)

    def encode(x):  # (B, 3, 256, 256) -> (B, 256, 64, 64)
        return proj(torch.nn.functional.avg_pool2d(x, 4))

    sam.image_encoder.forward = encode
    return sam


def blob_image(seed=0, shape=(200, 240)) -> np.ndarray:
    """Noise with one bright rectangle (rows 60-120, columns 80-150)."""
    rng = np.random.default_rng(seed)
    img = rng.normal(100, 10, shape)
    img[60:120, 80:150] += 80
    return img.astype(np.float32)


def cpu_autocast() -> bool:
    """Whether CPU autocast is on in this thread."""
    try:
        return torch.is_autocast_enabled("cpu")
    except TypeError:  # torch < 2.4
        return torch.is_autocast_cpu_enabled()
