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
def walk(qtbot, monkeypatch):  # qtbot: the QApplication the viewer joins
    """:func:`quickstart_check.walk` on a first start, as napari's own viewer fixture does it:
    napari's settings reset (a start after one that saved no window geometry opens a small
    window whose docks squeeze the canvas to nothing), and closing saves no window settings."""
    from napari._qt.qt_main_window import _QtMainWindow
    from napari.settings import get_settings

    require_lite_medsam()
    get_settings().reset()
    monkeypatch.setattr(_QtMainWindow, "_save_current_window_settings", lambda self: None)
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import quickstart_check
    finally:
        sys.path.remove(str(ROOT / "docs"))
    yield quickstart_check.walk
    get_settings().reset()


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
    save_step = text[text.index("5. **Save.**"):text.index("Sample images")]
    assert "`.tif`" in save_step
    assert "`.png`" not in save_step or facts["png_saved"], facts.get("png_error")  # it said .tif or .png
