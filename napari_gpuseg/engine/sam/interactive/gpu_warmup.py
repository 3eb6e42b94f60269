"""Pay a GPU's one-off costs when a SAM model loads, not on the user's first image.

The first encoder and decoder calls in a process load their CUDA kernels, and cuDNN's
autotuner (on for inputs of the model's own size) times its algorithms for every new batch
shape. On an H200 that made the first 520x696 field's 36 views take 2.3-2.4 s against 0.15 s
for the next field (``benchmarks/gpu_engine.py``). :func:`warm_gpu`, called when the annotator
loads a model, runs what a drop and its first prompts run: the encoder at batch 1 (a prompt's
own view) and at the background step's batch, a box, a first click (multimask) and a
corrective click with the previous logits as mask input, on a small synthetic image. On a CPU
it does nothing: oneDNN has no autotuning and an encoder call there costs a second or more.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from ...runtime.device import synchronize
from .inputs import view_input
from .prompt_types import Prompt


def warm_gpu(engine, batch_sizes: tuple[int, ...] | None = None) -> float:
    """Warm ``engine`` (a :class:`~.predictor.SamEngine`) when it runs on a CUDA device;
    the seconds it took (0.0 on other devices, which it leaves alone)."""
    if engine.policy.device.type != "cuda":
        return 0.0
    return warm(engine, batch_sizes)


def warm(engine, batch_sizes: tuple[int, ...] | None = None) -> float:
    """Run the encoder once per batch size (default: 1 and the background step's) and the
    decoder's three kinds of call on a synthetic image; the seconds it took. The image
    leaves a few embeddings in the engine's cache (a few MiB, evicted like any other)."""
    from .predictor import GPU_EMBED_STEP

    device = engine.policy.device
    t0 = time.perf_counter()
    s = engine.input_size
    rng = np.random.default_rng(0)
    image = engine.prepare((rng.random((s, s)) * 255).astype(np.uint8))
    for b in batch_sizes or (1, GPU_EMBED_STEP):
        views = (engine.views(image) * b)[:b]
        engine.encode(torch.stack([view_input(image, v, engine.info.normalization) for v in views]))
    c = s / 2
    box = np.array([c - s / 8, c - s / 8, c + s / 8, c + s / 8])
    engine.predict(image, [Prompt(box=box)], near_box=True)
    first = engine.predict(image, [Prompt(points=np.array([[c, c]]))], multimask=True)[0]
    engine.predict(image, [Prompt(points=np.array([[c, c], [c + s / 4, c]]), labels=np.array([1, 0]),
                                  mask_input=first)])
    synchronize(device)
    return time.perf_counter() - t0

