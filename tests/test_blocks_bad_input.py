"""Block runs on bad input: hand annotations never replaced, resume only of the same
pixels, NaN/inf pixels, block sizes, OME-Zarr label geometry, output names, two runs at
once, channels (small real BBBC039 fields)."""
import numpy as np
import pytest

zarr = pytest.importorskip("zarr")

from napari_gpuseg.engine.blocks import BlockRunError, run_blocks  # noqa: E402
from napari_gpuseg.io.zarr_images import open_zarr  # noqa: E402

from zarr_inputs import field_files, write_mosaic  # noqa: E402

pytestmark = pytest.mark.timeout(120)
FIELD = (520, 696)


@pytest.fixture(scope="module")
def files(shared_data):
    return field_files(shared_data / "bbbc039" / "images")


def _field(files, path, k=0, fmt=2):
    return write_mosaic(files[k:k + 1], path, FIELD, chunks=256, zarr_format=fmt)


@pytest.mark.parametrize("layout", ["block-chunks", "pyramid"])
def test_hand_annotations_in_the_input_are_never_replaced(files, tmp_path, layout):
    """Labels at labels/<method> that this program did not write: the run refuses in one
    line (with overwrite too), pixels and metadata are untouched."""
    from ome_zarr.writer import write_labels

    path = _field(files, tmp_path / "m.ome.zarr")
    root = zarr.open_group(str(path), mode="a")
    hand = np.zeros(FIELD, np.uint32)
    hand[10:50, 10:50] = 7
    if layout == "block-chunks":  # pixels were overwritten in place
        root.require_group("labels").attrs["labels"] = ["threshold"]
        root.require_group("labels/threshold").create_array("0", data=hand, chunks=(256, 256))
        level = "labels/threshold/0"
    else:  # the metadata was rewritten to a new array: the hand labels unreachable
        write_labels(hand, root, name="threshold", axes="yx", scale_factors=[])
        level = "labels/threshold/s0"
    grp = zarr.open_group(str(path), path="labels/threshold", mode="r")
    before = (dict(grp.attrs), sorted(grp.array_keys()))
    for overwrite in (False, True):
        with pytest.raises(BlockRunError) as err:
            run_blocks(open_zarr(path), tmp_path / "out", "threshold", block=256, halo=32, overwrite=overwrite)
        msg = str(err.value)
        assert "\n" not in msg and msg.startswith("not overwritten: labels/threshold in m.ome.zarr exists")
    np.testing.assert_array_equal(zarr.open_array(str(path), path=level)[:], hand)
    grp = zarr.open_group(str(path), path="labels/threshold", mode="r")
    assert (dict(grp.attrs), sorted(grp.array_keys())) == before
    # the same in the output folder: a labels store there that is not ours is kept
    zarr.create_array(str(tmp_path / "o2" / "m_labels.ome.zarr"), data=hand, zarr_format=2)
    with pytest.raises(BlockRunError, match="not overwritten: m_labels.ome.zarr exists"):
        run_blocks(open_zarr(path), tmp_path / "o2", "threshold", block=256, halo=32, into_input=False)
    np.testing.assert_array_equal(zarr.open_array(str(tmp_path / "o2" / "m_labels.ome.zarr"))[:], hand)
    # our own labels are redone as before
    rep = run_blocks(open_zarr(path), tmp_path / "o3", "threshold", block=256, halo=32, name="mine")
    again = run_blocks(open_zarr(path), tmp_path / "o3", "threshold", block=256, halo=32, name="mine")
    assert rep.objects == again.objects > 50


def _cancel_after(n):
    from napari_gpuseg.engine.runtime.cancel import CancelToken

    cancel = CancelToken()

    def progress(phase, done, total):
        if phase == "segment" and done == n:
            cancel.cancel()

    return cancel, progress


