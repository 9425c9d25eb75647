"""The job's supervisor (ddpkit/slurm_job.py) as Python, without Slurm: the settings and their
one-line errors, what the ranks' exit codes mean (settle), the srun and torchrun step
commands, the resubmit request, containers, the copy of the code a job runs; that it and
what it imports need nothing newer than Python 3.6 (vermin); and run_training.sbatch's own
one-line refusals (outside Slurm, no python3 on the node). tests/test_slurm.py runs it all
on a real Slurm.

    python -m pytest tests/test_slurm_job.py
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, SBATCH_FILE, clean_env
from ddpkit import slurm_job
from ddpkit.slurm_job import JobError, Outcome, read_settings, resubmit_line, settle, step_command

BIN = Path(sys.executable).parent
JOB = {"SLURM_JOB_ID": "77", "SLURM_SUBMIT_DIR": "/home/ann/sub", "SLURM_NTASKS": "4", "SLURM_JOB_NUM_NODES": "2",
       "SLURM_NTASKS_PER_NODE": "2", "SLURM_CPUS_PER_TASK": "3", "SLURM_JOB_PARTITION": "gpu"}
LINE = ("JobId=77 JobName=mnist-ddp UserId=ann(1000) Requeue=1 Restarts=0 BatchFlag=1 TimeLimit=00:30:00 "
        "StartTime=2026-11-24T10:00:00 EndTime=2026-11-24T10:30:00 Partition=gpu Command=/home/ann/p/run_training.sbatch")


def settings(tmp_path: Path, args: tuple = (), line: str = LINE, **env: str) -> slurm_job.Settings:
    """The settings of a job whose project is a copy with a training script in tmp_path."""
    project = tmp_path / "project"
    (project / "ddpkit").mkdir(parents=True, exist_ok=True)
    if not (project / "mnist_ddp.py").exists():
        (project / "mnist_ddp.py").write_text("print('trained')\n")
    environment = {**JOB, "SHARED_DIR": str(tmp_path), **env}
    return read_settings(environment, str(project), str(project / "run_training.sbatch"), "VENV=/v", list(args),
                         slurm_job.job_fields(line))


# ----------------------------------------------------------------------------- settings

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
    s = settings(tmp_path, MAX_RESTARTS="08", MASTER_PORT="01080")
    assert (s.max_restarts, s.master_port) == (8, 1080)


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
    assert slurm_job.training_args(s, "t.py")[-6:] == ["--lr", "3e-3", "--epochs", "2", "--seed", "1"]  # (given ones last)
    with pytest.raises(JobError, match="lr sweep.txt:2: --run-name: a sweep names"):
        (tmp_path / "lr sweep.txt").write_text("--lr 1e-3\n--epochs 2 --run-name x\n")
        settings(tmp_path, SWEEP_FILE=str(tmp_path / "lr sweep.txt"), SLURM_ARRAY_JOB_ID="70", SLURM_ARRAY_TASK_ID="0")


# ----------------------------------------------------------------------------- the outcome

@pytest.mark.parametrize("srun_status, codes, status, retry", [
    (0, {0: 0, 1: 0}, 0, False),
    (137, {0: 4}, 137, True),             # rank 1 killed (SIGKILL, the OOM killer), rank 0 lost it
    (143, {0: 4}, 143, True),             # ... and srun ended rank 0 with SIGTERM
    (4, {0: 4, 1: 4}, 4, True),           # both lost a peer (a hang ended by --dist-timeout)
    (4, {0: 4, 1: 1}, 1, False),          # rank 1's bug, rank 0 lost it: the bug decides
    (4, {0: 4, 1: 3}, 3, False),          # rank 1 diverged, rank 0 lost it: never retried
    (143, {0: 3, 1: 4}, 3, False),        # ... the other way round, srun ending the rest
    (4, {0: 4, 1: 2}, 2, False),          # rank 1's usage problem, rank 0 lost it
    (137, {0: 75, 1: 4}, 75, False),      # rank 0 stopped on a signal, rank 1 lost it on the way out
    (137, {0: 3, 1: 75}, 3, False),       # a divergence beats a stop
    (2, {0: 2, 1: 2}, 2, False),          # a usage problem
    (3, {0: 3, 1: 3}, 3, False),          # diverged
    (75, {0: 75, 1: 75}, 75, False),      # stopped on a signal, not requeued
    (1, {}, 1, False),                    # died before main() (an import error): no codes, no signal
    (139, {0: 0, 1: 0}, 0, False),        # every rank finished and saved, then one died at exit: done
    (134, {0: 0}, 134, True),             # rank 1 died before it recorded anything: killed
])
def test_which_outcomes_the_supervisor_retries(tmp_path, srun_status, codes, status, retry):
    """settle over the files the ranks write (rank-<r>, the code and a newline)."""
    for rank, code in codes.items():
        (tmp_path / f"rank-{rank}").write_text(f"{code}\n")
    outcome = settle(srun_status, slurm_job.read_codes(str(tmp_path)), 2)
    assert (outcome.status, outcome.retry) == (status, retry), outcome
    assert not retry or outcome.why
    assert outcome.note.startswith(f"every rank had finished and saved (each recorded exit 0) before srun's exit "
                                   f"{srun_status} ") == (srun_status != 0 and status == 0)


def test_settle_names_the_first_rank_that_decided_and_every_killed_one():
    assert settle(4, {0: "4", 1: "2", 2: "1"}, 3) == Outcome(2, why="rank 1 exited with 2")
    assert settle(137, {1: "4\n"}, 4).why.startswith("rank 0 2 3 ended without an exit code: killed by a signal")
    assert settle(4, {0: "4", 1: "4"}, 2) == Outcome(4, True, "rank 0 1 lost contact with a peer that died or hung")


# ----------------------------------------------------------------------------- commands

def test_the_srun_step_starts_every_rank_through_the_task_entry(tmp_path):
    s = settings(tmp_path, ("--epochs", "2"), NODE_DATA_DIR="$TMPDIR/data")
    s.python = "/v/bin/python"
    train = slurm_job.training_args(s, "/code/mnist_ddp.py")
    assert step_command(s, "/code/ddpkit/slurm_job.py", train) == [
        "srun", "--label", "--kill-on-bad-exit=1", "/v/bin/python", "/code/ddpkit/slurm_job.py", "task", "train",
        "/code/mnist_ddp.py", f"--data-dir={tmp_path}/data", f"--log-dir={tmp_path}/runs", "--run-name=job-77",
        "--node-data-dir=$TMPDIR/data", "--epochs", "2"]


def test_after_a_lost_node_the_step_goes_on_with_the_most_nodes_the_batch_splits_among(tmp_path):
    """MIN_NODES=1 on 2 nodes x 2 tasks: with 1 node left, 2 ranks if the batch splits among
    them, none if it does not; without rank 0's list, the divisors of the world size. The
    step then asks srun for that many nodes and tasks (its variables still say 2 and 4)."""
    s = settings(tmp_path, MIN_NODES="01")
    assert (s.job_nodes, s.min_nodes, settings(tmp_path).min_nodes) == (2, 1, 2)
    assert slurm_job.nodes_to_go_on_with(1, 1, 2, [1, 2, 4]) == 1
    assert slurm_job.nodes_to_go_on_with(1, 1, 2, [1, 4]) == 0
    assert slurm_job.nodes_to_go_on_with(1, 2, 2, [1, 2, 4]) == 0  # fewer than MIN_NODES
    assert slurm_job.nodes_to_go_on_with(3, 1, 4, [1, 2, 4, 8, 16]) == 2  # 12 ranks do not split 128; 8 do
    assert slurm_job.read_world_sizes(str(tmp_path / "none"), 12) == [1, 2, 3, 4, 6, 12]
    (tmp_path / slurm_job.WORLD_SIZES).write_text("1 2 3 4 6\n")
    assert slurm_job.read_world_sizes(str(tmp_path), 12) == [1, 2, 3, 4, 6]
    assert "--no-kill" in resubmit_line(s, JOB, slurm_job.job_fields(LINE)).split()  # (MIN_NODES needs it)
    assert "--no-kill" not in resubmit_line(settings(tmp_path), JOB, slurm_job.job_fields(LINE)).split()
    s.python, s.nodes, s.ntasks = "/v/bin/python", 1, 2
    assert step_command(s, "/code/ddpkit/slurm_job.py", ["t.py"])[:7] == [
        "srun", "--label", "--kill-on-bad-exit=1", "--nodes=1", "--ntasks=2", "--relative=0", "/v/bin/python"]


def scontrol_showing(directory: Path, line: str) -> str:
    """A PATH whose scontrol shows `line` for any job and refuses every requeue."""
    directory.mkdir()
    (directory / "scontrol").write_text(f"""#!/bin/sh
