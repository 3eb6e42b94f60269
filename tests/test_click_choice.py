"""Which candidate a first click keeps: measured on labelled objects, stored with the decoder,
applied by the engine and the session alike."""
import shutil

import numpy as np
import pytest
import tifffile
import torch

from napari_gpuseg.engine import AnnotationSession, load_engine
from napari_gpuseg.engine.annotate.session_clicks import session_click_ious
from napari_gpuseg.engine.sam.interactive.cache import EmbeddingCache
from napari_gpuseg.engine.sam.interactive.prompt_types import Prompt
from napari_gpuseg.engine.sam.training.click_choice import (THRESHOLDS, choose_click_output, choose_click_threshold,
                                                           output_to_train)
from napari_gpuseg.models import registry
from napari_gpuseg.models.sam.decoder_checkpoint import read_decoder, set_decoder_fields
from napari_gpuseg.models.state_dict_loading import CheckpointError

from sam_fixtures import require_lite_medsam

SHIPPED = registry.WEIGHTS_DIR / registry.MODELS["cells_nuclei_sam"].filename


@pytest.fixture(scope="module")
def cache():
    require_lite_medsam()
    return EmbeddingCache()


@pytest.fixture(scope="module")
def cells(shared_data):
    """Whole cells of a training frame of the scratch assay (transmitted light)."""
    d = shared_data / "scratch_assay" / "cells"
    return tifffile.imread(d / "images" / "t02.tif"), tifffile.imread(d / "masks" / "t02.tif")


def test_the_engine_keeps_the_candidate_the_decoder_file_names(cache, tmp_path):
    path = tmp_path / "decoder.pt"
    shutil.copyfile(SHIPPED, path)
    set_decoder_fields(path, click_output=2)
    engine = load_engine(str(path), cache=cache)
    assert engine.click_output == 2 and read_decoder(path)["state"].keys() == read_decoder(SHIPPED)["state"].keys()
    image = np.zeros((96, 96), np.float32)
    image[30:60, 35:70] = 1.0
    prompt = Prompt(points=np.array([[50.0, 45.0]]), labels=np.array([1]))
    res = engine.predict(image, [prompt], multimask=True)[0]
    assert res.score == pytest.approx(float(res.all_scores[2]))  # candidate 2, whatever the head rates best
    engine.click_output = None
    res = engine.predict(image, [prompt], multimask=True)[0]
    assert res.score == pytest.approx(float(res.all_scores.max()))
    # a value the engine could not use is refused, and the file stays as it was
    with pytest.raises(CheckpointError, match="'click_output' must be None or a candidate index"):
        set_decoder_fields(path, click_output=7)
    assert read_decoder(path)["click_output"] == 2


def test_a_first_click_is_cut_at_the_logit_the_decoder_file_names(cache, tmp_path):
    """``click_threshold`` moves a first click's outline (its logits shifted, so the mask
    shown is the mask input a corrective click refines); boxes and corrective clicks are cut
    at 0 as before."""
    path = tmp_path / "decoder.pt"
    shutil.copyfile(SHIPPED, path)
    image = np.zeros((96, 96), np.float32)
    image[30:60, 35:70] = 1.0
    image[40:50, 45:60] = 0.6
    click = Prompt(points=np.array([[50.0, 45.0]]), labels=np.array([1]))
    box = Prompt(box=np.array([35.0, 30.0, 69.0, 59.0]))
    got = {}
    for thr in (None, -4.0, 4.0):
        set_decoder_fields(path, click_threshold=thr)
        engine = load_engine(str(path), cache=cache)
        assert engine.click_threshold == (thr or 0.0)
        first = engine.predict(image, [click], multimask=True)[0]
        again = Prompt(points=np.array([[50.0, 45.0], [20.0, 20.0]]), labels=np.array([1, 0]), mask_input=first)
        got[thr] = first, engine.predict(image, [box])[0], engine.predict(image, [again])[0]
    (zero, box0, _), (low, box_low, _), (high, box_high, _) = got[None], got[-4.0], got[4.0]
    torch.testing.assert_close(low.low_res, zero.low_res + 4.0)  # the same logits, shifted
    torch.testing.assert_close(high.low_res, zero.low_res - 4.0)
    assert (low.mask >= zero.mask).all() and (zero.mask >= high.mask).all()
    assert low.mask.sum() > zero.mask.sum() > high.mask.sum()
    assert low.score == zero.score == high.score
    assert np.array_equal(box0.mask, box_low.mask) and np.array_equal(box0.mask, box_high.mask)
    with pytest.raises(CheckpointError, match="'click_threshold' must be None or a logit"):
        set_decoder_fields(path, click_threshold=-20.0)


