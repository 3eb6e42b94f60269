"""SAM decoder fine-tuning (engine), its checkpoint, the shipped decoder and train-sam."""
import hashlib

import numpy as np
import pytest
import tifffile
import torch

from napari_gpuseg.engine import load_engine
from napari_gpuseg.engine.runtime.cancel import CancelToken
from napari_gpuseg.engine.sam.interactive.cache import EmbeddingCache
from napari_gpuseg.engine.sam.training.click_eval import click_ious
from napari_gpuseg.engine.sam.training.finetune import evaluate, finetune_sam
from napari_gpuseg.engine.sam.training.tune_config import SamTuneConfig
from napari_gpuseg.engine.sam.training.train_views import check_pair, collect_views
from napari_gpuseg.models import registry
from napari_gpuseg.models.state_dict_loading import CheckpointError
from napari_gpuseg.models.sam.decoder_checkpoint import apply_decoder, read_decoder

from sam_fixtures import require_lite_medsam


@pytest.fixture(scope="module")
def lite():
    require_lite_medsam()
    return load_engine("lite_medsam", cache=EmbeddingCache())


@pytest.fixture(scope="module")
def train_crop(shared_data):
    """One 256 x 256 training crop (one view) from the first BBBC039 training field."""
    f = sorted((shared_data / "bbbc039" / "images").glob("*.tif"))[0]
    img = tifffile.imread(f)[0:256, 0:256]
    lab = tifffile.imread(shared_data / "bbbc039" / "masks" / f.name)[0:256, 0:256]
    return img, lab


@pytest.fixture(scope="module")
def val_crop(shared_data):
    """A 256 x 256 crop of a BBBC039 validation field (never trained on)."""
    f = sorted((shared_data / "bbbc039" / "images").glob("*.tif"))[-3]
    img = tifffile.imread(f)[100:356, 200:456]
    lab = tifffile.imread(shared_data / "bbbc039" / "masks" / f.name)[100:356, 200:456]
    return img, lab


def tiny_config(**kw):
    base = dict(max_steps=8, views_per_step=1, objects_per_view=3, lr=1e-3, warmup=1, corrections=1,
                views_per_image=None, val_fraction=0.0, seed=0)
    base.update(kw)
    return SamTuneConfig(**base)


@pytest.mark.slow
def test_short_training_learns_clicks_and_the_checkpoint_round_trips(lite, train_crop, tmp_path):
    from napari_gpuseg.engine.runtime.device import make_policy

    img, lab = train_crop
    # fp32 embeddings on every CPU: eight steps at lr 1e-3 are tuned to them (a CPU whose
    # policy picks bf16 embeds in bf16; the next test covers training there)
    engine = load_engine("lite_medsam", cache=lite.cache, policy=make_policy("cpu", "fp32"))
    cfg = tiny_config()
    views = collect_views(engine, [img], [lab])
    pairs = [(0, int(o)) for o in views[0].ids[:8]]
    before = evaluate(engine.sam, views, pairs, cfg, engine.policy.device)
    losses = []
    out = tmp_path / "decoder.pt"
    res = finetune_sam([img], [lab], model=engine, config=cfg, out_path=out,
                       on_event=lambda ev: losses.append(ev.loss))
    assert res.stopped == "done" and len(losses) == 8 and np.isfinite(losses).all()
    after = evaluate(engine.sam, views, pairs, cfg, engine.policy.device)
    # eight steps teach the corrective clicks and boxes (single-mask output) first
    assert after["score"] > before["score"] + 0.1, (before, after)
    assert after["iou_3click"] > before["iou_3click"] + 0.3, (before, after)
    assert np.mean(losses[-3:]) < np.mean(losses[:3]), losses
    # the file holds only the decoder (fp16), names its base, and loads with weights_only
    assert out.stat().st_size < 10 * 2**20
    doc = torch.load(out, map_location="cpu", weights_only=True)
    assert doc["base"] == "lite_medsam" and doc["base_sha256"] == registry.MODELS["lite_medsam"].sha256
    assert {k.split(".")[0] for k in doc["state"]} == {"prompt_encoder", "mask_decoder"}
    reloaded = load_engine(str(out), cache=lite.cache, policy=engine.policy)  # the views' device
    assert reloaded.info.encoder == "lite_medsam" and not reloaded.info.box_trained and reloaded.info.decoder_tuned
    for name, p in engine.sam.mask_decoder.state_dict().items():
        q = reloaded.sam.mask_decoder.state_dict()[name]
        assert torch.allclose(p, q, atol=2e-3, rtol=2e-3), name
    again = evaluate(reloaded.sam, views, pairs, cfg, reloaded.policy.device)
    assert abs(again["score"] - after["score"]) < 0.05


