"""Fused oneDNN conv/linear + GELU on CPU: same outputs as the plain ops, used only where
it cannot change what a caller sees, and a failing kernel falls back for good."""
import pytest
import torch
import torch.nn.functional as F

from napari_gpuseg.models.sam import cpu_fused
from napari_gpuseg.models.sam.tiny_vit import TinyViT

pytestmark = pytest.mark.skipif(not cpu_fused._available, reason="PyTorch built without oneDNN")
fast_bf16 = pytest.mark.skipif(not cpu_fused._fast_bf16, reason="a CPU without AVX512-BF16 or AMX runs bf16 "
                               "through the plain ops (the policy picks fp32 there)")


@pytest.fixture(autouse=True)
def _restore():
    prev, avail = cpu_fused.set_enabled(True), cpu_fused._available
    bands = cpu_fused.set_row_bands(True)
    yield
    cpu_fused.set_enabled(prev)
    cpu_fused.set_row_bands(bands)
    cpu_fused._available = avail


def _calls(monkeypatch):
    seen = []
    real = torch.ops.mkldnn._convolution_pointwise

    def spy(*a):
        seen.append(a[0].shape)
        return real(*a)
    monkeypatch.setattr(cpu_fused.torch.ops.mkldnn, "_convolution_pointwise", spy, raising=False)
    return seen


def test_fused_ops_match_the_plain_ops():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 20, 24, generator=g)
    w, b = torch.randn(16, 1, 3, 3, generator=g), torch.randn(16, generator=g)
    t, wl, bl = torch.randn(3, 50, 32, generator=g), torch.randn(64, 32, generator=g), torch.randn(64, generator=g)
    with torch.inference_mode():
        assert cpu_fused.active(x)
        conv = cpu_fused.conv2d(x, w, b, (1, 1), (1, 1), (1, 1), 16, "gelu")
        lin = cpu_fused.linear(t, wl, bl, "gelu")
    torch.testing.assert_close(conv, F.gelu(F.conv2d(x, w, b, 1, 1, 1, 16)), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin, F.gelu(F.linear(t, wl, bl)), rtol=1e-5, atol=1e-5)
    assert lin.shape == (3, 50, 64)


def test_only_cpu_inference_in_fp32_or_a_bf16_autocast_is_fused(monkeypatch):
    x = torch.randn(1, 4, 8, 8)
    assert not cpu_fused.active(x)  # autograd on
    with torch.inference_mode():
        assert cpu_fused.active(x)
        assert not cpu_fused.active(x.to(torch.bfloat16))  # bf16 outside an autocast
        assert not cpu_fused.active(x.double())
        with torch.autocast("cpu", dtype=torch.bfloat16), monkeypatch.context() as m:
            m.setattr(cpu_fused, "_fast_bf16", True)  # AVX512-BF16 or AMX
            assert cpu_fused.active(x) and cpu_fused.active(x.to(torch.bfloat16))
            assert not cpu_fused.active(x.double())
            m.setattr(cpu_fused, "_fast_bf16", False)  # a forced bf16 elsewhere: the plain ops
            assert not cpu_fused.active(x) and not cpu_fused.channels_last_input(x)
        cpu_fused.set_enabled(False)
        assert not cpu_fused.active(x)


def test_tinyvit_runs_fused_and_gives_the_plain_result(monkeypatch):
    torch.manual_seed(0)
    enc = TinyViT(img_size=64, patch_embed="conv1x1", num_classes=0).eval()
    x = torch.rand(1, 3, 64, 64)
    seen = _calls(monkeypatch)
    with torch.inference_mode():
        cpu_fused.set_enabled(False)
        plain = enc(x)
        assert not seen
        cpu_fused.set_enabled(True)
        fused = enc(x)
    assert len(seen) >= 7  # patch embed, 2 MBConv x 2, downsampling x 2
    assert fused.is_contiguous()
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-4)


def _random_mbconv(dim=8):
    from napari_gpuseg.models.sam.tiny_vit import MBConv

    torch.manual_seed(1)
    blk = MBConv(dim, dim, 4.0)
    for bn in (blk.conv1.bn, blk.conv2.bn, blk.conv3.bn):  # BatchNorms that change something
        bn.weight.data.uniform_(0.5, 1.5)
        bn.bias.data.normal_()
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 2.0)
    return blk.eval()


# bands of 3 rows (the least), of 5 rows (a row: 11 px x 32 channels x 4 bytes), one band
@pytest.mark.parametrize("band_bytes", [1, 7040, 1 << 30])
def test_mbconv_band_by_band_gives_the_whole_grids_result(monkeypatch, band_bytes):
    """Bands of rows: a band's depthwise window reaches into its neighbours' rows, the image's
    top and bottom rows keep the zero padding, the residual is added inside the last conv."""
    blk = _random_mbconv()
    x = torch.randn(2, 8, 13, 11).contiguous(memory_format=torch.channels_last)  # 13 rows: a short last band
    with torch.inference_mode():
        cpu_fused.set_row_bands(False)
        whole = blk(x)
        cpu_fused.set_row_bands(True)
        assert cpu_fused.rows_active(x)
        monkeypatch.setattr(cpu_fused, "ROW_BAND_BYTES", band_bytes)
        convs = (blk.conv1, blk.conv2, blk.conv3)
        banded = cpu_fused.inverted_residual_rows(x, *(c.folded() for c in convs), band_bytes=band_bytes)
        assert blk(x).is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(banded, whole, rtol=1e-5, atol=1e-5)
    assert (banded - whole).abs().max() < 1e-5 < whole.abs().max()


