"""Launch-environment parsing (ddpkit/launch.py): torchrun's variables, Slurm's (host lists, port derivation,
a missing srun, ranks that do not add up) and the single-process fallback.

    python -m pytest tests/test_launch.py
"""

import signal

import pytest

from ddpkit.launch import StopSignals, UsageError, expand_hostlist, port_from_job_id, read_launch_env, tasks_on_node

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


def test_port_derivation_separates_jobs_and_avoids_ephemeral_ports():
    ports = {port_from_job_id(str(job)) for job in range(5000, 5100)}
    assert len(ports) == 100
    assert all(10000 <= p < 30000 for p in ports)
    assert port_from_job_id("987654") == port_from_job_id("987654")


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
