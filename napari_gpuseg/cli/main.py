"""``napari-gpuseg``: open napari with the plugin docked, or run jobs from a terminal.

    napari-gpuseg [IMAGE ...]            open napari with our docks (sample image if none)
    napari-gpuseg batch IN OUT ...       segment a folder (see ``napari-gpuseg batch -h``)
    napari-gpuseg train ...              train a U-Net (see ``napari-gpuseg train -h``)
    napari-gpuseg train-sam ...          fine-tune a SAM decoder (``napari-gpuseg train-sam -h``)
    napari-gpuseg info                   device, precision, memory, models (adapted ones too)
"""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from ..engine.runtime.device import PRECISIONS

# (module, add-parser function, run function) for each optional subcommand
_SUBCOMMANDS = {
    "annotate": ("napari_gpuseg.cli.annotate", "add_annotate_parser", "run_annotate"),
    "batch": ("napari_gpuseg.cli.batch", "add_batch_parser", "run_batch"),
    "train": ("napari_gpuseg.cli.train", "add_train_parser", "run_train"),
    "train-sam": ("napari_gpuseg.cli.train_sam", "add_train_sam_parser", "run_train_sam"),
}

# docks opened by default, in order: (npe2 widget display name)
DEFAULT_DOCKS = ("SAM annotator", "GPU monitor")


def _info(args) -> int:
    from ..engine.runtime import memory
    from ..engine.runtime.device import make_policy

    policy = make_policy(args.device, args.precision)
    snap = memory.snapshot(policy.device)
    print(f"device:    {policy.describe()} ({policy.reason})")
    print(f"process:   {memory.format_bytes(snap.process_rss)} RSS")
    if snap.total is not None:
        print(f"gpu mem:   {memory.format_bytes(snap.free)} free of {memory.format_bytes(snap.total)}")
    try:
        from ..models import registry

        for name in registry.list_models():
            print(f"model:     {name}")
    except ImportError:
        pass
    _print_adapted()
    return 0


def _print_adapted() -> None:
    """The user's adapted decoders (Adapt SAM, the annotator's *Adapt to these objects*),
    newest first, each with the image it came from and the file to pass as ``--model``."""
    from ..engine.sam.training.adapt import adapted_dir, adapted_models

    entries = adapted_models()
    if not entries:
        print(f"adapted:   none yet (kept in {adapted_dir()})")
        return
    for e in entries:
        image = e.get("image") or "an image"
        objects = e.get("objects")
        made = str(e.get("created", ""))[:16].replace("T", " ")
        what = ", ".join(x for x in (f"from {image}", f"{objects} objects" if objects else "",
                                     f"on {e.get('base')}" if e.get("base") else "", made) if x)
        print(f"adapted:   {e.get('name')} ({what}): {e['path']}")


def _missing(paths: list[str]) -> list[str]:
    """The paths (not URLs) that do not exist: a typo is said in one line, before any window."""
    return [p for p in paths if "://" not in p and not Path(p).exists()]


def _open_viewer(args) -> int:
    missing = _missing(args.images)
    for path in missing:
        print(f"napari-gpuseg: {path}: no such file or folder", file=sys.stderr)
    if missing:
        return 2
    import napari

    from ..engine.runtime.device import set_policy

    set_policy(args.device, args.precision)
    viewer = napari.Viewer(title="napari-gpuseg")
    if args.images:
        for path in args.images:
            try:
                viewer.open(path)
            except Exception as exc:  # noqa: BLE001 - a file no reader takes: say so, keep the window
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                print(f"napari-gpuseg: could not open {path}: {first}", file=sys.stderr)
                _notify(f"could not open {path}: {first}")
    else:
        viewer.open_sample("napari-gpuseg", "bbbc039")
    for name in DEFAULT_DOCKS:
        try:
            viewer.window.add_plugin_dock_widget("napari-gpuseg", name)
        except Exception as exc:  # a dock that is not available must not stop the app
            print(f"napari-gpuseg: could not open dock {name!r}: {exc}", file=sys.stderr)
    if not args.no_run:
        napari.run()
    return 0


def _notify(text: str) -> None:
    from napari.utils.notifications import show_warning

    show_warning(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="napari-gpuseg", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("images", nargs="*", help="images to open (default: a sample image)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, mps")
    parser.add_argument("--precision", default="auto", choices=PRECISIONS)
    parser.add_argument("--no-run", action="store_true", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    # no allocator set-up here: batch and train apply it, the viewer's worker does on a CPU
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _SUBCOMMANDS:
        mod_name, add_name, run_name = _SUBCOMMANDS[argv[0]]
        mod = importlib.import_module(mod_name)
        parser = argparse.ArgumentParser(prog="napari-gpuseg")
        sub = parser.add_subparsers(dest="command")
        getattr(mod, add_name)(sub)
        args = parser.parse_args(argv)
        return _policy_error(args) or int(getattr(mod, run_name)(args) or 0)
    if argv and argv[0] == "info":
        args = build_parser().parse_args(argv[1:])
        return _policy_error(args) or _info(args)
    args = build_parser().parse_args(argv)
    return _policy_error(args) or _open_viewer(args)


def _policy_error(args) -> int:
    """2 (after one line on stderr) when --device/--precision (or the environment) name a
    device or precision this machine cannot use, e.g. bf16 on a Turing card; else 0."""
    if not hasattr(args, "device") and not hasattr(args, "precision"):
        return 0
    from ..engine.runtime.device import make_policy

    try:
        make_policy(getattr(args, "device", None), getattr(args, "precision", None))
    except (ValueError, RuntimeError) as exc:
        print(f"napari-gpuseg: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
