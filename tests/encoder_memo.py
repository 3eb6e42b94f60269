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
weights and buffers; nothing is stored when gradients flow to the encoder's weights. The
encoder's trunk (``TinyViT.trunk``: every stage but the last ones) is kept the same way,
keyed by the trunk's own weights: the tuned models (``cells_nuclei_sam``, adapted decoders)
train only the last stage and neck, so a view they share with LiteMedSAM runs its trunk once,
and training runs that cache trunk outputs find them. Everything above the encoder (the
engine's views, caches, pause points, workers) runs as it does without the memo, only sooner.
Tests about scheduling, priorities, cancelling, latency or the encoder itself
(``test_sam_annotator_priorities``, ``test_sam_models``, a cancelled stack, ...) do not opt
in: their encoder runs every time.
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


def _tensors(module, part: str):
    """``module``'s parameters and buffers: all of them (``part`` "all"), or those of its trunk
    (``part`` "trunk:N": the patch embedding and every stage but the last N)."""
    items = list(module.named_parameters()) + list(module.named_buffers())
    if part == "all":
        return [t for _, t in items]
    first_kept = len(module.layers) - int(part.split(":")[1])
    prefixes = ("patch_embed.",) + tuple(f"layers.{i}." for i in range(first_kept))
    return [t for name, t in items if name.startswith(prefixes)]


def _weights_key(module, part: str = "all") -> str:
    """A hash of ``module``'s weights and buffers (or its trunk's), computed again only when
    one changed (another tensor, or one written to in place)."""
    tensors = _tensors(module, part)
    state = tuple((t.data_ptr(), _version(t)) for t in tensors)
    memo = module.__dict__.setdefault("_test_memo_weights", {})
    cached = memo.get(part)
    if cached is not None and cached[0] == state:
        return cached[1]
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        h.update(str((tuple(t.shape), t.dtype)).encode())
        h.update(t.detach().float().contiguous().cpu().numpy().tobytes())
    memo[part] = (state, h.hexdigest())
    return h.hexdigest()


def _input_key(module, x, part: str = "all") -> str:
    import torch

    try:
        autocast = torch.is_autocast_enabled(x.device.type)
    except TypeError:  # torch < 2.4
        autocast = torch.is_autocast_enabled()
    h = hashlib.blake2b(digest_size=16)
    h.update(x.detach().contiguous().cpu().numpy().tobytes() if x.dtype != torch.bfloat16
             else x.detach().float().contiguous().cpu().numpy().tobytes())
    h.update("|".join((part, _weights_key(module, part), str(x.dtype), str(tuple(x.shape)), str(x.device.type),
                       str(autocast), str(module.training))).encode())
    return h.hexdigest()


def _to_host(out):
    """``out`` (a tensor, or the trunk's (tokens, (h, w))) with its tensors detached on the host."""
    import torch

    if torch.is_tensor(out):
        return out.detach().cpu()
    return tuple(v.detach().cpu() if torch.is_tensor(v) else v for v in out)


def _look_up(folder, key, x, compute):
    """The stored output for ``key``, or ``compute()``'s, stored."""
    import torch

    path = folder / f"{key}.pt"
    if path.exists():
        return torch.load(path, map_location=x.device, weights_only=True)
    out = compute()
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".part")
    os.close(fd)
    torch.save(_to_host(out), tmp)
    os.replace(tmp, path)  # whole files only: another test process may read it at once
    return out


def install() -> None:
    """Wrap ``TinyViT.forward`` and ``TinyViT.trunk`` once per process; they consult the memo
    only while a test of an opted-in module runs (:func:`use`)."""
    if _STATE["installed"]:
        return
    import torch

    from napari_gpuseg.models.sam import tiny_vit

    forward, trunk = tiny_vit.TinyViT.forward, tiny_vit.TinyViT.trunk

    def grads_flow(x, tensors) -> bool:
        return torch.is_grad_enabled() and (x.requires_grad or any(t.requires_grad for t in tensors))

    def memo_forward(self, x, *args, **kwargs):
        folder = _STATE["folder"]
        if folder is None or args or kwargs or grads_flow(x, self.parameters()):
            return forward(self, x, *args, **kwargs)
        return _look_up(folder, _input_key(self, x), x, lambda: forward(self, x))

    def memo_trunk(self, x, stages: int = 1):
        folder = _STATE["folder"]
        part = f"trunk:{int(stages)}"
        if folder is None or self.training or grads_flow(x, _tensors(self, part)):  # (BatchNorms learn)
            return trunk(self, x, stages)
        tokens, hw = _look_up(folder, _input_key(self, x, part), x, lambda: trunk(self, x, stages))
        return tokens, tuple(int(v) for v in hw)

    memo_forward.__doc__, memo_trunk.__doc__ = forward.__doc__, trunk.__doc__
    tiny_vit.TinyViT.forward, tiny_vit.TinyViT.trunk = memo_forward, memo_trunk
    _STATE["installed"] = True


def use(folder: Path | None) -> None:
    """Consult and fill the memo in ``folder`` (``None``: encode every time)."""
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        install()
    _STATE["folder"] = folder