def test_the_encoder_splits_before_any_of_its_last_three_stages_and_refuses_the_first():
    """trunk(x, n) then last_stages(.., n) is the encoder for n = 1-3 (the trunk's tokens
    get finer as n grows); 0 and the pixel convolutions of the first stage are refused."""
    from napari_gpuseg.models.sam.tiny_vit import TinyViT

    torch.manual_seed(0)
    enc = TinyViT(img_size=64, patch_embed="conv1x1", num_classes=0).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        whole = enc(x)
        sizes = []
        for n in (1, 2, 3):
            tokens, hw = enc.trunk(x, n)
            sizes.append(tokens.shape[1])
            assert tokens.shape[1] == hw[0] * hw[1]
            assert torch.allclose(enc.last_stages(tokens, hw, n), whole, atol=1e-5)
    assert sizes[0] == sizes[1] < sizes[2]  # the last merge keeps the resolution
    assert enc.last_stages_parts(2) == ("layers.2.", "layers.3.", "neck.")
    for bad in (0, 4):
        with pytest.raises(ValueError, match="1-3"):
            enc.last_stages_parts(bad)
    with pytest.raises(ValueError, match="encoder_stages must be a whole number 1-3"):
        SamTuneConfig(encoder_stages=4).check()


@pytest.mark.slow
def test_the_encoders_last_stages_train_with_the_decoder_and_travel_in_the_file(lite, train_crop, tmp_path):
    """``encoder_lr``: the last ``encoder_stages`` stages and the neck change (the rest of the
    encoder does not), the file carries them, and the tuned engine, the reloaded file and the
    base never share an embedding, though all three use one cache. Two stages here; one (Adapt
    SAM's schedule) is trained in ``test_sam_adapt_engine.py``, and the split for 1-3 stages is
    checked above."""
    stages = 2
    from napari_gpuseg.engine.runtime.device import make_policy

    img, lab = train_crop
    policy = make_policy("cpu", "fp32")
    engine = load_engine("lite_medsam", cache=lite.cache, policy=policy)
    enc0 = {k: v.clone() for k, v in engine.sam.image_encoder.state_dict().items()}
    base_info = engine.info
    out = tmp_path / "tuned_encoder.pt"
    res = finetune_sam([img], [lab], model=engine,
                       config=tiny_config(max_steps=3, encoder_lr=1e-4, encoder_stages=stages), out_path=out)
    assert res.stopped == "done"
    tail = ("layers.2.", "layers.3.", "neck.")
    changed = {k for k, v in engine.sam.image_encoder.state_dict().items()
               if v.is_floating_point() and not torch.equal(v, enc0[k])}
    assert changed and all(k.startswith(tail) for k in changed), sorted(changed)[:5]
    assert all(any(k.startswith(t) for k in changed) for t in tail)
    doc = read_decoder(out)
    enc_keys = {k[len("image_encoder."):] for k in doc["state"] if k.startswith("image_encoder.")}
    assert enc_keys and all(k.startswith(tail) for k in enc_keys) and changed <= enc_keys
    assert doc["base"] == "lite_medsam" and out.stat().st_size < 20 * 2**20
    assert engine.info.encoder != base_info.encoder
    reloaded = load_engine(out, cache=lite.cache, policy=policy)
    assert reloaded.info.encoder not in (base_info.encoder, "lite_medsam")
    plain = load_engine("lite_medsam", cache=lite.cache, policy=policy)
    prepared = plain.prepare(img)
    view = plain.views(prepared)[0]
    e_plain = plain.embedding(prepared, view).float()
    e_tuned = engine.embedding(engine.prepare(img), view).float()
    e_file = reloaded.embedding(reloaded.prepare(img), view).float()
    assert (e_tuned - e_plain).abs().max() > 1e-3
    assert torch.allclose(e_file, e_tuned, atol=0.05), (e_file - e_tuned).abs().max()  # fp16 weights in the file
    # where the encoder cannot be split, encoder_lr is refused before anything is embedded
    class Whole(torch.nn.Module):
        img_size = 256

    broken = load_engine("lite_medsam", cache=EmbeddingCache(), policy=policy)
    broken.sam.image_encoder = Whole()
    with pytest.raises(ValueError, match="only a TinyViT image encoder"):
        finetune_sam([img], [lab], model=broken, config=tiny_config(max_steps=1, encoder_lr=1e-4))


