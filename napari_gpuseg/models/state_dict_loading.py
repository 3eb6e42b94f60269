"""Reading checkpoints safely and loading them strictly, with errors that say what is wrong."""
from __future__ import annotations

import os
import re
from collections import OrderedDict
from pathlib import Path
from typing import Iterable, List, Mapping, Tuple, Union

import torch
from torch import nn

StateOrPath = Union[str, os.PathLike, Mapping[str, torch.Tensor]]
WRAPPER_KEYS = ("model", "state_dict", "model_state_dict", "net")
SHOW = 5  # how many names of each kind an error message lists


class CheckpointError(RuntimeError):
    """A checkpoint cannot be read or does not fit the model.

    ``missing``, ``unexpected`` and ``mismatched`` (``(key, checkpoint_shape,
    model_shape)``) hold the full lists for programs; the message shows the first few.
    """

    def __init__(self, message: str, missing=(), unexpected=(), mismatched=()):
        super().__init__(message)
        self.missing: List[str] = list(missing)
        self.unexpected: List[str] = list(unexpected)
        self.mismatched: List[Tuple[str, tuple, tuple]] = list(mismatched)


def describe_source(source) -> str:
    return f"'{source}'" if isinstance(source, (str, os.PathLike)) else "the given state dict"


def unwrap_state_dict(obj) -> "OrderedDict[str, torch.Tensor]":
    """The tensor mapping inside a checkpoint: handles ``{"model": ...}``,
    ``{"state_dict": ...}`` wrappers and a DataParallel ``module.`` prefix."""
    for _ in range(3):  # nested wrappers ({"state_dict": {"model": ...}}) are rare but seen
        if isinstance(obj, Mapping) and not any(torch.is_tensor(v) for v in obj.values()):
            inner = next((obj[k] for k in WRAPPER_KEYS if k in obj and isinstance(obj[k], Mapping)), None)
            if inner is None:
                break
            obj = inner
    if not isinstance(obj, Mapping):
        raise CheckpointError(f"checkpoint holds a {type(obj).__name__}, not a state dict")
    state = OrderedDict((k, v) for k, v in obj.items() if torch.is_tensor(v))
    if not state:
        keys = ", ".join(list(map(str, obj.keys()))[:SHOW])
        raise CheckpointError(f"checkpoint holds no tensors (top-level keys: {keys or 'none'})")
    if all(k.startswith("module.") for k in state):
        state = OrderedDict((k[len("module."):], v) for k, v in state.items())
    return state


def load_error_message(path, exc: BaseException) -> str:
    """One line for a failed ``torch.load(path, weights_only=True)``. torch's own text
    advises re-running with ``weights_only=False`` (which lets code in the file run) and
    filing a PyTorch issue; neither applies to a damaged file, so it is never shown."""
    text = str(exc)
    # torch >= 2.4: "Unsupported global: GLOBAL argparse.Namespace"; 2.3: "Unsupported class argparse.Namespace"
    found = re.search(r"Unsupported (?:global: GLOBAL|class) ([\w.]+)", text)
    if found:
        return (f"checkpoint '{path}' holds Python objects other than tensors ({found.group(1)}); "
                "it is not loaded, since unpickling them could run code")
    if isinstance(exc, OSError) and not isinstance(exc, EOFError):
        return f"cannot read checkpoint '{path}': {exc.strerror or type(exc).__name__}"
    return f"'{path}' is not a checkpoint (corrupt or not a torch file)"


def safe_torch_load(path, map_location="cpu"):
    """``torch.load`` with ``weights_only=True``; any failure is a :class:`CheckpointError`
    with :func:`load_error_message`."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # pickle errors, truncated zip files, non-tensor payloads
        raise CheckpointError(load_error_message(path, exc)) from exc


def read_state_dict(path_or_state: StateOrPath, map_location="cpu") -> "OrderedDict[str, torch.Tensor]":
    """Load a checkpoint file with ``weights_only=True`` (or take a mapping) and unwrap it."""
    if isinstance(path_or_state, Mapping):
        return unwrap_state_dict(path_or_state)
    path = Path(path_or_state)
    if not path.is_file():
        raise CheckpointError(f"checkpoint file not found: '{path}'")
    return unwrap_state_dict(safe_torch_load(path, map_location))


def _first(items: Iterable[str]) -> str:
    items = list(items)
    shown = ", ".join(items[:SHOW])
    return shown + (f", ... (+{len(items) - SHOW} more)" if len(items) > SHOW else "")


def compare_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor]):
    """``(missing, unexpected, mismatched)`` of ``state`` against ``model``'s state dict."""
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    mismatched = [
        (k, tuple(state[k].shape), tuple(own[k].shape))
        for k in own
        if k in state and tuple(state[k].shape) != tuple(own[k].shape)
    ]
    return missing, unexpected, mismatched


def mismatch_summary(missing, unexpected, mismatched) -> str:
    """``"2 missing key(s): a, b; 1 mis-shaped key(s): c (checkpoint [3] vs model [4])"``:
    the first few names of each kind, with counts."""
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing key(s): {_first(missing)}")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected key(s): {_first(unexpected)}")
    if mismatched:
        shapes = [f"{k} (checkpoint {list(a)} vs model {list(b)})" for k, a, b in mismatched]
        parts.append(f"{len(mismatched)} mis-shaped key(s): {_first(shapes)}")
    return "; ".join(parts)


def load_state_dict_strict(
    model: nn.Module,
    path_or_state: StateOrPath,
    map_location="cpu",
    ignore_unexpected: Iterable[str] = (),
    hint: str = "",
) -> nn.Module:
    """Load ``path_or_state`` into ``model`` requiring every key and shape to match.

    ``ignore_unexpected``: extra checkpoint keys to drop silently (exact names).
    ``hint``: appended to the error message (e.g. "this looks like a vit_h checkpoint").
    Raises :class:`CheckpointError` naming the first few missing, unexpected and
    mis-shaped keys, with counts.
    """
    state = read_state_dict(path_or_state, map_location=map_location)
    drop = set(ignore_unexpected)
    if drop:
        state = OrderedDict((k, v) for k, v in state.items() if k not in drop)
    missing, unexpected, mismatched = compare_state_dict(model, state)
    if missing or unexpected or mismatched:
        msg = (f"checkpoint {describe_source(path_or_state)} does not fit {type(model).__name__}: "
               + mismatch_summary(missing, unexpected, mismatched))
        if hint:
            msg += f". {hint}"
        raise CheckpointError(msg, missing, unexpected, mismatched)
    model.load_state_dict(state, strict=True)
    return model
