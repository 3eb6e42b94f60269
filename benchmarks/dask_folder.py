"""Folder jobs on a Dask LocalCluster (127.0.0.1) against the in-process run, on real
BBBC039 images.

    OMP_NUM_THREADS=1 python benchmarks/dask_folder.py identical --n 48
    OMP_NUM_THREADS=1 python benchmarks/dask_folder.py kill --n 48
    OMP_NUM_THREADS=1 python benchmarks/dask_folder.py scaling --n 48 --method unet --repeats 2

``identical``: labels of a 2-worker cluster run equal the in-process run's, file by file.
``kill``: one of 2 workers is SIGKILLed after the first output; the run must still end with
n outputs, a complete report, no temp file, and no output written twice (its inode stays).
``scaling``: 1 worker against 2 (one thread each), runs alternated, after a warm-up;
efficiency = t(1 worker) / (2 * t(2 workers)); a control task of fixed CPU time (0.25 s, no
I/O) run the same way shows what a shared, loaded machine allows. Results are printed as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
if not DATA.exists():
    DATA = Path(os.environ.get("NAPARI_GPUSEG_SHARED_DATA", "/work/shared/data"))


def _files(n: int) -> list[Path]:
    return sorted((DATA / "bbbc039_more" / "images").glob("*.tif"))[:n]


def _labels(folder: Path) -> dict:
    from napari_gpuseg.io import label_files

    return {p.name: label_files.read_labels(p) for p in sorted(folder.glob("*_labels.tif"))}


def identical(args, work: Path) -> dict:
    from napari_gpuseg.engine.jobs.clusters import connect
    from napari_gpuseg.engine.jobs.dask_runner import run_folder_dask
    from napari_gpuseg.engine.jobs.pipeline import run_folder

    files = _files(args.n)
    in_dir = files[0].parent
    t0 = time.perf_counter()
    ref = run_folder(in_dir, work / "local", args.method, files=files, devices="cpu")
    t_local = time.perf_counter() - t0
    with connect("local", n_workers=2) as h:
        t0 = time.perf_counter()
        rep = run_folder_dask(h.client, in_dir, work / "dask", args.method, files=files, device="cpu")
        t_dask = time.perf_counter() - t0
    a, b = _labels(work / "local"), _labels(work / "dask")
    same = sum(np.array_equal(a[k], b.get(k)) for k in a)
    return {"files": len(files), "method": args.method, "in_process_ok": ref.ok, "cluster_ok": rep.ok,
            "identical_label_files": same, "in_process_s": round(t_local, 1), "cluster_2_workers_s": round(t_dask, 1)}


def kill(args, work: Path) -> dict:
    from napari_gpuseg.io import label_files
    from napari_gpuseg.engine.jobs.clusters import connect
    from napari_gpuseg.engine.jobs.dask_runner import run_folder_dask
    from napari_gpuseg.engine.jobs.pipeline import run_folder

    files = _files(args.n)
    in_dir, out = files[0].parent, work / "killed"
    with connect("local", n_workers=2) as h:
        pids = h.client.run(os.getpid)
        result = {}
        t = threading.Thread(target=lambda: result.setdefault("rep", run_folder_dask(
            h.client, in_dir, out, args.method, files=files, device="cpu")))
        t.start()
        inodes, killed_at = {}, None
        while t.is_alive():
            for p in out.glob("*_labels.tif"):
                inodes.setdefault(p.name, p.stat().st_ino)
            if inodes and killed_at is None:
                os.kill(sorted(pids.values())[0], signal.SIGKILL)
                killed_at = len(inodes)
            time.sleep(0.02)
        t.join()
    rep = result["rep"]
    names = [p.name for p in out.iterdir()]
    rewritten = sum(1 for p in out.glob("*_labels.tif") if p.name in inodes and p.stat().st_ino != inodes[p.name])
    valid = sum(label_files.read_output(p) is not None for p in out.glob("*_labels.tif"))
    ref = run_folder(in_dir, work / "ref", args.method, files=files, devices="cpu")
    a, b = _labels(work / "ref"), _labels(out)
    return {"files": len(files), "killed_after_outputs": killed_at, "ok": rep.ok, "errors": rep.errors,
            "report_rows": len(json.loads((out / "report.json").read_text())["rows"]),
            "label_files": sum(n.endswith("_labels.tif") for n in names),
            "tables": sum(n.endswith("_objects.csv") for n in names), "valid_label_files": valid,
            "temp_files": sum(n.startswith(label_files.TEMP_PREFIX) for n in names),
            "outputs_written_twice": rewritten, "identical_to_in_process": sum(np.array_equal(a[k], b.get(k)) for k in a),
            "reference_ok": ref.ok}


def scaling(args, work: Path) -> dict:
    from napari_gpuseg.engine.jobs.clusters import connect
    from napari_gpuseg.engine.jobs.dask_runner import run_folder_dask

    files = _files(args.n)
    in_dir = files[0].parent
    times = {1: [], 2: []}
    with connect("local", n_workers=1) as one, connect("local", n_workers=2) as two:
        handles = {1: one, 2: two}
        for k, h in handles.items():  # warm-up: imports and the model load on every worker
            run_folder_dask(h.client, in_dir, work / f"warm{k}", args.method, files=files[:4], device="cpu",
                            overwrite=True)
        t0 = time.perf_counter()  # what one task costs the cluster itself (no work in it)
        two.client.gather(two.client.map(_noop, range(500), pure=False))
        per_task_ms = (time.perf_counter() - t0) / 500 * 1000
        for r in range(args.repeats):
            for k in ((1, 2) if r % 2 == 0 else (2, 1)):
                t0 = time.perf_counter()
                rep = run_folder_dask(handles[k].client, in_dir, work / f"s{k}", args.method, files=files,
                                      device="cpu", overwrite=True)
                times[k].append(time.perf_counter() - t0)
                assert rep.ok == len(files), rep.summary()
        control = {1: [], 2: []}  # the same clusters on pure CPU work: what the machine gives
        for r in range(args.repeats):
            for k in ((1, 2) if r % 2 == 0 else (2, 1)):
                t0 = time.perf_counter()
                handles[k].client.gather(handles[k].client.map(_busy, range(len(files)), pure=False))
                control[k].append(time.perf_counter() - t0)
    t1, t2 = min(times[1]), min(times[2])
    c1, c2 = min(control[1]), min(control[2])
    return {"files": len(files), "method": args.method, "one_worker_s": [round(t, 1) for t in times[1]],
            "two_workers_s": [round(t, 1) for t in times[2]], "speedup": round(t1 / t2, 3),
            "efficiency": round(t1 / (2 * t2), 3), "overhead_ms_per_task": round(per_task_ms, 2),
            "control_one_worker_s": [round(t, 1) for t in control[1]],
            "control_two_workers_s": [round(t, 1) for t in control[2]],
            "control_efficiency": round(c1 / (2 * c2), 3),
            "load_avg_after": os.getloadavg()}


def _noop(i):
    return i


def _busy(i, seconds: float = 0.25):
    """Pure CPU work of a fixed CPU time: the efficiency the machine itself allows."""
    t0, x = time.process_time(), 0
    while time.process_time() - t0 < seconds:
        x += 1
    return i


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("section", choices=("identical", "kill", "scaling"))
    p.add_argument("--n", type=int, default=48)
    p.add_argument("--method", default="threshold")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="gpuseg-dask-bench-"))
    try:
        res = {"identical": identical, "kill": kill, "scaling": scaling}[args.section](args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