if [ "$1" = requeue ]; then echo "scontrol: error: Job has been denied requeue" >&2; exit 1; fi
echo "{line}"
""")
    (directory / "scontrol").chmod(0o755)
    return str(directory)


def test_the_supervisor_goes_on_with_the_nodes_scontrol_shows_or_says_why_it_cannot(tmp_path, monkeypatch, capsys):
    """After a step lost to a node: all nodes held, the same step again; 1 of 2 held with
    MIN_NODES=1, 2 ranks on it (settled as 2 from then on); with MIN_NODES unset, a requeue,
    which Slurm refuses here, and the outcome says so."""
    killed = Outcome(137, True, "rank 2 3 ended without an exit code")
    monkeypatch.setenv("PATH", scontrol_showing(tmp_path / "all", LINE + " NumNodes=2 NodeList=n[1-2]"))
    supervisor = slurm_job.Supervisor(settings(tmp_path, MIN_NODES="1"), LINE, "/code/ddpkit/slurm_job.py")
    assert supervisor.nodes_held_now(killed) == ""
    monkeypatch.setenv("PATH", scontrol_showing(tmp_path / "one", LINE + " NumNodes=1 NodeList=n1"))
    assert supervisor.nodes_held_now(killed) == (": the job holds 1 of its 2 nodes (n1), so on 1 node(s) with 2 rank(s) "
                                                 "instead of 4")
    assert (supervisor.s.nodes, supervisor.s.ntasks) == (1, 2)
    whole = slurm_job.Supervisor(settings(tmp_path), LINE, "/code/ddpkit/slurm_job.py")
    assert whole.nodes_held_now(killed) is None
    assert ("requeueing Slurm job 77 after exit 137: the job holds 1 of its 2 nodes (n1), fewer than MIN_NODES=2 "
            "(unset: every node of the job); it resumes") in capsys.readouterr().out
    assert killed.why.endswith("and it was not requeued") and (whole.s.nodes, whole.s.ntasks) == (2, 4)
    weak = slurm_job.Supervisor(settings(tmp_path, MIN_NODES="1"), LINE, "/code/ddpkit/slurm_job.py")
    os.makedirs(weak.s.job_dir, exist_ok=True)
    Path(weak.s.job_dir, slurm_job.WORLD_SIZES).write_text("4\n")  # (--batch-size per rank: 4 ranks alone keep it)
    assert weak.nodes_held_now(Outcome(4, True, "rank 0 lost contact")) is None
    assert ("the job holds 1 of its 2 nodes (n1), and no count of them from MIN_NODES=1 up, at 2 rank(s) a node, keeps "
            "the global batch; it resumes") in capsys.readouterr().out


def test_the_torchrun_step_starts_one_agent_per_node_with_every_cpu_of_its_ranks(tmp_path, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "3")
    s = settings(tmp_path, LAUNCHER="torchrun", MAX_RESTARTS="2")
    s.python = "python3"
    assert step_command(s, "t.py", ["m.py"]) == [
        "srun", "--label", "--kill-on-bad-exit=1", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--cpus-per-task=6",
        "python3", "t.py", "task", "torchrun", "--nnodes=2", "--nproc-per-node=2", "--max-restarts=2",
        "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.1:10077", "--rdzv-id=77", "m.py"]
    # CHECK=1 always starts srun tasks
    assert step_command(s, "t.py", ["m.py", "--check"], "srun")[3:] == ["python3", "t.py", "task", "train", "m.py", "--check"]


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
    s.python = slurm_job.ranks_python(s, {"PYTHON": ""})
    assert s.python == "python3"  # (the container's, found on its own PATH)
    assert step_command(s, "t.py", ["m.py"])[3:6] == ["apptainer", "exec", "--nv"]
    assert slurm_job.where_ranks_run(s, ["python3", "-c", "0"])[:2] == ["apptainer", "exec"]
    pyxis = settings(tmp_path, CONTAINER="nvcr.io#pytorch", CONTAINER_RUNTIME="pyxis")
    assert pyxis.container == [] and pyxis.container_srun[0] == "--container-image=nvcr.io#pytorch"
    assert slurm_job.where_ranks_run(pyxis, ["python3"])[:4] == ["srun", "--nodes=1", "--ntasks=1",
                                                                 "--container-image=nvcr.io#pytorch"]
    words = settings(tmp_path, CONTAINER_CMD="podman run --rm -v '/a b:/a b' img")
    assert words.container == ["podman", "run", "--rm", "-v", "/a b:/a b", "img"]
    with pytest.raises(JobError, match="CONTAINER_CMD=podman run 'img: No closing quotation; quote it as a shell would"):
        settings(tmp_path, CONTAINER_CMD="podman run 'img")
    with pytest.raises(JobError, match="CONTAINER=.*needs singularity, which is not on the PATH"):
        settings(tmp_path, CONTAINER=str(tmp_path / "img.sif"), CONTAINER_RUNTIME="singularity")


def test_a_step_killed_by_a_signal_is_128_plus_its_number_as_a_shell_says(tmp_path):
    """What settle reads as killed (and restarts): Popen's -9 is the shell's 137."""
    supervisor = slurm_job.Supervisor(settings(tmp_path), "", "t.py")
    assert supervisor.run_step(["sh", "-c", "kill -KILL $$"]) == 137
    assert supervisor.run_step(["sh", "-c", "exit 4"]) == 4


def test_the_ranks_python_must_exist_and_run(tmp_path):
    s = settings(tmp_path)
    with pytest.raises(JobError, match="PYTHON=/nonexistent/python does not exist"):
        slurm_job.ranks_python(s, {"PYTHON": "/nonexistent/python"})
    with pytest.raises(JobError, match=f"PYTHON={tmp_path} is not an executable file"):
        slurm_job.ranks_python(s, {"PYTHON": str(tmp_path)})
    assert slurm_job.ranks_python(s, {"PYTHON": sys.executable}) == sys.executable


# ----------------------------------------------------------------------------- the resubmit request

@pytest.mark.parametrize("env, line, asked", [
    ({}, LINE, "--nodes=2 --ntasks-per-node=2 --cpus-per-task=3 --time=00:30:00 --partition=gpu"),
    ({"SLURM_NTASKS": "3"}, LINE, "--nodes=2 --ntasks=3 --cpus-per-task=3"),  # uneven: 2 and 1
    ({"SLURM_NTASKS": "3", "LAUNCHER": "torchrun"}, LINE, "--nodes=2 --ntasks-per-node=2"),
    ({"SLURM_MEM_PER_NODE": "8192"}, LINE, "--mem=8192M"),
    ({"SLURM_MEM_PER_CPU": "1000"}, LINE, "--mem-per-cpu=1000M"),
    ({}, LINE.replace("TimeLimit=00:30:00", "TimeLimit=UNLIMITED"), "--cpus-per-task=3 --partition=gpu"),
    ({}, LINE.replace("TimeLimit=00:30:00", "TimeLimit=Partition_Limit"), "--cpus-per-task=3 --partition=gpu"),
    ({}, LINE + " TresPerNode=gres:gpu:2", "--gpus-per-node=2"),
    ({}, LINE + " TresPerNode=gres/gpu:a100:4,gres/shard:1", "--gpus-per-node=a100:4"),
    ({}, LINE + " TresPerNode=gpu:2", "--gpus-per-node=2"),                       # older Slurm
    ({}, LINE + " TresPerJob=gres:gpu:3", "--gpus=3"),
    ({}, LINE + " TresPerTask=gres:gpu:1", "--gpus-per-task=1"),
    ({"SLURM_GPUS_PER_NODE": "2"}, LINE, "--gpus-per-node=2"),                  # no TRES in the line
    ({"SLURM_JOB_NAME": "lr-sweep", "SLURM_JOB_ACCOUNT": "ml"}, LINE, "--account=ml --job-name=lr-sweep"),
])
def test_the_resubmit_line_asks_for_what_this_job_got(tmp_path, env, line, asked):
    s = settings(tmp_path, line=line, **env)
    resubmit = resubmit_line(s, {**JOB, **env}, slurm_job.job_fields(line))
    assert f" {asked} " in f" {resubmit} ", resubmit
    assert resubmit.endswith(f" {tmp_path}/project/run_training.sbatch")


def test_the_resubmit_line_carries_the_settings_as_given_and_is_quoted(tmp_path):
    """Each setting is NAME= and its value quoted, which a shell reads as an assignment (a
    quoted 'NAME=value' is a command to it): the line, run as printed by bash with an sbatch
    that shows what it got, sets each one as given. OMP_NUM_THREADS only when the user set
    it: the supervisor sets it from --cpus-per-task, which the line may change."""
    shared = tmp_path / "sub dir"
    env = {"RUN_NAME": "lr=1e-3,a", "LAUNCHER": "torchrun", "CONTAINER_CMD": "podman run img", "SETUP": "/s/env.sh",
           "NODE_DATA_DIR": "$TMPDIR/data", "SHARED_DIR": str(shared)}
    s = settings(tmp_path, **env)
    resubmit = resubmit_line(s, {**JOB, **env, "OMP_NUM_THREADS": "3"}, {})  # (as the supervisor set it)
    assert resubmit.startswith(f"SHARED_DIR='{shared}' DATA_DIR='{shared}/data' LOG_DIR='{shared}/runs' "
                               "RUN_NAME=lr=1e-3,a SETUP=/s/env.sh NODE_DATA_DIR='$TMPDIR/data' LAUNCHER=torchrun "
                               "CONTAINER_CMD='podman run img' sbatch --nodes=2 --ntasks-per-node=2 "), resubmit
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "sbatch").write_text('#!/bin/sh\nfor v in SHARED_DIR NODE_DATA_DIR CONTAINER_CMD RUN_NAME '
                                             'OMP_NUM_THREADS; do eval "echo $v=\\${$v-unset}"; done\n')
    (tmp_path / "bin" / "sbatch").chmod(0o755)
    shown = subprocess.run(["bash", "-c", resubmit], env={"PATH": f"{tmp_path}/bin:/usr/bin:/bin"}, capture_output=True,
                           text=True, timeout=60)
    assert (shown.returncode, shown.stdout.splitlines()) == (0, [
        f"SHARED_DIR={shared}", "NODE_DATA_DIR=$TMPDIR/data", "CONTAINER_CMD=podman run img", "RUN_NAME=lr=1e-3,a",
        "OMP_NUM_THREADS=unset"]), shown.stderr
    given = settings(tmp_path, OMP_NUM_THREADS="2")
    assert " OMP_NUM_THREADS=2 sbatch " in resubmit_line(given, {**JOB, "OMP_NUM_THREADS": "2"}, {})


# ----------------------------------------------------------------------------- the code a job runs

def test_a_job_runs_a_copy_of_its_code_taken_at_its_first_start(tmp_path, capsys):
    """What the copy holds; a new job of the run, or the same job run again inside salloc,
    takes a new one and says in one line when the code differs. (That a requeue runs the
    copy it has: tests/test_slurm.py, on a real Slurm.)"""
    s = settings(tmp_path)
    project = Path(s.project)
    (project / "ddpkit" / "jobs.py").write_text("A = 1\n")
    (project / "sweep.py").write_text("")
    (project / "models").mkdir()
    (project / "models" / "resnet.py").write_text("")  # a package of the user's, beside the script
    (project / "data").mkdir()
    subprocess.run(["git", "init", "-q", str(project)], check=True)
    subprocess.run(["git", "-C", str(project), "add", "."], check=True)
    subprocess.run(["git", "-C", str(project), "-c", "user.name=a", "-c", "user.email=a@b", "commit", "-qm", "x"], check=True)
    (project / "mnist_ddp.py").write_text("print('edited before the job started: é')\n")
    for name in (".git/hooks/x.py", ".venv/lib/site.py", "__pycache__/m.py", "runs/job-1/code/job-1/m.py"):
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text("")
    (project / ".venv" / "pyvenv.cfg").write_text("")
    (project / "env" / "conda-meta").mkdir(parents=True)
    (project / "env" / "lib.py").write_text("")
    copy = Path(slurm_job.take_snapshot(settings(tmp_path, LOG_DIR=str(project / "runs"))))
    assert copy == project / "runs" / "job-77" / "code" / "job-77"
    assert slurm_job.code_files(str(copy)) == ["mnist_ddp.py", "sweep.py", "ddpkit/jobs.py", "models/resnet.py"]
    assert (copy / "data").resolve() == project / "data"
    assert len((copy / "git-commit.txt").read_text().strip()) == 40
    assert "+print('edited before the job started: é')" in (copy / "git.diff").read_text()
    assert capsys.readouterr().out == ""
    # The same job started again (inside salloc) takes the code as it is now.
    (project / "mnist_ddp.py").write_text("raise SystemExit(1)\n")
    again = settings(tmp_path, LOG_DIR=str(project / "runs"))
    assert slurm_job.take_snapshot(again) == str(copy)
    assert (copy / "mnist_ddp.py").read_text() == "raise SystemExit(1)\n"
    assert capsys.readouterr().out == f"code: this job runs code that differs from job-77's ({copy}): mnist_ddp.py\n"
    # A new job of the same run takes a new copy, and says so when the code differs.
    (project / "ddpkit" / "jobs.py").unlink()
    slurm_job.take_snapshot(settings(tmp_path, LOG_DIR=str(project / "runs"), SLURM_JOB_ID="78", RUN_NAME="job-77"))
    assert capsys.readouterr().out == f"code: this job runs code that differs from job-77's ({copy}): ddpkit/jobs.py\n"
    slurm_job.take_snapshot(settings(tmp_path, LOG_DIR=str(project / "runs"), SLURM_JOB_ID="79", RUN_NAME="job-77"))
    assert capsys.readouterr().out == ""  # (the same as job 78's)


def test_a_copy_that_cannot_be_written_is_one_line(tmp_path):
    s = settings(tmp_path, LOG_DIR="/proc/version/runs")
    with pytest.raises(JobError, match="cannot copy the code this job runs into /proc/version/runs/job-77/code/job-77"):
        slurm_job.take_snapshot(s)


def test_the_copy_takes_what_the_job_runs_and_names_a_file_it_cannot_copy(tmp_path):
    """Emacs leaves .#mnist_ddp.py, a dangling symlink, beside a file with unsaved edits: the
    copy leaves it out, as any dangling link (nothing can import it). A .py it cannot read
    (here a named pipe) is named in one line that does not blame LOG_DIR, and no
    job-N.partial folder is left behind."""
    s = settings(tmp_path)
    project = Path(s.project)
    (project / ".#mnist_ddp.py").symlink_to("ann@login1.4242:1764000000")
    (project / "old.py").symlink_to("moved-away.py")
    copy = Path(slurm_job.take_snapshot(s))
    assert slurm_job.code_files(str(copy)) == ["mnist_ddp.py"]
    os.mkfifo(project / "pipe.py")
    with pytest.raises(JobError) as raised:
        slurm_job.take_snapshot(s)
    assert str(raised.value) == (f"cannot copy {project}/pipe.py into the job's copy of its code (not a regular file); "
                                 "move it out of the project, or make it a readable file")
    assert sorted(os.listdir(copy.parent)) == ["job-77"]  # (the earlier copy kept, no .partial)
    shutil.rmtree(copy)
    with pytest.raises(JobError):
        slurm_job.take_snapshot(s)
    assert os.listdir(copy.parent) == []


# ----------------------------------------------------------------------------- what runs on the host

def test_what_the_host_runs_needs_nothing_newer_than_python_3_6():
    """run_training.sbatch hands over to ddpkit/slurm_job.py with the host's python3 (the
    ranks' PYTHON may exist only in a container), which may be 3.6 (RHEL 8): it and what it
    imports use nothing newer, as vermin reads them."""
    assert 'exec python3 "$project/ddpkit/slurm_job.py" supervise' in SBATCH_FILE.read_text()
    result = subprocess.run([str(BIN / "vermin"), "--target=3.6-", "--no-tips", "--violations", "ddpkit/slurm_job.py",
                             "ddpkit/sweeplines.py"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    imports = subprocess.run(["python3", "-c", "import sys; import ddpkit.slurm_job; "
                              "print(sorted(m for m in sys.modules if m.startswith('ddpkit')))"],
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert imports.stdout.strip() == "['ddpkit', 'ddpkit.slurm_job', 'ddpkit.sweeplines']", imports.stderr


def test_the_supervisor_outside_slurm_is_one_line():
    result = subprocess.run(["python3", str(ROOT / "ddpkit" / "slurm_job.py"), "supervise", "--project", str(ROOT),
                             "--batch-file", str(SBATCH_FILE), "--environment", "python3 on the PATH", "--",
                             "--epochs", "1", "--", "x"],
                            env=clean_env(PATH="/usr/bin:/bin"), capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stderr) == (2, "run_training.sbatch: error: not inside a Slurm job. Submit it: "
                                                     "sbatch run_training.sbatch [options]\n")


@pytest.mark.parametrize("env, error", [
    ({}, "not inside a Slurm job. Submit it: sbatch run_training.sbatch [options]; without Slurm use: torchrun "
         "--standalone --nproc-per-node N mnist_ddp.py [options]"),
    ({"SLURM_JOB_ID": "5"}, "this node has no python3 on the PATH, which runs the job's supervisor "
                            "(ddpkit/slurm_job.py, Python 3.6 or newer); load a python module in cluster-env.sh or SETUP"),
])
def test_the_batch_file_without_slurm_or_without_python3_is_one_line(tmp_path, env, error):
    """Run as bash would run it (a copy, in a project without a .venv) on a node whose PATH has
    the shell's tools and no python3."""
    tools, project = tmp_path / "bin", tmp_path / "project"
    tools.mkdir()
    for name in ("dirname", "realpath", "basename"):
        (tools / name).symlink_to(f"/usr/bin/{name}")
    (project / "ddpkit").mkdir(parents=True)
    shutil.copy(ROOT / "ddpkit" / "slurm_job.py", project / "ddpkit")
    shutil.copy(SBATCH_FILE, project)
    result = subprocess.run(["/bin/bash", str(project / "run_training.sbatch"), "--epochs", "1"], cwd=tmp_path,
                            env={"PATH": str(tools), "SLURM_SUBMIT_DIR": str(tmp_path), **env},
                            capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stderr) == (2, f"run_training.sbatch: error: {error}\n")
    assert sorted(os.listdir(tmp_path)) == ["bin", "project"]  # nothing written


