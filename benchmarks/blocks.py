"""Big images in blocks: peak memory on a 16384 x 16384 OME-Zarr mosaic of real BBBC039
fields, and blocks against the whole image in one piece (2D mosaic, ZYX volume).

    OMP_NUM_THREADS=1 python benchmarks/blocks.py big --size 16384
    OMP_NUM_THREADS=1 python benchmarks/blocks.py compare --size 4096
    OMP_NUM_THREADS=1 python benchmarks/blocks.py volume

``big`` builds the mosaic (once) and segments it in a child process whose peak RSS
(``ru_maxrss``) is reported against the image's size. Results are printed as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _mosaic import field_files, write_mosaic  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
if not DATA.exists():
    DATA = Path(os.environ.get("NAPARI_GPUSEG_SHARED_DATA", "/work/shared/data"))


def _mosaic(size: int, work: Path) -> Path:
    path = work / f"mosaic{size}.ome.zarr"
    if not (path / "0").exists():
        files = field_files(DATA / "bbbc039_more" / "images") + field_files(DATA / "bbbc039" / "images")
        write_mosaic(files, path, (size, size), chunks=1024)
    return path


def _segment(path: str, out: str, method: str, block: int, halo: int) -> None:
    """Child process of ``big``: the run alone, so its peak RSS is the run's."""
    from napari_gpuseg.engine.blocks import run_blocks
    from napari_gpuseg.io.zarr_images import open_zarr

    img = open_zarr(path)
    t0 = time.perf_counter()
    rep = run_blocks(img, out, method, block=block, halo=halo, device="cpu", precision="fp32", overwrite=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"objects": rep.objects, "blocks": rep.blocks, "seconds": round(time.perf_counter() - t0, 1),
                      "peak_rss_bytes": peak, "image_bytes": img.nbytes, "labels": rep.labels}))


def big(args) -> dict:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    path = _mosaic(args.size, work)
    built = time.perf_counter() - t0
    cmd = [sys.executable, __file__, "_segment", str(path), str(work / "out"), args.method, str(args.block),
           str(args.halo)]
    res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
    res.update(size=args.size, build_s=round(built, 1), method=args.method, block=args.block, halo=args.halo,
               peak_rss_gb=round(res["peak_rss_bytes"] / 1e9, 3), image_gb=round(res["image_bytes"] / 1e9, 3))
    return res


def _whole(method: str, image: np.ndarray) -> np.ndarray:
    """The image in one piece through the folder-job method (its own normalisation; a ZYX
    volume with the 2D U-Net: per slice, linked across slices)."""
    from napari_gpuseg.engine.jobs.method_registry import SegResult, method_factory
    from napari_gpuseg.engine.runtime.device import make_policy

    seg = method_factory(method)()
    seg.load(make_policy("cpu", "fp32"))
    raw = seg.segment([seg.prepare(image, False)])[0]
    res = raw if isinstance(raw, SegResult) else seg.finish(raw)
    return np.asarray(res.labels)


def _against_whole(path: Path, out: Path, method: str, block, halo) -> dict:
    import zarr

    from napari_gpuseg.engine.blocks import plan_blocks, run_blocks
    from napari_gpuseg.engine.blocks.check import seam_splits
    from napari_gpuseg.engine.metrics import object_f1
    from napari_gpuseg.io.zarr_images import open_zarr

    img = open_zarr(path)
    t0 = time.perf_counter()
    rep = run_blocks(img, out, method, block=block, halo=halo, device="cpu", precision="fp32", overwrite=True)
    t_blocks = time.perf_counter() - t0
    lab = zarr.open_array(rep.store, path=rep.array_path, mode="r")[:]
    t0 = time.perf_counter()
    whole = _whole(method, img.read((slice(None),) * len(img.shape)))
    t_whole = time.perf_counter() - t0
    plan = plan_blocks(img.shape, block, halo)
    return {"shape": list(img.shape), "method": method, "block": block, "halo": halo, "blocks": rep.blocks,
            "objects_blocks": rep.objects, "objects_whole": int(len(np.unique(whole)) - 1),
            "f1_at_0.5": round(object_f1(whole, lab), 4), "seam_splits": seam_splits(whole, lab, plan),
            "seam_matches": rep.seam_merges, "blocks_s": round(t_blocks, 1), "whole_s": round(t_whole, 1)}


def compare(args) -> dict:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    return _against_whole(_mosaic(args.size, work), work / "out", args.method, args.block, args.halo)


def volume(args) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from zarr_inputs import volume_zarr

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    path = volume_zarr(DATA, work / "volume.ome.zarr", reps=(4, 4, 4))
    out = []
    for method, block, halo in (("threshold", (64, 128, 128), (16, 24, 24)), ("threshold", (64, 128, 128), (24, 40, 40)),
                                ("unet", (64, 128, 128), (4, 64, 64))):
        out.append(_against_whole(path, work / "vout", method, block, halo))
    return {"volume": out}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_segment":
        _segment(argv[1], argv[2], argv[3], int(argv[4]), int(argv[5]))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("section", choices=("big", "compare", "volume"))
    p.add_argument("--size", type=int, default=16384)
    p.add_argument("--method", default="unet")
    p.add_argument("--block", type=int, default=1024)
    p.add_argument("--halo", type=int, default=64)
    p.add_argument("--work", default="/tmp/gpuseg-blocks-bench")
    args = p.parse_args(argv)
    res = {"big": big, "compare": compare, "volume": volume}[args.section](args)
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
