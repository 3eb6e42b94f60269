"""Fine-tuning on an annotated region (engine.unet.finetune_annotated) and the ignored loss pixels."""
import numpy as np
import pytest
import tifffile
import torch

from napari_gpuseg.engine.runtime.cancel import Cancelled, CancelToken
from napari_gpuseg.engine.runtime.device import Policy
from napari_gpuseg.engine.unet import training
from napari_gpuseg.engine.unet.finetune_annotated import (
    default_output_path, default_schedule, finetune_unet, region_mask, training_pair,
)
from napari_gpuseg.engine.unet.unet_checkpoint import bundled_model_path, load_checkpoint, load_unet
from napari_gpuseg.engine.unet.predict import predict_labels
from napari_gpuseg.engine.unet.loss import dice_ce_loss
from napari_gpuseg.engine.unet.train_data import IGNORE

FP32 = Policy(torch.device("cpu"), "fp32")


@pytest.fixture(scope="module")
def dsb(shared_data):
    img = tifffile.imread(shared_data / "dsb2018" / "image.tif")[:160, :192]
    gt = tifffile.imread(shared_data / "dsb2018" / "mask.tif")[:160, :192]
    return img, gt


def _short(**kw):
    from dataclasses import replace

    base = dict(crop_size=64, batch_size=2, epochs=1, iters_per_epoch=3, warmup_iters=1)
    return replace(default_schedule(), **{**base, **kw})


def test_ignored_pixels_do_not_count_in_the_loss():
    torch.manual_seed(0)
    target = torch.randint(0, 3, (2, 16, 16))
    target[:, :, 8:] = IGNORE
    logits = torch.randn(2, 3, 16, 16, requires_grad=True)
    loss = dice_ce_loss(logits, target, contact_weight=5.0)
    loss.backward()
    assert torch.isfinite(loss)
    assert float(logits.grad[..., 8:].abs().max()) == 0.0  # nothing flows from ignored pixels
    assert float(logits.grad[..., :8].abs().max()) > 0.0
    other = logits.detach().clone()
    other[..., 8:] = torch.randn(2, 3, 16, 8) * 10  # anything outside the region: same loss
    assert float(dice_ce_loss(other, target, 5.0)) == pytest.approx(float(loss.detach()), rel=1e-5)
    # the valid half alone gives the same value
    half = dice_ce_loss(logits.detach()[..., :8], target[..., :8], 5.0)
    assert float(half) == pytest.approx(float(loss.detach()), rel=1e-5)


def test_region_masks_and_bad_regions():
    lab = np.zeros((50, 60), np.int32)
    lab[20:25, 30:34] = 1
    assert region_mask(lab.shape, "whole").all()
    m = region_mask(lab.shape, "rectangle", rectangle=(-5, 10, 20, 100))
    assert m[:20, 10:].all() and m.sum() == 20 * 50
    m = region_mask(lab.shape, "labels", labels=lab, margin=2)
    assert m[18:27, 28:36].all() and m.sum() == 9 * 8
    for kw, msg in (({"region": "labels", "labels": np.zeros((50, 60))}, "no objects"),
                    ({"region": "rectangle", "rectangle": (60, 0, 70, 10)}, "does not overlap"),
                    ({"region": "rectangle"}, "needs"), ({"region": "circle"}, "unknown region")):
        with pytest.raises(ValueError, match=msg):
            region_mask(lab.shape, **kw)


def test_training_pair_crops_with_context_and_marks_outside():
    img = np.arange(100 * 100, dtype=np.float32).reshape(100, 100)
    lab = np.zeros((100, 100), np.int32)
    lab[50:60, 50:60] = 7
    mask = region_mask(lab.shape, "rectangle", rectangle=(40, 40, 70, 70))
    x, y = training_pair(img, lab, mask, context=5)
    assert x.shape == y.shape == (40, 40)
    assert (y[:5] == -1).all() and (y[5:35, 5:35] >= 0).all() and (y == 7).sum() == 100
    assert x[0, 0] == img[35, 35]


def test_train_unet_sees_ignored_targets(dsb, monkeypatch, tmp_path):
    seen = []
    real = training.dice_ce_loss

    def spy(logits, target, *a, **k):
        seen.append(torch.unique(target).tolist())
        return real(logits, target, *a, **k)

    monkeypatch.setattr(training, "dice_ce_loss", spy)
    img, gt = dsb
    finetune_unet(img, gt, region="rectangle", rectangle=(0, 0, 160, 96), config=_short(), policy=FP32,
                  out_path=tmp_path / "t.pt")
    values = set().union(*seen)
    assert IGNORE in values and values <= {0, 1, 2, 3, IGNORE}


def test_finetune_saves_beside_the_image_loads_and_cancels(dsb, tmp_path):
    img, gt = dsb
    src = tmp_path / "field.tif"
    tifffile.imwrite(src, img)
    losses = []
    res = finetune_unet(img, gt, region="labels", config=_short(), image_path=src, policy=FP32,
                        on_event=lambda e: losses.append(e.train_loss) if e.kind == "iter" else None)
    assert res.checkpoint == str(tmp_path / "field_unet_adapted.pt")
    assert len(losses) == 3 and all(np.isfinite(losses))
    ck = load_checkpoint(res.checkpoint)
    assert ck["config"] == load_checkpoint(bundled_model_path())["config"]  # started from the bundled model
    assert ck["training"]["data"]["finetune"]["region"] == "labels"
    pred = predict_labels(load_unet(res.checkpoint), img)
    assert pred.shape == img.shape
    assert default_output_path(src) == tmp_path / "field_unet_adapted_2.pt"  # never overwrites
    # start from the adapted model, then cancel
    token = CancelToken()

    def stop(ev):
        token.cancel()

    with pytest.raises(Cancelled):
        finetune_unet(img, gt, init_checkpoint=res.checkpoint, config=_short(epochs=2), out_path=tmp_path / "b.pt",
                      policy=FP32, on_event=stop, cancel=token)
    with pytest.raises(ValueError, match="no labelled objects"):
        finetune_unet(img, np.where(np.arange(192)[None] < 100, 0, gt), region="rectangle",
                      rectangle=(0, 0, 160, 50), config=_short(), policy=FP32)


def test_output_goes_to_base_when_the_image_folder_is_read_only(tmp_path, monkeypatch):
    from napari_gpuseg.engine.unet import finetune_annotated as finetune

    monkeypatch.setattr(finetune.os, "access", lambda path, mode: False)
    assert default_output_path(tmp_path / "ro" / "f.tif", base=tmp_path / "models") == \
        tmp_path / "models" / "f_unet_adapted.pt"
    assert default_output_path(None, base=tmp_path) == tmp_path / "image_unet_adapted.pt"
