"""`train` and train_unet on bad user input: one line, exit 2, before any work; crops
clamped to the images; the checkpoint path checked first and a fallback on a failed save."""
from __future__ import annotations

import errno
import shutil

import numpy as np
import pytest
import tifffile
import torch

from napari_gpuseg.cli.main import main
from napari_gpuseg.engine.unet import train_data, training
from napari_gpuseg.engine.runtime.device import Policy
from napari_gpuseg.engine.unet.training import TrainConfig, TrainConfigError, check_output_path, train_unet
from napari_gpuseg.models.unet import UNetConfig

FP32 = Policy(torch.device("cpu"), "fp32")


@pytest.fixture(scope="module")
def folders(tmp_path_factory, shared_data):
    """Two BBBC039 crops (160 x 200) with labels, a labels folder of another shape and a
    folder with one corrupt image."""
    root = tmp_path_factory.mktemp("train")
    bb = shared_data / "bbbc039"
    for sub in ("img", "lab", "small", "corrupt"):
        (root / sub).mkdir()
    for f in sorted((bb / "images").glob("*.tif"))[:2]:
        tifffile.imwrite(root / "img" / f.name, tifffile.imread(f)[:160, :200])
        lab = tifffile.imread(bb / "masks" / f.name)[:160, :200]
        tifffile.imwrite(root / "lab" / f.name, lab)
        tifffile.imwrite(root / "small" / f.name, lab[:100, :100])
        shutil.copy(root / "img" / f.name, root / "corrupt" / f.name)
    first = sorted((root / "corrupt").iterdir())[0]
    first.write_bytes(np.random.default_rng(0).bytes(3000))
    return root


def _train(root, *extra, out=None):
    opts = {"--images": str(root / "img"), "--labels": str(root / "lab"), "--out": str(out or root / "m.pt"),
            "--depth": "2", "--base": "4", "--crop": "64", "--batch-size": "1", "--epochs": "1",
            "--iters-per-epoch": "1", "--device": "cpu", "--precision": "fp32"}
    flags = []
    for a in extra:  # an option given here replaces the default (--images/--labels repeat otherwise)
        key, _, value = a.partition(" ")
        if value:
            opts[key] = value
        else:
            flags.append(a)
    return main(["train", *[x for kv in opts.items() for x in kv], *flags])


@pytest.mark.parametrize("extra, expect", [
    (("--labels {root}/small",), "differ in shape"),
    (("--labels {root}/nowhere",), "labels folder not found"),
    (("--images {root}/corrupt",), "not a readable TIFF"),
    (("--crop 0",), "--crop must be an integer >= 8"),
    (("--val-fraction 1.0",), "--val-fraction must be in [0, 1)"),
    (("--lr -1",), "--lr must be a positive number"),
    (("--lr nan",), "--lr must be a finite number"),
    (("--epochs 0",), "--epochs must be an integer >= 1"),
    (("--batch-size 0",), "--batch-size must be an integer >= 1"),
    (("--limit 0",), "--limit must be >= 1"),
    (("--skip 5",), "leaves no image/label pairs"),
    (("--eval-images {root}/img", "--eval-labels {root}/small"), "differ in shape"),
    (("--eval-images {root}/img",), "--eval-images and --eval-labels go together"),
])
def test_train_user_errors_one_line_exit_2(folders, capsys, extra, expect):
    rc = _train(folders, *[e.format(root=folders) for e in extra])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err.startswith("napari-gpuseg train: error: ") and expect in err and "\n" not in err
    assert "Traceback" not in err
    if "shape" in expect:  # names the files
        assert "IXMtest_A02_s1.tif (160, 200)" in err and "(100, 100)" in err
    assert not (folders / "m.pt").exists()


@pytest.mark.parametrize("out", ["/proc/gpuseg-x.pt", "{root}/img", "{root}/img/IXMtest_A02_s1.tif/m.pt"])
def test_unwritable_out_is_found_before_training(folders, capsys, monkeypatch, out):
    called = []
    monkeypatch.setattr(training, "build_unet", lambda *a, **k: called.append(1))
    rc = _train(folders, out=out.format(root=folders))
    err = capsys.readouterr().err
    assert rc == 2 and not called
    assert ("cannot write the checkpoint" in err or "is a folder" in err) and "Traceback" not in err


def test_config_check_names_the_field():
    with pytest.raises(TrainConfigError, match="iters_per_epoch") as info:
        TrainConfig(iters_per_epoch=0).check()
    assert info.value.name == "iters_per_epoch"
    with pytest.raises(TrainConfigError, match="val_fraction"):
        train_unet(np.zeros((32, 32)), np.ones((32, 32), int), TrainConfig(val_fraction=1.0), policy=FP32)


