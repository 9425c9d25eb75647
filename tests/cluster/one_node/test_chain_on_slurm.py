"""CHAIN on a real Slurm (local-slurm.sh, the one_node cluster): a job that Slurm may not requeue
(sbatch --no-requeue), stopped by SIGUSR1 after its first epoch, submits the job that continues
the run itself (sbatch --dependency=afterany:<its id>), which resumes at the saved step and
finishes; after END it names that job instead of a line to submit. The timeline it prints
(each job's START and END) is the one docs/recovery.md quotes. The same from inside salloc:
the chained job keeps the batch file's job name and output file.

    python -m pytest -s tests/cluster/one_node/test_chain_on_slurm.py
"""

import datetime
import re
import subprocess
import sys
import time
from pathlib import Path

from ddpkit.job.contract import JobPaths
from helpers.cluster import FAST, LOCAL_SLURM, SBATCH_FILE, finish, wait_for_epoch_1
from helpers.images import read_metrics
from helpers.processes import ROOT


def wait_for_end(output: Path, timeout: float = 400) -> str:
    """The output of a job that Slurm starts on its own (no `sbatch --wait` waits for it), once
    it holds the END line."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = output.read_text() if output.exists() else ""
        if re.search(r"^END ", text, re.M):
            return text
        time.sleep(0.5)
    raise AssertionError(f"{output.name} has no END line within {timeout} s:\n{text[-3000:]}")


def line_time(pattern: str, text: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(re.search(pattern, text, re.M).group(1))


def test_a_job_slurm_will_not_requeue_chains_the_job_that_continues_the_run(one_node, tmp_path):
    client = one_node.sbatch(tmp_path, ["--no-requeue", "--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1"],
                             [*FAST, "--epochs", "3"], CHAIN="2")
    first = wait_for_epoch_1(client, tmp_path)
    signalled = datetime.datetime.now(datetime.timezone.utc)
    subprocess.run([str(LOCAL_SLURM), "exec", str(one_node.dir), "scancel", "--signal=USR1", first],
                   env=one_node.env, check=True, timeout=60)
    _, out = finish(client, tmp_path, code=75)
    assert f"Slurm job {first} may not be requeued (it was submitted without --requeue)" in out, out[-3000:]
    chained = re.search(rf"^Slurm did not requeue job {first}: chained Slurm job (\d+), which continues the run once "
                        rf"this one has ended \(sbatch --dependency=afterany:{first}, CHAIN=1\)$", out, re.M)
    assert chained, out[-3000:]
    second = chained.group(1)
    assert re.search(rf"^END \S+ job={first} exit=75 chained: Slurm job {second} continues the run$", out, re.M)
    assert out.splitlines()[-1] == f"nothing to submit: Slurm job {second} already continues the run (squeue --job {second})"
    assert "0: run_training.sbatch requeues the job when this step has ended; where it cannot, it chains the job that " \
           "continues the run (CHAIN=2)" in out
    assert "to continue" not in out  # (no line to run: run as told, it would queue a second job)
    stopped = int(re.search(r"^0: stopping on SIGUSR1 at step (\d+): saved ", out, re.M).group(1))

    text = wait_for_end(tmp_path / f"mnist-ddp-{second}.out")
    run_dir = tmp_path / "runs" / f"job-{first}"
    assert re.search(rf"^START \S+ job={second} restart=0 .* run={run_dir}$", text, re.M), text[:3000]
    resumed = re.search(rf"^0: resumed from {run_dir}/checkpoints/ckpt-\d+\.pt: epoch \d+, step (\d+) ", text, re.M)
    assert resumed and int(resumed.group(1)) == stopped, text[-3000:]
    assert re.search(rf"^END \S+ job={second} exit=0$", text, re.M), text[-3000:]
    assert "chained" not in text and "to continue from" not in text  # (finished: nothing to chain)
    assert [m["epoch"] for m in read_metrics(run_dir)] == [1, 2, 3]
    assert not (run_dir / JobPaths.CHAINED_JOB).exists()  # (cleared by the chained job as it started)

    start_1, end_1 = line_time(r"^START (\S+) ", out), line_time(r"^END (\S+) ", out)
    start_2, end_2 = line_time(r"^START (\S+) ", text), line_time(r"^END (\S+) ", text)
    print(f"\nCHAIN timeline: job {first} START +0 s, USR1 at +{(signalled - start_1).total_seconds():.0f} s, END (exit 75, "
          f"chained {second}) +{(end_1 - start_1).total_seconds():.0f} s; job {second} START "
          f"+{(start_2 - start_1).total_seconds():.0f} s ({(start_2 - end_1).total_seconds():.0f} s after the first END), "
          f"END (exit 0) +{(end_2 - start_1).total_seconds():.0f} s")


def test_a_job_chained_from_inside_salloc_keeps_the_batch_files_job_name(one_node, tmp_path):
    """Inside salloc, the batch file run with CHAIN=1 and stopped on SIGUSR1 at step 20 (the
    rehearsed stop): Slurm requeues no allocation, so it chains the job that continues the
    run, which starts once the allocation has ended. That job is named as the batch file names
    it (mnist-ddp-<id>.out), not after the allocation, resumes at the saved step and
    finishes; the allocation's output names it, after END, as the job that continues the run."""
    inner = tmp_path / "inside.sh"
    inner.write_text(f"CHAIN=1 RUN_NAME=salloc-chain bash {SBATCH_FILE} {' '.join(FAST)} --epochs 2 --interrupt-at 20:USR1; "
                     "echo BATCH=$?\n")
    env = {**one_node.env, "SCRIPT": str(ROOT / "mnist_ddp.py"), "PYTHON": sys.executable}
    result = subprocess.run([str(LOCAL_SLURM), "exec", str(one_node.dir), "salloc", "-N1", "-n2", "--cpus-per-task=1",
                             "bash", str(inner)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = result.stdout + result.stderr
    assert "BATCH=75" in out and "is an interactive allocation (salloc), which Slurm does not requeue" in out, out[-4000:]
    chained = re.search(r"^Slurm did not requeue job (\d+): chained Slurm job (\d+), which continues the run", out, re.M)
    assert chained, out[-4000:]
    first, second = chained.groups()
    assert f"\nnothing to submit: Slurm job {second} already continues the run (squeue --job {second})\n" in out, out[-3000:]
    assert "to continue" not in out, out[-3000:]
    deadline = time.monotonic() + 300
    while not list(tmp_path.glob(f"*-{second}.out")) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert [path.name for path in tmp_path.glob("*.out")] == [f"mnist-ddp-{second}.out"]  # (not interactive-<id>.out)
    text = wait_for_end(tmp_path / f"mnist-ddp-{second}.out")
    assert re.search(r"^0: resumed from \S+/runs/salloc-chain/checkpoints/ckpt-0*20\.pt: epoch \d+, step 20 ", text, re.M), \
        text[-3000:]
    assert re.search(rf"^END \S+ job={second} exit=0$", text, re.M), text[-3000:]
    assert [m["epoch"] for m in read_metrics(tmp_path / "runs" / "salloc-chain")] == [1, 2]
