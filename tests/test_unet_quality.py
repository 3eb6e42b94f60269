"""The bundled nuclei U-Net on validation data it never saw: the 8 last BBBC039 fields,
against the classical baseline (blur, Otsu, distance-transform watershed) computed here
too, and the DSB2018 field of another microscope."""
import numpy as np
import pytest
import tifffile
import torch

from napari_gpuseg.engine import metrics
from napari_gpuseg.engine.classical import classical_segment
from napari_gpuseg.engine.runtime.device import Policy
from napari_gpuseg.engine.unet.unet_checkpoint import bundled_model_path, load_unet
from napari_gpuseg.engine.unet.predict import predict_labels

FP32 = Policy(torch.device("cpu"), "fp32")


@pytest.fixture(scope="module")
def validation(shared_data):
    files = sorted((shared_data / "bbbc039" / "images").glob("*.tif"))
    assert len(files) == 24
    val = files[16:]
    images = [tifffile.imread(f) for f in val]
    truth = [tifffile.imread(shared_data / "bbbc039" / "masks" / f.name) for f in val]
    return images, truth


def test_bundled_checkpoint_is_small_and_safe():
    path = bundled_model_path()
    assert path.is_file()
    assert path.stat().st_size < 5 * 2**20
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    assert ckpt["format"] == "napari-gpuseg-unet"
    assert ckpt["normalization"]["kind"] == "percentile"
    train_files = ckpt["training"]["data"]["train_files"]  # "<data set>/<file>"
    sets = {f.split("/")[0] for f in train_files}
    assert sets == {"bbbc039", "bbbc039_more", "dsb2018_more"} and len(train_files) == 16 + 120 + 32
    bbbc039 = sorted(f for f in train_files if f.startswith("bbbc039/"))
    assert len(bbbc039) == 16 and bbbc039[-1] == "bbbc039/IXMtest_L10_s6.tif"  # the first 16 only
    assert "bbbc039/IXMtest_M04_s3.tif" not in train_files  # validation unseen


def test_bundled_model_beats_classical_baseline(validation):
    images, truth = validation
    model = load_unet(None, device="cpu")
    # all 8 fields share one shape: one engine call, windows of all images batched together
    pred = predict_labels(model, np.stack(images), policy=FP32)
    preds = list(pred)
    base = [classical_segment(im) for im in images]
    ours, classic = metrics.summary(truth, preds), metrics.summary(truth, base)
    print(f"\nU-Net:     F1@0.5 {ours['f1@0.5']:.4f} F1@0.75 {ours['f1@0.75']:.4f} "
          f"fg IoU {ours['foreground_iou']:.4f}")
    print(f"classical: F1@0.5 {classic['f1@0.5']:.4f} F1@0.75 {classic['f1@0.75']:.4f} "
          f"fg IoU {classic['foreground_iou']:.4f}")
    assert ours["f1@0.5"] >= 0.90
    assert ours["foreground_iou"] >= 0.92
    assert ours["f1@0.5"] > classic["f1@0.5"]
    assert ours["foreground_iou"] > classic["foreground_iou"]


def test_bundled_model_on_another_microscope(shared_data):
    """The DSB2018 field (fluorescence from another microscope, dim nuclei beside a few
    saturated ones): F1@0.5 0.49 with the model trained on BBBC039 alone."""
    image = tifffile.imread(shared_data / "dsb2018" / "image.tif")
    truth = tifffile.imread(shared_data / "dsb2018" / "mask.tif")
    labels = predict_labels(load_unet(None, device="cpu"), image, policy=FP32)
    m = metrics.summary([truth], [labels])
    print(f"\nDSB2018 field: F1@0.5 {m['f1@0.5']:.4f} fg IoU {m['foreground_iou']:.4f}")
    assert m["f1@0.5"] >= 0.80
    assert m["foreground_iou"] >= 0.80


def test_metrics_on_known_cases():
    gt = np.zeros((20, 20), int)
    gt[2:8, 2:8] = 1
    gt[10:18, 10:18] = 2
    assert metrics.object_f1(gt, gt) == 1.0 and metrics.foreground_iou(gt, gt) == 1.0
    pred = np.zeros_like(gt)
    pred[2:8, 2:7] = 5  # IoU 30/36 = 0.83 with object 1
    pred[0:2, 0:2] = 7  # false positive
    s = metrics.pooled_stats(gt, pred, 0.5)
    assert (s.tp, s.fp, s.fn) == (1, 1, 1)
    assert metrics.object_f1(gt, pred, 0.9) == 0.0
    assert metrics.object_f1([gt, gt], [pred, gt], 0.5) == pytest.approx(2 * 3 / (2 * 3 + 1 + 1))
    assert metrics.foreground_iou(gt, pred) == pytest.approx(30 / (100 + 4))
    empty = np.zeros_like(gt)
    assert metrics.object_f1(empty, empty) == 1.0 and metrics.foreground_iou(empty, empty) == 1.0
