"""Damaged or foreign checkpoint files: one plain line, never torch's advice to load with
``weights_only=False`` (which would let code in the file run)."""
from __future__ import annotations

import argparse
import pickle

import numpy as np
import pytest
import torch

from napari_gpuseg.engine.unet.unet_checkpoint import load_checkpoint, load_unet
from napari_gpuseg.models.state_dict_loading import CheckpointError, read_state_dict


def _files(tmp_path):
    rng = np.random.default_rng(0)
    good = tmp_path / "good.pt"
    torch.save({"a": torch.zeros(3)}, good)
    data = good.read_bytes()
    files = {
        "random": rng.bytes(5000),
        "empty": b"",
        "truncated": data[: len(data) // 2],
        "zip-header": b"PK\x03\x04" + rng.bytes(200),
        "text": b"not a checkpoint\n",
    }
    out = {}
    for name, payload in files.items():
        out[name] = tmp_path / f"{name}.pt"
        out[name].write_bytes(payload)
    return out


def _assert_plain(msg: str):
    assert "weights_only" not in msg and "issue" not in msg.lower() and "\n" not in msg


@pytest.mark.parametrize("kind", ["random", "empty", "truncated", "zip-header", "text"])
def test_corrupt_checkpoint_says_not_a_checkpoint(tmp_path, kind):
    path = _files(tmp_path)[kind]
    with pytest.raises(CheckpointError, match=r"is not a checkpoint \(corrupt or not a torch file\)") as info:
        read_state_dict(path)
    _assert_plain(str(info.value))
    for load in (load_checkpoint, lambda p: load_unet(p, device="cpu")):
        with pytest.raises(ValueError, match=r"is not a checkpoint \(corrupt or not a torch file\)") as info:
            load(path)
        _assert_plain(str(info.value))


def test_pickled_objects_are_refused_without_suggesting_to_allow_them(tmp_path):
    path = tmp_path / "objects.pt"
    torch.save({"args": argparse.Namespace(a=1), "w": torch.zeros(2)}, path)
    for load in (read_state_dict, load_checkpoint):
        with pytest.raises((CheckpointError, ValueError), match="argparse.Namespace") as info:
            load(path)
        msg = str(info.value)
        _assert_plain(msg)
        assert "add_safe_globals" not in msg and "could run code" in msg


def test_unet_checkpoint_that_does_not_fit_names_keys_and_shapes(tmp_path):
    """The U-Net loads through the one strict loader: a missing key and a mis-shaped key are
    both named (with shapes) in one line, as a ValueError and a CheckpointError."""
    from napari_gpuseg.engine.unet.unet_checkpoint import model_from_checkpoint, save_checkpoint
    from napari_gpuseg.models.unet import UNetConfig, build_unet

    model = build_unet(UNetConfig(depth=1, base=4))
    ckpt = torch.load(save_checkpoint(tmp_path / "m.pt", model), weights_only=True)
    state = ckpt["state_dict"]
    dropped = next(iter(state))
    del state[dropped]
    bent = next(k for k, v in state.items() if v.ndim == 4)
    state[bent] = torch.zeros(tuple(state[bent].shape[:-1]) + (state[bent].shape[-1] + 1,))
    with pytest.raises(ValueError, match="checkpoint does not match the architecture") as info:
        model_from_checkpoint(ckpt)
    msg = str(info.value)
    assert isinstance(info.value, CheckpointError)
    assert "1 missing key(s): " + dropped in msg and f"1 mis-shaped key(s): {bent} (checkpoint" in msg
    assert info.value.missing == [dropped] and [m[0] for m in info.value.mismatched] == [bent]
    _assert_plain(msg)


@pytest.mark.parametrize("torch_text", [
    "Weights only load failed. ... WeightsUnpickler error: Unsupported global: GLOBAL argparse.Namespace was not an allowed global",
    "Weights only load failed. Re-running `torch.load` with `weights_only` set to `False` will likely succeed, "
    "but it can result in arbitrary code execution. WeightsUnpickler error: Unsupported class argparse.Namespace",
])
def test_the_refused_object_is_named_in_the_wording_of_each_torch(torch_text):
    """torch 2.4+ and torch 2.3 (the oldest supported) word a refused object differently;
    the message names it either way and never repeats torch's advice."""
    from napari_gpuseg.models.state_dict_loading import load_error_message

    msg = load_error_message("m.pt", pickle.UnpicklingError(torch_text))
    assert "(argparse.Namespace)" in msg and "could run code" in msg
    _assert_plain(msg)
