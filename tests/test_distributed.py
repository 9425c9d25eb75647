"""ddpkit/distributed.py's labelled collectives: an error raised inside collective() carries
its label (the innermost one when nested), collective_of falls back to the background label,
and, with two real Gloo ranks, a rank that has exited makes rank 0's broadcast_from_main,
gather_to_all and wrap_ddp fail with an error that names that operation, which is what the
lost-peer line (exit 4) says. (The device and launch checks are in test_launch.py.)

    python -m pytest tests/test_distributed.py
"""

import json
import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from ddpkit import recovery
from ddpkit.checkpoints import Progress
from ddpkit.distributed import (
    Runtime,
    broadcast_from_main,
    collective,
    collective_of,
    gather_to_all,
    set_background,
    wrap_ddp,
)


@pytest.fixture
def background():
    """Put the background label back as it was (TrainingRun sets it too)."""
    before = collective_of(Exception())
    yield
    set_background(before)


def test_an_error_inside_carries_the_label():
    with pytest.raises(ValueError, match="boom") as raised:
        with collective("the gather of each rank's state"):
            raise ValueError("boom")
    assert raised.value.collective == "the gather of each rank's state"
    assert collective_of(raised.value) == "the gather of each rank's state"


def test_the_innermost_label_wins():
    with pytest.raises(RuntimeError) as raised:
        with collective("the whole start-up"):
            with collective("sharing the host names"):
                raise RuntimeError("Connection closed by peer")
    assert collective_of(raised.value) == "sharing the host names"


def test_nothing_raised_nothing_changed():
    with collective("a barrier"):
        value = 1 + 1
    assert value == 2


def test_a_keyboard_interrupt_is_not_labelled():
    with pytest.raises(KeyboardInterrupt) as raised:
        with collective("a barrier"):
            raise KeyboardInterrupt
    assert not hasattr(raised.value, "collective")


def test_an_unlabelled_error_falls_back_to_the_background(background):
    set_background("the gradient all-reduce of a training step")
    assert collective_of(RuntimeError("Connection reset by peer")) == "the gradient all-reduce of a training step"
    with pytest.raises(RuntimeError) as raised:
        with collective("the barrier before stopping"):
            raise RuntimeError("x")
    assert collective_of(raised.value) == "the barrier before stopping"  # a label beats the background


def test_one_process_needs_no_process_group():
    assert not dist.is_initialized()
    assert broadcast_from_main({"a": 1}, "choosing the checkpoint to resume from") == {"a": 1}
    assert gather_to_all(5, "sharing the host names") == [5]
    model = nn.Linear(2, 2)
    assert wrap_ddp(model, Runtime(0, 0, 1, torch.device("cpu"), "none", True)) is model


# ----------------------------------------------------------------------------- two real Gloo ranks, one lost

# What rank 0 does after rank 1 has exited, and the label its error must carry.
OPERATIONS = {
    "broadcast_from_main": "choosing the checkpoint to resume from",
    "gather_to_all": "sharing the host names",
    "wrap_ddp": "wrapping the model in DDP (the broadcast of rank 0's weights)",
}


def _run_operation(name: str, rt: Runtime) -> None:
    if name == "broadcast_from_main":
        broadcast_from_main(["ckpt-00000004.pt", "", ""], OPERATIONS[name])
    elif name == "gather_to_all":
        gather_to_all(("host", "1/1"), OPERATIONS[name])
    else:
        wrap_ddp(nn.Linear(4, 2), rt)


def _rank(rank: int, init: str, name: str, peer_gone, out: str) -> None:
    torch.set_num_threads(1)  # as DataLoader's forked workers do: no thread pool inherited half-made
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=10))
    rt = Runtime(rank, rank, 2, torch.device("cpu"), "gloo", rank == 0)
    dist.barrier()  # both connected
    if rank == 1:
        os._exit(0)  # gone, as a killed rank is: no goodbye
    peer_gone.wait(30)
    time.sleep(0.5)  # Gloo's own thread sees the closed connection (a send alone would not notice it)
    try:
        _run_operation(name, rt)
        result = {"error": None}
    except Exception as err:
        result = {"error": type(err).__name__, "collective": collective_of(err), "lost_peer": recovery.is_lost_peer(err),
                  "line": recovery.lost_peer_message(err, Progress(epoch=2, step=40))}
    Path(out).write_text(json.dumps(result))
    os._exit(0)  # no teardown: the group has lost a member


@pytest.fixture(scope="module")
def lost_peer_errors(tmp_path_factory) -> dict[str, dict]:
    """A pair of ranks per operation, all three pairs at once; rank 0 of each records its error.

    The ranks are forked, not spawned: a spawned interpreter imports torch, and DDP's
    constructor then torch._dynamo, 5-7 s on 2 busy cores against under 1 s here. A fork is
    safe for this: this process has no process group, and the ranks run only Gloo
    collectives on tiny CPU tensors, on one thread."""
    assert not dist.is_initialized()
    import torch._dynamo  # noqa: F401  (DDP's constructor imports it: once here, not in a rank)
    folder = tmp_path_factory.mktemp("lost-peer")
    fork = mp.get_context("fork")
    pairs = []
    for name in OPERATIONS:
        gone = fork.Event()
        args = (f"file://{folder}/rendezvous-{name}", name, gone, f"{folder}/{name}.json")
        pair = [fork.Process(target=_rank, args=(rank, *args)) for rank in range(2)]
        for process in pair:
            process.start()
        pairs.append((pair, gone))
    for (_, rank1), gone in pairs:
        rank1.join(60)
        gone.set()
    for (rank0, _), _ in pairs:
        rank0.join(60)
    return {name: json.loads((folder / f"{name}.json").read_text()) for name in OPERATIONS
            if (folder / f"{name}.json").exists()}


@pytest.mark.parametrize("name", OPERATIONS)
def test_a_lost_peer_is_named_by_the_operation(lost_peer_errors, name):
    assert name in lost_peer_errors, f"rank 0 of the {name} pair recorded nothing"
    result = lost_peer_errors[name]
    assert result["error"] is not None, f"{name} succeeded without its peer"
    assert result["collective"] == OPERATIONS[name]
    assert result["lost_peer"], result
    assert result["line"].startswith(f"lost contact with another rank during {OPERATIONS[name]} at step 40 (epoch 2): "
                                     "a peer probably died or hung ("), result["line"]