def test_mbconv_bands_only_in_fp32_inference():
    blk = _random_mbconv()
    x = torch.randn(1, 8, 6, 6)
    with torch.inference_mode():
        assert cpu_fused.rows_active(x)
        assert not cpu_fused.rows_active(x[0])  # not a batch
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not cpu_fused.rows_active(x)  # bf16 keeps the whole-grid ops
        prev = cpu_fused.set_row_bands(False)
        assert not cpu_fused.rows_active(x)
        cpu_fused.set_row_bands(prev)
    assert not cpu_fused.rows_active(x)  # autograd on
    blk.train()
    blk(x).sum().backward()
    assert blk.conv3.c.weight.grad is not None


def test_a_failing_band_kernel_falls_back_to_the_plain_ops(monkeypatch, caplog):
    blk = _random_mbconv()
    x = torch.randn(1, 8, 9, 7)
    def broken(*_a):
        raise RuntimeError("no such kernel")
    with torch.inference_mode():
        cpu_fused.set_enabled(False)
        plain = blk(x)
        cpu_fused.set_enabled(True)
        monkeypatch.setattr(cpu_fused.torch.ops.mkldnn._convolution_pointwise_, "binary", broken, raising=False)
        y = blk(x)
        assert not cpu_fused.active(x)
    torch.testing.assert_close(y, plain, rtol=1e-5, atol=1e-5)
    assert "plain ops" in caplog.text


def test_a_failing_kernel_falls_back_for_good(monkeypatch, caplog):
    def broken(*_a):
        raise RuntimeError("no such kernel")
    monkeypatch.setattr(cpu_fused.torch.ops.mkldnn, "_convolution_pointwise", broken, raising=False)
    x, w = torch.randn(1, 2, 5, 5), torch.randn(2, 2, 1, 1)
    with torch.inference_mode():
        y = cpu_fused.conv2d(x, w, None, (1, 1), (0, 0), (1, 1), 1, "gelu")
        assert not cpu_fused.active(x)
    torch.testing.assert_close(y, F.gelu(F.conv2d(x, w)))
    assert "plain ops" in caplog.text


def test_training_mode_keeps_autograd():
    torch.manual_seed(0)
    enc = TinyViT(img_size=64, patch_embed="conv1x1", num_classes=0)
    x = torch.rand(1, 3, 64, 64)
    enc(x).sum().backward()
    assert enc.layers[0].blocks[0].conv1.c.weight.grad is not None


def test_on_unless_turned_off():
    assert cpu_fused.enabled_by(None) and cpu_fused.enabled_by("") and cpu_fused.enabled_by("1")
    assert not cpu_fused.enabled_by("0") and not cpu_fused.enabled_by(" Off ")
    assert not cpu_fused.enabled_by("false") and not cpu_fused.enabled_by("no")


@fast_bf16
def test_in_a_cpu_bf16_autocast_the_fused_ops_take_bf16_operands_and_match_autocast():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 20, 24, generator=g)
    w, b = torch.randn(16, 1, 3, 3, generator=g), torch.randn(16, generator=g)
    t, wl, bl = torch.randn(3, 50, 32, generator=g), torch.randn(64, 32, generator=g), torch.randn(64, generator=g)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        conv = cpu_fused.conv2d(x, w, b, (1, 1), (1, 1), (1, 1), 16, "gelu")
        lin = cpu_fused.linear(t, wl, bl, "gelu")
        ref_conv, ref_lin = F.gelu(F.conv2d(x, w, b, 1, 1, 1, 16)), F.gelu(F.linear(t, wl, bl))
    assert conv.dtype == ref_conv.dtype == torch.bfloat16 and lin.dtype == ref_lin.dtype == torch.bfloat16
    torch.testing.assert_close(conv.float(), ref_conv.float(), rtol=0.02, atol=0.02)
    torch.testing.assert_close(lin.float(), ref_lin.float(), rtol=0.02, atol=0.02)


@fast_bf16
def test_tinyvit_in_a_cpu_bf16_autocast_runs_fused_on_channels_last_input(monkeypatch):
    """The policy's precision on a CPU with AVX512-BF16 or AMX: the encoder's convolutions
    get a channels-last input and the fused kernels bf16 operands; NCHW, bf16 result."""
    torch.manual_seed(0)
    enc = TinyViT(img_size=64, patch_embed="conv1x1", num_classes=0).eval()
    x = torch.rand(1, 3, 64, 64)
    layouts = []
    real = enc.patch_embed.forward
    monkeypatch.setattr(enc.patch_embed, "forward", lambda t: (layouts.append(
        t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()), real(t))[1])
    seen = _calls(monkeypatch)
    with torch.inference_mode():
        cpu_fused.set_enabled(False)
        ref = enc(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            plain = enc(x)
            assert not seen
            cpu_fused.set_enabled(True)
            fast = enc(x)
    assert layouts == [False, False, True] and len(seen) >= 7
    assert fast.is_contiguous() and fast.dtype == plain.dtype == torch.bfloat16
    err_fast, err_plain = ((y.float() - ref).norm() / ref.norm() for y in (fast, plain))
    assert err_fast < 0.05 and err_fast < 1.5 * err_plain, (err_fast, err_plain)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not cpu_fused.channels_last_input(x)  # autograd on: training keeps its layout
