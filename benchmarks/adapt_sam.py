"""Adapt SAM: annotate the left half of a field, measure clicks on the right half.

    python benchmarks/adapt_sam.py [--minutes 4] [--model nuclei_sam] [--annotate right]

On the DSB2018 field (``shared/data/dsb2018``, never trained on): the objects whose
centre lies in the left half are the user's annotation; the decoder of ``--model`` is
fine-tuned on them with the Adapt SAM dock's own schedule (``widgets.sam_adapt``'s
``adapt_config``: a fixed number of visits per object, bound by ``--minutes``; embedding
included in the reported wall time), and the first-click candidate is measured on them as
the dock does (``store_click_choice``). Then the
objects of the right half are clicked (``click_ious``: 1, 3 clicks and a box) with the
starting model and the adapted one, in the same run.

``--annotate right`` tunes on the measured objects themselves: not the user's case but its
ceiling, what the same minutes of adapting can add when the annotation is the test.
"""
import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from scipy import ndimage as ndi

from _data import dsb2018_field
from _machine import machine_line
from _overrides import override
from napari_gpuseg.engine import load_engine
from napari_gpuseg.engine.sam.interactive.cache import EmbeddingCache
from napari_gpuseg.engine.sam.training.click_choice import store_click_choice
from napari_gpuseg.engine.sam.training.click_eval import click_ious
from napari_gpuseg.engine.sam.training.finetune import finetune_sam


def halves(lab: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(left objects only, right objects only) by each object's centre."""
    ids = np.arange(1, int(lab.max()) + 1)
    centres = ndi.center_of_mass(lab > 0, lab, ids)
    left = [i for i, c in zip(ids, centres) if not np.isnan(c[1]) and c[1] < lab.shape[1] / 2]
    in_left = np.isin(lab, left)
    return np.where(in_left, lab, 0), np.where(~in_left, lab, 0)


def main(argv=None) -> int:
    from napari_gpuseg.widgets.sam_adapt import adapt_config

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=4)
    ap.add_argument("--model", default="nuclei_sam")
    ap.add_argument("--annotate", choices=("left", "right"), default="left",
                    help="the half the decoder is tuned on; right = the measured half (a ceiling)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a field of the dock's schedule (to try another one), e.g. lr=5e-4")
    args = ap.parse_args(argv)
    print(machine_line())
    img, lab = dsb2018_field()
    left, right = halves(lab)
    annotation = left if args.annotate == "left" else right
    print(f"{len(np.unique(annotation)) - 1} objects annotated ({args.annotate} half), "
          f"{len(np.unique(right)) - 1} measured (right)")
    cache = EmbeddingCache(max_bytes=2 << 30)
    start = load_engine(args.model, cache=cache)
    before = click_ious(start, img, right, clicks=3)
    out = Path(tempfile.mkdtemp()) / "adapted.pt"
    cfg = override(adapt_config(args.minutes, len(np.unique(annotation)) - 1), args.set)
    if args.set:
        print("schedule overrides:", ", ".join(args.set))
    t0 = time.perf_counter()
    tuned = load_engine(args.model, cache=EmbeddingCache())  # a fresh cache: embedding is part of the time
    res = finetune_sam([img], [annotation], model=tuned, config=cfg, out_path=out)
    store_click_choice(res.engine, str(out), [img], [annotation])
    wall = time.perf_counter() - t0
    adapted = load_engine(str(out), cache=cache)
    after = click_ious(adapted, img, right, clicks=3)
    for name, r in (("start (" + args.model + ")", before), ("adapted", after)):
        c = r["clicks"]
        print(f"{name:24s} n={r['n']}  1 click {c[:, 0].mean():.3f}  3 clicks {c[:, 2].mean():.3f}  "
              f"box {r['box'].mean():.3f}")
    gain = after["clicks"][:, 0].mean() - before["clicks"][:, 0].mean()
    print(f"adapt: {res.history[-1]['step']} steps, {wall:.0f} s wall (embedding included); "
          f"1-click gain {gain:+.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
