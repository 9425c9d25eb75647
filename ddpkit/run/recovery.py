"""Agreement and recovery: what the ranks agree on after each step (a stop signal, a loss
that is not finite, a checkpoint due by the clock), and how a failure is told apart and
named: a lost peer (exit 4, which a restart fixes), a fault of this rank's node's GPU (ECC,
NVLink, a busy device: exit 5, which a restart fixes, elsewhere if need be), a storage
problem the user fixes (exit 2)."""

import errno
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ddpkit.distributed import Runtime, collective, collective_of
from ddpkit.launch import StopSignals
from ddpkit.options import RunOptions
from ddpkit.run.checkpoints import Progress


class CheckpointClock:
    """Says when --ckpt-minutes have passed since the last checkpoint (the clock is a
    parameter so that tests can move time)."""

    def __init__(self, minutes: float, clock=time.monotonic):
        self.seconds, self.clock = minutes * 60, clock
        self.last = clock()

    def due(self) -> bool:
        return self.seconds > 0 and self.clock() - self.last >= self.seconds

    def reset(self) -> None:
        self.last = self.clock()


@dataclass(frozen=True)
class Verdict:
    """What the ranks agreed on about one step: some rank got a stop signal, some rank's
    loss is not finite, some rank's clock says a checkpoint is due, rank 0 found a request
    for a profile (RUN_DIR/profile-now); at the end of a --log-every window, each rank's
    time per step in it (ms, rank order; else empty)."""
    stopping: bool = False
    diverged: bool = False
    ckpt_due: bool = False
    profile: bool = False
    step_ms: tuple = ()


class AgreementBuffers:
    """The per-step agreement's tensors, made once per run, so that a step adds one copy and
    one all-reduce: [stop, checkpoint due, profile, loss, each rank's ms per step] on the
    device, summed over the ranks (a non-finite sum means some rank's loss is not finite;
    each rank writes its own time slot, at a window's end only), and on a GPU a pinned host
    copy of the result and the event after which it holds it."""

    def __init__(self, device: torch.device, world_size: int = 1, rank: int = 0):
        """world_size: the time slots, one per rank (0: the times are not agreed on)."""
        self.flags = torch.zeros(4 + world_size, device=device)
        self.host_flags, self.loss, self.step_ms = self.flags[:3], self.flags[3], self.flags[4:]  # views
        self.mine = self.step_ms[rank] if world_size else None
        on_gpu = device.type == "cuda"
        self.result = torch.zeros(4 + world_size, pin_memory=True) if on_gpu else self.flags
        self.result_flags = self.result[:4]  # (a view made once: a step makes no slice of its own)
        self.copied = torch.cuda.Event() if on_gpu else None
        self.host_flags_set = False  # whether host_flags may hold more than zeros (written here, or summed)
        self.step_ms_set = False     # likewise the time slots


@dataclass(frozen=True)
class PendingAgreement:
    """An agreement under way: the all-reduce of the flags (None when it is already waited
    for, or there is one process) and the buffers it reduces."""
    work: object | None
    buffers: AgreementBuffers


AGREEMENT = "the per-step agreement (stop, divergence, checkpoint time)"


def start_agreement(stop: StopSignals, loss: torch.Tensor, clock: CheckpointClock, rt: Runtime,
                    buffers: AgreementBuffers | None = None, *, profile: bool = False,
                    step_ms: float | None = None) -> PendingAgreement:
    """Start this step's agreement: one small all-reduce of every rank's flags and loss (and,
    at a log window's end, its `step_ms`), which runs while the next step computes;
    read_agreement reads it one step later. Reading it at once would make the host wait for
    the step to finish on a GPU (twice: the loss check and the result), so the next step's
    kernels could not be queued behind it."""
    buffers = buffers or AgreementBuffers(rt.device, rt.world_size, rt.rank)
    host = (float(stop.asked()), float(clock.due()), float(profile))
    if any(host):  # rare: a new tensor then is no cost
        buffers.host_flags.copy_(torch.tensor(host))
        buffers.host_flags_set = True
    elif buffers.host_flags_set:
        buffers.host_flags.zero_()
        buffers.host_flags_set = False
    if step_ms is not None or buffers.step_ms_set:  # (every --log-every steps, and the step after)
        buffers.step_ms.zero_()
        if step_ms is not None:
            buffers.mine.fill_(step_ms)
        buffers.step_ms_set = step_ms is not None
    with torch.no_grad():
        buffers.loss.copy_(loss)
    with collective(AGREEMENT):
        work = dist.all_reduce(buffers.flags, async_op=True) if dist.is_initialized() else None
        if buffers.copied is None:
            return PendingAgreement(work, buffers)
        if work is not None:
            work.wait()  # on a GPU: the stream waits for the reduction, the host does not
    buffers.result.copy_(buffers.flags, non_blocking=True)
    buffers.copied.record()
    return PendingAgreement(None, buffers)


def read_agreement(pending: PendingAgreement) -> Verdict:
    """The verdict of a started agreement, waiting for it if need be (by the next step's end
    it has long arrived)."""
    buffers = pending.buffers
    with collective(AGREEMENT):
        if pending.work is not None:
            pending.work.wait()
        if buffers.copied is not None:
            buffers.copied.synchronize()
    if buffers.step_ms_set:
        stopping, ckpt_due, profile, loss, *step_ms = buffers.result.tolist()
    else:
        stopping, ckpt_due, profile, loss = buffers.result_flags.tolist()
        step_ms = ()
    buffers.host_flags_set = buffers.host_flags_set or stopping > 0 or ckpt_due > 0 or profile > 0
    return Verdict(stopping > 0, not math.isfinite(loss), ckpt_due > 0, profile > 0, tuple(step_ms))


