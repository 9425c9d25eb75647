"""Launch-environment parsing (ddpkit/launch.py): torchrun's variables, Slurm's (host lists, the port,
a missing srun, ranks that do not add up, GPUs granted) and the single-process fallback, every field
of the Launch each gives; the stop signals' flag; the exit codes and exit files the launchers read.

    python -m pytest tests/unit/test_launch.py
"""

import signal
import socket
import sys
import weakref

import pytest

from ddpkit.job.contract import EXIT_BUG, EXIT_LOST_PEER, EXIT_STOPPED, JobEnv, JobPaths, port_from_job_id
from ddpkit.launch import (
    Launch,
    StopSignals,
    UsageError,
    exit_status,
    expand_hostlist,
    gpus_granted,
    read_launch_env,
    record_exit,
    record_node_fault,
    tasks_on_node,
    unfixable_exit,
    write_exit_file,
)
from ddpkit.run.time_limit import JobTimes, TimeLimit

SRUN_TASK = {"SLURM_JOB_ID": "1234", "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4",
             "SLURM_STEP_ID": "0", "SLURM_JOB_NODELIST": "node[07-08]", "SLURM_CPUS_PER_TASK": "8"}


@pytest.mark.parametrize("hostlist, hosts", [
    ("node01", ["node01"]),
    ("node[01-04,07],gpu3", ["node01", "node02", "node03", "node04", "node07", "gpu3"]),
    ("gpu3,node[1-2]", ["gpu3", "node1", "node2"]),
    ("n[008-010]", ["n008", "n009", "n010"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("a-b.c,d[5]", ["a-b.c", "d5"]),
])
def test_expand_hostlist(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("bad", ["node[a-b]", "node[1-]", ""])
def test_expand_hostlist_rejects_garbage(bad):
    with pytest.raises(UsageError, match="host list"):
        expand_hostlist(bad)


def test_single_process():
    launch = read_launch_env({})
    assert (launch.source, launch.rank, launch.local_rank, launch.world_size, launch.job_id) == ("single", 0, 0, 1, "")


def test_torchrun():
    env = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400",
           "OMP_NUM_THREADS": "1"}
    launch = read_launch_env(env)
    assert (launch.source, launch.rank, launch.local_rank, launch.world_size) == ("torchrun", 5, 1, 8)
    assert (launch.master_addr, launch.master_port, launch.num_threads) == ("10.0.0.1", 29400, 0)


def test_torchrun_wins_over_slurm():
    # torchrun started by srun (one agent per node): its variables describe the workers.
    env = {**SRUN_TASK, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "node07", "MASTER_PORT": "20000"}
    launch = read_launch_env(env)
    assert (launch.source, launch.world_size, launch.job_id) == ("torchrun", 2, "1234")


def test_torchrun_incomplete():
    with pytest.raises(UsageError, match="MASTER_ADDR, MASTER_PORT"):
        read_launch_env({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})


def test_slurm_task():
    launch = read_launch_env(SRUN_TASK)
    assert (launch.source, launch.rank, launch.local_rank, launch.world_size) == ("slurm", 3, 1, 4)
    assert launch.master_addr == "node07"
    assert launch.master_port == port_from_job_id("1234") == 11234
    assert launch.num_threads == 8


def test_a_rank_tells_the_supervisor_that_its_node_failed_it(tmp_path):
    """By its node as Slurm names it (SLURMD_NODENAME, which may differ from the host's name),
    in the file the supervisor pins the failure on the node by (exit 5)."""
    launch = read_launch_env({**SRUN_TASK, "SLURMD_NODENAME": "gpu17", JobEnv.EXIT_DIR: str(tmp_path / "job-1234")})
    record_node_fault("CUDA error: uncorrectable ECC error encountered", launch)
    assert (tmp_path / "job-1234" / JobPaths.NODE_FAULT.format(3)).read_text() == \
        "gpu17 CUDA error: uncorrectable ECC error encountered\n"


def test_slurm_step_nodelist_and_explicit_master():
    env = {**SRUN_TASK, "SLURM_STEP_NODELIST": "node08", "MASTER_PORT": "23456"}
    assert (read_launch_env(env).master_addr, read_launch_env(env).master_port) == ("node08", 23456)
    env["MASTER_ADDR"] = "10.1.2.3"
    assert read_launch_env(env).master_addr == "10.1.2.3"


def test_slurm_array_job_gets_its_own_name_and_port():
    env = {**SRUN_TASK, "SLURM_JOB_ID": "1300", "SLURM_ARRAY_JOB_ID": "1296", "SLURM_ARRAY_TASK_ID": "4"}
    launch = read_launch_env(env)
    assert launch.job_id == "1296_4"
    assert launch.master_port == port_from_job_id("1300")  # each array task has a job id of its own


def test_omp_num_threads_is_respected():
    assert read_launch_env({**SRUN_TASK, "OMP_NUM_THREADS": "2"}).num_threads == 0


def test_slurm_without_srun_fails_with_hint():
    env = {k: v for k, v in SRUN_TASK.items() if k != "SLURM_STEP_ID"}
    env["SLURM_PROCID"] = "0"
    with pytest.raises(UsageError, match=r"not started by srun.*HINT: run it as `srun"):
        read_launch_env(env)


def test_an_salloc_shell_of_several_tasks_fails_with_the_same_hint():
    """salloc sets the job's variables but no SLURM_PROCID: a bare `python mnist_ddp.py`
    there would train alone on one task's share."""
    env = {"SLURM_JOB_ID": "8", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n1", "SLURM_NNODES": "1"}
    with pytest.raises(UsageError, match=r"SLURM_NTASKS=2 but this process was not started by srun.*HINT"):
        read_launch_env(env)
    assert read_launch_env({**env, "SLURM_NTASKS": "1"}).source == "single"
    assert read_launch_env(env, alone_ok=True).source == "single"  # (--help, --download-only)


def test_a_hangup_ignored_by_nohup_stays_ignored():
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        stop = StopSignals()
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        stop.restore()
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        stop = StopSignals()
        assert signal.getsignal(signal.SIGHUP) == stop.handle
        stop.restore()
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_slurm_batch_step_with_one_task_runs_alone():
    launch = read_launch_env({"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_NODELIST": "n1"})
    assert (launch.source, launch.world_size, launch.job_id) == ("slurm", 1, "7")


@pytest.mark.parametrize("env", [
    {**SRUN_TASK, "SLURM_PROCID": "4"},
    {**SRUN_TASK, "SLURM_PROCID": "-1"},
    {**SRUN_TASK, "SLURM_LOCALID": "5"},
    {"RANK": "2", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"},
    {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "0", "MASTER_ADDR": "a", "MASTER_PORT": "1"},
])
def test_ranks_that_do_not_add_up(env):
    with pytest.raises(UsageError, match="ranks do not add up"):
        read_launch_env(env)


def test_non_integer_variable():
    with pytest.raises(UsageError, match="SLURM_NTASKS='four' is not an integer"):
        read_launch_env({**SRUN_TASK, "SLURM_NTASKS": "four"})


@pytest.mark.parametrize("value, node, count", [("2(x3),1", 0, 2), ("2(x3),1", 3, 1), ("4", 0, 4), ("3,1", 1, 1)])
def test_tasks_on_node(value, node, count):
    assert tasks_on_node(value, node) == count


@pytest.mark.parametrize("value, node, count", [("2(x3),1", 4, 0), ("2", 1, 0)])
def test_a_node_past_the_task_counts_has_none(value, node, count):
    assert tasks_on_node(value, node) == count


# ----------------------------------------------------------------------------- every field of the Launch

def test_every_field_of_a_torchrun_worker():
    env = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400",
           "LOCAL_WORLD_SIZE": "4", "TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_MAX_RESTARTS": "3",
           "SLURM_JOB_ID": "55", "SLURM_CPUS_PER_TASK": "6", "MNIST_DDP_EXIT_DIR": "/tmp/exits", "SLURM_RESTART_COUNT": "2",
           "CUDA_VISIBLE_DEVICES": "0,1", "SLURMD_NODENAME": "node08"}
    assert read_launch_env(env) == Launch("torchrun", 5, 1, 8, "10.0.0.1", 29400, "55", 6, local_world_size=4,
                                          gpus_granted="CUDA_VISIBLE_DEVICES=0,1", attempt="2/4", restarts_left=2,
                                          exit_dir="/tmp/exits", requeues=2, nodes=2, node="node08")
    # Without LOCAL_WORLD_SIZE (an older torchrun), at least this rank's; without the agent's
    # restart counts, the attempt run_training.sbatch gives; never fewer than one node.
    bare = {k: v for k, v in env.items() if not k.startswith(("LOCAL_WORLD", "TORCHELASTIC"))}
    launch = read_launch_env({**bare, "MNIST_DDP_ATTEMPT": "2/3", "WORLD_SIZE": "2", "RANK": "1"})
    assert (launch.local_world_size, launch.attempt, launch.restarts_left, launch.nodes) == (2, "2/3", 0, 1)
    assert read_launch_env({**env, "WORLD_SIZE": "6"}).nodes == 1  # whole nodes: 6 ranks at 4 a node


def test_every_field_of_a_slurm_task():
    env = {**SRUN_TASK, "SLURM_STEP_TASKS_PER_NODE": "1,3", "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_NODEID": "1",
           "SLURM_GPUS_PER_TASK": "1", "SLURM_STEP_NUM_NODES": "2", "SLURM_NNODES": "5", "SLURM_RESTART_COUNT": "1",
           "SLURM_GPUS_ON_NODE": "2", "MNIST_DDP_ATTEMPT": "2/3", "MNIST_DDP_EXIT_DIR": "/tmp/exits",
           "SLURMD_NODENAME": "node08"}
    assert read_launch_env(env) == Launch("slurm", 3, 1, 4, "node07", 11234, "1234", 8, local_world_size=3,
                                          gpus_granted="SLURM_GPUS_ON_NODE=2", gpu_per_task=True, attempt="2/3",
                                          restarts_left=0, exit_dir="/tmp/exits", requeues=1, nodes=2, node="node08")
    # The job's task counts and node count where the step's are not set; node 0 where no
    # node id is; the local rank where the counts say fewer.
    job_wide = {k: v for k, v in env.items() if k not in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_STEP_NUM_NODES",
                                                          "SLURM_NODEID")}
    launch = read_launch_env(job_wide)
    assert (launch.local_world_size, launch.nodes, launch.gpu_per_task) == (2, 5, True)
    launch = read_launch_env({**job_wide, "SLURM_TASKS_PER_NODE": "1", "SLURM_LOCALID": "1"})
    assert launch.local_world_size == 2
    assert read_launch_env({**job_wide, "SLURM_TASKS_PER_NODE": "3,1", "SLURM_NODEID": ""}).local_world_size == 3
    plain = read_launch_env(SRUN_TASK)  # no task counts: every task on this node; no node count: one node
    assert (plain.local_world_size, plain.nodes, plain.gpu_per_task, plain.gpus_granted, plain.requeues,
            plain.attempt, plain.exit_dir) == (4, 1, False, "", 0, "1/1", "")


def test_every_field_of_one_process():
    assert read_launch_env({"SLURM_CPUS_PER_TASK": "3"}) == Launch("single", 0, 0, 1, "127.0.0.1", 0, "", 3,
                                                                   node=socket.gethostname())  # (no Slurm node: the host)
    assert read_launch_env({"SLURM_CPUS_PER_TASK": ""}).num_threads == 0
    assert read_launch_env({"RANK": "0"}).source == "single"  # torchrun sets both RANK and WORLD_SIZE
    assert read_launch_env({"WORLD_SIZE": "1"}).source == "single"


def test_a_slurm_task_without_a_job_id_node_list_or_node_id():
    launch = read_launch_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_TASKS_PER_NODE": "1"})
    assert (launch.source, launch.master_addr, launch.master_port, launch.job_id, launch.local_world_size) == (
        "slurm", "127.0.0.1", 10000, "", 1)
    launch = read_launch_env({**SRUN_TASK, "SLURM_JOB_NODELIST": "", "SLURM_NODELIST": "n[3-4]"})
    assert launch.master_addr == "n3"
    with pytest.raises(UsageError) as refused:
        read_launch_env({**SRUN_TASK, "SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_JOB_NODELIST": ""})
    assert str(refused.value) == "SLURM_JOB_NODELIST is not set, so the first host is unknown; set MASTER_ADDR"


def test_an_array_task_needs_both_array_variables():
    assert read_launch_env({**SRUN_TASK, "SLURM_ARRAY_JOB_ID": "1296"}).job_id == "1234"
    assert read_launch_env({**SRUN_TASK, "SLURM_ARRAY_TASK_ID": "4"}).job_id == "1234"


@pytest.mark.parametrize("env, message", [
    ({**SRUN_TASK, "SLURM_JOB_ID": "12x"}, "SLURM_JOB_ID='12x' is not a job id; unset it or set MASTER_PORT"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "a"},
     "RANK and WORLD_SIZE are set but MASTER_PORT not; launch with torchrun, or unset RANK/WORLD_SIZE"),
    ({**SRUN_TASK, "MNIST_DDP_ATTEMPT": "0/3"}, "MNIST_DDP_ATTEMPT='0/3' is not k/N; unset it"),
    ({**SRUN_TASK, "SLURM_PROCID": "5"}, "ranks do not add up (slurm: rank 5, local rank 1, world size 4); HINT: start one "
                                         "task per rank, e.g. srun --ntasks-per-node=N"),
    ({**SRUN_TASK, "MASTER_PORT": "65536"}, "master port 65536 is not a TCP port; set MASTER_PORT to 1024-65535"),
    ({**SRUN_TASK, "SLURM_NTASKS": "2", "SLURM_PROCID": "1", "MASTER_PORT": "0"},
     "master port 0 is not a TCP port; set MASTER_PORT to 1024-65535"),
    ({k: v for k, v in SRUN_TASK.items() if k != "SLURM_STEP_ID"},
     "SLURM_NTASKS=4 but this process was not started by srun, so it would train alone. HINT: run it as "
     "`srun python mnist_ddp.py ...` (run_training.sbatch does), or ask for --ntasks=1"),
])
def test_refusals_say_what_to_fix(env, message):
    with pytest.raises(UsageError) as refused:
        read_launch_env(env)
    assert str(refused.value) == message


def test_the_ports_that_are_accepted():
    for port in ("1", "65535"):
        assert read_launch_env({**SRUN_TASK, "MASTER_PORT": port}).master_port == int(port)
    # One process opens no port: its own 0 is fine.
    assert read_launch_env({**SRUN_TASK, "SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
                            "MASTER_PORT": "0"}).master_port == 0


@pytest.mark.parametrize("env, granted", [
    ({}, ""),
    ({"SLURM_GPUS_ON_NODE": "0", "SLURM_JOB_GPUS": "", "SLURM_STEP_GPUS": "-1", "CUDA_VISIBLE_DEVICES": "NoDevFiles"}, ""),
    ({"SLURM_GPUS_ON_NODE": "1", "CUDA_VISIBLE_DEVICES": "0"}, "SLURM_GPUS_ON_NODE=1"),
    ({"SLURM_GPUS_ON_NODE": "0", "SLURM_JOB_GPUS": "0", "CUDA_VISIBLE_DEVICES": "1"}, "SLURM_JOB_GPUS=0"),
    ({"SLURM_GPUS_ON_NODE": "none", "SLURM_STEP_GPUS": "2,3", "CUDA_VISIBLE_DEVICES": "1"}, "SLURM_STEP_GPUS=2,3"),
    ({"CUDA_VISIBLE_DEVICES": " 0 "}, "CUDA_VISIBLE_DEVICES=0"),
])
def test_which_variable_says_gpus_were_granted(env, granted):
    """A count of 0, an empty list, -1 and NoDevFiles grant none; GPU 0 is a GPU."""
    assert gpus_granted(env) == granted


# ----------------------------------------------------------------------------- the stop signals

def test_a_stop_signal_only_sets_a_flag_and_the_first_one_says_why():
    stop = StopSignals()
    try:
        assert {signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGTERM)} == {stop.handle}
        assert stop.asked() is False
        with pytest.raises(KeyboardInterrupt):  # before training: nothing to save
            stop.handle(signal.SIGINT, None)
        try:
            stop.handle(signal.SIGUSR1, None)
        except KeyboardInterrupt:
            pytest.fail("SIGUSR1 before training was taken for a Ctrl-C")
        assert stop.asked() and stop.received == signal.SIGUSR1
        stop.handle(signal.SIGTERM, None)
        assert stop.received == signal.SIGUSR1
        again = StopSignals()
        again.training = True
        again.handle(signal.SIGINT, None)
        assert again.received == signal.SIGINT
        again.restore()
    finally:
        stop.restore()


