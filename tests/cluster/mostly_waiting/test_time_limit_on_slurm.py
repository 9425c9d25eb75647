"""The time limit on a real Slurm 22.05 (local-slurm.sh), on the single-node cluster of this
group's own: a job whose batch file has no --signal line requeues itself before Slurm's
limit, again and again, and ends with the weights of the same run uninterrupted. At unit
level: tests/unit/test_time_limit.py.

    python -m pytest tests/cluster/mostly_waiting/test_time_limit_on_slurm.py
"""

import re

import torch

from helpers import preloaded
from helpers.cluster import SBATCH_FILE, finish
from helpers.images import load_params, read_metrics
from helpers.processes import ROOT, clean_env


def test_a_job_without_signal_requeues_itself_before_its_time_limit(timed_node, tmp_path):
    """A site's copy of the batch file without the --signal line, --time=2 (minutes) and about
    130 s of training on one rank (16 epochs of 32 steps, each step made to last at least
    0.25 s by the tests' aid AID_STEP_SECONDS, so that the run's length holds whatever else the
    machine runs): rank 0 says after its first epoch that the run does not fit, saves and stops
    about a minute before the limit (--stop-before auto) with no signal from Slurm, and the
    batch shell requeues the job, again and again (each job trains for about 55 s) until it
    ends with exit 0; its weights are those of the same run uninterrupted, trained beside it."""
    batch_file = tmp_path / "site.sbatch"
    batch_file.write_text("".join(line for line in SBATCH_FILE.read_text().splitlines(keepends=True)
                                  if not line.startswith("#SBATCH --signal")))
    epochs = 16  # (4000 images at the global batch of 128: 32 steps an epoch)
    args = ["--epochs", str(epochs), "--image-every", "0"]
    (tmp_path / "alone").mkdir()
    uninterrupted = preloaded.Run([*args, "--log-dir", "runs", "--run-name", "alone"], tmp_path / "alone",
                                  clean_env(OMP_NUM_THREADS="1"))
    client = timed_node.sbatch(tmp_path, ["--time=2", "--nodes=1", "--ntasks-per-node=1", "--cpus-per-task=1", "--mem=1G"],
                             args, batch_file=batch_file, PROJECT_DIR=str(ROOT), AID_STEP_SECONDS="0.25")
    job_id, out = finish(client, tmp_path, timeout=900)
    assert uninterrupted.wait(600).returncode == 0
    assert re.search(r"^0: Slurm ends this job in [\w ]+: it saves and stops 60 s before that \(--stop-before auto\)",
                     out, re.M), out[:3000]
    assert re.search(r"^0: needs about \d+ \w+ at this speed, the job ends in \d+ \w+: it will be requeued about ", out, re.M)
    stops = re.findall(r"^0: stopping on the time limit \((\d+) s left\) at step \d+: saved ", out, re.M)
    before = re.findall(rf"^requeueing Slurm job {job_id} after the time limit came near; it resumes from its last "
                        r"checkpoint \((-?\d+) s before the job's time limit\)$", out, re.M)
    assert len(before) == len(stops) >= 2, out[-4000:]
    assert all(int(seconds) > 0 for seconds in before), before  # always requeued before Slurm's limit
    assert "DUE TO TIME LIMIT" not in out and f"job={job_id} exit=0" in out
    assert re.findall(r"^START .* restart=(\d+) ", out, re.M) == [str(n) for n in range(len(stops) + 1)]
    run_dir = tmp_path / "runs" / f"job-{job_id}"
    assert [m["epoch"] for m in read_metrics(run_dir)] == list(range(1, epochs + 1))
    params, alone = load_params(run_dir), load_params(tmp_path / "alone" / "runs" / "alone")
    for name in alone:
        torch.testing.assert_close(params[name], alone[name], rtol=0, atol=0, msg=name)
