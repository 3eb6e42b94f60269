"""Train from what is annotated in a folder, then segment the rest, without a window: held-out
BBBC039 fields cut to 128 px (whole-cell scratch-assay training frames for Adapt SAM), annotated
by putting their ground truth in; a tiny training budget (two steps) keeps each test fast."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import tifffile
import torch

from napari_gpuseg.engine import AnnotationSession, FolderAnnotation
from napari_gpuseg.engine.annotate.folder import (ANNOTATED, NOT_STARTED, PRESEGMENTED, SKIPPED, Presegmenter,
                                                  unet_presegmenter)
from napari_gpuseg.engine.annotate.folder_train import (adapt_sam_on_annotated, models_dir,
                                                        train_unet_on_annotated)
from napari_gpuseg.engine.runtime.cancel import CancelToken
from napari_gpuseg.io.label_files import output_info

from sam_fixtures import require_lite_medsam

CUT = (slice(100, 228), slice(200, 328))


def tiny_unet_schedule():
    from napari_gpuseg.engine.unet.finetune_annotated import default_schedule

    return replace(default_schedule(), epochs=1, iters_per_epoch=2, batch_size=2, crop_size=64, warmup_iters=1)


def fields(shared_data, folder, n):
    """``n`` validation fields with objects in the cut, written to ``folder``; {stem: gt}."""
    folder.mkdir()
    gts = {}
    for f in sorted((shared_data / "bbbc039" / "images").glob("*.tif"))[-8:]:
        gt = tifffile.imread(shared_data / "bbbc039" / "masks" / f.name)[CUT]
        if len(np.unique(gt)) > 4 and len(gts) < n:
            tifffile.imwrite(folder / f.name, tifffile.imread(f)[CUT])
            gts[f.stem] = gt
    assert len(gts) == n
    return gts


def annotate(f: FolderAnnotation, gt: np.ndarray) -> None:
    """The open image's labels become ``gt`` (as a painted edit would), then Next."""
    f.session.labels[:] = gt
    f.edited()
    f.next()


def threshold():
    return Presegmenter("threshold")


def test_unet_trained_on_annotated_presegments_the_rest(shared_data, tmp_path):
    images, out = tmp_path / "images", tmp_path / "out"
    gts = fields(shared_data, images, 4)
    stems = sorted(gts)
    f = FolderAnnotation(AnnotationSession(None), images, out, presegment=unet_presegmenter(), prefetch=False,
                         embed=False)
    annotate(f, gts[stems[0]])
    annotate(f, gts[stems[1]])
    assert f.index == 2 and f.current.state == PRESEGMENTED and not f.current.labels_path.exists()
    kept = {i: f.images[i].labels_path.read_bytes() for i in (0, 1)}
    assert [im.name for im in f.annotated()] == [f"{stems[0]}.tif", f"{stems[1]}.tif"]
    losses = []
    res = train_unet_on_annotated(f, config=tiny_unet_schedule(),
                                  on_event=lambda ev: ev.kind == "iter" and losses.append(ev.train_loss))
    assert res.stopped == "completed" and res.images == 2 and res.steps == 2 and len(losses) == 2
    assert res.path is not None and models_dir(out) in __import__("pathlib").Path(res.path).parents
    assert sorted(p.name for p in models_dir(out).iterdir()) == ["unet_1.pt"]  # no temporary file left
    # the new checkpoint pre-segments the images still to do: the open (unedited) one again, the next
    assert f.presegment.method == "unet" and f.presegment.model == res.path
    new = unet_presegmenter(res.path)
    image2 = tifffile.imread(images / f"{stems[2]}.tif")
    np.testing.assert_array_equal(f.session.labels, new(image2))
    f.next()  # the third accepted as the new model segmented it
    assert f.index == 3 and f.current.state == PRESEGMENTED
    np.testing.assert_array_equal(f.session.labels, new(tifffile.imread(images / f"{stems[3]}.tif")))
    # the weights moved from the bundled model's, and the annotated files were never touched
    from napari_gpuseg.engine.unet.unet_checkpoint import bundled_model_path, load_checkpoint

    a, b = load_checkpoint(bundled_model_path())["state_dict"], load_checkpoint(res.path)["state_dict"]
    assert any(not torch.equal(a[k], b[k]) for k in a)
    assert all(f.images[i].labels_path.read_bytes() == kept[i] for i in (0, 1))
    # a second round starts from the first round's model, saved beside it
    res2 = train_unet_on_annotated(f, config=tiny_unet_schedule())
    assert res2.path.endswith("unet_2.pt") and f.presegment.model == res2.path
    f.close()


