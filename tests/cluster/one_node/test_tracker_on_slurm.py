"""--tracker mlflow in a Slurm job that requeues itself (local-slurm.sh, the one_node cluster, an
MLflow server the test starts on the host's loopback): the job stops on SIGUSR1 (the hidden
--interrupt-at), is requeued and finishes, and MLflow holds one run with both starts of the
job, its attempts and every step once, in the experiment MLFLOW_EXPERIMENT_NAME names. (Without Slurm: tests/runs/test_trackers_runs.py.)

    python -m pytest tests/cluster/one_node/test_tracker_on_slurm.py
"""

import re

from helpers.cluster import FAST, finish
from helpers.images import read_metrics
from helpers.trackers import MLflowServer


def test_a_requeued_job_is_one_mlflow_run_with_each_step_once(one_node, tmp_path):
    server = MLflowServer(tmp_path / "mlflow")
    try:
        client = one_node.sbatch(tmp_path / "submit", ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1"],
                                 [*FAST, "--tracker", "mlflow", "--interrupt-at", "20:USR1"],
                                 MLFLOW_TRACKING_URI=server.uri, MLFLOW_EXPERIMENT_NAME="requeued jobs")
        job_id, out = finish(client, tmp_path / "submit")
        assert re.search(rf"^requeueing Slurm job {job_id} ", out, re.M), out[-3000:]
        stopped = re.search(r"^0: stopping on SIGUSR1 at step (\d+): saved ", out, re.M).group(1)
        run_dir = tmp_path / "submit" / "runs" / f"job-{job_id}"
        (run,) = server.runs("requeued jobs")  # (the experiment the job named, created for it)
        assert run.info.run_name == f"job-{job_id}" and run.info.status == "FINISHED"
        starts = [run.data.tags.get(f"start.{n}", "") for n in (1, 2, 3)]
        assert re.match(rf"job {job_id}, attempt 1/\d+, world size 2, from step 0, at ", starts[0]), starts
        assert re.match(rf"job {job_id} \(requeued 1x\), attempt 1/\d+, world size 2, from step {stopped}, at ", starts[1]), starts
        assert starts[2] == ""
        records = read_metrics(run_dir)
        for tag, field in (("train/loss", "train_loss"), ("test/accuracy", "test_accuracy")):
            assert server.history(run.info.run_id, tag) == [(r["step"], r[field]) for r in records], tag
    finally:
        server.stop()
