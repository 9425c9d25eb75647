"""A job's settings for the supervisor's unit tests (tests/unit/test_supervisor_*.py): a job
of 2 nodes and 4 ranks, its `scontrol show job` line, and its settings as read_settings
gives them for a project with a training script in a test's folder; a copy of ddpkit/ as the
project a stand-in srun runs."""

import shutil
from pathlib import Path

from ddpkit.supervisor.settings import Settings, read_settings
from helpers.processes import ROOT

JOB = {"SLURM_JOB_ID": "77", "SLURM_SUBMIT_DIR": "/home/ann/sub", "SLURM_NTASKS": "4", "SLURM_JOB_NUM_NODES": "2",
       "SLURM_NTASKS_PER_NODE": "2", "SLURM_CPUS_PER_TASK": "3", "SLURM_JOB_PARTITION": "gpu"}
LINE = ("JobId=77 JobName=mnist-ddp UserId=ann(1000) Requeue=1 Restarts=0 BatchFlag=1 TimeLimit=00:30:00 "
        "StartTime=2026-11-24T10:00:00 EndTime=2026-11-24T10:30:00 Partition=gpu Command=/home/ann/p/run_training.sbatch")


def settings(tmp_path: Path, args: tuple = (), **env: str) -> Settings:
    """The settings of a job whose project is a copy with a training script in tmp_path."""
    project = tmp_path / "project"
    (project / "ddpkit").mkdir(parents=True, exist_ok=True)
    if not (project / "mnist_ddp.py").exists():
        (project / "mnist_ddp.py").write_text("print('trained')\n")
    environment = {**JOB, "SHARED_DIR": str(tmp_path), **env}
    return read_settings(environment, project=str(project), batch_file=str(project / "run_training.sbatch"),
                         environment="VENV=/v", args=list(args))


def stand_in_project(project: Path, tools: Path) -> None:
    """The project a supervisor test's stand-in tools run: ddpkit/ as it is, and a training
    script of one line; `tools`, the empty folder the test writes its stand-ins into."""
    shutil.copytree(ROOT / "ddpkit", project / "ddpkit", ignore=shutil.ignore_patterns("__pycache__"))
    (project / "mnist_ddp.py").write_text("v1\n")
    tools.mkdir()