def test_resume_reuses_only_blocks_of_the_same_pixels(files, tmp_path):
    """A run stopped after 3 blocks, then the store's pixels rewritten (or another channel
    asked for): the rerun redoes every block and equals a clean run of the new pixels."""
    import tifffile

    path = _field(files, tmp_path / "mosaic.zarr", k=0)
    cancel, progress = _cancel_after(3)
    first = run_blocks(open_zarr(path), tmp_path / "out", "threshold", block=256, halo=32, into_input=False,
                       progress=progress, cancel=cancel)
    assert first.cancelled
    zarr.open_array(str(path), path="0", mode="r+")[:] = tifffile.imread(files[1])  # other pixels, same store
    rerun = run_blocks(open_zarr(path), tmp_path / "out", "threshold", block=256, halo=32, into_input=False)
    clean = run_blocks(open_zarr(path), tmp_path / "clean", "threshold", block=256, halo=32, into_input=False)
    assert rerun.resumed == 0 and rerun.objects == clean.objects
    np.testing.assert_array_equal(zarr.open_array(rerun.store, path=rerun.array_path)[:],
                                  zarr.open_array(clean.store, path=clean.array_path)[:])

    from ome_zarr.writer import write_image

    a, b = (tifffile.imread(f) for f in files[:2])
    two = tmp_path / "two.zarr"
    write_image(np.stack([a, b]), zarr.open_group(str(two), mode="w", zarr_format=2), axes="cyx",
                scale_factors=[])
    cancel, progress = _cancel_after(3)
    assert run_blocks(open_zarr(two, channel=0), tmp_path / "o2", "threshold", block=256, halo=32,
                      into_input=False, progress=progress, cancel=cancel).cancelled
    ch1 = run_blocks(open_zarr(two, channel=1), tmp_path / "o2", "threshold", block=256, halo=32, into_input=False)
    ref = run_blocks(open_zarr(two, channel=1), tmp_path / "o3", "threshold", block=256, halo=32, into_input=False)
    assert ch1.resumed == 0
    np.testing.assert_array_equal(zarr.open_array(ch1.store, path=ch1.array_path)[:],
                                  zarr.open_array(ref.store, path=ref.array_path)[:])
    # a plain rerun of unchanged pixels still resumes
    cancel, progress = _cancel_after(3)
    run_blocks(open_zarr(path), tmp_path / "o4", "threshold", block=256, halo=32, progress=progress, cancel=cancel)
    assert run_blocks(open_zarr(path), tmp_path / "o4", "threshold", block=256, halo=32).resumed == 3


def test_nan_and_inf_pixels_in_a_float_store_are_replaced_as_in_a_tiff(files, tmp_path):
    """A float32 field with a 20 x 20 NaN patch and one +inf pixel: the blocks get the
    pixels a TIFF job gets (NaN/inf -> the image minimum, with the same note) and the same
    objects; a store of NaN only is one line, as a folder job's error row."""
    import tifffile

    from napari_gpuseg.engine.classical import classical_segment
    from napari_gpuseg.engine.metrics import object_f1
    from napari_gpuseg.io import load_image

    img = tifffile.imread(files[0]).astype(np.float32)
    img[100:120, 300:320] = np.nan
    img[400, 50] = np.inf
    tifffile.imwrite(tmp_path / "f.tif", img)
    loaded = load_image(tmp_path / "f.tif")
    zarr.create_array(str(tmp_path / "f.zarr"), data=img, chunks=(256, 256), zarr_format=2)
    whole = classical_segment(loaded.data)
    for method in ("threshold", "unet"):
        rep = run_blocks(open_zarr(tmp_path / "f.zarr"), tmp_path / method, method, block=256, halo=64,
                         device="cpu", precision="fp32")
        lab = zarr.open_array(rep.store, path=rep.array_path)[:]
        assert rep.notes == loaded.notes == ["401 NaN/inf pixels replaced by the image minimum (120)"]
        assert rep.objects > 50, method
        if method == "threshold":
            assert rep.objects == int(whole.max()) and object_f1(whole, lab) >= 0.99
    zarr.create_array(str(tmp_path / "n.zarr"), data=np.full((256, 256), np.nan, np.float32), zarr_format=2)
    with pytest.raises(BlockRunError) as err:
        run_blocks(open_zarr(tmp_path / "n.zarr"), tmp_path / "o", "threshold", block=128, halo=32)
    assert str(err.value) == "n.zarr: every pixel is NaN or infinite: nothing to segment"


