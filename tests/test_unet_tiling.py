"""Tiled inference equals MONAI's sliding_window_inference (MONAI is a test-only reference)."""
import numpy as np
import pytest
import torch

from napari_gpuseg.engine.runtime.device import Policy
from napari_gpuseg.engine.runtime.cancel import Cancelled, CancelToken
from napari_gpuseg.engine.unet.tiling import importance_map, sliding_window_inference, window_slices
from napari_gpuseg.engine.unet.predict import predict_labels, predict_probabilities
from napari_gpuseg.models.unet import UNet, UNetConfig

monai_inferers = pytest.importorskip("monai.inferers")
monai_utils = pytest.importorskip("monai.data.utils")

FP32 = Policy(torch.device("cpu"), "fp32")


def _net(dims, norm="batch", seed=0):
    torch.manual_seed(seed)
    net = UNet(UNetConfig(spatial_dims=dims, depth=2, base=4, norm=norm)).eval()
    # non-trivial batch-norm statistics so eval mode is not an identity
    for m in net.modules():
        if isinstance(m, (torch.nn.BatchNorm2d, torch.nn.BatchNorm3d)):
            m.running_mean.uniform_(-0.2, 0.2)
            m.running_var.uniform_(0.5, 1.5)
    return net


def _monai(x, roi, net, overlap, mode="gaussian", bs=3):
    with torch.no_grad():
        return monai_inferers.sliding_window_inference(x, roi, bs, net, overlap=overlap, mode=mode)


