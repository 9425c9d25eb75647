"""ddpkit/distributed.py's labelled collectives: an error raised inside collective() carries
its label (the innermost one when nested), collective_of falls back to the background label,
and, with two real Gloo ranks, a rank that has exited makes rank 0's broadcast_from_main,
gather_to_all and wrap_ddp fail with an error that names that operation, which is what the
lost-peer line (exit 4) says; and the device each rank takes (GPU requests, the local
rank's GPU on a second node, too few GPUs, GPUs torch cannot use, --amp before Ampere),
from the launcher's facts and torch's count.

    python -m pytest tests/unit/test_distributed.py
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

from ddpkit.distributed import (
    Runtime,
    amp_warning,
    broadcast_from_main,
    collective,
    collective_of,
    gather_to_all,
    invisible_gpu_cause,
    nondeterministic_operation,
    pick_device,
    set_background,
    unusable_gpu_message,
    wrap_ddp,
)
from ddpkit.launch import UsageError, read_launch_env
from ddpkit.options import RunOptions
from ddpkit.run import recovery
from ddpkit.run.checkpoints import Progress


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


# --- GPUs: which device each rank takes, decided from the launcher's facts and torch's count.

def device_for(env: dict, cuda_available: bool, device_count: int, device: str = "auto"):
    config = RunOptions(device=device)
    return pick_device(config, read_launch_env(env), cuda_available, device_count)


def srun_env(local_rank: int, tasks_per_node: str, **extra: str) -> dict:
    return {"SLURM_JOB_ID": "7", "SLURM_PROCID": str(local_rank), "SLURM_LOCALID": str(local_rank), "SLURM_NTASKS": "4",
            "SLURM_STEP_ID": "0", "SLURM_JOB_NODELIST": "gpu[1-2]", "SLURM_NODEID": "0",
            "SLURM_STEP_TASKS_PER_NODE": tasks_per_node, **extra}


def test_gpus_per_node_each_rank_takes_its_own():
    env = srun_env(3, "4(x1)", SLURM_GPUS_ON_NODE="4", CUDA_VISIBLE_DEVICES="0,1,2,3")
    assert device_for(env, True, 4) == (torch.device("cuda", 3), "nccl")


def test_a_rank_of_the_second_node_takes_the_gpu_of_its_local_rank():
    """Global rank 3 is local rank 1 of the second node: it takes that node's GPU 1, not GPU 3
    (which the node does not have), under srun and under torchrun alike."""
    env = {**srun_env(1, "2(x2)", SLURM_GPUS_ON_NODE="2", CUDA_VISIBLE_DEVICES="0,1"), "SLURM_PROCID": "3",
           "SLURM_NODEID": "1"}
    assert device_for(env, True, 2) == (torch.device("cuda", 1), "nccl")
    torchrun = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "gpu1",
                "MASTER_PORT": "20000", "CUDA_VISIBLE_DEVICES": "0,1"}
    assert device_for(torchrun, True, 2) == (torch.device("cuda", 1), "nccl")


def test_gpus_per_task_each_task_sees_one():
    env = srun_env(3, "4", SLURM_GPUS_PER_TASK="1", SLURM_JOB_GPUS="0,1,2,3", CUDA_VISIBLE_DEVICES="3")
    assert device_for(env, True, 1) == (torch.device("cuda", 0), "nccl")


def test_more_ranks_than_gpus_is_refused():
    env = srun_env(2, "4", SLURM_GPUS_ON_NODE="2", CUDA_VISIBLE_DEVICES="0,1")
    with pytest.raises(UsageError, match=r"4 ranks on this node but 2 GPU\(s\) visible to rank 2 .*ranks would share GPUs"):
        device_for(env, True, 2)


def test_torchrun_under_gpus_per_task_is_refused():
    """One torchrun task per node with --gpus-per-task=1 shows a single GPU to all its workers."""
    env = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "gpu1",
           "MASTER_PORT": "20000", "SLURM_GPUS_PER_TASK": "1", "CUDA_VISIBLE_DEVICES": "0"}
    with pytest.raises(UsageError, match="with LAUNCHER=torchrun, one task per node must see all its GPUs"):
        device_for(env, True, 1)


@pytest.mark.parametrize("variable", ["SLURM_GPUS_ON_NODE=2", "SLURM_JOB_GPUS=0,1", "CUDA_VISIBLE_DEVICES=0"])
def test_gpus_given_but_unusable_is_refused(variable):
    name, value = variable.split("=")
    with pytest.raises(UsageError, match=rf"this job was given GPUs \({name}={value}\) but torch cannot use them"):
        device_for({name: value}, False, 0)


@pytest.mark.parametrize("env", [{}, {"CUDA_VISIBLE_DEVICES": ""}, {"SLURM_GPUS_ON_NODE": "0"}, {"CUDA_VISIBLE_DEVICES": "-1"}])
def test_no_gpus_given_means_cpu(env):
    assert device_for(env, False, 0) == (torch.device("cpu"), "gloo")


def test_device_cpu_overrides_given_gpus():
    assert device_for({"SLURM_JOB_GPUS": "0"}, False, 0, device="cpu") == (torch.device("cpu"), "gloo")


@pytest.mark.parametrize("driver_cuda, index", [("12.2", "cu121"), ("12.8", "cu128"), ("11.4", None)])
def test_unusable_gpu_message_names_a_matching_build(driver_cuda, index):
    message = unusable_gpu_message("SLURM_JOB_GPUS=0", "13.0", "535.104.05", driver_cuda)
    assert f"is built for CUDA 13.0, the node's driver 535.104.05 runs CUDA up to {driver_cuda}" in message
    assert f"--index-url https://download.pytorch.org/whl/{index or 'cuXYZ'}" in message
    assert "or pass --device cpu" in message


def test_unusable_gpu_message_for_a_cpu_wheel_without_nvidia_smi():
    message = unusable_gpu_message("CUDA_VISIBLE_DEVICES=0", None, "", "")
    assert "is a CPU-only build, the driver's version is unknown (no nvidia-smi on this node)" in message


@pytest.mark.parametrize("capability, warns", [((7, 0), True), ((7, 5), True), ((8, 0), False), ((9, 0), False)])
def test_amp_warns_before_ampere(capability, warns):
    assert bool(amp_warning(True, "Tesla V100", capability)) == warns
    assert amp_warning(False, "Tesla V100", capability) == ""


# ----------------------------------------------------------------------------- a GPU that torch does not see

NODE = [("0", "GPU-5d1c7e0a-aaaa", "Default"), ("1", "GPU-77b2c4f9-bbbb", "Default")]


@pytest.mark.parametrize("visible, words", [
    ("7", "CUDA_VISIBLE_DEVICES=7 names GPU 7, which this node does not have (nvidia-smi lists 0, 1), so CUDA shows no GPU"),
    ("GPU-0000", "CUDA_VISIBLE_DEVICES=GPU-0000 names GPU GPU-0000, which this node does not have"),
    ("", "CUDA_VISIBLE_DEVICES is set but empty, so CUDA shows no GPU"),
    ("GPU-77b2", "nvidia-smi lists GPUs 0, 1 but CUDA cannot open them: in a container, pass them in"),
])
def test_when_the_build_suits_the_driver_the_gpu_error_names_the_real_cause(visible, words):
    message = unusable_gpu_message("SLURM_GPUS_ON_NODE=1", "13.0", "580.159.04", "13.0", invisible_gpu_cause(visible, NODE))
    assert message.startswith(f"this job was given GPUs (SLURM_GPUS_ON_NODE=1) but torch sees none: {words}")
    assert "torch " in message and "suits the driver 580.159.04 (CUDA up to 13.0)" in message
    assert "Install a matching build" not in message and "or pass --device cpu" in message


def test_a_gpu_busy_in_exclusive_mode_and_a_node_without_gpus_are_named():
    assert invisible_gpu_cause(None, [("0", "GPU-a", "Exclusive_Process")]).startswith(
        "GPU 0 of this node is in exclusive-process mode: another process probably holds it")
    assert invisible_gpu_cause("0", []) == "nvidia-smi lists no GPU on this node"


# ----------------------------------------------------------------------------- the whole lines a user reads

ASK_CPU = "or pass --device cpu to train on the CPU on purpose"


@pytest.mark.parametrize("device, backend, flag", [("cuda", "auto", "--device cuda"), ("auto", "nccl", "--backend nccl")])
def test_a_gpu_option_without_a_gpu_is_refused_naming_that_option(device, backend, flag):
    with pytest.raises(UsageError) as refused:
        pick_device(RunOptions(device=device, backend=backend), read_launch_env({}), False, 0)
    assert str(refused.value) == (f"{flag} needs a CUDA GPU but torch sees none (CUDA_VISIBLE_DEVICES unset); use "
                                  "--device cpu --backend gloo, or ask Slurm for a GPU")


def test_device_cuda_takes_the_gpu_and_a_backend_given_is_kept():
    assert pick_device(RunOptions(device="cuda"), read_launch_env({}), True, 1) == (torch.device("cuda", 0), "nccl")
    assert pick_device(RunOptions(device="cuda", backend="gloo"), read_launch_env({}), True, 1) == (
        torch.device("cuda", 0), "gloo")


@pytest.mark.parametrize("granted", ["SLURM_GPUS_ON_NODE=2", ""])
def test_more_ranks_than_gpus_is_refused_in_one_line_that_names_the_gpus_granted(granted):
    env = srun_env(2, "4", SLURM_GPUS_ON_NODE="2") if granted else {
        "RANK": "2", "LOCAL_RANK": "2", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "gpu1",
        "MASTER_PORT": "20000"}
    with pytest.raises(UsageError) as refused:
        device_for(env, True, 2)
    assert str(refused.value) == (
        f"4 ranks on this node but 2 GPU(s) visible to rank 2 ({granted or 'CUDA_VISIBLE_DEVICES unset'}): ranks would "
        "share GPUs. Ask for one GPU per rank: --gpus-per-node=N with --ntasks-per-node=N, or --gpus-per-task=1 (srun "
        "mode only: with LAUNCHER=torchrun, one task per node must see all its GPUs, so use --gpus-per-node)")


def fake_nvidia_smi(directory: Path, cuda: str) -> str:
    """An nvidia-smi of a node with GPUs 0 and 1 and a driver that runs CUDA up to `cuda`:
    what pick_device reads of the node when torch sees none of them."""
    directory.mkdir()
    script = directory / "nvidia-smi"
    script.write_text(f"""#!/bin/sh
