#!/usr/bin/env python3
"""mnist-ddp: data-parallel training of a small CNN on MNIST (or your own image folder)
with PyTorch DDP, launched by hand, by torchrun or by Slurm's srun.

This file is the recipe, the part you adapt: options, data, model, schedule, training
step, evaluation and the training loop. The machinery it stands on (launch environment,
process group, staging, checkpoints, agreement and recovery, logging, exit codes) is the
ddpkit/ package beside it, which this file reaches through one face, ddpkit/api.py (its
`kit.` names); keep the two together.

What it does
  * works out rank, local rank and world size from torchrun's variables, else from
    Slurm's (SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS, the node list), else runs as
    one process; NCCL on GPUs, Gloo on CPUs;
  * lets the first rank of each node stage the data set behind a barrier and a lease
    that holds on shared storage (NFS, Lustre, GPFS, whatever their lock options: see
    docs/clusters.md, "Shared storage"), then trains from the whole split held
    in memory as one uint8 tensor, or streams it with a DataLoader when it does not fit;
  * trains on your own images with no code change: --dataset folder --data-dir DIR reads
    DIR/train/<class>/*.png|jpg and DIR/test/<class>/* (one size, 1 or 3 channels), and
    --mirror-images says they may be mirrored left to right;
  * trains a small CNN whose first layer is fixed to the whitening of the training images,
    on images shifted by a pixel and, where the data set allows it, mirrored, and scores
    an average of its weights (each default, and why: docs/defaults.md);
  * evaluates exactly (every test image counted once, for any world size) and logs to
    stdout, metrics.jsonl and TensorBoard in one run directory per job.

What it reaches
  measured on Intel(R) Xeon(R) Processor, 2 cores, 24 GiB, no GPU; 2026-11-28; the
  method and every figure: docs/benchmark.md
  * the bundled 4,000-image MNIST sample, defaults (8 epochs, 1 process): 97.3-97.6 %
    test accuracy (seeds 0-2), ~10 s a run;
  * full Fashion-MNIST, defaults: 90.1 % after the first epoch, 93.2 % after the last,
    epoch 8 (evaluated with the --ema average of the weights); it reaches 90 % 26.7x
    sooner than the usual DataLoader + ToTensor example loop, from process start (10.2 s
    against 272.4 s);
  * full Fashion-MNIST, defaults, from 1, 2 or 4 ranks, the global batch split among
    them: 90.09-90.33 % after the first epoch, 93.05-93.24 % after the last.

How to launch
  python mnist_ddp.py                                    # one process, bundled sample
  python mnist_ddp.py --dataset mnist --download-only    # stage MNIST (login node)
  python mnist_ddp.py --dataset folder --data-dir ~/my-images   # your own images
  torchrun --standalone --nproc-per-node 2 mnist_ddp.py --dataset fashion-mnist
  srun --ntasks 2 python mnist_ddp.py                    # inside an allocation
  sbatch run_training.sbatch --epochs 3                  # Slurm batch job
  RUN_NAME=lr3e-3 sbatch run_training.sbatch             # a named run: resubmitting continues it

A run lives in LOG_DIR/RUN_NAME (--run-name; default job-<SLURM_JOB_ID>, else a timestamp).
Checkpoints go to its checkpoints/ (atomic, last --keep-ckpts kept); --resume auto (the
default) continues from the newest valid one, so the same command with the same run name,
or a requeued Slurm job, carries on where it stopped. --allow-changes lets it carry on with
more --epochs or another --lr. SIGUSR1, SIGTERM or SIGHUP: save at the next step, requeue
the Slurm job (run_training.sbatch: on its SIGNAL, USR1 by default), exit; Ctrl-C: save at
the next step and exit. Under Slurm the same save, requeue and exit comes --stop-before
minutes ahead of the job's time limit, with no signal; after its first epoch a run says
whether it fits in the job's time. One run of a name runs at a time (a second one exits
2). A rank that dies or hangs makes the others exit with code 4 within --dist-timeout;
run_training.sbatch then restarts the job from the newest checkpoint.

Exit codes
   0  done
   1  unexpected error (a traceback above it): a bug, which a restart would repeat
   2  a problem you can fix: one line on stderr says what to do
   3  the loss or the weights stopped being finite; nothing bad was saved (the line says
      how to resume with a lower --lr)
   4  lost contact with another rank (it died, or hung past --dist-timeout), or waited
      that long for the data directory's lock; the line names the operation and the
      step, or the lock's holder. Nothing saved is lost: run it again, as
      run_training.sbatch does by itself (MAX_RESTARTS)
   5  a fault of this rank's node's GPU (ECC, NVLink, a busy device), from CUDA or NCCL;
      run it again, as run_training.sbatch does, which leaves out a node that two
      failures were pinned on
  75  stopped by SIGUSR1/SIGTERM/SIGHUP/Ctrl-C, or ahead of the time limit, after saving a
      checkpoint; the line says how to continue
      (under Slurm with --requeue the job has requeued itself)
 130  Ctrl-C before training started: nothing to save
"""

