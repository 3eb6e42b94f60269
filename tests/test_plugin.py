import subprocess
import sys

import numpy as np


def test_manifest_validates():
    out = subprocess.run([sys.executable, "-m", "npe2", "validate", "napari-gpuseg"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_sample_data_opens_real_images(make_napari_viewer):
    viewer = make_napari_viewer()
    viewer.open_sample("napari-gpuseg", "bbbc039_masks")
    image, labels = viewer.layers
    assert image.data.shape == labels.data.shape == (520, 696)
    assert labels.data.max() > 50
    viewer.open_sample("napari-gpuseg", "nuclei3d")
    assert viewer.layers[-1].data.ndim == 3


def test_tiff_drag_and_drop_uses_builtin_reader_without_dialog(make_napari_viewer, tmp_path):
    import tifffile

    path = tmp_path / "x.tif"
    tifffile.imwrite(path, np.arange(64, dtype=np.uint16).reshape(8, 8))
    viewer = make_napari_viewer()
    layers = viewer.open(str(path))  # no plugin given: must not need a choice
    assert layers[0].data.shape == (8, 8)


def test_cli_info_runs():
    out = subprocess.run([sys.executable, "-m", "napari_gpuseg.cli.main", "info", "--device", "cpu"],
                         capture_output=True, text=True)
    assert out.returncode == 0 and "device:" in out.stdout


def test_the_launcher_refuses_a_typo_in_one_line_and_opens_what_it_can(make_napari_viewer, monkeypatch,
                                                                        tmp_path, capsys):
    """``napari-gpuseg PATH ...``: a path that does not exist stops it with one line and no
    window; a file no reader takes is named on stderr and in the window, the others open."""
    import importlib

    import napari
    import tifffile

    launcher = importlib.import_module("napari_gpuseg.cli.main")
    made = []
    monkeypatch.setattr(napari, "Viewer", lambda **kw: made.append(make_napari_viewer(**kw)) or made[-1])
    monkeypatch.setattr(launcher, "DEFAULT_DOCKS", ())
    assert launcher.main([str(tmp_path / "typo.tif"), "--no-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"napari-gpuseg: {tmp_path / 'typo.tif'}: no such file or folder" and made == []
    (tmp_path / "empty.tif").write_bytes(b"")
    tifffile.imwrite(tmp_path / "good.tif", np.arange(64, dtype=np.uint16).reshape(8, 8))
    assert launcher.main([str(tmp_path / "empty.tif"), str(tmp_path / "good.tif"), "--no-run"]) == 0
    err = capsys.readouterr().err
    assert f"napari-gpuseg: could not open {tmp_path / 'empty.tif'}:" in err
    assert [layer.name for layer in made[0].layers] == ["good"]