def test_segment_the_rest_writes_only_images_still_to_do(shared_data, tmp_path):
    images, out = tmp_path / "images", tmp_path / "out"
    gts = fields(shared_data, images, 5)
    stems = sorted(gts)
    out.mkdir()
    foreign = out / f"{stems[4]}_labels.tif"  # ground truth put there by hand: counted as annotated
    tifffile.imwrite(foreign, gts[stems[4]])
    f = FolderAnnotation(AnnotationSession(None), images, out, presegment=threshold(), prefetch=False, embed=False)
    annotate(f, gts[stems[0]])
    f.skip()
    assert f.index == 2  # open, not edited: Segment the rest leaves it to the user
    before = {p.name: p.read_bytes() for p in out.glob("*_labels.tif")}
    assert [im.name for im in f.rest()] == [f"{stems[3]}.tif"]
    items = f.start_rest()
    with pytest.raises(ValueError, match="being segmented"):
        f.goto(3)
    f.run_rest(items)
    assert f.finish_rest(items) == 1
    written = sorted(p.name for p in out.glob("*_labels.tif"))
    assert written == sorted(list(before) + [f"{stems[3]}_labels.tif"])
    assert all((out / name).read_bytes() == data for name, data in before.items())  # byte for byte
    assert not f.images[1].labels_path.exists() and f.images[1].state == SKIPPED
    assert [im.state for im in f.images] == [ANNOTATED, SKIPPED, PRESEGMENTED, PRESEGMENTED, ANNOTATED]
    rest = f.images[3]
    expected = threshold()(tifffile.imread(images / f"{stems[3]}.tif"))
    np.testing.assert_array_equal(tifffile.imread(rest.labels_path), expected)
    assert rest.objects == len(np.unique(expected)) - 1 and output_info(rest.labels_path)["method"] == "threshold"
    # opened, its file is shown; Next accepts it as the user's; nothing is left to segment after
    f.goto(3)
    np.testing.assert_array_equal(f.session.labels, expected)
    f.next()
    assert rest.state == ANNOTATED and output_info(rest.labels_path)["method"] == "annotation"
    f.goto(2)
    with pytest.raises(ValueError, match="nothing left to segment"):
        f.segment_rest()
    f.close()
    # reopened: the states as they were left
    g = FolderAnnotation(AnnotationSession(None), images, out, prefetch=False, embed=False, open_first=False)
    assert [im.state for im in g.images][:4] == [ANNOTATED, SKIPPED, PRESEGMENTED, ANNOTATED]
    g.close()


def test_segment_the_rest_needs_a_method_and_skips_what_is_open(shared_data, tmp_path):
    images, out = tmp_path / "images", tmp_path / "out"
    fields(shared_data, images, 2)
    f = FolderAnnotation(AnnotationSession(None), images, out, prefetch=False, embed=False)
    with pytest.raises(ValueError, match="needs a pre-segmentation method"):
        f.segment_rest()
    assert f.set_presegmenter(threshold())  # the open image, untouched, is pre-segmented now
    assert f.current.state == PRESEGMENTED and f.current.objects > 0
    assert f.images[1].state == NOT_STARTED
    f.segment_rest()
    assert f.images[1].state == PRESEGMENTED and not f.images[0].labels_path.exists()
    f.close()