# ----------------------------------------------------------------------------- the supervisor's steps

def supervised_job(tmp_path: Path, srun_exits: str, args: list, **env: str) -> subprocess.CompletedProcess:
    """The supervisor as run_training.sbatch hands over to it, in a job of 1 node and 2 ranks
    whose project is a copy in tmp_path/project. On its PATH, srun records each step's command
    (a line of srun.log: the copy's mnist_ddp.py it runs, then the training options) and exits
    with the next of `srun_exits` (137: killed, as srun reports it); scontrol
    knows no job; PYTHON answers the supervisor's check that it imports torch."""
    project, tools = tmp_path / "project", tmp_path / "bin"
    if not project.exists():
        shutil.copytree(ROOT / "ddpkit", project / "ddpkit", ignore=shutil.ignore_patterns("__pycache__"))
        (project / "mnist_ddp.py").write_text("v1\n")
        tools.mkdir()
        (tools / "srun").write_text(f"""#!/bin/bash
while [[ $1 == -* ]]; do shift; done   # srun's own options
shift 3                                # PYTHON, the task entry, "task"
mode=$1; shift
while [[ $1 == --* ]]; do shift; done  # (torchrun's own options)
echo "$mode $(cat "$1") ${{*:2}}" >> {tmp_path}/srun.log
set -- $(cat {tmp_path}/srun-exits)
n=$(wc -l < {tmp_path}/srun.log)
exit "${{!n}}"
""")
        (tools / "scontrol").write_text("#!/bin/sh\nexit 1\n")
        (tools / "python").write_text("#!/bin/sh\necho python=here torch=2\n")
        for tool in tools.iterdir():
            tool.chmod(0o755)
    (tmp_path / "srun-exits").write_text(srun_exits)
    job = {"SLURM_JOB_ID": "77", "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_NTASKS": "2", "SLURM_JOB_NUM_NODES": "1",
           "SLURM_NTASKS_PER_NODE": "2", "MASTER_ADDR": "127.0.0.1", "PYTHON": str(tools / "python")}
    return subprocess.run([sys.executable, str(project / "ddpkit" / "slurm_job.py"), "supervise", "--project",
                           str(project), "--batch-file", str(project / "run_training.sbatch"), "--environment", "VENV=/v",
                           "--", *args], cwd=tmp_path, env=clean_env(PATH=f"{tools}:/usr/bin:/bin", **job, **env),
                          capture_output=True, text=True, timeout=60)


