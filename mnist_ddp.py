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

What it reaches (measured; see README.md "Figures" for the machine and the commands)
  * bundled 4,000-image MNIST sample, defaults (8 epochs, 1 process): 95.8-96.3 % test
    accuracy (seeds 0-2) in ~10 s on 2 CPU cores;
  * full Fashion-MNIST, defaults: 90.1 % after 4 epochs, 91.2 % after 8 (~6 s an epoch).

How to launch
  python mnist_ddp.py                                    # one process, bundled sample
  python mnist_ddp.py --dataset mnist --download-only    # stage MNIST (login node)
  torchrun --standalone --nproc-per-node 2 mnist_ddp.py --dataset fashion-mnist
  srun --ntasks 2 python mnist_ddp.py                    # inside an allocation
  sbatch run_training.sbatch --epochs 3                  # Slurm batch job

Exit codes: 0 done, 1 unexpected error (traceback), 2 a problem you can fix (one line
on stderr that says what to do).
"""

import argparse
import contextlib
import dataclasses
import fcntl
import io
import json
import math
import os
import platform
import re
import socket
import sys
import shutil
import tempfile
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Mapping

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.summary import hparams as hparams_summary
from torchvision.datasets import MNIST, FashionMNIST
from torchvision.datasets.utils import check_integrity

PROG = "mnist_ddp.py"
HERE = Path(__file__).resolve().parent
EXIT_USAGE = 2


class UsageError(Exception):
    """A problem the user can fix: printed as one line on stderr, exit code 2."""


# ----------------------------------------------------------------------------- config

DATASETS = ("mnist-sample", "mnist", "fashion-mnist")
MODELS = ("cnn", "mlp", "resnet18")


@dataclass(frozen=True)
class Config:
    # data
    dataset: str = field(default="mnist-sample", metadata={
        "choices": DATASETS, "help": "mnist-sample is the bundled 4,000/1,000-image MNIST sample (offline)"})
    data_dir: str = field(default="data", metadata={
        "help": "data directory, on shared storage for multi-node jobs; files go to DATA_DIR/<Name>/raw"})
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
    seed: int = field(default=0, metadata={"help": "seed of weights and data order, the same on every rank"})
    max_steps: int = field(default=0, metadata={"help": "stop after this many optimiser steps in all (0: no limit); for smoke runs"})
    # distributed
    backend: str = field(default="auto", metadata={"choices": ("auto", "gloo", "nccl"), "help": "auto: nccl on CUDA, else gloo"})
    device: str = field(default="auto", metadata={"choices": ("auto", "cpu", "cuda"), "help": "auto: cuda when available"})
    dist_timeout: float = field(default=300.0, metadata={"help": "seconds a collective may wait for a missing rank before the job fails"})
    # output
    log_dir: str = field(default="runs", metadata={"help": "directory that holds one run directory per job (shared storage)"})
    run_dir: str = field(default="", metadata={"help": "this run's directory (default: LOG_DIR/job-<SLURM_JOB_ID>, else LOG_DIR/<timestamp>)"})
    log_every: int = field(default=50, metadata={"help": "log the training loss to TensorBoard every N steps"})


class OneLineErrorParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UsageError(f"{message} (see --help)")


def build_parser() -> argparse.ArgumentParser:
    """Derive the CLI from Config: one kebab-case flag per field, default shown in --help."""
    parser = OneLineErrorParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(Config):
        flag = "--" + f.name.replace("_", "-")
        if f.type is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=f.metadata["help"])
        else:
            parser.add_argument(flag, type=f.type, default=f.default, choices=f.metadata.get("choices"),
                                help=f.metadata["help"], metavar=f.name.upper() if "choices" not in f.metadata else None)
    return parser


def check_config(c: Config) -> None:
    def need(ok: bool, message: str) -> None:
        if not ok:
            raise UsageError(message)

    need(c.epochs >= 1, f"--epochs must be at least 1, got {c.epochs}")
    need(c.batch_size >= 1, f"--batch-size must be at least 1, got {c.batch_size}")
    need(math.isfinite(c.lr) and c.lr > 0, f"--lr must be a positive number, got {c.lr}")
    need(math.isfinite(c.weight_decay) and c.weight_decay >= 0, f"--weight-decay must be 0 or more, got {c.weight_decay}")
    need(0 <= c.dropout < 1, f"--dropout must be in [0, 1), got {c.dropout}")
    need(c.max_steps >= 0, f"--max-steps must be 0 (no limit) or more, got {c.max_steps}")
    need(math.isfinite(c.dist_timeout) and c.dist_timeout > 0, f"--dist-timeout must be a positive number of seconds, got {c.dist_timeout}")
    need(c.log_every >= 1, f"--log-every must be at least 1, got {c.log_every}")
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
        launch = Launch("torchrun", _int_var(env, "RANK"), _int_var(env, "LOCAL_RANK"), _int_var(env, "WORLD_SIZE"),
                        env["MASTER_ADDR"], _int_var(env, "MASTER_PORT"), job_id, num_threads)
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
        launch = Launch("slurm", _int_var(env, "SLURM_PROCID"), _int_var(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0,
                        ntasks, master_addr, master_port, job_id, num_threads)
    else:
        launch = Launch("single", 0, 0, 1, "127.0.0.1", 0, job_id, num_threads)

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


def pick_device(config: Config, launch: Launch) -> tuple[torch.device, str]:
    cuda = torch.cuda.is_available()
    if (config.device == "cuda" or config.backend == "nccl") and not cuda:
        flag = "--device cuda" if config.device == "cuda" else "--backend nccl"
        raise UsageError(f"{flag} needs a CUDA GPU but torch sees none (CUDA_VISIBLE_DEVICES="
                         f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); use --device cpu --backend gloo, or ask Slurm for a GPU")
    use_cuda = config.device == "cuda" or (config.device == "auto" and cuda)
    # Several tasks per node share the node's GPUs round-robin; one task per GPU is the norm.
    device = torch.device("cuda", launch.local_rank % torch.cuda.device_count()) if use_cuda else torch.device("cpu")
    backend = config.backend if config.backend != "auto" else ("nccl" if use_cuda else "gloo")
    return device, backend


def init_distributed(config: Config, launch: Launch) -> Runtime:
    device, backend = pick_device(config, launch)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before the process group, so NCCL binds the right GPU
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


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_ranks_agree(ok: bool, rt: Runtime) -> bool:
    """True when `ok` holds on every rank; doubles as a barrier."""
    flag = torch.tensor([0 if ok else 1], device=rt.device)
    return all_reduce_sum(flag).item() == 0


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


def stage_dataset(cls: type[MNIST], data_dir: Path) -> bool:
    """Make DATA_DIR/<Name>/raw hold the unpacked files; True if it had to download them.

    A file lock in the data directory makes concurrent jobs (and nodes sharing an NFS
    data directory) take turns. Files are downloaded and checked in a private staging
    directory and then renamed into place, so a reader never sees half a file and a
    crash mid-download leaves nothing behind that looks complete."""
    raw = data_dir / cls.__name__ / "raw"
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        lock_file = open(data_dir / ".mnist_ddp.lock", "a")
    except OSError as err:
        raise UsageError(f"cannot write to --data-dir {data_dir} ({err.strerror}); pass a writable --data-dir") from None
    with lock_file:
        fcntl.lockf(lock_file, fcntl.LOCK_EX)  # POSIX locks also work across NFS clients
        if all((raw / name).is_file() for name in raw_files(cls)):
            return False
        chatter = io.StringIO()
        try:
            with tempfile.TemporaryDirectory(dir=data_dir, prefix=".staging-") as staging:
                copy_from_file_mirror(cls, Path(staging, cls.__name__, "raw"))
                with contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
                    cls(staging, train=True, download=True)
                raw.mkdir(parents=True, exist_ok=True)
                for name in raw_files(cls):
                    os.replace(Path(staging, cls.__name__, "raw", name), raw / name)
        except (RuntimeError, OSError) as err:
            lines = [line.strip() for line in str(err).splitlines() + chatter.getvalue().splitlines() if line.strip()]
            reason = lines[-1] if lines else type(err).__name__
            names = ", ".join(name for name, _ in cls.resources)
            raise UsageError(f"cannot download {cls.__name__} into {raw} ({reason}). Put {names} (or the unpacked files) "
                             f"there, e.g. run `python {PROG} --dataset ... --download-only` on a machine with internet, "
                             "or pass --data-mirror URL or --data-dir DIR") from None
    return True


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
    shared one, the lock lets only the first of them download."""
    cls, data_dir = dataset_class(config), Path(config.data_dir)
    error = ""
    if rt.local_rank == 0:
        try:
            if stage_dataset(cls, data_dir):
                print(f"[rank {rt.rank}] staged {cls.__name__} in {data_dir / cls.__name__ / 'raw'}", flush=True)
        except UsageError as err:
            error = str(err)
    if not all_ranks_agree(not error, rt):
        raise UsageError(error or "another rank could not stage the data set; see its error above")
    return load_split(cls, data_dir, True, rt.device), load_split(cls, data_dir, False, rt.device)