def test_a_ctrl_c_swallowed_where_python_ignores_exceptions_stops_training_before_it_begins(capsys):
    """A Ctrl-C whose KeyboardInterrupt lands in a weakref callback (the import system's module
    locks), where Python can only ignore it: no traceback, and training does not begin."""
    before = sys.unraisablehook
    stop = StopSignals()
    try:
        class Held:
            pass

        held = Held()
        watch = weakref.ref(held, lambda _: stop.handle(signal.SIGINT, None))
        del held  # (the callback runs now, and Python ignores its KeyboardInterrupt)
        assert watch() is None and capsys.readouterr().err == ""
        with pytest.raises(KeyboardInterrupt):
            stop.begin_training()
        assert not stop.training
    finally:
        stop.restore()
    assert sys.unraisablehook is before


def test_the_time_limit_asks_for_a_stop_on_rank_0():
    class Clock:
        now = 0.0

        def __call__(self):
            return self.now

    clock, stop = Clock(), StopSignals()
    try:
        stop.time_limit = TimeLimit(JobTimes(0.0, 1000.0), "1", clock)
        assert stop.asked() is False
        clock.now = 940.0
        assert stop.asked() is True and stop.time_up
        clock.now = 0.0  # once asked, it stays asked
        assert stop.asked() is True
    finally:
        stop.restore()


