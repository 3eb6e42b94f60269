"""Adapt SAM at engine level: a few objects in, a decoder in the user's list out; the unsure hint."""
import json
from pathlib import Path

import numpy as np
import pytest
import tifffile

from napari_gpuseg.engine import load_engine
from napari_gpuseg.engine.runtime.cancel import CancelToken
from napari_gpuseg.engine.sam.training.adapt import (ADAPT_ENCODER_LR, ADAPT_LR, FEW_OBJECT_VISITS, adapt_to_objects,
                                                     adapted_dir, adapted_entry, adapted_models, few_object_config,
                                                     forget_adapted, unsure_hint)
from napari_gpuseg.engine.sam.training.click_choice import choose_click_output
from napari_gpuseg.engine.sam.interactive.cache import EmbeddingCache
from napari_gpuseg.models.sam.decoder_checkpoint import read_decoder

from sam_fixtures import require_lite_medsam


@pytest.fixture(scope="module")
def cells(shared_data):
    """A 256 px crop of a training frame of the scratch assay with 6 of its cells annotated."""
    d = shared_data / "scratch_assay" / "cells"
    img = tifffile.imread(d / "images" / "t02.tif")[:, 100:356]
    lab = tifffile.imread(d / "masks" / "t02.tif")[:, 100:356]
    inner = set(np.unique(lab[20:-20, 20:-20])) - set(np.unique(lab[[0, -1]])) - set(np.unique(lab[:, [0, -1]]))
    ids = sorted(i for i in inner if i and np.count_nonzero(lab == i) >= 100)[:6]
    return img, np.where(np.isin(lab, ids), lab, 0)


@pytest.fixture(scope="module")
def embeddings():
    """One embedding cache for this module's engines: each adaptation tunes its own engine's
    decoder, and they all run the same encoder on the same crop (embedded once, not per test)."""
    return EmbeddingCache()


def test_the_few_object_schedule_is_bound_by_visits_per_object_not_by_the_machine():
    # 20 visits per object, up to four objects a step: the same steps on any machine, the time
    # budget only an upper bound (a fast GPU's two minutes overtrained 15 cells: +0.018 vs +0.136)
    for n, steps, per_step in ((1, 20, 1), (3, 20, 3), (4, 20, 4), (5, 25, 4), (15, 75, 4), (20, 100, 4)):
        cfg = few_object_config(n, minutes=4)
        assert (cfg.max_steps, cfg.objects_per_view) == (steps, per_step), n
        assert cfg.max_steps * cfg.objects_per_view >= FEW_OBJECT_VISITS * n
        assert cfg.max_time == 240.0 and cfg.lr == ADAPT_LR
        # the encoder's last stage and neck learn too (LiteMedSAM's TinyViT)
        assert cfg.encoder_lr == ADAPT_ENCODER_LR > 0 and cfg.encoder_stages == 1
    assert few_object_config(0).max_steps == 20  # no object yet: the labels check says so later
    # a few objects in all 8 orientations; fewer orientations for more objects (views to embed)
    assert [few_object_config(n).orientations for n in (1, 15, 20, 40, 100, 160, 500)] == [8, 8, 8, 4, 1, 1, 1]


