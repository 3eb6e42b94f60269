"""A few training iterations on real BBBC039 crops produce a checkpoint that loads with
weights_only=True and predicts; targets, loss, cancel, 3D and the CLI twin."""
import numpy as np
import pytest
import tifffile
import torch

from napari_gpuseg.engine.runtime.device import Policy
from napari_gpuseg.engine.runtime.cancel import Cancelled, CancelToken
from napari_gpuseg.engine.unet.loss import dice_ce_loss
from napari_gpuseg.engine.unet.train_data import make_targets
from napari_gpuseg.engine.unet.training import TrainConfig, train_unet
from napari_gpuseg.engine.unet.unet_checkpoint import load_unet
from napari_gpuseg.engine.unet.predict import predict_labels, predict_probabilities
from napari_gpuseg.models.unet import UNet, UNetConfig

FP32 = Policy(torch.device("cpu"), "fp32")


def _tiny(dims=2, **kw):
    base = dict(model=UNetConfig(spatial_dims=dims, depth=2, base=8).to_dict(), crop_size=64, batch_size=2,
                epochs=2, iters_per_epoch=3, warmup_iters=2, val_fraction=0.5, patience=5, val_roi=128)
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def pairs(shared_data):
    files = sorted((shared_data / "bbbc039" / "images").glob("*.tif"))[:2]
    imgs = [tifffile.imread(f)[:160, :200] for f in files]
    labs = [tifffile.imread(shared_data / "bbbc039" / "masks" / f.name)[:160, :200] for f in files]
    return imgs, labs


def test_targets_separate_touching_objects():
    lab = np.zeros((12, 20), int)
    lab[2:10, 2:10] = 1
    lab[2:10, 10:18] = 2  # touching object
    t = make_targets(lab)
    assert set(np.unique(t)) == {0, 1, 2}
    assert (t[lab == 0] == 0).all()
    assert (t[2:10, 9] == 2).all() and (t[2:10, 10] == 2).all()  # both rims at the contact
    assert t[5, 5] == 1 and t[5, 14] == 1
    from scipy import ndimage as ndi

    assert ndi.label(t == 1)[1] == 2  # interiors do not touch


def test_loss_prefers_the_right_answer():
    target = torch.randint(0, 3, (2, 16, 16))
    good = torch.nn.functional.one_hot(target, 3).movedim(-1, 1).float() * 10
    bad = torch.roll(good, 1, dims=1)
    assert dice_ce_loss(good, target) < 0.05 < dice_ce_loss(bad, target)


def test_training_writes_checkpoint_that_loads_and_predicts(pairs, tmp_path):
    imgs, labs = pairs
    events, prog = [], []
    out = tmp_path / "m.pt"
    res = train_unet(imgs, labs, _tiny(channels_last=True), out_path=out, policy=FP32, on_event=events.append,
                     progress=lambda d, t: prog.append((d, t)), data_summary={"note": "test"})
    assert res.checkpoint == str(out) and out.is_file()
    assert prog[-1] == (6, 6)
    iters = [e for e in events if e.kind == "iter"]
    epochs = [e for e in events if e.kind == "epoch"]
    assert len(iters) == 6 and len(epochs) == 2
    assert all(np.isfinite(e.train_loss) for e in iters)
    assert epochs[0].val_f1 is not None and 0 <= epochs[0].val_fg_iou <= 1
    ckpt = torch.load(out, map_location="cpu", weights_only=True)
    assert ckpt["config"]["depth"] == 2 and ckpt["training"]["data"]["note"] == "test"
    assert ckpt["training"]["config"]["crop_size"] == 64 and "val_score" in ckpt["metrics"]
    loaded = load_unet(out, device="cpu")
    probs = predict_probabilities(loaded, imgs[0], policy=FP32)
    assert probs.shape == (3,) + imgs[0].shape
    assert np.allclose(probs.sum(0), 1, atol=1e-5)
    labels = predict_labels(loaded, imgs[0], policy=FP32)
    assert labels.shape == imgs[0].shape and labels.dtype == np.int32


def test_single_image_split_fine_tune_and_cancel(pairs, tmp_path):
    imgs, labs = pairs
    first = tmp_path / "a.pt"
    train_unet(imgs[0], labs[0], _tiny(epochs=1, val_fraction=0.2), out_path=first, policy=FP32)
    tuned = tmp_path / "b.pt"
    res = train_unet(imgs[1], labs[1], _tiny(epochs=1, model=UNetConfig(base=4).to_dict()), out_path=tuned,
                     policy=FP32, init_checkpoint=first)
    assert res.model.config.base == 8  # architecture comes from the initial checkpoint
    token = CancelToken()

    def stop(ev):
        if ev.iteration >= 2:
            token.cancel()

    with pytest.raises(Cancelled):
        train_unet(imgs, labs, _tiny(epochs=5), policy=FP32, on_event=stop, cancel=token)
    with pytest.raises(ValueError, match="no objects"):
        train_unet(imgs[0], np.zeros_like(labs[0]), _tiny(), policy=FP32)


def test_3d_training_with_gradient_checkpointing(shared_data, tmp_path):
    vol = tifffile.imread(shared_data / "synthetic3d" / "image.tif")
    lab = tifffile.imread(shared_data / "synthetic3d" / "mask.tif")
    cfg = _tiny(dims=3, crop_size=16, epochs=1, iters_per_epoch=2, val_fraction=0.0,
                gradient_checkpointing=True)
    res = train_unet(vol, lab, cfg, out_path=tmp_path / "v.pt", policy=FP32)
    loaded = load_unet(res.checkpoint, device="cpu")
    assert loaded.config.spatial_dims == 3
    labels = predict_labels(loaded, vol, policy=FP32, roi_size=(16, 32, 32))
    assert labels.shape == vol.shape


