"""The stages of a folder job: reader threads -> one worker per device -> writer threads,
joined by bounded queues (see :mod:`napari_gpuseg.engine.jobs.pipeline` for the run as a
whole). GUI-free and print-free."""
from __future__ import annotations

import logging
import queue
import threading
import time

from ...io import label_files
from ..runtime.cancel import Cancelled
from .file_step import FileStep, Item
from .outputs import DISK_ERRNOS, skipped_row
from .method_registry import Segmenter

logger = logging.getLogger(__name__)

POLL_S = 0.05  # queue poll interval: how fast a stop request is seen
STOP = object()


class FolderRun:
    """The threads and queues of one :func:`~napari_gpuseg.engine.jobs.pipeline.run_folder`
    call: readers load and prepare images, one worker per device segments same-shape
    batches, writers write the object table and then the label image."""

    def __init__(self, items, factory, prep, policies, io_workers, image_batch, overwrite,
                 max_image_bytes, cancel, run_info, earlier=({}, {})):
        self.items = items
        self.run_info = run_info  # {"method", "model"}: stored in every label file
        self.header, self.earlier = earlier  # the report an earlier run left in OUT
        self.other_method: dict[tuple[str, str], int] = {}  # skipped outputs of another method
        self.disk_error: OSError | None = None
        self.factory = factory
        self.policies = policies
        self.image_batch = max(1, int(image_batch))
        self.overwrite = overwrite
        self.max_image_bytes = max_image_bytes
        self.cancel = cancel
        self.stop = threading.Event()
        self.fatal: BaseException | None = None
        n_dev = len(policies)
        depth = max(2, 2 * self.image_batch * n_dev)
        self.tasks: queue.Queue = queue.Queue()
        for it in items:
            self.tasks.put(it)
        self.in_q: queue.Queue = queue.Queue(maxsize=depth)
        self.out_q: queue.Queue = queue.Queue(maxsize=depth)
        self.rows: queue.Queue = queue.Queue()
        self.n_readers = max(1, int(io_workers))
        self.n_writers = max(1, int(io_workers))
        self._alive = {"readers": self.n_readers, "workers": n_dev}
        self._alive_lock = threading.Lock()
        self.prep = prep  # unloaded instance: prepare() runs in the reader threads
        self.step = FileStep(prep, run_info, max_image_bytes)  # read, segment, write: as every executor
        self.threads: list[threading.Thread] = []

    # -- plumbing ---------------------------------------------------------------------
    def _put(self, q: queue.Queue, obj) -> bool:
        while not self.stop.is_set():
            try:
                q.put(obj, timeout=POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _get(self, q: queue.Queue):
        while not self.stop.is_set():
            try:
                return q.get(timeout=POLL_S)
            except queue.Empty:
                continue
        return STOP

    def _last_out(self, stage: str, q: queue.Queue, n_next: int) -> None:
        with self._alive_lock:
            self._alive[stage] -= 1
            last = self._alive[stage] == 0
        if last:
            for _ in range(n_next):
                self._put(q, STOP)

    def _error(self, item: Item, exc: BaseException) -> None:
        self.rows.put(self.step.error_row(item, exc))

    # -- stages -----------------------------------------------------------------------
    def reader(self) -> None:
        try:
            while not self.stop.is_set():
                try:
                    item: Item = self.tasks.get_nowait()
                except queue.Empty:
                    break
                done = None if self.overwrite else label_files.read_output(item.labels_path)
                if done is not None:
                    self._skip(item, *done)
                    continue
                try:
                    self.step.read(item)
                except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
                    self._error(item, exc)
                    continue
                if not self._put(self.in_q, item):
                    return
        finally:
            self._last_out("readers", self.in_q, len(self.policies))

    def _skip(self, item: Item, labels, info) -> None:
        current = (self.run_info["method"], self.run_info["model"])
        row, other = skipped_row(item.rel, item.labels_rel, labels, info, item.table_path,
                                 self.earlier.get(item.rel), self.header, current, item.path)
        if other is not None:
            with self._alive_lock:
                self.other_method[other] = self.other_method.get(other, 0) + 1
        self.rows.put(row)

    def worker(self, policy) -> None:
        seg: Segmenter | None = None
        try:
            seg = self.factory()
            seg.cancel = self.cancel
            seg.load(policy)
        except BaseException as exc:  # noqa: BLE001 - the whole run fails
            self.fatal = exc
            self.stop.set()
            self._last_out("workers", self.out_q, self.n_writers)
            return
        device = str(getattr(policy, "device", policy))
        try:
            finished = False
            while not finished and not self.stop.is_set():
                first = self._get(self.in_q)
                if first is STOP:
                    break
                batch = [first]
                while len(batch) < self.image_batch:
                    try:
                        nxt = self.in_q.get_nowait()
                    except queue.Empty:
                        break
                    if nxt is STOP:
                        finished = True
                        break
                    batch.append(nxt)
                groups: dict[tuple, list[Item]] = {}
                for it in batch:
                    groups.setdefault((it.data.shape, it.data.dtype.str), []).append(it)
                for group in groups.values():
                    if self.stop.is_set():
                        return
                    self._segment(seg, group, device)
        except Cancelled:
            self.stop.set()
        finally:
            try:
                seg.unload()
            except Exception as exc:  # noqa: BLE001 - the results are written; only memory stays held
                logger.warning("unloading the %s method failed: %s: %s", seg.name, type(exc).__name__, exc)
            self._last_out("workers", self.out_q, self.n_writers)

    def _segment(self, seg: Segmenter, group: list[Item], device: str) -> None:
        t0 = time.perf_counter()
        try:
            results = self.step.segment(seg, group)
        except Cancelled:
            raise
        except Exception as exc:  # noqa: BLE001
            if len(group) > 1:  # find the culprit: retry one by one
                for it in group:
                    self._segment(seg, [it], device)
                return
            group[0].device = device
            group[0].seconds += time.perf_counter() - t0
            self._error(group[0], exc)
            return
        share = (time.perf_counter() - t0) / len(group)
        for it, res in zip(group, results):
            it.result, it.device = res, device
            it.seconds += share
            if not self._put(self.out_q, it):
                return

    def writer(self) -> None:
        while True:
            item = self._get(self.out_q)
            if item is STOP:
                return
            try:
                row = self.step.write(item)
            except Exception as exc:  # noqa: BLE001
                self._error(item, exc)
                if isinstance(exc, OSError) and exc.errno in DISK_ERRNOS:
                    self.disk_error = exc  # every later write fails too: stop, keep what is done
                    self.stop.set()
                continue
            self.rows.put(row)
            item.data = item.result = None

    def start(self) -> None:
        specs = [(self.reader, ()) for _ in range(self.n_readers)]
        specs += [(self.worker, (p,)) for p in self.policies]
        specs += [(self.writer, ()) for _ in range(self.n_writers)]
        for i, (fn, args) in enumerate(specs):
            t = threading.Thread(target=fn, args=args, daemon=True,
                                 name=f"gpuseg-{fn.__name__}-{i}")
            t.start()
            self.threads.append(t)

    def alive(self) -> bool:
        return any(t.is_alive() for t in self.threads)

    def join(self, timeout: float | None = None) -> None:
        """Wait for every stage thread (``None``: until they end; each ends after its
        current step once ``stop`` is set). A thread left running inside torch or a C
        library when the interpreter exits aborts the process (SIGABRT), so the run
        never returns while one is alive, unless interrupted again."""
        end = None if timeout is None else time.monotonic() + timeout
        for t in self.threads:
            while t.is_alive():
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return
                t.join(POLL_S if left is None else min(POLL_S, left))  # signals stay responsive

    def drain(self) -> list:
        out = []
        while True:
            try:
                out.append(self.rows.get_nowait())
            except queue.Empty:
                return out