@pytest.mark.usefixtures("reuse_embeddings")
@pytest.mark.slow
def test_adapt_saves_into_the_users_list_with_the_image_name(cells, embeddings, tmp_path, monkeypatch):
    require_lite_medsam()
    monkeypatch.setenv("NAPARI_GPUSEG_CACHE", str(tmp_path / "cache"))
    img, ann = cells
    cfg = few_object_config(6, minutes=1)
    cfg.max_steps, cfg.max_time, cfg.view_zooms, cfg.orientations = 2, None, (1.0,), 1
    engine = load_engine("nuclei_sam", cache=embeddings)
    steps = []
    res = adapt_to_objects(img, ann, model=engine, image_name="/data/my cells.tif", config=cfg,
                           on_event=lambda ev: steps.append(ev.step))
    assert res.objects == 6 and res.steps == 2 and steps == [1, 2] and res.stopped == "done"
    assert res.name == "my_cells_adapted" and adapted_dir() == tmp_path / "cache" / "adapted_sam"
    listed = adapted_models()
    assert [m["name"] for m in listed] == ["my_cells_adapted"]
    assert listed[0]["image"] == "/data/my cells.tif" and listed[0]["objects"] == 6
    adapted = load_engine(listed[0]["path"], cache=engine.cache)
    assert adapted.info.decoder_tuned
    # the encoder's last stage and neck learnt too: the file carries them, and the adapted
    # model's embeddings are its own (never the base's from the shared cache)
    state = read_decoder(listed[0]["path"])["state"]
    assert {k.split(".")[1] for k in state if k.startswith("image_encoder.")} == {"layers", "neck"}
    assert all(k.startswith(("image_encoder.layers.3.", "image_encoder.neck."))
               for k in state if k.startswith("image_encoder."))
    assert adapted.info.encoder not in (engine.info.encoder, "lite_medsam")
    # the first clicks trained the candidate measured on these cells before training (the base
    # keeps none of its own): the one choose_click_output picks with the base's decoder
    aimed = read_decoder(listed[0]["path"])["training"]["config"]["first_output"]
    base = load_engine("nuclei_sam", cache=engine.cache)
    assert base.click_output is None
    assert aimed == choose_click_output(base, [(img, ann, None)]).output == 1  # 0.557 vs the head's 0.403
    # which candidate a first click keeps was measured on the six cells and travels with the file
    doc = read_decoder(listed[0]["path"])
    assert doc["click_choice"]["objects"] == 6 and set(doc["click_choice"]["one_click_iou"]) == {"head", "0", "1", "2", "3"}
    assert adapted.click_output == doc["click_output"] == doc["click_choice"]["output"]
    # a second adaptation of the same image gets its own name; a vanished file drops out
    cfg.max_steps, cfg.encoder_lr = 1, 0.0  # the name is what this one is for
    res2 = adapt_to_objects(img, ann, model=engine, image_name="/data/my cells.tif", config=cfg)
    assert res2.name == "my_cells_adapted_2" and len(adapted_models()) == 2
    (adapted_dir() / "my_cells_adapted.pt").unlink()
    assert [m["name"] for m in adapted_models()] == ["my_cells_adapted_2"]
    # forgetting one deletes its file and takes it off the list; a file not on it is never deleted
    browsed = tmp_path / "browsed.pt"
    browsed.write_bytes(b"a checkpoint of the user's")
    assert forget_adapted(browsed) is None and browsed.is_file()
    assert adapted_entry(res2.path)["name"] == "my_cells_adapted_2" and adapted_entry("nuclei_sam") is None
    assert forget_adapted(res2.path)["name"] == "my_cells_adapted_2"
    assert not Path(res2.path).exists() and adapted_models() == [] and adapted_entry(res2.path) is None
    assert forget_adapted(res2.path) is None


def test_a_model_fine_tuning_cannot_take_is_refused_in_one_line_before_embedding(cells, tmp_path):
    """Training compares masks with objects at the model's input size: SAM's ViT models (random
    weights here, 128 px in, 32 px masks; 1024 and 256 for the real ones) are refused up front."""
    import torch

    from napari_gpuseg.engine.runtime.device import Policy
    from napari_gpuseg.engine.sam.interactive.predictor import SamEngine, SamModelInfo
    from napari_gpuseg.models.sam import build_sam

    engine = SamEngine(build_sam("vit_b", image_size=128), SamModelInfo("vit_b-random", 128, "sam"),
                       Policy(torch.device("cpu"), "fp32"))
    embedded = []
    engine.embed = lambda *a, **k: embedded.append(a)
    img, ann = cells
    with pytest.raises(ValueError, match=r"^fine-tuning needs a model whose masks come at its input size .*"
                                         r"vit_b-random takes 128 px and gives 32 px masks$"):
        adapt_to_objects(img, ann, model=engine, folder=tmp_path)
    assert embedded == [] and adapted_models(tmp_path) == []


