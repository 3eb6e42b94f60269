"""Ctrl-C on real folder jobs: exit code and report rows vs label files on disk, N trials.

Each trial copies a few BBBC039 images, starts ``napari-gpuseg batch`` in a subprocess,
sends SIGINT a random 0-0.9 s after the first label file appears, and checks: exit 130,
no "terminate called" (SIGABRT), and the ok rows of report.csv equal the label files.

    python benchmarks/ctrl_c_trials.py --method unet --trials 20 [--images 12]
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from napari_gpuseg.io import tables

from _data import shared_data  # noqa: E402  (benchmarks/, the script's folder)
DATA = shared_data() / "bbbc039" / "images"


def trial(in_dir: Path, out: Path, method: str, rng: random.Random) -> tuple[bool, str]:
    cmd = [sys.executable, "-m", "napari_gpuseg.cli.main", "batch", str(in_dir), str(out),
           "--method", method, "--quiet"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="2"))
    deadline = time.monotonic() + 300
    while not list(out.glob("*_labels.tif")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(rng.random() * 0.9)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    labels = sorted(p.name for p in out.glob("*_labels.tif"))
    rows = tables.read_csv(out / "report.csv") if (out / "report.csv").exists() else []
    ok_rows = sorted(r["labels"] for r in rows if r["status"] == "ok")
    good = proc.returncode == 130 and "terminate called" not in err and ok_rows == labels
    return good, f"rc={proc.returncode} labels={len(labels)} ok_rows={len(ok_rows)}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", default="unet")
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--images", type=int, default=12)
    args = ap.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        in_dir = Path(tmp) / "in"
        in_dir.mkdir()
        for p in sorted(DATA.glob("*.tif"))[: args.images]:
            shutil.copy(p, in_dir / p.name)
        passed = 0
        for i in range(args.trials):
            out = Path(tmp) / f"out{i}"
            good, what = trial(in_dir, out, args.method, rng)
            passed += good
            print(f"trial {i + 1}: {'pass' if good else 'FAIL'} {what}", flush=True)
            shutil.rmtree(out, ignore_errors=True)
    print(f"{args.method}: {passed}/{args.trials} trials passed")


if __name__ == "__main__":
    main()