@pytest.mark.usefixtures("reuse_embeddings")
@pytest.mark.slow
def test_the_shipped_decoder_cuts_first_clicks_as_measured_and_the_session_clicks_what_was_measured(cache, cells):
    """The shipped file names the logit measured on its 291 training objects (kept only where it
    beat 0 by more than 0.005); measuring on whole cells leaves the engine as it was, and the
    annotator's path gives the masks measured at that logit."""
    doc = read_decoder(SHIPPED)
    stored = doc["click_threshold_choice"]
    assert stored["objects"] == 291 and stored["threshold"] == doc["click_threshold"] == -2.0
    ious = stored["one_click_iou"]
    assert ious["logit -2"] == max(ious.values()) > ious["logit +0"] + 0.005
    engine = load_engine(cache=cache)
    img, lab = cells
    chosen, means, per_rule = choose_click_threshold(engine, [(img, lab, 10)])
    assert engine.click_threshold == -2.0 and set(means) == {0.0, *THRESHOLDS}  # left as it was
    assert all(len(np.concatenate(v)) == 10 for v in per_rule.values())
    through = session_click_ious(AnnotationSession(engine, cache=cache), img, lab, clicks=1, max_objects=10, box=False)
    assert through["clicks"][:, 0].mean() == pytest.approx(means[-2.0], abs=1e-6)
    assert means[-2.0] > means[0.0]  # whole cells: the outline drawn lower is the closer one


@pytest.mark.usefixtures("reuse_embeddings")
@pytest.mark.slow
def test_the_shipped_decoder_keeps_the_choice_its_file_names_and_the_session_clicks_what_was_measured(cache, cells):
    """The shipped file names the first-click rule measured on its 291 training objects (a
    fixed candidate only where it beat the IoU head's choice by more than 0.01); the engine
    applies it, measuring on whole cells of a training frame leaves it as it was, and the
    annotator's path (a session, one object at a time) gives the masks measured for that rule."""
    doc = read_decoder(SHIPPED)
    stored = doc["click_choice"]
    assert stored["objects"] == 291 and stored["output"] == doc["click_output"]
    best = max((k for k in stored["one_click_iou"] if k != "head"), key=stored["one_click_iou"].get)
    beats = stored["one_click_iou"][best] > stored["one_click_iou"]["head"] + 0.01
    assert doc["click_output"] == (int(best) if beats else None)
    engine = load_engine(cache=cache)
    assert engine.click_output == doc["click_output"]
    img, lab = cells
    choice = choose_click_output(engine, [(img, lab, 12)])
    assert engine.click_output == doc["click_output"]  # left as it was
    assert choice.objects == 12 and set(choice.ious) == {"head", "0", "1", "2", "3"}
    rule = "head" if engine.click_output is None else str(engine.click_output)
    through = session_click_ious(AnnotationSession(engine, cache=cache), img, lab, clicks=1, max_objects=12, box=False)
    assert through["clicks"][:, 0].mean() == pytest.approx(choice.ious[rule], abs=1e-6)


@pytest.mark.usefixtures("reuse_embeddings")
def test_every_rule_measured_from_one_decode_gives_each_rules_own_masks(cache, cells, monkeypatch):
    """Inside ``reuse_decodes`` the decoder runs once per view for the same first clicks; each
    rule then keeps its own candidate: the masks and scores of a separate ``predict`` per rule."""
    engine = load_engine(cache=cache)
    img, lab = cells
    img, lab = img[:, :200], lab[:, :200]
    prompts = [Prompt(points=np.array([[x, y]], float), labels=np.array([1])) for x, y in ((40, 60), (150, 120))]
    alone = {}
    for rule in (None, 0, 1, 2, 3):
        engine.click_output = rule
        alone[rule] = engine.predict(img, prompts, multimask=True)
    runs = []
    real = engine._decoder_outputs
    monkeypatch.setattr(engine, "_decoder_outputs", lambda *a, **k: runs.append(1) or real(*a, **k))
    with engine.reuse_decodes():
        for rule in (None, 0, 1, 2, 3):
            engine.click_output = rule
            for mine, theirs in zip(engine.predict(img, prompts, multimask=True), alone[rule]):
                assert mine.view == theirs.view and mine.score == pytest.approx(theirs.score)
                assert np.array_equal(mine.mask, theirs.mask)
        once = len(runs)
    assert 1 <= once <= 4  # the first rule's decodes (a click view and a native view per group)
    engine.predict(img, prompts, multimask=True)
    assert len(runs) > once  # outside it, the decoder runs again


@pytest.mark.usefixtures("reuse_embeddings")
@pytest.mark.slow
def test_the_shipped_decoder_blends_as_measured_and_the_session_clicks_what_was_measured(cache, cells):
    """The shipped file names the blend measured on its 291 training objects (kept only where it
    beat one kept by more than 0.01); measuring on whole cells leaves the engine as it was, and
    the annotator's path gives the masks measured for that temperature."""
    from napari_gpuseg.engine.sam.training.click_choice import BLENDS, choose_click_blend

    doc = read_decoder(SHIPPED)
    stored = doc["click_blend_choice"]
    assert stored["objects"] == 291 and stored["blend"] == doc["click_blend"] == 10.0
    ious = stored["one_click_iou"]
    assert ious[f"blend {doc['click_blend']:g}"] == max(ious.values()) > ious["one kept"] + 0.01
    engine = load_engine(cache=cache)
    img, lab = cells
    chosen, means, per_rule = choose_click_blend(engine, [(img, lab, 10)])
    assert engine.click_blend == 10.0 and set(means) == {None, *BLENDS}  # left as it was
    assert all(len(np.concatenate(v)) == 10 for v in per_rule.values())
    through = session_click_ious(AnnotationSession(engine, cache=cache), img, lab, clicks=1, max_objects=10, box=False)
    assert through["clicks"][:, 0].mean() == pytest.approx(means[10.0], abs=1e-6)
    engine.click_output = 1
    with pytest.raises(ValueError, match="IoU head's choice only"):
        choose_click_blend(engine, [(img, lab, 10)])
    engine.click_output = None