# The stop signals are caught before torch loads (seconds on shared storage): one may come
# while it loads, or while ranks wait for each other (a requeued job gets its time-limit
# signal again), and would otherwise kill the process before anything can be saved. A Ctrl-C
# while it loads ends the process at once, in one line.
import sys

try:
    from ddpkit import launch
except ModuleNotFoundError as missing:  # this file was copied without the package beside it
    if missing.name != "ddpkit":
        raise
    print("mnist_ddp.py: error: cannot import ddpkit, the package this script runs on; keep the ddpkit/ folder beside "
          "mnist_ddp.py (copy both)", file=sys.stderr)
    sys.exit(2)
except KeyboardInterrupt:  # a Ctrl-C before the stop signals are caught: nothing to save
    print("mnist_ddp.py: error: interrupted (Ctrl-C) before training started; nothing was saved", file=sys.stderr)
    sys.exit(130)
STOP_SIGNALS = launch.StopSignals(loading=True) if __name__ == "__main__" else None

import math  # (after the stop signals, on purpose: see above)
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from ddpkit import api as kit

# ----------------------------------------------------------------------------- options

# Each data set, and whether its images may be mirrored left to right (a mirrored shoe is a
# shoe; a mirrored 3 is no digit): a folder of your own says so with --mirror-images.
DATASETS = {"mnist-sample": False, "mnist": False, "fashion-mnist": True, "folder": None}
MODELS = ("cnn", "mlp", "resnet18")
# The data order's generators are seeded with seed * 100_003 + epoch (epoch_shard,
# epoch_moves), which torch takes as a 64-bit integer; 10**13 leaves room to spare.
SEED_LIMIT = 10**13


