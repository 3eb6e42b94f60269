"""README's "Use from Python" examples run as written, on real BBBC039 nuclei images."""
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import tifffile

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "sample_data"


def readme_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index("## Use from Python\n")
    end = text.index("\n## ", start + 1)
    return re.findall(r"```python\n(.*?)```", text[start:end], flags=re.S)


def test_readme_has_the_four_examples():
    blocks = readme_blocks()
    assert len(blocks) == 4
    assert "run_folder(" in blocks[0] and "Prompt(box=" in blocks[1] and "predict_probabilities(" in blocks[2]
    assert "AnnotationSession(" in blocks[3]


@pytest.fixture
def workdir(tmp_path, monkeypatch, shared_data):
    """``images/`` with two BBBC039 fields and ``nuclei.tif`` (the shipped sample field)."""
    (tmp_path / "images").mkdir()
    for src in sorted((shared_data / "bbbc039" / "images").glob("*.tif"))[:2]:
        shutil.copy(src, tmp_path / "images" / src.name)
    shutil.copy(SAMPLE / "bbbc039_nuclei.tif", tmp_path / "nuclei.tif")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def run_block(index: int) -> dict:
    scope: dict = {"__name__": "__readme__"}
    exec(compile(readme_blocks()[index], f"README.md[python block {index}]", "exec"), scope)
    return scope


def test_folder_run(workdir):
    scope = run_block(0)
    report = scope["report"]
    assert report.total == 2 and report.ok == 2, report.summary()
    for src in (workdir / "images").glob("*.tif"):
        labels = tifffile.imread(workdir / "labels" / f"{src.stem}_labels.tif")
        assert labels.shape == tifffile.imread(src).shape and labels.max() > 10
    assert (workdir / "labels" / "report.csv").is_file()


@pytest.mark.usefixtures("reuse_embeddings")
def test_sam_box_prompt(workdir):
    scope = run_block(1)
    truth = tifffile.imread(SAMPLE / "bbbc039_nuclei_masks.tif")
    mask = scope["mask"]
    assert mask.shape == truth.shape and mask.dtype == bool
    # the box [262, 178, 318, 218] surrounds one nucleus: the mask must be that nucleus
    ids, counts = np.unique(truth[mask], return_counts=True)
    obj = truth == ids[np.argmax(counts)]
    iou = (mask & obj).sum() / (mask | obj).sum()
    assert iou > 0.7, iou


def test_unet_prediction(workdir):
    scope = run_block(2)
    truth = tifffile.imread(SAMPLE / "bbbc039_nuclei_masks.tif")
    labels, probs = scope["labels"], scope["probs"]
    assert probs.shape == (3,) + truth.shape and labels.shape == truth.shape
    assert abs(int(labels.max()) - int(truth.max())) < 0.2 * truth.max()
    fg_iou = ((labels > 0) & (truth > 0)).sum() / ((labels > 0) | (truth > 0)).sum()
    assert fg_iou > 0.8, fg_iou


@pytest.mark.usefixtures("reuse_embeddings")
def test_annotation_session(workdir):
    scope = run_block(3)
    truth = tifffile.imread(SAMPLE / "bbbc039_nuclei_masks.tif")
    s, mask = scope["s"], scope["mask"]
    assert mask.shape == truth.shape and mask.dtype == bool
    ids, counts = np.unique(truth[mask], return_counts=True)
    obj = truth == ids[np.argmax(counts)]
    assert (mask & obj).sum() / (mask | obj).sum() > 0.7  # the box's nucleus
    assert scope["obj"] == 1 and s.labels.shape == truth.shape
    assert not s.labels.any()  # the commit was undone