@pytest.mark.slow
def test_training_steps_run_in_fp32_on_a_cpu_whose_policy_picks_bf16(lite, train_crop, monkeypatch):
    """A CPU with AVX512-BF16 or AMX gets bf16 for inference; the decoder's training steps
    stay fp32 there (at the short run's lr 1e-3 they diverged in bf16), while validation
    decodes in the policy's precision, as the annotator does."""
    from napari_gpuseg.engine.runtime.device import cpu_has_fast_bf16, make_policy
    from napari_gpuseg.engine.sam.training import finetune as ft

    img, lab = train_crop
    images, labels = [img, img[::-1].copy()], [lab, lab[::-1].copy()]
    # the views embedded once in fp32 (a CPU without fast bf16 would take a minute per view
    # in bf16); the bf16 engine then runs the decoder only
    fp32 = load_engine("lite_medsam", cache=lite.cache, policy=make_policy("cpu", "fp32"))
    views = collect_views(fp32, images, labels)
    monkeypatch.setattr(ft, "collect_views", lambda *_a, **_k: views)
    engine = load_engine("lite_medsam", cache=lite.cache, policy=make_policy("cpu", "bf16"))
    seen = {"train": [], "eval": []}
    real_episode, real_evaluate = ft.episode, ft.evaluate

    def cpu_autocast():
        try:
            return torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")
        except (TypeError, AttributeError):  # torch < 2.4
            return torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype()

    def spy_episode(*a, **kw):
        seen["train"].append(cpu_autocast()[0])
        return real_episode(*a, **kw)

    def spy_evaluate(*a, **kw):
        seen["eval"].append(cpu_autocast())
        return real_evaluate(*a, **kw)

    monkeypatch.setattr(ft, "episode", spy_episode)
    monkeypatch.setattr(ft, "evaluate", spy_evaluate)
    if not cpu_has_fast_bf16():
        # a CPU that emulates bf16 runs the decoder's transposed convolutions through a slow
        # reference kernel (8.5 of this test's 25 s on a 2-core AVX2 EPYC); they go in fp32
        # there. The rest of the decoder, linear layers and attention, still runs in bf16
        for up in (m for m in engine.sam.mask_decoder.modules() if isinstance(m, torch.nn.ConvTranspose2d)):
            monkeypatch.setattr(up, "forward", _outside_autocast(up))
    # two objects are enough to see the precision validation runs in (each bf16 validation
    # costs seconds on a CPU that emulates bf16)
    cfg = tiny_config(max_steps=2, eval_every=2, val_fraction=0.5, val_objects=2)
    res = finetune_sam(images, labels, model=engine, config=cfg)
    assert res.stopped == "done" and np.isfinite([h["loss"] for h in res.history[1:]]).all()
    assert seen["train"] and not any(seen["train"])
    assert seen["eval"] and all(e == (True, torch.bfloat16) for e in seen["eval"])


