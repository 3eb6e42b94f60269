"""Hostile inputs, second round: file names that are not valid UTF-8, channel axes, files
with several image series, label images with huge or uint64 ids, non-integer labels for
fine-tuning, malformed box CSVs (a doubled column, ``1_0``), duplicate and one-pixel boxes,
and the shape column of skipped rows.

Each test states what a user gets: a clear message and nothing lost.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tifffile

from napari_gpuseg.engine.box_files import BoxFileError, read_csv_boxes, read_label_boxes

REAL = "IXMtest_N11_s4.tif"


@pytest.fixture
def field(shared_data) -> np.ndarray:
    """A 128 x 128 uint16 piece of a BBBC039 field with 7 nuclei."""
    return tifffile.imread(shared_data / "bbbc039" / "images" / REAL)[:128, :128]


def _run(in_dir, out_dir, method="threshold", **options):
    from napari_gpuseg.engine.jobs.pipeline import run_folder

    return run_folder(in_dir, out_dir, method, io_workers=1, image_batch=2,
                      method_options=options or None)


# ----------------------------------------------------------------------------- 1: names
def test_file_name_not_valid_utf8_gets_a_report(tmp_path, field):
    from napari_gpuseg.cli.batch import main

    in_dir, out_dir = tmp_path / "in", tmp_path / "out"
    in_dir.mkdir()
    bad = os.fsdecode(os.fsencode(str(in_dir)) + b"/bad\xff\xfeutf8.tif")
    tifffile.imwrite(bad, field)
    tifffile.imwrite(in_dir / "good.tif", field)
    for run in (1, 2):  # a rerun finishes as well, and skips both
        assert main([str(in_dir), str(out_dir), "--quiet", "--method", "threshold"]) == 0
        text = (out_dir / "report.csv").read_text(encoding="utf-8")
        assert "bad\\xff\\xfeutf8.tif" in text and "good.tif" in text
        assert text.count("skipped" if run == 2 else ",ok,") == 2
        assert len(text.splitlines()) == 3  # one row per file: the rerun matched the escaped name
    assert (out_dir / "report.json").is_file()
    assert os.path.isfile(os.fsdecode(os.fsencode(str(out_dir)) + b"/bad\xff\xfeutf8_labels.tif"))


# ----------------------------------------------------------------------------- 2: channels
def _channel_folder(folder, gray: np.ndarray) -> None:
    """The same nuclei as channel 1 of YXC files with 2, 3 and 4 channels and of CYX files;
    the other channels hold noise."""
    rng = np.random.default_rng(0)

    def noise():
        return rng.integers(0, 200, gray.shape).astype(gray.dtype)

    folder.mkdir()
    tifffile.imwrite(folder / "gray.tif", gray)
    tifffile.imwrite(folder / "yxc2.tif", np.stack([noise(), gray], -1))
    tifffile.imwrite(folder / "yxc3.tif", np.stack([noise(), gray, noise()], -1))  # RGB
    tifffile.imwrite(folder / "yxc4.tif", np.stack([noise(), gray, noise(), noise()], -1))
    tifffile.imwrite(folder / "cyx2.tif", np.stack([noise(), gray]), metadata={"axes": "CYX"})
    tifffile.imwrite(folder / "cyx3.tif", np.stack([noise(), gray, noise()]), imagej=True,
                     metadata={"axes": "CYX"})


def test_channel_axes_are_recognised(tmp_path, field):
    from napari_gpuseg import io as gio

    _channel_folder(tmp_path / "in", field)
    expect = {"gray.tif": (0, False), "yxc2.tif": (2, False), "yxc3.tif": (0, True),
              "yxc4.tif": (4, False), "cyx2.tif": (2, False), "cyx3.tif": (3, False)}
    for name, (channels, rgb) in expect.items():
        loaded = gio.load_image(tmp_path / "in" / name)
        assert (loaded.channels, loaded.rgb) == (channels, rgb), name
        assert loaded.data.shape[:2] == (128, 128), name  # never 128 planes of 128 x C
        np.testing.assert_array_equal(gio.read_image(tmp_path / "in" / name, channel=0 if name == "gray.tif" else 1),
                                      field)
    with pytest.raises(gio.ChannelError, match=r"2 channels .*channel=N \(0\.\.1\)"):
        gio.read_image(tmp_path / "in" / "yxc2.tif")
    with pytest.raises(gio.ChannelError, match=r"channel 5 does not exist: the image has 3"):
        gio.read_image(tmp_path / "in" / "cyx3.tif", channel=5)
    # a real RGBA image (constant alpha) stays colour, alpha dropped
    rgba = np.stack([field, field, field, np.full_like(field, 65535)], -1)
    tifffile.imwrite(tmp_path / "rgba.tif", rgba)
    loaded = gio.load_image(tmp_path / "rgba.tif")
    assert loaded.rgb and loaded.data.shape == (128, 128, 3) and "alpha channel dropped" in loaded.notes


@pytest.mark.parametrize("method", ["threshold", "unet", "sam-boxes", "sam-everything"])
@pytest.mark.usefixtures("reuse_embeddings")
def test_each_method_on_channel_images(tmp_path, field, method):
    """Without ``channel`` a multichannel file is an error row that says how to choose one
    (RGB stays colour); with ``channel=1`` every layout gives the gray image's labels."""
    from sam_fixtures import require_lite_medsam

    options = {}
    if method.startswith("sam"):
        options["model"] = str(require_lite_medsam())
    if method == "sam-everything":
        options["points_per_side"] = 4
    in_dir = tmp_path / "in"
    _channel_folder(in_dir, field)
    report = _run(in_dir, tmp_path / "picked", method, channel=1, **options)
    picked = {r.file: r for r in report.rows}
    report = _run(in_dir, tmp_path / "plain", method, **options)
    rows = {r.file: r for r in report.rows}
    assert rows["gray.tif"].status == "ok" and rows["yxc3.tif"].status == "ok"  # colour
    for name in ("yxc2.tif", "yxc4.tif", "cyx2.tif", "cyx3.tif"):
        assert rows[name].status == "error", name
        assert "channels" in rows[name].error and "--set channel=" in rows[name].error
        assert not (tmp_path / "plain" / name.replace(".tif", "_labels.tif")).exists()
    assert "linked across slices" not in " ".join(r.notes for r in report.rows)

    assert picked["gray.tif"].status == "error" and "has 1 channel" in picked["gray.tif"].error
    reference = tifffile.imread(tmp_path / "plain" / "gray_labels.tif")
    assert reference.max() > 0
    for name in ("yxc2.tif", "yxc3.tif", "yxc4.tif", "cyx2.tif", "cyx3.tif"):
        assert picked[name].status == "ok", (name, picked[name].error)
        assert "channel 1 of" in picked[name].notes
        labels = tifffile.imread(tmp_path / "picked" / name.replace(".tif", "_labels.tif"))
        assert labels.shape == (128, 128), name
        np.testing.assert_array_equal(labels, reference, err_msg=name)