def test_adapt_refuses_empty_labels_and_cancel_saves_nothing(cells, embeddings, tmp_path):
    img, ann = cells
    with pytest.raises(ValueError, match="no annotated object"):
        adapt_to_objects(img, np.zeros_like(ann), folder=tmp_path)
    require_lite_medsam()
    token = CancelToken()
    cfg = few_object_config(6, minutes=1)
    cfg.view_zooms, cfg.orientations = (1.0,), 1  # one view to embed before the first step cancels
    res = adapt_to_objects(img, ann, model=load_engine("nuclei_sam", cache=embeddings), folder=tmp_path,
                           config=cfg, cancel=token, on_event=lambda ev: token.cancel())
    assert res.path is None and res.stopped == "cancelled" and adapted_models(tmp_path) == []


def test_a_broken_index_lists_nothing(tmp_path):
    (tmp_path / "index.json").write_text("{not json")
    assert adapted_models(tmp_path) == []
    (tmp_path / "index.json").write_text(json.dumps([{"name": "x", "path": str(tmp_path / "gone.pt")}, 3]))
    assert adapted_models(tmp_path) == []


def test_unsure_hint_speaks_only_below_the_threshold():
    assert unsure_hint(0.95) is None and unsure_hint(float("nan")) is None
    hint = unsure_hint(0.42)
    assert "0.42" in hint and "box" in hint and "adapt" in hint


def test_a_cancel_while_the_first_click_choice_is_measured_keeps_nothing(cells, embeddings, tmp_path, monkeypatch):
    from napari_gpuseg.engine.sam.training import adapt as sam_adapt

    require_lite_medsam()
    img, ann = cells
    cfg = few_object_config(6, minutes=1)
    cfg.max_steps, cfg.max_time, cfg.view_zooms, cfg.orientations = 1, None, (1.0,), 1
    token = CancelToken()
    measure = sam_adapt.store_click_choice

    def cancel_then_measure(*args, **kwargs):  # the user presses Cancel once training is done
        token.cancel()
        return measure(*args, **kwargs)

    monkeypatch.setattr(sam_adapt, "store_click_choice", cancel_then_measure)
    res = adapt_to_objects(img, ann, model=load_engine("nuclei_sam", cache=embeddings), folder=tmp_path,
                           config=cfg, cancel=token)
    assert res.path is None and res.stopped == "cancelled"
    assert adapted_models(tmp_path) == [] and not list(tmp_path.glob("*.pt"))


def test_info_lists_the_users_adapted_decoders_with_their_image_and_file(tmp_path, monkeypatch, capsys):
    """``napari-gpuseg info`` names each adapted decoder (newest first), the image it came from
    and the file to pass as ``--model``; one whose file is gone is not listed."""
    from napari_gpuseg.cli.main import main
    from napari_gpuseg.engine.sam.training.adapt import _record

    monkeypatch.setenv("NAPARI_GPUSEG_CACHE", str(tmp_path / "cache"))
    assert main(["info", "--device", "cpu"]) == 0
    assert f"adapted:   none yet (kept in {tmp_path / 'cache' / 'adapted_sam'})" in capsys.readouterr().out
    d = adapted_dir()
    d.mkdir(parents=True)
    for name, created, keep in (("t06_adapted", "2026-11-30T10:00:00", True), ("gone_adapted", "2026-11-30T11:00:00", False),
                                ("t06_adapted_2", "2026-11-30T12:30:00", True)):
        path = d / f"{name}.pt"
        if keep:
            path.write_bytes(b"decoder")
        _record(d, {"name": name, "path": str(path), "image": "/data/t06.tif", "base": "nuclei_sam",
                    "objects": 15, "created": created})
    assert main(["info", "--device", "cpu"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("adapted:")]
    assert lines == [
        f"adapted:   t06_adapted_2 (from /data/t06.tif, 15 objects, on nuclei_sam, 2026-11-30 12:30): {d / 't06_adapted_2.pt'}",
        f"adapted:   t06_adapted (from /data/t06.tif, 15 objects, on nuclei_sam, 2026-11-30 10:00): {d / 't06_adapted.pt'}"]
