"""Bad input to cluster runs: one line each, before anything starts or listens, and no
silent waits: an address where no scheduler answers, worker and thread counts, SLURM without
sbatch, bad cluster-config values, Ctrl-C while the cluster starts, options a cluster cannot
honour, and a file given as IN."""
import http.server
import os
import signal
import threading

import pytest

distributed = pytest.importorskip("distributed")

from napari_gpuseg.cli.batch import main  # noqa: E402
from napari_gpuseg.engine.jobs import clusters  # noqa: E402
from napari_gpuseg.engine.jobs.clusters import ClusterError, connect, slurm_options  # noqa: E402
from napari_gpuseg.engine.runtime.cancel import Cancelled, CancelToken  # noqa: E402

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def images(shared_data, tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    for f in sorted((shared_data / "bbbc039_more" / "images").glob("*.tif"))[:2]:
        os.symlink(f, folder / f.name)
    return folder


@pytest.fixture
def no_cluster_start(monkeypatch):
    """Fails the test if a cluster is started or reached."""
    def refuse(*a, **k):
        raise AssertionError("a cluster was started before the options were checked")

    monkeypatch.setattr(clusters, "connect", refuse)
    monkeypatch.setattr(clusters, "local_cluster", refuse)


def _last_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    return err[-1] if err else ""


def test_an_address_where_no_scheduler_answers_is_bounded_and_one_line():
    """A web server on 127.0.0.1 (a dashboard port, say): the client used to wait far past
    its timeout (110-120 s for 20 s)."""
    class Quiet(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    server.daemon_threads = True
    t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    t.start()
    try:
        with pytest.raises(ClusterError) as err:
            connect(scheduler=f"tcp://127.0.0.1:{server.server_address[1]}", timeout=2)
    finally:
        server.shutdown()
        server.server_close()
    msg = str(err.value)
    assert "\n" not in msg and "127.0.0.1" in msg and ("scheduler" in msg)


def test_worker_and_thread_counts_below_one_are_refused(images, tmp_path, capsys, no_cluster_start):
    for flag, value in (("--workers", "0"), ("--workers", "-1"), ("--threads-per-worker", "-2")):
        with pytest.raises(SystemExit) as exit_:
            main([str(images), str(tmp_path / "o"), "--cluster", "local", flag, value])
        assert exit_.value.code == 2
        assert f"{flag}: must be >= 1" in capsys.readouterr().err
    for kw in ({"n_workers": 0}, {"threads_per_worker": -2}):
        with pytest.raises(ClusterError, match="must be a whole number >= 1"):
            clusters.check_counts(kw.get("n_workers"), kw.get("threads_per_worker", 1))


def test_a_scheduler_without_workers_says_so_and_cancel_ends_the_wait():
    """It used to wait 300 s in silence, deaf to the first Ctrl-C."""
    from distributed import LocalCluster

    empty = LocalCluster(n_workers=0, processes=True, host="127.0.0.1", dashboard_address="127.0.0.1:0")
    token, heard = CancelToken(), []

    def notify(text):
        heard.append(text)
        token.cancel()

    try:
        with pytest.raises(Cancelled):
            connect(scheduler=empty.scheduler_address, cancel=token, notify=notify, wait_workers=60)
    finally:
        empty.close()
    assert len(heard) == 1 and heard[0].startswith("waiting for a Dask worker to join tcp://127.0.0.1:")


def test_slurm_without_sbatch_is_one_line_and_starts_nothing(images, tmp_path, capsys, monkeypatch):
    pytest.importorskip("dask_jobqueue")
    import dask_jobqueue

    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch here
    started = []
    monkeypatch.setattr(dask_jobqueue, "SLURMCluster", lambda **k: started.append(k))
    assert main([str(images), str(tmp_path / "o"), "--cluster", "slurm", "--quiet"]) == 2
    line = _last_line(capsys)
    assert line.startswith("napari-gpuseg batch: --cluster slurm needs SLURM's sbatch") and not started


def test_bad_cluster_config_values_name_the_file_and_the_key(images, tmp_path, capsys, monkeypatch):
    pytest.importorskip("dask_jobqueue")
    for text, key in (("jobs: -2\n", "jobs"), ("gpus: -3\n", "gpus"), ("jobs: many\n", "jobs")):
        cfg = tmp_path / "slurm.yaml"
        cfg.write_text(text)
        assert main([str(images), str(tmp_path / "o"), "--cluster", "slurm", "--cluster-config", str(cfg),
                     "--quiet"]) == 2
        line = _last_line(capsys)
        assert f"cluster config {cfg}: {key}:" in line and "must be a whole number" in line
    opts, jobs = slurm_options({"gpus": 2, "jobs": 3})
    assert jobs == 3 and "--gres=gpu:2" in opts["job_extra_directives"]
    assert opts["scheduler_options"]["dashboard_address"].startswith("127.0.0.1:")


def test_ctrl_c_while_the_cluster_starts_exits_130(images, tmp_path, capsys, monkeypatch):
    """Ctrl-C reaches the starting worker processes too; their start-up then fails
    ("Nanny failed to start"): that used to be exit 2 with that message."""
    def interrupted_start(*a, **k):
        os.kill(os.getpid(), signal.SIGINT)
        raise RuntimeError("Nanny failed to start.")

    monkeypatch.setattr(clusters, "local_cluster", interrupted_start)
    assert main([str(images), str(tmp_path / "o"), "--cluster", "local", "--workers", "1",
                 "--method", "threshold", "--quiet"]) == 130
    assert "Nanny" not in capsys.readouterr().err


def test_options_a_cluster_cannot_honour_are_refused_before_it_starts(images, tmp_path, capsys,
                                                                      no_cluster_start):
    for extra, word in ((["--io-workers", "3"], "io_workers"), (["--image-batch", "8"], "image_batch"),
                        (["--devices", "cpu,cpu"], "devices cpu,cpu")):
        code = main([str(images), str(tmp_path / "o"), "--cluster", "local", "--quiet", *extra])
        line = _last_line(capsys)
        assert code == 2 and line.startswith(f"napari-gpuseg batch: {word}") and "cluster" in line
    assert not (tmp_path / "o").exists()


def test_one_device_is_every_workers_device():
    from napari_gpuseg.engine.jobs.dask_runner import cluster_options

    assert cluster_options("unet", "cuda:1", None, None) == "cuda:1"
    assert cluster_options("unet", None, None, None) is None


def test_a_file_as_in_says_in_must_be_a_folder(images, tmp_path, capsys):
    f = next(images.iterdir())
    assert main([str(f), str(tmp_path / "o"), "--quiet"]) == 2
    line = _last_line(capsys)
    assert "IN must be a folder of images or a zarr store" in line and "is a file" in line
    assert "not found" not in line
