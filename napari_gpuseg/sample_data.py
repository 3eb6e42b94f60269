"""Sample data contributions: real images shipped in the repository's ``sample_data/``."""
from __future__ import annotations

import os
from pathlib import Path

import tifffile


def sample_dir() -> Path:
    """``$NAPARI_GPUSEG_SAMPLE_DIR``, else the copy inside the package (wheels: ``_sample_data``),
    else ``sample_data/`` beside it (a source or editable install)."""
    env = os.environ.get("NAPARI_GPUSEG_SAMPLE_DIR")
    candidates = [Path(env)] if env else []
    here = Path(__file__).resolve().parent
    candidates += [here / "_sample_data", here.parent / "sample_data"]
    for c in candidates:
        if (c / "bbbc039_nuclei.tif").exists():
            return c
    raise FileNotFoundError(
        "napari-gpuseg sample data not found; install from a source checkout "
        "(pip install -e .) or set NAPARI_GPUSEG_SAMPLE_DIR"
    )


def _read(name: str):
    return tifffile.imread(sample_dir() / name)


def bbbc039_nuclei():
    return [
        (_read("bbbc039_nuclei.tif"), {"name": "BBBC039 nuclei", "colormap": "gray"}, "image"),
    ]


def bbbc039_with_masks():
    return bbbc039_nuclei() + [
        (_read("bbbc039_nuclei_masks.tif"), {"name": "BBBC039 ground truth", "opacity": 0.5}, "labels"),
    ]


def dsb2018_nuclei():
    return [(_read("dsb2018_nuclei.tif"), {"name": "DSB2018 nuclei", "colormap": "gray"}, "image")]


def nuclei_3d():
    return [(_read("nuclei3d.tif"), {"name": "3D nuclei", "colormap": "gray"}, "image")]


def human_mitosis():
    return [(_read("human_mitosis.tif"), {"name": "human mitosis", "colormap": "gray"}, "image")]
