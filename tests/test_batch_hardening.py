"""Folder jobs under hostile but realistic use: Ctrl-C, empty device lists, two runs into
one folder, OUT == IN, symlinks, unwritable and full disks, reruns, bad method options."""
from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tifffile

import batch_helpers  # noqa: F401 - registers slow-threshold
from napari_gpuseg import io as gio
from napari_gpuseg.io import label_files, tables
from napari_gpuseg.cli.main import main
from napari_gpuseg.engine.jobs.method_registry import OptionError, create_method
from napari_gpuseg.engine.jobs.pipeline import PipelineError, output_paths, run_folder

HELPERS = Path(__file__).with_name("batch_helpers.py")


@pytest.fixture(scope="module")
def images(tmp_path_factory, shared_data) -> list[Path]:
    """Four real BBBC039 images (copied: tests may add files beside them)."""
    src = sorted((shared_data / "bbbc039" / "images").glob("*.tif"))[:4]
    folder = tmp_path_factory.mktemp("bbbc")
    for p in src:
        shutil.copy(p, folder / p.name)
    return sorted(folder.glob("*.tif"))


def _copy(images, folder: Path, n=None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for p in images[:n]:
        shutil.copy(p, folder / p.name)
    return folder


def _cli(*args, env_extra=None):
    env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONPATH=str(Path(__file__).parents[1]),
               **(env_extra or {}))
    return [sys.executable, "-m", "napari_gpuseg.cli.main", "batch", *map(str, args),
            *(() if "--method" in map(str, args) else ("--method", "threshold"))], env


# -- 1. Ctrl-C ---------------------------------------------------------------------------
def sigint_trial(in_dir: Path, out: Path, method: str = "unet", timeout: float = 120) -> dict:
    """Run the CLI, send SIGINT once the first label file appears; what happened."""
    cmd, env = _cli(in_dir, out, "--method", method, "--image-batch", "1", "--quiet")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + timeout
        while not list(out.glob("*_labels.tif")):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no output before the deadline"
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    labels = sorted(p.name for p in out.glob("*_labels.tif"))
    rows = tables.read_csv(out / "report.csv") if (out / "report.csv").exists() else []
    return {"rc": proc.returncode, "stderr": stderr, "stdout": stdout, "labels": labels,
            "ok_rows": sorted(r["labels"] for r in rows if r["status"] == "ok")}


def test_ctrl_c_on_a_real_unet_run_exits_130_with_a_row_per_output(images, tmp_path):
    for trial in range(2):
        r = sigint_trial(images[0].parent, tmp_path / f"out{trial}")
        assert r["rc"] == 130, r["stderr"][-500:]
        assert "terminate called" not in r["stderr"]
        assert r["labels"] and r["ok_rows"] == r["labels"]  # report rows == outputs on disk
        assert "cancelled" in r["stdout"]
        assert not list((tmp_path / f"out{trial}").rglob(label_files.TEMP_PREFIX + "*"))


# -- 2. device lists naming no device ------------------------------------------------------
def test_device_list_with_no_device_exits_2_without_hanging(images, tmp_path):
    cmd, env = _cli(images[0].parent, tmp_path / "out", "--devices", ",", "--quiet")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "names no device" in proc.stderr
    assert "Traceback" not in proc.stderr
    for bad in (",", " , ", []):
        with pytest.raises(ValueError, match="names no device"):
            run_folder(images[0].parent, tmp_path / "out2", "threshold", devices=bad)


# -- 3. two runs into one folder -------------------------------------------------------------
def test_temp_clean_up_spares_live_writers(images, tmp_path):
    in_dir = _copy(images, tmp_path / "in", 1)
    out = tmp_path / "out"
    out.mkdir()
    target = output_paths(in_dir, out, in_dir / images[0].name)[0]
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        live_tmp = out / f"{label_files.TEMP_PREFIX}{target.name}.{live.pid}-abcd1234.tmp"
        dead_tmp = out / f"{label_files.TEMP_PREFIX}{target.name}.{dead.pid}-abcd1234.tmp"
        for p in (live_tmp, dead_tmp):
            p.write_bytes(b"partial")
        assert label_files.temp_owner(live_tmp) == live.pid
        report = run_folder(in_dir, out, "threshold", devices="cpu")
        assert report.ok == 1
        assert live_tmp.exists(), "the temp file of another live run was deleted"
        assert not dead_tmp.exists(), "a killed run's temp file was left"
    finally:
        live.kill()
        live.wait()


def test_two_concurrent_runs_into_one_folder_both_finish(images, tmp_path):
    out = tmp_path / "out"
    procs = []
    for _ in range(2):
        cmd, env = _cli(images[0].parent, out, "--method", "slow-threshold", "--plugin", HELPERS,
                        "--image-batch", "1", "--quiet", "--overwrite",
                        env_extra={"NAPARI_GPUSEG_TEST_DELAY": "0.2"})
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    results = [(p.wait(120), p.stderr.read()) for p in procs]
    for rc, err in results:
        assert rc == 0 and "FileNotFoundError" not in err, err
    assert len(list(out.glob("*_labels.tif"))) == len(images)
    assert all(label_files.is_valid_output(p) for p in out.glob("*_labels.tif"))
    assert not list(out.rglob(label_files.TEMP_PREFIX + "*"))


