"""Embeddings of the test images computed once per test run, for the tests that opt in.

Many tests encode the same BBBC039 and scratch-assay views with the same LiteMedSAM
encoder, each through engines of their own (a dock, a session, a script), so one view can
be encoded a dozen times in one run. A test that asserts what comes out of the embeddings
-- masks, labels, IoU, what a dock shows -- and not when the encoder runs, opts in with
``@pytest.mark.usefixtures("reuse_embeddings")`` (a whole module with ``pytestmark``). Its
encoder calls (``TinyViT.forward``) then look up their output in a folder shared by the
test processes of the run, and compute and store it when it is not there.

A stored output is what the forward pass computed for exactly that input: the key is a
hash of the input's values, its shape, dtype and the autocast state, and of the encoder's
weights; nothing is stored when gradients flow to the encoder's weights. Everything above
the encoder (the engine's views, caches, pause points, workers) runs as it does without
the memo, only sooner. Tests about scheduling, priorities, cancelling, latency or the encoder
itself (``test_sam_annotator_priorities``, ``test_sam_models``, a cancelled stack, ...) do
not opt in: their encoder runs every time.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

_STATE = {"folder": None, "installed": False}


def _version(tensor) -> int | None:
    try:
        return tensor._version
    except RuntimeError:  # an inference tensor (made under torch.inference_mode) keeps none
        return None


def _weights_key(module) -> str:
    """A hash of every weight of ``module``, computed again only when a weight changed
    (another tensor, or one written to in place)."""
    state = tuple((p.data_ptr(), _version(p)) for p in module.parameters())
    cached = getattr(module, "_test_memo_weights", None)
    if cached is not None and cached[0] == state:
        return cached[1]
    h = hashlib.blake2b(digest_size=16)
    for p in module.parameters():
        h.update(str((tuple(p.shape), p.dtype)).encode())
        h.update(p.detach().float().contiguous().cpu().numpy().tobytes())
    module._test_memo_weights = (state, h.hexdigest())
    return module._test_memo_weights[1]


def _input_key(module, x) -> str:
    import torch

    try:
        autocast = torch.is_autocast_enabled(x.device.type)
    except TypeError:  # torch < 2.4
        autocast = torch.is_autocast_enabled()
    h = hashlib.blake2b(digest_size=16)
    h.update(x.detach().contiguous().cpu().numpy().tobytes() if x.dtype != torch.bfloat16
             else x.detach().float().contiguous().cpu().numpy().tobytes())
    h.update("|".join((_weights_key(module), str(x.dtype), str(tuple(x.shape)), str(x.device.type),
                       str(autocast), str(module.training))).encode())
    return h.hexdigest()


def install() -> None:
    """Wrap ``TinyViT.forward`` once per process; it consults the memo only while a test
    of an opted-in module runs (:func:`use`)."""
    if _STATE["installed"]:
        return
    import torch

    from napari_gpuseg.models.sam import tiny_vit

    forward = tiny_vit.TinyViT.forward

    def memo_forward(self, x, *args, **kwargs):
        folder = _STATE["folder"]
        if folder is None or args or kwargs or (torch.is_grad_enabled() and (
                x.requires_grad or any(p.requires_grad for p in self.parameters()))):
            return forward(self, x, *args, **kwargs)
        path = folder / f"{_input_key(self, x)}.pt"
        if path.exists():
            return torch.load(path, map_location=x.device, weights_only=True)
        out = forward(self, x)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".part")
        os.close(fd)
        torch.save(out.detach().cpu(), tmp)
        os.replace(tmp, path)  # whole files only: another test process may read it at once
        return out

    memo_forward.__doc__ = forward.__doc__
    tiny_vit.TinyViT.forward = memo_forward
    _STATE["installed"] = True


def use(folder: Path | None) -> None:
    """Consult and fill the memo in ``folder`` (``None``: encode every time)."""
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        install()
    _STATE["folder"] = folder

