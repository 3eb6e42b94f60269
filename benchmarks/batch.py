"""Folder pipeline benchmark: pipeline images/s vs the model-only rate on the same images in
memory, vs a naive sequential load -> segment -> save loop; effect of the image batch size
and of the number of I/O workers. All in one run, on the same files.

    OMP_NUM_THREADS=2 python benchmarks/batch.py [--method threshold] [--n 48] [--out FILE]
    python benchmarks/batch.py --method unet --device cuda --n 256      # on a GPU

Images: the 24 BBBC039 fields (520x696 uint16) from ``../shared/data`` (or ``--data``),
repeated under new names up to ``--n`` files. ``--method unet`` without ``--model`` uses
the bundled model, or a randomly initialised U-Net of the same size if none is bundled
(speed does not depend on the weights; the object count does). Every timing is the best of
``--repeats``, model-only, naive and pipeline runs taking turns so that all see the same
machine load; the pipeline timings include model loading and thread start-up.
"""
from __future__ import annotations

import argparse
import datetime
import platform
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from napari_gpuseg import io as gio
from napari_gpuseg.io import label_files, tables
from napari_gpuseg.engine.runtime.device import device_name, make_policy
from napari_gpuseg.engine.jobs.method_registry import method_factory
from napari_gpuseg.engine.jobs.pipeline import output_paths, run_folder

LINES: list[str] = []
OUT_FILE: list[Path] = []


def emit(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)
    if OUT_FILE:  # written as we go, so a run cut short keeps what it measured
        OUT_FILE[0].write_text("\n".join(LINES) + "\n")


def default_data() -> Path:
    from _data import shared_data  # benchmarks/, the script's folder

    return shared_data() / "bbbc039" / "images"


def make_folder(src: Path, n: int, dst: Path) -> list[Path]:
    files = sorted(src.glob("*.tif"))
    if not files:
        sys.exit(f"no images in {src}")
    dst.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        shutil.copy(files[i % len(files)], dst / f"img{i:04d}_{files[i % len(files)].name}")
    return sorted(dst.glob("*.tif"))


def sync(policy) -> None:
    if policy.device.type == "cuda":
        import torch

        torch.cuda.synchronize(policy.device)


def random_unet(path: Path) -> Path:
    import torch

    from napari_gpuseg.engine.unet import unet_checkpoint as unet_ckpt
    from napari_gpuseg.models.unet import UNetConfig, build_unet

    torch.manual_seed(0)
    return unet_ckpt.save_checkpoint(path, build_unet(UNetConfig()))


def in_thread(fn):
    """Run ``fn`` in a fresh thread, as the pipeline's device worker does (on this CPU,
    torch ran the same U-Net 2-3x slower in the main thread than in a new thread)."""
    out: dict = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001
            out["error"] = exc

    t = threading.Thread(target=target)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def model_only(factory, policy, files, image_batch: int):
    """A callable: segment (+ finish) of every image already in memory, in one thread."""
    seg = factory()
    seg.load(policy)
    images = [seg.prepare(gio.read_image(f)) for f in files]

    def run():
        for i in range(0, len(images), image_batch):
            for raw in seg.segment(images[i : i + image_batch]):
                seg.finish(raw)
        sync(policy)

    run()  # warm-up (CUDA context, cuDNN autotuning, allocator)
    return run


def naive(factory, policy, files, in_dir: Path, out_dir: Path):
    """A callable: a sequential read -> segment -> write loop (model loaded once)."""
    seg = factory()
    seg.load(policy)

    def run():
        for f in files:
            img = seg.prepare(gio.read_image(f))
            res = seg.finish(seg.segment([img])[0])
            lp, tp = output_paths(in_dir, out_dir, f)
            tables.write_object_table(tp, res.labels, res.scores)
            label_files.write_labels(lp, res.labels)

    return run


class UtilSampler:
    """GPU utilisation (NVML, percent) sampled every 50 ms while active."""

    def __init__(self, policy):
        self.policy, self.samples, self._stop = policy, [], threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self):
        from napari_gpuseg.engine.runtime import memory

        while not self._stop.wait(0.05):
            util = memory.snapshot(self.policy.device).utilization
            if util is not None:
                self.samples.append(util)

    def __enter__(self):
        if self.policy.device.type == "cuda":
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()

    def text(self) -> str:
        if not self.samples:
            return "n/a"
        return f"mean {np.mean(self.samples):.0f} %, max {np.max(self.samples):.0f} %"


def pipeline_run(method, options, in_dir, out_dir, device, precision, image_batch, io_workers):
    """A callable: one full pipeline run into an empty output folder."""
    def run():
        shutil.rmtree(out_dir, ignore_errors=True)
        report = run_folder(in_dir, out_dir, method, method_options=options, devices=device,
                            precision=precision, image_batch=image_batch, io_workers=io_workers)
        assert report.ok == report.total, [r.error for r in report.rows if r.error][:3]

    return run


