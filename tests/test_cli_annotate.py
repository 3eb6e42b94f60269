"""``napari-gpuseg annotate IN OUT``: bad folders are one line and exit 2, before any window."""
from __future__ import annotations

from napari_gpuseg.cli.main import main


def test_annotate_bad_folders_exit_2(tmp_path, capsys):
    assert main(["annotate", str(tmp_path / "nope"), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip() == f"napari-gpuseg annotate: {tmp_path / 'nope'}: no such folder"
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jpg").write_bytes(b"x")
    assert main(["annotate", str(tmp_path / "in"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "set the pattern to '*.jpg'" in err
    (tmp_path / "file").write_text("x")
    assert main(["annotate", str(tmp_path / "in"), str(tmp_path / "file"), "--pattern", "*.jpg"]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err
