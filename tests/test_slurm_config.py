"""``--cluster slurm``: the job script dask-jobqueue would submit, from a config file,
without a SLURM installation (nothing is submitted)."""
from pathlib import Path

import pytest

pytest.importorskip("dask_jobqueue")

from napari_gpuseg.engine.jobs.clusters import ClusterError, load_cluster_config, slurm_cluster  # noqa: E402

pytestmark = pytest.mark.timeout(60)
EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "examples" / "slurm.yaml"


def test_job_script_has_the_gpus_memory_time_and_queue_of_the_config(tmp_path):
    cfg = load_cluster_config(EXAMPLE)
    cfg["scheduler_options"] = {"host": "127.0.0.1", "dashboard_address": "127.0.0.1:0"}  # binds nothing else
    cluster, jobs = slurm_cluster(cfg)
    try:
        script = cluster.job_script()
    finally:
        cluster.close()
    assert jobs == 8
    lines = script.splitlines()
    assert "#SBATCH --gres=gpu:1" in lines
    assert "#SBATCH -p gpu" in lines
    assert "#SBATCH -t 04:00:00" in lines
    assert "#SBATCH --cpus-per-task=8" in lines
    assert any(line.startswith("#SBATCH --mem=") and "G" in line for line in lines)
    assert "--nthreads 8" in script and "--memory-limit 29.80GiB" in script
    assert "tcp://127.0.0.1:" in script


def test_bad_config_files_are_one_line(tmp_path):
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    (tmp_path / "bad.yaml").write_text("cores: [\n")
    for name, why in [("list.yaml", "expected a mapping"), ("bad.yaml", "not valid YAML"),
                      ("none.yaml", "No such file")]:
        with pytest.raises(ClusterError) as err:
            load_cluster_config(tmp_path / name)
        assert why in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ClusterError, match="cluster config:"):
        slurm_cluster({"no_such_option": 1, "scheduler_options": {"host": "127.0.0.1", "dashboard_address": "127.0.0.1:0"}})