def normalize(images: torch.Tensor, dataset: str) -> torch.Tensor:
    """uint8 [B, 28, 28] -> float [B, 1, 28, 28], standardised; runs per batch on the device."""
    mean, std = DATASET_STATS[dataset]
    return images.unsqueeze(1).float().sub_(255 * mean).div_(255 * std)


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
    """Two 3x3 conv blocks and a linear classifier: ~20x fewer multiply-adds per image than
    the 2-conv CNN of the PyTorch MNIST example, and as accurate in a few epochs."""

    def __init__(self, dropout: float):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 5, stride=2, padding=2), nn.ReLU(inplace=True),   # 32 x 14 x 14
            nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU(inplace=True),  # 64 x 7 x 7
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Dropout(dropout), nn.Linear(64 * 7 * 7, 10))

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


def build_optimizer(config: Config, model: nn.Module, total_steps: int):
    """AdamW with a one-cycle schedule: linear warm-up over the first 10 % of the steps,
    then a cosine decay to zero at the last step (README "Defaults" says why)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=config.lr, total_steps=total_steps + 1,
                                                    pct_start=0.1, anneal_strategy="cos", div_factor=10,
                                                    final_div_factor=1e3, cycle_momentum=False)
    return optimizer, scheduler


# ----------------------------------------------------------------------------- train and eval steps

def train_step(model: nn.Module, optimizer, scheduler, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.cross_entropy(model(x), y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()  # DDP averages the gradients across ranks here
    optimizer.step()
    scheduler.step()
    return loss.detach()


@torch.no_grad()
def evaluate(model: nn.Module, split: Split, dataset: str, rt: Runtime, batch_size: int = 1000) -> tuple[float, float, int]:
    """(mean loss, accuracy, images counted) over the whole test set.

    Each rank takes its own unpadded strided shard and runs the unwrapped model (no
    collectives inside); one all-reduce of (loss sum, correct, count) then gives the
    exact global figures for any world size."""
    model.eval()
    mine = torch.arange(rt.rank, len(split.labels), rt.world_size, device=rt.device)
    sums = torch.zeros(3, dtype=torch.float64, device=rt.device)
    for start in range(0, len(mine), batch_size):
        idx = mine[start: start + batch_size]
        logits, y = model(normalize(split.images[idx], dataset)), split.labels[idx]
        sums[0] += F.cross_entropy(logits.float(), y, reduction="sum")
        sums[1] += (logits.argmax(1) == y).sum()
        sums[2] += len(idx)
    model.train()
    loss_sum, correct, count = all_reduce_sum(sums).tolist()
    return loss_sum / count, correct / count, int(count)


# ----------------------------------------------------------------------------- checkpoints

def save_atomic(obj, path: Path) -> None:
    """Write to a temporary file beside `path`, fsync, then rename over it: a crash
    mid-write leaves the previous file intact (rename is atomic on POSIX and NFS)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- logging