def is_lost_peer(err: BaseException) -> bool:
    """A collective failed because another rank is gone or hung: c10d's own errors (NCCL,
    the store), or Gloo's, which arrive as a RuntimeError that says what the socket saw;
    never a CUDA error, torch's or one NCCL's CUDA call met (node_fault, or a bug)."""
    # A CUDA error is this rank's GPU or the run's kernel, never a peer, whatever its words:
    # "the launch timed out and was terminated" is a kernel past the display's watchdog.
    if "CUDA error: " in str(err) or NODE_NCCL_ERROR.search(str(err)):
        return False
    if isinstance(err, dist.DistError):
        return True
    # Gloo's words for it vary with where the wait was: "Timed out waiting 20000ms for recv",
    # "Application timeout caused pair closure", "Connection closed by peer", ...
    return isinstance(err, RuntimeError) and re.search(
        r"connection (closed|reset) by peer|timed out|timeout caused|broken pipe|connection refused|gloo/transport",
        str(err), re.IGNORECASE) is not None


# CUDA's errors that tell of the node's GPU itself (cudaError_t's texts, as torch raises them,
# "CUDA error: <text>", and as NCCL's failed CUDA call names its last error): its memory
# (uncorrectable ECC), its links (NVLink), a device busy or unavailable (another process holds
# it, or it fell off the bus). Others, however much they look like the GPU's, are the run's own
# more often than not, and a restart elsewhere would hide a bug: an illegal memory access, an
# unspecified launch failure or a launch timeout (a kernel's bug), an initialization error or
# an unknown error (the environment: drivers, CUDA_VISIBLE_DEVICES), out of memory or an
# invalid device ordinal (the run's size, its device): exit 1, as before.
NODE_GPU_FAULTS = re.compile(r"uncorrectable ECC error encountered|uncorrectable NVLink error|"
                             r"CUDA-capable device\(s\) is/are busy or unavailable")
# NCCL's failed CUDA call on this rank's GPU (ncclUnhandledCudaError), a node's fault only when
# the CUDA error it wraps is one of those. NCCL's others are a lost peer (ncclRemoteError, a
# timeout: exit 4) or a bug (an invalid argument or usage).
NODE_NCCL_ERROR = re.compile(r"unhandled cuda error|ncclUnhandledCudaError")


def node_fault(err: BaseException) -> str:
    """The class of a CUDA or NCCL error that tells of a fault of this rank's node's GPU (ECC,
    NVLink, a busy device), e.g. "CUDA error: uncorrectable ECC error encountered"; "" for
    any other error."""
    if not isinstance(err, RuntimeError):  # (torch's AcceleratorError and c10d's DistBackendError are ones)
        return ""
    text = str(err)
    gpu = NODE_GPU_FAULTS.search(text)
    if not gpu:
        return ""
    if "CUDA error: " + gpu.group() in text:
        return "CUDA error: " + gpu.group()
    return f"NCCL error: unhandled cuda error ({gpu.group()})" if NODE_NCCL_ERROR.search(text) else ""


def lost_peer_message(err: BaseException, progress: Progress) -> str:
    where = collective_of(err)
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    detail = re.sub(r"^\[[^\]]*\]\s*", "", first).split(". This is typically")[0]  # drop Gloo's source path
    return (f"lost contact with another rank during {where} at step {progress.step} (epoch {progress.epoch}): a peer "
            f"probably died or hung ({detail[:200]}). Nothing saved is lost: run_training.sbatch restarts from the newest "
            "checkpoint by itself; elsewhere run the same command again")


# Errors of the run's own files that the user fixes, not the code, and what to do about each.
STORAGE_FIXES = {
    errno.ENOSPC: "free space there or pass another --log-dir/--run-dir",
    errno.EDQUOT: "free space there (the quota is full) or pass another --log-dir/--run-dir",
    errno.EROFS: "pass a --log-dir/--run-dir on a writable file system",
    errno.EACCES: "fix its permissions or pass another --log-dir/--run-dir",
    errno.EPERM: "fix its permissions or pass another --log-dir/--run-dir",
    errno.ENAMETOOLONG: "pass a shorter --log-dir/--run-dir/--run-name",
    errno.ENOTDIR: "pass another --log-dir/--run-dir",  # a file where a directory goes
    errno.EEXIST: "pass another --log-dir/--run-dir",   # (mkdir's word for the same)
}


def storage_problem(err: BaseException, options: RunOptions | None) -> str:
    """The one line for an error in the log directory, the run directory or its checkpoints
    that the user fixes (a full disk or quota, no permission, a read-only file system, a
    file where a directory goes); "" for anything else, which stays a bug with a traceback."""
    if not isinstance(err, OSError) or err.errno not in STORAGE_FIXES or options is None:
        return ""
    fix = STORAGE_FIXES[err.errno]
    if not err.filename:
        # A buffered write's error (a log line; TensorBoard's are runlog.EventFile's) names no file;
        # a full disk is the user's to fix all the same.
        if err.errno not in (errno.ENOSPC, errno.EDQUOT):
            return ""
        return f"cannot write the run's files under {options.run_dir or options.log_dir} ({err.strerror}); {fix}"
    path = Path(os.fsdecode(err.filename))
    roots = [options.log_dir] + ([options.run_dir] if options.run_dir else [])
    if not any(Path(os.path.abspath(path)).is_relative_to(os.path.abspath(root)) for root in roots):
        return ""
    if err.errno in (errno.ENOTDIR, errno.EEXIST):
        blocker = next((p for p in (path, *path.parents) if os.path.lexists(p)), path)
        return "" if blocker.is_dir() else f"{blocker} is not a directory; {fix}"
    return f"cannot write {path} ({err.strerror}); {fix}"