def interleaved(runs: dict, repeats: int) -> dict:
    """Best time of each callable, the callables taking turns so all see the same load."""
    times: dict = {k: [] for k in runs}
    for _ in range(repeats):
        for k, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: min(v) for k, v in times.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="threshold")
    ap.add_argument("--model", default=None)
    ap.add_argument("--data", type=Path, default=default_data())
    ap.add_argument("--n", type=int, default=48)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", default="auto")
    ap.add_argument("--image-batch", type=int, default=4)
    ap.add_argument("--io-workers", type=int, default=2)
    ap.add_argument("--batches", default="1,2,4,8", help="image batch sizes to sweep")
    ap.add_argument("--workers", default="1,2,4", help="I/O worker counts to sweep")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="also write the markdown here")
    ap.add_argument("--two-workers", action="store_true",
                    help="also run two device workers on the same device (device,device)")
    args = ap.parse_args(argv)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        OUT_FILE.append(args.out)

    tmp = Path(tempfile.mkdtemp(prefix="gpuseg-bench-"))
    try:
        in_dir, out_dir = tmp / "in", tmp / "out"
        files = make_folder(args.data, args.n, in_dir)
        model = args.model
        if args.method == "unet" and model is None:
            from napari_gpuseg.engine.unet.unet_checkpoint import bundled_model_path

            model = str(bundled_model_path()) if bundled_model_path().is_file() else None
            model = model or str(random_unet(tmp / "random_unet.pt"))
        options = {"model": model}
        factory = method_factory(args.method, **options)
        policy = make_policy(args.device, args.precision)
        n = len(files)

        emit(f"### Folder pipeline, method `{args.method}`, {policy.describe()}")
        emit()
        emit(f"{datetime.date.today()}, {platform.machine()} {platform.python_version()}, "
             f"{n} BBBC039 images 520x696 uint16, best of {args.repeats}. Command: "
             f"`python benchmarks/batch.py {' '.join(sys.argv[1:] if argv is None else argv)}`")
        emit()
        run_model = in_thread(lambda: model_only(factory, policy, files, args.image_batch))
        run_naive = in_thread(lambda: naive(factory, policy, files, in_dir, tmp / "naive"))
        run_pipe = pipeline_run(args.method, options, in_dir, out_dir, args.device, args.precision,
                                args.image_batch, args.io_workers)
        best_t = in_thread(lambda: interleaved(
            {"model": run_model, "naive": run_naive, "pipe": run_pipe}, args.repeats))
        t_model, t_naive, t_pipe = best_t["model"], best_t["naive"], best_t["pipe"]
        with UtilSampler(policy) as util_pipe:
            if policy.device.type == "cuda":
                run_pipe()
        with UtilSampler(policy) as util_model:
            if policy.device.type == "cuda":
                in_thread(run_model)
        emit("| run | images/s | vs model-only |")
        emit("| --- | ---: | ---: |")
        rate_model = n / t_model
        for name, t in ((f"model only, images in memory (image batch {args.image_batch})", t_model),
                        ("naive loop: read, segment, write, one at a time", t_naive),
                        (f"pipeline (image batch {args.image_batch}, {args.io_workers} I/O workers)",
                         t_pipe)):
            emit(f"| {name} | {n / t:.2f} | {(n / t) / rate_model:.2f} |")
        emit()
        emit(f"Pipeline / model-only = **{t_model / t_pipe:.2f}** (target >= 0.9); "
             f"pipeline / naive loop = **{t_naive / t_pipe:.2f}x**.")
        emit()
        emit("| image batch | I/O workers | pipeline images/s | vs model-only |")
        emit("| ---: | ---: | ---: | ---: |")
        for b in [int(x) for x in args.batches.split(",") if x]:
            for w in [int(x) for x in args.workers.split(",") if x]:
                t = interleaved({"p": pipeline_run(args.method, options, in_dir, out_dir, args.device,
                                                   args.precision, b, w)}, args.repeats)["p"]
                emit(f"| {b} | {w} | {n / t:.2f} | {t_model / t:.2f} |")
        if args.two_workers:
            dev = str(policy.device)
            t = interleaved({"p": pipeline_run(args.method, options, in_dir, out_dir, f"{dev},{dev}",
                                               args.precision, args.image_batch, args.io_workers)},
                            args.repeats)["p"]
            emit(f"| {args.image_batch} | {args.io_workers} (2 device workers on {dev}) | "
                 f"{n / t:.2f} | {t_model / t:.2f} |")
        emit()
        emit(f"Device: {device_name(policy.device)}.")
        if policy.device.type == "cuda":
            emit(f"GPU utilisation (NVML) during the pipeline run: {util_pipe.text()}; "
                 f"during the model-only run: {util_model.text()}.")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
