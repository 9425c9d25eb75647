"""The supervisor's step (ddpkit/supervisor/step.py) without Slurm: the srun and torchrun step
commands, the ranks' command line, the sbatch line that continues the run and its
submission by CHAIN, --compile's caches on node-local scratch, and the rendezvous address of a job of several nodes (with stand-ins
for scontrol and ip), never a loopback one.

    python -m pytest tests/unit/test_supervisor_step.py
"""

import subprocess
from pathlib import Path

import pytest

from ddpkit.job.contract import job_fields
from ddpkit.supervisor.step import (
    chained_submission,
    compile_caches,
    master_address,
    resubmit_line,
    step_command,
    training_args,
)
from helpers.supervisor import JOB, LINE, settings


def test_the_srun_step_starts_every_rank_through_the_task_entry(tmp_path):
    s = settings(tmp_path, ("--epochs", "2"), NODE_DATA_DIR="$TMPDIR/data")
    s.python = "/v/bin/python"
    train = training_args(s, "/code/mnist_ddp.py")
    assert step_command(s, "/code/ddpkit/supervisor/main.py", train) == [
        "srun", "--label", "--kill-on-bad-exit=1", "/v/bin/python", "/code/ddpkit/supervisor/main.py", "task", "train",
        "/code/mnist_ddp.py", f"--data-dir={tmp_path}/data", f"--log-dir={tmp_path}/runs", "--run-name=job-77",
        "--node-data-dir=$TMPDIR/data", "--epochs", "2"]


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


def test_a_run_name_that_starts_with_a_dash_reaches_the_ranks_as_one_word(tmp_path):
    """RUN_NAME=-lr3 is a name by the rule; the ranks' argparse reads it as the value of
    --run-name only in the --run-name=VALUE form (and so every directory the supervisor
    passes). The ranks' own parser takes it, and so does their check of the name."""
    import mnist_ddp
    from ddpkit.options import parse_options
    s = settings(tmp_path, RUN_NAME="-lr3", DATA_DIR="-d", NODE_DATA_DIR="-n", LOG_DIR=str(tmp_path / "-runs"))
    args = training_args(s, "m.py")
    assert args[1:] == ["--data-dir=-d", f"--log-dir={tmp_path}/-runs", "--run-name=-lr3", "--node-data-dir=-n"]
    _, options = parse_options(mnist_ddp.Recipe, args[1:])
    assert (options.run_name, options.data_dir, options.node_data_dir) == ("-lr3", "-d", "-n")


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
    s = settings(tmp_path, **env)
    resubmit = resubmit_line(s, {**JOB, **env}, job_fields(line))
    assert f" {asked} " in f" {resubmit} ", resubmit
    assert resubmit.endswith(f" {tmp_path}/project/run_training.sbatch")


def test_a_line_from_inside_salloc_keeps_the_batch_files_job_name(tmp_path):
    """Inside salloc (BatchFlag=0), SLURM_JOB_NAME is the allocation's name (interactive): the
    line leaves the name to the batch file's own --job-name, so the job it submits, chained or
    typed, writes mnist-ddp-<id>.out. A batch job's own name is kept (a chain of it too)."""
    inside = resubmit_line(settings(tmp_path), {**JOB, "SLURM_JOB_NAME": "interactive"},
                           job_fields(LINE.replace("BatchFlag=1", "BatchFlag=0")))
    assert "--job-name" not in inside, inside
    chained = resubmit_line(settings(tmp_path), {**JOB, "SLURM_JOB_NAME": "lr-sweep"}, job_fields(LINE))
    assert " --job-name=lr-sweep " in chained, chained


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


def test_the_line_that_continues_a_chain_counts_it_down(tmp_path):
    """CHAIN=N: the job that continues the run may chain N-1 more; CHAIN=0 or unset: no CHAIN."""
    assert " CHAIN=2 sbatch " in resubmit_line(settings(tmp_path, CHAIN="3"), JOB, {})
    assert " CHAIN=0 sbatch " in resubmit_line(settings(tmp_path, CHAIN="1"), JOB, {})
    assert "CHAIN" not in resubmit_line(settings(tmp_path, CHAIN="0"), JOB, {}) + resubmit_line(settings(tmp_path), JOB, {})


