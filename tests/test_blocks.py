"""Big images in blocks: plan, seam stitching, OME-Zarr labels, table, resume, against
the whole image segmented in one piece (real BBBC039 fields, synthetic 3D nuclei)."""
import json

import numpy as np
import pytest

zarr = pytest.importorskip("zarr")

from napari_gpuseg.io import tables  # noqa: E402
from napari_gpuseg.engine.blocks import ArraySource, BlockRunError, plan_blocks, run_blocks  # noqa: E402
from napari_gpuseg.engine.blocks.check import seam_splits  # noqa: E402
from napari_gpuseg.engine.blocks.stitch import global_ids, match_objects  # noqa: E402
from napari_gpuseg.engine.classical import classical_segment  # noqa: E402
from napari_gpuseg.engine.metrics import object_f1  # noqa: E402
from napari_gpuseg.engine.runtime.cancel import CancelToken  # noqa: E402
from napari_gpuseg.io.zarr_images import open_zarr  # noqa: E402

from zarr_inputs import field_files, volume_zarr, write_mosaic  # noqa: E402

pytestmark = pytest.mark.timeout(180)
ALL = (slice(None), slice(None))


@pytest.fixture(scope="module")
def mosaic(shared_data, tmp_path_factory):
    """2 x 2 real fields: 1040 x 1392 uint16 OME-Zarr."""
    files = field_files(shared_data / "bbbc039" / "images")[:4]
    return write_mosaic(files, tmp_path_factory.mktemp("m") / "m.ome.zarr", (1040, 1392), chunks=256)


def test_plan_covers_the_image_once_with_halo_context():
    plan = plan_blocks((1040, 1392), 512, 64)
    cover = np.zeros(plan.shape, int)
    for b in plan.blocks:
        cover[b.core_slices()] += 1
        for (c0, c1), (e0, e1), s in zip(b.core, b.ext, plan.shape):
            assert e0 == max(0, c0 - 64) and e1 == min(s, c1 + 64)
    assert (cover == 1).all() and plan.grid_shape == (3, 3)
    assert len(plan.seams()) == 2 * 3 + 3 * 2
    with pytest.raises(ValueError, match="halo"):
        plan_blocks((1040, 1392), 64, 64)


def test_match_objects_and_global_ids():
    a = np.array([[1, 1, 0, 2, 2]])
    b = np.array([[5, 5, 0, 0, 7]])  # 5 is a's 1; 7 covers half of a's 2: the smaller's share counts
    assert match_objects(a, b).tolist() == [[1, 5], [2, 7]]
    luts, n = global_ids([2, 7], [np.array([1, 2]), np.array([5, 7, 3])], [(0, 1, np.array([[1, 5]]))])
    assert n == 4 and luts[0][1] == luts[1][5] == 1 and len({luts[0][2], luts[1][7], luts[1][3]}) == 3


def test_threshold_blocks_equal_the_whole_image(mosaic, tmp_path):
    img = open_zarr(mosaic)
    rep = run_blocks(img, tmp_path, "threshold", block=512, halo=64)
    lab = zarr.open_array(str(mosaic), path="labels/threshold/0")[:]
    whole = classical_segment(img.read(ALL))
    plan = plan_blocks(img.shape, 512, 64)
    assert rep.objects == int(whole.max()) == len(np.unique(lab)) - 1 > 300
    assert object_f1(whole, lab) >= 0.99
    assert seam_splits(whole, lab, plan) == 0 and rep.seam_merges > 0
    # the per-object table is the table of the stitched labels
    want = tables.object_table(lab)
    got = tables.read_csv(rep.table)
    assert [int(r["label"]) for r in got] == want["label"].tolist()
    assert [int(r["area"]) for r in got] == want["area"].tolist()
    assert np.allclose([float(r["centroid_x"]) for r in got], want["centroid_x"], atol=1e-3)
    assert [int(r["bbox_y1"]) for r in got] == want["bbox_y1"].tolist()
    # NGFF: the labels are listed in the input's labels/ group and point back at the image
    root = zarr.open_group(str(mosaic), mode="r")
    assert "threshold" in dict(root["labels"].attrs)["labels"]
    attrs = dict(root["labels/threshold"].attrs)
    assert attrs["image-label"]["source"]["image"] == "../../" and attrs["multiscales"][0]["datasets"][0]["path"] == "0"
    assert dict(root["labels/threshold/0"].attrs)["napari_gpuseg"]["complete"] is True
    assert not list(tmp_path.glob(".gpuseg-blocks-*"))  # the work folder is gone
    from ome_zarr.io import parse_url
    from ome_zarr.reader import Reader

    found = {n.metadata.get("name"): n.data[0].shape for n in Reader(parse_url(str(mosaic)))() if n.data}
    assert found["threshold"] == (1040, 1392)  # what napari-ome-zarr reads


