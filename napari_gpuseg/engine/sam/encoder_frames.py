"""The frames napari's process and its second encoder process exchange over that process's
stdin and stdout: length-prefixed pickles of tuples whose tensors travel as
``(dtype name, shape, bytes)``."""
from __future__ import annotations

import pickle
import struct

import torch

_HEADER = struct.Struct("<Q")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pack(t: torch.Tensor) -> tuple[str, tuple, bytes]:
    t = t.detach().to("cpu").contiguous()
    name = str(t.dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise TypeError(f"cannot send a {t.dtype} tensor")
    return name, tuple(t.shape), t.view(torch.uint8).numpy().tobytes()


def unpack(name: str, shape: tuple, data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=_DTYPES[name]).reshape(shape)


def write(stream, obj) -> None:
    body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(body)) + body)
    stream.flush()


def read(stream):
    """One frame from ``stream``; None at its end."""
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None
    (n,) = _HEADER.unpack(head)
    body = stream.read(n)
    if len(body) < n:
        return None
    return pickle.loads(body)  # noqa: S301 - frames of the process this package started
