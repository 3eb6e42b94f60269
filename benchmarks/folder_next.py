"""Next -> first mask on the next image of a folder, with the next image prefetched or not.

    python benchmarks/folder_next.py [--images 4] [--size 256] [--model NAME]

A folder of held-out BBBC039 fields (the last 8; ``--size`` px cuts from their centre, 0 for
the whole 520x696 field) is gone through with :class:`napari_gpuseg.engine.FolderAnnotation`
three ways in one run, each with its own embedding cache (one model, one worker):

- *prefetched*: the folder reads and embeds the next image in the background (``IDLE``) while
  the current one is clicked; the user takes until that is done; then the clock runs from
  ``next()`` to the mask of a click at the most interior pixel of the next image's largest
  object.
- *not prefetched*: the same with ``prefetch=False`` (Next reads the image, the click embeds
  its view).
- *embedded*: on each image, once it is embedded, a click on another object (a new object),
  in the same conditions as the prefetched first click (the prefetch of the image after runs
  meanwhile): the prompt on an already embedded image that a prefetched Next should match.

Prints the medians and the ratios prefetched / embedded (target <= 1.2) and not prefetched /
prefetched, with the CPU, its flags, the threads and the date.
"""
import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import tifffile
from scipy import ndimage as ndi

from _data import bbbc039_validation
from _machine import machine_line


def interior_points(gt, n=2):
    out = []
    for i in sorted(np.unique(gt)[1:], key=lambda i: -(gt == i).sum())[:n]:
        dist = ndi.distance_transform_edt(gt == i)
        y, x = np.unravel_index(int(np.argmax(dist)), gt.shape)
        out.append((float(x), float(y)))
    return out


def make_folder(root: Path, n: int, size: int) -> list[np.ndarray]:
    (root / "images").mkdir(parents=True)
    gts = []
    for img_path, gt_path in bbbc039_validation():
        img, gt = tifffile.imread(img_path), tifffile.imread(gt_path)
        if size:
            y0, x0 = (img.shape[0] - size) // 2, (img.shape[1] - size) // 2
            img, gt = img[y0:y0 + size, x0:x0 + size], gt[y0:y0 + size, x0:x0 + size]
        if len(np.unique(gt)) < 3:
            continue  # an empty field: nothing to click
        tifffile.imwrite(root / "images" / img_path.name, img)
        gts.append(gt)
        if len(gts) == n:
            break
    return gts


def go_through(root: Path, gts, engine, worker, prefetch: bool, out_name: str):
    from napari_gpuseg.engine import AnnotationSession, FolderAnnotation
    from napari_gpuseg.engine.sam.interactive.cache import EmbeddingCache

    engine.cache = EmbeddingCache()  # each way starts with nothing embedded
    engine.forget_decoder_work()
    session = AnnotationSession(engine, worker=worker)
    folder = FolderAnnotation(session, root / "images", root / out_name, prefetch=prefetch)
    first, again = [], []
    for i, gt in enumerate(gts):
        (x, y), (x2, y2) = interior_points(gt)
        if i:
            if prefetch:
                folder.wait_prefetched()  # the user takes longer than the background work
            t0 = time.perf_counter()
            folder.next()
            session.click(x, y)
            first.append(time.perf_counter() - t0)
        else:
            session.click(x, y)
        folder.commit()
        session.embed()  # the image embedded (the embedded baseline's condition)
        t0 = time.perf_counter()
        session.click(x2, y2)
        again.append(time.perf_counter() - t0)
        folder.commit()
    folder.close()
    session.close()
    return first, again


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=4)
    ap.add_argument("--size", type=int, default=256, help="px cut from each field's centre; 0: whole field")
    ap.add_argument("--model", default=None, help="SAM model (default: the default model)")
    args = ap.parse_args(argv)

    from napari_gpuseg.engine import InferenceWorker, configure_allocator, load_engine

    configure_allocator()
    print(machine_line())
    root = Path(tempfile.mkdtemp(prefix="folder-next-"))
    try:
        gts = make_folder(root, args.images, args.size)
        engine = load_engine(args.model) if args.model else load_engine()
        worker = InferenceWorker(engine.policy)
        try:
            print(f"{len(gts)} images, {gts[0].shape[1]} x {gts[0].shape[0]} px; "
                  f"model {args.model or 'default'}; {len(gts) - 1} Next per way")
            off_first, off_again = go_through(root, gts, engine, worker, False, "out_off")
            on_first, on_again = go_through(root, gts, engine, worker, True, "out_on")
        finally:
            worker.shutdown()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = statistics.median
    embedded = off_again + on_again
    print(f"{'':32s} {'median s':>9s}  each")
    for name, vals in (("Next -> mask, not prefetched", off_first), ("Next -> mask, prefetched", on_first),
                       ("click on an embedded image", embedded)):
        print(f"{name:32s} {med(vals):9.3f}  " + " ".join(f"{v:.3f}" for v in vals))
    print(f"prefetched / embedded: {med(on_first) / med(embedded):.2f} (target <= 1.2)")
    print(f"not prefetched / prefetched: {med(off_first) / med(on_first):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