def test_without_stitching_the_seams_split_objects(mosaic):
    """The check above can fail: ids per block with no seam matches split objects."""
    img = open_zarr(mosaic)
    plan = plan_blocks(img.shape, 512, 64)
    naive = np.zeros(img.shape, np.int64)
    for b in plan.blocks:
        part = classical_segment(img.read(b.core_slices()))
        naive[b.core_slices()] = np.where(part > 0, part + naive.max(), 0)
    assert seam_splits(classical_segment(img.read(ALL)), naive, plan) > 10


def test_unet_blocks_match_the_whole_image(shared_data, tmp_path):
    from napari_gpuseg.engine.unet.unet_checkpoint import load_unet
    from napari_gpuseg.engine.unet.predict import predict_labels

    files = field_files(shared_data / "bbbc039" / "images")[4:6]
    path = write_mosaic(files, tmp_path / "u.ome.zarr", (520, 1392), chunks=256, zarr_format=3)
    img = open_zarr(path)
    rep = run_blocks(img, tmp_path / "out", "unet", block=384, halo=64, device="cpu", precision="fp32")
    lab = zarr.open_array(str(path), path="labels/unet/0")[:]
    whole = predict_labels(load_unet(device="cpu"), img.read(ALL))
    assert rep.blocks == 8 and rep.objects > 100
    assert object_f1(whole, lab) >= 0.99
    assert seam_splits(whole, lab, plan_blocks(img.shape, 384, 64)) == 0


def test_zyx_volume_in_blocks(shared_data, tmp_path):
    path = volume_zarr(shared_data, tmp_path / "v.ome.zarr", reps=(2, 2, 2))
    img = open_zarr(path)
    assert img.spatial_names == ("z", "y", "x")
    rep = run_blocks(img, tmp_path / "out", "threshold", block=(32, 64, 64), halo=(16, 24, 24))
    lab = zarr.open_array(str(path), path="labels/threshold/0")[:]
    whole = classical_segment(img.read((slice(None),) * 3))
    assert rep.blocks == 2 * 2 * 2 and abs(rep.objects - int(whole.max())) <= 0.02 * whole.max() and rep.objects > 50
    assert object_f1(whole, lab) >= 0.99
    assert seam_splits(whole, lab, plan_blocks(img.shape, (32, 64, 64), (16, 24, 24))) == 0


def test_resume_redoes_only_missing_blocks(mosaic, tmp_path):
    img = open_zarr(mosaic)
    cancel = CancelToken()
    seen = []

    def stop_after_four(phase, done, total):
        seen.append(done)
        if phase == "segment" and done == 4:
            cancel.cancel()

    first = run_blocks(img, tmp_path, "threshold", block=512, halo=64, name="r", progress=stop_after_four,
                       cancel=cancel)
    assert first.cancelled and len(list(next(tmp_path.glob(".gpuseg-blocks-*")).glob("block*.npz"))) == 4
    again = run_blocks(img, tmp_path, "threshold", block=512, halo=64, name="r")
    assert again.resumed == 4 and not again.cancelled
    once = run_blocks(img, tmp_path / "fresh", "threshold", block=512, halo=64, name="r2")
    a = zarr.open_array(str(mosaic), path="labels/r/0")[:]
    b = zarr.open_array(str(mosaic), path="labels/r2/0")[:]
    np.testing.assert_array_equal(a, b)


def test_in_memory_dask_array_to_its_own_store(mosaic, tmp_path):
    da = pytest.importorskip("dask.array")
    img = open_zarr(mosaic)
    src = ArraySource(img.to_dask()[:520, :696])
    rep = run_blocks(src, tmp_path, "threshold", block=256, halo=32)
    lab = zarr.open_array(rep.labels, path="0")[:]
    whole = classical_segment(np.asarray(src.array))
    assert object_f1(whole, lab) >= 0.99 and isinstance(da.from_zarr(rep.labels, component="0"), da.Array)


def test_unwritable_output_and_unreadable_input_are_one_line(mosaic, tmp_path):
    img = open_zarr(mosaic)
    (tmp_path / "file").write_text("x")
    with pytest.raises(BlockRunError) as err:
        run_blocks(img, tmp_path / "file" / "out", "threshold", block=512)
    assert "\n" not in str(err.value) and "file" in str(err.value)
    broken = tmp_path / "broken.ome.zarr"
    import shutil

    shutil.copytree(mosaic, broken)
    shutil.rmtree(broken / "0")
    (broken / "0").mkdir()
    (broken / "0" / ".zarray").write_text(json.dumps({"bad": 1}))
    with pytest.raises(Exception) as err:
        run_blocks(open_zarr(broken), tmp_path / "o", "threshold", block=512)
    assert "\n" not in str(err.value)


