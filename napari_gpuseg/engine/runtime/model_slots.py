"""The models an inference worker keeps loaded: one per key, loaded in the worker's thread
by the first job that asks, released when a model of the same kind replaces it."""
from __future__ import annotations

import threading
from typing import Any, Callable, Hashable


class ModelSlots:
    """Mixed into :class:`~.worker.InferenceWorker` (uses its ``policy``)."""

    _models: dict
    _models_lock: threading.Lock

    def model(self, key: Hashable, loader: Callable[[], Any], replace: bool = False) -> Any:
        """Return the cached model for ``key``, loading it once (call from a job).

        ``replace=True`` (key a tuple): a new model releases the cached ones of the same
        kind (``key[0]``) first, so switching models does not keep the old one in GPU memory.
        """
        with self._models_lock:
            if key not in self._models:
                if replace:
                    old = [k for k in self._models if isinstance(k, tuple) and k[:1] == key[:1]]
                    for k in old:
                        del self._models[k]
                    if old:
                        import gc

                        from .memory import empty_cache

                        gc.collect()  # engines hold reference cycles (memo closures)
                        empty_cache(self.policy.device)
                self._models[key] = loader()
            return self._models[key]

    def cached_model(self, key: Hashable) -> Any | None:
        """The model cached for ``key``, or None (never loads one)."""
        with self._models_lock:
            return self._models.get(key)

    def loaded_models(self) -> list[Hashable]:
        with self._models_lock:
            return list(self._models)

    def unload(self, key: Hashable | None = None) -> None:
        with self._models_lock:
            if key is None:
                self._models.clear()
            else:
                self._models.pop(key, None)