def steps_run(tmp_path: Path) -> list:
    return (tmp_path / "srun.log").read_text().splitlines()


FIRST_START = ["--resume", "/base/ckpt-00000016.pt", "--interrupt-at=30:USR1", "--epochs", "3", "--interrupt-at",
               "9:TERM"]


@pytest.mark.parametrize("given, continued", [
    (["--resume", "never", "--lr", "1e-3"], ["--lr", "1e-3"]),
    (["--resume=never", "--interrupt-at", "40:USR1", "--epochs", "2"], ["--epochs", "2"]),
    (["--interrupt-at=40:TERM", "--resume", "auto"], []),
    (["--resume", "/b/c.pt"], []),          # (the run holds a checkpoint of its own)
    (["--resume=/b/c.pt", "--max-steps", "9"], ["--max-steps", "9"]),
])
def test_what_a_restart_or_a_requeue_continues_with(tmp_path, given, continued):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "ckpt-best.pt").write_bytes(b"")  # (a user's copy: not the run's own)
    assert slurm_job.continuing_args(given, str(tmp_path)) == continued + (["--resume=/b/c.pt"] if "c.pt" in str(given)
                                                                          else [])
    (tmp_path / "checkpoints" / "ckpt-00000040.pt").write_bytes(b"")
    assert slurm_job.continuing_args(given, str(tmp_path)) == continued


