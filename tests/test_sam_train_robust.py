"""SAM decoder training on bad output paths and Ctrl-C, and its intensity and orientation variants."""
import numpy as np
import pytest
import tifffile

from napari_gpuseg.engine import load_engine
from napari_gpuseg.engine.sam.training import finetune as ft
from napari_gpuseg.engine.sam.interactive.cache import EmbeddingCache
from napari_gpuseg.engine.sam.training.finetune import TuneInterrupted, finetune_sam
from napari_gpuseg.engine.sam.training.tune_config import SamTuneConfig
from napari_gpuseg.engine.sam.training.train_views import (collect_views, gamma_image, intensity_variants, invert_image,
                                                         orient, orientations_of)

from sam_fixtures import require_lite_medsam


@pytest.fixture(scope="module")
def lite():
    require_lite_medsam()
    return load_engine("lite_medsam", cache=EmbeddingCache())


@pytest.fixture(scope="module")
def crop(shared_data):
    f = sorted((shared_data / "bbbc039" / "images").glob("*.tif"))[0]
    img = tifffile.imread(f)[0:256, 0:256]
    lab = tifffile.imread(shared_data / "bbbc039" / "masks" / f.name)[0:256, 0:256]
    return img, lab


def tiny(**kw):
    base = dict(max_steps=6, views_per_step=1, objects_per_view=2, lr=1e-3, warmup=1, corrections=1,
                views_per_image=None, val_fraction=0.0, seed=0)
    base.update(kw)
    return SamTuneConfig(**base)


@pytest.mark.parametrize("where", ["folder", "under_a_file"])
def test_a_bad_out_path_fails_before_anything_is_embedded(crop, tmp_path, monkeypatch, where):
    img, lab = crop
    (tmp_path / "afile").write_text("x")
    out = tmp_path if where == "folder" else tmp_path / "afile" / "decoder.pt"
    monkeypatch.setattr(ft, "collect_views", lambda *a, **k: pytest.fail("embedded before the path was checked"))
    monkeypatch.setattr(ft, "_engine", lambda *a, **k: pytest.fail("loaded a model before the path was checked"))
    with pytest.raises(OSError, match="checked before training|is a folder"):
        finetune_sam([img], [lab], model="lite_medsam", config=tiny(), out_path=out)