# ----------------------------------------------------------------------------- exit codes and exit files

def test_each_rank_leaves_its_exit_code_in_the_exit_folder(tmp_path):
    launch = Launch("torchrun", 1, 1, 2, "a", 1, "", 0, exit_dir=str(tmp_path / "exits" / "job-7"))
    record_exit(EXIT_LOST_PEER, launch)
    assert (tmp_path / "exits" / "job-7" / "rank-1").read_text() == "4\n"
    write_exit_file(launch, launch.paths.continue_command, "python mnist_ddp.py\n")
    assert sorted(p.name for p in (tmp_path / "exits" / "job-7").iterdir()) == ["continue-command", "rank-1"]
    record_exit(EXIT_BUG, None)  # before the launch was read: nowhere to write
    nowhere = Launch("single", 0, 0, 1, "a", 0, "", 0)
    write_exit_file(nowhere, nowhere.paths.rank_code(0), "1\n")
    record_exit(EXIT_BUG, nowhere)
    assert list(tmp_path.iterdir()) == [tmp_path / "exits"]
    # A folder that cannot be written (here: a file in the way) loses the code, not the exit.
    (tmp_path / "file").write_text("")
    record_exit(EXIT_BUG, Launch("single", 0, 0, 1, "a", 0, "", 0, exit_dir=str(tmp_path / "file")))