def choose_run_dir(config: Config, launch: Launch) -> Path:
    """One directory per run: the Slurm job id when there is one (a requeued job finds its
    own directory again), else a timestamp chosen on rank 0 and shared with the others."""
    if config.run_dir:
        return Path(config.run_dir)
    if launch.job_id:
        return Path(config.log_dir, f"job-{launch.job_id}")
    name = ""
    if launch.rank == 0:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        name, n = stamp, 1
        while Path(config.log_dir, name).exists():
            n += 1
            name = f"{stamp}-{n}"
    return Path(config.log_dir, broadcast_from_main(name))


def describe_environment(rt: Runtime, launch: Launch, hosts: list[str]) -> dict:
    env = {
        "python": platform.python_version(), "torch": torch.__version__, "torchvision": torchvision.__version__,
        "launcher": launch.source, "world_size": rt.world_size, "backend": rt.backend, "device": str(rt.device),
        "hosts": sorted(set(hosts)), "master": f"{launch.master_addr}:{launch.master_port}" if rt.world_size > 1 else "",
        "slurm_job_id": launch.job_id, "cpu_threads_per_rank": torch.get_num_threads(),
    }
    if rt.device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(rt.device)
    return env


def markdown_table(d: dict) -> str:
    return "| key | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in d.items())


