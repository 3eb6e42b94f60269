"""FolderAnnotation without a window: held-out BBBC039 fields (the last 8 are validation), cut to
256 x 256 so that a test embeds little, annotated with clicks through the engine object; a new
object over the same folders finds the labels and the resume point as they were left."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest
import tifffile
from scipy import ndimage as ndi

from napari_gpuseg.engine import AnnotationSession, FolderAnnotation, InferenceWorker, load_engine
from napari_gpuseg.engine.annotate.folder import ANNOTATED, NOT_STARTED, PRESEGMENTED, PROGRESS_NAME, SKIPPED
from napari_gpuseg.io.label_files import output_info

from sam_fixtures import require_lite_medsam

CUT = (slice(100, 356), slice(200, 456))


def validation_fields(shared_data, n):
    names = sorted((shared_data / "bbbc039" / "images").glob("*.tif"))[-8:]
    names = [f for f in names if tifffile.imread(shared_data / "bbbc039" / "masks" / f.name)[CUT].max() > 3]
    return names[:n]


def copy_fields(shared_data, folder, n):
    folder.mkdir()
    gts = {}
    for f in validation_fields(shared_data, n):
        tifffile.imwrite(folder / f.name, tifffile.imread(f)[CUT])
        gts[f.stem] = tifffile.imread(shared_data / "bbbc039" / "masks" / f.name)[CUT]
    return gts


def centres(gt, n):
    """(x, y) inside the ``n`` largest objects."""
    out = []
    for i in sorted(np.unique(gt)[1:], key=lambda i: -(gt == i).sum())[:n]:
        dist = ndi.distance_transform_edt(gt == i)
        y, x = np.unravel_index(int(np.argmax(dist)), gt.shape)
        out.append((float(x), float(y)))
    return out


@pytest.fixture(scope="module")
def engine():
    """The default model, clicks decoded at native scale: one view per 256 px field, so that
    the test embeds five views in all."""
    require_lite_medsam()
    e = load_engine()
    zoom, e.click_zoom = e.click_zoom, 1.0
    yield e
    e.click_zoom = zoom


@pytest.fixture(scope="module")
def worker():
    w = InferenceWorker()
    yield w
    w.shutdown()


@pytest.mark.usefixtures("reuse_embeddings")
def test_annotate_reopen_resume_skip_and_foreign_labels_kept(shared_data, tmp_path, engine, worker):
    images, out = tmp_path / "images", tmp_path / "out"
    gts = copy_fields(shared_data, images, 5)
    stems = sorted(gts)
    assert len(stems) == 5
    out.mkdir()
    foreign = out / f"{stems[4]}_labels.tif"  # ground truth someone put there: never overwritten
    tifffile.imwrite(foreign, gts[stems[4]])
    foreign_bytes = foreign.read_bytes()

    f = FolderAnnotation(AnnotationSession(engine, worker=worker), images, out)
    assert f.index == 0 and len(f) == 5
    assert f.images[4].state == ANNOTATED and f.images[4].objects == len(np.unique(gts[stems[4]])) - 1
    plan = {0: 2, 1: 1, 3: 1}  # image -> objects clicked; image 2 is skipped, 3 left open
    kept = {}
    for i in range(4):
        assert f.index == i
        if i == 2:
            f.skip()
            continue
        assert f.wait_prefetched(120)  # the next image read and embedded meanwhile
        for x, y in centres(gts[stems[i]], plan[i]):
            mask = f.session.click(x, y)
            assert mask[int(y), int(x)]
            assert f.commit() is not None
        kept[i] = f.session.labels.copy()
        on_disk = tifffile.imread(out / f"{stems[i]}_labels.tif")  # saved at each commit
        np.testing.assert_array_equal(on_disk, kept[i])
        assert len(np.unique(on_disk)) - 1 == plan[i]
        if i < 3:
            nxt = f.next()
            # Next found the next image embedded by the prefetch: the prompt only decodes
            assert engine.is_embedded(engine.prepare(f.session.plane_image()))
            assert nxt is f.images[i + 1]
    f.close()
    assert not (out / f"{stems[2]}_labels.tif").exists()

    g = FolderAnnotation(AnnotationSession(engine, worker=worker), images, out, prefetch=False)
    assert g.index == 3  # the first image not done: annotated but not left with Next
    np.testing.assert_array_equal(g.session.labels, kept[3])
    assert [im.state for im in g.images] == [ANNOTATED, ANNOTATED, SKIPPED, ANNOTATED, ANNOTATED]
    assert [im.objects for im in g.images[:4]] == [2, 1, 0, 1]
    assert [im.done for im in g.images] == [True, True, True, False, False]
    g.goto(0)
    np.testing.assert_array_equal(g.session.labels, kept[0])
    g.goto(4)  # opened and left without an edit
    np.testing.assert_array_equal(g.session.labels, gts[stems[4]])
    g.previous()
    g.goto(4)
    g.next()  # the last image: stays, nothing written
    assert foreign.read_bytes() == foreign_bytes and output_info(foreign) is None
    doc = json.loads((out / PROGRESS_NAME).read_text())
    assert doc["images"][f"{stems[2]}.tif"]["state"] == SKIPPED
    g.close()


def test_closing_stops_the_embeddings_of_the_open_and_the_next_image(shared_data, tmp_path, monkeypatch):
    """The next image is embedded ahead; Next takes that job over as the open image's embedding.
    On the last image no later prefetch replaces it: closing the folder cancels it, as it cancels
    a prefetch not yet taken and the open image's own embedding (each kept an encoder busy for
    many seconds after the folder dock had closed)."""
    from napari_gpuseg.engine.annotate import folder as folder_mod
    from napari_gpuseg.engine.runtime.job import CANCELLED

    def endless(engine_of, img, progress=None, cancel=None):  # an embedding that never ends by itself
        while True:
            yield
            time.sleep(0.005)

    monkeypatch.setattr(folder_mod, "_embed_and_warm", endless)
    images, out = tmp_path / "images", tmp_path / "out"
    copy_fields(shared_data, images, 2)
    w = InferenceWorker()
    try:
        f = FolderAnnotation(AnnotationSession(None, worker=w), images, out, embed=False)
        job = _prefetch_job(f, 1)
        f.next()  # the last image opens: its prefetch embedding goes on
        assert f.index == 1 and not job.wait(0.2)
        f.close()
        assert job.wait(30) and job.status == CANCELLED
        # the open image's own embedding stops with the folder too (the docs' example left it
        # embedding a field's tiles in the background after its close())
        session, embeds = AnnotationSession(None, worker=w), []

        def embed_async(on_done=None, on_cancelled=None, **_kw):
            embeds.append(w.submit(endless, None, None, on_result=on_done, on_cancelled=on_cancelled))
            return embeds[-1]

        session.embed_async = embed_async
        g = FolderAnnotation(session, images, out, prefetch=False)
        assert len(embeds) == 1 and not embeds[0].wait(0.2)
        g.close()
        assert embeds[0].wait(30) and embeds[0].status == CANCELLED
    finally:
        w.shutdown()


def _prefetch_job(f, index):
    """The job embedding image ``index`` ahead, once it is submitted."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        ahead = f._ahead
        if ahead is not None and ahead.index == index and ahead.job is not None:
            return ahead.job
        time.sleep(0.01)
    raise AssertionError(f"image {index} was not prefetched")