def _outside_autocast(module):
    def forward(x, *a, **kw):
        with torch.autocast("cpu", enabled=False):
            return type(module).forward(module, x.float(), *a, **kw)
    return forward


def test_a_decoder_that_does_not_fit_names_the_keys(lite, tmp_path):
    doc = read_decoder(registry.WEIGHTS_DIR / "nuclei_sam_decoder.pt")
    state = dict(doc["state"])
    state.pop("mask_decoder.iou_token.weight")
    state["mask_decoder.bogus"] = torch.zeros(1)
    with pytest.raises(CheckpointError, match="iou_token.*bogus|bogus.*iou_token|missing.*iou_token"):
        apply_decoder(lite.sam, {**doc, "state": state})


def test_cancel_stops_and_writes_nothing(lite, train_crop, tmp_path):
    img, lab = train_crop
    token = CancelToken()
    out = tmp_path / "never.pt"
    res = finetune_sam([img], [lab], model=load_engine("lite_medsam", cache=lite.cache),
                       config=tiny_config(max_steps=50), out_path=out, cancel=token,
                       on_event=lambda ev: token.cancel())
    assert res.stopped == "cancelled" and res.path is None and not out.exists()


def test_bad_training_labels_are_refused():
    img = np.zeros((64, 64), np.uint16)
    with pytest.raises(ValueError, match="non-integer"):
        check_pair(img, np.full((64, 64), 0.5, np.float32), "image 0")
    with pytest.raises(ValueError, match="differ in size"):
        check_pair(img, np.zeros((32, 64), np.int32), "image 0")
    with pytest.raises(ValueError, match="no training images"):
        finetune_sam([], [], model="lite_medsam")


@pytest.mark.usefixtures("reuse_embeddings")
@pytest.mark.slow
def test_shipped_decoder_is_the_default_and_clicks_work(lite, val_crop):
    assert registry.DEFAULT_MODEL == "cells_nuclei_sam"
    # both shipped files: small (a decoder is 8 MB; the default's also carries its encoder's
    # tuned last stage and neck, 6 MB more), the hash they say
    for name, limit in (("cells_nuclei_sam", 16), ("nuclei_sam", 10)):
        spec = registry.MODELS[name]
        path = registry.WEIGHTS_DIR / spec.filename
        assert path.stat().st_size == spec.size < limit * 2**20
        assert hashlib.sha256(path.read_bytes()).hexdigest() == spec.sha256
    tuned = load_engine(cache=lite.cache)  # the public API's default
    assert tuned.info.name == "cells_nuclei_sam" and not tuned.info.box_trained and tuned.info.decoder_tuned
    assert load_engine(None, cache=lite.cache).info.name == "cells_nuclei_sam"  # None: the default too
    assert lite.info.box_trained and not lite.info.decoder_tuned
    # the candidate a first click keeps, measured on training objects when it shipped
    # (scripts/calibrate_iou_head.py --choose-output: the default's IoU head's choice); a stock
    # decoder keeps its head's choice
    assert tuned.click_output == read_decoder(registry.WEIGHTS_DIR / "cells_nuclei_sam_decoder.pt")["click_output"]
    assert lite.click_output is None
    img, lab = val_crop
    ours = click_ious(tuned, img, lab, clicks=1, max_objects=24)
    base = click_ious(lite, img, lab, clicks=1, max_objects=24)
    assert ours["n"] == base["n"] >= 15
    one_ours, one_base = ours["clicks"][:, 0].mean(), base["clicks"][:, 0].mean()
    assert one_ours >= 0.8 and one_base < 0.4, (one_ours, one_base)
    assert ours["box"].mean() >= 0.8


