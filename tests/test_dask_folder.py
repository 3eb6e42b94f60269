"""Folder jobs on a LocalCluster of 2 worker processes (127.0.0.1): the same labels as the
in-process run, a worker killed mid-run, and one clear line for each new failure."""
import json
import os
import signal
import threading
import time

import numpy as np
import pytest

distributed = pytest.importorskip("distributed")

from napari_gpuseg.io import label_files  # noqa: E402
from napari_gpuseg.engine.jobs.clusters import ClusterError, connect  # noqa: E402
from napari_gpuseg.engine.jobs.dask_runner import run_folder_dask  # noqa: E402
from napari_gpuseg.engine.jobs.pipeline import PipelineError, run_folder  # noqa: E402

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def cluster():
    handle = connect("local", n_workers=2, threads_per_worker=1)
    try:
        yield handle
    finally:
        handle.close()


@pytest.fixture(scope="module")
def images(shared_data, tmp_path_factory):
    folder = tmp_path_factory.mktemp("in")
    for f in sorted((shared_data / "bbbc039_more" / "images").glob("*.tif"))[:8]:
        os.symlink(f, folder / f.name)
    return folder


def _labels(folder):
    return {p.name: label_files.read_labels(p) for p in sorted(folder.glob("*_labels.tif"))}


def test_workers_run_this_code_on_127_0_0_1(cluster):
    import napari_gpuseg

    where = cluster.client.run(lambda: __import__("napari_gpuseg").__file__)
    assert set(where.values()) == {napari_gpuseg.__file__} and len(where) == 2
    assert all(addr.startswith("tcp://127.0.0.1:") for addr in where)
    assert cluster.dashboard.startswith("http://127.0.0.1:")


def test_same_labels_as_in_process_and_resume(cluster, images, tmp_path):
    events = []
    rep = run_folder_dask(cluster.client, images, tmp_path / "dask", "threshold", progress=events.append)
    assert rep.ok == 8 and rep.errors == 0 and events[-1].done == 8 and events[-1].eta_s == 0
    ref = run_folder(images, tmp_path / "local", "threshold", devices="cpu")
    assert ref.ok == 8
    a, b = _labels(tmp_path / "dask"), _labels(tmp_path / "local")
    assert a.keys() == b.keys() and len(a) == 8
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    assert {r.device for r in rep.rows} == {"cpu"}
    doc = json.loads((tmp_path / "dask" / "report.json").read_text())
    assert doc["ok"] == 8 and len(doc["rows"]) == 8
    again = run_folder_dask(cluster.client, images, tmp_path / "dask", "threshold")
    assert again.skipped == 8 and again.ok == 0


def test_a_worker_killed_mid_run(cluster, images, tmp_path):
    """SIGKILL one worker after the first output: every file still ends with one complete
    output, written once, and a full report."""
    out = tmp_path / "out"
    pids = cluster.client.run(os.getpid)
    result = {}
    t = threading.Thread(target=lambda: result.setdefault(
        "rep", run_folder_dask(cluster.client, images, out, "unet", device="cpu", precision="fp32")))
    t.start()
    inodes, killed = {}, False
    deadline = time.monotonic() + 200
    while t.is_alive() and time.monotonic() < deadline:
        for p in out.glob("*_labels.tif"):
            inodes.setdefault(p.name, p.stat().st_ino)
        if inodes and not killed:
            os.kill(sorted(pids.values())[0], signal.SIGKILL)
            killed = True
        time.sleep(0.05)
    t.join(5)
    rep = result["rep"]
    assert killed and rep.ok == 8 and rep.errors == 0 and not rep.cancelled
    files = sorted(p.name for p in out.iterdir())
    assert len([f for f in files if f.endswith("_labels.tif")]) == 8
    assert len([f for f in files if f.endswith("_objects.csv")]) == 8
    assert not [f for f in files if f.startswith(label_files.TEMP_PREFIX)]
    for p in out.glob("*_labels.tif"):
        assert label_files.read_output(p) is not None
        if p.name in inodes:  # seen before the end: never replaced by a second write
            assert p.stat().st_ino == inodes[p.name]
    assert len(json.loads((out / "report.json").read_text())["rows"]) == 8
    cluster.client.wait_for_workers(2, timeout=60)


def test_a_temp_file_left_mid_run_by_a_dead_writer_is_removed(cluster, images, tmp_path):
    """A worker killed while writing leaves its temp file after the run's first sweep; the
    sweep at the end removes it (its writer is gone; the file was written again elsewhere)."""
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out = tmp_path / "out"
    left = []

    def progress(_p):
        if not left and out.is_dir():
            target = sorted(images.glob("*.tif"))[0].stem + "_objects.csv"
            left.append(out / f"{label_files.TEMP_PREFIX}{target}.{dead.pid}-0badcafe.tmp")
            left[0].write_text("half a table")

    rep = run_folder_dask(cluster.client, images, out, "threshold", progress=progress)
    assert rep.ok == 8 and left and not left[0].exists()
    assert not [p.name for p in out.iterdir() if p.name.startswith(label_files.TEMP_PREFIX)]