@dataclass(frozen=True)
class Recipe:
    """The options that set the course of training: a checkpoint resumes only a run with the
    same ones, except those marked changeable, which may differ with --allow-changes. The
    machinery's options (data directories, devices, output, checkpoints) are the kit's
    RunOptions; --help lists both. The kit reads global_batch, batch_size, epochs, max_steps
    and lr by name: keep those."""
    dataset: str = kit.option("mnist-sample", "mnist-sample is the bundled 4,000/1,000-image MNIST sample (offline); folder "
                              "is your own images in --data-dir (DIR/train/<class>/*, DIR/test/<class>/*)", "data",
                              choices=tuple(DATASETS))
    mirror_images: bool = kit.option(False, "--dataset folder: its images may be mirrored left to right", "data")
    model: str = kit.option("cnn", "network to train", "training", choices=MODELS)
    epochs: int = kit.option(8, "passes over the training set", "training", changeable=True)
    global_batch: int = kit.option(128, "images per optimiser step over all ranks, split evenly among them, so that 1 or 16 "
                                   "ranks train the same model", "training")
    batch_size: int = kit.option(0, "images per step per rank instead (weak scaling): the global batch grows with the ranks, "
                                 "and --lr should grow with it (docs/defaults.md) (0: --global-batch / ranks)", "training")
    lr: float = kit.option(3e-3, "peak learning rate of the one-cycle schedule (AdamW)", "training", changeable=True)
    warmup: float = kit.option(0.02, "fraction of the steps over which the learning rate rises from --lr/10", "training")
    weight_decay: float = kit.option(5e-4, "AdamW weight decay", "training", changeable=True)
    dropout: float = kit.option(0.0, "dropout before the classifier (cnn, mlp)", "training")
    label_smoothing: float = kit.option(0.1, "label smoothing of the training loss (the test loss stays plain "
                                        "cross-entropy)", "training")
    shift: float = kit.option(0.25, "fraction of the training images moved by one pixel in a random direction, drawn afresh "
                              "each epoch (0: no augmentation)", "training")
    whiten: bool = kit.option(True, "the cnn's first filters: the whitening of the training images, fixed", "training")
    ema: float = kit.option(0.99, "decay of an exponential moving average of the weights, which evaluation and model.pt use "
                            "(0: off)", "training")
    seed: int = kit.option(0, "seed of weights and data order, the same on every rank", "training")
    max_steps: int = kit.option(0, "stop after this many optimiser steps in all (0: no limit); for smoke runs", "training",
                                changeable=True)

    def check(self) -> None:
        kit.need(self.epochs >= 1, f"--epochs must be at least 1, got {self.epochs}")
        kit.need(self.global_batch >= 1, f"--global-batch must be at least 1, got {self.global_batch}")
        kit.need(self.batch_size >= 0, f"--batch-size must be 0 (from --global-batch) or more, got {self.batch_size}")
        # Either one sets the batch; with both, one would be ignored without a word.
        kit.need(not (self.batch_size and self.global_batch != type(self).global_batch),  # (the class holds the default)
                 f"--batch-size {self.batch_size} and --global-batch {self.global_batch} both set the batch; pass one: "
                 "--global-batch for the images per step over all ranks, --batch-size for the images per rank")
        kit.need(math.isfinite(self.lr) and self.lr > 0, f"--lr must be a positive number, got {self.lr}")
        kit.need(0 <= self.warmup <= 1, f"--warmup must be in [0, 1], got {self.warmup}")
        kit.need(math.isfinite(self.weight_decay) and self.weight_decay >= 0,
                 f"--weight-decay must be 0 or more, got {self.weight_decay}")
        kit.need(0 <= self.dropout < 1, f"--dropout must be in [0, 1), got {self.dropout}")
        kit.need(0 <= self.label_smoothing < 1, f"--label-smoothing must be in [0, 1), got {self.label_smoothing}")
        kit.need(0 <= self.shift <= 1, f"--shift must be in [0, 1], got {self.shift}")
        kit.need(0 <= self.ema < 1, f"--ema must be in [0, 1) (0: off), got {self.ema}")
        kit.need(-SEED_LIMIT <= self.seed <= SEED_LIMIT, f"--seed must be from -{SEED_LIMIT} to {SEED_LIMIT}, got {self.seed}")
        kit.need(self.max_steps >= 0, f"--max-steps must be 0 (no limit) or more, got {self.max_steps}")
        kit.need(self.dataset == "folder" or not self.mirror_images, f"--mirror-images is for --dataset folder; {self.dataset}'s "
                 "entry in DATASETS (mnist_ddp.py) says whether its images may be mirrored: drop --mirror-images")

    @property
    def mirrored(self) -> bool:
        """Whether training mirrors the images and evaluation scores both views: DATASETS says."""
        return self.mirror_images if self.dataset == "folder" else DATASETS[self.dataset]


# ----------------------------------------------------------------------------- data

def read_data(recipe: Recipe, options: kit.RunOptions, data_dir: Path, job: kit.Job) -> tuple[kit.ImageSet, kit.ImageSet]:
    """Both splits as uint8 images [N, C, H, W] with their labels and class names: held in
    memory on the device when they fit (the fast path), else streamed from their files by a
    DataLoader (--data-feed). Data of another kind: return two ImageSets from here."""
    return kit.read_splits(recipe.dataset, data_dir, options.data_feed, job.rt, job.launch.local_world_size)


