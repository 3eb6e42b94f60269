"""``napari-gpuseg batch``: exit codes, sharding, Ctrl-C, and SIGKILL then resume."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tifffile

from batch_helpers import BAD, GOOD, make_mixed_folder
from napari_gpuseg.io import label_files, tables
from napari_gpuseg.cli.main import main

HELPERS = Path(__file__).with_name("batch_helpers.py")
PATTERN = "*.tif*,*.png"


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, shared_data):
    folder = tmp_path_factory.mktemp("mixed")
    make_mixed_folder(folder, shared_data)
    return folder


@pytest.fixture(scope="module")
def eight(tmp_path_factory, shared_data):
    """Eight real BBBC039 images."""
    folder = tmp_path_factory.mktemp("eight")
    for src in sorted((shared_data / "bbbc039" / "images").glob("*.tif"))[:8]:
        shutil.copy(src, folder / src.name)
    return folder


def test_exit_code_says_files_failed(mixed, tmp_path, capsys):
    rc = main(["batch", str(mixed), str(tmp_path), "--pattern", PATTERN, "--quiet",
               "--method", "threshold", "--image-batch", "2", "--io-workers", "1"])
    out = capsys.readouterr().out
    assert rc == 1
    assert f"{len(GOOD)} ok" in out and f"{len(BAD)} errors" in out
    for name in BAD:
        assert f"error  {name}:" in out
    assert len(list(tmp_path.glob("*_labels.tif"))) == len(GOOD)
    # only good files -> exit code 0 (and they are skipped now: already done)
    rc = main(["batch", str(mixed), str(tmp_path), "--pattern", "IXM*,rgb.png", "--quiet", "--method", "threshold"])
    assert rc == 0 and "0 ok, 4 skipped" in capsys.readouterr().out


def test_usage_errors_exit_2(mixed, tmp_path, capsys):
    assert main(["batch", str(mixed), str(tmp_path), "--method", "nope", "--quiet"]) == 2
    assert "unknown method 'nope'" in capsys.readouterr().err
    assert main(["batch", str(tmp_path / "missing"), str(tmp_path), "--quiet", "--method", "threshold"]) == 2
    assert main(["batch", str(mixed), str(tmp_path), "--shard", "5/2", "--quiet", "--method", "threshold"]) == 2
    assert main(["batch", str(mixed), str(tmp_path), "--set", "sigmaa=1", "--quiet", "--method", "threshold"]) == 2
    assert "unknown option(s) ['sigmaa']" in capsys.readouterr().err
    assert main(["batch", str(mixed), str(tmp_path), "--set", "oops", "--quiet", "--method", "threshold"]) == 2
    assert main(["batch", "--list-methods"]) == 0
    assert "threshold" in capsys.readouterr().out


def test_the_default_pattern_is_the_docks_and_a_folder_it_misses_is_named(mixed, tmp_path, capsys):
    """The terminal takes what the Batch folder dock takes (TIFF and PNG); a folder whose
    files the pattern misses (JPEGs here) says what it holds and which pattern takes them,
    instead of a silent "0/0 files"."""
    import argparse

    import imageio.v3 as iio

    from napari_gpuseg import io as gio
    from napari_gpuseg.cli.batch import add_batch_parser

    parser = argparse.ArgumentParser()
    add_batch_parser(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["batch", "a", "b"]).pattern == gio.DEFAULT_PATTERN == PATTERN
    assert main(["batch", str(mixed), str(tmp_path / "o"), "--quiet", "--method", "threshold"]) == 1
    assert (tmp_path / "o" / "rgb_labels.tif").exists()  # the PNG was taken
    jpgs = tmp_path / "jpgs"
    jpgs.mkdir()
    img = tifffile.imread(next(iter(sorted(mixed.glob("IXM*.tif")))))
    for i in range(3):
        iio.imwrite(jpgs / f"field{i}.jpg", (img / img.max() * 255).astype(np.uint8))
    (jpgs / "notes.txt").write_text("plate 3")
    assert main(["batch", str(jpgs), str(tmp_path / "j"), "--quiet", "--method", "threshold"]) == 0
    err = capsys.readouterr().err
    assert f"no file in {jpgs} matches the file pattern '{PATTERN}'; it holds 3 .jpg, 1 .txt: " \
           "set the pattern to '*.jpg'" in err, err
    assert main(["batch", str(jpgs), str(tmp_path / "j"), "--quiet", "--method", "threshold",
                 "--pattern", "*.jpg"]) == 0
    assert "3 ok" in capsys.readouterr().out


def test_cli_shards_cover_every_file_once(eight, tmp_path, capsys):
    for i in range(3):
        assert main(["batch", str(eight), str(tmp_path), "--shard", f"{i}/3", "--quiet", "--method", "threshold"]) == 0
    rows = []
    for i in range(3):
        rows += [r["file"] for r in tables.read_csv(tmp_path / f"report_shard{i}of3.csv")]
    assert sorted(rows) == sorted(p.name for p in eight.glob("*.tif")) and len(set(rows)) == 8


def test_ctrl_c_exits_130_and_leaves_no_temp(eight, tmp_path, capsys, monkeypatch):
    """Ctrl-C once the first label file is written (not at a fixed time: a loaded machine
    starts slower): exit 130, 'cancelled', no temporary file, the finished files valid and
    the run stopped before the last of the 8 (each takes 0.5 s)."""
    monkeypatch.setenv("NAPARI_GPUSEG_TEST_DELAY", "0.5")
    stop = threading.Event()

    def interrupt_after_first_file():
        deadline = time.monotonic() + 120
        while not stop.is_set() and time.monotonic() < deadline:
            if list(tmp_path.glob("*_labels.tif")):
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.02)

    watcher = threading.Thread(target=interrupt_after_first_file, daemon=True)
    watcher.start()
    try:
        rc = main(["batch", str(eight), str(tmp_path), "--method", "slow-threshold", "--plugin",
                   str(HELPERS), "--image-batch", "1", "--quiet"])
    finally:
        stop.set()
        watcher.join()
    assert rc == 130
    assert "cancelled" in capsys.readouterr().out
    assert not list(tmp_path.rglob(label_files.TEMP_PREFIX + "*"))
    done = list(tmp_path.glob("*_labels.tif"))
    assert 0 < len(done) < 8 and all(label_files.is_valid_output(p) for p in done)


def _cli(*args, env_extra=None):
    env = dict(os.environ, OMP_NUM_THREADS="2", **(env_extra or {}))
    return [sys.executable, "-m", "napari_gpuseg.cli.main", "batch", *map(str, args),
            *(() if "--method" in map(str, args) else ("--method", "threshold"))], env


def test_sigkill_then_rerun_completes_without_rewriting(eight, tmp_path, capsys):
    out = tmp_path / "out"
    cmd, env = _cli(eight, out, "--method", "slow-threshold", "--plugin", HELPERS,
                    "--image-batch", "1", "--io-workers", "2", "--quiet",
                    env_extra={"NAPARI_GPUSEG_TEST_DELAY": "0.4"})
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 40
        while len(list(out.glob("*_labels.tif"))) < 3:
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "no progress before the kill"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("*_labels.tif")}
    assert 3 <= len(before) < 8
    # every file under its real name is complete, whatever the kill interrupted
    for p in out.glob("*_labels.tif"):
        assert label_files.is_valid_output(p), p
    assert not (out / "report.csv").exists()

    assert main(["batch", str(eight), str(out), "--quiet", "--method", "threshold"]) == 0
    assert f"{8 - len(before)} ok, {len(before)} skipped, 0 errors" in capsys.readouterr().out
    after = {p.name: p.stat().st_mtime_ns for p in out.glob("*_labels.tif")}
    assert len(after) == 8 and all(after[n] == t for n, t in before.items())  # none rewritten
    for p in out.glob("*_labels.tif"):
        labels = tifffile.imread(p)
        assert labels.shape == (520, 696) and labels.max() > 0
        assert (out / p.name.replace("_labels.tif", "_objects.csv")).is_file()
    assert not list(out.rglob(label_files.TEMP_PREFIX + "*"))
    rows = tables.read_csv(out / "report.csv")
    assert sorted(r["status"] for r in rows) == sorted(["ok"] * (8 - len(before)) + ["skipped"] * len(before))
    assert np.all([r["error"] == "" for r in rows])
