"""The one conversion of any image to the U-Net's 1-channel input
(napari_gpuseg.engine.normalize.model_input), on synthetic and real colour images, and the
same labels from a U-Net folder job as from the engine call the predict dock makes."""
import numpy as np
import pytest
import tifffile
import torch

from napari_gpuseg import io as gio
from napari_gpuseg.engine.normalize import bright_background, is_color, model_input, to_gray

H_AND_E = "9f17aea854db1301.tif"  # a colour H&E field of dsb2018_more (training data)


def _blobs(dark_on_bright: bool, rgb: bool, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A field with a few round objects: fluorescence-like or dark purple on white."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[:96, :128]
    mask = np.zeros((96, 128), bool)
    for cy, cx in ((20, 30), (60, 90), (70, 30), (30, 100)):
        mask |= (yy - cy) ** 2 + (xx - cx) ** 2 < 81
    noise = rng.normal(0, 4, mask.shape)
    if not rgb:
        img = np.where(mask, 180.0, 20.0) + noise
        return (255 - img if dark_on_bright else img).clip(0, 255).astype(np.uint8), mask
    bg, fg = np.array([240.0, 235, 240]), np.array([90.0, 60, 140])  # white, hematoxylin purple
    if not dark_on_bright:
        bg, fg = np.array([5.0, 5, 10]), np.array([20.0, 40, 220])  # blue fluorescence in RGB
    img = np.where(mask[..., None], fg, bg) + noise[..., None]
    return img.clip(0, 255).astype(np.uint8), mask


@pytest.mark.parametrize("rgb", [False, True])
@pytest.mark.parametrize("dark_on_bright", [False, True])
def test_objects_come_out_bright_on_dark(rgb, dark_on_bright):
    img, mask = _blobs(dark_on_bright, rgb)
    out = model_input(img)
    assert out.shape == mask.shape and out.dtype == np.float32
    assert out[mask].mean() - out[~mask].mean() > 0.5 * (out.max() - out.min())
    assert bool(bright_background(to_gray(img) if rgb else img)) == dark_on_bright
    if not rgb and not dark_on_bright:  # fluorescence passes unchanged
        np.testing.assert_array_equal(out, img.astype(np.float32))


def test_conversion_is_final_and_luminance_first():
    img, _ = _blobs(True, True)
    once = model_input(img)
    np.testing.assert_array_equal(model_input(once), once)  # a second pass changes nothing
    np.testing.assert_array_equal(model_input(to_gray(img)), once)  # gray first: same input
    np.testing.assert_array_equal(model_input(gio.to_gray(img)), once)  # io's gray is the same
    rgba = np.concatenate([img, np.full(img.shape[:2] + (1,), 7, np.uint8)], axis=-1)
    np.testing.assert_array_equal(model_input(rgba), once)  # alpha ignored
    assert is_color(img) and is_color(rgba) and not is_color(img[..., 0])
    assert not is_color(np.zeros((3, 40, 3)), labels_shape=(3, 40, 3))  # a stack, not colour


def test_planes_of_a_stack_are_decided_one_by_one():
    bright, _ = _blobs(True, False)
    dark, _ = _blobs(False, False, seed=1)
    stack = np.stack([bright, dark])
    out = model_input(stack)
    np.testing.assert_array_equal(out[0], model_input(bright))
    np.testing.assert_array_equal(out[1], dark.astype(np.float32))
    assert not np.array_equal(out[0], bright.astype(np.float32))


def test_flat_empty_and_nan_images_pass():
    np.testing.assert_array_equal(model_input(np.full((8, 8), 5, np.uint16)), np.full((8, 8), 5, np.float32))
    x = np.ones((8, 8), np.float32)
    x[0, 0] = np.nan
    assert np.isnan(model_input(x)[0, 0])  # NaN handling stays with the normalisation
    assert model_input(np.zeros((0, 4))).shape == (0, 4)


def test_real_fields_fluorescence_kept_colour_inverted(shared_data):
    """Every fluorescence field with nuclei passes unchanged, every colour field is inverted
    (the decision the model card reports), and the H&E nuclei come out bright."""
    for folder in ("dsb2018_more", "bbbc039"):
        for path in sorted((shared_data / folder / "images").glob("*.tif"))[:40]:
            img = tifffile.imread(path)
            mask = tifffile.imread(shared_data / folder / "masks" / path.name) > 0
            if is_color(img):
                assert bright_background(to_gray(img)), path.name
                out = model_input(img)
                assert np.median(out[mask]) > np.median(out[~mask]), path.name
            elif mask.any():
                assert not bright_background(img), path.name
                np.testing.assert_array_equal(model_input(img), img.astype(np.float32))


def test_folder_job_and_predict_dock_give_the_same_labels_on_colour(shared_data, tmp_path):
    """The predict dock's job (RGB layer, ``rgb=True``) and a U-Net folder job over the same
    RGB file: identical labels, and the bundled model finds the H&E nuclei."""
    from napari_gpuseg.engine.jobs.pipeline import output_paths, run_folder
    from napari_gpuseg.engine.metrics import object_f1
    from napari_gpuseg.widgets._unet_jobs import predict_job

    src = shared_data / "dsb2018_more" / "images" / H_AND_E
    image = gio.read_image(src)
    assert image.ndim == 3 and image.shape[-1] == 3
    folder, out = tmp_path / "in", tmp_path / "out"
    folder.mkdir()
    tifffile.imwrite(folder / H_AND_E, image)
    report = run_folder(folder, out, "unet", devices="cpu", precision="fp32")
    assert report.ok == 1, report.rows
    from_job = tifffile.imread(output_paths(folder, out, folder / H_AND_E)[0])

    from napari_gpuseg.engine.runtime import worker as worker_mod
    from napari_gpuseg.engine.runtime.device import Policy

    worker = worker_mod.default_worker()
    old = worker.policy
    worker.policy = Policy(torch.device("cpu"), "fp32")
    try:
        from_dock = predict_job(image, None, True, ["labels"], None, 0.25, 0)["labels"]
    finally:
        worker.policy = old
    np.testing.assert_array_equal(from_dock, from_job)
    truth = tifffile.imread(shared_data / "dsb2018_more" / "masks" / H_AND_E)
    assert from_job.max() > 10 and object_f1(truth, from_job, 0.5) > 0.5