def test_a_second_click_feeds_the_first_masks_logits_back(lite, val_crop, monkeypatch):
    from napari_gpuseg.engine.sam.interactive.predictor import Prompt
    from napari_gpuseg.widgets._prompts import follow_up

    img, lab = val_crop
    engine = load_engine(cache=lite.cache)
    first_prompt = Prompt(points=[[120, 130]], labels=[1])
    first = engine.predict(img, [first_prompt], multimask=True)[0]
    # the annotator rebuilds the prompt from its layers (positives first, then negatives)
    rebuilt = Prompt(points=[[120, 130], [90, 90]], labels=[1, 0])
    second = follow_up(rebuilt, first_prompt, first)
    assert second.mask_input is first and second.points.tolist() == [[120, 130], [90, 90]]
    seen = {}
    encode = engine.sam.prompt_encoder.forward

    def spy(points, boxes, masks):
        seen["masks"] = masks
        return encode(points, boxes, masks)

    monkeypatch.setattr(engine.sam.prompt_encoder, "forward", spy)
    refined = engine.predict(img, [second])[0]
    assert seen["masks"] is not None
    # the first mask's logits, as they are in its own view, or carried into the finer click
    # view when the first mask was decoded at native scale
    if refined.view == first.view:
        want = first.low_res
    else:
        from napari_gpuseg.engine.sam.interactive.mask_input_carry import carry_logits

        assert first.view in engine.views(engine.prepare(img)) and refined.view in engine.click_views(engine.prepare(img))
        want = carry_logits(first.low_res, first.view, refined.view)
    torch.testing.assert_close(seen["masks"][0, 0].cpu(), want.cpu())
    # a moved or deleted point starts over; so does a box prompt before it
    assert follow_up(Prompt(points=[[121, 130], [90, 90]], labels=[1, 0]), first_prompt, first).mask_input is None
    assert follow_up(rebuilt, Prompt(box=[100, 100, 140, 150]), first).mask_input is None


def test_train_sam_cli_errors_are_one_line(tmp_path, capsys, shared_data):
    from napari_gpuseg.cli.main import main

    d = shared_data / "bbbc039"
    cases = [
        (["--images", str(tmp_path / "nope"), "--labels", str(tmp_path)], "images folder not found"),
        (["--images", str(d / "images"), "--labels", str(d / "masks"), "--labels", str(d / "masks")],
         "1 --images but 2 --labels"),
        (["--images", str(d / "images"), "--labels", str(d / "masks"), "--max-steps", "0"], "max-steps"),
        (["--images", str(d / "images"), "--labels", str(d / "masks"), "--limit", "1", "--limit", "2"],
         "--limit"),
        (["--images", str(d / "images"), "--labels", str(d / "masks"), "--model", str(tmp_path / "x.pt"),
          "--limit", "1"], "not found"),
    ]
    for args, text in cases:
        rc = main(["train-sam", *args, "--out", str(tmp_path / "o.pt"), "--quiet"])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and text in err and len(err.splitlines()) == 1, (args, err)
    assert not (tmp_path / "o.pt").exists()