def test_stores_whose_names_agree_up_to_the_first_dot_keep_their_own_outputs(files, tmp_path):
    """mosaic.zarr and mosaic.v3.zarr write outputs of their own names; a store of the same
    name from another folder (or a.zarr beside a.ome.zarr) is refused, with overwrite too,
    and the first store's outputs are kept."""
    a = _field(files, tmp_path / "mosaic.zarr", k=0)
    b = _field(files, tmp_path / "mosaic.v3.zarr", k=1)
    out = tmp_path / "out"
    ra = run_blocks(open_zarr(a), out, "threshold", block=256, halo=32, into_input=False)
    lab_a = zarr.open_array(ra.store, path="0")[:]
    rb = run_blocks(open_zarr(b), out, "threshold", block=256, halo=32, into_input=False)
    assert (ra.labels, ra.table) == (str(out / "mosaic_labels.ome.zarr"), str(out / "mosaic_objects.csv"))
    assert (rb.labels, rb.table) == (str(out / "mosaic.v3_labels.ome.zarr"), str(out / "mosaic.v3_objects.csv"))
    (tmp_path / "other").mkdir()
    c = _field(files, tmp_path / "other" / "mosaic.zarr", k=1)
    table = (out / "mosaic_objects.csv").read_text()
    for overwrite, into_input in ((False, False), (True, False), (False, True)):
        with pytest.raises(BlockRunError) as err:
            run_blocks(open_zarr(c), out, "threshold", block=256, halo=32, into_input=into_input,
                       overwrite=overwrite)
        msg = str(err.value)
        assert "\n" not in msg and msg.startswith("output name mosaic_labels.ome.zarr / mosaic_objects.csv")
        assert f"already used by {a.resolve()}" in msg
    np.testing.assert_array_equal(zarr.open_array(ra.store, path="0")[:], lab_a)
    assert (out / "mosaic_objects.csv").read_text() == table
    # labels into each input: their tables would share OUT/a_objects.csv
    run_blocks(open_zarr(_field(files, tmp_path / "a.zarr")), out, "threshold", block=256, halo=32)
    with pytest.raises(BlockRunError, match="already used by"):
        run_blocks(open_zarr(_field(files, tmp_path / "a.ome.zarr", k=1)), out, "threshold", block=256, halo=32)


def test_a_second_run_on_the_same_outputs_is_refused_while_the_first_runs(files, tmp_path):
    """A run started while another writes the same outputs (the same OUT, or the same input
    store's labels) is refused in one line; the first ends as a run alone does (before, the
    first removed the shared work folder and the other died with a TypeError)."""
    path = _field(files, tmp_path / "m.ome.zarr")
    errors = []

    def start_another(phase, done, total):
        if phase == "segment" and done == 1 and not errors:
            for out in (tmp_path / "out", tmp_path / "elsewhere"):
                try:
                    run_blocks(open_zarr(path), out, "threshold", block=256, halo=32)
                    errors.append(None)
                except BlockRunError as exc:
                    errors.append(str(exc))

    rep = run_blocks(open_zarr(path), tmp_path / "out", "threshold", block=256, halo=32, progress=start_another)
    assert errors[0] == (f"another run is writing the outputs of m in {tmp_path / 'out'} now: wait for it to "
                         "end (or use another output folder)")
    assert errors[1].startswith("another run is writing the labels of m.ome.zarr now")
    clean = run_blocks(open_zarr(path), tmp_path / "clean", "threshold", block=256, halo=32, name="clean")
    assert not rep.cancelled and rep.objects == clean.objects > 50
    np.testing.assert_array_equal(zarr.open_array(rep.store, path=rep.array_path)[:],
                                  zarr.open_array(clean.store, path=clean.array_path)[:])
    # the locks end with the run: the next run goes ahead
    assert run_blocks(open_zarr(path), tmp_path / "out", "threshold", block=256, halo=32).objects == rep.objects