case "$1" in
--query-gpu=*) echo "0, {NODE[0][1]}, Default"; echo "1, {NODE[1][1]}, Default" ;;
*) echo "| NVIDIA-SMI 580.65.06    Driver Version: 580.65.06    CUDA Version: {cuda}     |" ;;
esac
""")
    script.chmod(0o755)
    return str(directory)


def test_gpus_granted_that_torch_does_not_see_are_refused_with_the_nodes_driver_and_the_real_cause(tmp_path,
                                                                                                  monkeypatch):
    """The build suits the node's driver (as nvidia-smi says): the cause is CUDA_VISIBLE_DEVICES."""
    if torch.version.cuda is None:
        pytest.skip("a CPU-only build of torch is refused for being one")
    monkeypatch.setenv("PATH", fake_nvidia_smi(tmp_path / "bin", torch.version.cuda))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    with pytest.raises(UsageError) as refused:
        device_for({"SLURM_GPUS_ON_NODE": "1"}, False, 0)
    assert str(refused.value) == (
        "this job was given GPUs (SLURM_GPUS_ON_NODE=1) but torch sees none: CUDA_VISIBLE_DEVICES=7 names GPU 7, which "
        "this node does not have (nvidia-smi lists 0, 1), so CUDA shows no GPU. "
        f"torch {torch.__version__} (CUDA {torch.version.cuda}) suits the driver 580.65.06 (CUDA up to "
        f"{torch.version.cuda}); let Slurm set CUDA_VISIBLE_DEVICES (do not set it yourself), ask for a GPU of your "
        f"own, {ASK_CPU}")


