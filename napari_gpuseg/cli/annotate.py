"""``napari-gpuseg annotate``: napari with the Annotate folder dock open on two folders.

    napari-gpuseg annotate IN_DIR OUT_DIR [--pattern "*.tif*,*.png"] [--presegment none|unet|sam]

Images of ``IN_DIR`` come one by one with the SAM annotator; labels are saved to
``OUT_DIR/<name>_labels.tif`` as they change, and reopening the same folders resumes where it
was left. Errors (a missing folder, no image matching the pattern) are one line, exit 2.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .. import io as gio
from ..engine.runtime.device import PRECISIONS

PRESEGMENT = {"none": 0, "unet": 1, "sam": 2}  # -> the dock's pre-segmentation choice


def add_annotate_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("annotate", help="annotate a folder of images one by one in napari",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("in_dir", help="folder of images")
    p.add_argument("out_dir", help="folder for the labels (made if needed)")
    p.add_argument("--pattern", default=gio.DEFAULT_PATTERN, help="file globs, comma-separated")
    p.add_argument("--presegment", choices=sorted(PRESEGMENT), default="none",
                   help="pre-segment each image without labels (unet: the bundled U-Net, sam: SAM automatic)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, mps")
    p.add_argument("--precision", default="auto", choices=PRECISIONS)
    p.add_argument("--no-run", action="store_true", help=argparse.SUPPRESS)
    return p


def check_folders(in_dir: str, out_dir: str, pattern: str) -> str | None:
    """Why these folders cannot be annotated (one line), or None."""
    from ..engine.jobs.outputs import list_inputs, no_input_note

    if not Path(in_dir).is_dir():
        return f"{in_dir}: no such folder"
    if Path(out_dir).exists() and not Path(out_dir).is_dir():
        return f"{out_dir}: is a file, not a folder"
    if not list_inputs(in_dir, out_dir, pattern):
        return no_input_note(in_dir, out_dir, pattern)
    return None


def run_annotate(args) -> int:
    problem = check_folders(args.in_dir, args.out_dir, args.pattern)
    if problem:
        print(f"napari-gpuseg annotate: {problem}", file=sys.stderr)
        return 2
    import napari

    from ..engine.runtime.device import set_policy

    set_policy(args.device, args.precision)
    viewer = napari.Viewer(title="napari-gpuseg: annotate a folder")
    _dock, widget = viewer.window.add_plugin_dock_widget("napari-gpuseg", "Annotate folder")
    widget.pattern_edit.setText(args.pattern)
    widget.presegment_box.setCurrentIndex(PRESEGMENT[args.presegment])
    if not widget.open(args.in_dir, args.out_dir):
        print(f"napari-gpuseg annotate: {widget.status.text()}", file=sys.stderr)
    if not args.no_run:
        napari.run()
    return 0
