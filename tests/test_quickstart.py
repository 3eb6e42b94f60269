"""The README's quick start as a user does it (docs/quickstart_check.py) in the window
``napari-gpuseg`` opens, with the real default model, and the names it gives are the window's."""
import re
import sys
from pathlib import Path

import pytest

from sam_fixtures import require_lite_medsam

ROOT = Path(__file__).resolve().parents[1]


def quick_start() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = re.search(r"^## Quick start\n(.*?)^## ", text, flags=re.S | re.M).group(1)
    return " ".join(section.split())  # one line: a name may wrap in the source


@pytest.fixture
def walk(qtbot):  # qtbot: the QApplication the viewer joins
    require_lite_medsam()
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import quickstart_check
    finally:
        sys.path.remove(str(ROOT / "docs"))
    return quickstart_check.walk


def test_the_quick_start_runs_as_written(walk, tmp_path):
    facts = walk(tmp_path, log=lambda _text: None)
    text = quick_start()
    # 1. the command opens both docks on the sample, SAM positive selected
    for dock in ("SAM annotator", "GPU monitor"):
        assert f"{dock} (napari-gpuseg)" in facts["docks"] and f"**{dock}**" in text
    assert facts["active"] == facts["positive_layer"] == "SAM positive"
    # 2.-3. the layers the steps name are the ones the window shows
    for layer in (facts["positive_layer"], facts["preview_layer"], facts["negative_layer"], "SAM boxes"):
        assert f"**{layer}**" in text and layer in facts["layers"], layer
    assert facts["click_iou"] > 0.8 and facts["corrected_iou"] > 0.8
    # 4. the keys and the button, the labels layer's name
    for key in re.findall(r"`(Shift-[A-Z])`", text):
        assert key in facts["keys"], key
    assert "**Commit**" in text and facts["buttons"][0].startswith("Commit ")
    assert "`<image> SAM labels`" in text and facts["labels_layer"] == f"{facts['image']} SAM labels"
    # 5. the menu entry, and the file holds the committed nucleus
    menu = re.search(r"\*File > ([^*]+)\*", text).group(1)
    assert menu.rstrip(".") + "..." in facts["file_menu"]
    assert facts["saved_ids"] == [0, 1] and facts["saved_iou"] > 0.8