def test_cancel_writes_nothing(shared_data, tmp_path):
    images, out = tmp_path / "images", tmp_path / "out"
    gts = fields(shared_data, images, 3)
    stems = sorted(gts)
    f = FolderAnnotation(AnnotationSession(None), images, out, presegment=threshold(), prefetch=False, embed=False)
    annotate(f, gts[stems[0]])
    pre = f.presegment
    stop = CancelToken()
    stop.cancel()
    res = train_unet_on_annotated(f, config=tiny_unet_schedule(), cancel=stop)
    assert res.path is None and res.stopped == "cancelled"
    assert not any(models_dir(out).iterdir()) and f.presegment is pre  # no model, not even a temporary one
    # cancelled after its first step
    stop2 = CancelToken()
    res = train_unet_on_annotated(f, config=replace(tiny_unet_schedule(), iters_per_epoch=50),
                                  on_event=lambda ev: stop2.cancel(), cancel=stop2)
    assert res.path is None and not any(models_dir(out).iterdir()) and f.presegment is pre
    labels_before = sorted(p.name for p in out.glob("*_labels.tif"))
    assert f.segment_rest(cancel=stop).cancelled  # a folder job cancelled before it starts
    assert sorted(p.name for p in out.glob("*_labels.tif")) == labels_before
    assert f.images[2].state == NOT_STARTED
    f.goto(2)  # no longer claimed by the job
    f.close()


def test_no_annotation_no_training(shared_data, tmp_path):
    images = tmp_path / "images"
    fields(shared_data, images, 1)
    f = FolderAnnotation(AnnotationSession(None), images, tmp_path / "out", prefetch=False, embed=False)
    with pytest.raises(ValueError, match="no annotated image with objects"):
        train_unet_on_annotated(f, config=tiny_unet_schedule())
    f.close()


@pytest.mark.usefixtures("reuse_embeddings")
@pytest.mark.slow
def test_adapt_sam_on_annotated_cells(shared_data, tmp_path):
    require_lite_medsam()
    images, out, adapted = tmp_path / "images", tmp_path / "out", tmp_path / "adapted"
    images.mkdir()
    d = shared_data / "scratch_assay" / "cells"
    for t in ("t02", "t03", "t04"):  # training frames
        tifffile.imwrite(images / f"{t}.tif", tifffile.imread(d / "images" / f"{t}.tif")[:128, 100:228])
    f = FolderAnnotation(AnnotationSession(None), images, out, prefetch=False, embed=False)
    annotate(f, tifffile.imread(d / "masks" / "t02.tif")[:128, 100:228])
    f.session.labels[:8, :8] = 1  # an edit on the open image: it is the user's, no longer pre-segmented
    f.edited()
    from napari_gpuseg.engine.sam.training.adapt import few_object_config

    cfg = few_object_config(4, minutes=1)
    cfg.max_steps, cfg.max_time, cfg.view_zooms, cfg.orientations = 2, None, (1.0,), 1
    cfg.encoder_lr = 0.0  # the decoder alone: the folder's wiring is tested here (the encoder: test_sam_adapt_engine)
    stop = CancelToken()
    stop.cancel()
    res = adapt_sam_on_annotated(f, config=cfg, models_folder=adapted, cancel=stop)
    assert res.path is None and res.stopped == "cancelled" and f.presegment is None
    assert not adapted.exists() or not list(adapted.glob("*.pt"))
    steps = []
    res = adapt_sam_on_annotated(f, config=cfg, models_folder=adapted, on_event=lambda ev: steps.append(ev.loss))
    assert res.path is not None and res.steps == 2 and len(steps) == 2 and res.objects > 5
    # the session prompts with the adapted decoder; SAM automatic with it pre-segments the rest
    assert f.session.model == res.path
    assert f.presegment.method == "sam-everything" and f.presegment.model == res.path
    assert f.images[1].state == ANNOTATED and f.session.labels[:8, :8].all()  # the open image untouched
    f.close()
