"""A real Slurm on this machine (local-slurm.sh): a cluster started in a directory of its own,
`sbatch --wait` of the real batch file, and what a job's output and processes show."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers.images import read_metrics
from helpers.processes import ROOT, clean_env

LOCAL_SLURM = ROOT / "local-slurm.sh"
SBATCH_FILE = ROOT / "run_training.sbatch"

# The single-node clusters share the host's network, and run jobs at the same time: one_node,
# timed_node and the others each in a group of its own (make test runs the groups at once,
# docs/tests.md). A job
# derives its rendezvous port from its id (10000 + id % 20000, ddpkit/job/contract.py), and every
# cluster would number its jobs from 1: each numbers them from a block of its own instead. (The
# clusters in network namespaces have ports of their own.)
FIRST_JOB_ID = {"one_node": 1001, "bound_node": 3001, "roomy_node": 5001, "gpu_node": 7001, "timed_node": 9001}


def on_host_network(name: str, **settings: str) -> dict[str, str]:
    """The environment that starts the single-node cluster `name`: its local-slurm.sh settings,
    and the first of its block of job ids (FIRST_JOB_ID)."""
    return clean_env(**settings, LOCAL_SLURM_CONF=f"FirstJobId={FIRST_JOB_ID[name]}")


class Cluster:
    def __init__(self, directory: Path, nodes: int, env: dict[str, str]):
        self.dir, self.nodes, self.env = directory, nodes, env
        result = subprocess.run([str(LOCAL_SLURM), "start", str(directory), str(nodes)], env=env,
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, f"cannot start a local Slurm cluster:\n{result.stdout}{result.stderr}"

    def sbatch(self, submit_dir: Path, options: list[str], args: list[str], batch_file: Path = SBATCH_FILE,
               **env: str) -> subprocess.Popen:
        """Start `sbatch --wait` of the real batch file (or a user's copy of it) from submit_dir;
        returns the running client. The job runs the tests' interpreter unless env names
        another environment."""
        submit_dir.mkdir(parents=True, exist_ok=True)
        job_env = {**self.env, "SCRIPT": str(ROOT / "mnist_ddp.py"), "PYTHON": sys.executable, **env}
        job_env = {k: v for k, v in job_env.items() if v is not None}
        cmd = [str(LOCAL_SLURM), "exec", str(self.dir), "sbatch", "--wait", "--parsable", *options, str(batch_file), *args]
        return subprocess.Popen(cmd, cwd=submit_dir, env=job_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def run(self, *command: str) -> str:
        """What a Slurm command (sinfo, scontrol, ...) run against this cluster prints."""
        return subprocess.run([str(LOCAL_SLURM), "exec", str(self.dir), *command], env=self.env, capture_output=True,
                              text=True, timeout=60).stdout

    def every_node_idle(self, timeout: float = 300) -> None:
        """Wait until every node is idle again after a test that cut one off or killed its daemons,
        resuming a node that Slurm drained meanwhile: a step that could not report its end
        while its node was cut off holds its slurmstepd past UnkillableStepTimeout, and Slurm
        drains the node ("Kill task failed"), as it would on a real cluster."""
        deadline, states = time.monotonic() + timeout, {}
        while time.monotonic() < deadline:
            listed = self.run("sinfo", "-h", "-N", "-o", "%N %T")
            states = dict(line.split() for line in listed.splitlines() if line.strip())
            if states and all(state == "idle" for state in states.values()):
                return
            for node, state in states.items():
                if state.startswith("drain"):
                    self.run("scontrol", "update", f"nodename={node}", "state=resume")
            time.sleep(1)
        raise AssertionError(f"the cluster's nodes are not all idle within {timeout:g} s: {states}")

    def stop(self):
        subprocess.run([str(LOCAL_SLURM), "stop", str(self.dir)], env=self.env, capture_output=True, timeout=120)


def finish(client: subprocess.Popen, submit_dir: Path, timeout: float = 400, code: int = 0) -> tuple[str, str]:
    """Wait for `sbatch --wait`; return (job id, output file text) after checking the exit code."""
    out, err = client.communicate(timeout=timeout)
    job_id = out.strip().split(";")[0]
    log = submit_dir / f"mnist-ddp-{job_id}.out"
    text = log.read_text() if log.exists() else "(no output file)"
    assert client.returncode == code, f"sbatch exit {client.returncode}\n{err}\n{text[-4000:]}"
    return job_id, text


def wait_for_epoch_1(client: subprocess.Popen, submit_dir: Path) -> str:
    """Wait until a job's output shows its first epoch; returns the job id."""
    deadline = time.monotonic() + 300
    logs = []
    while time.monotonic() < deadline and client.poll() is None:
        logs = list(submit_dir.glob("mnist-ddp-*.out"))
        if logs and re.search(r"^0: epoch   1 \|", logs[0].read_text(), re.M):
            break
        time.sleep(0.2)
    assert logs, "the job wrote no output"
    return logs[0].name.split("-")[-1].removesuffix(".out")


def usr1_saves_requeues_and_resumes(cluster: Cluster, launcher: str, submit_dir: Path) -> None:
    """Slurm's --signal, sent now: the job saves, requeues itself, resumes and completes.
    In torchrun mode the batch file passes SIGUSR1 on to torchrun as SIGTERM. (One scenario
    on two clusters: one_node's group and own_clusters' each run theirs.)"""
    options = ["--nodes=1", "--ntasks-per-node=2"] if cluster.nodes == 1 else ["--nodes=2", "--ntasks-per-node=1", "--mem=1G"]
    client = cluster.sbatch(submit_dir, [*options, "--cpus-per-task=1"], ["--batch-size", "64", "--ckpt-every", "10"],
                            LAUNCHER=launcher)
    job_id = wait_for_epoch_1(client, submit_dir)
    subprocess.run([str(LOCAL_SLURM), "exec", str(cluster.dir), "scancel", "--signal=USR1", job_id],
                   env=cluster.env, check=True, timeout=60)
    _, out = finish(client, submit_dir)
    assert re.search(rf"^START .* restart=0 .* launcher={launcher} ", out, re.M)
    assert re.search(r"^START .* restart=1 ", out, re.M)
    assert re.search(r"^0: stopping on SIGUSR1 at step \d+: saved ", out, re.M)
    assert re.search(rf"^requeueing Slurm job {job_id} after SIGUSR1; ", out, re.M)  # by the batch shell, on the host
    assert re.search(rf"^0: resumed from \S+/runs/job-{job_id}/checkpoints/ckpt-\d+\.pt: epoch ", out, re.M)
    metrics = read_metrics(submit_dir / "runs" / f"job-{job_id}")
    assert [m["epoch"] for m in metrics] == list(range(1, 9))
    assert metrics[-1]["test_accuracy"] >= 0.95


# ----------------------------------------------------------------------------- a job's ranks and output

FAST = ["--batch-size", "64", "--ckpt-every", "10"]  # 32 steps an epoch on 2 ranks, a checkpoint every 10


def rank_pids(run_name: str, rank: int) -> list[int]:
    """The training processes of rank `rank` of the run, found as an operator would: by
    their command line and the rank variables their launcher gave them."""
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if not any(a.endswith(b"mnist_ddp.py") for a in args) or f"--run-name={run_name}".encode() not in args:
            continue
        if b"torch.distributed.run" in args or args[0].endswith(b"bash"):
            continue  # torchrun's agent, or the batch file's wrapper
        under_torchrun = any(e.startswith(b"TORCHELASTIC_RUN_ID=") for e in env)
        if f"{'RANK' if under_torchrun else 'SLURM_PROCID'}={rank}".encode() in env:
            pids.append(int(proc.name))
    return pids


def output_of(submit_dir: Path) -> str:
    logs = list(submit_dir.glob("mnist-ddp-*.out"))
    return logs[0].read_text() if logs else ""


def wait_for(submit_dir: Path, pattern: str, count: int = 1, timeout: float = 300) -> float:
    """Wait until the job's output holds `pattern` (a regex, per line) `count` times; returns when."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(re.findall(pattern, output_of(submit_dir), re.M)) >= count:
            return time.monotonic()
        time.sleep(0.1)
    raise AssertionError(f"no {pattern!r} x{count} in the output within {timeout} s:\n{output_of(submit_dir)[-3000:]}")


def signal_rank(run_name: str, rank: int, sig: signal.Signals) -> float:
    deadline = time.monotonic() + 60
    while not (pids := rank_pids(run_name, rank)):
        assert time.monotonic() < deadline, f"rank {rank} of {run_name} is not running"
        time.sleep(0.1)
    for pid in pids:
        os.kill(pid, sig)
    return time.monotonic()


def lost_steps(out: str) -> list[int]:
    """Per restart: the step a lost peer was noticed at, minus the step the next attempt resumed from."""
    noticed = [int(s) for s in re.findall(r"lost contact with another rank during .* at step (\d+) ", out)]
    resumed = [int(s) for s in re.findall(r"^0: resumed from \S+: epoch \d+, step (\d+) ", out, re.M)]
    return [n - r for n, r in zip(noticed, resumed, strict=False)]
