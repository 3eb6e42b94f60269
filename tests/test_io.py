"""Reading, validation, folder scans and atomic writes (napari_gpuseg.io)."""
from __future__ import annotations

import os

import numpy as np
import pytest
import tifffile

from batch_helpers import BAD, REAL, bbbc, make_mixed_folder
from napari_gpuseg import io as gio
from napari_gpuseg.io import label_files, tables


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, shared_data):
    folder = tmp_path_factory.mktemp("mixed")
    make_mixed_folder(folder, shared_data)
    return folder


def test_real_tiff_reads_unchanged(mixed, shared_data):
    img, _ = bbbc(shared_data, REAL[0])
    loaded = gio.load_image(mixed / REAL[0])
    assert loaded.data.dtype == np.uint16 and not loaded.rgb and loaded.notes == []
    np.testing.assert_array_equal(loaded.data, img)


@pytest.mark.parametrize("name,cls", [
    ("zero.tif", gio.EmptyFileError),
    ("text.tif", gio.NotAnImageError),
    ("corrupt.tif", gio.NotAnImageError),
    ("five_d.tif", gio.UnsupportedDimensionsError),
    ("all_nan.tif", gio.AllNaNError),
    ("complex.tif", gio.UnsupportedDtypeError),
])
def test_bad_files_raise_clear_errors(mixed, name, cls):
    with pytest.raises(cls) as info:
        gio.load_image(mixed / name)
    assert isinstance(info.value, gio.ImageReadError)
    assert name in str(info.value)  # the message names the file
    assert BAD[name].lower() in info.value.message.lower()


def test_missing_file(tmp_path):
    with pytest.raises(gio.ImageReadError, match="not found"):
        gio.load_image(tmp_path / "nope.tif")


def test_nan_replaced_by_minimum(mixed):
    loaded = gio.load_image(mixed / "float_nan.tif")
    assert np.isfinite(loaded.data).all()
    assert "NaN" in loaded.notes[0]
    assert loaded.data[0, 0] == loaded.data.min()


def test_rgb_png_kept_as_rgb_and_gray_helper(mixed):
    loaded = gio.load_image(mixed / "rgb.png")
    assert loaded.rgb and loaded.data.shape[-1] == 3 and loaded.data.dtype == np.uint8
    gray = gio.to_gray(loaded.data)
    assert gray.shape == loaded.data.shape[:2] and gray.dtype == np.float32
    expected = 0.587 * loaded.data[..., 1] + 0.114 * loaded.data[..., 2]
    np.testing.assert_allclose(gray, expected, rtol=1e-5, atol=1e-3)


def test_rgba_drops_alpha_and_singletons_squeezed(tmp_path):
    tifffile.imwrite(tmp_path / "rgba.tif", np.zeros((20, 30, 4), np.uint8), photometric="rgb")
    loaded = gio.load_image(tmp_path / "rgba.tif")
    assert loaded.data.shape == (20, 30, 3) and "alpha" in loaded.notes[0]
    tifffile.imwrite(tmp_path / "s.tif", np.zeros((1, 1, 20, 30), np.uint16))
    assert gio.read_image(tmp_path / "s.tif").shape == (20, 30)
    tifffile.imwrite(tmp_path / "b.tif", np.ones((8, 8), bool))
    assert gio.read_image(tmp_path / "b.tif").dtype == np.uint8


def test_too_large_is_refused_before_reading(mixed):
    with pytest.raises(gio.TooLargeError, match="GiB"):
        gio.load_image(mixed / REAL[0], max_bytes=1000)


def test_scan_folder_sorted_patterns_recursive_excludes(tmp_path):
    for rel in ["b.tif", "a.TIFF", "c.png", "note.txt", ".hidden.tif", "sub/d.tif", "out/x.tif",
                "sub/.gpuseg-tmp-e.tif.1.tmp"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"x")
    names = lambda files: [f.relative_to(tmp_path).as_posix() for f in files]  # noqa: E731
    assert names(gio.scan_folder(tmp_path, "*.tif*")) == ["a.TIFF", "b.tif"]
    assert names(gio.scan_folder(tmp_path)) == ["a.TIFF", "b.tif", "c.png"]  # TIFF and PNG by default
    assert names(gio.scan_folder(tmp_path, "*.tif*, *.png")) == ["a.TIFF", "b.tif", "c.png"]
    assert names(gio.scan_folder(tmp_path, "*.tif*", recursive=True, exclude=[tmp_path / "out"])) == [
        "a.TIFF", "b.tif", "sub/d.tif"]
    with pytest.raises(NotADirectoryError):
        gio.scan_folder(tmp_path / "missing")


