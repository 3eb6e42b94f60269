"""Folder pipeline on real images mixed with broken files (napari_gpuseg.engine.jobs.pipeline)."""
from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
import tifffile

from batch_helpers import BAD, GOOD, REAL, SlowThreshold, bbbc, make_mixed_folder
from napari_gpuseg import io as gio
from napari_gpuseg.io import label_files, tables
from napari_gpuseg.engine.classical import classical_segment
from napari_gpuseg.engine.runtime.cancel import CancelToken
from napari_gpuseg.engine.jobs.builtin_methods import ThresholdSegmenter
from napari_gpuseg.engine.jobs.method_registry import MethodUnavailable, SegResult, Segmenter, available_methods, create_method, register_method, unregister_method
from napari_gpuseg.engine.metrics import object_f1
from napari_gpuseg.engine.jobs.pipeline import PipelineError, output_paths, resolve_shard, run_folder, shard_files

PATTERN = "*.tif*,*.png"


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, shared_data):
    folder = tmp_path_factory.mktemp("mixed")
    gts = make_mixed_folder(folder, shared_data)
    return folder, gts


@pytest.fixture(scope="module")
def first_run(mixed, tmp_path_factory):
    folder, _ = mixed
    out = tmp_path_factory.mktemp("out")
    events = []
    report = run_folder(folder, out, "threshold", pattern=PATTERN, image_batch=3,
                        progress=events.append, devices="cpu")
    return out, report, events


@pytest.mark.usefixtures("reuse_embeddings")
def test_good_images_correct_bad_images_clear_errors(mixed, first_run):
    folder, gts = mixed
    out, report, _ = first_run
    rows = {r.file: r for r in report.rows}
    assert set(rows) == GOOD | set(BAD)
    assert report.total == len(GOOD) + len(BAD)
    for name, expect in BAD.items():
        assert rows[name].status == "error", name
        assert expect.lower() in rows[name].error.lower(), rows[name].error
        assert not output_paths(folder, out, folder / name)[0].exists()
    for name in GOOD:
        row = rows[name]
        assert row.status == "ok", (name, row.error)
        lp, tp = output_paths(folder, out, folder / name)
        labels = tifffile.imread(lp)
        assert row.objects == len(np.unique(labels)) - 1 > 20
        # the same labels as calling the method directly, and close to the ground truth
        image = gio.to_gray(gio.read_image(folder / name))
        np.testing.assert_array_equal(labels, classical_segment(image))
        assert object_f1(gts[name], labels, 0.5) > 0.8, name
        table = tables.read_csv(tp)
        assert len(table) == row.objects
        assert {"label", "area", "bbox_y0", "centroid_x"} <= set(table[0])
    assert "NaN" in rows["float_nan.tif"].notes
    assert report.failed and report.errors == len(BAD) and report.ok == len(GOOD)


def test_report_files(first_run):
    out, report, _ = first_run
    csv_rows = tables.read_csv(out / "report.csv")
    assert [r["file"] for r in csv_rows] == sorted(r.file for r in report.rows)
    assert {r["status"] for r in csv_rows} == {"ok", "error"}
    doc = json.loads((out / "report.json").read_text())
    assert doc["ok"] == len(GOOD) and doc["errors"] == len(BAD) and len(doc["rows"]) == doc["total"]
    assert not list(out.rglob(label_files.TEMP_PREFIX + "*"))


def test_progress_events(first_run):
    _, report, events = first_run
    done = [e.done for e in events]
    assert done == sorted(done) and done[-1] == report.total
    assert events[-1].ok == len(GOOD) and events[-1].errors == len(BAD)
    assert events[-1].images_per_s > 0 and events[-1].eta_s == 0
    assert sum(e.row is not None for e in events) == report.total


def test_rerun_skips_valid_outputs_and_overwrite_redoes(mixed, first_run):
    folder, _ = mixed
    out, _, _ = first_run
    written = sorted(out.glob("*_labels.tif"))
    mtimes = {p: p.stat().st_mtime_ns for p in written}
    report = run_folder(folder, out, "threshold", pattern=PATTERN, devices="cpu")
    assert report.skipped == len(GOOD) and report.ok == 0 and report.errors == len(BAD)
    assert {p: p.stat().st_mtime_ns for p in written} == mtimes
    # a truncated output is not "done": it is redone
    victim = output_paths(folder, out, folder / REAL[0])[0]
    victim.write_bytes(victim.read_bytes()[:100])
    report = run_folder(folder, out, "threshold", pattern=PATTERN, devices="cpu")
    assert report.ok == 1 and label_files.is_valid_output(victim)
    report = run_folder(folder, out, "threshold", pattern="IXM*", overwrite=True, devices="cpu")
    assert report.ok == len(REAL) and report.skipped == 0