# -- 4. OUT == IN, foreign files, our own outputs as inputs ---------------------------------
def test_out_equal_in_never_replaces_ground_truth(images, tmp_path):
    folder = _copy(images, tmp_path / "data", 2)
    gt_path = folder / images[0].name.replace(".tif", "_labels.tif")
    tifffile.imwrite(gt_path, np.arange(16, dtype=np.uint16).reshape(4, 4))  # a ground truth
    before = gt_path.read_bytes()
    for overwrite in (False, True):
        with pytest.raises(PipelineError, match="output folder is the input folder"):
            run_folder(folder, folder, "threshold", overwrite=overwrite, devices="cpu")
        assert gt_path.read_bytes() == before
    rc = main(["batch", str(folder), str(folder), "--quiet", "--method", "threshold", "--overwrite"])
    assert rc == 2 and gt_path.read_bytes() == before
    # another OUT holding a foreign file under an output name: an error row, file kept
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(gt_path, out / gt_path.name)
    report = run_folder(folder, out, "threshold", overwrite=True, devices="cpu")
    row = {r.file: r for r in report.rows}[images[0].name]
    assert row.status == "error" and "not overwritten" in row.error
    assert (out / gt_path.name).read_bytes() == before and report.ok == 1


def test_out_equal_in_without_collisions_never_reads_own_outputs(images, tmp_path):
    folder = _copy(images, tmp_path / "data", 2)
    report = run_folder(folder, folder, "threshold", pattern="*", devices="cpu")
    assert report.ok == 2 and report.total == 2
    report = run_folder(folder, folder, "threshold", pattern="*", devices="cpu")
    assert report.total == 2 and report.skipped == 2 and report.errors == 0  # no csv/json read


# -- 5. symlinks --------------------------------------------------------------------------
def test_folder_of_symlinks_and_broken_links(images, tmp_path):
    links = tmp_path / "links"
    links.mkdir()
    for p in images[:2]:
        (links / p.name).symlink_to(p)
    (links / "gone.tif").symlink_to(tmp_path / "missing.tif")
    (links / "loop.tif").symlink_to(links / "loop.tif")
    report = run_folder(links, tmp_path / "out", "threshold", devices="cpu")
    rows = {r.file: r for r in report.rows}
    assert report.total == 4 and set(rows) == {images[0].name, images[1].name, "gone.tif", "loop.tif"}
    assert rows[images[0].name].status == "ok" and rows[images[1].name].status == "ok"
    for name in ("gone.tif", "loop.tif"):
        assert rows[name].status == "error" and "broken symbolic link" in rows[name].error


# -- 6. OUT that cannot be written ----------------------------------------------------------
class _Counting(batch_helpers.ThresholdSegmenter):
    calls = 0

    def segment(self, images):
        type(self).calls += 1
        return super().segment(images)


@pytest.mark.parametrize("case", ["file", "proc", "readonly"])
def test_unwritable_out_fails_before_any_work(images, tmp_path, monkeypatch, capsys, case):
    in_dir = images[0].parent
    if case == "file":
        out = tmp_path / "a_file"
        out.write_text("x")
        expect = "is an existing file"
    elif case == "proc":
        out, expect = Path("/proc/gpuseg-x"), "cannot be created"
    else:
        out, expect = tmp_path / "ro", "not writable: Read-only file system"

        def refuse(target):
            raise OSError(errno.EROFS, "Read-only file system")
        monkeypatch.setattr(label_files, "_temp_path", refuse)
    _Counting.calls = 0
    with pytest.raises(PipelineError, match=expect):
        run_folder(in_dir, out, _Counting, devices="cpu")
    assert _Counting.calls == 0
    assert main(["batch", str(in_dir), str(out), "--quiet", "--method", "threshold"]) == 2
    err = capsys.readouterr().err
    assert expect in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


# -- 7. disk full -------------------------------------------------------------------------
_REAL_WRITE = label_files.atomic_write_bytes


def _fill_disk_after(monkeypatch, n_labels: int) -> None:
    real = _REAL_WRITE
    state = {"labels": 0}

    def write(path, data):
        if state["labels"] >= n_labels:
            raise OSError(errno.ENOSPC, "No space left on device")
        out = real(path, data)
        state["labels"] += str(path).endswith("_labels.tif")
        return out
    monkeypatch.setattr(label_files, "atomic_write_bytes", write)