def test_a_restart_and_a_requeue_leave_out_the_options_of_the_first_start(tmp_path):
    """--resume (where the run started from) and --interrupt-at (a stop rehearsed at a chosen
    step), in either spelling, go to the first start alone: a restart of the step after a
    killed rank, and the job requeued, go on from the run's own newest checkpoint. Before the
    run saved one, a --resume FILE stays (else the restart would train afresh)."""
    result = supervised_job(tmp_path, "137 0", FIRST_START)
    assert result.returncode == 0, result.stdout + result.stderr
    first, restart = steps_run(tmp_path)
    data, runs = tmp_path / "data", tmp_path / "runs"
    options = f"--data-dir={data} --log-dir={runs} --run-name=job-77"
    assert first == f"train v1 {options} {' '.join(FIRST_START)}"
    assert restart == f"train v1 {options} --epochs 3 --resume=/base/ckpt-00000016.pt"  # (nothing saved yet)
    assert "ATTEMPT 2/4 after exit 137" in result.stdout
    (runs / "job-77" / "checkpoints").mkdir()
    (runs / "job-77" / "checkpoints" / "ckpt-00000030.pt").write_bytes(b"")  # (as the ranks save)
    for exits, restart_count, steps in (("137 0", "0", 2), ("0", "1", 1)):
        (tmp_path / "srun.log").unlink()
        again = supervised_job(tmp_path, exits, FIRST_START, SLURM_RESTART_COUNT=restart_count)
        assert again.returncode == 0, again.stdout + again.stderr
        assert steps_run(tmp_path)[-1] == f"train v1 {options} --epochs 3" and len(steps_run(tmp_path)) == steps
    # Killed at every attempt, before rank 0 wrote the line that continues the run: the line
    # after END is built from the options as given, less those of the first start.
    (tmp_path / "srun.log").unlink()
    gave_up = supervised_job(tmp_path, "137 137 137 137", FIRST_START, SLURM_RESTART_COUNT="1")
    assert gave_up.returncode == 137
    assert gave_up.stdout.endswith(f"to continue from the newest checkpoint, from {tmp_path}: SHARED_DIR={tmp_path} "
                                   f"DATA_DIR={data} LOG_DIR={runs} RUN_NAME=job-77 PYTHON={tmp_path}/bin/python sbatch "
                                   f"--nodes=1 --ntasks-per-node=2 {tmp_path}/project/run_training.sbatch --epochs 3\n")
    assert "--resume" not in gave_up.stdout + gave_up.stderr