def epoch_moves(n: int, epoch: int, seed: int, shift: float, mirror: bool) -> torch.Tensor | None:
    """[2, n] int64, each training image's move this epoch: (down, right) in {-1, 0, 1}, a
    `shift` fraction of them moved one pixel in one of the 8 directions. With `mirror`, a
    third row, 1 where the image is mirrored left to right: in every other epoch, half of the
    images in the odd epochs and half in the even ones (alternating, not drawn afresh, so that
    two epochs show each image both ways). A function of (seed, epoch, image) alone, so any
    world size and any resume move an image alike."""
    if not shift and not mirror:
        return None
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch + 7_777_777)
    moved = torch.rand(n, generator=generator) < shift
    direction = torch.randint(0, 8, (n,), generator=generator)
    direction += direction >= 4  # 0..8 without 4, the middle of the 3 x 3 grid of moves
    odd = torch.rand(n, generator=torch.Generator().manual_seed(seed * 100_003 + 5_555_555)) < 0.5  # (every epoch alike)
    mirrored = [(odd ^ (epoch % 2 == 0)).long()] if mirror else []
    return torch.stack([(direction // 3 - 1) * moved, (direction % 3 - 1) * moved, *mirrored])


def epoch_shard(n: int, epoch: int, seed: int, *, rank: int, world_size: int, batch_size: int,
                steps: int) -> torch.Tensor:
    """This rank's training indices for one epoch of `steps` steps, batch_size of them a step.

    Position p of the epoch is image order[p % n] of a seeded permutation every rank
    draws alike. Step k's global batch is positions k * G to k * G + G - 1 (G = world_size *
    batch_size), and each rank takes every world_size-th of them from its own offset. So a
    global batch holds the same images on any number of ranks that split it: a run saved
    by N ranks goes on in mid-epoch on M. Past the n images (the run's epoch is ceil(n / G)
    steps), the epoch's first images fill the last global batch up, as DistributedSampler
    pads, so every step trains G images."""
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = torch.randperm(n, generator=generator)
    return order[torch.arange(rank, steps * world_size * batch_size, world_size) % n]


# ----------------------------------------------------------------------------- model

class SmallCNN(nn.Module):
    """A 5x5 and a 3x3 convolution, both of stride 2 (no pooling), a hidden layer of 128
    and a linear classifier: ~8x fewer multiply-adds per image than the 2-conv CNN of the
    PyTorch MNIST example, and more accurate in a few epochs. With `fixed_first` (--whiten)
    the first convolution does not train: build_training sets its filters to the whitening
    of the training images, and a step skips its gradient, which pays for the 32 channels it
    gives the second convolution (docs/defaults.md)."""

    def __init__(self, channels: int, height: int, width: int, classes: int, dropout: float, fixed_first: bool = False):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(channels, 32, 5, stride=2, padding=2), nn.ReLU(inplace=True),   # 32 x 14 x 14 for 28 x 28
            nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU(inplace=True),         # 64 x 7 x 7
        )
        self.features[0].requires_grad_(not fixed_first)
        h, w = ((height - 1) // 2) // 2 + 1, ((width - 1) // 2) // 2 + 1   # each stride-2 layer: (n - 1) // 2 + 1
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(64 * h * w, 128), nn.ReLU(inplace=True),
                                        nn.Dropout(dropout), nn.Linear(128, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def build_model(recipe: Recipe, shape: tuple[int, int, int], classes: int) -> nn.Module:
    """The --model network for images of `shape` (C, H, W) and `classes` classes."""
    channels, height, width = shape
    if recipe.model == "cnn":
        return SmallCNN(channels, height, width, classes, recipe.dropout, fixed_first=recipe.whiten)
    if recipe.model == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(channels * height * width, 512), nn.ReLU(inplace=True),
                             nn.Dropout(recipe.dropout), nn.Linear(512, 512), nn.ReLU(inplace=True),
                             nn.Dropout(recipe.dropout), nn.Linear(512, classes))
    if recipe.model == "resnet18":
        # For small images: a 3x3 stem of stride 1 and no max-pool, so 28x28 is not shrunk to 7x7 at once.
        import torchvision  # here, not at the top: importing it costs seconds that the other models need not wait

        net = torchvision.models.resnet18(num_classes=classes)
        net.conv1 = nn.Conv2d(channels, 64, 3, stride=1, padding=1, bias=False)
        net.maxpool = nn.Identity()
        return net
    # A name added to MODELS before its branch here: say so, rather than train another network under its name.
    raise kit.UsageError(f"--model {recipe.model} is in MODELS, but build_model has no branch that builds it: add one "
                         "that returns its nn.Module (docs/adapt.md)")


@dataclass
class Training:
    """The network and what trains it. One network: `model` is it, plain (checkpoints hold its
    weights); `wrapped` is the same network in DDP (and compiled, with --compile), which the
    training step runs; `average` (--ema) averages its weights. `scored` is what evaluation
    scores and model.pt holds."""
    model: nn.Module
    wrapped: nn.Module
    optimizer: torch.optim.Optimizer
    average: kit.WeightAverage | None
    scored: nn.Module  # the weights evaluation scores: the average's, with --ema


def build_training(recipe: Recipe, options: kit.RunOptions, rt: kit.Runtime, data: kit.ImageSet) -> Training:
    torch.manual_seed(recipe.seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = build_model(recipe, data.shape, len(data.classes))
    if recipe.whiten and recipe.model == "cnn" and rt.is_main:  # (DDP's wrapping, below, sends them to the other ranks)
        kit.whiten_first_layer(model.features[0], data, recipe.seed)
    model = model.to(rt.device)
    if options.channels_last:
        model = model.to(memory_format=torch.channels_last)
    wrapped = torch.compile(kit.wrap_ddp(model, rt)) if options.compile else kit.wrap_ddp(model, rt)
    average = kit.WeightAverage(model, recipe.ema) if recipe.ema else None
    torch.manual_seed(recipe.seed + rt.rank)  # dropout differs per rank, as its data does
    return Training(model, wrapped, build_optimizer(recipe, model), average, average.model if average else model)


def build_optimizer(recipe: Recipe, model: nn.Module) -> torch.optim.Optimizer:
    # beta2 0.99 instead of 0.999: the step sizes adapt within ~100 steps, not ~1,000 (docs/defaults.md).
    # fused: one pass over all the weights (on 2 CPU cores 0.5 ms instead of 1.4 ms, a tenth of the
    # step; on a GPU, one kernel). Any torch.optim optimizer also works here.
    return torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=(0.9, 0.99), weight_decay=recipe.weight_decay,
                             fused=True)


def lr_at(step: int, total_steps: int, peak: float, warmup_fraction: float) -> float:
    """One cycle: linear warm-up from peak/10 to peak over the first `warmup_fraction` of the
    steps (--warmup), then a cosine decay to peak/1e4 at the last step (docs/defaults.md says
    why). A pure function of the step, so a resumed run needs no scheduler state."""
    warmup = int(total_steps * warmup_fraction)  # (0: none)
    if step < warmup:
        return peak * (0.1 + 0.9 * step / warmup)
    progress = min(1.0, (step - warmup) / max(1, total_steps - 1 - warmup))
    return peak * (1e-4 + (1 - 1e-4) * 0.5 * (1 + math.cos(math.pi * progress)))


# ----------------------------------------------------------------------------- training step and evaluation

def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, lr: float, x: torch.Tensor, y: torch.Tensor,
               amp: bool = False, label_smoothing: float = 0.0) -> torch.Tensor:
    """One optimiser step at the schedule's `lr` (for --lr). A parameter group built with its own
    lr keeps its share of it: the lr a group is built with is its peak ("initial_lr", as torch's
    schedulers call it), scaled by lr over the optimizer's own lr (build_training gives it --lr:
    keep that, so a group without an lr of its own follows the schedule exactly); its own weight
    decay is left as it is."""
    for group in optimizer.param_groups:
        group["lr"] = lr * (group.setdefault("initial_lr", group["lr"]) / optimizer.defaults["lr"])
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=amp):
        loss = F.cross_entropy(model(x), y, label_smoothing=label_smoothing)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()  # DDP averages the gradients across ranks here
    optimizer.step()
    return loss.detach()


@dataclass(frozen=True)
class Evaluation:
    metrics: dict               # {name: mean over the test images}: "loss", "accuracy" and any added in evaluate
    count: int                  # test images counted: the whole test set, for any world size
    confusion: torch.Tensor     # [classes, classes] int64, rows true class, columns prediction, all ranks
    examples: dict              # rank 0's: {name: (uint8 images, predictions, true classes)} for TensorBoard


@torch.no_grad()
def evaluate(model: nn.Module, test_set: kit.ImageSet, options: kit.RunOptions, rt: kit.Runtime, mirrored: bool = False,
             batch_size: int = 200) -> Evaluation:
    """Loss, accuracy (and any metric added to `sums`) and confusion matrix over the whole test set.

    Each rank takes its own unpadded strided shard and runs the unwrapped model (no
    collectives inside); two all-reduces, of the sums and count and of the confusion matrix
    (whole numbers), then give exact global figures for any world size. Rank 0 also keeps a few examples to show.
    Batches of 200 keep the activations in the CPU's caches: 10,000 test images took 0.14 s
    on the benchmark's 2 cores, against 0.32 s in batches of 1,000 (docs/benchmark.md). With
    `mirrored` each image is scored by the mean of its logits and its mirror's: twice the
    forward passes (0.35 s and 0.7 s for 10,000 on the Intel Xeon's 2 cores)."""
    model.eval()
    n = len(test_set.classes)
    mine = torch.arange(rt.rank, len(test_set), rt.world_size, device=rt.device)
    # Sums over the test images, each reported as its mean: test_<name> in the epoch's line
    # and metrics.jsonl, test/<name> in TensorBoard. A metric of your own is a name here and
    # a line in the loop that adds to it.
    sums = {name: torch.zeros((), dtype=torch.float64, device=rt.device) for name in ("loss", "accuracy")}
    counted = torch.zeros((), dtype=torch.float64, device=rt.device)  # test images
    confusion = torch.zeros(n * n, dtype=torch.int64, device=rt.device)
    examples = kit.Examples(keep=32 if rt.is_main else 0)
    chunks = [mine[start: start + batch_size] for start in range(0, len(mine), batch_size)]
    for idx, (images, y) in zip(chunks, test_set.batches(chunks, rt.device, options.data_workers), strict=True):
        with torch.autocast(rt.device.type, dtype=torch.bfloat16, enabled=options.amp):
            x = kit.normalize(images, test_set.mean, test_set.std, options.channels_last)
            logits = (model(x) + model(x.flip(3))) / 2 if mirrored else model(x)  # (both views, when training saw both)
        pred = logits.argmax(1)
        sums["loss"] += F.cross_entropy(logits.float(), y, reduction="sum")
        sums["accuracy"] += (pred == y).sum()
        counted += len(idx)
        confusion += torch.bincount(y * n + pred, minlength=n * n)
        examples.add(idx, pred, y)
    model.train()
    totals = kit.all_reduce(torch.stack([counted, *sums.values()]), "the all-reduce of the test figures").tolist()
    kit.all_reduce(confusion, "the all-reduce of the test figures")
    count, metrics = totals[0], {name: total / totals[0] for name, total in zip(sums, totals[1:], strict=True)}
    confusion = confusion.view(n, n).cpu()
    return Evaluation(metrics, int(count), confusion, examples.shown(test_set))


# ----------------------------------------------------------------------------- the training loop

def train(run: kit.TrainingRun, job: kit.Job, training: Training, train_set: kit.ImageSet, test_set: kit.ImageSet) -> None:
    """Each epoch: this rank's shard in batches, one optimiser step each, then an evaluation
    of the (averaged) weights and a checkpoint. Every rank runs every line; `run` holds what
    each event costs (kit.TrainingRun). A stop ends the loop with kit.Stopped, and the job runner
    requeues the Slurm job or prints the command that continues the run."""
    recipe, options, rt, average = job.recipe, job.options, job.rt, training.average

    def evaluate_now() -> Evaluation:
        kit.sync_buffers(training.model)  # every rank scores with rank 0's BatchNorm statistics
        if average:
            average.copy_buffers(training.model)
        return evaluate(training.scored, test_set, options, rt, recipe.mirrored)

    while not run.done():
        epoch = run.epoch_begins()  # (a resumed epoch goes on at the step it stopped at)
        shard = epoch_shard(len(train_set), epoch, recipe.seed, rank=rt.rank, world_size=rt.world_size,
                            batch_size=run.plan.batch_size, steps=run.plan.steps_per_epoch).to(rt.device)
        moves = epoch_moves(len(train_set), epoch, recipe.seed, recipe.shift, recipe.mirrored)
        for images, y in train_set.batches(run.batches_left(shard), rt.device, options.data_workers, moves=moves):
            if run.done():  # the --max-steps cap, in mid-epoch
                break
            x = kit.normalize(images, train_set.mean, train_set.std, options.channels_last)
            lr = lr_at(*run.lr_position(), recipe.lr, recipe.warmup)  # (the schedule's step, of its steps in all)
            loss = train_step(training.wrapped, training.optimizer, lr, x, y, options.amp, recipe.label_smoothing)
            if average:
                average.update(run.progress.step)
            run.step_done(loss, len(y))  # counted and logged; the ranks agree on it while the next step runs
            if run.checkpoint_due():  # every --ckpt-every steps or --ckpt-minutes, and before a stop
                saved = run.checkpoint()
                if run.stop_already_agreed():  # a signal, or the job's time limit near, on any rank: all stop here
                    raise kit.Stopped(saved)
        if run.evaluation_due():  # (once per step: not again after a resume from a checkpoint of this step)
            run.evaluate(evaluate_now)
        run.epoch_done()  # the next epoch starts (not at the --max-steps cap, in mid-epoch)
        saved = run.checkpoint()
        run.estimate_time_left()  # (after the first epoch) whether the run fits in the job's time
        if run.all_ranks_vote_on_stop() and not run.done():  # a stop asked for during the evaluation; finishing is quicker
            raise kit.Stopped(saved)
    run.finish(evaluate_now, training.scored)


# ----------------------------------------------------------------------------- main

def prepare_and_train(job: kit.Job) -> None:
    """This process's part of the job: data, model, the run (resumed where it stopped), the loop."""
    recipe, options, rt = job.recipe, job.options, job.rt
    with job.startup.phase("data"):  # (for the `ready in` line at the first step)
        data_dir = kit.stage_data(options, recipe.dataset, rt)
        if options.download_only:
            print(f"[rank {rt.rank}] {recipe.dataset} is ready in {data_dir}")
            return
        kit.split_batch(recipe.global_batch, rt.world_size, recipe.batch_size)  # (one that does not split stops here)
        train_set, test_set = read_data(recipe, options, data_dir, job)
    training = build_training(recipe, options, rt, train_set)
    averaged = training.average.model if training.average else None  # (the --ema weights, saved with the rest)
    run = job.start_run({"model": training.model, "optimizer": training.optimizer, "average": averaged}, train_set,
                        on_divergence={"lr": f"{recipe.lr / 3:.3g}"})
    train(run, job, training, train_set, test_set)


def main(argv: list[str] | None = None) -> int:
    """Run this process's part of the job; returns the exit code (see the manual above)."""
    return kit.run_job(prepare_and_train, Recipe, argv, manual=__doc__, stop=STOP_SIGNALS,
                       step_parts=kit.StepParts(build_model, build_optimizer, train_step))


if __name__ == "__main__":
    sys.exit(kit.exit_status(main()))