class Recorder(Segmenter):
    """Records batches and threads; fails on images whose first pixel is 999."""

    spatial_ndims = (2,)

    def __init__(self, log, **kw):
        super().__init__(**kw)
        self.log = log

    def load(self, policy):
        super().load(policy)
        self.log.append(("load", threading.current_thread().name, str(policy.device)))
        time.sleep(0.5)  # a model load takes time: readers fill the queue meanwhile

    def segment(self, images):
        self.log.append(("batch", [im.shape for im in images]))
        if any(im.flat[0] == 999 for im in images):
            raise RuntimeError("bad pixel")
        return [SegResult((im > 0).astype(np.uint8), {1: 0.5}) for im in images]


def test_same_shape_batching_load_once_per_device_and_bad_image_isolated(tmp_path):
    rng = np.random.default_rng(0)
    for i in range(12):
        shape = (32, 40) if i % 2 else (24, 24)
        img = (rng.random(shape) > 0.5).astype(np.uint16)
        if i == 5:
            img[0, 0] = 999
        tifffile.imwrite(tmp_path / f"im{i:02d}.tif", img)
    log: list = []
    report = run_folder(tmp_path, tmp_path / "out", lambda: Recorder(log), image_batch=4,
                        devices=["cpu", "cpu"], io_workers=2)
    loads = [e for e in log if e[0] == "load"]
    assert len(loads) == 2 and all(name.startswith("gpuseg-worker") for _, name, _ in loads)
    batches = [e[1] for e in log if e[0] == "batch"]
    assert all(len(set(b)) == 1 and len(b) <= 4 for b in batches)  # one shape per call
    assert max(len(b) for b in batches) > 1
    rows = {r.file: r for r in report.rows}
    assert rows["im05.tif"].status == "error" and "bad pixel" in rows["im05.tif"].error
    assert report.ok == 11 and {r.device for r in report.rows if r.status == "ok"} == {"cpu"}
    table = tables.read_csv(tmp_path / "out" / "im00_objects.csv")
    assert table[0]["score"] == "0.5"


def test_output_folder_inside_input_recursive_mirrors_tree(tmp_path, shared_data):
    img, _ = bbbc(shared_data, REAL[0])
    (tmp_path / "a" / "b").mkdir(parents=True)
    tifffile.imwrite(tmp_path / "a" / "b" / "x.tif", img[:128, :128])
    tifffile.imwrite(tmp_path / "y.tif", img[:128, :128])
    for _ in range(2):  # the second run must not pick up its own outputs
        report = run_folder(tmp_path, tmp_path / "labels", "threshold", recursive=True)
        assert sorted(r.file for r in report.rows) == ["a/b/x.tif", "y.tif"]
    assert (tmp_path / "labels" / "a" / "b" / "x_labels.tif").is_file()
    report = run_folder(tmp_path, tmp_path, "threshold")  # same folder: outputs not inputs
    assert [r.file for r in report.rows] == ["y.tif"]


def test_cancel_stops_fast_and_leaves_no_partial_files(mixed, tmp_path):
    folder, _ = mixed
    cancel = CancelToken()

    def on_progress(p):
        if p.ok >= 1 and not cancel.cancelled:
            cancel.cancel()

    report = run_folder(folder, tmp_path, lambda: SlowThreshold(delay=1.0), pattern="IXM*",
                        image_batch=1, progress=on_progress, cancel=cancel, io_workers=1)
    assert report.cancelled
    assert not list(tmp_path.rglob(label_files.TEMP_PREFIX + "*"))
    for p in tmp_path.glob("*_labels.tif"):
        assert label_files.is_valid_output(p)
    assert len(list(tmp_path.glob("*_labels.tif"))) == report.ok == 1


def test_method_that_cannot_load_fails_the_run(tmp_path, mixed):
    class Broken(Segmenter):
        def load(self, policy):
            raise FileNotFoundError("no such model file: /x.pt")

    with pytest.raises(PipelineError, match="no such model file"):
        run_folder(mixed[0], tmp_path, lambda: Broken(), pattern="IXM*")
    assert not list(tmp_path.rglob("*_labels.tif"))


def test_method_that_cannot_unload_is_logged_and_results_kept(tmp_path, caplog):
    """A failing unload() after the last batch is a logged warning, not a lost run."""
    class Sticky(Segmenter):
        name = "sticky"

        def segment(self, images):
            return [SegResult((im > 0).astype(np.uint8), {1: 0.5}) for im in images]

        def unload(self):
            raise RuntimeError("device busy")

    tifffile.imwrite(tmp_path / "a.tif", np.ones((16, 16), np.uint16))
    with caplog.at_level("WARNING", logger="napari_gpuseg.engine.jobs"):
        report = run_folder(tmp_path, tmp_path / "out", lambda: Sticky(), devices="cpu")
    assert report.ok == 1
    assert any("sticky" in r.getMessage() and "device busy" in r.getMessage() for r in caplog.records)


