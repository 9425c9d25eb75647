"""Failures that heal by themselves, with real processes, real signals and a real Slurm
(local-slurm.sh): a rank SIGKILLed twice in one job, a rank frozen with SIGSTOP, a
crash loop, failures that must not be retried, a torchrun worker killed across two
nodes, a whole node lost from a three-node cluster (the job requeued onto the nodes left,
by Slurm or, under --no-kill, by the supervisor; or with MIN_NODES going on with the node
it still holds). Also, at unit level: what a lost
peer says, and --ckpt-minutes with a fake clock (which outcomes the job retries:
tests/test_slurm_job.py).

The times these tests print (kill to resumed, hang detected, node lost to training
again) are the README's "Failures and recovery" figures; nothing asserts on them.

    python -m pytest tests/test_recovery.py -s
"""

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import LOCAL_SLURM, Cluster, clean_env, finish, load_params, read_metrics
from ddpkit import checkpoints, distributed, recovery
from ddpkit.launch import StopSignals, exit_status, read_launch_env, unfixable_exit

FAST = ["--batch-size", "64", "--ckpt-every", "10"]  # 32 steps an epoch on 2 ranks, a checkpoint every 10


# ----------------------------------------------------------------------------- helpers

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


def tensorboard_steps(run_dir: Path, tag: str) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return [e.step for e in events.Scalars(tag)]


@pytest.fixture(scope="module")
def three_nodes(tmp_path_factory):
    """Three nodes; slurmctld declares a silent node down within about 10 s."""
    cluster = Cluster(tmp_path_factory.mktemp("slurm3"), 3,
                      clean_env(LOCAL_SLURM_PORT="16847", LOCAL_SLURM_PREFIX="ft", LOCAL_SLURM_SUBNET="10.231.11",
                                LOCAL_SLURM_SELF_LOOPBACK="1", LOCAL_SLURM_CONF="SlurmdTimeout=10\nMessageTimeout=3"))
    yield cluster
    cluster.stop()


# ----------------------------------------------------------------------------- unit level

@pytest.mark.parametrize("message, lost", [
    ("[gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:5525", True),   # a peer killed
    ("Read error [10.231.19.12]:34966: Connection reset by peer", True),
    ("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 20000ms for recv operation to complete", True),
    ("Application timeout caused pair closure", True),                                         # a peer hung (SIGSTOP)
    ("size mismatch for classifier.2.weight", False),                                          # our own bug
])
def test_which_errors_mean_a_lost_peer(message, lost):
    """The words Gloo used in these tests' runs for a dead or frozen peer; anything else is a bug."""
    assert recovery.is_lost_peer(RuntimeError(message)) is lost


def test_checkpoint_clock_with_a_fake_clock():
    now = [100.0]
    clock = recovery.CheckpointClock(2.5, clock=lambda: now[0])
    now[0] += 149
    assert not clock.due()
    now[0] += 1
    assert clock.due()
    clock.reset()
    assert not clock.due()
    assert not recovery.CheckpointClock(0, clock=lambda: now[0] + 1e9).due()  # 0: never


def _agreement(rank: int, init: str, result: dict) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    rt = distributed.Runtime(rank, rank, 2, torch.device("cpu"), "gloo", rank == 0)
    now = [0.0]
    clock = recovery.CheckpointClock(1, clock=lambda: now[0])
    stop = StopSignals()
    stop.restore()
    loss = torch.tensor(0.5)
    agree = lambda: recovery.read_agreement(recovery.start_agreement(stop, loss, clock, rt))  # noqa: E731
    first = agree()
    if rank == 0:
        now[0] = 61.0  # only rank 0's clock has passed the minute
    second = agree()
    progress = checkpoints.Progress(epoch=3, step=77)
    if rank == 1:
        dist.destroy_process_group()
        os._exit(0)  # rank 1 dies: rank 0's next collective loses it
    try:
        agree()
        lost = "no error"
    except Exception as err:  # what main() sees
        lost = recovery.lost_peer_message(err, progress) if recovery.is_lost_peer(err) else f"not a lost peer: {err!r}"
    result.update(first=first, second=second, lost=lost)


