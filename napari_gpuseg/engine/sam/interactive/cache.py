"""Embedding cache: bounded in bytes (RAM), optionally persisted on disk in fp16.

Keys are built from the image content, the model and the precision, so a prompt can never
receive an embedding of another image, and reopening an image is instant.
"""
from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Hashable

import numpy as np
import torch


def image_digest(image: np.ndarray) -> str:
    """A content hash of an array (shape and dtype included)."""
    a = np.ascontiguousarray(image)
    h = hashlib.blake2b(digest_size=16)
    h.update(str((a.shape, a.dtype.str)).encode())
    h.update(memoryview(a).cast("B"))
    return h.hexdigest()


class EmbeddingCache:
    """LRU cache of tensors bounded by ``max_bytes``; ``disk_dir`` adds an fp16 disk tier."""

    def __init__(self, max_bytes: int = 1 << 30, disk_dir: str | os.PathLike | None = None):
        self.max_bytes = int(max_bytes)
        self.disk_dir = Path(disk_dir) if disk_dir else None
        self._items: OrderedDict[Hashable, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = self.disk_hits = 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._items

    def _disk_path(self, key: Hashable) -> Path | None:
        if self.disk_dir is None:
            return None
        name = hashlib.blake2b(repr(key).encode(), digest_size=16).hexdigest()
        return self.disk_dir / f"{name}.pt"

    def get(self, key: Hashable) -> torch.Tensor | None:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
                self.hits += 1
                return value
        path = self._disk_path(key)
        if path is not None and path.exists():
            try:
                value = torch.load(path, map_location="cpu", weights_only=True).float()
            except Exception:
                path.unlink(missing_ok=True)  # a damaged cache entry is recomputed
            else:
                self.disk_hits += 1
                self.put(key, value, persist=False)
                return value
        self.misses += 1
        return None

    def put(self, key: Hashable, value: torch.Tensor, persist: bool = True) -> None:
        """Keep ``value`` in host memory (a GPU tensor is copied to RAM: the cache is sized
        as RAM and must not hold device memory on small cards)."""
        if value.device.type != "cpu":
            value = value.detach().to("cpu")
        size = value.numel() * value.element_size()
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= old.numel() * old.element_size()
            if size <= self.max_bytes:
                self._items[key] = value
                self._bytes += size
            while self._bytes > self.max_bytes and self._items:
                _k, ev = self._items.popitem(last=False)
                self._bytes -= ev.numel() * ev.element_size()
        path = self._disk_path(key) if persist else None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}-{threading.get_ident()}")
            torch.save(value.detach().to("cpu", torch.float16).contiguous(), tmp)
            os.replace(tmp, path)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0
