"""zarr / OME-Zarr inputs: the layouts read, and one clear line for the others."""
import numpy as np
import pytest

zarr = pytest.importorskip("zarr")

from napari_gpuseg.io.zarr_images import ZarrLayoutError, is_zarr, open_zarr  # noqa: E402

from zarr_inputs import field_files, write_mosaic  # noqa: E402

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def fields(shared_data):
    return field_files(shared_data / "bbbc039" / "images")[:2]


@pytest.mark.parametrize("fmt", [2, 3])
def test_ome_zarr_mosaic_reads_back_the_real_fields(tmp_path, fields, fmt):
    import tifffile

    path = write_mosaic(fields, tmp_path / "m.ome.zarr", (520, 1392), chunks=256, zarr_format=fmt)
    img = open_zarr(path)
    assert img.ome and img.zarr_format == fmt and img.shape == (520, 1392) and img.spatial_names == ("y", "x")
    np.testing.assert_array_equal(img.read((slice(0, 520), slice(696, 1392))), tifffile.imread(fields[1]))
    assert img.to_dask().shape == (520, 1392)


def test_channel_axis_picks_one_channel(tmp_path, fields):
    import tifffile
    from ome_zarr.writer import write_image

    a, b = (tifffile.imread(f) for f in fields)
    root = zarr.open_group(str(tmp_path / "c.zarr"), mode="w", zarr_format=2)
    write_image(np.stack([a, b]), root, axes="cyx", scale_factors=[])
    assert np.array_equal(open_zarr(tmp_path / "c.zarr", channel=1).read((slice(None), slice(None))), b)
    with pytest.raises(ZarrLayoutError, match="channel 5 asked for, the image has 2"):
        open_zarr(tmp_path / "c.zarr", channel=5)


def test_bare_array_and_single_array_group(tmp_path, fields):
    import tifffile

    a = tifffile.imread(fields[0])
    zarr.create_array(str(tmp_path / "bare.zarr"), data=a, zarr_format=2)
    g = zarr.open_group(str(tmp_path / "g.zarr"), mode="w")
    g.create_array("img", data=a)
    for p in ("bare.zarr", "g.zarr"):
        assert is_zarr(tmp_path / p)
        assert np.array_equal(open_zarr(tmp_path / p).read((slice(None), slice(None))), a)


@pytest.mark.parametrize("make, reason", [
    (lambda g: (g.create_array("a", shape=(8, 8), dtype="u2"), g.create_array("b", shape=(8, 8), dtype="u2")),
     "a group of 2 arrays without OME multiscales metadata"),
    (lambda g: g.attrs.update({"plate": {"wells": []}}), "an HCS plate or well"),
    (lambda g: (g.create_array("0", shape=(3, 8, 8), dtype="u2"),
                g.attrs.update({"multiscales": [{"version": "0.4", "axes": ["t", "y", "x"],
                                                  "datasets": [{"path": "0"}]}]})),
     "a time series of 3 points"),
    (lambda g: g.create_array("x", shape=(2, 2, 8, 8), dtype="u2"), "a 4-D array without axis metadata"),
])
def test_unsupported_layouts_are_one_line(tmp_path, make, reason):
    g = zarr.open_group(str(tmp_path / "bad.zarr"), mode="w", zarr_format=2)
    make(g)
    with pytest.raises(ZarrLayoutError) as err:
        open_zarr(tmp_path / "bad.zarr")
    msg = str(err.value)
    assert reason in msg and "\n" not in msg and msg.startswith("bad.zarr: unsupported zarr layout")


def test_not_a_zarr_store(tmp_path):
    (tmp_path / "plain").mkdir()
    with pytest.raises(ZarrLayoutError, match="not a zarr store"):
        open_zarr(tmp_path / "plain")


def test_a_channel_other_than_0_of_a_single_channel_store_is_refused(tmp_path, fields):
    """As a gray TIFF: channel 0 reads the image, channel 3 is one line (was silently ignored)."""
    import tifffile

    a = tifffile.imread(fields[0])
    zarr.create_array(str(tmp_path / "bare.zarr"), data=a, zarr_format=2)
    path = write_mosaic(fields[:1], tmp_path / "m.ome.zarr", (520, 696), chunks=256)
    for p in (tmp_path / "bare.zarr", path):
        assert np.array_equal(open_zarr(p, channel=0).read((slice(None), slice(None))), a)
        with pytest.raises(ZarrLayoutError) as err:
            open_zarr(p, channel=3)
        assert str(err.value) == f"{p.name}: unsupported zarr layout: channel 3 asked for, the image has 1"