def test_presegmentation_shown_then_accepted_by_next(shared_data, tmp_path):
    images, out = tmp_path / "images", tmp_path / "out"
    gts = copy_fields(shared_data, images, 2)
    stems = sorted(gts)

    def threshold(image):
        return ndi.label(image > np.percentile(image, 90))[0]

    f = FolderAnnotation(AnnotationSession(None), images, out, presegment=threshold, prefetch=False,
                         embed=False)  # no prompt: the model is never loaded
    first = f.current
    assert first.state == PRESEGMENTED and first.objects > 0 and not first.labels_path.exists()
    expected = threshold(tifffile.imread(images / f"{stems[0]}.tif"))
    f.next()  # accepted as it is: saved
    np.testing.assert_array_equal(tifffile.imread(first.labels_path), expected)
    assert first.state == ANNOTATED and first.done
    f.undo()  # nothing committed on this image: nothing happens
    assert f.current.state == PRESEGMENTED
    f.skip()  # skipped: its pre-segmentation is not written
    assert not f.images[1].labels_path.exists() and f.images[1].state == SKIPPED
    f.close()
    g = FolderAnnotation(AnnotationSession(None), images, out, presegment=threshold, prefetch=False, embed=False)
    assert g.finished and [im.state for im in g.images] == [ANNOTATED, SKIPPED]


def test_unet_presegmentation_finds_the_nuclei(shared_data, tmp_path):
    from napari_gpuseg.engine.annotate.folder import unet_presegmenter

    images = tmp_path / "images"
    gts = copy_fields(shared_data, images, 1)
    f = FolderAnnotation(AnnotationSession(None), images, tmp_path / "out", presegment=unet_presegmenter(),
                         prefetch=False, embed=False)
    gt = next(iter(gts.values()))
    n_gt = len(np.unique(gt)) - 1
    assert f.current.state == PRESEGMENTED and abs(f.current.objects - n_gt) <= max(2, n_gt // 5)
    hit = (f.session.labels > 0) == (gt > 0)
    assert hit.mean() > 0.9  # foreground where the ground truth has nuclei
    f.close()


def test_bad_folders_say_why(tmp_path):
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "a.jpg").write_bytes(b"x")
    with pytest.raises(NotADirectoryError, match="image folder not found"):
        FolderAnnotation(AnnotationSession(None), tmp_path / "nope", tmp_path / "out")
    with pytest.raises(ValueError, match="matches the file pattern"):
        FolderAnnotation(AnnotationSession(None), tmp_path / "images", tmp_path / "out")
    assert NOT_STARTED == "not started"
