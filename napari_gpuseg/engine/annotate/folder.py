"""Going through a folder of images with an :class:`~.session.AnnotationSession`, without a window
(the names below are in ``napari_gpuseg.engine``):

    f = FolderAnnotation(AnnotationSession(load_engine()), "images/", "labels/")
    f.session.click(x, y); f.commit()     # labels/<name>_labels.tif written at once
    f.next()                              # the next image (read and embedded in the background)
    f.skip(); f.previous(); f.goto(3)
    train_unet_on_annotated(f)            # folder_train: the annotated images teach the pre-segmenter
    f.segment_rest()                      # a folder job over the images still to do


Images are the folder job's (``io.DEFAULT_PATTERN``, sorted by name); labels go to the folder
job's output name (``OUT/<name>_labels.tif``, :func:`~napari_gpuseg.engine.jobs.outputs.output_paths`)
so that every other tool reads them, written atomically (temp file + rename) after each
change of the session's labels (a commit, an undo, boxes: the session tells its
``labels_listeners``) and :meth:`FolderAnnotation.edited` (a painted edit); ``label_listeners``
hear of each save. ``OUT/annotation_progress.json`` keeps each
image's state and object count; a new object over the same folders resumes at the first image
not done, with its saved labels loaded. A labels file found on disk is loaded, never
overwritten unless that image is edited.

While an image is annotated, the next one is read (and pre-segmented, with ``presegment``) in a
thread and embedded on the session's worker at ``IDLE`` priority (prompts and the current
image's tiles go first), into the engine's embedding cache: the first prompt after
:meth:`next` only decodes.
"""
from __future__ import annotations

import json
import logging
import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ... import io as gio
from ...io import label_files
from ..jobs.outputs import list_inputs, no_input_note, output_paths, rel_name
from ..runtime.job import IDLE
from . import steps
from .presegment import Presegmenter

logger = logging.getLogger(__name__)

NOT_STARTED, PRESEGMENTED, ANNOTATED, SKIPPED = "not started", "pre-segmented", "annotated", "skipped"
PROGRESS_NAME = "annotation_progress.json"


@dataclass
class FolderImage:
    """One image of the folder: where it is, where its labels go, how far it is."""
    path: Path
    name: str  # relative to the input folder (POSIX), the progress file's key
    labels_path: Path
    state: str = NOT_STARTED
    objects: int = 0
    done: bool = False  # moved on from it with next() after annotating, or skipped


@dataclass
class _Ahead:
    index: int
    read: Future  # -> (image, labels or None, state)
    job: object = None  # the worker job embedding it


def unet_presegmenter(path=None) -> Presegmenter:
    """A ``presegment`` callable: image -> labels with a U-Net checkpoint (None: the bundled
    nuclei model), the folder job's ``unet`` method loaded on first use (in the reading
    thread); RGB images as luminance."""
    return Presegmenter("unet", model=None if path is None else str(path))


def sam_presegmenter(model=None) -> Presegmenter:
    """A ``presegment`` callable: SAM automatic (the folder job's ``sam-everything``: a grid of
    point prompts) with ``model`` (a name or an adapted checkpoint; None: the default model)."""
    return Presegmenter("sam-everything", model=None if model is None else str(model))


def count_objects(labels: np.ndarray) -> int:
    ids = np.unique(labels)
    return int(np.count_nonzero(ids))