def test_bad_labels_anywhere_stop_training_before_any_image_is_embedded(lite, tmp_path, capsys, monkeypatch,
                                                                        train_crop):
    """A folder whose last labels file is not a label image (or that holds no object at
    all) is refused with one line naming the file before the encoder runs, not after
    embedding the images before it."""
    from napari_gpuseg.cli.main import main
    from napari_gpuseg.engine.sam.interactive.predictor import SamEngine

    def encode(self, x):
        raise AssertionError("the encoder ran before every pair was checked")

    monkeypatch.setattr(SamEngine, "encode", encode)
    img, lab = train_crop
    (tmp_path / "i").mkdir(), (tmp_path / "l").mkdir()
    tifffile.imwrite(tmp_path / "i" / "a.tif", img)
    tifffile.imwrite(tmp_path / "l" / "a.tif", lab)
    tifffile.imwrite(tmp_path / "i" / "b.tif", img)
    tifffile.imwrite(tmp_path / "l" / "b.tif", (lab > 0).astype(np.float32) * 0.5)
    args = ["train-sam", "--images", str(tmp_path / "i"), "--labels", str(tmp_path / "l"),
            "--out", str(tmp_path / "o.pt"), "--cache", str(tmp_path / "emb"), "--quiet"]  # nothing cached
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "labels b.tif: labels hold non-integer values" in err and len(err.splitlines()) == 1, err
    tifffile.imwrite(tmp_path / "l" / "a.tif", np.zeros_like(lab))
    tifffile.imwrite(tmp_path / "l" / "b.tif", np.zeros_like(lab))
    assert main(args) == 2
    assert "no objects to learn from" in capsys.readouterr().err
    with pytest.raises(ValueError, match="image 1: labels hold negative ids"):
        finetune_sam([img, img], [lab, -lab.astype(np.int32)], model="lite_medsam", config=tiny_config(max_steps=1))
    assert not (tmp_path / "o.pt").exists()


def test_views_are_embedded_once_across_runs(lite, train_crop, tmp_path, monkeypatch):
    from napari_gpuseg.engine.sam.interactive.predictor import SamEngine

    img, lab = train_crop
    calls = []
    encode = SamEngine.encode
    monkeypatch.setattr(SamEngine, "encode", lambda self, x: calls.append(len(x)) or encode(self, x))
    cfg = tiny_config(max_steps=1)
    finetune_sam([img], [lab], model="lite_medsam", config=cfg, cache_dir=tmp_path / "emb")
    assert sum(calls) == 1  # one view
    calls.clear()
    finetune_sam([img], [lab], model="lite_medsam", config=cfg, cache_dir=tmp_path / "emb")
    assert calls == []  # the second run reads the embedding from disk


def test_out_of_memory_halves_the_objects_per_step(lite, train_crop, monkeypatch):
    from napari_gpuseg.engine.sam.training import finetune

    img, lab = train_crop
    sizes = []
    real = finetune.episode

    def episode(sam, emb, gt, *a, **kw):
        sizes.append(len(gt))
        if len(sizes) == 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(sam, emb, gt, *a, **kw)

    monkeypatch.setattr(finetune, "episode", episode)
    cfg = tiny_config(max_steps=1, objects_per_view=4, box_fraction=0.0, objects_per_pass=4)
    res = finetune_sam([img], [lab], model=load_engine("lite_medsam", cache=lite.cache), config=cfg)
    assert res.stopped == "done" and sizes == [4, 2]


def _first_click_setup(lite, train_crop):
    """LiteMedSAM with a trainable mask decoder, four objects of the training crop (masks
    at the model input) and their view's embedding, one row per object."""
    img, lab = train_crop
    engine = load_engine("lite_medsam", cache=lite.cache)
    views = collect_views(engine, [img], [lab])
    gt = np.stack([views[0].labels == o for o in views[0].ids[:4]])
    emb = views[0].embedding[None].to(engine.policy.device, torch.float32).expand(len(gt), -1, -1, -1)
    for p in engine.sam.mask_decoder.parameters():
        p.requires_grad_(True)
    return engine, engine.sam, emb, gt


