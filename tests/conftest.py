"""Shared helpers: start mnist_ddp.py the way users do (plain, torchrun, as srun would)
in subprocesses, with a clean environment and a data directory of the test's own."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "mnist_ddp.py"
SAMPLE = ROOT / "data" / "mnist-sample"
sys.path.insert(0, str(ROOT))

LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")


def clean_env(**extra: str) -> dict[str, str]:
    """os.environ without any launcher's variables (the tests may themselves run under one)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = str(ROOT)  # for commands that import mnist_ddp from another directory
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_single(args: list[str], cwd: Path, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=cwd, env=clean_env(**env),
                          capture_output=True, text=True, timeout=timeout)


def run_torchrun(nproc: int, args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(SCRIPT), *args]
    return subprocess.run(cmd, cwd=cwd, env=clean_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=timeout)


def run_as_srun(ntasks: int, args: list[str], cwd: Path, timeout: float = 300, job_id: str = "4242",
                command: list[str] | None = None, detach: bool = False):
    """One process per task with the variables srun gives its tasks on one node (job_id ""
    leaves SLURM_JOB_ID out). Returns the finished results, or with detach the processes."""
    host = socket.gethostname()
    port = str(free_port())
    procs = []
    for rank in range(ntasks):
        env = clean_env(SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NTASKS=str(ntasks),
                        SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS=str(ntasks), SLURM_JOB_NODELIST=host,
                        SLURM_STEP_NODELIST=host, SLURM_CPUS_PER_TASK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        if job_id:
            env["SLURM_JOB_ID"] = job_id
        cmd = command or [sys.executable, str(SCRIPT)]
        procs.append(subprocess.Popen([*cmd, *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    if detach:
        return procs
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return results


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


MEASURED = ("images_per_s", "epoch_s", "peak_rss_mb")  # figures of the machine, not of the training


def read_results(run_dir: Path) -> list[dict]:
    """metrics.jsonl without the measured figures: what two identical runs must share."""
    return [{k: v for k, v in m.items() if k not in MEASURED} for m in read_metrics(run_dir)]


def load_params(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt", weights_only=True)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """An empty working directory: runs stage their data into its data/ and log into its runs/."""
    return tmp_path


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"