def test_ranks_agree_on_a_checkpoint_due_by_time_and_name_a_lost_peer(tmp_path):
    """Two real Gloo ranks: when one rank's clock says a checkpoint is due, both decide to
    save; when rank 1 dies, rank 0's error names the operation and the step."""
    manager = mp.Manager()
    result = manager.dict()
    ctx = mp.get_context("spawn")
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [ctx.Process(target=_agreement, args=(rank, init, result if rank == 0 else {})) for rank in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert result["first"] == recovery.Verdict(stopping=False, diverged=False, ckpt_due=False)
    assert result["second"] == recovery.Verdict(stopping=False, diverged=False, ckpt_due=True)
    assert result["lost"].startswith("lost contact with another rank during the per-step agreement "
                                     "(stop, divergence, checkpoint time) at step 77 (epoch 3): a peer probably died or hung ("), \
        result["lost"]


def _lagged_stop(rank: int, init: str, result: dict) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    rt = distributed.Runtime(rank, rank, 2, torch.device("cpu"), "gloo", rank == 0)
    clock, stop = recovery.CheckpointClock(0), StopSignals()
    stop.restore()
    pending, seen = None, []
    for step in range(1, 7):  # as main() does after each training step
        earlier = recovery.read_agreement(pending) if pending else recovery.Verdict()
        if rank == 1 and step == 3:
            stop.received = signal.SIGUSR1  # arrives on rank 1 only, during step 3
        pending = recovery.start_agreement(stop, torch.tensor(1.0 if step != 5 else float("nan")), clock, rt)
        seen.append((step, earlier.stopping, earlier.diverged))
    result[rank] = seen
    dist.destroy_process_group()


def test_the_per_step_agreement_lands_one_step_later_on_every_rank(tmp_path):
    """The flags of step N are reduced while step N+1 runs and read after it: a signal on
    rank 1 during step 3 stops both ranks after step 4; rank 0 learns of a loss that went
    non-finite at step 5 after step 6, like rank 1."""
    result = mp.Manager().dict()
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [mp.get_context("spawn").Process(target=_lagged_stop, args=(rank, init, result)) for rank in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    expected = [(1, False, False), (2, False, False), (3, False, False), (4, True, False), (5, True, False),
                (6, True, True)]
    assert result[0] == result[1] == expected


def test_torchrun_workers_hide_unfixable_codes_from_the_agent(monkeypatch, tmp_path):
    """Under run_training.sbatch's torchrun, a code no restart fixes is written down and
    reported to the agent as 0 while it would restart; a lost peer stays non-zero."""
    for var in ("SLURM_JOB_ID", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999",
                "TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_MAX_RESTARTS": "3", "MNIST_DDP_EXIT_DIR": str(tmp_path)}
    for name, value in torchrun.items():
        monkeypatch.setenv(name, value)
    assert [exit_status(code) for code in (0, 1, 2, 3, 4, 75)] == [0, 0, 0, 0, 4, 0]
    launch = read_launch_env(os.environ)
    assert launch.attempt == "2/4" and launch.restarts_left == 2
    assert unfixable_exit(launch) == (0, "")
    (tmp_path / "rank-0").write_text("4\n")
    (tmp_path / "rank-1").write_text("1\n")
    assert unfixable_exit(launch) == (1, "rank-1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")  # the last attempt: the agent hears the real code
    assert exit_status(2) == 2
    monkeypatch.delenv("MNIST_DDP_EXIT_DIR")  # torchrun by hand: real codes always
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert exit_status(2) == 2


# ----------------------------------------------------------------------------- on a real Slurm

def test_a_rank_killed_twice_heals_within_the_job_bit_identically(one_node, tmp_path):
    """SIGKILL rank 1 in epoch 2 and again in epoch 5 of the restarted step: the job
    restarts the step twice in its allocation and ends with the very parameters of an
    uninterrupted run, every epoch and every logged step once in metrics and TensorBoard."""
    options = ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1"]
    reference = one_node.sbatch(tmp_path / "reference", options, FAST, RUN_NAME="straight")
    client = one_node.sbatch(tmp_path, options, FAST, RUN_NAME="healed")
    kills = []
    for epoch in (1, 4):  # epoch 4 ends only in the restarted step
        wait_for(tmp_path, rf"^0: epoch   {epoch} \|")
        kills.append(signal_rank("healed", 1, signal.SIGKILL))
    resumed = [wait_for(tmp_path, r"^0: resumed from ", n) for n in (1, 2)]
    job_id, out = finish(client, tmp_path)
    finish(reference, tmp_path / "reference")
    print(f"\nSIGKILL to training resumed: {[round(r - k, 1) for k, r in zip(kills, resumed, strict=True)]} s; "
          f"steps lost per crash: {lost_steps(out)}")
    assert re.findall(r"^ATTEMPT (\d/4) after exit \d+ \(rank 1 ended without an exit code", out, re.M) == ["2/4", "3/4"], \
        out[-3000:]
    assert re.search(rf"^END .* job={job_id} exit=0$", out, re.M)
    assert re.findall(r"^0: resumed from .* \(attempt (\d/4), requeued 0x\)$", out, re.M) == ["2/4", "3/4"]
    run_dir = tmp_path / "runs" / "healed"
    healed, straight = load_params(run_dir), load_params(tmp_path / "reference" / "runs" / "straight")
    assert healed.keys() == straight.keys()
    assert all(torch.equal(healed[k], straight[k]) for k in healed)
    assert [m["epoch"] for m in read_metrics(run_dir)] == list(range(1, 9))
    steps = tensorboard_steps(run_dir, "train/batch_loss")
    assert steps == sorted(set(steps)) == list(range(50, 257, 50))
    assert tensorboard_steps(run_dir, "test/accuracy") == list(range(32, 257, 32))


def test_a_hung_rank_is_named_from_outside_before_the_timeout_and_the_job_heals(one_node, tmp_path):
    """SIGSTOP freezes rank 1 mid-training: after --hang-after (its default: 10 s at
    --dist-timeout 20) rank 0 names it, stopped, from /proc, with its host, and keeps both
    ranks' stacks (rank 1's from faulthandler, or none: it is stopped); rank 0 gives up on it
    after --dist-timeout with the lost-peer code, and the restarted step completes. The ranks
    were given NCCL's Flight Recorder settings, which a Gloo run ignores."""
    client = one_node.sbatch(tmp_path, ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1"],
                             [*FAST, "--dist-timeout", "20"], RUN_NAME="frozen")
    wait_for(tmp_path, r"^0: epoch   1 \|")
    environ = (Path("/proc") / str(rank_pids("frozen", 1)[0]) / "environ").read_bytes().split(b"\0")
    stopped = signal_rank("frozen", 1, signal.SIGSTOP)
    named = wait_for(tmp_path, r"^0: hang after step \d+: rank 1 on ")
    noticed = wait_for(tmp_path, r"error: lost contact with another rank during .*(Timed out|timeout)")
    print(f"\nhang (SIGSTOP) named after {named - stopped:.1f} s, given up on after {noticed - stopped:.1f} s at "
          "--dist-timeout 20")
    _, out = finish(client, tmp_path)
    verdict = re.search(r"^0: (hang after step \d+: rank 1 on (\S+) is stopped \(state T, stopped: SIGSTOP or a debugger"
                        r".*\); rank\(s\) 0 wait for it in .* for \d+ s; every rank's stacks: (\S+)); --dist-timeout "
                        r"ends the wait$", out, re.M)
    assert verdict and re.search(rf"^1: \[rank 1/2\] {re.escape(verdict.group(2))} cpu gloo", out, re.M), out[-3000:]
    print(verdict.group(1))
    assert (Path(verdict.group(3)) / "verdict.txt").read_text() == verdict.group(1) + "\n"
    assert "(most recent call first)" in next(Path(verdict.group(3)).glob("rank-0-*.txt")).read_text()
    assert out.index(verdict.group(0)) < out.index("error: lost contact with another rank")
    run_dir = tmp_path / "runs" / "frozen"
    assert f"TORCH_NCCL_DEBUG_INFO_TEMP_FILE={run_dir}/hangs/nccl-trace-rank-".encode() in environ
    assert b"TORCH_NCCL_DUMP_ON_TIMEOUT=1" in environ
    assert re.search(r"^ATTEMPT 2/4 after exit \d+ ", out, re.M)
    assert re.search(r"^0: resumed from .*\(attempt 2/4", out, re.M)
    assert [m["epoch"] for m in read_metrics(tmp_path / "runs" / "frozen")] == list(range(1, 9))


def test_a_crash_loop_gives_up_after_max_restarts(one_node, tmp_path):
    """Rank 1 is killed in every attempt: after MAX_RESTARTS=2 restarts the job gives up,
    says so on its END line and exits non-zero."""
    client = one_node.sbatch(tmp_path, ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1"],
                             [*FAST, "--epochs", "30"], RUN_NAME="doomed", MAX_RESTARTS="2")

    def killer():
        for attempt in range(1, 4):
            wait_for(tmp_path, r"^0: global batch", attempt)
            signal_rank("doomed", 1, signal.SIGKILL)
    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    client.communicate(timeout=400)
    text = output_of(tmp_path)
    thread.join(timeout=10)
    assert client.returncode not in (0, 1, 2, 3, 75), text[-3000:]
    assert re.findall(r"^ATTEMPT (\d/3) after exit", text, re.M) == ["2/3", "3/3"]
    assert re.search(r"^END .* exit=\d+ gave up after 3 attempts \(rank 1 ended without an exit code.*MAX_RESTARTS=2\)$",
                     text, re.M), text[-2000:]
    assert "to continue from the newest checkpoint" in text


def test_a_rank_that_dies_after_it_finished_and_saved_does_not_fail_the_job(one_node, tmp_path):
    """Rank 1 ends its training with 0, then dies of SIGABRT as Gloo's teardown at exit
    sometimes makes it ("terminate called without an active exception"), after rank 0 too
    recorded 0. srun reports the abort; the job still counts as done, with no restart."""
    wrapper = tmp_path / "python-then-abort"
    wrapper.write_text(f"""#!/bin/bash
"{sys.executable}" "$@"; status=$?
if [[ $status == 0 && $SLURM_PROCID == 1 && " $* " == *mnist_ddp.py* ]]; then
    for _ in $(seq 600); do [[ $(cat "$MNIST_DDP_EXIT_DIR/rank-0" 2>/dev/null) == 0 ]] && break; sleep 0.1; done
    kill -ABRT $$
fi
exit $status
""")
    wrapper.chmod(0o755)
    client = one_node.sbatch(tmp_path, ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1"],
                             ["--epochs", "1", "--max-steps", "10"], RUN_NAME="aborted-late", PYTHON=str(wrapper))
    job_id, out = finish(client, tmp_path)
    assert re.search(r"^srun: error: \S+: task 1: Aborted", out, re.M), out[-3000:]
    # 134: rank 1's abort; 143: srun ended rank 0 for it while rank 0 was still shutting down
    assert re.search(r"^every rank had finished and saved \(each recorded exit 0\) before srun's exit 1(34|43) ", out, re.M)
    assert "ATTEMPT" not in out and "to continue from" not in out
    assert re.search(rf"^END .* job={job_id} exit=0$", out, re.M)
    run_dir = tmp_path / "runs" / "aborted-late"
    assert (run_dir / "exit-code").read_text() == "0\n"
    assert (run_dir / "model.pt").exists() and read_metrics(run_dir)[-1]["epoch"] == 1


@pytest.mark.parametrize("args, code", [(["--epochs", "0"], 2), (["--lr", "1e5", "--epochs", "1"], 3)],
                         ids=["usage-error", "diverged"])
def test_usage_errors_and_divergence_are_not_retried(one_node, tmp_path, args, code):
    client = one_node.sbatch(tmp_path, ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1"], [*FAST, *args])
    _, out = finish(client, tmp_path, code=code)
    assert "ATTEMPT" not in out and out.count("PREFLIGHT") == 1
    assert re.search(rf"^END .* exit={code}$", out, re.M)


def test_torchrun_restarts_a_killed_worker_across_two_nodes(two_nodes, tmp_path):
    client = two_nodes.sbatch(tmp_path, ["--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", "--mem=1G"],
                              [*FAST, "--epochs", "6"], LAUNCHER="torchrun", RUN_NAME="elastic")
    wait_for(tmp_path, r"^0: epoch   1 \|")
    killed = signal_rank("elastic", 1, signal.SIGKILL)
    resumed = wait_for(tmp_path, r"^0: resumed from ")
    _, out = finish(client, tmp_path)
    print(f"\ntorchrun: SIGKILL to training resumed {resumed - killed:.1f} s; steps lost {lost_steps(out)}")
    assert re.search(r"^0: resumed from \S+: epoch \d, step \d+ \(attempt 2/4, requeued 0x\)", out, re.M), out[-3000:]
    assert re.search(r"^END .* exit=0$", out, re.M)
    assert [m["epoch"] for m in read_metrics(tmp_path / "runs" / "elastic")] == list(range(1, 7))


@contextlib.contextmanager
def rank_1_node_cut_off(submit_dir: Path, run_name: str):
    """Rank 1's node drops off the network (its link into the cluster's bridge goes down) and
    its rank is killed; yields (rank 0's node, the lost node, when); the link comes back after."""
    first, node = (re.search(rf"^{r}: \[rank {r}/2\] (\S+) ", output_of(submit_dir), re.M).group(1) for r in (0, 1))
    link = ["ip", "-n", f"{node[:-2]}-ctl", "link", "set", f"v{node[-1]}"]  # (local-slurm.sh's names: ftn2 is v2 in ft-ctl)
    subprocess.run([*link, "down"], check=True)
    try:
        yield first, node, signal_rank(run_name, 1, signal.SIGKILL)
    finally:
        subprocess.run([*link, "up"], check=True)


def test_a_job_that_loses_a_node_goes_on_with_the_node_left_at_half_the_world_size(three_nodes, tmp_path):
    """MIN_NODES=1, --no-kill: a 2-node job's second node drops off the network (its link down)
    and its rank is killed. Slurm declares the node down and leaves the job the first one;
    the supervisor starts the step there with 1 rank, which goes on in mid-epoch from the
    checkpoint of 2 with the same global batch, and the job ends with exit 0, each epoch
    logged once, within 0.3 points of the accuracy of a run that lost nothing."""
    args = ["--ckpt-every", "10", "--epochs", "4"]
    client = three_nodes.sbatch(tmp_path, ["--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", "--mem=1G",
                                           "--no-kill"], args, RUN_NAME="shrunk", MIN_NODES="1")
    wait_for(tmp_path, r"^0: epoch   1 \|")
    with rank_1_node_cut_off(tmp_path, "shrunk") as (first, _, lost):
        went_on = wait_for(tmp_path, r"^ATTEMPT 2/4 after exit .*: the job holds 1 of its 2 nodes", timeout=300)
        job_id, out = finish(client, tmp_path)
        ended = time.monotonic()
    print(f"\nnode lost at 0 s; the job went on with 1 node at {went_on - lost:.1f} s; it finished at {ended - lost:.1f} s")
    shrunk = re.search(r"^ATTEMPT 2/4 after exit .*$", out, re.M).group(0)
    print(shrunk)
    assert shrunk.endswith(f"the job holds 1 of its 2 nodes ({first}), so on 1 node(s) with 1 rank(s) "
                           "instead of 2; it resumes from the newest checkpoint"), shrunk
    assert re.search(r"^0: global batch 128 \(1 x 128\)", out, re.M), out[-3000:]
    assert re.search(r"^0: \S+ckpt-\d+\.pt was written by 2 ranks, this run has 1: the same global batch of 128, so the run "
                     r"goes on at step \d+", out, re.M), out[-3000:]
    assert re.search(rf"^END .* job={job_id} exit=0$", out, re.M)
    run_dir = tmp_path / "runs" / "shrunk"
    metrics = read_metrics(run_dir)
    assert [m["epoch"] for m in metrics] == [1, 2, 3, 4]
    assert not (run_dir / "checkpoints" / "superseded").exists()
    healthy = subprocess.run([sys.executable, str(LOCAL_SLURM.parent / "mnist_ddp.py"), *args, "--run-dir", "healthy"],
                             cwd=tmp_path, env=clean_env(OMP_NUM_THREADS="1"), capture_output=True, text=True)
    assert healthy.returncode == 0, healthy.stderr[-2000:]
    accuracy, expected = metrics[-1]["test_accuracy"], read_metrics(tmp_path / "healthy")[-1]["test_accuracy"]
    print(f"accuracy {accuracy:.4f}, a run that lost nothing {expected:.4f}")
    assert abs(accuracy - expected) <= 0.003


def test_a_no_kill_job_that_loses_a_node_without_min_nodes_is_requeued_onto_whole_nodes(three_nodes, tmp_path):
    """--no-kill without MIN_NODES: the job that lost a node would wait for it forever (srun
    asks for 2 nodes, the job holds 1): the supervisor requeues it instead, and it reruns
    on 2 nodes that work, resuming."""
    client = three_nodes.sbatch(tmp_path, ["--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", "--mem=1G",
                                           "--no-kill"], ["--ckpt-every", "10", "--epochs", "3"], RUN_NAME="whole")
    wait_for(tmp_path, r"^0: epoch   1 \|")
    with rank_1_node_cut_off(tmp_path, "whole") as (first, node, _):
        job_id, out = finish(client, tmp_path)
    assert re.search(rf"^requeueing Slurm job {job_id} after exit \d+: the job holds 1 of its 2 nodes \({first}\), fewer "
                     r"than MIN_NODES=2 \(unset: every node of the job\); it resumes from its last checkpoint", out, re.M), \
        out[-3000:]
    rerun_nodes = re.findall(r"^START .* restart=1 nodes=(\S+) ", out, re.M)[0]
    assert node not in subprocess.run([str(LOCAL_SLURM), "exec", str(three_nodes.dir), "scontrol", "show", "hostnames",
                                       rerun_nodes], env=three_nodes.env, capture_output=True, text=True).stdout.split()
    assert re.search(r"^0: resumed from .*\(attempt 1/4, requeued 1x\)", out, re.M)
    assert re.search(rf"^END .* job={job_id} exit=0$", out, re.M)
    assert [m["epoch"] for m in read_metrics(tmp_path / "runs" / "whole")] == [1, 2, 3]


def test_a_lost_node_requeues_the_job_onto_the_nodes_left(three_nodes, tmp_path):
    """A 2-node job loses its second node (slurmd, the step's daemon and the rank: every
    process in that node's namespace, SIGKILLed). Slurm declares the node down and
    requeues the job (--requeue), which reruns on the other two nodes and resumes."""
    client = three_nodes.sbatch(tmp_path, ["--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", "--mem=1G"],
                                [*FAST, "--epochs", "6"], RUN_NAME="survivor")
    wait_for(tmp_path, r"^0: epoch   1 \|")
    node = re.search(r"^1: \[rank 1/2\] (\S+) ", output_of(tmp_path), re.M).group(1)
    pids = subprocess.run(["ip", "netns", "pids", node], capture_output=True, text=True, check=True).stdout.split()
    subprocess.run(["kill", "-9", *pids], check=True)
    lost = time.monotonic()
    resumed = wait_for(tmp_path, r"^0: resumed from ", timeout=300)
    job_id, out = finish(client, tmp_path)
    print(f"\nnode lost to training again on the nodes left: {resumed - lost:.1f} s")
    assert re.search(rf"^START .* job={job_id} restart=1 nodes=\S+ ", out, re.M)
    rerun_nodes = re.findall(r"^START .* restart=1 nodes=(\S+) ", out, re.M)[0]
    assert node not in subprocess.run([str(LOCAL_SLURM), "exec", str(three_nodes.dir), "scontrol", "show", "hostnames",
                                       rerun_nodes], env=three_nodes.env, capture_output=True, text=True).stdout.split()
    assert re.search(r"^0: resumed from .*\(attempt 1/4, requeued 1x\)", out, re.M)
    assert [m["epoch"] for m in read_metrics(tmp_path / "runs" / "survivor")] == list(range(1, 7))