@pytest.mark.parametrize("first", ["all", "multi"])
def test_a_first_click_trains_the_candidates_the_engine_offers(lite, train_crop, first):
    """A tuned decoder's first click is picked from four masks (SamEngine.candidates
    "all"): training ranks the single-mask output beside the three multimask ones, so its
    IoU prediction learns from first clicks too; "multi" trains the three only."""
    from napari_gpuseg.engine.sam.training.episode_loss import episode

    engine, sam, emb, gt = _first_click_setup(lite, train_crop)
    rec = []
    loss = episode(sam, emb, gt, False, np.random.default_rng(0), tiny_config(first_candidates=first),
                   engine.policy.device, n_corr=0, record=rec)
    loss.backward()
    head = sam.mask_decoder.iou_prediction_head.layers[-1]
    single_row = head.weight.grad[0].abs().sum().item()
    multi_rows = head.weight.grad[1:].abs().sum().item()
    assert multi_rows > 0 and np.isfinite(loss.item())
    assert (single_row > 0) == (first == "all")
    assert len(rec) == 1 and rec[0].shape == (len(gt),)
    with pytest.raises(ValueError, match="first_candidates"):
        tiny_config(first_candidates="two").check()


def test_a_first_click_can_train_the_candidate_the_engine_keeps(lite, train_crop):
    """``first_output`` (the engine's numbering: 0 the single-mask output, 1-3 SAM's three):
    a first click's mask loss goes to that candidate alone, not to the best one; the IoU
    head still learns every candidate."""
    from napari_gpuseg.engine.sam.training.episode_loss import episode

    engine, sam, emb, gt = _first_click_setup(lite, train_crop)
    hyper = sam.mask_decoder.output_hypernetworks_mlps  # one per output: single, then SAM's three
    for first, keep, trained in (("multi", 2, {2}), ("all", 3, {3}), ("all", 0, {0})):
        sam.mask_decoder.zero_grad(set_to_none=True)
        cfg = tiny_config(first_candidates=first, first_output=keep)
        cfg.check()
        rec = []
        episode(sam, emb, gt, False, np.random.default_rng(0), cfg, engine.policy.device, n_corr=0,
                record=rec).backward()
        got = {i for i, mlp in enumerate(hyper) if mlp.layers[-1].weight.grad is not None
               and mlp.layers[-1].weight.grad.abs().sum() > 0}
        assert got == trained, (first, keep, got)
        head = sam.mask_decoder.iou_prediction_head.layers[-1].weight.grad
        assert (head[1:].abs().sum(1) > 0).all()  # the IoU head: every candidate
    for first, bad in (("multi", 0), ("all", 4), ("all", -1), ("all", 1.0), ("all", True), ("all", "best")):
        with pytest.raises(ValueError, match="first_output"):
            tiny_config(first_candidates=first, first_output=bad).check()


def test_train_sam_options_reach_the_config(tmp_path):
    import argparse

    from napari_gpuseg.cli.train import TrainInputError
    from napari_gpuseg.cli.train_sam import add_train_sam_parser, config_from

    parser = argparse.ArgumentParser()
    add_train_sam_parser(parser.add_subparsers())
    base = ["train-sam", "--images", "i", "--labels", "l", "--out", str(tmp_path / "o.pt")]
    cfg = config_from(parser.parse_args(base))
    assert cfg.first_candidates == "multi" and cfg.view_zooms is None and cfg.click_zoom is None
    cfg = config_from(parser.parse_args(
        base + ["--first-candidates", "all", "--zoom", "1", "--zoom", "1.5", "--click-zoom", "1.5"]))
    assert cfg.first_candidates == "all" and cfg.view_zooms == (1.0, 1.5) and cfg.click_zoom == 1.5
    assert cfg.first_output is None
    assert config_from(parser.parse_args(base + ["--first-output", "measured"])).first_output == "measured"
    assert config_from(parser.parse_args(base + ["--first-output", "2"])).first_output == 2
    # the single-mask output is not among the three a first click trains over by default
    with pytest.raises(TrainInputError, match="first-output must be None, 'measured' or a candidate"):
        config_from(parser.parse_args(base + ["--first-output", "0"]))
    assert config_from(parser.parse_args(base + ["--first-output", "0", "--first-candidates", "all"])).first_output == 0
    assert cfg.encoder_lr == 0 and config_from(parser.parse_args(base + ["--encoder-lr", "5e-5"])).encoder_lr == 5e-5
    with pytest.raises(TrainInputError, match="--encoder-lr must be 0"):
        config_from(parser.parse_args(base + ["--encoder-lr", "-1"]))
    assert cfg.orientations == 1 and config_from(parser.parse_args(base + ["--orientations", "8"])).orientations == 8
    with pytest.raises(TrainInputError, match="--orientations must be a whole number 1-8"):
        config_from(parser.parse_args(base + ["--orientations", "9"]))