def test_unusable_gpu_messages_whole():
    assert unusable_gpu_message("SLURM_GPUS_ON_NODE=1", "13.0", "580.65.06", "13.0") == (
        "this job was given GPUs (SLURM_GPUS_ON_NODE=1) but torch sees none: no GPU is visible. "
        f"torch {torch.__version__} (CUDA 13.0) suits the driver 580.65.06 (CUDA up to 13.0); let Slurm set "
        f"CUDA_VISIBLE_DEVICES (do not set it yourself), ask for a GPU of your own, {ASK_CPU}")
    assert unusable_gpu_message("CUDA_VISIBLE_DEVICES=0", None, "", "") == (
        f"this job was given GPUs (CUDA_VISIBLE_DEVICES=0) but torch cannot use them: torch {torch.__version__} is a "
        "CPU-only build, the driver's version is unknown (no nvidia-smi on this node). Install a matching build: pip "
        "install torch torchvision --index-url https://download.pytorch.org/whl/cuXYZ (a CUDA version your driver "
        f"supports) ; {ASK_CPU}")
    # A version's third number (a patch) does not make a build newer than the driver.
    assert "suits the driver 580.65.06 (CUDA up to 12.8)" in unusable_gpu_message("X=0", "12.8.1", "580.65.06", "12.8")