def test_block_size_has_a_lower_bound_and_zero_is_refused(files, tmp_path, capsys):
    """Block 0 meant 1024 without a word; block 1 or 2 meant hours of tiny blocks: one line
    from the plan (every front end), before any work."""
    from napari_gpuseg.cli.batch import main
    from napari_gpuseg.engine.blocks.plan import MIN_BLOCK

    path = _field(files, tmp_path / "m.ome.zarr")
    for block in (0, 1, 2, MIN_BLOCK - 1, (0, 256)):
        with pytest.raises(BlockRunError) as err:
            run_blocks(open_zarr(path), tmp_path / "out", "threshold", block=block, halo=0)
        assert str(err.value) == (f"block size {block!r} is too small: at least {MIN_BLOCK} pixels a side "
                                  "(1024 in 2D, 128 in 3D by default)")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    with pytest.raises(BlockRunError, match="gives 100000000 blocks"):
        from napari_gpuseg.engine.blocks import ArraySource
        import dask.array as da

        run_blocks(ArraySource(da.zeros((160000, 160000), dtype="u1")), tmp_path / "o", "threshold", block=16, halo=0)
    assert main([str(path), str(tmp_path / "o2"), "--block-size", "0", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["napari-gpuseg batch: block size 0 is too small: at least 16 pixels a side (1024 in 2D, "
                   "128 in 3D by default)"]
    rep = run_blocks(open_zarr(path), tmp_path / "o3", "threshold", block=MIN_BLOCK * 8, halo=16)
    assert rep.blocks == 5 * 6 and rep.objects > 50


@pytest.mark.parametrize("fmt", [2, 3])
def test_labels_keep_the_image_geometry_and_ngff_05_dimension_names(files, tmp_path, fmt):
    """An image with axis units, a level scale + translation and a multiscales scale: the
    labels (in the input and in OUT) lie on it (the same pixel -> world mapping, the units);
    in an NGFF 0.5 store the labels array names its dimensions."""
    path = _field(files, tmp_path / "m.ome.zarr", fmt=fmt)
    root = zarr.open_group(str(path), mode="a")
    attrs = dict(root.attrs)
    ome = attrs.get("ome", attrs)
    ms = ome["multiscales"]
    ms[0]["axes"] = [{"name": a, "type": "space", "unit": "micrometer"} for a in "yx"]
    ms[0]["datasets"][0]["coordinateTransformations"] = [
        {"type": "scale", "scale": [0.5, 0.25]}, {"type": "translation", "translation": [100.0, 200.0]}]
    ms[0]["coordinateTransformations"] = [{"type": "scale", "scale": [2.0, 2.0]}]
    root.attrs.update(attrs)
    for into_input in (True, False):
        rep = run_blocks(open_zarr(path), tmp_path / "out", "threshold", block=256, halo=32, into_input=into_input)
        grp = zarr.open_group(rep.store, path=rep.array_path[:-2] or None, mode="r")
        got = dict(grp.attrs)
        m = got.get("ome", got)["multiscales"][0]
        assert m["axes"] == [{"name": a, "type": "space", "unit": "micrometer"} for a in "yx"]
        # world = 2 * (0.5 * i + 100) for y, 2 * (0.25 * j + 200) for x
        assert m["datasets"][0]["coordinateTransformations"] == [
            {"type": "scale", "scale": [1.0, 0.5]}, {"type": "translation", "translation": [200.0, 400.0]}]
        arr = zarr.open_array(rep.store, path=rep.array_path, mode="r")
        if fmt == 3:
            assert tuple(arr.metadata.dimension_names) == ("y", "x")
        assert arr.shape == FIELD and rep.objects > 50


def test_the_terminal_prints_a_block_runs_notes(capsys, tmp_path):
    """The NaN/inf note of a block run reaches the terminal, as a folder job's notes do."""
    from types import SimpleNamespace

    from napari_gpuseg.cli.batch import print_blocks

    rep = SimpleNamespace(cancelled=False, objects=31, blocks=4, resumed=0, seam_merges=2, seconds=1.0,
                          labels=tmp_path / "l", table=tmp_path / "t.csv",
                          notes=["400 NaN/inf pixels replaced by the image minimum (120)"])
    assert print_blocks(rep) == 0
    assert "note: 400 NaN/inf pixels replaced by the image minimum (120)" in capsys.readouterr().out
