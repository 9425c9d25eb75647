"""The process group and the device: which device and backend each rank uses (and why a
GPU that Slurm gave cannot be used), the process group's setup and teardown, and the few
collectives the rest uses, each labelled with what it is for, so that a lost peer is named
by the operation that lost it."""

import contextlib
import os
import re
import subprocess
import sys
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from ddpkit import hangs
from ddpkit.launch import Launch, UsageError
from ddpkit.options import RunOptions


@dataclass(frozen=True)
class Runtime:
    """This process once the process group is up."""
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str            # "gloo", "nccl", or "none" for a single process
    is_main: bool
    timeout: float = RunOptions.dist_timeout  # --dist-timeout: the longest wait on another rank or process


# CUDA builds on PyTorch's own index, oldest first; a driver runs builds up to its CUDA version.
CUDA_WHEELS = ((11, 8), (12, 1), (12, 4), (12, 6), (12, 8), (12, 9), (13, 0))


def driver_cuda() -> tuple[str, str]:
    """(driver version, highest CUDA version it runs) from nvidia-smi's header, or ("", "")."""
    try:
        header = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "", ""
    driver = re.search(r"Driver Version:\s*([\d.]+)", header)
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", header)
    return (driver.group(1) if driver else ""), (cuda.group(1) if cuda else "")


def cuda_version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:2])


def node_gpus() -> list[tuple[str, str, str]]:
    """(index, UUID, compute mode) of every GPU on this node, whatever CUDA_VISIBLE_DEVICES
    says (nvidia-smi sees them all), or [] without nvidia-smi."""
    try:
        listed = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,compute_mode", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [tuple(field.strip() for field in line.split(",")) for line in listed.splitlines() if line.count(",") == 2]


def invisible_gpu_cause(visible: str | None, gpus: list[tuple[str, str, str]]) -> str:
    """Why torch sees no GPU although its build suits the driver: CUDA_VISIBLE_DEVICES names
    none, or names GPUs this node does not have (CUDA stops at the first such entry), or the
    GPUs are there but cannot be opened (busy in exclusive mode, or not in this container)."""
    if not gpus:
        return "nvidia-smi lists no GPU on this node"
    indices = ", ".join(index for index, _, _ in gpus)
    if visible is not None and not visible.strip():
        return "CUDA_VISIBLE_DEVICES is set but empty, so CUDA shows no GPU"
    if visible is not None:
        entries = [entry.strip() for entry in visible.split(",")]
        # (MIG instances, MIG-<uuid>, are not in nvidia-smi's list of GPUs: taken as valid)
        valid = [entry.startswith("MIG-") or any(entry and (entry == index or uuid.startswith(entry))
                                                 for index, uuid, _ in gpus) for entry in entries]
        if not all(valid):
            wrong = entries[valid.index(False)]
            return (f"CUDA_VISIBLE_DEVICES={visible} names {f'GPU {wrong}' if wrong else 'an empty entry'}, which this "
                    f"node does not have (nvidia-smi lists {indices}), so CUDA shows "
                    f"{'no GPU' if not valid[0] else 'only the GPUs before it'}")
    return busy_gpu_cause(gpus) or (f"nvidia-smi lists GPUs {indices} but CUDA cannot open them: in a container, pass "
                                    "them in (--nv for Apptainer, --gpus for Docker)")


def busy_gpu_cause(gpus: list[tuple[str, str, str]]) -> str:
    """The GPUs whose compute mode keeps this process out, as words, or ""."""
    for word, why in (("exclusive", "is in exclusive-process mode: another process probably holds it (nvidia-smi shows "
                                    "which)"), ("prohibited", "is in prohibited mode: no process may use it")):
        held = [index for index, _, mode in gpus if word in mode.lower()]
        if held:
            return f"GPU {', '.join(held)} of this node {why}"
    return ""


