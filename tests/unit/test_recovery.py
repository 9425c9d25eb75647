"""ddpkit/run/recovery.py at unit level: which errors mean a lost peer, --ckpt-minutes with a fake
clock, two real Gloo ranks that agree on a checkpoint due by time and name a lost peer, the
per-step agreement that lands one step later on every rank, and torchrun's workers hiding
unfixable codes from the agent (which outcomes the job retries: tests/unit/test_supervisor_outcome.py).
The failures healed on a real Slurm: tests/cluster/one_node/test_recovery_on_slurm.py and
tests/cluster/mostly_waiting/test_recovery_across_nodes.py.

    python -m pytest tests/unit/test_recovery.py
"""

import os
import signal

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ddpkit import distributed
from ddpkit.launch import StopSignals, exit_status, read_launch_env, unfixable_exit
from ddpkit.run import checkpoints, recovery

# ----------------------------------------------------------------------------- unit level

@pytest.mark.parametrize("message, lost", [
    ("[gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:5525", True),   # a peer killed
    ("Read error [10.231.19.12]:34966: Connection reset by peer", True),
    ("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 20000ms for recv operation to complete", True),
    ("Application timeout caused pair closure", True),                                         # a peer hung (SIGSTOP)
    ("size mismatch for classifier.2.weight", False),                                          # our own bug
    ("CUDA error: the launch timed out and was terminated", False),                            # a kernel's bug
])
def test_which_errors_mean_a_lost_peer(message, lost):
    """The words Gloo used in these tests' runs for a dead or frozen peer; anything else is a bug."""
    assert recovery.is_lost_peer(RuntimeError(message)) is lost


@pytest.mark.parametrize("error, fault", [
    (RuntimeError("CUDA error: uncorrectable ECC error encountered\nCUDA kernel errors might be asynchronously "
                  "reported at some other API call"), "CUDA error: uncorrectable ECC error encountered"),
    (RuntimeError("CUDA error: uncorrectable NVLink error detected during the execution"),
     "CUDA error: uncorrectable NVLink error"),
    (RuntimeError("CUDA error: CUDA-capable device(s) is/are busy or unavailable"),
     "CUDA error: CUDA-capable device(s) is/are busy or unavailable"),
    (dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error (run with NCCL_DEBUG=INFO "
                           "for details), NCCL version 2.21.5\nncclUnhandledCudaError: Call to CUDA function failed.\n"
                           "Last error:\nCuda failure 'uncorrectable ECC error encountered'"),
     "NCCL error: unhandled cuda error (uncorrectable ECC error encountered)"),
    # The run's own, or a peer's: no fault of this node (a restart elsewhere would hide a bug).
    (RuntimeError("CUDA error: device-side assert triggered"), ""),                # an index out of range: a bug
    (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), ""),  # the run's size
    (RuntimeError("CUDA error: misaligned address"), ""),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), ""),  # a kernel's bug, most often
    (RuntimeError("CUDA error: unspecified launch failure\nCompile with `TORCH_USE_CUDA_DSA`"), ""),
    (RuntimeError("CUDA error: initialization error"), ""),  # a fork after CUDA's start, drivers: the environment
    (RuntimeError("CUDA error: unknown error"), ""),
    (RuntimeError("CUDA error: the launch timed out and was terminated"), ""),
    (dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error (run with NCCL_DEBUG=INFO "
                           "for details), NCCL version 2.21.5\nncclUnhandledCudaError: Call to CUDA function failed.\n"
                           "Last error:\nCuda failure 'out of memory'"), ""),            # the run's size
    (dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error (run with NCCL_DEBUG=INFO "
                           "for details), NCCL version 2.21.5\nncclUnhandledCudaError: Call to CUDA function failed.\n"
                           "Last error:\nCuda failure 'invalid device ordinal'"), ""),   # the run's device
    (dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error (run with NCCL_DEBUG=INFO "
                           "for details), NCCL version 2.21.5\nncclUnhandledCudaError: Call to CUDA function failed."),
     ""),                                                                           # (it says not which)
    (dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there was a network "
                           "error, NCCL version 2.21.5\nncclRemoteError: A call failed possibly due to a network error "
                           "or a remote process exiting prematurely."), ""),     # a lost peer (4)
    (dist.DistBackendError("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE)"), ""),
    (ValueError("CUDA error: uncorrectable ECC error encountered"), ""),          # (not torch's)
])
def test_which_errors_tell_of_a_fault_of_the_ranks_node(error, fault):
    """A fault of the node's GPU (ECC, NVLink, a busy device), from CUDA or wrapped by NCCL's
    failed CUDA call, is the node's (exit 5: a restart fixes it, on other nodes once the job
    leaves the node out); any other CUDA error (an illegal memory access, an initialization
    error, out of memory...) and a lost peer are not (they stay 1 and 4)."""
    assert recovery.node_fault(error) == fault
    assert not fault or not recovery.is_lost_peer(error)


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