def test_a_chained_job_is_submitted_with_its_line_alone_after_this_one(tmp_path):
    """The line's sbatch words, after --parsable and the dependency on this job; its settings
    in place of those this job read (MASTER_PORT, SWEEP_FILE: the line sets neither), and
    none of the SLURM_* variables of this job but SLURM_CONF; the rest of the environment
    kept, as a shell would keep it."""
    line = ("SHARED_DIR='/s d' RUN_NAME=lr=1e-3 CHAIN=1 sbatch --nodes=1 --ntasks-per-node=2 /p/run_training.sbatch "
            "--epochs 3 --lr '1e-3'")
    env = {**JOB, "SLURM_ARRAY_TASK_ID": "7", "SLURM_MEM_PER_CPU": "1000", "SLURM_CONF": "/etc/slurm/slurm.conf",
           "MASTER_PORT": "29500", "SWEEP_FILE": "lr.txt", "CHAIN": "2", "RUN_NAME": "old", "PATH": "/v/bin:/bin",
           "HOME": "/home/ann"}
    command, given = chained_submission(line, "70_7", env)
    assert command == ["sbatch", "--parsable", "--dependency=afterany:70_7", "--nodes=1", "--ntasks-per-node=2",
                       "/p/run_training.sbatch", "--epochs", "3", "--lr", "1e-3"]
    assert given == {"SLURM_CONF": "/etc/slurm/slurm.conf", "PATH": "/v/bin:/bin", "HOME": "/home/ann",
                     "SHARED_DIR": "/s d", "RUN_NAME": "lr=1e-3", "CHAIN": "1"}
    for wrong in ("python mnist_ddp.py --epochs 3", "sbatch 'x", "echo hi; sbatch run_training.sbatch"):
        with pytest.raises(ValueError):
            chained_submission(wrong, "7", env)


def stand_in(folder: Path, name: str, prints: str) -> None:
    """An executable `name` in `folder` that prints `prints`, whatever it is asked."""
    folder.mkdir(exist_ok=True)
    (folder / name).write_text(f"#!/bin/sh\ncat <<'EOF'\n{prints}\nEOF\n")
    (folder / name).chmod(0o755)


@pytest.mark.parametrize("first, second, expected", [
    ("localhost", "10.0.0.2", "10.0.0.1"),   # the first node's own name resolves to a loopback address there
    ("10.0.0.7", "10.0.0.2", "10.0.0.7"),    # it resolves to an address the others reach: that one
], ids=["own-name-loopback", "own-name-routable"])
def test_the_rendezvous_address_of_a_job_of_several_nodes_is_never_a_loopback_one(tmp_path, monkeypatch, first,
                                                                                   second, expected):
    """On many clusters a node's own name resolves to 127.0.1.1 there (localhost stands for it:
    127.0.0.1): the other nodes could never reach that. The supervisor then gives the address
    this node reaches the second node from (`ip route get`'s src), which the second reaches back."""
    stand_in(tmp_path / "bin", "scontrol", f"{first}\n{second}")
    stand_in(tmp_path / "bin", "ip", f"{second} via 10.0.0.254 dev eth0 src 10.0.0.1 uid 0")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:/usr/bin:/bin")
    address = master_address({"SLURM_JOB_NODELIST": "node[1-2]"})
    assert address == expected and not address.startswith("127.")
    assert master_address({"SLURM_JOB_NODELIST": "node[1-2]", "MASTER_ADDR": "10.9.9.9"}) == "10.9.9.9"  # (the user's)


def test_compile_caches_are_on_node_local_scratch_in_a_folder_of_the_job():
    """Each task puts torch's compile caches on its node's $TMPDIR (else /tmp), one folder per
    job (an array task's its own), unless they were given (step.task keeps yours)."""
    assert compile_caches({"SLURM_JOB_ID": "77", "TMPDIR": "/scratch/77"}) == {
        "TORCHINDUCTOR_CACHE_DIR": "/scratch/77/mnist-ddp-77/inductor", "TRITON_CACHE_DIR": "/scratch/77/mnist-ddp-77/triton"}
    assert compile_caches({"SLURM_JOB_ID": "80", "SLURM_ARRAY_JOB_ID": "78", "SLURM_ARRAY_TASK_ID": "2", "TMPDIR": ""}) == {
        "TORCHINDUCTOR_CACHE_DIR": "/tmp/mnist-ddp-78_2/inductor", "TRITON_CACHE_DIR": "/tmp/mnist-ddp-78_2/triton"}