def test_a_restart_ends_at_once_after_a_code_that_a_restart_does_not_fix(tmp_path):
    launch = Launch("torchrun", 0, 0, 2, "a", 1, "", 0, attempt="2/3", exit_dir=str(tmp_path))
    assert unfixable_exit(launch) == (0, "")
    (tmp_path / "rank-0").write_text("4\n")
    (tmp_path / "rank-1").write_text("not a number\n")
    (tmp_path / "other").write_text("1\n")
    (tmp_path / "rank-10").mkdir()  # (not a file: unreadable)
    assert unfixable_exit(launch) == (0, "")  # a lost peer: the restart may fix it
    (tmp_path / "rank-2").write_text("2\n")
    (tmp_path / "rank-3").write_text("1\n")
    assert unfixable_exit(launch) == (2, "rank-2")
    first = Launch("torchrun", 0, 0, 2, "a", 1, "", 0, attempt="1/3", exit_dir=str(tmp_path))
    assert unfixable_exit(first) == (0, "")  # the files of an earlier job step, not of this one's attempts
    assert unfixable_exit(Launch("torchrun", 0, 0, 2, "a", 1, "", 0, attempt="2/3")) == (0, "")
    (tmp_path / "rank-2").write_text("75\n")
    assert unfixable_exit(launch) == (EXIT_STOPPED, "rank-2")


def test_under_torchrun_with_restarts_left_an_unfixable_code_exits_0(monkeypatch, tmp_path):
    worker = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "29400",
              "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "2", "MNIST_DDP_EXIT_DIR": str(tmp_path)}
    for name, value in worker.items():
        monkeypatch.setenv(name, value)
    assert [exit_status(code) for code in (0, 1, 2, 3, 4, 75, 143)] == [0, 0, 0, 0, 4, 0, 143]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # one restart left
    assert exit_status(2) == 0
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")  # the last attempt: its code is the job's
    assert [exit_status(code) for code in (1, 4)] == [1, 4]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.delenv("MNIST_DDP_EXIT_DIR")  # torchrun without run_training.sbatch: the code itself
    assert exit_status(2) == 2
    monkeypatch.setenv("RANK", "two")  # a launch that cannot be read: the code itself
    assert exit_status(2) == 2