def test_train_sam_says_where_the_held_back_score_started():
    from types import SimpleNamespace

    from napari_gpuseg.cli.train_sam import result_line

    run = SimpleNamespace(stopped="time", best_score=0.71, best_step=380, path="d.pt",
                          history=[{"step": 0, "loss": None, "val_score": 0.63}, {"step": 1, "loss": 0.2}])
    assert result_line(run) == "time: best validation score 0.71 at step 380 (at the start: 0.63); saved d.pt"
    run.history = run.history[1:]  # nothing held back: no start to name
    assert result_line(run) == "time: best validation score 0.71 at step 380; saved d.pt"


def _seeded_step(engine, views, cfg):
    """One training step from a fixed start: its loss and the gradients it left."""
    from napari_gpuseg.engine.sam.training import finetune as ft

    state = {n: t.clone() for n, t in engine.sam.state_dict().items()}
    opt, scaler = ft._optimizer(engine, cfg)
    opt.step = lambda *a, **k: None  # the gradients are compared, the weights stay
    engine.sam.train()
    try:
        loss = ft._step(engine, views, [0], cfg.objects_per_view, np.random.default_rng(3), cfg, opt, scaler)
        grads = {n: p.grad.clone() for n, p in engine.sam.named_parameters() if p.grad is not None}
    finally:
        engine.sam.load_state_dict(state)
        engine.sam.eval()
        for p in engine.sam.parameters():
            p.requires_grad_(False)
            p.grad = None
    return loss, grads


@pytest.mark.slow
def test_a_training_step_decodes_a_few_objects_at_a_time_with_the_same_gradients(lite, train_crop):
    """A step's objects go through the decoder two at a time on a CPU (each object holds
    about 90 MiB of activations per decode), each group's loss back-propagated before the
    next: the seeded step's loss and gradients equal those of one pass over all objects."""
    from napari_gpuseg.engine.runtime.device import make_policy

    img, lab = train_crop
    engine = load_engine("lite_medsam", cache=lite.cache, policy=make_policy("cpu", "fp32"))
    views = collect_views(engine, [img], [lab])
    batches = []
    hook = engine.sam.mask_decoder.register_forward_hook(lambda m, args, out: batches.append(out[0].shape[0]))
    try:
        cfg = tiny_config(objects_per_view=5, box_fraction=0.4, corrections=2)
        loss, grads = _seeded_step(engine, views, cfg)
        assert batches and max(batches) <= 2 and sum(batches) >= 5, batches
        batches.clear()
        whole_loss, whole = _seeded_step(engine, views, tiny_config(objects_per_view=5, box_fraction=0.4,
                                                                    corrections=2, objects_per_pass=99))
        assert max(batches) >= 3, batches  # one pass over all clicked (or boxed) objects
    finally:
        hook.remove()
    assert loss == pytest.approx(whole_loss, rel=1e-5)
    assert grads.keys() == whole.keys()
    scale = torch.cat([g.flatten() for g in whole.values()]).norm()
    for name, g in whole.items():  # the k_proj biases get 0 up to rounding (softmax is shift-invariant)
        assert (grads[name] - g).norm() <= 1e-5 * scale, name
    with pytest.raises(ValueError, match="objects_per_pass"):
        tiny_config(objects_per_pass=0).check()