def test_shards_cover_every_file_exactly_once(mixed, tmp_path):
    folder, _ = mixed
    files = gio.scan_folder(folder, PATTERN)
    parts = [shard_files(files, i, 3, root=folder) for i in range(3)]
    flat = [p for part in parts for p in part]
    assert sorted(flat) == sorted(files) and len(flat) == len(set(flat))
    assert shard_files(list(reversed(files)), 1, 3, root=folder) == parts[1]  # order-free
    seen = []
    # an in-flight write of shard 2 (in the shared output folder) must survive shards 0 and 1
    stem = parts[2][0].name.split(".")[0]
    other = tmp_path / f"{label_files.TEMP_PREFIX}{stem}_labels.tif.0badcafe.tmp"
    other.write_bytes(b"partial")
    for i in range(3):
        env = {"SLURM_ARRAY_TASK_ID": str(i + 1), "SLURM_ARRAY_TASK_MIN": "1",
               "SLURM_ARRAY_TASK_COUNT": "3"}
        report = run_folder(folder, tmp_path, "threshold", pattern=PATTERN, env=env)
        assert report.shard == f"{i}/3"
        seen += [r.file for r in report.rows]
        assert (tmp_path / f"report_shard{i}of3.csv").is_file()
        assert other.exists() == (i < 2)  # shard 2 cleans up its own leftovers
    assert sorted(seen) == sorted(f.name for f in files) and len(seen) == len(set(seen))


def test_resolve_shard():
    assert resolve_shard("2/5", {}) == (2, 5)
    assert resolve_shard(None, {}) is None
    assert resolve_shard(None, {"SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_COUNT": "8"}) == (4, 8)
    env = {"SLURM_ARRAY_TASK_ID": "6", "SLURM_ARRAY_TASK_MIN": "0", "SLURM_ARRAY_TASK_MAX": "14",
           "SLURM_ARRAY_TASK_STEP": "2"}
    assert resolve_shard(None, env) == (3, 8)
    assert resolve_shard("1/2", {"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_COUNT": "4"}) == (1, 2)
    for bad in ("3/3", "x", "1/0"):
        with pytest.raises(ValueError):
            resolve_shard(bad, {})


def test_registry():
    assert {"threshold", "unet"} <= set(available_methods(all_registered=True))
    assert isinstance(create_method("threshold", sigma=1.0), ThresholdSegmenter)
    with pytest.raises(MethodUnavailable, match="unknown method"):
        create_method("no-such-method")
    with pytest.raises(TypeError, match="unknown option"):
        create_method("threshold", sigmaa=1.0)
    register_method("ghost", "napari_gpuseg.engine.no_such_module:Thing")
    try:
        assert "ghost" not in available_methods() and "ghost" in available_methods(True)
        with pytest.raises(MethodUnavailable, match="not available"):
            create_method("ghost")
    finally:
        unregister_method("ghost")


def test_threshold_prepare_rejects_4d_and_converts_rgb():
    seg = create_method("threshold")
    assert seg.prepare(np.zeros((4, 5, 3), np.uint8)).shape == (4, 5)
    with pytest.raises(gio.UnsupportedDimensionsError, match="ZYX"):
        seg.prepare(np.zeros((2, 3, 8, 8)))


def test_unet_method_matches_engine_call(tmp_path, shared_data, cpu_policy):
    import torch

    from napari_gpuseg.engine.unet import unet_checkpoint as unet_ckpt, predict as unet
    from napari_gpuseg.models.unet import UNetConfig, build_unet

    torch.manual_seed(0)
    net = build_unet(UNetConfig(depth=2, base=4))
    ckpt = unet_ckpt.save_checkpoint(tmp_path / "tiny.pt", net, postprocess={"interior_threshold": 0.34})
    img, _ = bbbc(shared_data, REAL[0])
    crops = {"a.tif": img[:64, :64], "b.tif": img[64:128, :64], "c.tif": img[:48, 100:180]}
    for name, crop in crops.items():
        tifffile.imwrite(tmp_path / name, crop)
    report = run_folder(tmp_path, tmp_path / "out", "unet", image_batch=4, devices="cpu",
                        precision="fp32", method_options={"model": str(ckpt), "min_size": 1})
    assert report.ok == 3, [r.error for r in report.rows]
    loaded = unet_ckpt.load_unet(ckpt, device="cpu")
    for name, crop in crops.items():
        expect = unet.predict_labels(loaded, crop, policy=cpu_policy, postprocess={"min_size": 1})
        got = tifffile.imread(tmp_path / "out" / name.replace(".tif", "_labels.tif"))
        np.testing.assert_array_equal(got, expect)
        table = tables.read_csv(tmp_path / "out" / name.replace(".tif", "_objects.csv"))
        assert expect.max() > 0 and len(table) == expect.max() and all(0 <= float(r["score"]) <= 1 for r in table)
    with pytest.raises(PipelineError, match="not found"):
        run_folder(tmp_path, tmp_path / "out2", "unet", method_options={"model": str(tmp_path / "x.pt")})


def test_method_options_parsed():
    from napari_gpuseg.engine.jobs.method_registry import parse_options

    assert parse_options("detector=unet, min_size=20, thr=0.5, flag=true") == {
        "detector": "unet", "min_size": 20, "thr": 0.5, "flag": True}
    assert parse_options(["a=b=c"]) == {"a": "b=c"}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_options("oops")