def test_under_torchrun_the_supervisor_leaves_restarts_to_its_agents(tmp_path):
    """torchrun's agents restart the workers MAX_RESTARTS times themselves: a step that ends
    as a killed one would be restarted under srun is not started again on top of them."""
    result = supervised_job(tmp_path, "137 137 137", ["--epochs", "1"], LAUNCHER="torchrun", MAX_RESTARTS="2")
    assert len(steps_run(tmp_path)) == 1 and "ATTEMPT" not in result.stdout, result.stdout
    assert result.returncode == 137 and "gave up after 3 attempts" in result.stdout
    (tmp_path / "srun.log").unlink()
    result = supervised_job(tmp_path, "137 137 137", ["--epochs", "1"], MAX_RESTARTS="2")
    assert len(steps_run(tmp_path)) == 3 and "ATTEMPT 3/3" in result.stdout  # (srun: the supervisor restarts)


def test_a_job_run_again_inside_salloc_takes_a_new_copy_and_a_requeue_keeps_its_own(tmp_path):
    """Inside salloc, running the batch file again is a new start of the same job id: it runs
    the code as it is now. A requeue of the job (SLURM_RESTART_COUNT) runs the copy it has."""
    supervised_job(tmp_path, "0 0 0", ["--epochs", "1"], RUN_NAME="r")
    (tmp_path / "project" / "mnist_ddp.py").write_text("v2\n")
    again = supervised_job(tmp_path, "0 0 0", ["--epochs", "1"], RUN_NAME="r")
    (tmp_path / "project" / "mnist_ddp.py").write_text("v3\n")
    supervised_job(tmp_path, "0 0 0", ["--epochs", "1"], RUN_NAME="r", SLURM_RESTART_COUNT="1")
    assert [line.split()[1] for line in steps_run(tmp_path)] == ["v1", "v2", "v2"]
    assert "code: this job runs code that differs from job-77's" in again.stdout


