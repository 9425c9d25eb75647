"""The supervisor's settings (ddpkit/supervisor/settings.py) without Slurm: the defaults, the
one-line error of each wrong setting (CHAIN's too), a sweep's array task, containers, the
ranks' interpreter, the settings a chained job is given anew.

    python -m pytest tests/unit/test_supervisor_settings.py
"""

import re
import sys

import pytest

from ddpkit.supervisor.settings import SETTINGS, JobError, ranks_python
from ddpkit.supervisor.step import step_command, training_args, where_ranks_run
from helpers.processes import ROOT
from helpers.supervisor import settings


def test_defaults_follow_the_shared_directory_and_the_job(tmp_path):
    s = settings(tmp_path)
    assert (s.data_dir, s.log_dir, s.run_name, s.launcher, s.signal, s.max_restarts, s.master_port) == \
        (f"{tmp_path}/data", f"{tmp_path}/runs", "job-77", "srun", "USR1", 3, 10077)
    assert s.job_dir == f"{tmp_path}/runs/job-77/exit-codes/job-77"
    array = settings(tmp_path, SLURM_ARRAY_JOB_ID="70", SLURM_ARRAY_TASK_ID="7")
    assert (array.job, array.run_name, array.master_port) == ("70_7", "job-70_7", 10077)  # (the port: its own job id)


@pytest.mark.parametrize("env, error", [
    ({"LAUNCHER": "mpirun"}, "LAUNCHER must be srun or torchrun, got 'mpirun'"),
    ({"SIGNAL": "SIGUSR1"}, "SIGNAL must be USR1, TERM, HUP or INT (without SIG), got 'SIGUSR1'"),
    ({"CHECK": "yes"}, "CHECK must be 1 (check the job's ranks instead of training) or 0, got 'yes'"),
    ({"MAX_RESTARTS": "101"}, "MAX_RESTARTS must be a number from 0 to 100, got '101'"),
    ({"MAX_RESTARTS": "-1"}, "MAX_RESTARTS must be a number from 0 to 100, got '-1'"),
    ({"MAX_RESTARTS": "1e3"}, "MAX_RESTARTS must be a number from 0 to 100, got '1e3'"),
    ({"CHAIN": "101"}, "CHAIN must be a number from 0 to 100, got '101'"),
    ({"CHAIN": "yes"}, "CHAIN must be a number from 0 to 100, got 'yes'"),
    ({"CHAIN": "-2"}, "CHAIN must be a number from 0 to 100, got '-2'"),
    ({"MASTER_PORT": "80"}, "MASTER_PORT must be a number from 1024 to 65535, got '80'"),
    ({"RUN_NAME": ".."}, "RUN_NAME must be one directory name of letters, digits and ._-+=,@ (no / or spaces, "
                         "not . or ..), got '..'"),
    ({"RUN_NAME": "a/b"}, "got 'a/b'"),
    ({"SCRIPT": "/nonexistent/train.py"}, "/nonexistent/train.py not found; submit from the project directory or set SCRIPT"),
    ({"CONTAINER": "x.sif", "CONTAINER_CMD": "podman run"}, "set CONTAINER (with CONTAINER_RUNTIME) or CONTAINER_CMD, not both"),
    ({"CONTAINER": "x.sif", "CONTAINER_RUNTIME": "docker"}, "CONTAINER_RUNTIME must be apptainer, singularity or pyxis"),
    ({"SWEEP_FILE": "lr.txt"}, "SWEEP_FILE is set but this is not an array job; submit it with: "),
    ({"MIN_NODES": "3"}, "MIN_NODES must be a number from 1 to 2, got '3'"),
    ({"MIN_NODES": "0"}, "MIN_NODES must be a number from 1 to 2, got '0'"),
    ({"MIN_NODES": "1", "LAUNCHER": "torchrun"}, "MIN_NODES=1 is for LAUNCHER=srun: under torchrun, its agents restart "
                                                 "the workers themselves; unset MIN_NODES or LAUNCHER"),
])
def test_a_wrong_setting_is_one_line_naming_it(tmp_path, env, error):
    with pytest.raises(JobError) as raised:
        settings(tmp_path, **env)
    assert error in str(raised.value) and "\n" not in str(raised.value)


def test_numbers_with_leading_zeros_are_decimal(tmp_path):
    """Bash read 08 as octal once; here 08 is 8 and 01080 is 1080."""
    s = settings(tmp_path, MAX_RESTARTS="08", MASTER_PORT="01080", CHAIN="09")
    assert (s.max_restarts, s.master_port, s.chain) == (8, 1080, 9)
    assert settings(tmp_path).chain == settings(tmp_path, CHAIN="").chain == 0  # (off unless set)


def test_the_settings_a_chained_job_is_given_anew_are_every_one_the_batch_file_lists():
    """The job CHAIN submits gets the settings of its line in place of every one this job
    read (SETTINGS): each name run_training.sbatch's header lists, and no other."""
    header = (ROOT / "run_training.sbatch").read_text().split("# Settings, as environment variables", 1)[1]
    listed = re.findall(r"^#   ([A-Z_]+(?:, [A-Z_]+)*) ", header.split("\n# Exit codes", 1)[0], re.M)
    assert sorted(SETTINGS) == sorted(name for names in listed for name in names.split(", "))


