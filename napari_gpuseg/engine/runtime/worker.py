"""The long-lived inference worker: one thread owns the models and serves queued jobs.

Widgets and the CLI submit callables; the worker runs them one at a time with the
policy's autocast entered *inside* its thread (autocast is thread-local), passing
``progress=`` and ``cancel=`` to functions that accept them. Callbacks run in the worker
thread; the Qt bridge (``widgets/_bridge.py``) forwards them to the GUI thread.

Jobs carry a priority (``INTERACTIVE`` < ``NORMAL`` < ``BACKGROUND`` < ``IDLE``; lower
runs first). Long background work gives way in two places: a job whose function is a
generator is parked after each step while higher-priority jobs are queued, and code
that calls :func:`pause_point` (the SAM encoder, between blocks) runs such jobs on the
spot. So a prompt's decode waits for at most one encoder block, not a whole image.

While the GUI shows an interactive result (a preview mask being drawn), background work
would still take both cores from it: :meth:`InferenceWorker.hold_background` parks
``BACKGROUND`` and ``IDLE`` jobs at their next pause point or step, sleeping (the GIL and
the cores free) until :meth:`~InferenceWorker.release_background` or a deadline, while
higher-priority jobs queued meanwhile still run at once.

A worker on the CPU applies the allocator set-up (``allocator.py``) before its thread starts
(so the thread allocates from the main heap; again with the first job if the policy changed to
the CPU) and trims the heap whenever it goes idle. A failed job keeps its exception but not the locals of
its frames (no tensors held after an out-of-memory error). Every worker still running is
stopped at interpreter exit; :meth:`InferenceWorker.submit` after
:meth:`~InferenceWorker.shutdown` raises ``RuntimeError("worker is shut down")``.
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import heapq
import inspect
import itertools
import logging
import threading
import time
import weakref
from typing import Any, Callable, Hashable

import torch

from . import allocator
from .device import Policy, get_policy
from .cancel import Cancelled
from .model_slots import ModelSlots
from .job import (BACKGROUND, CANCELLED, DONE, FAILED, IDLE, INTERACTIVE, NORMAL,  # noqa: F401 - re-exported
                  PENDING, RUNNING, Job, accepts_keyword, release_frames)

logger = logging.getLogger(__name__)

_local = threading.local()
_live: "weakref.WeakSet[InferenceWorker]" = weakref.WeakSet()  # every started worker, for exit


def pause_point() -> None:
    """Call inside long work (the SAM encoder calls it between blocks): in a worker thread,
    queued jobs of higher priority than the running one run here and now, a cancelled
    job stops here, and background work waits here while the worker's background hold
    lasts (:meth:`InferenceWorker.hold_background`). Elsewhere it does nothing."""
    worker = getattr(_local, "worker", None)
    if worker is None or not worker._stack:
        return
    job = worker._stack[-1]
    job.token.check()
    worker._serve_above(job.priority)
    worker._wait_hold(job)


class InferenceWorker(ModelSlots):
    """One background thread that owns loaded models and runs submitted jobs by priority
    (first come, first served within a priority)."""

    LOG = 1000  # entries kept in :attr:`log`

    def __init__(self, policy: Policy | None = None, name: str = "napari-gpuseg-worker") -> None:
        self._policy = policy
        self._models: dict[Hashable, Any] = {}
        self._models_lock = threading.Lock()
        self._cond = threading.Condition()
        self._heap: list[tuple[int, int, Job]] = []
        self._seq = itertools.count()
        self._stack: list[Job] = []  # running jobs; more than one when a pause point serves others
        self._stopping = False
        self._hold_until = 0.0  # time.monotonic() until which background work waits
        # (event, job id, tag): "start", "pause" (a stepped job gave way), "resume", "end",
        # "held" / "unheld" (background work waited for a hold, and went on)
        self.log: collections.deque[tuple[str, int, Hashable]] = collections.deque(maxlen=self.LOG)
        if self._device_type() == "cpu":  # before the thread exists: it allocates from the main heap
            allocator.configure_allocator()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()
        _live.add(self)

    def _device_type(self) -> str | None:
        try:
            return self.policy.device.type
        except Exception:  # noqa: BLE001 - a bad device setting: the first job reports it
            return None

    @property
    def policy(self) -> Policy:
        return self._policy or get_policy()

    @policy.setter
    def policy(self, value: Policy | None) -> None:
        self._policy = value

    # -- jobs ---------------------------------------------------------------
    def submit(self, fn: Callable, *args, tag: Hashable | None = None, replace: bool = False,
               inference: bool = True, priority: int = NORMAL, hold_after: float = 0.0,
               on_result=None, on_error=None, on_progress=None, on_cancelled=None,
               defer: Callable[[], bool] | None = None, **kwargs) -> Job:
        """Queue ``fn(*args, **kwargs)`` at ``priority`` (lower runs first).
        ``replace=True`` cancels earlier jobs with ``tag``. ``hold_after`` (seconds): when
        the job ends, background work is held that long (:meth:`hold_background`) before
        its callbacks run, so the GUI can show the result on free cores and release the
        hold (:meth:`release_background`) once it has. ``defer()`` (called in the worker
        thread at a pause point): True when the job is better served after the work that
        pause point interrupted (a prompt whose view that work is embedding); it then runs
        at that work's next step or end, not inside it, and a background hold stops
        parking that work."""
        if self._stopping or not self._thread.is_alive():
            raise RuntimeError("worker is shut down")
        if replace and tag is not None:
            self.cancel(tag)
        job = Job(fn, args, kwargs, tag, inference, on_result, on_error, on_progress, on_cancelled,
                  priority, hold_after, defer)
        job._seq = next(self._seq)
        self._push(job, job._seq)
        return job

    def _push(self, job: Job, seq: int) -> None:
        with self._cond:
            if self._stopping and job._gen is None:  # shut down between the check and here
                raise RuntimeError("worker is shut down")
            heapq.heappush(self._heap, (job.priority, seq, job))
            self._cond.notify()

    def pending(self, tag: Hashable | None = None) -> list[Job]:
        """Queued jobs (all, or those with ``tag``) in the order they will run."""
        with self._cond:
            return [j for _p, _s, j in sorted(self._heap) if tag is None or j.tag == tag]

    def reprioritize(self, tag: Hashable, priority: int) -> int:
        """Give the queued jobs with ``tag`` a new priority. Returns how many."""
        with self._cond:
            hit = [e for e in self._heap if e[2].tag == tag and not e[2].cancelled]
            for _p, _s, job in hit:
                job.priority = priority
            self._heap = [(p if j.cancelled else j.priority, s, j) for p, s, j in self._heap]
            heapq.heapify(self._heap)
            self._cond.notify()
        return len(hit)

    def cancel(self, tag: Hashable | None = None) -> int:
        """Cancel queued and running jobs (all, or those with ``tag``). Returns how many."""
        n = 0
        with self._cond:
            for job in [j for _p, _s, j in self._heap] + list(self._stack):
                if (tag is None or job.tag == tag) and not job._done.is_set() and not job.cancelled:
                    job.cancel()
                    n += 1
            # queued cancelled jobs go first: they end at once (their callbacks say so)
            self._heap = [(-1 if j.cancelled else p, s, j) for p, s, j in self._heap]
            heapq.heapify(self._heap)
            self._cond.notify_all()  # a job waiting for a background hold ends too
        return n

    # -- background hold -----------------------------------------------------------
    HELD = BACKGROUND  # jobs of this priority or lower (larger numbers) wait for a hold

    def hold_background(self, seconds: float) -> None:
        """Park background work (priority ``BACKGROUND`` and ``IDLE``) for at most ``seconds``
        from now, until :meth:`release_background`: a running background job stops at its
        next :func:`pause_point` or step and sleeps (the GIL and the cores free for the GUI),
        and none starts. Jobs of higher priority still run, queued before or during the
        hold. A later call moves the deadline; the deadline bounds a hold nobody releases."""
        with self._cond:
            self._hold_until = time.monotonic() + max(0.0, float(seconds))
            self._cond.notify_all()

    def release_background(self) -> None:
        """End the hold of :meth:`hold_background` now."""
        with self._cond:
            self._hold_until = 0.0
            self._cond.notify_all()

    @property
    def holding(self) -> bool:
        """True while a background hold lasts."""
        with self._cond:
            return time.monotonic() < self._hold_until

    def _wait_hold(self, job: Job) -> None:
        """In the worker thread: while a hold lasts and ``job`` is background work, serve
        jobs of higher priority as they come and otherwise sleep; a cancel ends the wait."""
        if job.priority < self.HELD:
            return
        held = False
        try:
            while not (self._stopping or job.cancelled):
                if self._waiting_above(job.priority):
                    nxt = self._pop_ready(job.priority)
                    if nxt is None:  # the waiting jobs want this work's result: park no longer
                        break
                    self._execute(nxt)  # outside the lock, like every job
                    continue
                with self._cond:
                    left = self._hold_until - time.monotonic()
                    if left <= 0:
                        break
                    if not held:
                        held = True
                        self.log.append(("held", job.id, job.tag))
                    # in slices: Job.cancel() (unlike cancel()) does not wake the worker
                    self._cond.wait(min(left, 0.05))
        finally:
            if held:
                self.log.append(("unheld", job.id, job.tag))
        job.token.check()

    @property
    def alive(self) -> bool:
        """True while the worker thread runs (False after :meth:`shutdown`)."""
        return self._thread.is_alive()

    @property
    def busy(self) -> bool:
        with self._cond:
            return bool(self._stack or self._heap)

    def shutdown(self, timeout: float = 5.0) -> None:
        self.cancel()
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def _pop(self, above: int | None = None) -> Job | None:
        """The next job; with ``above``, only one of a higher priority, without waiting."""
        with self._cond:
            while True:
                if self._heap and (above is None or self._heap[0][0] < above):
                    return heapq.heappop(self._heap)[2]
                if above is not None or self._stopping:
                    return None
                self._cond.wait()

    def _loop(self) -> None:
        _local.worker = self
        while True:
            job = self._pop()
            if job is None:
                return
            self._execute(job)
            if not self.busy:  # idle: large work is over, give its freed host memory back
                allocator.trim()

    def _waiting_above(self, priority: int) -> bool:
        with self._cond:
            return bool(self._heap) and self._heap[0][0] < priority

    def _pop_ready(self, above: int) -> Job | None:
        """At a pause point: the next queued job of a higher priority than ``above`` whose
        ``defer()`` is not True (asked outside the lock), or None."""
        with self._cond:
            waiting = sorted(e for e in self._heap if e[0] < above)
        for entry in waiting:
            defer = entry[2].defer
            if defer is not None:
                try:
                    if defer():
                        continue
                except Exception:  # noqa: BLE001 - a failing check never holds a job back
                    logger.debug("defer check of job %s failed", entry[2].id, exc_info=True)
            with self._cond:
                if entry in self._heap:
                    self._heap.remove(entry)
                    heapq.heapify(self._heap)
                    return entry[2]
        return None

    def _serve_above(self, priority: int) -> None:
        while True:
            job = self._pop_ready(priority)
            if job is None:
                return
            self._execute(job)

    def _execute(self, job: Job) -> None:
        with self._cond:
            self._stack.append(job)
        try:
            self._run(job)
        finally:
            with self._cond:
                self._stack.remove(job)
        if job.error is not None:  # the frames are finished now: their locals can go
            release_frames(job.error)

    def _should_yield(self, job: Job) -> bool:
        with self._cond:
            return bool(self._heap) and self._heap[0][0] < job.priority

    def _run(self, job: Job) -> None:
        t0 = time.perf_counter()
        callback = None
        resumed = job._gen is not None
        self.log.append(("resume" if resumed else "start", job.id, job.tag))
        try:
            job.token.check()
            job.status = RUNNING
            dev = self.policy.device  # this thread's current CUDA device is the policy's
            if dev.type == "cpu":  # CPU inference and training: keep freed memory (allocator.py)
                allocator.configure_allocator()
            while True:
                self._wait_hold(job)  # before a background job starts, and before each step
                on_dev = torch.cuda.device(dev) if dev.type == "cuda" and dev.index is not None \
                    and torch.cuda.is_available() else contextlib.nullcontext()
                with torch.inference_mode(job.inference), on_dev, \
                        (self.policy.autocast() if job.inference else torch.enable_grad()):
                    if job._gen is None:
                        out = job.fn(*job.args, **self._kwargs(job))
                        if not inspect.isgenerator(out):
                            value = out
                            break
                        job._gen = out
                    try:
                        next(job._gen)
                    except StopIteration as stop:
                        value = stop.value
                        break
                job.token.check()
                if self._should_yield(job):  # one step done; higher-priority work first
                    job.status = PENDING
                    self.log.append(("pause", job.id, job.tag))
                    self._push(job, job._seq)  # ahead of later jobs of its priority
                    return
            job.token.check()
            job.value, job.status = value, DONE
            callback = (job.on_result, value)
        except Cancelled:
            job.status = CANCELLED
            callback = (job.on_cancelled,)
        except BaseException as exc:  # noqa: BLE001 - delivered to the caller
            job.error, job.status = exc, FAILED
            logger.debug("job %s (%r) failed", job.id, job.tag, exc_info=exc)
            callback = (job.on_error, exc)
        finally:
            job.seconds = (job.seconds or 0.0) + time.perf_counter() - t0
            if job.status != PENDING:
                if job._gen is not None:
                    job._gen.close()
                if job.hold_after > 0:  # before the callbacks: their release comes after it
                    self.hold_background(job.hold_after)
                self.log.append(("end", job.id, job.tag))
                job._done.set()
        if callback and callback[0] is not None:
            try:
                callback[0](*callback[1:])
            except Exception:  # a broken callback must not kill the worker: log it
                logger.exception("callback %r of job %s (%r) raised", callback[0], job.id, job.tag)

    def _kwargs(self, job: Job) -> dict:
        kwargs = dict(job.kwargs)
        if accepts_keyword(job.fn, "progress"):
            kwargs.setdefault("progress", job._progress)
        if accepts_keyword(job.fn, "cancel"):
            kwargs.setdefault("cancel", job.token)
        return kwargs


_default: InferenceWorker | None = None
_default_lock = threading.Lock()


@atexit.register
def _shutdown_all() -> None:
    """Stop every worker still running (the shared one, the training worker, any other)
    before the interpreter tears down: a thread still inside torch at exit aborts the
    process (closing napari during training)."""
    for worker in list(_live):
        if worker.alive:
            worker.shutdown(timeout=10.0)


def default_worker() -> InferenceWorker:
    """The shared worker all docks use, so each model is loaded once per process."""
    global _default
    with _default_lock:
        if _default is None or not _default.alive:
            _default = InferenceWorker()
        return _default