@pytest.mark.parametrize("visible, cause", [
    ("0,7", "CUDA_VISIBLE_DEVICES=0,7 names GPU 7, which this node does not have (nvidia-smi lists 0, 1), so CUDA "
            "shows only the GPUs before it"),
    ("0,,1", "CUDA_VISIBLE_DEVICES=0,,1 names an empty entry, which this node does not have (nvidia-smi lists 0, 1), "
             "so CUDA shows only the GPUs before it"),
    ("MIG-4f2a,7", "CUDA_VISIBLE_DEVICES=MIG-4f2a,7 names GPU 7, which this node does not have (nvidia-smi lists 0, "
                   "1), so CUDA shows only the GPUs before it"),
    ("GPU-77b2", "nvidia-smi lists GPUs 0, 1 but CUDA cannot open them: in a container, pass them in (--nv for "
                 "Apptainer, --gpus for Docker)"),
], ids=["second-entry", "empty-entry", "mig-instance", "container"])
def test_why_torch_sees_no_gpu_whole(visible, cause):
    assert invisible_gpu_cause(visible, NODE) == cause


def test_gpus_busy_or_prohibited_are_named_whole():
    held = [("0", "GPU-a", "Exclusive_Process"), ("1", "GPU-b", "Exclusive_Process")]
    assert invisible_gpu_cause(None, held) == ("GPU 0, 1 of this node is in exclusive-process mode: another process "
                                               "probably holds it (nvidia-smi shows which)")
    assert invisible_gpu_cause(None, [("0", "GPU-a", "Prohibited")]) == ("GPU 0 of this node is in prohibited mode: no "
                                                                         "process may use it")


def test_the_amp_warning_whole():
    assert amp_warning(True, "Tesla T4", (7, 5)) == (
        "warning: --amp uses bfloat16, which Tesla T4 (compute capability 7.5) only emulates: slower than without "
        "--amp. Leave --amp off on GPUs older than Ampere (A100, RTX 30xx)")


def test_an_operation_without_a_deterministic_implementation_is_named():
    torch.use_deterministic_algorithms(True)
    try:
        torch.zeros(3).put_(torch.tensor([0, 1]), torch.ones(2))
    except RuntimeError as err:
        refused = err
    finally:
        torch.use_deterministic_algorithms(False)
    assert nondeterministic_operation(refused) == "put_"
    assert nondeterministic_operation(RuntimeError("CUDA error")) == ""
    assert nondeterministic_operation(ValueError("put_ does not have a deterministic implementation")) == ""