class FolderAnnotation:
    """A folder of images annotated one after the other with ``session``.

    ``in_dir``/``out_dir``: image and label folders (``out_dir`` is made). ``pattern``: file
    globs as folder jobs take them. ``presegment``: a callable image -> labels run on each image
    without a labels file (e.g. ``lambda im: predict_labels(load_unet(), im)``), so the user
    corrects rather than starts from nothing. ``prefetch``: read, pre-segment and embed the
    next image in the background. ``embed``: embed the current image as it opens (off when a
    view such as the SAM annotator dock embeds it). Opens the resume point
    (:meth:`resume_index`) unless ``open_first`` is False."""

    def __init__(self, session, in_dir, out_dir, pattern: str = gio.DEFAULT_PATTERN,
                 presegment: Callable[[np.ndarray], np.ndarray] | None = None, prefetch: bool = True,
                 recursive: bool = False, embed: bool = True, open_first: bool = True) -> None:
        self.session = session
        self.in_dir, self.out_dir = Path(in_dir), Path(out_dir)
        if not self.in_dir.is_dir():
            raise NotADirectoryError(f"image folder not found: {self.in_dir}")
        label_files.check_writable_dir(self.out_dir)
        self.pattern = pattern
        self.presegment = presegment
        self.prefetch = prefetch
        self.embed = embed
        files = list_inputs(self.in_dir, self.out_dir, pattern, recursive)
        if not files:
            raise ValueError(no_input_note(self.in_dir, self.out_dir, pattern, recursive))
        self.images = [FolderImage(f, rel_name(f, self.in_dir), output_paths(self.in_dir, self.out_dir, f)[0])
                       for f in files]
        self._load_progress()
        self.index: int | None = None
        self.image: np.ndarray | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="napari-gpuseg-folder")
        self._ahead: _Ahead | None = None
        self._embed_job = None  # the current image's embedding (the prefetch waits for it)
        self._taken_job = None  # the prefetch embedding of the open image: it goes on as its embedding
        self._closed = False
        self._lock = threading.RLock()  # _ahead: the caller's thread and the worker's callbacks
        self.listeners: list[Callable[[], None]] = []  # called after every change of state
        # called with (image, None) after its labels were saved, (image, reason) when they could not be
        self.label_listeners: list[Callable[[FolderImage, str | None], None]] = []
        self._image_id = None  # the session's image_id while it shows the open image
        self._saved_sum = None  # checksum of the open image's labels as loaded or last saved
        self._rest: set[int] = set()  # images a Segment the rest job is writing
        session.labels_listeners.append(self._session_edited)
        if open_first:
            self.goto(self.resume_index())

    # -- progress on disk ----------------------------------------------------------------------
    @property
    def progress_path(self) -> Path:
        return self.out_dir / PROGRESS_NAME

    def _load_progress(self) -> None:
        try:
            doc = json.loads(self.progress_path.read_text(encoding="utf-8"))
            rows = doc.get("images", {}) if isinstance(doc, dict) else {}
        except (OSError, ValueError):
            rows = {}
        for im in self.images:
            row = rows.get(im.name)
            if isinstance(row, dict):
                im.state = row.get("state", NOT_STARTED) if row.get("state") in (
                    NOT_STARTED, PRESEGMENTED, ANNOTATED, SKIPPED) else NOT_STARTED
                im.objects = int(row.get("objects", 0) or 0)
                im.done = bool(row.get("done", False))
            if im.labels_path.exists() and not isinstance(row, dict):
                try:  # labels from elsewhere (a folder job, ground truth): counted, loaded when opened
                    im.objects = count_objects(label_files.read_labels(im.labels_path))
                    im.state = ANNOTATED
                except Exception as exc:  # noqa: BLE001 - shown as not started; opening it says why
                    logger.warning("%s: cannot read (%s)", im.labels_path, exc)

    def _save_progress(self) -> None:
        doc = {"version": 1, "images_folder": str(self.in_dir), "pattern": self.pattern,
               "current": None if self.index is None else self.images[self.index].name,
               "images": {im.name: {k: v for k, v in asdict(im).items() if k in ("state", "objects", "done")}
                          for im in self.images}}
        label_files.atomic_write_text(self.progress_path, json.dumps(doc, indent=1))

    def _changed(self) -> None:
        self._save_progress()
        for fn in list(self.listeners):
            fn()

    # -- where we are ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.images)

    @property
    def current(self) -> FolderImage | None:
        return None if self.index is None else self.images[self.index]

    def resume_index(self) -> int:
        """The first image neither done nor skipped (the last image when all are)."""
        return next((i for i, im in enumerate(self.images) if not im.done and im.state != SKIPPED),
                    len(self.images) - 1)

    @property
    def finished(self) -> bool:
        return all(im.done or im.state == SKIPPED for im in self.images)

    # -- moving ---------------------------------------------------------------------------------
    def goto(self, index: int) -> FolderImage:
        """Open image ``index``: its labels file when there is one, else its pre-segmentation
        (with ``presegment``), else empty labels; the next image is prefetched."""
        if not 0 <= index < len(self.images):
            raise IndexError(f"image {index} is not in a folder of {len(self.images)} images")
        if index in self._rest:
            raise ValueError(f"{self.images[index].name} is being segmented (Segment the rest): "
                             "wait until it is done or cancel it")
        if self.index is not None and index != self.index:
            self.flush()
        image, labels, state = self._take_ahead(index)
        im = self.images[index]
        self.session.clear()
        self.session.set_image(image, labels=labels)
        self.index, self.image = index, image
        self._image_id, self._saved_sum = self.session.image_id, _checksum(self.session.labels)
        if state is not None and im.state in (NOT_STARTED, PRESEGMENTED):
            im.state = state
        im.objects = count_objects(labels)
        job = self._embed_job = None
        if self.embed and not self.session.too_big:
            # the next image once this one is embedded: its read and encoder work would
            # otherwise slow this image's first prompt down
            then = lambda *_a, i=index: self._prefetch_after(i)  # noqa: E731
            job = self._embed_job = self.session.embed_async(on_done=then, on_cancelled=then)
        if job is None:
            self._prefetch(index + 1)
        self._changed()
        return im

    def next(self) -> FolderImage | None:
        """Move on: the image is done (a pre-segmentation left as it is is accepted and saved);
        the next image, or None at the end (the current one stays open)."""
        im = self.current
        if im is not None:
            if im.state == PRESEGMENTED:  # shown and left as it is (also a Segment the rest file)
                self.save()
            if im.state == ANNOTATED:
                im.done = True
            self._save_progress()
        if self.index is None or self.index + 1 >= len(self.images):
            self._changed()
            return None
        return self.goto(self.index + 1)

    def previous(self) -> FolderImage | None:
        if not self.index:
            return None
        return self.goto(self.index - 1)

    def skip(self) -> FolderImage | None:
        """Mark this image skipped (its labels file, if any, stays as it is) and go on."""
        im = self.current
        if im is not None:
            im.state, im.done = SKIPPED, True
        return self.next()

    # -- edits ----------------------------------------------------------------------------------
    def commit(self) -> int | None:
        """Commit the session's current object (saved, as every change of the session's
        labels is); its id."""
        return self.session.commit()

    def undo(self) -> list[int]:
        return self.session.undo()

    def edited(self) -> None:
        """The labels were changed outside the session (painted in a viewer): save them."""
        self.save()

    def flush(self) -> bool:
        """Save the open image's labels when they differ from those loaded or saved last (an
        edit nobody reported, such as a viewer's own undo of a painted stroke); True if saved."""
        if self.index is None or self.session.image_id != self._image_id:
            return False
        if _checksum(self.session.labels) == self._saved_sum:
            return False
        self.save()
        return True

    def _session_edited(self) -> None:
        """The session changed its labels: save them when they are the open image's."""
        if self._closed or self.index is None or self.session.image_id != self._image_id:
            return
        try:
            self.save()
        except OSError as exc:  # the edit stays in memory; the listeners say why it is not on disk
            logger.warning("labels not saved: %s", exc)
            for fn in list(self.label_listeners):
                fn(self.current, f"labels not saved: {exc}")

    def save(self) -> Path:
        """Write the current labels to ``OUT/<name>_labels.tif`` atomically; the image is
        annotated."""
        im = self.current
        if im is None:
            raise ValueError("no image open")
        labels = self.session.labels
        label_files.write_labels(im.labels_path, labels, {"method": "annotation"})
        self._saved_sum = _checksum(labels)
        im.state = ANNOTATED
        im.objects = count_objects(labels)
        self._changed()
        for fn in list(self.label_listeners):
            fn(im, None)
        return im.labels_path

    # -- the images still to do -----------------------------------------------------------------
    def set_presegmenter(self, presegment) -> bool:
        """Pre-segment the images still to do with ``presegment`` from now on (a
        :class:`Presegmenter`, a callable image -> labels, or None). Images with a labels file,
        annotated or skipped are never touched; the image read ahead is read again, and the
        open image is opened again when it shows an unedited pre-segmentation or nothing
        (True then)."""
        old, self.presegment = self.presegment, presegment
        if isinstance(old, Presegmenter) and old is not presegment:
            old.close()
        with self._lock:
            self._drop_ahead()
        im = self.current
        if (im is not None and im.state in (NOT_STARTED, PRESEGMENTED) and not im.labels_path.exists()
                and self.session.image_id == self._image_id and _checksum(self.session.labels) == self._saved_sum):
            self.goto(self.index)
            return True
        if self.index is not None:
            self._prefetch(self.index + 1)
        self._changed()
        return False

    def annotated(self) -> list[FolderImage]:
        """The images annotated (by hand, or accepted with Next, or labels found on disk) whose
        labels file holds objects: what training learns from."""
        return [im for im in self.images
                if im.state == ANNOTATED and im.objects > 0 and im.labels_path.exists()]

    def training_pairs(self) -> tuple[list[np.ndarray], list[np.ndarray], list[FolderImage]]:
        """(images, labels, which) of :meth:`annotated`, read from disk (the open image's edits
        saved first); ``ValueError`` (one line) when there is none."""
        self.flush()
        images, labels, which = [], [], []
        for im in self.annotated():
            lab = np.asarray(label_files.read_labels(im.labels_path))
            if not lab.any():
                continue
            images.append(gio.read_image(im.path))
            labels.append(lab)
            which.append(im)
        if not which:
            raise ValueError("no annotated image with objects yet: annotate (or correct and accept) "
                             "a few images first")
        return images, labels, which

    def rest(self) -> list[FolderImage]:
        """The images Segment the rest runs on: neither done, skipped, annotated nor open, and
        without a labels file unless a folder job wrote it (an earlier Segment the rest)."""
        out = []
        for i, im in enumerate(self.images):
            if i == self.index or im.done or im.state in (ANNOTATED, SKIPPED) or i in self._rest:
                continue
            if im.labels_path.exists() or im.labels_path.is_symlink():
                info = label_files.output_info(im.labels_path)
                if info is None or info.get("method") in (None, "annotation") or im.state != PRESEGMENTED:
                    continue
            out.append(im)
        return out

    def start_rest(self) -> list[FolderImage]:
        """Claim :meth:`rest` for a Segment the rest job (they cannot be opened until
        :meth:`finish_rest`); ``ValueError`` (one line) when it cannot run."""
        if not isinstance(self.presegment, Presegmenter):
            raise ValueError("Segment the rest needs a pre-segmentation method (U-Net or SAM automatic): "
                             "choose one, or train one on the annotated images")
        if self._rest:
            raise ValueError("Segment the rest is already running")
        items = self.rest()
        if not items:
            raise ValueError("nothing left to segment: every image is annotated, skipped, done or open")
        self._rest = {self.images.index(im) for im in items}
        with self._lock:
            if self._ahead is not None and self._ahead.index in self._rest:
                self._drop_ahead()
        return items

    def run_rest(self, items: list[FolderImage], progress=None, cancel=None):
        """Run the folder job on ``items`` (any thread; changes no state): the pre-segmenter's
        method and options, the folder job's names in :attr:`out_dir`, replacing only the files
        of these images (which :meth:`rest` chose). Returns its ``RunReport``."""
        from ..jobs.pipeline import run_folder

        pre = self.presegment
        return run_folder(self.in_dir, self.out_dir, pre.method, pattern=self.pattern,
                          method_options=dict(pre.options), files=[im.path for im in items], overwrite=True,
                          progress=progress, cancel=cancel)

    def finish_rest(self, items: list[FolderImage]) -> int:
        """After :meth:`run_rest` (finished, failed or cancelled): the images it wrote are
        pre-segmented, with their object counts; how many."""
        n = 0
        for im in items:
            info = label_files.output_info(im.labels_path) if im.labels_path.exists() else None
            if info is None or info.get("method") in (None, "annotation"):
                continue
            try:
                im.objects = count_objects(label_files.read_labels(im.labels_path))
            except Exception as exc:  # noqa: BLE001 - shown as it was; opening it says why
                logger.warning("%s: cannot read (%s)", im.labels_path, exc)
                continue
            if im.state in (NOT_STARTED, PRESEGMENTED) and not im.done:
                im.state = PRESEGMENTED
                n += 1
        self._rest = set()
        if self.index is not None:
            with self._lock:
                self._drop_ahead()  # read before its file was written
            self._prefetch(self.index + 1)
        self._changed()
        return n

    def segment_rest(self, progress=None, cancel=None):
        """:meth:`start_rest`, :meth:`run_rest`, :meth:`finish_rest` in this thread; the report."""
        items = self.start_rest()
        try:
            return self.run_rest(items, progress=progress, cancel=cancel)
        finally:
            self.finish_rest(items)

    # -- reading ahead --------------------------------------------------------------------------
    def _read(self, index: int):
        """(image, labels, state the labels give) of image ``index`` (any thread)."""
        im = self.images[index]
        image = gio.read_image(im.path)
        shape = image.shape[:-1] if _rgb(image) else image.shape
        if im.labels_path.exists():
            labels = np.asarray(label_files.read_labels(im.labels_path))
            if labels.shape != shape:
                raise ValueError(f"{im.labels_path.name}: labels of shape {labels.shape} do not fit "
                                 f"{im.name} of shape {shape}")
            return image, labels.astype(np.int32), None
        if self.presegment is not None and im.state != SKIPPED:
            return image, np.asarray(self.presegment(image)).astype(np.int32), PRESEGMENTED
        return image, np.zeros(shape, np.int32), None

    def _prefetch_after(self, index: int) -> None:
        if self.index == index:
            self._prefetch(index + 1)

    def _prefetch(self, index: int) -> None:
        with self._lock:
            self._prefetch_locked(index)

    def _prefetch_locked(self, index: int) -> None:
        if self._closed:
            return
        old = self._ahead
        if old is not None and old.index != index:
            self._drop_ahead()
        if not self.prefetch or index >= len(self.images) or self._ahead is not None:
            return
        ahead = self._ahead = _Ahead(index, self._pool.submit(self._read, index))
        ahead.read.add_done_callback(lambda fut: self._embed_ahead(ahead, fut))

    def _embed_ahead(self, ahead: _Ahead, fut: Future) -> None:
        if ahead is not self._ahead or fut.cancelled() or fut.exception() is not None:
            return
        image = fut.result()[0]
        shape = image.shape[:-1] if _rgb(image) else image.shape
        if len(shape) != 2 or shape[0] * shape[1] > _max_plane_px():
            return  # stacks and too-big images are embedded when opened (a plane, a region)
        model, session = self.session.model, self.session

        def engine_of():
            return session.engine(model)

        # the worker's own submit (thread-safe; this runs in the reading thread); the job is
        # cancelled here when the folder moves elsewhere or closes
        ahead.job = session.worker.submit(_embed_and_warm, engine_of, image, tag=("prefetch", id(self)),
                                          replace=True, priority=IDLE)

    def _take_ahead(self, index: int):
        with self._lock:
            return self._take_ahead_locked(index)

    def _take_ahead_locked(self, index: int):
        ahead = self._ahead
        taken, self._taken_job = self._taken_job, None
        if taken is not None:  # the image it embeds is left now
            taken.cancel()
        if ahead is not None and ahead.index == index:
            self._ahead = None
            self._taken_job = ahead.job
            try:
                return ahead.read.result()
            except Exception:  # noqa: BLE001 - read again below: its error is the one to show
                logger.debug("prefetch of %s failed", self.images[index].name, exc_info=True)
        self._drop_ahead()
        return self._read(index)

    def _drop_ahead(self) -> None:
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return
        ahead.read.cancel()
        if ahead.job is not None:
            ahead.job.cancel()

    def wait_prefetched(self, timeout: float | None = None) -> bool:
        """Wait until the next image is read and embedded (tests, benchmarks); False when
        nothing is being prefetched."""
        if self._embed_job is not None:
            self._embed_job.wait(timeout)
            if self.index is not None:
                self._prefetch(self.index + 1)  # as the embedding's callback does (idempotent)
        ahead = self._ahead
        if ahead is None:
            return False
        ahead.read.result(timeout)
        if ahead.job is None:
            return False
        return ahead.job.wait(timeout)

    def close(self) -> None:
        """Stop reading ahead and embedding: the next image's embedding, and the open image's
        (its own, or the one it took over from reading ahead). The labels are saved as they
        change."""
        with self._lock:
            self._closed = True
            self._drop_ahead()
            for job in (self._taken_job, self._embed_job):
                if job is not None:
                    job.cancel()
            self._taken_job = self._embed_job = None
        if self._session_edited in self.session.labels_listeners:
            self.session.labels_listeners.remove(self._session_edited)
        self._pool.shutdown(wait=False, cancel_futures=True)


def _embed_and_warm(engine_of, img, progress=None, cancel=None):
    """Every view of an image (as the session's background embedding), then the decoder's
    image-only work for them, so that the first prompt after Next only decodes."""
    image, _seconds = yield from steps.tiles(engine_of, img, None, lambda: None, lambda _p: None,
                                             progress=progress, cancel=cancel)
    steps.warm(engine_of, image, cancel=cancel)
    return image


def _checksum(labels: np.ndarray) -> int:
    return zlib.adler32(np.ascontiguousarray(labels).data)


def _rgb(image: np.ndarray) -> bool:
    """As :meth:`AnnotationSession.set_image` takes it: YX with a last axis of 3 or 4."""
    return image.ndim == 3 and image.shape[-1] in (3, 4)


def _max_plane_px() -> int:
    from .region import MAX_PLANE_PX

    return MAX_PLANE_PX