@pytest.mark.parametrize("arg", ["--run-name", "--run-name=x", "--log-dir", "--run-dir=/tmp/r"])
def test_the_run_directory_is_named_by_the_settings_not_by_options(tmp_path, arg):
    with pytest.raises(JobError, match=r"name the run as RUN_NAME=NAME sbatch \.\.\. and its directory as LOG_DIR=DIR"):
        settings(tmp_path, ("--epochs", "2", arg))
    settings(tmp_path, ("--epochs", "2", "--run-names-are-not-this"))  # (the training script refuses that one)


def test_a_sweep_task_trains_its_line_in_a_run_named_by_its_options(tmp_path):
    (tmp_path / "lr sweep.txt").write_text("--lr 1e-3\n--lr 3e-3 --epochs 2\n")
    s = settings(tmp_path, ("--seed", "1"), SWEEP_FILE=str(tmp_path / "lr sweep.txt"), SLURM_ARRAY_JOB_ID="70",
                 SLURM_ARRAY_TASK_ID="1")
    assert (s.log_dir, s.run_name, s.sweep_args) == (f"{tmp_path}/runs/lr_sweep", "lr=3e-3,epochs=2",
                                                     ["--lr", "3e-3", "--epochs", "2"])
    assert training_args(s, "t.py")[-6:] == ["--lr", "3e-3", "--epochs", "2", "--seed", "1"]  # (given ones last)
    with pytest.raises(JobError, match="lr sweep.txt:2: --run-name: a sweep names"):
        (tmp_path / "lr sweep.txt").write_text("--lr 1e-3\n--epochs 2 --run-name x\n")
        settings(tmp_path, SWEEP_FILE=str(tmp_path / "lr sweep.txt"), SLURM_ARRAY_JOB_ID="70", SLURM_ARRAY_TASK_ID="0")


def test_containers_wrap_each_rank_and_bind_every_directory_once(tmp_path, monkeypatch):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "apptainer").write_text("#!/bin/sh\n")
    (tmp_path / "bin" / "apptainer").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:/usr/bin:/bin")
    (tmp_path / "img.sif").write_text("")
    (tmp_path / "shared").symlink_to(tmp_path)
    s = settings(tmp_path, CONTAINER=str(tmp_path / "img.sif"), SHARED_DIR=str(tmp_path / "shared"),
                 DATA_DIR=str(tmp_path / "data"), LOG_DIR=str(tmp_path / "runs"))
    project = f"{tmp_path}/project"
    binds = f"{project}:{project},{tmp_path}:{tmp_path}/shared,{tmp_path}/data:{tmp_path}/data,{tmp_path}/runs:{tmp_path}/runs"
    assert s.container == ["apptainer", "exec", "--nv", "--bind", binds, str(tmp_path / "img.sif")]
    assert s.container_desc == f"apptainer:{tmp_path}/img.sif" and (tmp_path / "data").is_dir()
    s.python = ranks_python(s, {"PYTHON": ""})
    assert s.python == "python3"  # (the container's, found on its own PATH)
    assert step_command(s, "t.py", ["m.py"])[3:6] == ["apptainer", "exec", "--nv"]
    assert where_ranks_run(s, ["python3", "-c", "0"])[:2] == ["apptainer", "exec"]
    pyxis = settings(tmp_path, CONTAINER="nvcr.io#pytorch", CONTAINER_RUNTIME="pyxis")
    assert pyxis.container == [] and pyxis.container_srun[0] == "--container-image=nvcr.io#pytorch"
    assert where_ranks_run(pyxis, ["python3"])[:4] == ["srun", "--nodes=1", "--ntasks=1",
                                                                 "--container-image=nvcr.io#pytorch"]
    words = settings(tmp_path, CONTAINER_CMD="podman run --rm -v '/a b:/a b' img")
    assert words.container == ["podman", "run", "--rm", "-v", "/a b:/a b", "img"]
    with pytest.raises(JobError, match="CONTAINER_CMD=podman run 'img: No closing quotation; quote it as a shell would"):
        settings(tmp_path, CONTAINER_CMD="podman run 'img")
    with pytest.raises(JobError, match="CONTAINER=.*needs singularity, which is not on the PATH"):
        settings(tmp_path, CONTAINER=str(tmp_path / "img.sif"), CONTAINER_RUNTIME="singularity")


def test_the_ranks_python_must_exist_and_run(tmp_path):
    s = settings(tmp_path)
    with pytest.raises(JobError, match="PYTHON=/nonexistent/python does not exist"):
        ranks_python(s, {"PYTHON": "/nonexistent/python"})
    with pytest.raises(JobError, match=f"PYTHON={tmp_path} is not an executable file"):
        ranks_python(s, {"PYTHON": str(tmp_path)})
    assert ranks_python(s, {"PYTHON": sys.executable}) == sys.executable