def test_gradient_checkpointing_gives_same_gradients():
    torch.manual_seed(0)
    net = UNet(UNetConfig(depth=2, base=4, norm="group"))
    x = torch.rand(2, 1, 32, 32)
    net(x).sum().backward()
    ref = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    net.gradient_checkpointing = True
    net(x).sum().backward()
    assert all(torch.allclose(a, p.grad, atol=1e-5) for a, p in zip(ref, net.parameters()))


def test_cli_train_twin(shared_data, tmp_path):
    from napari_gpuseg.cli.main import main

    out = tmp_path / "cli.pt"
    bb = shared_data / "bbbc039"
    rc = main(["train", "--images", str(bb / "images"), "--labels", str(bb / "masks"), "--limit", "2",
               "--out", str(out), "--depth", "2", "--base", "4", "--crop", "64", "--batch-size", "2",
               "--epochs", "1", "--iters-per-epoch", "2", "--val-fraction", "0", "--device", "cpu",
               "--precision", "fp32"])
    assert rc == 0
    ckpt = torch.load(out, map_location="cpu", weights_only=True)
    assert ckpt["training"]["data"]["train_files"] == ["IXMtest_A02_s1.tif", "IXMtest_A09_s1.tif"]


def test_scaled_crops_make_fresh_targets_and_follow_the_weights():
    from napari_gpuseg.engine.unet.train_data import CropDataset

    lab = np.zeros((80, 90), np.int32)
    lab[10:30, 10:30], lab[30:50, 10:30], lab[50:70, 40:80] = 1, 2, 3  # 1 and 2 touch
    img = (lab > 0).astype(np.float32)[None]
    empty = np.zeros_like(lab)
    torch.manual_seed(0)
    ds = CropDataset([img * 0, img], [empty, lab], 48, 40, weights=[0, 1], scale=(0.5, 2.0),
                     target_fn=lambda y: make_targets(y, mark_contacts=True), strong_intensity=True)
    seen = set()
    for k in range(len(ds)):
        x, y = ds[k]
        assert x.shape == (1, 48, 48) and y.shape == (48, 48) and torch.isfinite(x).all()
        seen |= set(torch.unique(y).tolist())
    assert seen == {0, 1, 2, 3}  # interiors, rims and contacts: only the weighted image is drawn
    with pytest.raises(ValueError, match="target_fn"):
        CropDataset([img], [lab], 48, 4, scale=(0.5, 2.0))
    with pytest.raises(ValueError, match="weights"):
        CropDataset([img], [lab], 48, 4, weights=[-1])


def test_cli_train_several_folders_colour_and_augmentation(shared_data, tmp_path):
    """Two data sets (gray BBBC039 crops, one colour H&E field), per-folder limits and
    weights, scale and intensity augmentation: the checkpoint names every file with its set."""
    from napari_gpuseg.cli.main import main

    bb, dsb = shared_data / "bbbc039", shared_data / "dsb2018_more"
    colour = "9f17aea854db1301.tif"
    for sub in ("c_img", "c_lab"):
        (tmp_path / "dsb" / sub).mkdir(parents=True)
    tifffile.imwrite(tmp_path / "dsb" / "c_img" / colour, tifffile.imread(dsb / "images" / colour)[:200, :240])
    tifffile.imwrite(tmp_path / "dsb" / "c_lab" / colour, tifffile.imread(dsb / "masks" / colour)[:200, :240])
    out = tmp_path / "multi.pt"
    rc = main(["train", "--images", str(bb / "images"), "--labels", str(bb / "masks"), "--limit", "2",
               "--images", str(tmp_path / "dsb" / "c_img"), "--labels", str(tmp_path / "dsb" / "c_lab"),
               "--limit", "all", "--weight", "1", "--weight", "3", "--scale-aug", "0.5", "2",
               "--strong-intensity", "--out", str(out), "--depth", "2", "--base", "4", "--crop", "64",
               "--batch-size", "2", "--epochs", "1", "--iters-per-epoch", "2", "--val-fraction", "0",
               "--device", "cpu", "--precision", "fp32"])
    assert rc == 0
    ckpt = torch.load(out, map_location="cpu", weights_only=True)
    assert ckpt["training"]["data"]["train_files"] == [
        "bbbc039/IXMtest_A02_s1.tif", "bbbc039/IXMtest_A09_s1.tif", f"dsb/{colour}"]
    assert ckpt["training"]["config"]["scale_range"] == [0.5, 2.0]
    assert ckpt["training"]["config"]["strong_intensity"] is True


def test_sample_weights_follow_the_validation_split():
    from napari_gpuseg.engine.unet.train_data import train_weights, val_indices

    w = [1.0, 2.0, 3.0, 4.0, 5.0]
    (v,) = val_indices(5, 0.2, seed=3)
    assert train_weights(w, 5, 4, 0.2, seed=3).tolist() == [x for i, x in enumerate(w) if i != v]
    assert train_weights(None, 5, 4, 0.2) is None
    with pytest.raises(ValueError, match="4 values for 5 images"):
        train_weights(w[:4], 5, 4, 0.2)
