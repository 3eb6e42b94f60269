"""Boxes from files in folder jobs: ``sam-boxes`` with ``--set boxes=DIR``.

Reading box files (CSV with and without a header, a z column for stacks, label images, a
missing, doubled and malformed file), the option checked before any work, and one real run
through :func:`run_folder` with LiteMedSAM on two BBBC039 fields cut to 256 x 256, boxes
from their ground-truth masks written as CSV for one image and as ``_labels.tif`` for the
other, a 3-plane stack with boxes on one plane (a z column), an image without a box file
and one with a malformed file.
"""
from __future__ import annotations

import numpy as np
import pytest
import tifffile

from napari_gpuseg.engine.box_files import BoxFileError, boxes_for_image, find_box_file, read_csv_boxes
from napari_gpuseg.engine.jobs.method_registry import OptionError, create_method

from sam_fixtures import require_lite_medsam


def _csv(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_csv_with_and_without_header(tmp_path):
    plain = _csv(tmp_path, "a.csv", "2,1,12,9\n\n# a comment\n6.5, 5, 30, 25\n")
    (boxes,) = read_csv_boxes(plain, (40, 50))
    np.testing.assert_array_equal(boxes, [[2, 1, 12, 9], [6.5, 5, 30, 25]])
    # header: any column order, other columns ignored, case-insensitive, BOM tolerated
    head = tmp_path / "b.csv"
    head.write_text("\ufeffLabel,Y0,x0,y1,X1,score\n7,1,2,9,12,0.9\n", encoding="utf-8")
    np.testing.assert_array_equal(read_csv_boxes(head, (40, 50))[0], [[2, 1, 12, 9]])
    empty = _csv(tmp_path, "c.csv", "x0,y0,x1,y1\n")  # no boxes: no objects
    assert read_csv_boxes(empty, (40, 50))[0].shape == (0, 4)


def test_csv_stack_with_z_column(tmp_path):
    head = _csv(tmp_path, "s.csv", "x0,y0,x1,y1,z\n2,1,12,9,0\n6,5,30,25,2\n0,0,4,4,2\n")
    planes = read_csv_boxes(head, (3, 40, 50))
    assert [len(p) for p in planes] == [1, 0, 2]
    np.testing.assert_array_equal(planes[2], [[6, 5, 30, 25], [0, 0, 4, 4]])
    frame = _csv(tmp_path, "f.csv", "frame,x0,y0,x1,y1\n1,2,1,12,9\n")
    assert [len(p) for p in read_csv_boxes(frame, (2, 40, 50))] == [0, 1]
    plain = _csv(tmp_path, "p.csv", "2,1,12,9,1\n")  # no header: the plane is the 5th value
    assert [len(p) for p in read_csv_boxes(plain, (2, 40, 50))] == [0, 1]
    with pytest.raises(BoxFileError, match=r"p\.csv, line 1: plane 1 does not exist .*planes 0\.\.0"):
        read_csv_boxes(plain, (1, 40, 50))
    with pytest.raises(BoxFileError, match="line 1: .*image is 2D"):
        read_csv_boxes(plain, (40, 50))
    no_z = _csv(tmp_path, "n.csv", "2,1,12,9\n")
    with pytest.raises(BoxFileError, match="line 1: no z/frame column, but the image is a stack of 3"):
        read_csv_boxes(no_z, (3, 40, 50))


@pytest.mark.parametrize("text, line, why", [
    ("2,1,12,9\n3,4,x,9\n", 2, "not a number"),
    ("2,1,12,9\n3,4,5\n", 2, "3 values where the first line has 4"),
    ("2,1,12\n", 1, "3 values; expected"),
    ("x,y,w,h\n1,2,3,4\n", 1, "missing x0, y0, x1, y1"),
    ("x0,y0,x1,y1\n12,1,2,9\n", 2, "empty or reversed box"),
    ("2,1,12,9\n60,1,70,9\n", 2, "outside the image"),
    ("2,1,nan,9\n", 1, "not a number"),
])
def test_malformed_csv_names_file_and_line(tmp_path, text, line, why):
    path = _csv(tmp_path, "bad.csv", text)
    with pytest.raises(BoxFileError, match=f"bad.csv, line {line}: .*{why}") as info:
        read_csv_boxes(path, (40, 50))
    assert str(path) in str(info.value)


def test_label_images_missing_and_doubled_files(tmp_path):
    lab = np.zeros((2, 20, 30), np.uint16)
    lab[0, 2:5, 3:9] = 1
    lab[1, 10:20, 25:30] = 4
    lab[1, 0:2, 0:2] = 1  # one id on two planes: a box on each
    tifffile.imwrite(tmp_path / "vol_labels.tif", lab)
    planes = boxes_for_image(tmp_path, "vol.ome.tif", (2, 20, 30))
    np.testing.assert_array_equal(planes[0], [[3, 2, 9, 5]])
    np.testing.assert_array_equal(planes[1], [[0, 0, 2, 2], [25, 10, 30, 20]])
    with pytest.raises(BoxFileError, match=r"vol_labels\.tif: label image of shape \(2, 20, 30\) for an image of shape \(20, 30\)"):
        boxes_for_image(tmp_path, "vol.tif", (20, 30))
    tifffile.imwrite(tmp_path / "f_labels.tif", np.full((20, 30), 0.5, np.float32))
    with pytest.raises(BoxFileError, match="not a label image"):
        boxes_for_image(tmp_path, "f.tif", (20, 30))
    # subfolders of the input folder are subfolders of the box folder
    (tmp_path / "sub").mkdir()
    _csv(tmp_path / "sub", "a.csv", "2,1,12,9\n")
    assert find_box_file(tmp_path, "sub/a.tif") == tmp_path / "sub" / "a.csv"
    with pytest.raises(BoxFileError, match=r"no box file for this image: neither .*a\.csv nor .*a_labels\.tif"):
        find_box_file(tmp_path, "a.tif")
    tifffile.imwrite(tmp_path / "sub" / "a_labels.tif", lab[0])
    with pytest.raises(BoxFileError, match="two box files"):
        find_box_file(tmp_path, "sub/a.tif")


def test_boxes_option_checked_before_any_work(tmp_path):
    with pytest.raises(OptionError, match="option boxes=.* must be an existing folder"):
        create_method("sam-boxes", boxes=str(tmp_path / "nowhere"))
    with pytest.raises(OptionError, match="either boxes .* or a detector"):
        create_method("sam-boxes", boxes=str(tmp_path), detector="threshold")
    with pytest.raises(OptionError, match="unknown option"):
        create_method("unet", boxes=str(tmp_path))
    seg = create_method("sam-boxes", boxes=str(tmp_path))  # constructing loads nothing
    assert seg.engine is None


def test_cli_refuses_a_missing_box_folder(tmp_path, capsys):
    from napari_gpuseg.cli.main import main

    (tmp_path / "in").mkdir()
    code = main(["batch", str(tmp_path / "in"), str(tmp_path / "out"), "--method", "sam-boxes",
                 "--set", f"boxes={tmp_path / 'nowhere'}"])
    assert code == 2
    assert "must be an existing folder" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # refused before any work


@pytest.mark.usefixtures("reuse_embeddings")
def test_run_folder_with_box_files(tmp_path, shared_data):
    """Real LiteMedSAM run: ground-truth boxes as CSV and as a label image give the
    ground-truth objects back; no box file and a malformed one are error rows."""
    from napari_gpuseg.engine.metrics import summary
    from napari_gpuseg.engine.jobs.pipeline import run_folder
    from napari_gpuseg.engine.detect import boxes_from_labels

    model = str(require_lite_medsam())
    files = sorted((shared_data / "bbbc039" / "images").glob("*.tif"))[-2:]
    crop = (slice(100, 356), slice(200, 456))
    in_dir, box_dir, out_dir = tmp_path / "in", tmp_path / "boxes", tmp_path / "out"
    in_dir.mkdir()
    box_dir.mkdir()
    gts = {}
    for name, f in zip(("csv", "tif"), files):
        tifffile.imwrite(in_dir / f"{name}.tif", tifffile.imread(f)[crop])
        gts[name] = tifffile.imread(shared_data / "bbbc039" / "masks" / f.name)[crop]
    b = boxes_from_labels(gts["csv"]).astype(int)
    (box_dir / "csv.csv").write_text("x0,y0,x1,y1\n" + "".join(f"{r[0]},{r[1]},{r[2]},{r[3]}\n" for r in b))
    tifffile.imwrite(box_dir / "tif_labels.tif", gts["tif"])
    # a stack: boxes on its middle plane only (a z column), the other planes stay empty
    piece, gt_piece = tifffile.imread(in_dir / "csv.tif")[:64, :64], gts["csv"][:64, :64]
    tifffile.imwrite(in_dir / "stack.tif", np.stack([np.zeros_like(piece), piece, np.zeros_like(piece)]))
    b = boxes_from_labels(gt_piece).astype(int)
    (box_dir / "stack.csv").write_text("".join(f"{r[0]},{r[1]},{r[2]},{r[3]},1\n" for r in b))
    tifffile.imwrite(in_dir / "nobox.tif", np.zeros((64, 64), np.uint16))
    tifffile.imwrite(in_dir / "bad.tif", np.zeros((64, 64), np.uint16))
    (box_dir / "bad.csv").write_text("x0,y0,x1,y1\n1,2,10,12\n1,2,ten,12\n")

    report = run_folder(in_dir, out_dir, "sam-boxes", image_batch=2, io_workers=1,
                        method_options={"model": model, "boxes": str(box_dir)})
    rows = {r.file: r for r in report.rows}
    assert rows["nobox.tif"].status == "error"
    assert "no box file for this image" in rows["nobox.tif"].error
    assert "nobox.csv" in rows["nobox.tif"].error and "nobox_labels.tif" in rows["nobox.tif"].error
    assert rows["bad.tif"].status == "error"
    assert "bad.csv, line 3: not a number" in rows["bad.tif"].error
    assert rows["stack.tif"].status == "ok", rows["stack.tif"].error
    stack = tifffile.imread(out_dir / "stack_labels.tif")
    assert stack.shape == (3, 64, 64) and not stack[0].any() and not stack[2].any()
    assert summary(gt_piece, stack[1])["f1@0.5"] > 0.8
    for name in ("csv", "tif"):
        row = rows[f"{name}.tif"]
        assert row.status == "ok", row.error
        gt = gts[name]
        labels = tifffile.imread(out_dir / f"{name}_labels.tif")
        assert row.objects == len(np.unique(gt)) - 1  # one object per box
        assert summary(gt, labels)["f1@0.5"] > 0.9


def test_dock_box_files_field(qtbot, tmp_path, monkeypatch):
    """The Batch folder dock's Box files field becomes the ``boxes`` option of the run;
    a missing folder is refused before any work, in one line."""
    from napari_gpuseg.widgets import batch_folder

    w = batch_folder.BatchFolderWidget(None)
    qtbot.addWidget(w)
    (tmp_path / "in").mkdir()
    w.in_dir.setText(str(tmp_path / "in"))
    w.out_dir.setText(str(tmp_path / "out"))
    w.method.setCurrentText("sam-boxes")
    w.boxes.setText(str(tmp_path / "nowhere"))
    w.start()
    qtbot.waitUntil(lambda: w.error is not None, timeout=30000)
    assert "option boxes=" in w.error and "must be an existing folder" in w.error
    assert not (tmp_path / "out").exists()

    seen = {}

    def fake_run(in_dir, out_dir, **kwargs):
        seen.update(kwargs)
        raise RuntimeError("not run")

    monkeypatch.setattr(batch_folder, "run_folder", fake_run)
    w.boxes.setText(f" {tmp_path} ")
    w.error = None
    w.start()
    qtbot.waitUntil(lambda: w.error is not None, timeout=30000)
    assert seen["method"] == "sam-boxes" and seen["method_options"]["boxes"] == str(tmp_path)


def test_one_csv_reader_for_the_dock_and_folder_jobs(tmp_path):
    """The dock's reader (boxes_for_planes) and folder jobs (read_csv_boxes) share one
    module and one policy: the same checks, the same file/line message for a bad line."""
    from napari_gpuseg.engine.box_files import boxes_for_planes

    plain = _csv(tmp_path, "s.csv", "# x0,y0,x1,y1,z\n2,1,12,9,0\n6,5,30,25,2\n0,0,4,4,2\n")
    planes = read_csv_boxes(plain, (3, 40, 50))
    got = boxes_for_planes(plain, (3,), (40, 50), [(0,), (1,), (2,)])
    for z in range(3):
        assert got[z].dtype == np.float64
        np.testing.assert_array_equal(got[z], planes[z].reshape(-1, 4))
    assert [len(b) for b in got] == [1, 0, 2]
    bad = _csv(tmp_path, "bad.csv", "2,1,12,9\n3,4,x,9\n")
    with pytest.raises(BoxFileError, match=r"bad\.csv, line 2: not a number") as dock:
        boxes_for_planes(bad, (), (40, 50), [()])
    with pytest.raises(BoxFileError) as job:
        read_csv_boxes(bad, (40, 50))
    assert str(dock.value) == str(job.value)
    outside = _csv(tmp_path, "out.csv", "2,1,12,9\n60,1,70,9\n")  # the dock checks geometry too
    with pytest.raises(BoxFileError, match=r"out\.csv, line 2: box outside the image \(50 x 40 px\)"):
        boxes_for_planes(outside, (), (40, 50), [()])


def test_dock_reader_on_tzyx_stacks(tmp_path):
    """A TZYX stack numbers its planes in C order (plane = t * Z + z): each plane gets its
    own boxes, never every box of the file; a plane that does not exist is an error; a file
    without a plane column serves the one plane on screen, and is an error for a stack."""
    from napari_gpuseg.engine.box_files import boxes_for_planes

    path = _csv(tmp_path, "tz.csv", "x0,y0,x1,y1,plane\n1,1,5,5,0\n2,2,8,8,3\n3,3,9,9,5\n")
    lead = (2, 3)  # T = 2, Z = 3
    idx = [(t, z) for t in range(2) for z in range(3)]
    got = boxes_for_planes(path, lead, (40, 50), idx)
    assert [b.tolist() for b in got] == [[[1, 1, 5, 5]], [], [], [[2, 2, 8, 8]], [], [[3, 3, 9, 9]]]
    assert boxes_for_planes(path, lead, (40, 50), [(1, 0)])[0].tolist() == [[2, 2, 8, 8]]
    with pytest.raises(BoxFileError, match=r"line 4: plane 5 does not exist .*planes 0\.\.3"):
        boxes_for_planes(path, (2, 2), (40, 50), [(0, 0)])
    flat = _csv(tmp_path, "flat.csv", "1,1,5,5\n2,2,8,8\n")
    on_screen = boxes_for_planes(flat, lead, (40, 50), [(1, 2)])
    assert [b.tolist() for b in on_screen] == [[[1, 1, 5, 5], [2, 2, 8, 8]]]
    with pytest.raises(BoxFileError, match="no z/frame column, but the image is a stack of 6 planes"):
        boxes_for_planes(flat, lead, (40, 50), idx)
