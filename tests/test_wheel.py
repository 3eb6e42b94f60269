"""The wheel holds every module, the shipped weights, the sample data and the licence files,
and builds without a setuptools packaging warning. Built offline with what is installed."""
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "setup.py", "README.md", "LICENSE", "NOTICE", "LICENSES", "napari_gpuseg",
           "sample_data")


def _expected() -> set[str]:
    pkg = ROOT / "napari_gpuseg"
    names = {p.relative_to(ROOT).as_posix() for p in pkg.rglob("*.py") if "__pycache__" not in p.parts}
    names |= {p.relative_to(ROOT).as_posix() for p in (pkg / "weights").glob("*") if p.suffix in (".pt", ".md")}
    names.add("napari_gpuseg/napari.yaml")
    names |= {f"napari_gpuseg/_sample_data/{p.name}" for p in (ROOT / "sample_data").iterdir()
              if p.suffix in (".tif", ".md")}
    return names


def build_wheel(root: Path, out: Path) -> tuple[subprocess.CompletedProcess, list[str]]:
    """``pip wheel`` of ``root`` (a clean copy: no stale build/ folder), its output and the
    wheel's file names."""
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "--no-index",
         "-v", "-w", str(out)],
        cwd=root, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    wheels = sorted(out.glob("napari_gpuseg-*.whl"))
    names = zipfile.ZipFile(wheels[0]).namelist() if wheels else []
    return proc, names


def _copy_sources(dst: Path) -> Path:
    dst.mkdir()
    for name in SOURCES:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dst / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy(src, dst / name)
    return dst


@pytest.mark.timeout(60)
def test_the_wheel_holds_every_module_the_weights_the_sample_data_and_the_licences(tmp_path):
    pytest.importorskip("setuptools", minversion="77")  # --no-build-isolation: the installed one
    root = _copy_sources(tmp_path / "src")
    proc, names = build_wheel(root, tmp_path / "dist")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "Package would be ignored" not in output, output[-4000:]
    expected = _expected()
    assert len([n for n in expected if n.endswith(".py")]) > 90  # the walk saw the whole package
    assert {"napari_gpuseg/weights/unet_nuclei.pt", "napari_gpuseg/_sample_data/bbbc039_nuclei.tif"} <= expected
    assert not expected - set(names), sorted(expected - set(names))
    licences = {n.split(".dist-info/licenses/", 1)[1] for n in names if ".dist-info/licenses/" in n}
    shipped = {"LICENSE", "NOTICE"} | {f"LICENSES/{p.name}" for p in (ROOT / "LICENSES").iterdir()}
    assert len(shipped) >= 4 and shipped <= licences, sorted(shipped - licences)