def unusable_gpu_message(granted: str, torch_cuda: str | None, driver: str, driver_max_cuda: str, cause: str = "") -> str:
    """Slurm gave GPUs that this torch cannot use: say why, and what to do. A build that the
    driver runs is not the problem: then `cause` (invisible_gpu_cause) is."""
    if torch_cuda and driver_max_cuda and cuda_version(torch_cuda) <= cuda_version(driver_max_cuda):
        return (f"this job was given GPUs ({granted}) but torch sees none: {cause or 'no GPU is visible'}. torch "
                f"{torch.__version__} (CUDA {torch_cuda}) suits the driver {driver} (CUDA up to {driver_max_cuda}); let "
                "Slurm set CUDA_VISIBLE_DEVICES (do not set it yourself), ask for a GPU of your own, or pass --device cpu "
                "to train on the CPU on purpose")
    build = f"torch {torch.__version__} is a CPU-only build" if not torch_cuda else f"torch {torch.__version__} is built for CUDA {torch_cuda}"
    fits = [w for w in CUDA_WHEELS if driver_max_cuda and w <= cuda_version(driver_max_cuda)]
    index = "cu{}{}".format(*fits[-1]) if fits else "cuXYZ (a CUDA version your driver supports)"
    node = (f"the node's driver {driver} runs CUDA up to {driver_max_cuda}" if driver
            else "the driver's version is unknown (no nvidia-smi on this node)")
    return (f"this job was given GPUs ({granted}) but torch cannot use them: {build}, {node}. Install a matching build: "
            f"pip install torch torchvision --index-url https://download.pytorch.org/whl/{index} ; or pass --device cpu "
            "to train on the CPU on purpose")


def pick_device(config: RunOptions, launch: Launch, cuda_available: bool, device_count: int) -> tuple[torch.device, str]:
    """The device and backend of this rank, from the launcher's facts and what torch sees.

    A GPU that Slurm gave but torch cannot use (a CUDA build newer than the driver, a
    CPU-only wheel) must not quietly become a CPU run; nor may ranks pile onto fewer GPUs."""
    wants_cuda = config.device == "cuda" or config.backend == "nccl"
    if not cuda_available and (wants_cuda or (config.device == "auto" and launch.gpus_granted)):
        if launch.gpus_granted:
            cause = invisible_gpu_cause(os.environ.get("CUDA_VISIBLE_DEVICES"), node_gpus())
            raise UsageError(unusable_gpu_message(launch.gpus_granted, torch.version.cuda, *driver_cuda(), cause))
        flag = "--device cuda" if config.device == "cuda" else "--backend nccl"
        raise UsageError(f"{flag} needs a CUDA GPU but torch sees none (CUDA_VISIBLE_DEVICES unset); "
                         "use --device cpu --backend gloo, or ask Slurm for a GPU")
    use_cuda = config.device == "cuda" or (config.device == "auto" and cuda_available)
    backend = config.backend if config.backend != "auto" else ("nccl" if use_cuda else "gloo")
    if not use_cuda:
        return torch.device("cpu"), backend
    if launch.local_world_size <= device_count:
        index = launch.local_rank                       # each rank of the node sees every GPU: take its own
    elif device_count == 1 and launch.gpu_per_task and launch.source == "slurm":
        index = 0                                       # srun --gpus-per-task: the one GPU shown is this task's
    else:
        raise UsageError(
            f"{launch.local_world_size} ranks on this node but {device_count} GPU(s) visible to rank {launch.rank} "
            f"({launch.gpus_granted or 'CUDA_VISIBLE_DEVICES unset'}): ranks would share GPUs. Ask for one GPU per rank: "
            "--gpus-per-node=N with --ntasks-per-node=N, or --gpus-per-task=1 (srun mode only: with LAUNCHER=torchrun, "
            "one task per node must see all its GPUs, so use --gpus-per-node)")
    return torch.device("cuda", index), backend


def amp_warning(amp: bool, gpu_name: str, capability: tuple[int, int]) -> str:
    """bfloat16 runs in emulation on GPUs before Ampere (compute capability 8.0): slower than fp32."""
    if not amp or capability >= (8, 0):
        return ""
    return (f"warning: --amp uses bfloat16, which {gpu_name} (compute capability {capability[0]}.{capability[1]}) "
            "only emulates: slower than without --amp. Leave --amp off on GPUs older than Ampere (A100, RTX 30xx)")