def test_val_fraction_keeps_one_image_to_train_on():
    assert train_data.val_indices(2, 0.9) == [train_data.val_indices(2, 0.9)[0]]
    assert len(train_data.val_indices(5, 0.99)) == 4


def test_crop_is_clamped_to_the_largest_image():
    imgs = [np.zeros((1, 160, 200), np.float32), np.zeros((1, 100, 120), np.float32)]
    tgts = [np.zeros((160, 200), np.uint8), np.zeros((100, 120), np.uint8)]
    ds = train_data.CropDataset(imgs, tgts, 5000, 4)
    assert ds.crop == (160, 200)
    x, y = ds[0]
    assert tuple(x.shape) == (1, 160, 200) and tuple(y.shape) == (160, 200)
    assert train_data.CropDataset(imgs, tgts, 64, 4).crop == (64, 64)


def _tiny(**kw):
    base = dict(model=UNetConfig(depth=2, base=4).to_dict(), crop_size=64, batch_size=1, epochs=2,
                iters_per_epoch=1, warmup_iters=1, val_fraction=0.0, patience=5)
    base.update(kw)
    return TrainConfig(**base)


def test_train_unet_notes_the_clamped_crop(folders):
    img = tifffile.imread(sorted((folders / "img").iterdir())[0])
    lab = tifffile.imread(sorted((folders / "lab").iterdir())[0])
    res = train_unet(img, lab, _tiny(crop_size=300, epochs=1), policy=FP32)
    assert any("crop 300 clamped to 160x200" in n for n in res.notes)


def test_failed_save_goes_to_a_fallback_and_says_where(folders, tmp_path, monkeypatch):
    img = tifffile.imread(sorted((folders / "img").iterdir())[0])
    lab = tifffile.imread(sorted((folders / "lab").iterdir())[0])
    out = tmp_path / "m.pt"
    real = training.save_checkpoint
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()

    def full_disk(path, *a, **k):
        if path == out:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, *a, **k)

    monkeypatch.setattr(training, "save_checkpoint", full_disk)
    res = train_unet(img, lab, _tiny(), out_path=out, policy=FP32)
    assert not out.exists()
    saved = training.fallback_checkpoint_path(out)
    assert res.checkpoint == str(saved) and saved.is_file() and saved.parent == tmp_path / "tmp"
    assert any("No space left on device" in n and str(saved) in n for n in res.notes)
    assert torch.load(saved, weights_only=True)["training"]["best_epoch"] >= 0


def test_check_output_path_writes_nothing(tmp_path):
    assert check_output_path(tmp_path / "sub" / "m.pt") == tmp_path / "sub" / "m.pt"
    assert list((tmp_path / "sub").iterdir()) == []


def test_failed_metrics_write_after_eval_keeps_the_checkpoint(folders, tmp_path, monkeypatch, capsys):
    out = tmp_path / "m.pt"
    real = torch.save

    def full_disk(obj, f, *a, **k):
        if str(f).endswith(".pt.tmp") and "test" in obj:  # the held-out metrics rewrite
            raise RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")
        return real(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", full_disk)
    rc = _train(folders, "--val-fraction 0", f"--eval-images {folders}/img", f"--eval-labels {folders}/lab",
                out=out)
    assert rc == 0
    assert "held-out metrics not stored" in capsys.readouterr().err
    ckpt = torch.load(out, weights_only=True)
    assert "test" not in ckpt and ckpt["training"]["best_epoch"] == 0
    assert not (tmp_path / "m.pt.tmp").exists()


def test_engine_names_the_pair_that_does_not_fit():
    imgs = [np.zeros((40, 40)), np.zeros((40, 40))]
    labs = [np.ones((40, 40), int), np.ones((30, 40), int)]
    with pytest.raises(ValueError, match=r"pair 2: image .* differ in shape"):
        train_unet(imgs, labs, _tiny(), policy=FP32)
    with pytest.raises(ValueError, match="2 images but 1 label"):
        train_unet(imgs, labs[:1], _tiny(), policy=FP32)


@pytest.mark.parametrize("extra, expect", [
    (["--images", "{root}/img"], "2 --images but 1 --labels folders"),
    (["--limit", "1", "--limit", "1"], "--limit given 2 times for 1 --images folders"),
    (["--weight", "0"], "--weight must be a positive number"),
    (["--scale-aug", "2", "1"], "--scale-aug must be two positive numbers, low <= high"),
])
def test_several_folder_options_one_line_exit_2(folders, capsys, extra, expect):
    args = ["train", "--images", str(folders / "img"), "--labels", str(folders / "lab"),
            "--out", str(folders / "m.pt"), "--device", "cpu"] + [a.format(root=folders) for a in extra]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("napari-gpuseg train: error: ") and expect in err and "\n" not in err, err
    assert not (folders / "m.pt").exists()