class RunLogger:
    """Rank 0's output: stdout lines, RUN_DIR/metrics.jsonl and TensorBoard events."""

    def __init__(self, run_dir: Path, config: Config, environment: dict):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir = run_dir
        self.writer = SummaryWriter(str(run_dir))
        self.metrics = open(run_dir / "metrics.jsonl", "a")
        self.show_progress = sys.stdout.isatty()
        self.writer.add_text("config", markdown_table(dataclasses.asdict(config)))
        self.writer.add_text("environment", markdown_table(environment))
        self.writer.flush()
        print(f"config: {json.dumps(dataclasses.asdict(config))}")
        print(f"environment: {json.dumps(environment)}")
        print(f"TensorBoard logs: {run_dir}  (view: tensorboard --logdir {run_dir.parent})", flush=True)

    def step(self, step: int, loss: torch.Tensor, epoch: int, step_in_epoch: int, steps_per_epoch: int) -> None:
        self.writer.add_scalar("train/batch_loss", loss.item(), step)
        if self.show_progress:
            print(f"\repoch {epoch} step {step_in_epoch}/{steps_per_epoch} loss {loss.item():.4f}", end="", flush=True)

    def epoch(self, record: dict) -> None:
        if self.show_progress:
            print("\r\033[K", end="")
        print(f"epoch {record['epoch']:3d} | train loss {record['train_loss']:.4f} | test loss {record['test_loss']:.4f} "
              f"| test acc {100 * record['test_accuracy']:6.2f}% | lr {record['lr']:.2e} "
              f"| {record['images_per_s']:8.0f} img/s | {record['epoch_s']:6.2f} s", flush=True)
        self.metrics.write(json.dumps(record) + "\n")
        self.metrics.flush()
        step = record["step"]
        for tag, key in (("train/loss", "train_loss"), ("test/loss", "test_loss"), ("test/accuracy", "test_accuracy"),
                         ("train/lr", "lr"), ("speed/images_per_s", "images_per_s"), ("speed/epoch_s", "epoch_s")):
            self.writer.add_scalar(tag, record[key], step)
        self.writer.flush()  # per epoch, not per step: cheap and TensorBoard stays current

    def finish(self, config: Config, final: dict) -> None:
        hparams = {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in dataclasses.asdict(config).items()}
        metrics = {f"final/{k}": v for k, v in final.items()}
        for summary in hparams_summary(hparams, metrics):
            self.writer.file_writer.add_summary(summary)
        for tag, value in metrics.items():
            self.writer.add_scalar(tag, value, 0)
        self.close()

    def close(self) -> None:
        self.writer.close()
        self.metrics.close()


class NullLogger:
    """What ranks other than 0 log: nothing, so call sites never branch on rank."""

    def step(self, *args) -> None: ...
    def epoch(self, record: dict) -> None: ...
    def finish(self, config: Config, final: dict) -> None: ...
    def close(self) -> None: ...


# ----------------------------------------------------------------------------- main