def test_cli_segments_a_zarr_in_blocks(mosaic, tmp_path, capsys):
    from napari_gpuseg.cli.batch import main

    code = main([str(mosaic), str(tmp_path / "out"), "--block-size", "512", "--halo", "64", "--quiet", "--method", "threshold",
                 "--labels-to", "out", "--set", "min_size=30"])
    out = capsys.readouterr().out
    assert code == 0 and "objects in 9 blocks" in out
    lab = zarr.open_array(str(tmp_path / "out" / "m_labels.ome.zarr"), path="0")[:]
    assert lab.shape == (1040, 1392) and lab.max() > 300
    assert (tmp_path / "out" / "m_objects.csv").is_file()
    bad = tmp_path / "bad.zarr"
    g = zarr.open_group(str(bad), mode="w", zarr_format=2)
    g.create_array("a", shape=(8, 8), dtype="u2")
    g.create_array("b", shape=(8, 8), dtype="u2")
    assert main([str(bad), str(tmp_path / "o2"), "--quiet", "--method", "threshold"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("napari-gpuseg batch: bad.zarr: unsupported zarr layout")


def test_unet_on_a_zyx_volume_in_blocks_matches_the_volume_in_one_piece(shared_data, tmp_path):
    """The 2D U-Net on a volume normalises each slice on its own; blocks use the whole
    slice's scale (not the block's) and give the same 3D objects. 31 x 122 x 114 (the volume
    once in z, twice in y and x) in 2 x 2 x 2 blocks: seams along every axis."""
    from napari_gpuseg.engine.jobs.method_registry import method_factory
    from napari_gpuseg.engine.runtime.device import make_policy

    path = volume_zarr(shared_data, tmp_path / "v.ome.zarr", reps=(1, 2, 2))
    img = open_zarr(path)
    rep = run_blocks(img, tmp_path / "out", "unet", block=(16, 64, 64), halo=(4, 32, 32), device="cpu",
                     precision="fp32")
    lab = zarr.open_array(str(path), path="labels/unet/0")[:]
    seg = method_factory("unet")()
    seg.load(make_policy("cpu", "fp32"))
    whole = seg.segment([img.read((slice(None),) * 3)])[0].labels
    assert rep.blocks == 8 and rep.objects > 50
    assert object_f1(whole, lab) >= 0.99
    assert seam_splits(whole, lab, plan_blocks(img.shape, (16, 64, 64), (4, 32, 32))) == 0


def test_cli_segments_a_folder_of_zarr_stores(mosaic, shared_data, tmp_path, capsys):
    """A folder IN holding zarr stores: each store in blocks, one after another (and the
    folder's image files as usual); a store with a layout the reader cannot take gets one
    error line and the others are still segmented (exit code 1)."""
    import shutil

    from napari_gpuseg.cli.batch import main

    src = tmp_path / "in"
    (src / "plate2").mkdir(parents=True)
    shutil.copytree(mosaic, src / "a.ome.zarr")
    shutil.copytree(mosaic, src / "plate2" / "b.ome.zarr")
    bad = zarr.open_group(str(src / "c.zarr"), mode="w", zarr_format=2)
    bad.create_array("x", shape=(8, 8), dtype="u2")
    bad.create_array("y", shape=(8, 8), dtype="u2")
    out = tmp_path / "out"
    args = [str(src), str(out), "--block-size", "512", "--halo", "64", "--quiet", "--labels-to", "out",
            "--set", "min_size=30"]
    assert main(args) == 1  # c.zarr cannot be read: the run says so and goes on
    text = capsys.readouterr()
    assert "store 1/2: a.ome.zarr" in text.out and "store 2/2: c.zarr" in text.out  # not recursive
    err = [line for line in text.err.splitlines() if line.startswith("napari-gpuseg batch:")]
    assert len(err) == 1 and "c.zarr: unsupported zarr layout" in err[0]
    lab = zarr.open_array(str(out / "a_labels.ome.zarr"), path="0")[:]
    assert lab.shape == (1040, 1392) and lab.max() > 300
    assert not (out / "plate2").exists()

    assert main(args + ["--recursive"]) == 1  # subfolders too
    text = capsys.readouterr()
    assert "store 3/3: plate2/b.ome.zarr" in text.out
    b = zarr.open_array(str(out / "plate2" / "b_labels.ome.zarr"), path="0")[:]
    np.testing.assert_array_equal(b, lab)  # the same pixels give the same labels
    assert (out / "plate2" / "b_objects.csv").is_file()