def test_disk_full_keeps_complete_outputs_and_says_why(images, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    _fill_disk_after(monkeypatch, 2)
    report = run_folder(images[0].parent, out, "threshold", devices="cpu", image_batch=1, io_workers=1)
    assert "No space left on device" in report.disk_error
    assert "No space left on device" in report.report_error
    assert report.ok == 2 and len(report.rows) == len(images)
    assert all(r.status == "error" and "No space left" in r.error for r in report.rows if r.status != "ok")
    done = list(out.glob("*_labels.tif"))
    assert len(done) == 2 and all(label_files.is_valid_output(p) for p in done)
    assert not list(out.rglob(label_files.TEMP_PREFIX + "*"))
    # the CLI: a summary, the cause, exit 1, no traceback
    shutil.rmtree(out)
    _fill_disk_after(monkeypatch, 2)
    rc = main(["batch", str(images[0].parent), str(out), "--quiet", "--method", "threshold", "--image-batch", "1",
               "--io-workers", "1"])
    cap = capsys.readouterr()
    assert rc == 1 and "2 ok" in cap.out
    assert "stopped: writing the outputs failed: No space left on device" in cap.err
    assert "report not written" in cap.err and "Traceback" not in cap.err


# -- 8. reruns ----------------------------------------------------------------------------
def test_rerun_keeps_rows_rebuilds_tables_and_warns_on_another_method(images, tmp_path, capsys):
    in_dir, out = images[0].parent, tmp_path / "out"
    first = {r.file: r for r in run_folder(in_dir, out, "threshold", devices="cpu").rows}
    labels_file = output_paths(in_dir, out, images[0])[0]
    assert label_files.output_info(labels_file) == {"napari_gpuseg": 1, "method": "threshold", "model": ""}
    table = output_paths(in_dir, out, images[1])[1]
    table_text = table.read_text()
    table.unlink()
    report = run_folder(in_dir, out, "threshold", devices="cpu")
    assert report.skipped == len(images) and not report.warnings
    for r in report.rows:
        assert (r.shape, r.objects, r.device) == (first[r.file].shape, first[r.file].objects,
                                                  first[r.file].device)
    assert table.is_file() and "rebuilt" in {r.file: r for r in report.rows}[images[1].name].notes
    rebuilt = table.read_text().splitlines()
    assert len(rebuilt) == len(table_text.splitlines())  # same objects (no score column)
    # a run over part of the folder keeps the other rows of the report
    run_folder(in_dir, out, "threshold", pattern=images[0].name, devices="cpu")
    rows = tables.read_csv(out / "report.csv")
    assert sorted(r["file"] for r in rows) == sorted(first)
    assert json.loads((out / "report.json").read_text())["earlier_rows"] == len(images) - 1
    # another method over these outputs: skipped, with a warning naming the method
    rc = main(["batch", str(in_dir), str(out), "--method", "slow-threshold", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 0 and f"{len(images)} existing output(s) were written by method 'threshold'" in err


# -- 9. option validation and the memory guard ---------------------------------------------
@pytest.mark.parametrize("opt, expect", [
    ("min_size=abc", "option min_size='abc' must be an integer >= 0"),
    ("threshold=abc", "option threshold='abc' must be a number"),
    ("sigma=-1", "option sigma=-1 must be a number >= 0"),
    ("sigmaa=1", "unknown option(s) ['sigmaa']"),
])
def test_bad_method_options_exit_2_before_any_work(images, tmp_path, capsys, opt, expect):
    out = tmp_path / "out"
    assert main(["batch", str(images[0].parent), str(out), "--set", opt, "--quiet", "--method", "threshold"]) == 2
    assert expect in capsys.readouterr().err
    assert not out.exists()


def test_method_option_specs():
    with pytest.raises(OptionError, match="overlap=2"):
        create_method("unet", overlap=2)
    with pytest.raises(OptionError, match="detector='x' must be one of"):
        create_method("sam-boxes", detector="x")
    with pytest.raises(OptionError, match="points_per_side"):
        create_method("sam-everything", points_per_side="many")
    create_method("sam-everything", points_per_side=16, pred_iou_thresh=0.8, tiling="tiles")
    create_method("unet", overlap=0.5, roi_size=[128, 128], min_size=5)


def test_max_image_gb_must_be_positive(images, tmp_path, capsys):
    for bad in ("-1", "0", "nan", "abc"):
        with pytest.raises(SystemExit) as exc:
            main(["batch", "--method", "threshold", str(images[0].parent), str(tmp_path), "--max-image-gb", bad])
        assert exc.value.code == 2
    capsys.readouterr()


def test_memory_guard_uses_the_method_estimate(images, tmp_path):
    raw = images[0].stat().st_size  # uncompressed uint16 TIFF: about the pixel bytes
    seg = create_method("threshold")
    assert seg.bytes_per_value >= 20  # measured peak (benchmarks/method_memory.py)
    gio.load_image(images[0], max_bytes=2 * raw)  # the raw bytes alone fit
    with pytest.raises(gio.TooLargeError, match="bytes per pixel value"):
        gio.load_image(images[0], max_bytes=2 * raw, bytes_per_value=seg.bytes_per_value)
    report = run_folder(images[0].parent, tmp_path / "out", "threshold", devices="cpu",
                        max_image_bytes=2 * raw)
    assert report.errors == len(images) and all("needs" in r.error for r in report.rows)
    with pytest.raises(ValueError, match="must be positive"):
        run_folder(images[0].parent, tmp_path / "out", "threshold", max_image_bytes=-1)
