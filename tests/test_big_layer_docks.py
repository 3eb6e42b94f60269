"""The U-Net predict and SAM automatic docks on a lazily opened (dask) image: run in
blocks, never read whole, labels added as a lazily read layer (real BBBC039 data)."""
import numpy as np
import pytest
import tifffile

da = pytest.importorskip("dask.array")

from napari_gpuseg.engine.blocks import run as block_run  # noqa: E402
from napari_gpuseg.engine.blocks import tasks as block_tasks  # noqa: E402
from napari_gpuseg.engine.metrics import object_f1  # noqa: E402

pytestmark = pytest.mark.timeout(400)


@pytest.fixture
def small_blocks(monkeypatch, tmp_path):
    """Blocks of 256 px so a small real image spans several; outputs under tmp_path; the
    largest region read from the image is recorded."""
    monkeypatch.setitem(block_run.DEFAULT_BLOCK, 2, 256)
    monkeypatch.setitem(block_run.DEFAULT_HALO, 2, 48)
    monkeypatch.setattr("platformdirs.user_data_dir", lambda *a, **k: str(tmp_path / "data"))
    reads = []
    real = block_tasks.ArraySource.read

    def read(self, region):
        out = real(self, region)
        reads.append(out.size)
        return out

    monkeypatch.setattr(block_tasks.ArraySource, "read", read)
    return reads


def test_unet_dock_runs_a_dask_layer_in_blocks(make_napari_viewer, qtbot, shared_data, small_blocks):
    from napari_gpuseg.engine.unet.unet_checkpoint import load_unet
    from napari_gpuseg.engine.unet.predict import predict_labels
    from napari_gpuseg.widgets.unet_predict import UNetPredictWidget

    f = sorted((shared_data / "bbbc039" / "images").glob("*.tif"))[3]
    img = tifffile.imread(f)
    viewer = make_napari_viewer()
    viewer.add_image(da.from_array(img, chunks=256), name="big")
    w = UNetPredictWidget(viewer)
    w.image_combo.setCurrentText("big")
    w.run()
    qtbot.waitUntil(lambda: w.run_button.isEnabled(), timeout=300_000)
    assert "Done" in w.status.text() and "blocks" in w.status.text(), w.status.text()
    layer = viewer.layers["big U-Net labels"]
    assert isinstance(layer.data, da.Array)  # read lazily from the OME-Zarr labels
    lab = np.asarray(layer.data)
    whole = predict_labels(load_unet(device="cpu"), img)
    assert object_f1(whole, lab) >= 0.99
    assert max(small_blocks) <= (256 + 2 * 48) ** 2 < img.size  # never the whole image


def test_sam_automatic_dock_runs_a_dask_layer_in_blocks(make_napari_viewer, qtbot, shared_data, small_blocks):
    from sam_fixtures import require_lite_medsam

    require_lite_medsam()
    f = sorted((shared_data / "bbbc039" / "images").glob("*.tif"))[17]
    img = tifffile.imread(f)[100:356, 200:712]
    gt = tifffile.imread(shared_data / "bbbc039" / "masks" / f.name)[100:356, 200:712]
    viewer = make_napari_viewer()
    viewer.add_image(da.from_array(img, chunks=128), name="big")
    _dock, w = viewer.window.add_plugin_dock_widget("napari-gpuseg", "SAM automatic")
    w.image_combo.setCurrentText("big")
    w.source_combo.setCurrentText("Detector: threshold")
    w.run()
    qtbot.waitUntil(lambda: w.run_button.isEnabled(), timeout=300_000)
    assert "objects in 2 blocks" in w.status.text(), w.status.text()
    layer = viewer.layers["big SAM automatic"]
    assert isinstance(layer.data, da.Array)
    from skimage.measure import label

    assert object_f1(label(gt > 0) if gt.max() == 1 else gt, np.asarray(layer.data)) > 0.7
    assert max(small_blocks) < img.size