def init_distributed(config: RunOptions, launch: Launch) -> Runtime:
    cuda = torch.cuda.is_available()
    device, backend = pick_device(config, launch, cuda, torch.cuda.device_count() if cuda else 0)
    if config.deterministic:
        set_deterministic()
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before the process group, so NCCL binds the right GPU
        try:
            torch.zeros(1, device=device)  # opens the device: a busy one fails here, in one line
        except RuntimeError as err:
            if "busy or unavailable" not in str(err):
                raise
            cause = busy_gpu_cause(node_gpus()) or "another process may hold it"
            raise UsageError(f"{device} on {os.uname().nodename} is busy or unavailable ({cause}); ask Slurm for a GPU of "
                             "your own (--gpus-per-task=1 or --exclusive), or pass --device cpu") from None
        warning = amp_warning(config.amp, torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device))
        if warning and launch.rank == 0:
            print(warning, file=sys.stderr, flush=True)
    if launch.num_threads:
        torch.set_num_threads(launch.num_threads)
    if launch.world_size == 1:
        return Runtime(rank=0, local_rank=0, world_size=1, device=device, backend="none", is_main=True,
                       timeout=config.dist_timeout)
    load_what_optimizers_load()
    with collective("joining the process group"):
        dist.init_process_group(backend, init_method=f"tcp://{launch.master_addr}:{launch.master_port}",
                                rank=launch.rank, world_size=launch.world_size,
                                timeout=timedelta(seconds=config.dist_timeout),
                                device_id=device if device.type == "cuda" else None)
    return Runtime(rank=launch.rank, local_rank=launch.local_rank, world_size=launch.world_size, device=device,
                   backend=backend, is_main=launch.rank == 0, timeout=config.dist_timeout)


def load_what_optimizers_load() -> None:
    """Imports torch's compiler, which the first torch.optim optimizer imports, before a process
    group exists: a group that exists at that import outlives destroy_process_group with its
    Gloo threads (torch 2.14), into the interpreter's exit, where one of them may abort a run
    that has ended well (SIGABRT, "terminate called without an active exception": exit 1)."""
    import torch._dynamo  # noqa: F401


# cuBLAS's workspace setting for reproducible results (CUDA's documentation, "Results
# reproducibility"); it must be in the environment before cuBLAS first runs.
CUBLAS_WORKSPACE = ":4096:8"


def set_deterministic() -> None:
    """--deterministic: bit-identical GPU runs and resumes. cuDNN picks deterministic
    kernels and no benchmarking, cuBLAS a fixed workspace, and every operation without a
    deterministic implementation stops the run (nondeterministic_operation names it).
    CPU runs at the same thread count are bit-identical without it."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True)


def nondeterministic_operation(err: BaseException) -> str:
    """The operation that --deterministic refused, from torch's error, or ""."""
    found = re.match(r"(\S+) does not have a deterministic implementation", str(err)) if isinstance(err, RuntimeError) else None
    return found.group(1) if found else ""


TEARDOWN_WAIT = 30  # seconds the ranks wait for each other at the end


def teardown_distributed(together: bool = False) -> None:
    """Destroy the process group. `together`: every rank ended the same way (done, or stopped
    at the step they agreed on), so they first wait for each other: a rank that destroyed
    its group while a peer still used it was seen to abort at exit (Gloo, torch 2.15)."""
    if not dist.is_initialized():
        return
    if together:
        with contextlib.suppress(Exception):  # a peer gone, or ended otherwise: nothing to wait for
            dist.barrier(async_op=True).wait(timeout=timedelta(seconds=TEARDOWN_WAIT))
    dist.destroy_process_group()