def test_worker_without_the_model_is_one_line(cluster, images, tmp_path):
    with pytest.raises(PipelineError) as err:
        run_folder_dask(cluster.client, images, tmp_path / "o", "unet",
                        method_options={"model": str(tmp_path / "missing.pt")})
    msg = str(err.value)
    assert msg.startswith("worker tcp://127.0.0.1:") and "missing.pt" in msg and "\n" not in msg
    assert not list((tmp_path / "o").glob("*_labels.tif"))


def test_out_unwritable_seen_from_a_worker_is_one_line(cluster, images, tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep_labels.tif").write_bytes(b"kept")  # written before: never lost

    def deny():  # this worker's view of OUT: a read-only mount
        from napari_gpuseg.io import label_files as lf

        lf._real_check = getattr(lf, "_real_check", lf.check_writable_dir)

        def check(folder):
            if str(folder) == str(out):
                raise OSError(30, f"output folder {folder} is not writable: Read-only file system")
            return lf._real_check(folder)

        lf.check_writable_dir = check

    def undo():
        from napari_gpuseg.io import label_files as lf

        lf.check_writable_dir = getattr(lf, "_real_check", lf.check_writable_dir)

    cluster.client.run(deny)
    try:
        with pytest.raises(PipelineError) as err:
            run_folder_dask(cluster.client, images, out, "threshold")
    finally:
        cluster.client.run(undo)
    msg = str(err.value)
    assert msg.startswith("worker tcp://") and "Read-only file system" in msg and "\n" not in msg
    assert (out / "keep_labels.tif").read_bytes() == b"kept"


def test_scheduler_unreachable_is_one_line():
    with pytest.raises(ClusterError) as err:
        connect(scheduler="tcp://127.0.0.1:9", timeout=1)
    msg = str(err.value)
    assert msg.startswith("cannot reach the Dask scheduler at tcp://127.0.0.1:9") and "\n" not in msg


def test_cli_batch_on_the_cluster_address(cluster, images, tmp_path, capsys, monkeypatch):
    from napari_gpuseg.cli.batch import main
    from napari_gpuseg.engine.jobs import clusters

    monkeypatch.setattr(clusters, "CONNECT_TIMEOUT_S", 1.0)
    addr = cluster.client.scheduler.address
    assert main([str(images), str(tmp_path / "c"), "--scheduler", addr, "--quiet", "--method", "threshold"]) == 0
    out = capsys.readouterr()
    assert "8 ok" in out.out and "dashboard http://127.0.0.1:" in out.err
    assert len(list((tmp_path / "c").glob("*_labels.tif"))) == 8
    assert main([str(images), str(tmp_path / "d"), "--scheduler", "tcp://127.0.0.1:9", "--quiet", "--method", "threshold"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("napari-gpuseg batch: cannot reach the Dask scheduler")


def test_cancel_stops_the_cluster_run_and_keeps_what_is_written(cluster, images, tmp_path):
    from napari_gpuseg.engine.runtime.cancel import CancelToken

    token = CancelToken()

    def stop_after_first(p):
        if p.row is not None:
            token.cancel()

    rep = run_folder_dask(cluster.client, images, tmp_path / "o", "unet", device="cpu", precision="fp32",
                          progress=stop_after_first, cancel=token)
    assert rep.cancelled and 1 <= rep.ok < 8
    for p in (tmp_path / "o").glob("*_labels.tif"):
        assert label_files.read_output(p) is not None
    assert json.loads((tmp_path / "o" / "report.json").read_text())["cancelled"] is True


def test_batch_dock_runs_on_the_cluster(make_napari_viewer, qtbot, cluster, images, tmp_path):
    from napari_gpuseg.widgets.batch_folder import RUN_ON, BatchFolderWidget

    viewer = make_napari_viewer()
    w = BatchFolderWidget(viewer)
    qtbot.addWidget(w)
    w.in_dir.setText(str(images))
    w.out_dir.setText(str(tmp_path / "out"))
    w.method.setCurrentText("threshold")
    w.run_on.setCurrentText(RUN_ON[1])
    assert w.address.isEnabled()
    w.address.setText(cluster.client.scheduler.address)
    w.start()
    qtbot.waitUntil(lambda: w.report is not None or w.error is not None, timeout=120000)
    assert w.error is None and w.report.ok == 8
    assert w.table.rowCount() == 8 and w.progress.value() == 8 and "done" in w.status.text()
    assert "127.0.0.1" in w.dashboard.text() and "href" in w.dashboard.text()
    assert w.last_progress.eta_s == 0


def test_blocks_of_a_big_image_are_cluster_tasks(cluster, shared_data, tmp_path):
    import zarr

    from napari_gpuseg.engine.blocks import run_blocks
    from napari_gpuseg.io.zarr_images import open_zarr
    from zarr_inputs import field_files, write_mosaic

    path = write_mosaic(field_files(shared_data / "bbbc039" / "images")[:2], tmp_path / "m.ome.zarr",
                        (520, 1392), chunks=256)
    img = open_zarr(path)
    on_cluster = run_blocks(img, tmp_path / "a", "threshold", block=256, halo=48, name="a", client=cluster.client)
    here = run_blocks(img, tmp_path / "b", "threshold", block=256, halo=48, name="b")
    assert on_cluster.blocks == 18 and on_cluster.objects == here.objects > 100
    np.testing.assert_array_equal(zarr.open_array(str(path), path="labels/a/0")[:],
                                  zarr.open_array(str(path), path="labels/b/0")[:])