def test_a_run_name_that_starts_with_a_dash_reaches_the_ranks_as_one_word(tmp_path):
    """RUN_NAME=-lr3 is a name by the rule; the ranks' argparse reads it as the value of
    --run-name only in the --run-name=VALUE form (and so every directory the supervisor
    passes). The ranks' own parser takes it, and so does their check of the name."""
    import mnist_ddp
    from ddpkit.options import parse_options
    s = settings(tmp_path, RUN_NAME="-lr3", DATA_DIR="-d", NODE_DATA_DIR="-n", LOG_DIR=str(tmp_path / "-runs"))
    args = slurm_job.training_args(s, "m.py")
    assert args[1:] == ["--data-dir=-d", f"--log-dir={tmp_path}/-runs", "--run-name=-lr3", "--node-data-dir=-n"]
    _, options = parse_options(mnist_ddp.Recipe, args[1:])
    assert (options.run_name, options.data_dir, options.node_data_dir) == ("-lr3", "-d", "-n")


def test_under_the_batch_file_the_advice_names_the_run_as_the_batch_file_does(tmp_path, monkeypatch):
    """run_training.sbatch refuses --run-name after its file name: the advice that starts
    another run names RUN_NAME there (a job submitted with --resume never into a run that
    holds checkpoints)."""
    from ddpkit.checkpoints import checkpoint_path, find_checkpoint
    from ddpkit.launch import UsageError
    checkpoint_path(tmp_path, 40).parent.mkdir()
    checkpoint_path(tmp_path, 40).write_bytes(b"")
    monkeypatch.delenv("MNIST_DDP_RESUBMIT", raising=False)
    with pytest.raises(UsageError, match="pass another --run-name to start afresh, or --resume auto to continue"):
        find_checkpoint("never", False, {}, (), tmp_path)
    monkeypatch.setenv("MNIST_DDP_RESUBMIT", "SHARED_DIR=/s sbatch run_training.sbatch")
    with pytest.raises(UsageError, match="pass another RUN_NAME to start afresh, or --resume auto to continue"):
        find_checkpoint("never", False, {}, (), tmp_path)