def test_train_sam_cli_refuses_an_unwritable_out_before_reading_data(tmp_path, capsys, shared_data, monkeypatch):
    from napari_gpuseg.cli import train_sam
    from napari_gpuseg.cli.main import main

    (tmp_path / "afile").write_text("x")
    monkeypatch.setattr(train_sam, "_read", lambda pairs: pytest.fail("read the data first"))
    d = shared_data / "bbbc039"
    rc = main(["train-sam", "--images", str(d / "images"), "--labels", str(d / "masks"), "--limit", "1",
               "--out", str(tmp_path / "afile" / "decoder.pt"), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "checked before training" in err and len(err.splitlines()) == 1, err


def test_ctrl_c_during_training_saves_the_best_decoder_so_far(lite, crop, tmp_path):
    img, lab = crop
    out = tmp_path / "decoder.pt"
    seen = []

    def on_event(ev):
        seen.append(ev.step)
        if ev.step == 3:
            raise KeyboardInterrupt

    with pytest.raises(TuneInterrupted) as info:
        finetune_sam([img], [lab], model=load_engine("lite_medsam", cache=lite.cache), config=tiny(),
                     out_path=out, on_event=on_event)
    res = info.value.result
    assert isinstance(info.value, KeyboardInterrupt)
    assert seen == [1, 2, 3] and res.stopped == "interrupted" and res.path == str(out) and out.exists()
    reloaded = load_engine(str(out), cache=lite.cache)
    assert reloaded.info.decoder_tuned


@pytest.mark.slow
def test_train_sam_cli_ctrl_c_exits_130_with_one_line_and_the_decoder(tmp_path, capsys, shared_data, monkeypatch):
    from napari_gpuseg.cli.main import main

    calls = []
    step = ft._step

    def interrupted(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step(*a, **k)

    monkeypatch.setattr(ft, "_step", interrupted)
    d = shared_data / "bbbc039"
    out = tmp_path / "decoder.pt"
    rc = main(["train-sam", "--images", str(d / "images"), "--labels", str(d / "masks"), "--limit", "2",
               "--model", "lite_medsam", "--zoom", "1", "--views-per-image", "1", "--views-per-step", "1",
               "--objects-per-view", "2", "--eval-every", "1", "--val-objects", "4", "--val-fraction", "0.5",
               "--corrections", "1", "--out", str(out), "--cache", str(tmp_path / "emb"), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert rc == 130 and len(err.splitlines()) == 1, err
    assert "interrupted" in err and "saved to" in err and str(out) in err and out.exists()


def test_intensity_variants_invert_and_keep_the_picture_for_the_engine(lite):
    rng = np.random.default_rng(0)
    u16 = rng.integers(100, 4000, (32, 40)).astype(np.uint16)
    inv = invert_image(u16)
    assert inv.dtype == np.uint16 and inv.min() == u16.min() and inv.max() == u16.max()
    a, b = lite.prepare(u16).tensor, lite.prepare(inv).tensor
    assert np.allclose(a.numpy(), 1 - b.numpy(), atol=1e-6)  # what the encoder sees, inverted
    u8 = rng.integers(0, 256, (8, 8, 3)).astype(np.uint8)
    assert (invert_image(u8) == 255 - u8).all()
    g = gamma_image(u16, 2.0)
    assert g.dtype == np.float32 and 0 <= g.min() and g.max() <= 1
    for pol, n in (("as-is", 1), ("invert", 1), ("both", 2), ("random", 1)):
        assert len(intensity_variants(u16, pol, 1.0, np.random.default_rng(1))) == n
    flips = [intensity_variants(u16, "random", 1.0, r)[0] is u16
             for r in [np.random.default_rng(s) for s in range(40)]]
    assert 10 < sum(flips) < 30  # about half of the images inverted
    with pytest.raises(ValueError, match="polarity"):
        intensity_variants(u16, "negative", 1.0, rng)
    with pytest.raises(ValueError, match="polarity"):
        SamTuneConfig(polarity="negative").check()


def test_both_polarities_embed_each_view_twice_under_one_source(lite, crop):
    img, lab = crop
    plain = collect_views(lite, [img], [lab])
    both = collect_views(lite, [img], [lab], polarity="both")
    assert len(both) == 2 * len(plain) and {v.source for v in both} == {0}
    assert not np.allclose(both[0].embedding.float().numpy(), both[-1].embedding.float().numpy())
    assert (both[0].labels == both[-1].labels).all()


def test_orientations_turn_image_and_labels_together_and_embed_each(lite, crop):
    img, lab = crop
    img, lab = img[:, :200], lab[:, :200]  # not square: a quarter turn swaps the sides
    for k in range(8):
        im, lb = orient(img, lab, k)
        assert im.shape == lb.shape and im.shape == (img.shape if k % 2 == 0 else img.shape[::-1])
        for obj in np.unique(lab)[1:4]:  # every object keeps its pixels' values
            assert sorted(im[lb == obj]) == sorted(img[lab == obj])
    assert all((orient(img, lab, 0)[i] == a).all() for i, a in enumerate((img, lab)))
    assert (orient(img, lab, 4)[0] == img[:, ::-1]).all() and (orient(img, lab, 1)[0] == np.rot90(img)).all()
    rng = np.random.default_rng(0)
    ks = [orientations_of(4, rng) for _ in range(20)]
    assert all(k[0] == 0 and len(set(k)) == 4 for k in ks) and len({tuple(k) for k in ks}) > 1
    assert orientations_of(8, rng) == list(range(8)) and orientations_of(1, None) == [0]
    with pytest.raises(ValueError, match="orientation"):
        orient(img, lab, 8)
    with pytest.raises(ValueError, match="orientations"):
        SamTuneConfig(orientations=9).check()
    plain = collect_views(lite, [img], [lab])
    four = collect_views(lite, [img], [lab], orientations=4, rng=np.random.default_rng(3))
    assert {v.source for v in four} == {0} and len(four) > len(plain)
    # the turned pictures are new pictures to the encoder
    assert not any(np.allclose(four[-1].embedding.float().numpy(), v.embedding.float().numpy()) for v in plain)