def fail(err: UsageError) -> int:
    print(f"{PROG}: error: {err}", file=sys.stderr, flush=True)
    return EXIT_USAGE


def main(argv: list[str] | None = None) -> int:
    try:
        config = parse_config(argv)
        launch = read_launch_env(os.environ)
        rt = init_distributed(config, launch)
    except UsageError as err:
        return fail(err)
    logger = NullLogger()
    try:
        train_set, test_set = prepare_data(config, rt)
        if config.download_only:
            print(f"[rank {rt.rank}] {config.dataset} is ready in {config.data_dir}")
            return 0
        run_dir = choose_run_dir(config, launch)
        hosts = [socket.gethostname()] * rt.world_size
        if dist.is_initialized():
            dist.all_gather_object(hosts, socket.gethostname())
        if rt.is_main:
            logger = RunLogger(run_dir, config, describe_environment(rt, launch, hosts))

        torch.manual_seed(config.seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
        raw_model = build_model(config).to(rt.device)
        model = raw_model
        if rt.world_size > 1:
            model = DistributedDataParallel(raw_model, device_ids=[rt.device.index] if rt.device.type == "cuda" else None)
        torch.manual_seed(config.seed + rt.rank)  # dropout differs per rank, as its data does

        per_rank = len(train_set.labels) // rt.world_size
        steps_per_epoch = math.ceil(per_rank / config.batch_size)
        total_steps = config.epochs * steps_per_epoch
        if config.max_steps:
            total_steps = min(total_steps, config.max_steps)
        optimizer, scheduler = build_optimizer(config, raw_model, total_steps)
        print(f"[rank {rt.rank}/{rt.world_size}] {socket.gethostname()} {rt.device} {rt.backend}: "
              f"{per_rank} images, {steps_per_epoch} steps per epoch", flush=True)
        if rt.is_main:
            print(f"global batch {config.batch_size * rt.world_size} ({rt.world_size} x {config.batch_size}), "
                  f"{total_steps} steps in all", flush=True)

        step, record = 0, {}
        for epoch in range(1, config.epochs + 1):
            if step >= total_steps:
                break
            started = time.perf_counter()
            shard = epoch_shard(len(train_set.labels), epoch, config.seed, rt.rank, rt.world_size).to(rt.device)
            loss_sum = torch.zeros(2, dtype=torch.float64, device=rt.device)  # (sum of losses, images) on this rank
            for start in range(0, per_rank, config.batch_size):
                idx = shard[start: start + config.batch_size]
                x, y = normalize(train_set.images[idx], config.dataset), train_set.labels[idx]
                loss = train_step(model, optimizer, scheduler, x, y)
                loss_sum[0] += loss * len(idx)
                loss_sum[1] += len(idx)
                step += 1
                if step % config.log_every == 0:
                    logger.step(step, loss, epoch, start // config.batch_size + 1, steps_per_epoch)
                if step >= total_steps:
                    break
            if rt.device.type == "cuda":
                torch.cuda.synchronize(rt.device)
            train_seconds = time.perf_counter() - started
            train_loss_sum, images = all_reduce_sum(loss_sum).tolist()
            test_loss, test_accuracy, test_images = evaluate(raw_model, test_set, config.dataset, rt)
            record = {"epoch": epoch, "step": step, "train_loss": train_loss_sum / images, "test_loss": test_loss,
                      "test_accuracy": test_accuracy, "test_images": test_images, "lr": optimizer.param_groups[0]["lr"],
                      "images_per_s": images / train_seconds, "epoch_s": time.perf_counter() - started}
            logger.epoch(record)

        if rt.is_main:
            save_atomic(raw_model.state_dict(), run_dir / "model.pt")
            print(f"saved {run_dir / 'model.pt'}; final test accuracy {100 * record['test_accuracy']:.2f}%", flush=True)
        logger.finish(config, {"test_accuracy": record["test_accuracy"], "test_loss": record["test_loss"],
                               "train_loss": record["train_loss"]})
        return 0
    except UsageError as err:
        return fail(err)
    finally:
        logger.close()
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main())