def test_write_labels_compressed_atomic_and_valid(tmp_path):
    labels = np.zeros((200, 300), np.int32)
    labels[10:50, 10:60] = 1
    labels[100:150, 200:260] = 300
    path = label_files.write_labels(tmp_path / "sub" / "x_labels.tif", labels)
    back = label_files.read_labels(path)
    np.testing.assert_array_equal(back, labels)
    assert back.dtype == np.uint16  # smallest dtype that holds 300
    with tifffile.TiffFile(path) as tf:
        assert tf.pages[0].compression != 1  # compressed
    assert os.path.getsize(path) < labels.size  # far smaller than raw
    assert label_files.is_valid_output(path)
    assert not list(tmp_path.rglob(label_files.TEMP_PREFIX + "*"))  # no temp left behind
    # a truncated TIFF is not a valid output, nor an empty or missing one
    raw = path.read_bytes()
    trunc = tmp_path / "trunc.tif"
    trunc.write_bytes(raw[: len(raw) // 2])
    assert not label_files.is_valid_output(trunc)
    (tmp_path / "empty.tif").write_bytes(b"")
    assert not label_files.is_valid_output(tmp_path / "empty.tif")
    assert not label_files.is_valid_output(tmp_path / "missing.tif")


def test_failed_write_leaves_old_file_and_no_temp(tmp_path, monkeypatch):
    target = tmp_path / "t.txt"
    label_files.atomic_write_text(target, "old")

    def boom(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError, match="disk full"):
        label_files.atomic_write_text(target, "new")
    assert target.read_text() == "old"
    assert not list(tmp_path.glob(label_files.TEMP_PREFIX + "*"))


def test_object_table_matches_regionprops(tmp_path, shared_data):
    from skimage.measure import regionprops

    _, gt = bbbc(shared_data, REAL[0])
    scores = {int(i): i / 1000 for i in np.unique(gt) if i}
    path = tables.write_object_table(tmp_path / "t.csv", gt, scores)
    rows = tables.read_csv(path)
    props = regionprops(gt)
    assert len(rows) == len(props) == len(scores)
    for row, p in zip(rows, props):
        assert int(row["label"]) == p.label and int(row["area"]) == p.area
        assert (int(row["bbox_y0"]), int(row["bbox_x0"]), int(row["bbox_y1"]), int(row["bbox_x1"])) == p.bbox
        assert float(row["centroid_y"]) == pytest.approx(p.centroid[0], abs=1e-3)
        assert float(row["score"]) == pytest.approx(p.label / 1000)
    # 3D table has z columns
    vol = np.zeros((4, 10, 10), np.uint8)
    vol[1:3, 2:5, 2:5] = 7
    t = tables.object_table(vol)
    assert t["label"].tolist() == [7] and t["area"].tolist() == [18] and t["bbox_z1"].tolist() == [3]


def test_remove_temp_files(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / (label_files.TEMP_PREFIX + "x.tif.abc.tmp")).write_bytes(b"partial")
    (tmp_path / "keep.tif").write_bytes(b"x")
    assert label_files.remove_temp_files(tmp_path) == 1
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == ["keep.tif"]


def test_temp_cleanup_can_spare_other_jobs_files(tmp_path):
    mine = label_files.TEMP_PREFIX + "a_labels.tif.1a2b3c4d.tmp"
    other = label_files.TEMP_PREFIX + "b_labels.tif.5e6f7a8b.tmp"
    for name in (mine, other):
        (tmp_path / name).write_bytes(b"partial")
    assert label_files.temp_target(tmp_path / mine) == tmp_path / "a_labels.tif"
    assert label_files.remove_temp_files(tmp_path, targets=[tmp_path / "a_labels.tif"]) == 1
    assert [p.name for p in tmp_path.iterdir()] == [other]