@pytest.mark.parametrize(
    "shape,roi,overlap",
    [
        ((2, 1, 110, 150), (64, 64), 0.25),
        ((1, 1, 97, 131), (64, 48), 0.5),
        ((1, 1, 40, 50), (64, 64), 0.25),  # smaller than the window: padded
        ((1, 1, 64, 200), (64, 64), 0.3),  # window spans one dimension exactly
    ],
)
def test_matches_monai_2d(shape, roi, overlap):
    net = _net(2)
    x = torch.rand(shape, generator=torch.Generator().manual_seed(1)) * 3
    ref = _monai(x, roi, net, overlap)
    with torch.no_grad():
        ours = sliding_window_inference(x, roi, 3, net, overlap=overlap, mode="gaussian", policy=FP32)
    assert ours.shape == ref.shape
    assert ours.dtype == torch.float32
    assert (ours - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize(
    "shape,roi,overlap",
    [((1, 1, 21, 50, 43), (16, 32, 32), 0.25), ((1, 1, 10, 30, 70), (16, 32, 32), 0.5)],
)
def test_matches_monai_3d(shape, roi, overlap):
    net = _net(3, norm="instance")
    x = torch.rand(shape, generator=torch.Generator().manual_seed(2))
    ref = _monai(x, roi, net, overlap, bs=2)
    with torch.no_grad():
        ours = sliding_window_inference(x, roi, 2, net, overlap=overlap, mode="gaussian", policy=FP32)
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() <= 1e-5


def test_constant_mode_and_importance_map_match_monai():
    for roi in [(64, 48), (16, 32, 31)]:
        ref = monai_utils.compute_importance_map(roi, mode="gaussian", sigma_scale=0.125)
        assert torch.allclose(importance_map(roi, "gaussian", 0.125), ref, atol=0, rtol=0)
    net = _net(2)
    x = torch.rand(1, 1, 90, 120)
    ref = _monai(x, (64, 64), net, 0.25, mode="constant")
    with torch.no_grad():
        ours = sliding_window_inference(x, 64, 4, net, overlap=0.25, mode="constant")
    assert (ours - ref).abs().max().item() <= 1e-5


def test_monai_argument_order_and_defaults():
    """The same positional call as MONAI's (inputs, roi_size, sw_batch_size, predictor) with
    MONAI's defaults (overlap 0.25, constant blending) gives MONAI's result."""
    import inspect

    net = _net(2)
    x = torch.rand(1, 1, 90, 120, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = monai_inferers.sliding_window_inference(x, (64, 64), 2, net)
        ours = sliding_window_inference(x, (64, 64), 2, net)
    assert (ours - ref).abs().max().item() <= 1e-5
    theirs = inspect.signature(monai_inferers.sliding_window_inference).parameters
    mine = inspect.signature(sliding_window_inference).parameters
    shared = list(mine)[: list(mine).index("device") + 1]
    assert shared == list(theirs)[: len(shared)]
    for name in shared:
        if theirs[name].default is not inspect.Parameter.empty:
            assert str(mine[name].default) == str(theirs[name].default), name


def test_windows_cover_image_and_end_at_border():
    wins = window_slices((100, 130), (64, 48), 0.25)
    cover = np.zeros((100, 130), int)
    for s in wins:
        assert all(sl.stop - sl.start == r for sl, r in zip(s, (64, 48)))
        cover[s] += 1
    assert cover.min() >= 1
    assert max(s[0].stop for s in wins) == 100 and max(s[1].stop for s in wins) == 130


def test_adaptive_batches_and_oom_backoff_equal_fixed():
    net = _net(2)
    x = torch.rand(1, 1, 130, 150)  # 9 windows
    with torch.no_grad():
        fixed = sliding_window_inference(x, 64, 1, net, overlap=0.25, mode="gaussian")
        auto = sliding_window_inference(x, 64, None, net, overlap=0.25, mode="gaussian")
    assert (fixed - auto).abs().max().item() <= 1e-5

    calls = []

    def flaky(batch):  # out of memory for batches larger than 2: the runner must halve
        calls.append(len(batch))
        if len(batch) > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return net(batch)

    with torch.no_grad():
        backed_off = sliding_window_inference(x, 64, 8, flaky, overlap=0.25, mode="gaussian")
    assert calls[:3] == [8, 4, 2] and max(calls[3:]) <= 2
    assert (fixed - backed_off).abs().max().item() <= 1e-5


def test_progress_and_cancel():
    net = _net(2)
    x = torch.rand(1, 1, 130, 130)
    seen = []
    with torch.no_grad():
        sliding_window_inference(x, 64, 2, net, progress=lambda d, t: seen.append((d, t)))
    assert seen[-1][0] == seen[-1][1] == len(window_slices((130, 130), (64, 64), 0.25))
    token = CancelToken()

    def cancel_after_first(done, total):
        if done >= 2:
            token.cancel()

    with pytest.raises(Cancelled), torch.no_grad():
        sliding_window_inference(x, 64, 2, net, progress=cancel_after_first, cancel=token)


def test_bf16_autocast_close_to_fp32():
    net = _net(2)
    x = torch.rand(1, 1, 100, 100)
    with torch.no_grad():
        ref = sliding_window_inference(x, 64, 2, net, mode="gaussian", policy=FP32)
        low = sliding_window_inference(x, 64, 2, net, mode="gaussian", policy=Policy(torch.device("cpu"), "bf16"))
    assert low.dtype == torch.float32
    assert (ref - low).abs().max().item() < 0.1 * ref.abs().max().item()


def test_stack_is_a_batch_of_slices():
    net = _net(2)
    stack = (np.random.default_rng(0).random((3, 70, 90)) * 4000).astype(np.uint16)
    probs = predict_probabilities(net, stack, policy=FP32, roi_size=(64, 64))
    assert probs.shape == (3, 3, 70, 90)
    assert np.allclose(probs.sum(1), 1, atol=1e-5)
    one = predict_probabilities(net, stack[1], policy=FP32, roi_size=(64, 64))
    assert np.abs(one - probs[1]).max() < 1e-5
    labels = predict_labels(net, stack, policy=FP32, roi_size=(64, 64))
    assert labels.shape == (3, 70, 90) and labels.dtype == np.int32