def test_channel_option_is_checked_before_any_work(tmp_path):
    from napari_gpuseg.cli.batch import main

    (tmp_path / "in").mkdir()
    assert main([str(tmp_path / "in"), str(tmp_path / "out"), "--set", "channel=-1", "--quiet", "--method", "threshold"]) == 2
    assert main([str(tmp_path / "in"), str(tmp_path / "out"), "--set", "channel=red", "--quiet", "--method", "threshold"]) == 2
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- 4: series
def test_multi_series_tiff_note_names_the_series_not_read(tmp_path, field):
    (tmp_path / "in").mkdir()
    with tifffile.TiffWriter(tmp_path / "in" / "two.tif") as tw:
        tw.write(field)
        tw.write(field[:64, :96])
    report = _run(tmp_path / "in", tmp_path / "out")
    (row,) = report.rows
    assert row.status == "ok" and row.objects > 0
    assert "2 image series" in row.notes and "series 1 (64x96 uint16) not" in row.notes


# ----------------------------------------------------------------------------- 5, 6: label ids
def test_label_boxes_with_a_huge_id_need_no_memory_per_id(tmp_path):
    """One object with id 4,000,000,000 in a 128 x 128 uint32 label image, read under a
    2 GiB address-space limit (one slot per id value would need tens of GiB)."""
    labels = np.zeros((128, 128), np.uint32)
    labels[10:20, 30:50] = 4_000_000_000
    labels[60:70, 5:9] = 7
    tifffile.imwrite(tmp_path / "a_labels.tif", labels)
    code = textwrap.dedent(f"""
        import resource
        import numpy as np
        from napari_gpuseg.engine.box_files import read_label_boxes
        resource.setrlimit(resource.RLIMIT_AS, (2 * 2**30, 2 * 2**30))
        (boxes,) = read_label_boxes({str(tmp_path / "a_labels.tif")!r}, (128, 128))
        assert boxes.tolist() == [[5, 60, 9, 70], [30, 10, 50, 20]], boxes.tolist()
        print("ok")
    """)
    env = {**os.environ, "NAPARI_GPUSEG_MALLOC": "0", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


def test_uint64_ids_above_2_63_keep_their_objects(tmp_path):
    from napari_gpuseg.engine.detect import boxes_from_labels

    labels = np.zeros((64, 64), np.uint64)
    ids = [1, 2, 3, 2**32 + 1, 2**62, 2**63 - 1, 2**63, 2**64 - 1]
    for k, i in enumerate(ids):
        labels[k * 8:k * 8 + 4, k * 8:k * 8 + 5] = i
    tifffile.imwrite(tmp_path / "a_labels.tif", labels)
    (boxes,) = read_label_boxes(tmp_path / "a_labels.tif", (64, 64))
    expected = [[k * 8, k * 8, k * 8 + 5, k * 8 + 4] for k in range(8)]  # in id order
    assert boxes.tolist() == expected
    assert boxes_from_labels(labels).tolist() == expected


# ----------------------------------------------------------------------------- 7: fine-tuning
def test_finetune_refuses_non_integer_labels(field, tmp_path):
    from napari_gpuseg.engine.unet.finetune_annotated import finetune_unet
    from napari_gpuseg.engine.unet.training import TrainConfig

    labels = np.zeros(field.shape, np.int32)
    labels[20:40, 20:40] = 1
    quick = TrainConfig(crop_size=64, batch_size=1, epochs=1, iters_per_epoch=1, max_time_s=30.0)
    for bad, why in [(labels.astype(np.float32) + 0.5, "non-integer values such as 0.5"),
                     (np.where(labels > 0, np.nan, 0.0), "NaN"),
                     (labels - 1, "negative values")]:
        with pytest.raises(ValueError, match=why):
            finetune_unet(field, bad, config=quick, out_path=tmp_path / "x.pt")
    assert not (tmp_path / "x.pt").exists()


def test_finetune_label_ids_and_inverted_rectangles(field):
    from napari_gpuseg.engine.unet.finetune_annotated import check_labels, region_mask

    labels = np.zeros(field.shape, np.int32)
    labels[20:40, 20:40] = 1
    # whole-number float labels and uint64 ids >= 2**63 are label images
    np.testing.assert_array_equal(check_labels(labels.astype(np.float32)), labels)
    huge = np.where(labels > 0, np.uint64(2**63 + 3), np.uint64(0))
    np.testing.assert_array_equal(check_labels(huge), labels)
    # an inverted rectangle (corners given the other way round) is the same region
    np.testing.assert_array_equal(region_mask(field.shape, "rectangle", rectangle=(90, 80, 10, 20)),
                                  region_mask(field.shape, "rectangle", rectangle=(10, 20, 90, 80)))


# ----------------------------------------------------------------------------- 9 and CSV cases
def test_box_csv_with_a_doubled_column_names_it(tmp_path):
    p = tmp_path / "a.csv"
    p.write_text("x0,x0,y0,x1,y1\n1,2,3,10,12\n")
    with pytest.raises(BoxFileError, match=r"a\.csv, line 1: column x0 appears more than once"):
        read_csv_boxes(p, (40, 50))
    p.write_text("x0,y0,x1,y1,z,frame\n1,3,10,12,0,0\n")
    with pytest.raises(BoxFileError, match=r"two plane columns \(z, frame\)"):
        read_csv_boxes(p, (2, 40, 50))
    p.write_text("x0,y0,x1,y1,label,label\n1,3,10,12,5,6\n")  # ignored columns may repeat
    assert read_csv_boxes(p, (40, 50))[0].tolist() == [[1, 3, 10, 12]]


@pytest.mark.parametrize("value", ["1_0", "0x10", "nan", "\u0661\u0660"],
                         ids=["underscore", "hex", "nan", "arabic-digits"])
def test_box_csv_numbers_are_plain_decimals(tmp_path, value):
    p = tmp_path / "a.csv"
    p.write_text(f"x0,y0,x1,y1\n2,3,{value},12\n")
    with pytest.raises(BoxFileError, match="line 2: not a number"):
        read_csv_boxes(p, (40, 50))


def test_duplicate_boxes_are_dropped_and_counted(tmp_path):
    p = tmp_path / "a.csv"
    p.write_text("x0,y0,x1,y1,z\n" + "2,3,10,12,0\n" * 2000 + "2,3,10,12,1\n4,4,9,9,0\n")
    planes = read_csv_boxes(p, (2, 40, 50))
    assert [b.tolist() for b in planes] == [[[2, 3, 10, 12], [4, 4, 9, 9]], [[2, 3, 10, 12]]]
    assert planes.notes == "1999 duplicate box(es) dropped (exact copies of an earlier line of a.csv)"


@pytest.mark.usefixtures("reuse_embeddings")
def test_box_files_in_a_folder_job(tmp_path, field):
    """Real LiteMedSAM run: a doubled column and ``1_0`` are error rows naming them; 200
    copies of one box give one object and a note; a one-pixel box gives a note."""
    from sam_fixtures import require_lite_medsam

    from napari_gpuseg.engine.detect import boxes_from_labels
    from napari_gpuseg.engine.classical import classical_segment

    model = str(require_lite_medsam())
    in_dir, box_dir = tmp_path / "in", tmp_path / "boxes"
    in_dir.mkdir()
    box_dir.mkdir()
    for name in ("doubled", "underscore", "copies", "tiny"):
        tifffile.imwrite(in_dir / f"{name}.tif", field)
    box = boxes_from_labels(classical_segment(field))[0].astype(int)
    line = ",".join(map(str, box))
    (box_dir / "doubled.csv").write_text(f"x0,x0,y0,x1,y1\n1,{line}\n")
    (box_dir / "underscore.csv").write_text("x0,y0,x1,y1\n1_0,1_0,3_0,3_0\n")
    (box_dir / "copies.csv").write_text("x0,y0,x1,y1\n" + f"{line}\n" * 200)
    (box_dir / "tiny.csv").write_text(f"x0,y0,x1,y1\n{line}\n100,100,101,101\n")
    report = _run(in_dir, tmp_path / "out", "sam-boxes", model=model, boxes=str(box_dir))
    rows = {r.file: r for r in report.rows}
    assert rows["doubled.tif"].status == "error"
    assert "doubled.csv, line 1: column x0 appears more than once" in rows["doubled.tif"].error
    assert rows["underscore.tif"].status == "error" and "underscore.csv, line 2: not a number" in rows[
        "underscore.tif"].error
    assert rows["copies.tif"].status == "ok" and rows["copies.tif"].objects == 1
    assert "199 duplicate box(es) dropped" in rows["copies.tif"].notes
    assert rows["tiny.tif"].status == "ok" and rows["tiny.tif"].objects == 1
    assert "1 of 2 given box(es) gave no object, e.g. 100,100,101,101 (1 x 1 px)" in rows["tiny.tif"].notes


# ----------------------------------------------------------------------------- skipped rows
def test_skipped_rows_keep_their_shape_without_an_earlier_row(tmp_path, field):
    (tmp_path / "in").mkdir()
    tifffile.imwrite(tmp_path / "in" / "a.tif", field)
    first = _run(tmp_path / "in", tmp_path / "out")
    assert first.rows[0].shape == "128x128 uint16"
    (tmp_path / "out" / "report.json").unlink()  # the earlier report lost (or another shard's)
    (row,) = _run(tmp_path / "in", tmp_path / "out").rows
    assert row.status == "skipped" and row.shape == "128x128 uint16"