@pytest.mark.parametrize("candidates, keeps, first, trained", [
    ("all", 1, "multi", 1), ("all", 0, "multi", None), ("all", 0, "all", 0), ("all", 3, "multi", 3),
    # a stock decoder offers SAM's three alone: its candidate k is the trained decoder's k + 1
    ("multi", 0, "multi", 1), ("multi", 2, "multi", 3), ("multi", 2, "all", 3),
])
def test_training_aims_a_first_click_at_the_candidate_the_engine_keeps(candidates, keeps, first, trained):
    from types import SimpleNamespace

    engine = SimpleNamespace(click_output=keeps, candidates=candidates)  # keeps one: nothing to measure
    assert output_to_train(engine, [], [], first) == trained


@pytest.mark.usefixtures("reuse_embeddings")
def test_train_sam_measures_which_candidate_a_first_click_keeps_and_stores_it(cells, tmp_path, capsys):
    """``napari-gpuseg train-sam`` ends as Adapt SAM does: one click on a few objects of each
    training image measures the first-click choice, which the file keeps and the engine applies;
    ``--choose-output 0`` keeps the IoU head's choice."""
    from napari_gpuseg.cli.main import main

    require_lite_medsam()
    img, lab = cells
    (tmp_path / "i").mkdir(), (tmp_path / "l").mkdir()
    tifffile.imwrite(tmp_path / "i" / "cells.tif", img[:, :256])
    tifffile.imwrite(tmp_path / "l" / "cells.tif", lab[:, :256])
    base = ["train-sam", "--images", str(tmp_path / "i"), "--labels", str(tmp_path / "l"), "--model", "nuclei_sam",
            "--max-steps", "1", "--val-fraction", "0", "--views-per-image", "1", "--zoom", "1",
            "--views-per-step", "1", "--objects-per-view", "2", "--corrections", "1", "--cache", str(tmp_path / "emb")]
    out = tmp_path / "measured.pt"
    assert main([*base, "--choose-output", "4", "--out", str(out)]) == 0
    said = capsys.readouterr().out
    doc = read_decoder(out)
    assert doc["click_choice"]["objects"] == 4
    assert set(doc["click_choice"]["one_click_iou"]) == {"head", "0", "1", "2", "3"}
    assert doc["click_output"] == doc["click_choice"]["output"]
    # whether its candidates are better blended was measured too; a blend replaces a kept candidate
    assert doc["click_blend_choice"]["objects"] == 4 and doc.get("click_blend") == doc["click_blend_choice"]["blend"]
    assert doc.get("click_blend") is None or doc["click_output"] is None
    engine = load_engine(str(out))
    assert engine.click_output == doc["click_output"] and engine.click_blend == doc.get("click_blend")
    assert "a first click keeps " in said and "one click on 4 objects" in said
    out0 = tmp_path / "head.pt"
    assert main([*base, "--choose-output", "0", "--out", str(out0), "--quiet"]) == 0
    assert read_decoder(out0).get("click_output") is None and "click_choice" not in read_decoder(out0)
    assert main([*base, "--choose-output", "-1", "--out", str(tmp_path / "x.pt"), "--quiet"]) == 2
    assert "--choose-output must be >= 0" in capsys.readouterr().err


def test_ctrl_c_while_train_sam_measures_the_choice_keeps_the_decoder(cells, tmp_path, capsys, monkeypatch):
    from napari_gpuseg.cli.main import main
    from napari_gpuseg.engine.sam.training import click_choice

    def interrupted(*_a, **_k):
        raise KeyboardInterrupt

    require_lite_medsam()
    monkeypatch.setattr(click_choice, "store_click_choice", interrupted)
    img, lab = cells
    (tmp_path / "i").mkdir(), (tmp_path / "l").mkdir()
    tifffile.imwrite(tmp_path / "i" / "cells.tif", img[:, :256])
    tifffile.imwrite(tmp_path / "l" / "cells.tif", lab[:, :256])
    out = tmp_path / "d.pt"
    rc = main(["train-sam", "--images", str(tmp_path / "i"), "--labels", str(tmp_path / "l"), "--model", "nuclei_sam",
               "--max-steps", "1", "--val-fraction", "0", "--views-per-image", "1", "--zoom", "1",
               "--objects-per-view", "2", "--out", str(out), "--cache", str(tmp_path / "emb"), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert rc == 130 and len(err.splitlines()) == 1 and "decoder saved to" in err and str(out) in err, err
    assert out.exists() and read_decoder(out).get("click_output") is None  # the IoU head's choice