def leave_after_lost_peer(code: int) -> None:
    """End this process now, without Python's finalization: after a lost peer that still
    hangs, a Gloo thread tied to it was seen to abort the process as the interpreter
    finalized (SIGABRT, exit 134 instead of 4, in 2 runs of 6, torch 2.14.1), after the exit
    code had been recorded and the logs closed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ----------------------------------------------------------------------------- collectives, labelled

# What the ranks are doing together when no labelled collective runs: set by the training
# loop's owner to the gradient all-reduce that DDP runs inside backward().
_background = ["a collective"]


def set_background(what: str) -> None:
    _background[0] = what


@contextlib.contextmanager
def collective(what: str):
    """Label the collectives inside: an error raised there carries `what` as its
    `collective` attribute (the innermost label wins), which recovery.lost_peer_message names;
    a wait there longer than --hang-after is reported by `what` (hangs.py)."""
    before = hangs.doing(what)
    try:
        yield
    except Exception as err:
        if getattr(err, "collective", None) is None:
            with contextlib.suppress(AttributeError, TypeError):
                err.collective = what
        raise
    finally:
        hangs.restore(before)


def collective_of(err: BaseException) -> str:
    """What the ranks were doing together when `err` was raised."""
    return getattr(err, "collective", None) or _background[0]


def all_reduce(tensor: torch.Tensor, what: str, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    """In place across ranks; a single process has nothing to reduce."""
    if dist.is_initialized():
        with collective(what):
            dist.all_reduce(tensor, op=op)
    return tensor


def all_ranks_agree(ok: bool, rt: Runtime, what: str) -> bool:
    """True when `ok` holds on every rank; doubles as a barrier."""
    flag = torch.tensor([0 if ok else 1], device=rt.device)
    return all_reduce(flag, what).item() == 0


def broadcast_from_main(value, what: str):
    if not dist.is_initialized():
        return value
    box = [value]
    with collective(what):
        dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_to_all(obj, what: str) -> list:
    if not dist.is_initialized():
        return [obj]
    objs = [None] * dist.get_world_size()
    with collective(what):
        dist.all_gather_object(objs, obj)
    return objs


def barrier(what: str) -> None:
    if dist.is_initialized():
        with collective(what):
            dist.barrier()


def sync_buffers(model: nn.Module) -> None:
    """Give every rank rank 0's buffers (BatchNorm running statistics).

    Each rank updates them from its own batches, so without this every shard of the test
    set would be scored by a different model, and none of them the one rank 0 saves."""
    if dist.is_initialized():
        with collective("the broadcast of the model's buffers"):
            for buffer in model.buffers():
                dist.broadcast(buffer, src=0)


# The DDP wrapper of each model that wrap_ddp wrapped, by the model: a run holds the model it
# trains and saves, not its wrapper, and asks the wrapper for DDP's own timing of the steps.
_wrappers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def wrap_ddp(model: nn.Module, rt: Runtime) -> nn.Module:
    """The model in DistributedDataParallel, which averages the gradients in backward() (a
    single process trains the model itself). Its constructor broadcasts rank 0's weights."""
    if rt.world_size == 1:
        return model
    with collective("wrapping the model in DDP (the broadcast of rank 0's weights)"):
        wrapped = DistributedDataParallel(model, device_ids=[rt.device.index] if rt.device.type == "cuda" else None)
    _wrappers[model] = weakref.ref(wrapped)
    return wrapped


def ddp_statistics(model: nn.Module | None) -> dict:
    """DDP's own runtime statistics of the wrapper wrap_ddp made for `model` ({} for a model it
    did not wrap): among them the average times, in ns, of the steps it sampled (the first
    10 of the process, then every 100th), which it measures on CPUs and GPUs alike. (A
    prototype interface of torch's: a torch without it gives {}.)"""
    wrapped = _wrappers.get(model)() if model in _wrappers else None
    return getattr(wrapped, "_get_ddp_logging_data", dict)() if wrapped is not None else {}


DDP_TIMES = ("avg_forward_compute_time", "avg_backward_compute_time", "avg_backward_comm_time",
             "avg_backward_compute_comm_overlap_time")


def gradient_wait(stats: Mapping) -> tuple[float, float, float] | None:
    """From DDP's runtime statistics: (the share of a step's forward and backward passes spent
    waiting for the gradient all-reduce, ms a step computing, ms a step waiting), or None
    before DDP timed a step. The wait is the all-reduce's time after the backward pass had
    computed every gradient (its overlap with that computation is free); it ends when the
    slowest rank's gradients have arrived, so it holds the wait for the other ranks too."""
    if not all(stats.get(key, 0) > 0 for key in DDP_TIMES[:3]):
        return None
    forward, backward, comm = (stats[key] / 1e6 for key in DDP_TIMES[:3])
    wait_ms = max(0.0, comm - stats.get(DDP_TIMES[3], 0) / 1e6)
    compute_ms = forward + backward
    return wait_ms / (wait_ms + compute_ms), compute_ms, wait_ms
