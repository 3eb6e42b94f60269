"""The long-lived inference worker: one thread owns the models and serves queued jobs.

Widgets and the CLI submit callables; the worker runs them one at a time with the
policy's autocast entered *inside* its thread (autocast is thread-local), passing
``progress=`` and ``cancel=`` to functions that accept them. Callbacks run in the worker
thread; the Qt bridge (``widgets/_bridge.py``) forwards them to the GUI thread.
"""
from __future__ import annotations

import atexit
import inspect
import itertools
import queue
import threading
import time
from typing import Any, Callable, Hashable

import torch

from .device import Policy, get_policy
from .jobs import Cancelled, CancelToken

PENDING, RUNNING, DONE, FAILED, CANCELLED = "pending", "running", "done", "failed", "cancelled"


class Job:
    """A queued call. Thread-safe: ``cancel()``, ``wait()``, ``result()`` from any thread."""

    _ids = itertools.count(1)

    def __init__(self, fn, args, kwargs, tag=None, inference=True,
                 on_result=None, on_error=None, on_progress=None, on_cancelled=None):
        self.id = next(Job._ids)
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.tag = tag
        self.inference = inference
        self.token = CancelToken()
        self.status = PENDING
        self.value: Any = None
        self.error: BaseException | None = None
        self.seconds: float | None = None
        self.on_result, self.on_error = on_result, on_error
        self.on_progress, self.on_cancelled = on_progress, on_cancelled
        self._done = threading.Event()

    def cancel(self) -> None:
        self.token.cancel()

    @property
    def cancelled(self) -> bool:
        return self.token.cancelled

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def result(self, timeout: float | None = None) -> Any:
        if not self._done.wait(timeout):
            raise TimeoutError(f"job {self.id} did not finish in {timeout} s")
        if self.status == CANCELLED:
            raise Cancelled(f"job {self.id} was cancelled")
        if self.error is not None:
            raise self.error
        return self.value

    def _progress(self, done: int, total: int) -> None:
        self.token.check()
        if self.on_progress is not None:
            self.on_progress(done, total)


def _accepts(fn: Callable, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


class InferenceWorker:
    """One background thread that owns loaded models and runs submitted jobs in order."""

    def __init__(self, policy: Policy | None = None, name: str = "napari-gpuseg-worker") -> None:
        self._policy = policy
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._models: dict[Hashable, Any] = {}
        self._models_lock = threading.Lock()
        self._current: Job | None = None
        self._jobs_lock = threading.Lock()
        self._pending: list[Job] = []
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def policy(self) -> Policy:
        return self._policy or get_policy()

    @policy.setter
    def policy(self, value: Policy | None) -> None:
        self._policy = value

    # -- models -------------------------------------------------------------
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

    def loaded_models(self) -> list[Hashable]:
        with self._models_lock:
            return list(self._models)

    def unload(self, key: Hashable | None = None) -> None:
        with self._models_lock:
            if key is None:
                self._models.clear()
            else:
                self._models.pop(key, None)

    # -- jobs ---------------------------------------------------------------
    def submit(self, fn: Callable, *args, tag: Hashable | None = None, replace: bool = False,
               inference: bool = True, on_result=None, on_error=None, on_progress=None,
               on_cancelled=None, **kwargs) -> Job:
        """Queue ``fn(*args, **kwargs)``. ``replace=True`` cancels earlier jobs with ``tag``."""
        if replace and tag is not None:
            self.cancel(tag)
        job = Job(fn, args, kwargs, tag, inference, on_result, on_error, on_progress, on_cancelled)
        with self._jobs_lock:
            self._pending.append(job)
        self._queue.put(job)
        return job

    def cancel(self, tag: Hashable | None = None) -> int:
        """Cancel queued and running jobs (all, or those with ``tag``). Returns how many."""
        n = 0
        with self._jobs_lock:
            jobs = list(self._pending) + ([self._current] if self._current else [])
        for job in jobs:
            if job is not None and (tag is None or job.tag == tag) and not job._done.is_set():
                job.cancel()
                n += 1
        return n

    @property
    def busy(self) -> bool:
        return self._current is not None or not self._queue.empty()

    def shutdown(self, timeout: float = 5.0) -> None:
        self.cancel()
        self._queue.put(None)
        self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            with self._jobs_lock:
                if job in self._pending:
                    self._pending.remove(job)
                self._current = job
            try:
                self._run(job)
            finally:
                with self._jobs_lock:
                    self._current = None

    def _run(self, job: Job) -> None:
        kwargs = dict(job.kwargs)
        if _accepts(job.fn, "progress"):
            kwargs.setdefault("progress", job._progress)
        if _accepts(job.fn, "cancel"):
            kwargs.setdefault("cancel", job.token)
        t0 = time.perf_counter()
        callback = None
        try:
            job.token.check()
            job.status = RUNNING
            grad = torch.inference_mode() if job.inference else torch.enable_grad()
            dev = self.policy.device  # this thread's current CUDA device is the policy's
            on_dev = torch.cuda.device(dev) if dev.type == "cuda" and dev.index is not None \
                and torch.cuda.is_available() else _null()
            with grad, on_dev, (self.policy.autocast() if job.inference else _null()):
                value = job.fn(*job.args, **kwargs)
            job.token.check()
            job.value, job.status = value, DONE
            callback = (job.on_result, value)
        except Cancelled:
            job.status = CANCELLED
            callback = (job.on_cancelled,)
        except BaseException as exc:  # noqa: BLE001 - delivered to the caller
            job.error, job.status = exc, FAILED
            callback = (job.on_error, exc)
        finally:
            job.seconds = time.perf_counter() - t0
            job._done.set()
        if callback and callback[0] is not None:
            try:
                callback[0](*callback[1:])
            except Exception:  # a broken callback must not kill the worker
                pass


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_default: InferenceWorker | None = None
_default_lock = threading.Lock()


@atexit.register
def _shutdown_default() -> None:
    """Stop the shared worker before the interpreter tears down (a thread still inside
    torch at exit aborts the process)."""
    worker = _default
    if worker is not None and worker._thread.is_alive():
        worker.shutdown(timeout=10.0)


def default_worker() -> InferenceWorker:
    """The shared worker all docks use, so each model is loaded once per process."""
    global _default
    with _default_lock:
        if _default is None or not _default._thread.is_alive():
            _default = InferenceWorker()
        return _default
