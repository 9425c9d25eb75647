"""run_training.sbatch on a real Slurm 22.05 that the tests start with local-slurm.sh:
one node on the host's network, and two nodes in network namespaces of their own so a
job really spans two hosts with different addresses. Also: the torchrun mode, two jobs
at once on one node sharing a data directory, the guard outside Slurm, the helper that
prints torchrun commands (run for real), and bash -n plus shellcheck on every script.

Needs root, Slurm, munge and shellcheck (`./local-slurm.sh install`, which `make test`
runs). A missing Slurm fails these tests; it does not skip them.

    python -m pytest tests/test_slurm.py
"""

import gzip
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, SAMPLE, clean_env, read_metrics

LOCAL_SLURM = ROOT / "local-slurm.sh"
SBATCH_FILE = ROOT / "run_training.sbatch"
SHELL_SCRIPTS = [LOCAL_SLURM, SBATCH_FILE, ROOT / "torchrun_commands.sh", ROOT / "tensorboard.sh", ROOT / ".ci" / "run"]


class Cluster:
    def __init__(self, directory: Path, nodes: int, env: dict[str, str]):
        self.dir, self.nodes, self.env = directory, nodes, env
        result = subprocess.run([str(LOCAL_SLURM), "start", str(directory), str(nodes)], env=env,
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, f"cannot start a local Slurm cluster:\n{result.stdout}{result.stderr}"

    def sbatch(self, submit_dir: Path, options: list[str], args: list[str], **env: str) -> subprocess.Popen:
        """Start `sbatch --wait` of the real batch file from submit_dir; returns the running client."""
        submit_dir.mkdir(parents=True, exist_ok=True)
        job_env = {**self.env, "SCRIPT": str(ROOT / "mnist_ddp.py"), "PYTHON": sys.executable, **env}
        cmd = [str(LOCAL_SLURM), "exec", str(self.dir), "sbatch", "--wait", "--parsable", *options, str(SBATCH_FILE), *args]
        return subprocess.Popen(cmd, cwd=submit_dir, env=job_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def stop(self):
        subprocess.run([str(LOCAL_SLURM), "stop", str(self.dir)], env=self.env, capture_output=True, timeout=120)


def finish(client: subprocess.Popen, submit_dir: Path, timeout: float = 400) -> tuple[str, str]:
    """Wait for `sbatch --wait`; return (job id, output file text) after checking exit 0."""
    out, err = client.communicate(timeout=timeout)
    job_id = out.strip().split(";")[0]
    log = submit_dir / f"mnist-ddp-{job_id}.out"
    text = log.read_text() if log.exists() else "(no output file)"
    assert client.returncode == 0, f"sbatch exit {client.returncode}\n{err}\n{text[-4000:]}"
    return job_id, text


@pytest.fixture(scope="module")
def one_node(tmp_path_factory):
    cluster = Cluster(tmp_path_factory.mktemp("slurm1"), 1, clean_env(LOCAL_SLURM_PORT="16817"))
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    cluster = Cluster(tmp_path_factory.mktemp("slurm2"), 2,
                      clean_env(LOCAL_SLURM_PORT="16827", LOCAL_SLURM_PREFIX="mt", LOCAL_SLURM_SUBNET="10.231.9"))
    yield cluster
    cluster.stop()


def test_two_tasks_on_one_node(one_node, tmp_path):
    client = one_node.sbatch(tmp_path, ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1"], ["--batch-size", "64"])
    job_id, out = finish(client, tmp_path)
    start = re.search(r"^START .* tasks=2 launcher=srun master=127\.0\.0\.1:(\d+) threads=1$", out, re.M)
    assert start and int(start.group(1)) == 10000 + int(job_id) % 20000
    assert "[rank 0/2]" in out and "[rank 1/2]" in out
    assert f"job={job_id} exit=0" in out
    run_dir = tmp_path / "runs" / f"job-{job_id}"
    assert out.count("TensorBoard logs:") == 1 and len(list(run_dir.glob("events.out.tfevents.*"))) == 1
    metrics = read_metrics(run_dir)
    assert len(metrics) == 8 and metrics[-1]["test_accuracy"] >= 0.95 and metrics[-1]["test_images"] == 1000


def test_two_nodes_one_task_each(two_nodes, tmp_path):
    client = two_nodes.sbatch(tmp_path, ["--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", "--mem=1G"],
                              ["--epochs", "1", "--max-steps", "10"])
    job_id, out = finish(client, tmp_path)
    assert re.search(r"^START .* nodes=mtn\[1-2\] tasks=2", out, re.M), out[:500]
    assert "master=10.231.9.11:" in out
    assert re.search(r"^\[rank 0/2\] mtn1 cpu gloo", out, re.M) and re.search(r"^\[rank 1/2\] mtn2 cpu gloo", out, re.M)
    assert '"hosts": ["mtn1", "mtn2"]' in out
    assert read_metrics(tmp_path / "runs" / f"job-{job_id}")[0]["step"] == 10


def test_torchrun_mode_across_two_nodes(two_nodes, tmp_path):
    client = two_nodes.sbatch(tmp_path, ["--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", "--mem=1G"],
                              ["--epochs", "1", "--max-steps", "10"], LAUNCHER="torchrun")
    job_id, out = finish(client, tmp_path)
    assert "launcher=torchrun" in out and '"launcher": "torchrun"' in out
    assert '"hosts": ["mtn1", "mtn2"]' in out
    assert read_metrics(tmp_path / "runs" / f"job-{job_id}")[0]["test_images"] == 1000


def test_two_jobs_at_once_share_a_node_and_a_data_dir(one_node, tmp_path):
    options = ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1"]
    args = ["--epochs", "2", "--max-steps", "40"]
    clients = [one_node.sbatch(tmp_path, options, args) for _ in range(2)]
    (job_a, out_a), (job_b, out_b) = (finish(c, tmp_path) for c in clients)
    port = {job: re.search(r"master=\S+:(\d+)", out).group(1) for job, out in ((job_a, out_a), (job_b, out_b))}
    assert port[job_a] != port[job_b]
    # They really ran at the same time: each started before the other ended.
    times = {job: (re.search(r"^START (\S+)", out, re.M).group(1), re.search(r"^END (\S+)", out, re.M).group(1))
             for job, out in ((job_a, out_a), (job_b, out_b))}
    assert times[job_a][0] <= times[job_b][1] and times[job_b][0] <= times[job_a][1]
    assert (out_a + out_b).count("staged MNISTSample") == 1
    raw = tmp_path / "data" / "MNISTSample" / "raw"
    for name in ("train-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        assert (raw / name).read_bytes() == gzip.decompress((SAMPLE / f"{name}.gz").read_bytes())
    for job in (job_a, job_b):
        assert read_metrics(tmp_path / "runs" / f"job-{job}")[-1]["epoch"] == 2


@pytest.mark.parametrize("cluster, launcher", [("one_node", "srun"), ("two_nodes", "torchrun")])
def test_usr1_saves_requeues_and_resumes(cluster, launcher, request, tmp_path):
    """Slurm's --signal, sent now: the job saves, requeues itself, resumes and completes.
    In torchrun mode the batch file passes SIGUSR1 on to torchrun as SIGTERM."""
    cluster = request.getfixturevalue(cluster)
    options = ["--nodes=1", "--ntasks-per-node=2"] if cluster.nodes == 1 else ["--nodes=2", "--ntasks-per-node=1", "--mem=1G"]
    client = cluster.sbatch(tmp_path, [*options, "--cpus-per-task=1"], ["--batch-size", "64", "--ckpt-every", "10"],
                            LAUNCHER=launcher)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and client.poll() is None:
        logs = list(tmp_path.glob("mnist-ddp-*.out"))
        if logs and re.search(r"^epoch   1 \|", logs[0].read_text(), re.M):
            break
        time.sleep(0.2)
    job_id = logs[0].name.split("-")[-1].removesuffix(".out")
    subprocess.run([str(LOCAL_SLURM), "exec", str(cluster.dir), "scancel", "--signal=USR1", job_id],
                   env=cluster.env, check=True, timeout=60)
    _, out = finish(client, tmp_path)
    assert re.search(rf"^START .* restart=0 .* launcher={launcher} ", out, re.M)
    assert re.search(r"^START .* restart=1 ", out, re.M)
    assert re.search(r"^stopping on SIGUSR1 at step \d+: saved ", out, re.M)
    assert f"requeueing Slurm job {job_id}" in out
    assert re.search(rf"^resumed from \S+/runs/job-{job_id}/checkpoints/ckpt-\d+\.pt: epoch ", out, re.M)
    metrics = read_metrics(tmp_path / "runs" / f"job-{job_id}")
    assert [m["epoch"] for m in metrics] == list(range(1, 9))
    assert metrics[-1]["test_accuracy"] >= 0.95


def test_guard_outside_slurm(tmp_path):
    result = subprocess.run(["bash", str(SBATCH_FILE)], cwd=tmp_path, env=clean_env(), capture_output=True, text=True)
    assert result.returncode == 2
    assert "not inside a Slurm job. Submit it: sbatch run_training.sbatch" in result.stderr


def test_printed_torchrun_commands_run(tmp_path):
    """Two 'machines' on this one, each running the line printed for it."""
    env = clean_env(SCRIPT=str(ROOT / "mnist_ddp.py"), PORT=str(29000 + os.getpid() % 1000), RUN_ID="t",
                    PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    printed = subprocess.run([str(ROOT / "torchrun_commands.sh"), "2", "1", "127.0.0.1", "--max-steps", "4",
                              "--epochs", "1", "--run-dir", "runs/helper"], env=env, capture_output=True, text=True, check=True)
    lines = [line for line in printed.stdout.splitlines() if not line.startswith("#")]
    assert len(lines) == 2 and all("--node-rank=" in line for line in lines)
    machines = [subprocess.Popen(["bash", "-c", line], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True) for line in lines]
    outputs = [m.communicate(timeout=300)[0] for m in machines]
    assert [m.returncode for m in machines] == [0, 0], outputs
    assert read_metrics(tmp_path / "runs" / "helper")[0]["step"] == 4


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: p.name)
def test_shell_scripts_are_clean(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    result = subprocess.run(["shellcheck", "--severity=style", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout
