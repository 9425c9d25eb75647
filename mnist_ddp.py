#!/usr/bin/env python3
"""mnist-ddp: data-parallel training of a small CNN on MNIST with PyTorch DDP, launched
by hand, by torchrun or by Slurm's srun.

What it does
  * works out rank, local rank and world size from torchrun's variables, else from
    Slurm's (SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS, the node list), else runs as
    one process; NCCL on GPUs, Gloo on CPUs;
  * lets the first rank of each node stage the data set behind a barrier and a file
    lock (shared NFS data directories are safe), then trains from the whole split held
    in memory as one uint8 tensor;
  * evaluates exactly (every test image counted once, for any world size) and logs to
    stdout, metrics.jsonl and TensorBoard in one run directory per job.

What it reaches (measured on 2 CPU cores; README.md "Benchmark" has the table and machine)
  * bundled 4,000-image MNIST sample, defaults (8 epochs, 1 process): 96.9-97.0 % test
    accuracy (seeds 0-2) in ~11 s on 2 CPU cores;
  * full Fashion-MNIST, defaults: 90.2 % after 2 epochs, 92.2 % after 8 (evaluated with
    the --ema average of the weights); 14.5x sooner to 90 % than the usual DataLoader +
    ToTensor example loop, from process start (11.0 s against 158.7 s).

How to launch
  python mnist_ddp.py                                    # one process, bundled sample
  python mnist_ddp.py --dataset mnist --download-only    # stage MNIST (login node)
  torchrun --standalone --nproc-per-node 2 mnist_ddp.py --dataset fashion-mnist
  srun --ntasks 2 python mnist_ddp.py                    # inside an allocation
  sbatch run_training.sbatch --epochs 3                  # Slurm batch job
  RUN_NAME=lr3e-3 sbatch run_training.sbatch             # a named run: resubmitting continues it

A run lives in LOG_DIR/RUN_NAME (--run-name; default job-<SLURM_JOB_ID>, else a timestamp).
Checkpoints go to its checkpoints/ (atomic, last --keep-ckpts kept); --resume auto (the
default) continues from the newest valid one, so the same command with the same run name,
or a requeued Slurm job, carries on where it stopped. --allow-changes lets it carry on with
more --epochs or another --lr. SIGUSR1 or SIGTERM: save at the next step, requeue the
Slurm job, exit; Ctrl-C: save at the next step and exit. One run of a name runs at a
time (a second one exits 2). A rank that dies or hangs makes the others exit with code 4
within --dist-timeout; run_training.sbatch then restarts the job from the newest
checkpoint.

Exit codes
   0  done
   1  unexpected error (a traceback above it): a bug, which a restart would repeat
   2  a problem you can fix: one line on stderr says what to do
   3  the loss or the weights stopped being finite; nothing bad was saved (the line says
      how to resume with a lower --lr)
   4  lost contact with another rank (it died, or hung past --dist-timeout); the line
      names the operation and the step. Nothing saved is lost: run it again, as
      run_training.sbatch does by itself (MAX_RESTARTS)
  75  stopped by SIGUSR1/SIGTERM/Ctrl-C after saving a checkpoint; the line says how to continue
      (under Slurm with --requeue the job has requeued itself)
 130  Ctrl-C before training started: nothing to save
"""

import signal


class StopSignals:
    """SIGUSR1 (Slurm's --signal), SIGTERM (preemption, time limit, torchrun) and, once
    training runs, SIGINT (Ctrl-C, which torchrun passes on to its workers) only set a flag
    here; the training loop acts on it at the next step boundary, where every rank agrees,
    rank 0 saves and (on USR1 or TERM) the job requeues itself. Saving inside a handler
    could interrupt a half-written file or a collective. A Ctrl-C pressed again while that
    save is a step away changes nothing (torchrun passes a second one on as SIGTERM, and
    kills workers still saving after 30 s). Before training starts there is nothing to
    save: Ctrl-C then stops at once (KeyboardInterrupt), e.g. during a rendezvous or a
    download. A SIGINT that the parent set to be ignored stays ignored."""

    def __init__(self):
        self.received, self.training = 0, False
        signals = [signal.SIGUSR1, signal.SIGTERM]
        if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            signals.append(signal.SIGINT)
        self.previous = {sig: signal.signal(sig, self.handle) for sig in signals}

    def handle(self, signum, frame) -> None:
        if signum == signal.SIGINT and not self.training:
            raise KeyboardInterrupt
        # The first one says why: a Ctrl-C stays a Ctrl-C, which asks for no requeue.
        self.received = self.received or signum

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


# A stop signal may come while torch is still being imported or while ranks wait for each
# other (a requeued job gets its time-limit signal again): catch it from the first moment,
# or it kills the process before anything can be saved. main() takes this over.
EARLY_STOP = StopSignals() if __name__ == "__main__" else None

import argparse  # (after the stop signals, on purpose: see above)
import contextlib
import copy
import dataclasses
import errno
import fcntl
import io
import itertools
import json
import math
import os
import platform
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image, ImageDraw
from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2
from torch.nn.parallel import DistributedDataParallel
from torch.utils.tensorboard import SummaryWriter
from torchvision.datasets import MNIST, FashionMNIST
from torchvision.datasets.utils import check_integrity

PROG = "mnist_ddp.py"
HERE = Path(__file__).resolve().parent
EXIT_BUG = 1
EXIT_USAGE = 2
EXIT_DIVERGED = 3
EXIT_LOST_PEER = 4  # another rank died or hung: the one failure that running again fixes
EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped on request, try again to continue
NOT_RETRIED = (EXIT_BUG, EXIT_USAGE, EXIT_DIVERGED, EXIT_STOPPED)  # a restart repeats them, or they asked to stop


class UsageError(Exception):
    """A problem the user can fix: printed as one line on stderr, exit code 2."""


class Diverged(Exception):
    """The loss stopped being finite: printed as one line, exit code 3, nothing saved."""


# ----------------------------------------------------------------------------- config

DATASETS = ("mnist-sample", "mnist", "fashion-mnist")
# Options that set the course of training: a checkpoint resumes only a run with the same,
# except that --allow-changes lets the CHANGEABLE ones differ.
TRAJECTORY = ("dataset", "model", "epochs", "batch_size", "lr", "weight_decay", "dropout", "label_smoothing", "shift",
              "seed", "max_steps", "ema")
CHANGEABLE = ("epochs", "max_steps", "lr", "weight_decay")
MODELS = ("cnn", "mlp", "resnet18")


@dataclass(frozen=True)
class Config:
    # data
    dataset: str = field(default="mnist-sample", metadata={
        "choices": DATASETS, "help": "mnist-sample is the bundled 4,000/1,000-image MNIST sample (offline)"})
    data_dir: str = field(default="data", metadata={
        "help": "data directory, on shared storage for multi-node jobs; files go to DATA_DIR/<Name>/raw"})
    node_data_dir: str = field(default="", metadata={
        "help": "node-local directory ($TMPDIR, /scratch/$USER, ...; $VARS expand on each node): the first rank of "
                "each node copies the data there from --data-dir, and every rank reads it from there"})
    data_mirror: str = field(default="", metadata={
        "help": "base URL (http://, https:// or file://) that replaces torchvision's download mirrors"})
    download_only: bool = field(default=False, metadata={
        "help": "stage the data set into --data-dir and exit (run it once on a login node)"})
    # model and optimisation
    model: str = field(default="cnn", metadata={"choices": MODELS, "help": "network to train"})
    epochs: int = field(default=8, metadata={"help": "passes over the training set"})
    batch_size: int = field(default=128, metadata={"help": "images per step per rank; the global batch is this times the world size"})
    lr: float = field(default=3e-3, metadata={"help": "peak learning rate of the one-cycle schedule (AdamW)"})
    weight_decay: float = field(default=5e-4, metadata={"help": "AdamW weight decay"})
    dropout: float = field(default=0.0, metadata={"help": "dropout before the classifier (cnn, mlp)"})
    label_smoothing: float = field(default=0.1, metadata={
        "help": "label smoothing of the training loss (the test loss stays plain cross-entropy)"})
    shift: float = field(default=0.25, metadata={
        "help": "fraction of the training images moved by one pixel in a random direction, drawn afresh each epoch "
                "(0: no augmentation)"})
    ema: float = field(default=0.99, metadata={
        "help": "decay of an exponential moving average of the weights, which evaluation and model.pt use (0: off)"})
    seed: int = field(default=0, metadata={"help": "seed of weights and data order, the same on every rank"})
    max_steps: int = field(default=0, metadata={"help": "stop after this many optimiser steps in all (0: no limit); for smoke runs"})
    # distributed
    backend: str = field(default="auto", metadata={"choices": ("auto", "gloo", "nccl"), "help": "auto: nccl on CUDA, else gloo"})
    device: str = field(default="auto", metadata={"choices": ("auto", "cpu", "cuda"), "help": "auto: cuda when available"})
    dist_timeout: float = field(default=300.0, metadata={"help": "seconds a collective may wait for a missing rank before the job fails"})
    # speed (for GPUs; they run on CPUs too, where they rarely help)
    amp: bool = field(default=False, metadata={"help": "bfloat16 autocast for forward passes"})
    channels_last: bool = field(default=False, metadata={"help": "channels-last memory layout for convolutions"})
    compile: bool = field(default=False, metadata={"help": "torch.compile the model (slow first steps; needs a C++ compiler on CPUs)"})
    # output
    log_dir: str = field(default="runs", metadata={"help": "directory that holds one directory per run (shared storage)"})
    run_name: str = field(default="", metadata={
        "help": "the run's name; its directory is LOG_DIR/NAME, and the same name continues that run from its newest "
                "checkpoint (default: job-<SLURM_JOB_ID>, else a timestamp)"})
    run_dir: str = field(default="", metadata={"help": "the run's directory as a path, instead of LOG_DIR/RUN_NAME"})
    log_every: int = field(default=50, metadata={"help": "log the training loss to TensorBoard every N steps"})
    progress_every: float = field(default=60.0, metadata={
        "help": "when the output is not a terminal (batch jobs), print a progress line every N seconds (0: never)"})
    image_every: int = field(default=1, metadata={
        "help": "log test images with their predictions and a confusion matrix every N epochs (0: never)"})
    # checkpoints and preemption
    resume: str = field(default="auto", metadata={
        "help": "auto: continue from the newest valid checkpoint in RUN_DIR/checkpoints; never: start afresh; or a checkpoint file"})
    ckpt_every: int = field(default=500, metadata={"help": "checkpoint every N steps as well as at each epoch end (0: epoch ends only)"})
    ckpt_minutes: float = field(default=10.0, metadata={
        "help": "checkpoint as well when M minutes have passed since the last one, so a slow step cannot lose hours "
                "(0: never)"})
    keep_ckpts: int = field(default=3, metadata={"help": "how many of the newest checkpoints to keep"})
    allow_changes: bool = field(default=False, metadata={
        "help": f"resume even though {', '.join('--' + k.replace('_', '-') for k in CHANGEABLE)} differ from the "
                "checkpoint's (to train longer, or on with a lower --lr); the change is logged"})
    interrupt_at: str = field(default="", metadata={
        "help": "testing aid: rank 0 sends itself a signal after step N, as N:USR1 or N:TERM (the run stops after step "
                "N+1, or at N on a checkpoint step)"})


class OneLineErrorParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UsageError(f"{message} (see --help)")


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The whole docstring as written (launch commands, exit codes), and defaults unless empty."""

    def _get_help_string(self, action):
        return action.help if action.default in ("", None) else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """Derive the CLI from Config: one kebab-case flag per field, default shown in --help."""
    parser = OneLineErrorParser(prog=PROG, description=__doc__, formatter_class=HelpFormatter)
    for f in dataclasses.fields(Config):
        flag = "--" + f.name.replace("_", "-")
        if f.type is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=f.metadata["help"])
        else:
            parser.add_argument(flag, type=f.type, default=f.default, choices=f.metadata.get("choices"),
                                help=f.metadata["help"], metavar=f.name.upper() if "choices" not in f.metadata else None)
    return parser


# The data order's generators are seeded with seed * 100_003 + epoch (epoch_shard,
# epoch_shifts), which torch takes as a 64-bit integer; 10**13 leaves room to spare.
SEED_LIMIT = 10**13
# Every collective waits this long for the other ranks. Below 10 s, ranks that start a few
# seconds apart (srun across nodes, torch imported from shared storage) or wait for rank 0
# to stage the data or write a checkpoint count as dead (exit 4), and run_training.sbatch
# restarts them again and again. Above a week a hang is not worth waiting for (time limits
# end jobs sooner), and far larger values overflow timedelta and Gloo's clock.
DIST_TIMEOUT_RANGE = (10.0, 7 * 24 * 3600.0)


def check_config(c: Config) -> None:
    def need(ok: bool, message: str) -> None:
        if not ok:
            raise UsageError(message)

    need(c.epochs >= 1, f"--epochs must be at least 1, got {c.epochs}")
    need(c.batch_size >= 1, f"--batch-size must be at least 1, got {c.batch_size}")
    need(math.isfinite(c.lr) and c.lr > 0, f"--lr must be a positive number, got {c.lr}")
    need(math.isfinite(c.weight_decay) and c.weight_decay >= 0, f"--weight-decay must be 0 or more, got {c.weight_decay}")
    need(0 <= c.dropout < 1, f"--dropout must be in [0, 1), got {c.dropout}")
    need(0 <= c.label_smoothing < 1, f"--label-smoothing must be in [0, 1), got {c.label_smoothing}")
    need(0 <= c.shift <= 1, f"--shift must be in [0, 1], got {c.shift}")
    need(0 <= c.ema < 1, f"--ema must be in [0, 1) (0: off), got {c.ema}")
    need(-SEED_LIMIT <= c.seed <= SEED_LIMIT, f"--seed must be from -{SEED_LIMIT} to {SEED_LIMIT}, got {c.seed}")
    need(c.max_steps >= 0, f"--max-steps must be 0 (no limit) or more, got {c.max_steps}")
    need(math.isfinite(c.dist_timeout) and c.dist_timeout > 0, f"--dist-timeout must be a positive number of seconds, got {c.dist_timeout}")
    low, high = DIST_TIMEOUT_RANGE
    need(low <= c.dist_timeout <= high,
         f"--dist-timeout must be from {low:g} to {high:g} seconds (a week), got {c.dist_timeout:g}")
    need(c.log_every >= 1, f"--log-every must be at least 1, got {c.log_every}")
    need(math.isfinite(c.progress_every) and c.progress_every >= 0,
         f"--progress-every must be 0 (never) or a number of seconds, got {c.progress_every}")
    need(not c.run_name or (re.fullmatch(r"[\w.+=,@-]+", c.run_name) is not None and c.run_name not in (".", "..")),
         f"--run-name must be one directory name of letters, digits and ._-+=,@ (no / or spaces), got {c.run_name!r}")
    need(not (c.run_name and c.run_dir), "pass --run-name or --run-dir, not both")
    need(c.image_every >= 0, f"--image-every must be 0 (never) or more, got {c.image_every}")
    need(c.ckpt_every >= 0, f"--ckpt-every must be 0 (epoch ends only) or more, got {c.ckpt_every}")
    need(math.isfinite(c.ckpt_minutes) and c.ckpt_minutes >= 0,
         f"--ckpt-minutes must be 0 (never) or a number of minutes, got {c.ckpt_minutes}")
    need(c.keep_ckpts >= 1, f"--keep-ckpts must be at least 1, got {c.keep_ckpts}")
    need(c.resume in ("auto", "never") or os.path.isfile(c.resume),  # (False, not an error, for a name too long)
         f"--resume {c.resume}: no such checkpoint file; pass auto, never or an existing file")
    need(not c.interrupt_at or re.fullmatch(r"[1-9]\d*:(USR1|TERM)", c.interrupt_at) is not None,
         f"--interrupt-at must look like 120:USR1 or 120:TERM, got {c.interrupt_at!r}")
    need(not c.data_mirror or re.match(r"^(https?|file)://", c.data_mirror) is not None,
         f"--data-mirror must be an http://, https:// or file:// URL, got {c.data_mirror!r}")
    need(c.backend != "nccl" or c.device != "cpu", "--backend nccl needs --device cuda (or auto); use --backend gloo for CPUs")
    data_dir = Path(c.data_dir)
    need(not data_dir.exists() or data_dir.is_dir(), f"--data-dir {data_dir} is not a directory")
    need(not data_dir.exists() or os.access(data_dir, os.R_OK | os.X_OK),
         f"--data-dir {data_dir} is not readable; fix its permissions or pass another --data-dir")


def parse_config(argv: list[str] | None) -> Config:
    config = Config(**vars(build_parser().parse_args(argv)))
    check_config(config)
    return config


# ----------------------------------------------------------------------------- launch environment

@dataclass(frozen=True)
class Launch:
    """Who this process is in the job, as the launcher said (nothing initialised yet)."""
    source: str             # "torchrun", "slurm" or "single"
    rank: int
    local_rank: int
    world_size: int
    master_addr: str
    master_port: int
    job_id: str             # Slurm job id ("123" or "123_4" for an array task), "" outside Slurm
    num_threads: int        # CPU threads for this rank; 0 = leave torch's default
    local_world_size: int = 1   # ranks on this node
    gpus_granted: str = ""      # the variable that says this job was given GPUs, e.g. "SLURM_JOB_GPUS=0,1"
    gpu_per_task: bool = False  # srun --gpus-per-task: Slurm shows each task only its own GPU(s)
    attempt: str = "1/1"        # "k/N": the k-th start of this job step out of at most N (restarts after failures)
    restarts_left: int = 0      # how often torchrun's agent would still restart this worker if it failed
    exit_dir: str = ""          # where each rank records its exit code as rank-<r> (run_training.sbatch reads them)
    requeues: int = 0           # how often Slurm has requeued this job (SLURM_RESTART_COUNT)
    nodes: int = 1              # machines the ranks run on


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand Slurm's compressed host list: 'node[01-03,07],gpu3' -> node01 node02 node03 node07 gpu3."""
    hosts: list[str] = []
    for item in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", hostlist):
        expanded = [""]
        for text, ranges in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", item):
            choices = [text]
            if ranges:
                choices = []
                for part in ranges.split(","):
                    low, dash, high = part.partition("-")
                    if not low.isdigit() or (dash and not high.isdigit()):
                        raise UsageError(f"cannot parse Slurm host list {hostlist!r}")
                    for n in range(int(low), int(high or low) + 1):
                        choices.append(text + str(n).zfill(len(low)))
            expanded = [prefix + choice for prefix in expanded for choice in choices]
        hosts.extend(expanded)
    if not hosts:
        raise UsageError(f"cannot parse Slurm host list {hostlist!r}")
    return hosts


def port_from_job_id(job_id: str) -> int:
    """A port every task of a job derives alike, different for jobs sharing a node.

    10000-29999 stays below Linux's ephemeral range (32768-60999), so an outgoing
    connection cannot already hold it. run_training.sbatch applies the same rule."""
    return 10000 + int(job_id or 0) % 20000


def tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """This node's entry of Slurm's compressed task counts: '2(x3),1' is 2, 2, 2, 1."""
    counts: list[int] = []
    for count, repeat in re.findall(r"(\d+)(?:\(x(\d+)\))?", tasks_per_node):
        counts += [int(count)] * int(repeat or 1)
    return counts[node_id] if node_id < len(counts) else 0


def gpus_granted(env: Mapping[str, str]) -> str:
    """Which variable says that GPUs were given to this job ("" if none does)."""
    for name in ("SLURM_GPUS_ON_NODE", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS", "CUDA_VISIBLE_DEVICES"):
        value = env.get(name, "").strip()
        if name == "SLURM_GPUS_ON_NODE":  # a count; the others list devices, where 0 is the first GPU
            given = value.isdigit() and int(value) > 0
        else:
            given = value not in ("", "-1", "NoDevFiles")
        if given:
            return f"{name}={value}"
    return ""


def _int_var(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise UsageError(f"{name}={env[name]!r} is not an integer; unset it or fix the launcher") from None


def read_launch_env(env: Mapping[str, str]) -> Launch:
    """The one place that reads the launcher's variables: torchrun, then Slurm, then one process."""
    job_id = env.get("SLURM_JOB_ID", "")
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        job_id = f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    # torchrun and srun set OMP_NUM_THREADS as they see fit; torch honours it. Otherwise use
    # the CPUs Slurm gave this task, so that tasks sharing a node do not fight over cores.
    num_threads = 0 if "OMP_NUM_THREADS" in env else int(env.get("SLURM_CPUS_PER_TASK", "0") or 0)

    if "RANK" in env and "WORLD_SIZE" in env:
        missing = [v for v in ("LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if v not in env]
        if missing:
            raise UsageError(f"RANK and WORLD_SIZE are set but {', '.join(missing)} not; launch with torchrun, or unset RANK/WORLD_SIZE")
        local_world = _int_var(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else _int_var(env, "LOCAL_RANK") + 1
        launch = Launch("torchrun", _int_var(env, "RANK"), _int_var(env, "LOCAL_RANK"), _int_var(env, "WORLD_SIZE"),
                        env["MASTER_ADDR"], _int_var(env, "MASTER_PORT"), job_id, num_threads, local_world)
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        ntasks = _int_var(env, "SLURM_NTASKS")
        if not env.get("SLURM_JOB_ID", "0").isdigit():
            raise UsageError(f"SLURM_JOB_ID={env['SLURM_JOB_ID']!r} is not a job id; unset it or set MASTER_PORT")
        if ntasks > 1 and "SLURM_STEP_ID" not in env:
            raise UsageError(f"SLURM_NTASKS={ntasks} but this process was not started by srun, so it would train alone. "
                             "HINT: run it as `srun python mnist_ddp.py ...` (run_training.sbatch does), or ask for --ntasks=1")
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
        if not nodelist and ntasks > 1:
            raise UsageError("SLURM_JOB_NODELIST is not set, so the first host is unknown; set MASTER_ADDR")
        master_addr = env.get("MASTER_ADDR") or (expand_hostlist(nodelist)[0] if nodelist else "127.0.0.1")
        master_port = _int_var(env, "MASTER_PORT") if "MASTER_PORT" in env else port_from_job_id(env.get("SLURM_JOB_ID", ""))
        local_rank = _int_var(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
        per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "")
        local_world = tasks_on_node(per_node, int(env.get("SLURM_NODEID", "0") or 0)) if per_node else ntasks
        launch = Launch("slurm", _int_var(env, "SLURM_PROCID"), local_rank, ntasks, master_addr, master_port, job_id,
                        num_threads, max(local_world, local_rank + 1), gpu_per_task=bool(env.get("SLURM_GPUS_PER_TASK")))
    else:
        launch = Launch("single", 0, 0, 1, "127.0.0.1", 0, job_id, num_threads)
    # Restarts: run_training.sbatch numbers its attempts (srun mode); torchrun counts its own.
    attempt = env.get("MNIST_DDP_ATTEMPT", "1/1")
    if launch.source == "torchrun" and "TORCHELASTIC_MAX_RESTARTS" in env:
        done, most = _int_var(env, "TORCHELASTIC_RESTART_COUNT"), _int_var(env, "TORCHELASTIC_MAX_RESTARTS")
        attempt = f"{done + 1}/{most + 1}"
        launch = dataclasses.replace(launch, restarts_left=most - done)
    if not re.fullmatch(r"[1-9]\d*/[1-9]\d*", attempt):
        raise UsageError(f"MNIST_DDP_ATTEMPT={attempt!r} is not k/N; unset it")
    launch = dataclasses.replace(launch, gpus_granted=gpus_granted(env), attempt=attempt,
                                 exit_dir=env.get("MNIST_DDP_EXIT_DIR", ""),
                                 requeues=_int_var(env, "SLURM_RESTART_COUNT") if "SLURM_RESTART_COUNT" in env else 0)
    if launch.source == "torchrun":
        launch = dataclasses.replace(launch, nodes=max(1, launch.world_size // launch.local_world_size))
    elif launch.source == "slurm":
        nodes = next((name for name in ("SLURM_STEP_NUM_NODES", "SLURM_NNODES") if name in env), "")
        launch = dataclasses.replace(launch, nodes=_int_var(env, nodes) if nodes else 1)

    if launch.world_size < 1 or not 0 <= launch.rank < launch.world_size or not 0 <= launch.local_rank <= launch.rank:
        raise UsageError(f"ranks do not add up ({launch.source}: rank {launch.rank}, local rank {launch.local_rank}, "
                         f"world size {launch.world_size}); HINT: start one task per rank, e.g. srun --ntasks-per-node=N")
    if not 0 < launch.master_port < 65536 and launch.world_size > 1:
        raise UsageError(f"master port {launch.master_port} is not a TCP port; set MASTER_PORT to 1024-65535")
    return launch


@dataclass(frozen=True)
class Runtime:
    """This process once the process group is up."""
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str            # "gloo", "nccl", or "none" for a single process
    is_main: bool


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


def unusable_gpu_message(granted: str, torch_cuda: str | None, driver: str, driver_max_cuda: str) -> str:
    """Slurm gave GPUs that this torch cannot use: say why, and which build to install."""
    build = f"torch {torch.__version__} is a CPU-only build" if not torch_cuda else f"torch {torch.__version__} is built for CUDA {torch_cuda}"
    fits = [w for w in CUDA_WHEELS if driver_max_cuda and w <= tuple(int(x) for x in driver_max_cuda.split(".")[:2])]
    index = "cu{}{}".format(*fits[-1]) if fits else "cuXYZ (a CUDA version your driver supports)"
    node = (f"the node's driver {driver} runs CUDA up to {driver_max_cuda}" if driver
            else "the driver's version is unknown (no nvidia-smi on this node)")
    return (f"this job was given GPUs ({granted}) but torch cannot use them: {build}, {node}. Install a matching build: "
            f"pip install torch torchvision --index-url https://download.pytorch.org/whl/{index} ; or pass --device cpu "
            "to train on the CPU on purpose")


def pick_device(config: Config, launch: Launch, cuda_available: bool, device_count: int) -> tuple[torch.device, str]:
    """The device and backend of this rank, from the launcher's facts and what torch sees.

    A GPU that Slurm gave but torch cannot use (a CUDA build newer than the driver, a
    CPU-only wheel) must not quietly become a CPU run; nor may ranks pile onto fewer GPUs."""
    wants_cuda = config.device == "cuda" or config.backend == "nccl"
    if not cuda_available and (wants_cuda or (config.device == "auto" and launch.gpus_granted)):
        if launch.gpus_granted:
            raise UsageError(unusable_gpu_message(launch.gpus_granted, torch.version.cuda, *driver_cuda()))
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


def init_distributed(config: Config, launch: Launch) -> Runtime:
    cuda = torch.cuda.is_available()
    device, backend = pick_device(config, launch, cuda, torch.cuda.device_count() if cuda else 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before the process group, so NCCL binds the right GPU
        warning = amp_warning(config.amp, torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device))
        if warning and launch.rank == 0:
            print(warning, file=sys.stderr, flush=True)
    if launch.num_threads:
        torch.set_num_threads(launch.num_threads)
    if launch.world_size == 1:
        return Runtime(0, 0, 1, device, "none", True)
    dist.init_process_group(backend, init_method=f"tcp://{launch.master_addr}:{launch.master_port}",
                            rank=launch.rank, world_size=launch.world_size,
                            timeout=timedelta(seconds=config.dist_timeout),
                            device_id=device if device.type == "cuda" else None)
    return Runtime(launch.rank, launch.local_rank, launch.world_size, device, backend, launch.rank == 0)


def teardown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce(tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    """In place across ranks; a single process has nothing to reduce."""
    if dist.is_initialized():
        dist.all_reduce(tensor, op=op)
    return tensor


def all_ranks_agree(ok: bool, rt: Runtime) -> bool:
    """True when `ok` holds on every rank; doubles as a barrier."""
    flag = torch.tensor([0 if ok else 1], device=rt.device)
    return all_reduce(flag).item() == 0


def broadcast_from_main(value):
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# ----------------------------------------------------------------------------- data

class MNISTSample(MNIST):
    """The 4,000 + 1,000-image MNIST sample bundled in data/mnist-sample (see its README).

    Its 'mirror' is that directory, so a smoke run stages it through the same download,
    checksum and parsing path as the full data sets."""
    mirrors = [(HERE / "data" / "mnist-sample").as_uri() + "/"]
    resources = [
        ("train-images-idx3-ubyte.gz", "2ed410f5afecb048f3454a25670855ab"),
        ("train-labels-idx1-ubyte.gz", "3c3d8702adc7c424b6625947ddd63d9e"),
        ("t10k-images-idx3-ubyte.gz", "028fa3aaba12cfa6cc55aca87a16885c"),
        ("t10k-labels-idx1-ubyte.gz", "4d079c24de05debc9420a23a8263db82"),
    ]


DATASET_CLASSES = {"mnist-sample": MNISTSample, "mnist": MNIST, "fashion-mnist": FashionMNIST}
# Per-pixel mean and standard deviation of each training set, on the 0-1 scale.
DATASET_STATS = {"mnist-sample": (0.1307, 0.3081), "mnist": (0.1307, 0.3081), "fashion-mnist": (0.2860, 0.3530)}


@dataclass(frozen=True)
class Split:
    images: torch.Tensor    # uint8 [N, 28, 28], on the training device
    labels: torch.Tensor    # int64 [N], on the training device


def dataset_class(config: Config) -> type[MNIST]:
    cls = DATASET_CLASSES[config.dataset]
    if not config.data_mirror:
        return cls
    # Same class name, so the files land in the same DATA_DIR/<Name>/raw folder.
    return type(cls.__name__, (cls,), {"mirrors": [config.data_mirror.rstrip("/") + "/"]})


def raw_files(cls: type[MNIST]) -> list[str]:
    return [name.removesuffix(".gz") for name, _ in cls.resources]


def copy_from_file_mirror(cls: type[MNIST], raw: Path) -> None:
    """torchvision cannot fetch file:// URLs; copy such a mirror's files and let it check them."""
    mirror = cls.mirrors[0]
    if not mirror.startswith("file://"):
        return
    raw.mkdir(parents=True)
    for name, md5 in cls.resources:
        source = Path(urllib.request.url2pathname(urllib.parse.urlparse(mirror + name).path))
        shutil.copyfile(source, raw / name)
        if not check_integrity(str(raw / name), md5):
            raise RuntimeError(f"{source} does not have the expected MD5 {md5}")


def is_staged(cls: type[MNIST], data_dir: Path) -> bool:
    raw = data_dir / cls.__name__ / "raw"
    return all((raw / name).is_file() for name in raw_files(cls))


def stage_dataset(cls: type[MNIST], data_dir: Path, source: Path | None = None, flag: str = "--data-dir") -> bool:
    """Make DATA_DIR/<Name>/raw hold the unpacked files, downloaded or copied from the
    staged data directory `source`; True if it had to fetch them.

    A data directory that already holds the data is only read (it may be read-only). To
    fetch, a file lock in the data directory makes concurrent jobs (and nodes sharing an
    NFS data directory) take turns. Files are fetched and checked in a private staging
    directory and then renamed into place, so a reader never sees half a file and a
    crash mid-download leaves nothing behind that looks complete."""
    if is_staged(cls, data_dir):
        return False
    raw = data_dir / cls.__name__ / "raw"
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        lock_file = open(data_dir / ".mnist_ddp.lock", "a")
    except OSError as err:
        raise UsageError(f"cannot write to {flag} {data_dir} ({err.strerror}) and it does not hold {cls.__name__} yet; "
                         f"pass a writable {flag}, or stage the data into it elsewhere first") from None
    with lock_file:
        fcntl.lockf(lock_file, fcntl.LOCK_EX)  # POSIX locks also work across NFS clients
        if is_staged(cls, data_dir):
            return False
        chatter = io.StringIO()
        try:
            with tempfile.TemporaryDirectory(dir=data_dir, prefix=".staging-") as staging:
                staged_raw = Path(staging, cls.__name__, "raw")
                if source is not None:
                    shutil.copytree(source / cls.__name__ / "raw", staged_raw)
                else:
                    copy_from_file_mirror(cls, staged_raw)
                    with contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
                        cls(staging, train=True, download=True)
                raw.mkdir(parents=True, exist_ok=True)
                for name in raw_files(cls):
                    os.replace(staged_raw / name, raw / name)
        except (RuntimeError, OSError) as err:
            if source is not None:
                raise UsageError(f"cannot copy {cls.__name__} from {source} into the node-local {data_dir} "
                                 f"({getattr(err, 'strerror', None) or err}); free space there or pass another --node-data-dir") from None
            lines = [line.strip() for line in str(err).splitlines() + chatter.getvalue().splitlines() if line.strip()]
            reason = lines[-1] if lines else type(err).__name__
            names = ", ".join(name for name, _ in cls.resources)
            raise UsageError(f"cannot download {cls.__name__} into {raw} ({reason}). Put {names} (or the unpacked files) "
                             f"there, e.g. run `python {PROG} --dataset ... --download-only` on a machine with internet, "
                             "or pass --data-mirror URL or --data-dir DIR") from None
    return True


def node_data_dir(config: Config) -> Path | None:
    """--node-data-dir with $VARS and ~ expanded here, on the node (not at submission)."""
    if not config.node_data_dir:
        return None
    path = os.path.expandvars(os.path.expanduser(config.node_data_dir))
    if "$" in path:
        raise UsageError(f"--node-data-dir {config.node_data_dir}: {path} names a variable that is not set on "
                         f"{socket.gethostname()}; name a directory that exists on every node, e.g. '$TMPDIR/data'")
    return Path(path)


def load_split(cls: type[MNIST], data_dir: Path, train: bool, device: torch.device) -> Split:
    try:
        ds = cls(str(data_dir), train=train, download=False)
    except Exception as err:  # torchvision raises several kinds for damaged files
        raise UsageError(f"cannot read {data_dir / cls.__name__ / 'raw'} ({type(err).__name__}: {err}); "
                         "delete that folder and run again to fetch it anew") from None
    return Split(ds.data.to(device).contiguous(), ds.targets.to(device))


def prepare_data(config: Config, rt: Runtime) -> tuple[Split, Split]:
    """The first rank of each node stages the data while the others wait; then all load it.

    One rank per node (not one per job) also covers node-local data directories; on a
    shared one, the lock lets only the first of them download. With --node-data-dir the
    shared directory is the source, and each node reads its own copy."""
    cls, data_dir = dataset_class(config), Path(config.data_dir)
    error = ""
    if rt.local_rank == 0:
        try:
            if stage_dataset(cls, data_dir):
                print(f"[rank {rt.rank}] staged {cls.__name__} in {data_dir / cls.__name__ / 'raw'}", flush=True)
            local = node_data_dir(config)
            if local is not None and stage_dataset(cls, local, source=data_dir, flag="--node-data-dir"):
                print(f"[rank {rt.rank}] copied {cls.__name__} to {local} on {socket.gethostname()}", flush=True)
        except UsageError as err:
            error = str(err)
    if not all_ranks_agree(not error, rt):
        raise UsageError(error or "another rank could not stage the data set; see its error above")
    data_dir = node_data_dir(config) or data_dir
    return load_split(cls, data_dir, True, rt.device), load_split(cls, data_dir, False, rt.device)


def normalize(images: torch.Tensor, dataset: str, channels_last: bool = False) -> torch.Tensor:
    """uint8 [B, 28, 28] -> float [B, 1, 28, 28], standardised; runs per batch on the device."""
    mean, std = DATASET_STATS[dataset]
    x = images.unsqueeze(1).float().sub_(255 * mean).div_(255 * std)
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


def epoch_shifts(n: int, epoch: int, seed: int, fraction: float) -> torch.Tensor | None:
    """[2, n] int64: each training image's (down, right) move in {-1, 0, 1} this epoch, a
    fraction of them moved one pixel in one of the 8 directions. A function of (seed,
    epoch, image) alone, so any world size and any resume shift an image alike."""
    if not fraction:
        return None
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch + 7_777_777)
    moved = torch.rand(n, generator=generator) < fraction
    direction = torch.randint(0, 8, (n,), generator=generator)
    direction += direction >= 4  # 0..8 without 4, the middle of the 3 x 3 grid of moves
    return torch.stack([direction // 3 - 1, direction % 3 - 1]) * moved


def shift_images(images: torch.Tensor, moves: torch.Tensor | None) -> torch.Tensor:
    """uint8 [B, 28, 28] moved by [2, B] pixels (down, right), the uncovered edge black."""
    if moves is None:
        return images
    b, h, w = images.shape
    windows = F.pad(images, (1, 1, 1, 1)).unfold(1, h, 1).unfold(2, w, 1)  # [B, 3, 3, h, w], views of the padded batch
    return windows[torch.arange(b, device=images.device), 1 - moves[0], 1 - moves[1]]


def epoch_shard(n: int, epoch: int, seed: int, rank: int, world_size: int) -> torch.Tensor:
    """This rank's training indices for one epoch.

    Every rank draws the same seeded permutation and takes every world_size-th index
    from its own offset, as DistributedSampler(drop_last=True) with set_epoch does: the
    shards are disjoint and equally long, so every rank runs the same number of steps.
    Step k of world_size ranks at batch B sees exactly what step k of one process at
    batch world_size * B sees."""
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = torch.randperm(n, generator=generator)
    per_rank = n // world_size
    return order[rank: per_rank * world_size: world_size]


# ----------------------------------------------------------------------------- model

class SmallCNN(nn.Module):
    """A 5x5 and a 3x3 convolution, both of stride 2 (no pooling), a hidden layer of 128
    and a linear classifier: ~13x fewer multiply-adds per image than the 2-conv CNN of the
    PyTorch MNIST example, and more accurate in a few epochs. The first convolution is
    narrow because the second one's cost grows with its input channels (README "Defaults")."""

    def __init__(self, dropout: float):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 5, stride=2, padding=2), nn.ReLU(inplace=True),   # 16 x 14 x 14
            nn.Conv2d(16, 64, 3, stride=2, padding=1), nn.ReLU(inplace=True),  # 64 x 7 x 7
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(inplace=True),
                                        nn.Dropout(dropout), nn.Linear(128, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def build_model(config: Config) -> nn.Module:
    if config.model == "cnn":
        return SmallCNN(config.dropout)
    if config.model == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 512), nn.ReLU(inplace=True), nn.Dropout(config.dropout),
                             nn.Linear(512, 512), nn.ReLU(inplace=True), nn.Dropout(config.dropout), nn.Linear(512, 10))
    # ResNet18 for 1x28x28: a 3x3 stem of stride 1 and no max-pool, so 28x28 is not shrunk to 7x7 at once.
    net = torchvision.models.resnet18(num_classes=10)
    net.conv1 = nn.Conv2d(1, 64, 3, stride=1, padding=1, bias=False)
    net.maxpool = nn.Identity()
    return net


def lr_at(step: int, total_steps: int, peak: float) -> float:
    """One cycle: linear warm-up from peak/10 to peak over the first 10 % of the steps, then
    a cosine decay to peak/1e4 at the last step (README "Defaults" says why). A pure
    function of the step, so a resumed run needs no scheduler state."""
    warmup = max(1, total_steps // 10)
    if step < warmup:
        return peak * (0.1 + 0.9 * step / warmup)
    progress = min(1.0, (step - warmup) / max(1, total_steps - 1 - warmup))
    return peak * (1e-4 + (1 - 1e-4) * 0.5 * (1 + math.cos(math.pi * progress)))


# ----------------------------------------------------------------------------- train and eval steps

def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, lr: float, x: torch.Tensor, y: torch.Tensor,
               amp: bool = False, label_smoothing: float = 0.0) -> torch.Tensor:
    for group in optimizer.param_groups:
        group["lr"] = lr
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=amp):
        loss = F.cross_entropy(model(x), y, label_smoothing=label_smoothing)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()  # DDP averages the gradients across ranks here
    optimizer.step()
    return loss.detach()


class WeightAverage:
    """An exponential moving average of the weights (buffers copied as they are): it
    evaluates well while the learning rate is still high. Its decay ramps up as
    (1 + step) / (10 + step), so that the random initial weights soon fade out of it."""

    def __init__(self, model: nn.Module, decay: float):
        self.model, self.decay = copy.deepcopy(model).requires_grad_(False), decay
        # Loading a checkpoint copies into these tensors, so the lists stay valid.
        self.mine, self.theirs = list(self.model.parameters()), list(model.parameters())

    @torch.no_grad()
    def update(self, step: int) -> None:
        weight = 1 - min(self.decay, (1 + step) / (10 + step))
        torch._foreach_lerp_(self.mine, self.theirs, weight)

    @torch.no_grad()
    def copy_buffers(self, model: nn.Module) -> None:
        for mine, theirs in zip(self.model.buffers(), model.buffers(), strict=True):
            mine.copy_(theirs)


@dataclass(frozen=True)
class Evaluation:
    loss: float
    accuracy: float
    count: int                  # test images counted: the whole test set, for any world size
    confusion: torch.Tensor     # [10, 10] int64, rows true class, columns prediction, all ranks
    shown: torch.Tensor         # rank 0's first test images (global indices) and ...
    shown_pred: torch.Tensor    # ... its predictions for them
    wrong: torch.Tensor         # rank 0's first misclassified test images (global indices) and ...
    wrong_pred: torch.Tensor    # ... its predictions for them


def sync_buffers(model: nn.Module) -> None:
    """Give every rank rank 0's buffers (BatchNorm running statistics).

    Each rank updates them from its own batches, so without this every shard of the test
    set would be scored by a different model, and none of them the one rank 0 saves."""
    if dist.is_initialized():
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)


@torch.no_grad()
def evaluate(model: nn.Module, split: Split, config: Config, rt: Runtime, batch_size: int = 1000, keep: int = 32) -> Evaluation:
    """Loss, accuracy and confusion matrix over the whole test set.

    Each rank takes its own unpadded strided shard and runs the unwrapped model (no
    collectives inside); one all-reduce of the sums and the confusion matrix then gives
    exact global figures for any world size. Rank 0 also keeps a few examples to show."""
    model.eval()
    mine = torch.arange(rt.rank, len(split.labels), rt.world_size, device=rt.device)
    sums = torch.zeros(2, dtype=torch.float64, device=rt.device)  # loss sum, images
    confusion = torch.zeros(100, dtype=torch.int64, device=rt.device)
    shown, shown_pred, wrong, wrong_pred = [], [], [], []
    for start in range(0, len(mine), batch_size):
        idx = mine[start: start + batch_size]
        with torch.autocast(rt.device.type, dtype=torch.bfloat16, enabled=config.amp):
            logits = model(normalize(split.images[idx], config.dataset, config.channels_last))
        y, pred = split.labels[idx], logits.argmax(1)
        sums[0] += F.cross_entropy(logits.float(), y, reduction="sum")
        sums[1] += len(idx)
        confusion += torch.bincount(y * 10 + pred, minlength=100)
        if rt.is_main and start == 0:
            shown, shown_pred = idx[:keep], pred[:keep]
        if rt.is_main and sum(map(len, wrong)) < keep:
            miss = pred != y
            wrong.append(idx[miss])
            wrong_pred.append(pred[miss])
    model.train()
    all_reduce(sums)
    all_reduce(confusion)
    loss_sum, count = sums.tolist()
    confusion = confusion.view(10, 10).cpu()
    as_cpu = lambda parts: torch.cat(parts)[:keep].cpu() if parts else torch.zeros(0, dtype=torch.int64)
    return Evaluation(loss_sum / count, confusion.trace().item() / count, int(count), confusion,
                      torch.as_tensor(shown).cpu(), torch.as_tensor(shown_pred).cpu(), as_cpu(wrong), as_cpu(wrong_pred))


# ----------------------------------------------------------------------------- checkpoints

TEMPORARY_SUFFIX = ".tmp-"  # save_atomic writes .NAME.tmp-PID beside NAME


def save_atomic(obj, path: Path) -> None:
    """Write to a temporary file beside `path`, fsync, then rename over it: a crash
    mid-write leaves the previous file intact (rename is atomic on POSIX and NFS).

    A failed write removes its temporary file (left there, it would keep a full disk full
    for every later attempt) and raises an OSError that names `path`: torch.save reports a
    full disk as a RuntimeError raised while handling it, and a write's OSError names no file."""
    tmp = path.with_name(f".{path.name}{TEMPORARY_SUFFIX}{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as err:  # KeyboardInterrupt too
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        cause = err if isinstance(err, Exception) else None
        while cause is not None and not (isinstance(cause, OSError) and cause.errno is not None):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
        raise OSError(cause.errno, cause.strerror, str(path)) from err


def remove_stale_temporaries(run_dir: Path) -> list[Path]:
    """Delete the temporary files of saves that never finished (a SIGKILL, a lost node, a
    power cut mid-save) from the run directory and its checkpoints/; returns them. Only the
    process that holds the run directory may call this: another run's save in progress
    would look the same."""
    pattern = re.compile(rf"\..+{re.escape(TEMPORARY_SUFFIX)}\d+")
    stale = [path for folder in (run_dir, run_dir / "checkpoints") if folder.is_dir()
             for path in sorted(folder.iterdir()) if pattern.fullmatch(path.name) and path.is_file()]
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


CKPT_FORMAT = 1


@dataclass
class Progress:
    """Where training stands; a checkpoint records it and a resumed run starts from it."""
    epoch: int = 1              # the epoch in progress
    step_in_epoch: int = 0      # its batches already done
    # Optimiser steps done in all, the run's one count (logs, checkpoint names, rotation). A
    # resume with another world size keeps counting from where the interrupted epoch began.
    step: int = 0
    last_record: dict = field(default_factory=dict)  # the last evaluation's metrics
    finished: bool = False      # the last epoch evaluated and model.pt written: nothing left to do


def rank_state(loss_sum: torch.Tensor, device: torch.device) -> dict:
    """What each rank alone holds that the run depends on: RNG states (dropout) and the
    partial sums of the epoch in progress."""
    return {"cpu_rng": torch.get_rng_state(), "loss_sum": loss_sum.cpu(),
            "cuda_rng": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def gather_to_all(obj) -> list:
    if not dist.is_initialized():
        return [obj]
    objs = [None] * dist.get_world_size()
    dist.all_gather_object(objs, obj)
    return objs


def save_checkpoint(run_dir: Path, config: Config, rt: Runtime, model: nn.Module, optimizer: torch.optim.Optimizer,
                    progress: Progress, loss_sum: torch.Tensor, average: WeightAverage | None = None) -> Path:
    """Every rank calls this (it gathers each rank's state); rank 0 writes the file."""
    # A finite loss can still be followed by an update that overflows the weights. The
    # weights are the same on every rank, so every rank reaches the same verdict.
    if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
        raise Diverged("the weights stopped being finite")
    states = gather_to_all(rank_state(loss_sum, rt.device))
    path = run_dir / "checkpoints" / f"ckpt-{progress.step:08d}.pt"
    if rt.is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_atomic({"format": CKPT_FORMAT, "config": dataclasses.asdict(config), "world_size": rt.world_size,
                     "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "average": average.model.state_dict() if average else None,
                     "progress": dataclasses.asdict(progress), "rank_states": states}, path)
        # The newest --keep-ckpts up to this step; a later one is the file a rewound run resumed
        # from, which set_aside_checkpoints moves away once this one is safe.
        ours = [p for p in sorted(path.parent.glob("ckpt-*.pt")) if checkpoint_step(p) <= progress.step]
        for old in ours[:-config.keep_ckpts]:
            old.unlink(missing_ok=True)
    return path


def set_aside_checkpoints(run_dir: Path, step: int, keep: str = "") -> list[Path]:
    """Move the checkpoints numbered `step` or later, but the file `keep`, into a folder of
    their own under checkpoints/superseded/, and return them. A run that goes on from an
    earlier point (a rollback with --resume PATH, another world size restarting its epoch,
    newer files that would not load) writes a new path from there, which --resume auto and
    rotation must not mistake for the old one. Nothing is deleted or overwritten: a
    rollback made by mistake can still be undone by hand."""
    checkpoints = run_dir / "checkpoints"
    kept = Path(keep).resolve() if keep else None
    later = [p for p in sorted(checkpoints.glob("ckpt-*.pt")) if checkpoint_step(p) >= step and p.resolve() != kept]
    if later:
        aside = checkpoints / "superseded" / f"{time.strftime('%Y%m%d-%H%M%S')}-going-on-from-step-{step}"
        aside.mkdir(parents=True, exist_ok=True)
        for path in later:
            os.replace(path, aside / path.name)
    return later


def checkpoint_step(path: Path) -> int:
    """The step in a checkpoint's name (ckpt-00000120.pt: 120), -1 for another name."""
    match = re.fullmatch(r"ckpt-(\d+)\.pt", path.name)
    return int(match.group(1)) if match else -1


def read_checkpoint(path: Path, device: torch.device | str) -> dict:
    # weights_only: a file planted in a shared directory can hold tensors and plain
    # containers, nothing that runs code when unpickled.
    ckpt = torch.load(path, map_location=device, weights_only=True)
    if not isinstance(ckpt, dict) or ckpt.get("format") != CKPT_FORMAT:
        raise ValueError(f"not a mnist_ddp.py checkpoint of format {CKPT_FORMAT}")
    return ckpt


def checkpoint_differences(ckpt: dict, config: Config) -> dict[str, str]:
    """The trajectory options that differ, each as 'there -> here'."""
    mine = dataclasses.asdict(config)
    return {k: f"--{k.replace('_', '-')} {ckpt['config'].get(k)} there, {mine[k]} here"
            for k in TRAJECTORY if ckpt["config"].get(k) != mine[k]}


def refuse_if_unfitting(path: Path, saved: Mapping[str, torch.Tensor], model: nn.Module) -> None:
    """A checkpoint whose weights do not fit this model (its code was edited since: a wider
    layer, a renamed one) is refused in one line that names the first tensor that differs,
    instead of load_state_dict's page-long error."""
    mine, difference = model.state_dict(), ""
    for name, tensor in mine.items():
        if name not in saved:
            difference = f"{name} is not in the checkpoint"
        elif saved[name].shape != tensor.shape:
            difference = f"{name} has shape {list(saved[name].shape)} there, {list(tensor.shape)} here"
        if difference:
            break
    else:
        extra = [name for name in saved if name not in mine]
        difference = f"{extra[0]} is in the checkpoint but not in this model" if extra else ""
    if difference:
        raise UsageError(f"checkpoint {path} does not fit this model ({difference}): the model's code changed since it "
                         "was saved. Pass another --run-name to train the changed model afresh, or undo the change to "
                         "resume this run")


def find_checkpoint(config: Config, run_dir: Path) -> tuple[Path | None, str]:
    """Rank 0 picks the checkpoint to resume from: the newest one that loads, falling back
    past damaged or refused files with a warning that names them. Also returns what
    --allow-changes let differ ("" if nothing)."""
    found = sorted((run_dir / "checkpoints").glob("ckpt-*.pt"), reverse=True)
    if config.resume == "never":
        if found:
            raise UsageError(f"{run_dir / 'checkpoints'} holds checkpoints and --resume is never; "
                             "pass another --run-name to start afresh, or --resume auto to continue")
        warn_if_starting_over(run_dir, [])
        return None, ""
    candidates = found if config.resume == "auto" else [Path(config.resume)]
    for path in candidates:
        try:
            ckpt = read_checkpoint(path, "cpu")
        except Exception as err:  # truncated, garbage, or refused by weights_only
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            if config.resume != "auto":
                raise UsageError(f"cannot resume from {path}: {reason}") from None
            print(f"warning: skipping checkpoint {path}: {reason[:200]}", file=sys.stderr, flush=True)
            continue
        differences = checkpoint_differences(ckpt, config)
        fixed = [text for k, text in differences.items() if k not in CHANGEABLE]
        if fixed or (differences and not config.allow_changes):
            allowed = ", ".join("--" + k.replace("_", "-") for k in CHANGEABLE)
            raise UsageError(f"checkpoint {path} is from a different configuration ({'; '.join(differences.values())}); "
                             "resume with the same options, or pass another --run-name to start afresh"
                             + ("" if fixed else f", or add --allow-changes to carry on with new {allowed}"))
        return path, "; ".join(differences.values())
    warn_if_starting_over(run_dir, found)
    return None, ""


def warn_if_starting_over(run_dir: Path, unreadable: list[Path]) -> None:
    """A run directory that holds logs but no checkpoint that loads starts over from step 0:
    say so, since its logged epochs are replaced rather than continued."""
    metrics = run_dir / "metrics.jsonl"
    if unreadable or (metrics.is_file() and metrics.stat().st_size > 0):
        kept = " (the checkpoints that did not load go to checkpoints/superseded/)" if unreadable else ""
        print(f"warning: {run_dir} holds an earlier attempt's logs but no checkpoint that loads: starting the run over "
              f"from step 0, replacing its logged epochs{kept}", file=sys.stderr, flush=True)


def run_is_done(progress: Progress, config: Config) -> bool:
    """Whether training has nothing left to do: every epoch done, or the --max-steps cap reached."""
    return progress.epoch > config.epochs or (config.max_steps > 0 and progress.step >= config.max_steps)


def resume_from(path: Path, config: Config, rt: Runtime, model: nn.Module, optimizer: torch.optim.Optimizer,
                average: WeightAverage | None = None) -> tuple[Progress, torch.Tensor]:
    """Load a checkpoint rank 0 chose; returns where to go on and this rank's loss sums."""
    # Read onto the CPU: load_state_dict places each tensor beside its parameter, except
    # AdamW's step counts, which must stay on the CPU or every step syncs with the GPU.
    ckpt = read_checkpoint(path, "cpu")
    refuse_if_unfitting(path, ckpt["model"], model)  # the average has the same tensors
    model.load_state_dict(ckpt["model"])
    try:
        optimizer.load_state_dict(ckpt["optimizer"])
    except ValueError as err:  # its parameter groups differ: the optimizer's code changed
        raise UsageError(f"checkpoint {path} does not fit this optimizer ({err}); pass another --run-name to train "
                         "afresh, or undo the change to resume this run") from None
    if average:
        average.model.load_state_dict(ckpt["average"])
    for group in optimizer.param_groups:
        group["weight_decay"] = config.weight_decay  # the saved value, unless --allow-changes changed it
    progress = Progress(**ckpt["progress"])
    loss_sum = torch.zeros(2, dtype=torch.float64, device=rt.device)
    if ckpt["world_size"] == rt.world_size:
        state = ckpt["rank_states"][rt.rank]
        torch.set_rng_state(state["cpu_rng"].cpu())
        if state["cuda_rng"] is not None and rt.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda_rng"].cpu(), rt.device)
        loss_sum.copy_(state["loss_sum"])
    elif not (progress.finished and run_is_done(progress, config)):
        # Other shards, other batches: restart the interrupted epoch with the saved weights,
        # its steps counted on from where it began (past every step logged before it).
        start = progress.step - progress.step_in_epoch
        record = progress.last_record if progress.last_record.get("step", 0) <= start else {}  # not evaluated here
        progress = Progress(progress.epoch, 0, start, record)
        if rt.is_main:
            print(f"warning: {path} was written by {ckpt['world_size']} ranks, this run has {rt.world_size}: "
                  f"the data order changed; continuing from the start of epoch {progress.epoch}", file=sys.stderr)
    return progress, loss_sum


# ----------------------------------------------------------------------------- preemption and failures

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
    loss is not finite, some rank's clock says a checkpoint is due."""
    stopping: bool = False
    diverged: bool = False
    ckpt_due: bool = False


def start_agreement(stop: StopSignals, loss: torch.Tensor, clock: CheckpointClock, rt: Runtime) -> tuple:
    """Start this step's agreement: one small all-reduce of every rank's flags, which runs
    while the next step computes; read_agreement reads it one step later. Reading it at
    once would make the host wait for the step to finish on a GPU (twice: the loss check
    and the result), so the next step's kernels could not be queued behind it."""
    host = torch.tensor([float(stop.received > 0), float(clock.due())])
    on_gpu = rt.device.type == "cuda"
    flags = torch.cat([(host.pin_memory() if on_gpu else host).to(rt.device, non_blocking=True),
                       (~torch.isfinite(loss.detach())).float().view(1)])
    work = dist.all_reduce(flags, async_op=True) if dist.is_initialized() else None
    if not on_gpu:
        return work, flags, None
    if work is not None:
        work.wait()  # on a GPU: the stream waits for the reduction, the host does not
    result = torch.empty(3, pin_memory=True)
    result.copy_(flags, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return None, result, done


def read_agreement(pending: tuple) -> Verdict:
    """The verdict of a started agreement, waiting for it if need be (by the next step's end
    it has long arrived)."""
    work, flags, done = pending
    if work is not None:
        work.wait()
    if done is not None:
        done.synchronize()
    stopping, ckpt_due, diverged = flags.tolist()
    return Verdict(stopping > 0, diverged > 0, ckpt_due > 0)


# What each collective is for, by the function that runs it: a lost peer names it.
COLLECTIVES = {
    "init_distributed": "joining the process group", "prepare_data": "the barrier around staging the data",
    "claim_run_dir": "sharing the run directory's name", "agree_on_checkpoint": "choosing the checkpoint to resume from", "train_step": "the gradient all-reduce",
    "start_agreement": "the per-step agreement (stop, divergence, checkpoint time)",
    "read_agreement": "the per-step agreement (stop, divergence, checkpoint time)",
    "sync_buffers": "the broadcast of the model's buffers", "evaluate": "the all-reduce of the test figures",
    "peak_rss_mb": "the all-reduce of the memory figures", "save_checkpoint": "the gather of each rank's state",
    "stop_here": "the barrier before stopping", "main": "a collective of main() (the host list, the epoch's loss sums)",
}


def is_lost_peer(err: BaseException) -> bool:
    """A collective failed because another rank is gone or hung: c10d's own errors (NCCL,
    the store), or Gloo's, which arrive as a RuntimeError that says what the socket saw."""
    if isinstance(err, dist.DistError):
        return True
    # Gloo's words for it vary with where the wait was: "Timed out waiting 20000ms for recv",
    # "Application timeout caused pair closure", "Connection closed by peer", ...
    return isinstance(err, RuntimeError) and re.search(
        r"connection (closed|reset) by peer|timed out|timeout caused|broken pipe|connection refused|gloo/transport",
        str(err), re.IGNORECASE) is not None


def lost_peer_message(err: BaseException, progress: Progress) -> str:
    frames = [f for f in traceback.extract_tb(err.__traceback__) if f.filename == __file__]
    where = next((COLLECTIVES[f.name] for f in reversed(frames) if f.name in COLLECTIVES), "a collective")
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


def storage_problem(err: BaseException, options: Config | None) -> str:
    """The one line for an error in the log directory, the run directory or its checkpoints
    that the user fixes (a full disk or quota, no permission, a read-only file system, a
    file where a directory goes); "" for anything else, which stays a bug with a traceback."""
    if not isinstance(err, OSError) or err.errno not in STORAGE_FIXES or options is None:
        return ""
    fix = STORAGE_FIXES[err.errno]
    if not err.filename:
        # A buffered write's error (TensorBoard's writer thread, a log line) names no file;
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


def record_exit(code: int, launch: Launch | None) -> None:
    """Leave this rank's exit code where run_training.sbatch reads it: it restarts after
    a lost peer or a killed rank, never after a code in NOT_RETRIED on any rank."""
    if launch and launch.exit_dir:
        with contextlib.suppress(OSError):
            Path(launch.exit_dir).mkdir(parents=True, exist_ok=True)
            Path(launch.exit_dir, f"rank-{launch.rank}").write_text(f"{code}\n")


def unfixable_exit(launch: Launch) -> tuple[int, str]:
    """(code, rank file) of an earlier attempt of this step that a restart cannot fix, or (0, "").

    torchrun restarts every worker when one fails. When one rank hit a bug (1) or a usage
    error (2) and the others lost it, the restarted workers find its code here and end
    at once instead of repeating it."""
    if not launch.exit_dir or launch.attempt.startswith("1/"):
        return 0, ""
    for path in sorted(Path(launch.exit_dir).glob("rank-*")):
        with contextlib.suppress(OSError, ValueError):
            if (code := int(path.read_text())) in NOT_RETRIED:
                return code, path.name
    return 0, ""


def exit_status(code: int) -> int:
    """The process's exit status for its launcher. torchrun restarts every worker group in
    which a worker exited non-zero, whatever the code; so while it would restart, a code
    that a restart cannot fix goes to the exit file only and the worker exits 0. Users of
    torchrun without run_training.sbatch (no MNIST_DDP_EXIT_DIR) get the code itself."""
    with contextlib.suppress(UsageError):
        launch = read_launch_env(os.environ)
        if launch.exit_dir and launch.restarts_left > 0 and code in NOT_RETRIED:
            return 0
    return code


SCONTROL_TIMEOUT = 60.0  # seconds; a slow controller must not keep the other ranks waiting forever


def requeue_slurm_job(launch: Launch) -> bool:
    """Ask Slurm to requeue this job, if it may; the job's processes die with this call.
    Any failure (no scontrol, a timeout, a refusal) means 'not requeued', never a crash."""
    if not launch.job_id or shutil.which("scontrol") is None:
        return False
    try:
        shown = subprocess.run(["scontrol", "show", "job", "-o", launch.job_id], capture_output=True, text=True,
                               timeout=SCONTROL_TIMEOUT)
        if "Requeue=1" not in shown.stdout:
            print(f"Slurm job {launch.job_id} may not be requeued (it was submitted without --requeue)", flush=True)
            return False
        print(f"requeueing Slurm job {launch.job_id}; it resumes from its last checkpoint", flush=True)
        result = subprocess.run(["scontrol", "requeue", launch.job_id], capture_output=True, text=True,
                                timeout=SCONTROL_TIMEOUT)
    except (OSError, subprocess.SubprocessError) as err:
        print(f"could not requeue Slurm job {launch.job_id} (scontrol: {err})", flush=True)
        return False
    if result.returncode != 0:
        print(f"could not requeue Slurm job {launch.job_id} (scontrol requeue: {result.stderr.strip()})", flush=True)
    return result.returncode == 0


# What a command that continues a run leaves out: where the first one started from, the
# testing aid (it would stop the run again at the same step), staging alone; and, under
# run_training.sbatch, what the batch file passes itself (from LOG_DIR and RUN_NAME; it
# refuses these options after its name). The data directories stay: an option given after
# the batch file's name wins over DATA_DIR.
NOT_CONTINUED = ("resume", "interrupt_at", "download_only")
SET_BY_BATCH_FILE = ("log_dir", "run_name", "run_dir")


def option_args(config: Config, leave_out: tuple[str, ...] = ()) -> list[str]:
    """The options of `config` that differ from their defaults, as command-line arguments."""
    args = []
    for f in dataclasses.fields(Config):
        value = getattr(config, f.name)
        if f.name in leave_out or value == f.default:
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.type is bool:
            args.append(flag if value else "--no-" + flag[2:])
        else:
            args += [flag, repr(value) if isinstance(value, float) else str(value)]
    return args


def continue_command(config: Config, launch: Launch, run_dir: Path, **changes: str) -> str:
    """The one builder of every command printed to carry this run on from its newest
    checkpoint: "to continue", "to train it longer", the advice after divergence, and
    the line run_training.sbatch prints after END. It is built from the run's options
    (not from the words typed, which may abbreviate them), naming the run's directory,
    without the NOT_CONTINUED ones, and with `changes` ({"lr": "0.001", "allow_changes":
    ""}) at the end. Under run_training.sbatch it is the sbatch line that resubmits the
    job: the batch file passes its beginning (the directory, its variables, the job's
    request, itself) in MNIST_DDP_RESUBMIT."""
    leave_out = NOT_CONTINUED + tuple(changes)
    resubmit = os.environ.get("MNIST_DDP_RESUBMIT", "")
    if resubmit:
        args = option_args(config, leave_out + SET_BY_BATCH_FILE)
        command = resubmit
    else:
        args = option_args(config, leave_out)
        if not (config.run_name or config.run_dir):
            args += ["--run-name", run_dir.name] if run_dir.parent == Path(config.log_dir) else ["--run-dir", str(run_dir)]
        script = sys.argv[0] if sys.argv[0].endswith(".py") else PROG
        command = f"{launcher_words(launch)} {shlex.quote(script)}"
    for name, value in changes.items():
        args += ["--" + name.replace("_", "-")] + ([value] if value != "" else [])
    return f"{command} {shlex.join(args)}".rstrip()


def launcher_words(launch: Launch) -> str:
    """How this process was started, as a command that starts the same ranks again."""
    if launch.source == "torchrun":
        if launch.nodes == 1:
            return f"torchrun --standalone --nproc-per-node={launch.local_world_size}"
        return f"torchrun [the torchrun options you gave, on each of the {launch.nodes} nodes]"
    if launch.source == "slurm":
        return f"srun --nodes={launch.nodes} --ntasks={launch.world_size} python"
    return "python"


# ----------------------------------------------------------------------------- logging

def choose_run_dir(config: Config, launch: Launch) -> Path:
    """Rank 0's choice of the run's directory: LOG_DIR/RUN_NAME; without a name, the Slurm
    job id when there is one (a requeued job finds its own directory again), else a new
    directory named by the time, created here so that runs started in the same second
    each get their own."""
    if config.run_dir:
        return Path(config.run_dir)
    if config.run_name:
        return Path(config.log_dir, config.run_name)
    if launch.job_id:
        return Path(config.log_dir, f"job-{launch.job_id}")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    Path(config.log_dir).mkdir(parents=True, exist_ok=True)
    for n in itertools.count(1):
        path = Path(config.log_dir, stamp if n == 1 else f"{stamp}-{n}")
        with contextlib.suppress(FileExistsError):
            path.mkdir()
            return path


class RunDirTaken(UsageError):
    """Another run holds the run directory."""


class RunClaim:
    """Rank 0's hold on its run directory for as long as the run lives: an exclusive lock
    on RUN_DIR/.claim. POSIX locks also work across NFS clients, and the kernel releases
    them when the process dies, even by SIGKILL, so a restart or a requeue gets it again.
    (On NFS, the lock of a node that was lost outright lasts until the server notices,
    its lock recovery; the refusal names the holder.) A second run of the same name (a
    resubmission while the first still runs) meets it and stops with one line, before it
    reads a checkpoint that the first one is writing."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self.file = open(run_dir / ".claim", "a+")
        try:
            fcntl.lockf(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno == errno.ENOLCK:
                self.file.close()
                raise UsageError(f"cannot lock {run_dir / '.claim'}: its file system offers no locks (NFS without a lock "
                                 "service); ask your admins, or pass a --log-dir on another file system") from None
            if err.errno not in (errno.EACCES, errno.EAGAIN):
                raise
            self.file.seek(0)
            holder = self.file.read().strip() or "another process"
            self.file.close()
            raise RunDirTaken(f"another run is using {run_dir} ({holder}); wait for it to end, or pass another "
                              "--run-name to start a separate run") from None
        self.file.seek(0)
        self.file.truncate()
        self.file.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        self.file.flush()
        (run_dir / "exit-code").unlink(missing_ok=True)  # written again when this attempt ends

    def release(self, code: int) -> None:
        """Record how this attempt ended, for run_training.sbatch, sweep.py summary and
        whoever reads the directory, then let the next run in."""
        with contextlib.suppress(OSError):
            (self.run_dir / "exit-code").write_text(f"{code}\n")
        self.file.close()


def claim_run_dir(config: Config, launch: Launch, rt: Runtime) -> tuple[Path, RunClaim | None]:
    """Rank 0 chooses and claims the run's directory, and tells every rank which it is."""
    claim, choice = None, ["", ""]
    if rt.is_main:
        try:
            claim = RunClaim(choose_run_dir(config, launch))
            choice = [str(claim.run_dir), ""]
        except UsageError as err:
            choice = ["", str(err)]
            if isinstance(err, RunDirTaken) and launch.exit_dir:  # so the batch file leaves that run's files alone
                Path(launch.exit_dir).mkdir(parents=True, exist_ok=True)
                Path(launch.exit_dir, "run-dir-taken").touch()
        except OSError as err:  # a log directory that is a file, read-only or full
            choice = ["", storage_problem(err, config)]
            if not choice[1]:
                raise
    run_dir, error = broadcast_from_main(choice)
    if error:
        raise UsageError(error if rt.is_main else "rank 0 cannot use the run directory; see its error")
    return Path(run_dir), claim


def peak_rss_mb(rt: Runtime) -> float:
    """The largest peak resident memory of any rank so far (Linux's VmHWM), in MB."""
    peak = 0.0
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                peak = int(line.split()[1]) / 1024
    return all_reduce(torch.tensor([peak], dtype=torch.float64, device=rt.device), dist.ReduceOp.MAX).item()


def gpu_figures(device: torch.device) -> dict:
    """This rank's peak GPU memory in the epoch and the GPU's utilisation (needs pynvml)."""
    if device.type != "cuda":
        return {}
    figures = {"gpu_memory_gb": torch.cuda.max_memory_allocated(device) / 1e9}
    try:
        figures["gpu_utilization"] = float(torch.cuda.utilization(device))
    except Exception:  # no NVML bindings installed: memory alone
        pass
    return figures


def usable_cpus() -> int:
    """CPUs this process may run on (Slurm's binding, cgroups, taskset), not the node's count."""
    return len(os.sched_getaffinity(0))


def describe_environment(rt: Runtime, launch: Launch, hosts: list[str]) -> dict:
    env = {
        "python": platform.python_version(), "torch": torch.__version__, "torchvision": torchvision.__version__,
        "launcher": launch.source, "world_size": rt.world_size, "backend": rt.backend, "device": str(rt.device),
        "hosts": sorted(set(hosts)), "master": f"{launch.master_addr}:{launch.master_port}" if rt.world_size > 1 else "",
        "slurm_job_id": launch.job_id, "cpu_threads_per_rank": torch.get_num_threads(), "cpus_rank_0": usable_cpus(),
        "gloo_socket_ifname": os.environ.get("GLOO_SOCKET_IFNAME", ""), "gpus_granted": launch.gpus_granted,
        "attempt": launch.attempt, "slurm_requeues": launch.requeues,
    }
    if rt.device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(rt.device)
    return env


def labelled_grid(images: torch.Tensor, pred: torch.Tensor, true: torch.Tensor, per_row: int = 8) -> np.ndarray:
    """Test images, twice their size, each captioned 'prediction/truth' (green if right, red if wrong)."""
    cell, caption = 56, 14
    rows = max(1, math.ceil(len(images) / per_row))
    sheet = Image.new("RGB", (per_row * cell, rows * (cell + caption)), "white")
    draw = ImageDraw.Draw(sheet)
    for i, (image, p, t) in enumerate(zip(images, pred.tolist(), true.tolist(), strict=True)):
        x, y = (i % per_row) * cell, (i // per_row) * (cell + caption)
        sheet.paste(Image.fromarray(image.numpy()).resize((cell, cell)), (x, y))
        draw.text((x + 4, y + cell + 1), f"{p}/{t}", fill=(0, 140, 0) if p == t else (220, 0, 0))
    return np.asarray(sheet)


def confusion_picture(confusion: torch.Tensor) -> np.ndarray:
    """The confusion matrix as a heat map with counts: rows true class, columns prediction."""
    cell, left, top = 40, 24, 36
    sheet = Image.new("RGB", (left + 10 * cell, top + 10 * cell), "white")
    draw = ImageDraw.Draw(sheet)
    draw.text((2, 2), "rows: true class, columns: prediction", fill="black")
    share = confusion.double() / confusion.sum(1, keepdim=True).clamp(min=1)
    for t in range(10):
        draw.text((8, top + t * cell + 14), str(t), fill="black")
        draw.text((left + t * cell + 17, top - 14), str(t), fill="black")
        for p in range(10):
            shade = int(255 * (1 - share[t, p].item()))
            box = (left + p * cell, top + t * cell, left + (p + 1) * cell - 1, top + (t + 1) * cell - 1)
            draw.rectangle(box, fill=(shade, shade, 255) if t == p else (255, shade, shade))
            draw.text((box[0] + 6, box[1] + 14), str(int(confusion[t, p])), fill="white" if shade < 128 else "black")
    return np.asarray(sheet)


# The HParams tab: the options that shape training, typed, and the metrics to compare runs
# by, with their scalar tags (so a run still going shows its latest values). TensorBoard
# takes the first experiment it finds in a log directory; every run declares this one.
HPARAMS = {"lr": float, "weight_decay": float, "batch_size": int, "global_batch": int, "epochs": int, "model": str,
           "dropout": float, "label_smoothing": float, "shift": float, "seed": int, "world_size": int, "amp": bool}
HPARAM_METRICS = {"test/accuracy": "test accuracy", "test/loss": "test loss", "train/loss": "train loss",
                  "time/seconds_to_best": "seconds to the best epoch"}
# The tab lists the hparams marked as differing first and shows the first five: a sweep
# marks the options it varies (sweep.py); a log directory of single runs, these.
USUAL_HPARAMS = ("lr", "batch_size", "global_batch", "weight_decay", "epochs")


def hparams_summary(tag: str, **content) -> Summary:
    data = plugin_data_pb2.HParamsPluginData(version=metadata.PLUGIN_DATA_VERSION, **content)
    plugin = SummaryMetadata.PluginData(plugin_name=metadata.PLUGIN_NAME, content=data.SerializeToString())
    return Summary(value=[Summary.Value(tag=tag, metadata=SummaryMetadata(plugin_data=plugin))])


def declare_hparams(log_dir: Path, first: tuple[str, ...] = USUAL_HPARAMS) -> None:
    """Write the experiment (which options and metrics the tab shows) once per log directory."""
    types = {float: api_pb2.DATA_TYPE_FLOAT64, int: api_pb2.DATA_TYPE_FLOAT64, str: api_pb2.DATA_TYPE_STRING,
             bool: api_pb2.DATA_TYPE_BOOL}
    infos = [api_pb2.HParamInfo(name=name, type=types[kind], differs=name in first) for name, kind in HPARAMS.items()]
    infos[list(HPARAMS).index("model")].domain_discrete.extend(MODELS)
    metrics = [api_pb2.MetricInfo(name=api_pb2.MetricName(tag=tag), display_name=name) for tag, name in HPARAM_METRICS.items()]
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
        os.close(os.open(log_dir / ".hparams-declared", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        return  # another run of this directory (an array task) did it
    except OSError as err:
        # The parent of a --run-dir may be a directory this user cannot write (a project's
        # shared folder): a run directory that can be written still trains, and without the
        # declaration TensorBoard infers the tab's columns from the runs it finds.
        print(f"warning: cannot declare the HParams experiment in {log_dir} ({err.strerror}); training goes on, "
              "and TensorBoard's HParams tab infers its columns from the runs", file=sys.stderr, flush=True)
        return
    with SummaryWriter(str(log_dir), filename_suffix=".hparams") as writer:
        writer.file_writer.add_summary(hparams_summary(metadata.EXPERIMENT_TAG, experiment=api_pb2.Experiment(
            hparam_infos=infos, metric_infos=metrics)))


def hparam_values(config: Config, world_size: int) -> dict:
    values = {**dataclasses.asdict(config), "global_batch": config.batch_size * world_size, "world_size": world_size}
    return {name: values[name] for name in HPARAMS}


def read_metrics_tolerantly(path: Path) -> list[dict]:
    """metrics.jsonl's records, without a line that a crash cut short while it was being
    appended (and any other line that is not a record), each dropped with a warning."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return []
    records = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
        else:
            print(f"warning: dropping line {number} of {path}, which is not a whole record: {line[:80]!r}",
                  file=sys.stderr, flush=True)
    return records


def markdown_table(d: dict) -> str:
    return "| key | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in d.items())


class RunLogger:
    """Rank 0's output: stdout lines, RUN_DIR/metrics.jsonl and TensorBoard events."""

    def __init__(self, run_dir: Path, config: Config, environment: dict, resumed_step: int, note: str = ""):
        # For sweep.py summary and anyone reading the directory: what this attempt runs with.
        (run_dir / "run.json").write_text(json.dumps({"config": dataclasses.asdict(config), "environment": environment}))
        self.log_every, self.progress_every = config.log_every, config.progress_every
        self.last_progress = time.monotonic()
        # The run goes on from resumed_step (0: from the start) and repeats what came after
        # it: drop those lines, and have TensorBoard hide those steps, so nothing is doubled
        # or rewound.
        metrics_path = run_dir / "metrics.jsonl"
        records = [r for r in read_metrics_tolerantly(metrics_path) if r["step"] <= resumed_step]
        rewritten = metrics_path.with_name(f".{metrics_path.name}{TEMPORARY_SUFFIX}{os.getpid()}")  # a kill loses no line
        rewritten.write_text("".join(json.dumps(r) + "\n" for r in records))
        os.replace(rewritten, metrics_path)
        # Training time so far and when the best epoch came, over every attempt of the run.
        self.elapsed, self.best, self.to_best = 0.0, -1.0, 0.0
        for record in records:
            self.add_epoch_time(record)
        declare_hparams(run_dir.parent)
        self.writer = SummaryWriter(str(run_dir), purge_step=resumed_step + 1)
        start = plugin_data_pb2.SessionStartInfo(start_time_secs=time.time())
        for name, value in hparam_values(config, environment["world_size"]).items():
            kind = "bool_value" if isinstance(value, bool) else "string_value" if isinstance(value, str) else "number_value"
            setattr(start.hparams[name], kind, value)
        self.writer.file_writer.add_summary(hparams_summary(metadata.SESSION_START_INFO_TAG, session_start_info=start))
        self.metrics = open(metrics_path, "a")
        self.show_progress = sys.stdout.isatty()
        # At the step it starts from: a resumed run's attempts each keep their own entry.
        self.writer.add_text("config", markdown_table(dataclasses.asdict(config)), resumed_step)
        self.writer.add_text("environment", markdown_table(environment), resumed_step)
        if note:
            self.writer.add_text("log", note, resumed_step)
            print(note, flush=True)
        self.writer.flush()
        print(f"config: {json.dumps(dataclasses.asdict(config))}")
        print(f"environment: {json.dumps(environment)}")
        print(f"TensorBoard logs: {run_dir}  (view: tensorboard --logdir {run_dir.parent})", flush=True)

    def step(self, step: int, loss: torch.Tensor, epoch: int, step_in_epoch: int, steps_per_epoch: int) -> None:
        """Called every step; reads the loss (a device sync) only when something is due."""
        if step % self.log_every == 0:
            self.writer.add_scalar("train/batch_loss", loss.item(), step)
            if self.show_progress:
                print(f"\repoch {epoch} step {step_in_epoch}/{steps_per_epoch} loss {loss.item():.4f}", end="", flush=True)
        if not self.show_progress and self.progress_every and time.monotonic() - self.last_progress >= self.progress_every:
            # In a batch job's output file, so that a long epoch does not look like a hang.
            self.last_progress = time.monotonic()
            print(f"epoch {epoch} step {step_in_epoch}/{steps_per_epoch} (step {step} in all) batch loss {loss.item():.4f}",
                  flush=True)

    def add_epoch_time(self, record: dict) -> None:
        self.elapsed += record["epoch_s"]
        if record["test_accuracy"] > self.best:
            self.best, self.to_best = record["test_accuracy"], self.elapsed
        record["seconds_to_best"] = self.to_best

    def epoch(self, record: dict, evaluation: Evaluation, test_set: Split, pictures: bool) -> None:
        self.add_epoch_time(record)
        if self.show_progress:
            print("\r\033[K", end="")
        line = (f"epoch {record['epoch']:3d} | train loss {record['train_loss']:.4f} | test loss {record['test_loss']:.4f} "
                f"| test acc {100 * record['test_accuracy']:6.2f}% | lr {record['lr']:.2e} "
                f"| {record['images_per_s']:8.0f} img/s | {record['epoch_s']:6.2f} s")
        print(line, flush=True)
        self.metrics.write(json.dumps(record) + "\n")
        self.metrics.flush()
        step = record["step"]
        for tag, key in (("train/loss", "train_loss"), ("test/loss", "test_loss"), ("test/accuracy", "test_accuracy"),
                         ("train/lr", "lr"), ("speed/images_per_s", "images_per_s"), ("speed/epoch_s", "epoch_s"),
                         ("memory/peak_rss_mb", "peak_rss_mb"), ("gpu/memory_gb", "gpu_memory_gb"),
                         ("time/seconds_to_best", "seconds_to_best"),
                         ("gpu/utilization_percent", "gpu_utilization")):
            if key in record:
                self.writer.add_scalar(tag, record[key], step)
        self.writer.add_text("log", f"`{line}`", step)
        if pictures:
            images, labels = test_set.images.cpu(), test_set.labels.cpu()
            self.writer.add_image("test/predictions", labelled_grid(images[evaluation.shown], evaluation.shown_pred,
                                                                    labels[evaluation.shown]), step, dataformats="HWC")
            if len(evaluation.wrong):
                self.writer.add_image("test/misclassified", labelled_grid(images[evaluation.wrong], evaluation.wrong_pred,
                                                                          labels[evaluation.wrong]), step, dataformats="HWC")
            self.writer.add_image("test/confusion_matrix", confusion_picture(evaluation.confusion), step, dataformats="HWC")
        self.writer.flush()  # per epoch, not per step: cheap and TensorBoard stays current

    def finish(self, final: dict, step: int) -> None:
        for name, value in final.items():
            self.writer.add_scalar(f"final/{name}", value, step)
        self.writer.file_writer.add_summary(hparams_summary(metadata.SESSION_END_INFO_TAG, session_end_info=(
            plugin_data_pb2.SessionEndInfo(status=api_pb2.STATUS_SUCCESS, end_time_secs=time.time()))))

    def close(self) -> None:
        self.writer.close()
        self.metrics.close()


class NullLogger:
    """What ranks other than 0 log: nothing, so call sites never branch on rank."""

    def step(self, *args) -> None: ...
    def epoch(self, record: dict, evaluation: Evaluation, test_set: Split, pictures: bool) -> None: ...
    def finish(self, final: dict, step: int) -> None: ...
    def close(self) -> None: ...


# ----------------------------------------------------------------------------- main

def fail(err: Exception | str, code: int = EXIT_USAGE, who: str = "") -> int:
    print(f"{PROG}{who}: error: {err}", file=sys.stderr, flush=True)
    return code


def build_training(config: Config, rt: Runtime) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer, WeightAverage | None]:
    """(the model to train, wrapped in DDP and compiled as asked; the plain model, for
    checkpoints; its AdamW; the average of its weights that evaluation uses, with --ema)."""
    torch.manual_seed(config.seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    raw_model = build_model(config).to(rt.device)
    if config.channels_last:
        raw_model = raw_model.to(memory_format=torch.channels_last)
    model = raw_model
    if rt.world_size > 1:
        model = DistributedDataParallel(raw_model, device_ids=[rt.device.index] if rt.device.type == "cuda" else None)
    if config.compile:
        model = torch.compile(model)
    average = WeightAverage(raw_model, config.ema) if config.ema else None
    torch.manual_seed(config.seed + rt.rank)  # dropout differs per rank, as its data does
    # beta2 0.99 instead of 0.999: the step sizes adapt within ~100 steps, not ~1,000 (README "Defaults").
    # fused: one pass over all the weights instead of a loop of small ops per tensor (on 2 CPU cores
    # the update takes 0.5 ms instead of 1.4 ms, a tenth of the step; on a GPU, one kernel).
    optimizer = torch.optim.AdamW(raw_model.parameters(), lr=config.lr, betas=(0.9, 0.99),
                                  weight_decay=config.weight_decay, fused=rt.device.type in ("cpu", "cuda"))
    return model, raw_model, optimizer, average


def record_continue_command(launch: Launch, command: str) -> None:
    """Under run_training.sbatch, leave the command that continues this run where the batch
    file prints it after its END line, even when every rank was killed."""
    if launch.exit_dir and os.environ.get("MNIST_DDP_RESUBMIT"):
        Path(launch.exit_dir).mkdir(parents=True, exist_ok=True)
        Path(launch.exit_dir, "continue-command").write_text(command + "\n")


def agree_on_checkpoint(config: Config, rt: Runtime, run_dir: Path) -> tuple[str, str]:
    """Rank 0 picks the checkpoint (or the error) and tells every rank: (path or "", what
    --allow-changes let differ)."""
    choice = ["", "", ""]
    if rt.is_main:
        try:
            path, changed = find_checkpoint(config, run_dir)
            choice = [str(path or ""), changed, ""]
        except UsageError as err:
            choice = ["", "", str(err)]
    path, changed, error = broadcast_from_main(choice)
    if error:
        raise UsageError(error if rt.is_main else "rank 0 cannot resume; see its error")
    return path, changed


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    stop, who = EARLY_STOP or StopSignals(), ""  # signal handlers first: one during start-up is kept, not fatal
    logger, code, launch, progress, claim, config = NullLogger(), EXIT_BUG, None, Progress(), None, None
    try:
        launch = read_launch_env(os.environ)
        who = f" [rank {launch.rank}/{launch.world_size} on {socket.gethostname()}]" if launch.world_size > 1 else ""
        config = parse_config(argv)
        earlier, rank_file = unfixable_exit(launch)
        if earlier:
            print(f"{PROG}{who}: not training again: an earlier attempt ended with exit code {earlier} ({rank_file}), "
                  "which a restart does not fix; see its error above", file=sys.stderr, flush=True)
            code = earlier
            return code
        rt = init_distributed(config, launch)
        train_set, test_set = prepare_data(config, rt)
        if config.download_only:
            print(f"[rank {rt.rank}] {config.dataset} is ready in {node_data_dir(config) or config.data_dir}")
            code = 0
            return code
        run_dir, claim = claim_run_dir(config, launch, rt)
        if claim:  # holding the directory: no other run's save can be under way in it
            for path in remove_stale_temporaries(run_dir):
                print(f"removed {path}, left by a save that never finished", file=sys.stderr, flush=True)
        model, raw_model, optimizer, average = build_training(config, rt)
        eval_model = average.model if average else raw_model

        per_rank = len(train_set.labels) // rt.world_size
        steps_per_epoch = math.ceil(per_rank / config.batch_size)

        ckpt_path, changed = agree_on_checkpoint(config, rt, run_dir)
        progress, loss_sum = Progress(), torch.zeros(2, dtype=torch.float64, device=rt.device)
        if ckpt_path:
            progress, loss_sum = resume_from(Path(ckpt_path), config, rt, raw_model, optimizer, average)
        if progress.finished and run_is_done(progress, config):
            if rt.is_main:
                longer = {"epochs": str(config.epochs + 4)} if progress.epoch > config.epochs else {}
                if config.max_steps and progress.step >= config.max_steps:
                    longer["max_steps"] = "0"  # the cap ended it: lift the cap
                print(f"run {run_dir} is already complete (epoch {progress.last_record.get('epoch', progress.epoch - 1)}, "
                      f"step {progress.step}); to train it longer: "
                      f"{continue_command(config, launch, run_dir, **longer, allow_changes='')}", flush=True)
            code = 0
            return code
        progress.finished = False
        # The learning-rate schedule runs in this world size's steps; the step count goes on
        # from the checkpoint's, which another world size may have counted differently.
        schedule_offset = progress.step - ((progress.epoch - 1) * steps_per_epoch + progress.step_in_epoch)
        total_steps = config.epochs * steps_per_epoch
        if config.max_steps:
            total_steps = min(total_steps, config.max_steps - schedule_offset)

        starts = gather_to_all((socket.gethostname(), launch.attempt))
        hosts = [host for host, _ in starts]
        # torchrun's agents count their restarts each on their own: the highest is the job's.
        launch = dataclasses.replace(launch, attempt=max((a for _, a in starts), key=lambda a: int(a.split("/")[0])))
        # Going on from an earlier point than the newest checkpoints (see set_aside_checkpoints),
        # or from a file elsewhere: first save where the run stands, as checkpoints/ckpt-<step>.
        here = run_dir / "checkpoints" / f"ckpt-{progress.step:08d}.pt"
        save_here = bool(ckpt_path) and Path(ckpt_path).resolve() != here.resolve()
        if rt.is_main:
            # Every rank has read its checkpoint by now (the gather above comes after).
            later = set_aside_checkpoints(run_dir, progress.step, keep=ckpt_path)
            if later:
                print(f"warning: set aside {len(later)} checkpoint(s) numbered from step {progress.step} on, which this run "
                      f"no longer continues, in {run_dir / 'checkpoints' / 'superseded'}", file=sys.stderr, flush=True)
            note = f"resumed with changed options (--allow-changes): {changed}" if changed else ""
            logger = RunLogger(run_dir, config, describe_environment(rt, launch, hosts), progress.step, note=note)
            record_continue_command(launch, continue_command(config, launch, run_dir))
        cpus, threads = usable_cpus(), torch.get_num_threads()
        print(f"[rank {rt.rank}/{rt.world_size}] {socket.gethostname()} {rt.device} {rt.backend}: "
              f"{per_rank} images, {steps_per_epoch} steps per epoch, {threads} threads on {cpus} CPUs", flush=True)
        if threads > cpus:
            print(f"warning{who}: {threads} threads share {cpus} CPUs, which slows every step; under Slurm export "
                  "SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK (run_training.sbatch does), or set OMP_NUM_THREADS", flush=True)
        if rt.is_main:
            print(f"global batch {config.batch_size * rt.world_size} ({rt.world_size} x {config.batch_size}), "
                  f"{total_steps + schedule_offset} steps in all", flush=True)
            if ckpt_path:
                print(f"resumed from {ckpt_path}: epoch {progress.epoch}, step {progress.step} (attempt {launch.attempt}, "
                      f"requeued {launch.requeues}x)", flush=True)
        interrupt_step, interrupt_signal = (config.interrupt_at.split(":") + [""])[:2]
        ckpt_clock, pending = CheckpointClock(config.ckpt_minutes), None

        def this_step() -> Verdict:
            """This step's agreement, waited for: before a checkpoint and at an epoch's end."""
            nonlocal pending
            now, pending = read_agreement(pending), None
            if now.diverged:  # before any checkpoint could take the bad weights
                raise diverged("the loss stopped being finite")
            return now

        def checkpoint() -> Path:
            try:
                path = save_checkpoint(run_dir, config, rt, raw_model, optimizer, progress, loss_sum, average)
            except Diverged as err:
                raise diverged(str(err)) from None
            ckpt_clock.reset()
            return path

        def stop_here(path: Path) -> int:
            if rt.is_main:
                why = signal.Signals(stop.received).name if stop.received else "another rank's signal"
                print(f"stopping on {why} at step {progress.step}: saved {path}", flush=True)
            if dist.is_initialized():
                dist.barrier()  # the checkpoint is complete before anyone can be killed
            # Ctrl-C asks to stop, not to be queued again. When the requeue succeeds, Slurm
            # ends every process here.
            if rt.is_main and (stop.received == signal.SIGINT or not requeue_slurm_job(launch)):
                print(f"to continue: {continue_command(config, launch, run_dir)}", flush=True)
            if dist.is_initialized():
                dist.barrier()
            return EXIT_STOPPED

        def diverged(what: str, step: int | None = None) -> Diverged:
            lower = continue_command(config, launch, run_dir, lr=f"{config.lr / 3:.3g}", allow_changes="")
            if rt.is_main:
                record_continue_command(launch, lower)
            return Diverged(f"{what} at step {progress.step if step is None else step} (epoch {progress.epoch}); nothing "
                            f"from this step on was saved. Resume from the last checkpoint with a lower learning rate: {lower}")

        def evaluate_here(started: float, trained: int) -> None:
            """Evaluate where training stands and log it as the epoch's record; `trained`
            images went through this rank since `started`."""
            if rt.device.type == "cuda":
                torch.cuda.synchronize(rt.device)
            train_seconds = time.perf_counter() - started
            train_loss_sum, images = all_reduce(loss_sum.clone()).tolist()
            sync_buffers(raw_model)
            if average:
                average.copy_buffers(raw_model)
            evaluation = evaluate(eval_model, test_set, config, rt)
            progress.last_record = {
                "epoch": progress.epoch, "step": progress.step, "train_loss": train_loss_sum / max(images, 1),
                "test_loss": evaluation.loss, "test_accuracy": evaluation.accuracy, "test_images": evaluation.count,
                "lr": optimizer.param_groups[0]["lr"], "images_per_s": trained * rt.world_size / max(train_seconds, 1e-9),
                "epoch_s": time.perf_counter() - started, "peak_rss_mb": peak_rss_mb(rt), **gpu_figures(rt.device)}
            logger.epoch(progress.last_record, evaluation, test_set,
                         pictures=config.image_every > 0 and progress.epoch % config.image_every == 0)

        if save_here:
            checkpoint()
            if rt.is_main:  # the file resumed from, when it was a later one in checkpoints/ (another world size)
                set_aside_checkpoints(run_dir, progress.step + 1)
        stop.training = True  # from now on Ctrl-C saves first
        while not run_is_done(progress, config):
            started = time.perf_counter()
            if rt.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(rt.device)
            shard = epoch_shard(len(train_set.labels), progress.epoch, config.seed, rt.rank, rt.world_size).to(rt.device)
            shifts = epoch_shifts(len(train_set.labels), progress.epoch, config.seed, config.shift)
            shifts = shifts if shifts is None else shifts.to(rt.device)
            trained = 0  # images this rank trained on since `started`, for the speed (a resumed epoch had more)
            for k in range(progress.step_in_epoch, steps_per_epoch):
                if run_is_done(progress, config):  # the --max-steps cap, in mid-epoch
                    break
                idx = shard[k * config.batch_size: (k + 1) * config.batch_size]
                images = shift_images(train_set.images[idx], shifts if shifts is None else shifts[:, idx])
                x, y = normalize(images, config.dataset, config.channels_last), train_set.labels[idx]
                lr = lr_at(progress.step - schedule_offset, total_steps, config.lr)
                loss = train_step(model, optimizer, lr, x, y, config.amp, config.label_smoothing)
                if average:
                    average.update(progress.step)
                loss_sum[0] += loss * len(idx)
                loss_sum[1] += len(idx)
                trained += len(idx)
                progress.step, progress.step_in_epoch = progress.step + 1, k + 1
                if rt.is_main and interrupt_step and progress.step == int(interrupt_step):
                    os.kill(os.getpid(), getattr(signal, f"SIG{interrupt_signal}"))
                # The ranks agree on the previous step while this one runs: a stop lands one step
                # after its signal, on every rank alike, and no step waits for the host.
                earlier = read_agreement(pending) if pending else Verdict()
                pending = start_agreement(stop, loss, ckpt_clock, rt)
                if earlier.diverged:  # before any checkpoint could take the bad weights
                    raise diverged("the loss stopped being finite", progress.step - 1)
                logger.step(progress.step, loss, progress.epoch, k + 1, steps_per_epoch)
                if earlier.stopping or earlier.ckpt_due or (config.ckpt_every and progress.step % config.ckpt_every == 0):
                    now = this_step()  # saving waits for the step anyway
                    path = checkpoint()
                    if earlier.stopping or now.stopping:
                        code = stop_here(path)
                        return code
            if pending and this_step().stopping:  # the epoch's last step
                code = stop_here(checkpoint())
                return code
            # A checkpoint saved at this very step before its evaluation (a stop at the
            # epoch's last step, a crash during the evaluation) is evaluated now; one saved
            # after it (at the --max-steps cap) is not evaluated twice.
            if progress.last_record.get("step") != progress.step:
                evaluate_here(started, trained)
            if progress.step_in_epoch >= steps_per_epoch:  # not when the cap stopped it in mid-epoch
                progress.epoch, progress.step_in_epoch = progress.epoch + 1, 0
                loss_sum.zero_()
            path = checkpoint()
            # A stop asked for during the evaluation; after the last one, finishing is quicker.
            now = read_agreement(start_agreement(stop, torch.zeros((), device=rt.device), ckpt_clock, rt))
            if now.stopping and not run_is_done(progress, config):
                code = stop_here(path)
                return code

        # Finished: the weights evaluated go to model.pt, and then a checkpoint says so, so
        # that running the same command again finds nothing left to do. (A run stopped at its
        # very last step, or at the cap, before the evaluation, evaluates here.)
        if progress.last_record.get("step") != progress.step:
            evaluate_here(time.perf_counter(), 0)
            checkpoint()
        record = progress.last_record
        if rt.is_main:
            save_atomic(eval_model.state_dict(), run_dir / "model.pt")
            print(f"saved {run_dir / 'model.pt'}; final test accuracy {100 * record['test_accuracy']:.2f}%", flush=True)
        progress.finished = True
        checkpoint()
        logger.finish({k: record[k] for k in ("test_accuracy", "test_loss", "train_loss")}, progress.step)
        code = 0
        return code
    except UsageError as err:
        code = fail(err, who=who)
        return code
    except Diverged as err:
        code = fail(err, EXIT_DIVERGED, who)
        return code
    except KeyboardInterrupt:  # Ctrl-C before training started: nothing to save
        code = fail("interrupted (Ctrl-C) before training started; nothing was saved", 128 + signal.SIGINT, who)
        return code
    except Exception as err:
        if is_lost_peer(err):
            code = fail(lost_peer_message(err, progress), EXIT_LOST_PEER, who)
        elif problem := storage_problem(err, config):
            code = fail(problem, who=who)
        else:
            traceback.print_exc()
            code = fail(f"unexpected {type(err).__name__} (the traceback above): not restarted, as it would happen again",
                        EXIT_BUG, who)
        return code
    finally:
        record_exit(code, launch)  # first: after a failure, srun may end this process any moment now
        with contextlib.suppress(OSError):  # a full disk: the one line above says so already
            logger.close()
        if claim:
            claim.release(code)
        teardown_distributed()
        stop.restore()


if __name__ == "__main__":
    sys.exit(exit_status(main()))
