"""Allocator benchmark: user vs kernel CPU time of one workload under allocator set-ups,
each in a fresh process, taking turns (A B C A B C ...) so all see the same machine load.

    OMP_NUM_THREADS=2 python benchmarks/allocator.py [--rounds 2] [--work embed,embed-thread,unet,folder]
    OMP_NUM_THREADS=2 python benchmarks/allocator.py --work embed-worker --setups at-import,scoped

Scoping (``--setups at-import,scoped``, workload ``embed-worker``):

* ``at-import``: the set-up applied when the package is imported, before anything else, and
  no trim (what the program did until the set-up was scoped);
* ``scoped``: nothing at import; the inference worker applies it when it runs its first CPU
  job and trims the heap (``malloc_trim``) when it goes idle (what the program does now).

Set-ups (every child starts from the parent's environment with all ``MALLOC_*`` removed):

* ``glibc-default``: nothing set and the program's own set-up off (``NAPARI_GPUSEG_MALLOC=0``):
  what the program did before;
* ``program``: nothing set in the environment; the program configures glibc itself
  (:func:`napari_gpuseg.engine.runtime.allocator.configure_allocator`, run on import);
* ``env``: ``MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296
  MALLOC_TOP_PAD_=1073741824`` (the program's set-up then stands aside).

Workloads (timed from after model loading; CPU time from ``os.times()`` of the process):

* ``embed``: all 12 native views of one BBBC039 520x696 field with the default SAM model
  (LiteMedSAM, the device policy's precision), in the main thread;
* ``embed-thread``: the same in a second thread, as the GUI's worker runs it;
* ``unet``: the bundled U-Net's labels for 4 BBBC039 fields;
* ``folder``: the folder pipeline (``run_folder``, threshold method) over 12 fields;
* ``embed-worker``: ``embed`` as the GUI runs it: the model loaded and the field embedded
  as jobs of an :class:`~napari_gpuseg.engine.runtime.worker.InferenceWorker` (the embedding
  job timed); ``rss after`` is the process RSS once the worker is idle again.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
from _data import shared_data  # noqa: E402  (benchmarks/, the script's folder)
from _machine import cpu_name  # noqa: E402  (benchmarks/, the script's folder)
DATA = shared_data() / "bbbc039"
GLIBC_ENV = {"MALLOC_MMAP_THRESHOLD_": "4294967296", "MALLOC_TRIM_THRESHOLD_": "4294967296",
             "MALLOC_TOP_PAD_": "1073741824"}
SETUPS = ("glibc-default", "program", "env")
SCOPED_SETUPS = ("at-import", "scoped")


def _fields(n: int) -> list[Path]:
    return sorted((DATA / "images").glob("*.tif"))[-n:]


def child(work: str) -> dict:
    """Run one workload in this process; returns times and what the allocator set-up did."""
    sys.path.insert(0, str(ROOT))
    import napari_gpuseg  # noqa: F401
    import tifffile

    from napari_gpuseg.engine.runtime import allocator
    from napari_gpuseg.engine.runtime.allocator import configure_allocator

    setup = os.environ.get("NAPARI_GPUSEG_BENCH_SETUP")
    state = None if setup == "scoped" else configure_allocator()  # at start, as an import-time set-up did
    if setup == "at-import":  # and never trimmed, as before the set-up was scoped
        allocator.trim = lambda *_a, **_k: False
    if work == "embed-worker":
        import psutil

        from napari_gpuseg.engine.runtime.worker import InferenceWorker
        from napari_gpuseg.engine.sam.loader import load_engine

        worker = InferenceWorker()
        engine = worker.submit(load_engine).result()
        image = tifffile.imread(_fields(1)[0])

        def embed():
            img = engine.prepare(image)
            engine.embed([img])
            assert engine.is_embedded(img)

        t0, w0 = os.times(), time.perf_counter()
        worker.submit(embed).result()
        t1, wall = os.times(), time.perf_counter() - w0
        while worker.busy:
            time.sleep(0.01)
        time.sleep(0.5)  # the worker's idle trim
        rss = psutil.Process().memory_info().rss
        worker.shutdown()
        return {"user": t1.user - t0.user, "sys": t1.system - t0.system, "wall": wall,
                "rss": rss, "state": allocator._state.get("result", "not configured")}
    if work.startswith("embed"):
        from napari_gpuseg.engine.sam.loader import load_engine

        engine = load_engine()
        image = tifffile.imread(_fields(1)[0])

        def run():
            img = engine.prepare(image)
            engine.embed([img])
            assert engine.is_embedded(img)
    elif work == "unet":
        from napari_gpuseg.engine.unet import unet_checkpoint as unet_ckpt, predict as unet

        model = unet_ckpt.load_unet(None, device="cpu")
        images = [tifffile.imread(f) for f in _fields(4)]

        def run():
            for im in images:
                unet.predict_labels(model, im)
    elif work == "folder":
        from napari_gpuseg.engine.jobs.pipeline import run_folder

        src = Path(tempfile.mkdtemp())
        for f in _fields(12):
            (src / f.name).write_bytes(f.read_bytes())

        def run():
            with tempfile.TemporaryDirectory() as out:
                report = run_folder(src, out, "threshold", image_batch=4)
                assert report.ok == report.total
    else:
        raise SystemExit(f"unknown workload {work}")
    t0, w0 = os.times(), time.perf_counter()
    if work == "embed-thread":
        th = threading.Thread(target=run)
        th.start()
        th.join()
    else:
        run()
    t1, wall = os.times(), time.perf_counter() - w0
    return {"user": t1.user - t0.user, "sys": t1.system - t0.system, "wall": wall, "state": state}


def run_child(work: str, setup: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.pop("NAPARI_GPUSEG_MALLOC", None)
    env["NAPARI_GPUSEG_BENCH_SETUP"] = setup
    if setup == "glibc-default":
        env["NAPARI_GPUSEG_MALLOC"] = "0"
    elif setup == "env":
        env.update(GLIBC_ENV)
    out = subprocess.run([sys.executable, __file__, "--child", work], env=env, capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--work", default="embed,embed-thread,unet,folder")
    ap.add_argument("--setups", default=",".join(SETUPS),
                    help=f"comma list of {', '.join(SETUPS + SCOPED_SETUPS)}; the first is the reference")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child)), flush=True)
        return
    setups = tuple(args.setups.split(","))
    ref = setups[0]
    lines = [f"date {datetime.date.today()}, {cpu_name()}, "
             f"{os.cpu_count()} cores, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '-')}, "
             f"{args.rounds} rounds taking turns, medians",
             "", f"| workload | set-up | wall s | user s | sys s | sys / CPU | wall vs {ref} | CPU vs {ref} "
                 "| rss after MiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for work in args.work.split(","):
        res: dict = {s: [] for s in setups}
        for _ in range(args.rounds):
            for s in setups:
                r = run_child(work, s)
                res[s].append(r)
                print(work, s, r, flush=True)
        med = {s: {k: statistics.median(r.get(k, float("nan")) for r in res[s])
                   for k in ("wall", "user", "sys", "rss")} for s in setups}
        for s in setups:
            m = med[s]
            lines.append(f"| {work} | {s} | {m['wall']:.1f} | {m['user']:.1f} | {m['sys']:.1f} | "
                         f"{m['sys'] / max(m['user'] + m['sys'], 1e-9):.0%} | "
                         f"{m['wall'] / med[ref]['wall']:.2f}x | "
                         f"{(m['user'] + m['sys']) / (med[ref]['user'] + med[ref]['sys']):.2f}x | "
                         f"{m['rss'] / 2**20:.0f} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
