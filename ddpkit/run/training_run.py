"""The training run as the loop sees it. mnist_ddp.train shows each event of the loop as a
line (a step done, a checkpoint when one is due, a stop when every rank agreed to one, an
evaluation, the epoch's end); TrainingRun holds what each one costs: the run's Progress and
loss sums, the one-step-late agreement between the ranks, the checkpoint files, the stop's
reasons (a signal, or the job's time limit near), the epoch's record, the run's log, and
after the first epoch whether the run fits in the job's time and whether its ranks mostly
wait for the gradient all-reduce; under --compile, after the first step, the run's compile
cache (compile_cache.py). Every rank makes every call, in the same order: the calls
that talk to the other ranks are among them.

jobs.Job.start_run makes one from the run's plan (plan_run: its batches and schedule, worked
out from the recipe's numbers and where the run stands; split_batch, world_sizes and
check_batch_fits: how a global batch splits among the ranks, one rule for all three); a loss or weights that are not
finite end it with launch.Diverged, raised from these calls; the loop itself ends a stop
with launch.Stopped."""

import math
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ddpkit import hangs
from ddpkit.distributed import Runtime, all_reduce, ddp_statistics, gradient_wait, set_background
from ddpkit.files import save_atomic
from ddpkit.launch import Diverged, StartupClock, StopSignals, UsageError
from ddpkit.options import RunOptions, need
from ddpkit.run.checkpoints import Progress, RunState, run_is_done, save_checkpoint, weights_are_finite
from ddpkit.run.compile_cache import CompileCache
from ddpkit.run.profiling import StepProfiler
from ddpkit.run.recovery import AgreementBuffers, CheckpointClock, Verdict, read_agreement, start_agreement
from ddpkit.run.runlog import final_figures, gpu_figures, peak_rss_mb
from ddpkit.run.stragglers import StepTimer, Stragglers
from ddpkit.run.time_limit import TimeLimit

# What the ranks do together during a training step: DDP averages the gradients inside backward().
GRADIENT_ALL_REDUCE = "the gradient all-reduce of a training step"
# Above this share of the forward and backward passes spent waiting for that all-reduce,
# rank 0 says, once, that more ranks cost more than they bring.
MOSTLY_WAITING = 0.5


def waiting_line(wait: tuple[float, float, float], *, epoch: int, images_per_rank: int) -> str:
    """What rank 0 says when waiting for the gradient all-reduce outweighs its compute, and what helps."""
    share, compute_ms, wait_ms = wait
    return (f"waiting for the other ranks: in epoch {epoch}, {100 * share:.0f} % of rank 0's forward and backward passes "
            f"went to waiting for the gradient all-reduce (DDP's own timing, a step: {compute_ms:.1f} ms computing, "
            f"{wait_ms:.1f} ms waiting); at {images_per_rank} images a rank, fewer ranks would train faster, or a larger "
            "global batch (--global-batch, or --batch-size a rank) with --lr raised by the square root of its growth "
            "(docs/defaults.md), unless a straggler line names one slow rank")


class EpochLoss:
    """This rank's training loss in the epoch so far: the sum of loss x images (float64, on
    the device, so adding to it never waits for the step: one operation a step), and the
    images, counted on the host. A checkpoint saves both as each rank's "loss_sum"."""

    def __init__(self, sums: torch.Tensor):
        self.sums = sums   # [loss x images, images]
        self.total, self.images = sums[0], int(sums[1].item())  # (a view of sums[0])

    def add(self, loss: torch.Tensor, images: int) -> None:
        with torch.no_grad():
            self.total.add_(loss, alpha=images)
        self.images += images

    def saved(self) -> torch.Tensor:
        """[loss x images, images] as a checkpoint keeps it."""
        self.sums[1] = self.images
        return self.sums

    def reset(self) -> None:
        self.sums.zero_()
        self.images = 0

    def mean_over_ranks(self) -> float:
        total, images = all_reduce(self.saved().clone(), "the all-reduce of the epoch's training loss").tolist()
        return total / max(images, 1)


# ----------------------------------------------------------------------------- the run's plan

@dataclass(frozen=True)
class RunPlan:
    """What the run trains, in which batches, on which schedule: worked out once, at its
    start, by plan_run."""
    epochs: int                 # the recipe's --epochs
    max_steps: int              # its --max-steps: a cap on the step count (0: none)
    batch_size: int             # each rank's images a step
    global_batch: int           # a step's images over all ranks, as every checkpoint records
    steps_per_epoch: int        # global batches an epoch (the recipe's shard fills the last one up)
    # The learning-rate schedule runs in this global batch's steps, total_steps of them; the
    # step count goes on from the checkpoint's, which another global batch may have counted
    # differently: the schedule's step is the step count less schedule_offset.
    schedule_offset: int
    total_steps: int
    classes: tuple[str, ...]    # what the data is, for every checkpoint
    shape: tuple[int, int, int] | None = None  # the images' (C, H, W), which every checkpoint records

    @property
    def last_step(self) -> int:
        """The step count at the schedule's end."""
        return self.schedule_offset + self.total_steps


def plan_run(progress: Progress, *, images: int, world_size: int, batch_size: int, epochs: int, max_steps: int,
             classes: tuple[str, ...], shape: tuple[int, int, int] | None = None) -> RunPlan:
    """The plan of a run of `images` training images on `world_size` ranks of `batch_size`
    images a step each, for the recipe's --epochs and --max-steps, from where `progress`
    stands (Progress() for a new run; a resumed one's step count goes on)."""
    global_batch = batch_size * world_size
    steps_per_epoch = math.ceil(images / global_batch)
    schedule_offset = progress.step - ((progress.epoch - 1) * steps_per_epoch + progress.step_in_epoch)
    total_steps = epochs * steps_per_epoch
    if max_steps:
        total_steps = min(total_steps, max_steps - schedule_offset)
    return RunPlan(epochs=epochs, max_steps=max_steps, batch_size=batch_size, global_batch=global_batch,
                   steps_per_epoch=steps_per_epoch, schedule_offset=schedule_offset, total_steps=total_steps,
                   classes=classes, shape=shape)


def split_batch(global_batch: int, world_size: int, per_rank: int = 0) -> int:
    """Each of world_size ranks' images a step: `per_rank` when given (--batch-size: the global
    batch grows with the ranks), else an equal share of `global_batch`. A global batch that
    does not split is a UsageError that names the world sizes that split it (the 8 nearest
    this one: a run that has started resumes only with its own global batch), and the
    batches that would split among these ranks, for a new run."""
    if per_rank:
        return per_rank
    if global_batch % world_size:
        fits = world_sizes(global_batch, 0, global_batch)
        fits = [str(n) for n in sorted(sorted(fits, key=lambda n: abs(n - world_size))[:8])]
        ranks = f"{', '.join(fits[:-1])} or {fits[-1]}" if len(fits) > 1 else fits[0]
        lower, higher = global_batch // world_size * world_size, -(-global_batch // world_size) * world_size
        batches = " or ".join(str(n) for n in (lower, higher) if n)
        raise UsageError(
            f"--global-batch {global_batch} does not split evenly among {world_size} ranks; run it on {ranks} "
            f"ranks (they split it; a run resumes only with its own batch), or, for a new run (another --run-name), "
            f"pass --global-batch {batches} (a multiple of {world_size}), or --batch-size N for N images per rank")
    return global_batch // world_size


def world_sizes(global_batch: int, per_rank: int, most: int) -> list[int]:
    """The world sizes up to `most` that split_batch splits this run's global batch (of `most`
    ranks) among in equal shares: a run goes on among them with the same batches. (Under
    --batch-size per rank, another world size changes the global batch: `most` alone.)"""
    if per_rank:
        return [most]
    return [ranks for ranks in range(1, most + 1) if global_batch % ranks == 0]


def check_batch_fits(global_batch: int, per_rank: int, images: int, world_size: int) -> None:
    """A global batch larger than the training set would fill each step up with the epoch's
    first images again (see the recipe's epoch_shard): almost surely a typo, or a smaller
    folder than meant."""
    batch = split_batch(global_batch, world_size, per_rank) * world_size
    twice = f"more than the {images} training images, so each step would train some of them more than once"
    if per_rank:
        need(batch <= images, f"--batch-size {per_rank} on {world_size} rank{'s' * (world_size > 1)} is a "
             f"global batch of {batch}, {twice}; pass --batch-size {images // world_size} or less")
    need(batch <= images, f"--global-batch {batch} is {twice}; pass --global-batch "
         f"{images // world_size * world_size} or less")


@dataclass(frozen=True)
class Surroundings:
    """What the run works in and reports to."""
    run_dir: Path
    stop: StopSignals                   # the stop signals, and on rank 0 the watch on the job's time limit
    logger: object                      # rank 0's RunLogger; a NullLogger on the other ranks
    startup: StartupClock | None = None  # (rank 0) printed as `ready in ...` when the first step is about to run
    time_limit: TimeLimit | None = None  # (rank 0) the job's end: after the first epoch, whether the run fits
    hosts: tuple[str, ...] = ()         # every rank's host, in rank order (the straggler line names them)
    compile_cache: CompileCache | None = None  # (--compile) the run's compile cache, saved after the first step


# ----------------------------------------------------------------------------- the run

class TrainingRun:
    def __init__(self, plan: RunPlan, *, rt: Runtime, options: RunOptions, state: RunState, around: Surroundings):
        self.plan, self.rt, self.options = plan, rt, options
        self.state, self.progress, self.config = state.state, state.progress, state.config
        self.loss = EpochLoss(state.loss_sums)
        self.run_dir, self.stop, self.logger = around.run_dir, around.stop, around.logger
        self.clock, self.pending = CheckpointClock(options.ckpt_minutes), None
        # What each rank's own part of a step takes (several ranks; not under --compile, whose
        # graph would take in the timer's forward hook), rank 0's judgement of it, and a profile
        # when --profile or RUN_DIR/profile-now asks for one.
        model = self.state.get("model") if rt.world_size > 1 and not options.compile else None
        self.timer = StepTimer(model if isinstance(model, torch.nn.Module) else None)
        self.agreement = AgreementBuffers(rt.device, rt.world_size if self.timer.hook else 0, rt.rank)
        self.earlier, self.stopping = Verdict(), False  # the previous step's agreement; a stop every rank agreed on
        self.profile_asked = False  # a profile every rank agreed on, to start at the next step's end
        self.optimizer = next((t for t in self.state.values() if isinstance(t, torch.optim.Optimizer)), None)
        self.epoch_started, self.trained = time.perf_counter(), 0
        self.startup = around.startup  # printed as `ready in ...` when the first step is about to run
        self.estimate_due = around.time_limit  # rank 0's watch on the job's end, until it said whether the run fits
        self.epoch_first_step = self.started_at = self.progress.step
        self.compile_cache = around.compile_cache
        self.stragglers = Stragglers(list(around.hosts)) if rt.is_main and self.timer.hook else None
        self.wait_unjudged = rt.is_main and rt.world_size > 1  # (rank 0, at this start's first evaluation)
        self.profiler = StepProfiler(run_dir=self.run_dir, rt=rt, steps=options.profile, first_step=self.progress.step,
                                     last_step=plan.last_step)
        # --interrupt-at N:SIGNAL (hidden from --help; docs/recovery.md): rank 0 sends itself the
        # signal as step N ends, as Slurm or a user would, and every rank stops a step later.
        at, _, name = options.interrupt_at.partition(":") if rt.is_main else ("", "", "")
        self.interrupt_at = (int(at), signal.Signals[f"SIG{name}"]) if at else None

    # ------------------------------------------------------------------ the loop's calls

    def done(self) -> bool:
        """Nothing left to train: every epoch done, or the --max-steps cap reached."""
        return run_is_done(self.progress, self.plan.epochs, self.plan.max_steps)

    def batches_left(self, shard: torch.Tensor) -> list[torch.Tensor]:
        """This rank's batches of the epoch still to train: `shard` (this rank's indices of the
        whole epoch, steps_per_epoch batches of batch_size) from the step the epoch stands at."""
        size = self.plan.batch_size
        return [shard[k * size: (k + 1) * size] for k in range(self.progress.step_in_epoch, self.plan.steps_per_epoch)]

    def lr_position(self) -> tuple[int, int]:
        """(step, steps): the learning-rate schedule's step that comes next, of its steps in all
        (this global batch's: see RunPlan)."""
        return self.progress.step - self.plan.schedule_offset, self.plan.total_steps

    def epoch_begins(self) -> int:
        """Called at the start of each epoch's steps (a resumed epoch too): its clock starts.
        Returns the epoch's number."""
        if self.startup:
            print(self.startup.ready_line(), flush=True)
            self.startup = None
        self.epoch_started, self.trained, self.epoch_first_step = time.perf_counter(), 0, self.progress.step
        if self.rt.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.rt.device)
        set_background(GRADIENT_ALL_REDUCE)
        self.timer.step_ended()  # (the epoch's first step: its own time starts here)
        self.watch_next_step()
        return self.progress.epoch

    def step_done(self, loss: torch.Tensor, images: int) -> None:
        """After each optimiser step: count it and log it, read the previous step's agreement
        (a stop, a loss that is not finite, the checkpoint clock, a profile request; at a log
        window's end every rank's time a step) and start this one's."""
        progress = self.progress
        self.loss.add(loss, images)
        self.trained += images
        progress.step, progress.step_in_epoch = progress.step + 1, progress.step_in_epoch + 1
        if self.interrupt_at and self.interrupt_at[0] == progress.step:  # (before this step's agreement, which hears it)
            os.kill(os.getpid(), self.interrupt_at[1])
        if self.stop.time_limit:  # (rank 0) the stop before the time limit leaves room for two steps
            self.stop.time_limit.stepped(time.perf_counter())
        if self.compile_cache and progress.step == self.started_at + 1:  # (--compile) what the first step compiled
            self.compile_cache.compiled()
        # The ranks agree on the previous step while this one runs: a stop lands one step
        # after its signal, on every rank alike, and no step waits for the host.
        window_end = progress.step % self.options.log_every == 0
        step_ms = self.timer.window_ms() if window_end and self.timer.hook else None
        profile = window_end and self.rt.is_main and self.profiler.requested()
        self.earlier = read_agreement(self.pending) if self.pending else Verdict()
        self.pending = start_agreement(self.stop, loss, self.clock, self.rt, self.agreement, profile=profile,
                                       step_ms=step_ms)
        if self.earlier.diverged:  # before any checkpoint could take the bad weights
            raise self.diverged("the loss stopped being finite", progress.step - 1)
        self.take(self.earlier)
        self.logger.step(progress.step, loss, progress.epoch, progress.step_in_epoch, self.plan.steps_per_epoch)
        self.profile_asked = self.profiler.step_done(progress.step, self.profile_asked)
        self.watch_next_step()
        self.timer.step_ended()  # (after the agreement's read, which on a GPU may wait for a slow rank)

    def checkpoint_due(self) -> bool:
        """Whether the step just done saves a checkpoint: every --ckpt-every steps, once
        --ckpt-minutes have passed, and before every stop. The previous step's agreement says
        so; at the epoch's last step (or the --max-steps cap's) this step's is waited for too,
        so that a stop asked for during it saves before the evaluation."""
        every, earlier = self.options.ckpt_every, self.earlier
        if earlier.stopping or earlier.ckpt_due or (every and self.progress.step % every == 0):
            return True
        steps_end = self.progress.step_in_epoch >= self.plan.steps_per_epoch or self.done()
        return bool(steps_end and self.pending and self.this_step().stopping)

    def checkpoint(self) -> Path:
        """Save where the run stands (every rank: each saves its own state). After a step, its
        agreement is waited for first: a loss that is not finite is never saved, and a stop
        asked for during the step stops at this checkpoint."""
        hangs.doing("saving a checkpoint", hangs.OWN)  # (only rank 0 writes the file: the others may wait for it)
        self.timer.pause()
        if self.pending:  # saving waits for the step anyway
            self.this_step()
        if not weights_are_finite(self.state):
            raise self.diverged("the weights stopped being finite")
        started = time.perf_counter()
        run = RunState(state=self.state, progress=self.progress, loss_sums=self.loss.saved(), config=self.config)
        path = save_checkpoint(self.run_dir, self.plan, run, self.rt, keep=self.options.keep_ckpts)
        if self.stop.time_limit:  # the stop before the time limit leaves room for the slowest save
            self.stop.time_limit.saved(time.perf_counter() - started)
        self.clock.reset()
        self.timer.step_ended()  # (the next step's own time starts after the save)
        self.watch_next_step()
        return path

    def stop_already_agreed(self) -> bool:
        """Whether every rank agreed to stop (a signal, or the job's time limit near, on any
        rank), as the agreements already read say: no talk with the other ranks."""
        return self.stopping

    def evaluation_due(self) -> bool:
        """At an epoch's end: whether this step is still to be evaluated (once per step: a run
        resumed from a checkpoint saved after its evaluation, at the --max-steps cap, is not)."""
        return self.progress.last_record.get("step") != self.progress.step

    def evaluate(self, evaluate: Callable[[], object]) -> None:
        """Evaluate where training stands and log it as the epoch's record. `evaluate` returns
        the recipe's Evaluation: each of its metrics (name -> float; "loss" and "accuracy"
        among them) goes into the record as test_<name>. At this start's first, rank 0 also
        judges how long its steps waited for the other ranks (judge_waiting)."""
        rt, progress = self.rt, self.progress
        hangs.doing("evaluating", hangs.OWN)
        self.timer.pause()  # (its forward passes are not steps)
        if rt.device.type == "cuda":
            torch.cuda.synchronize(rt.device)
        train_seconds = time.perf_counter() - self.epoch_started
        train_loss = self.loss.mean_over_ranks()
        evaluation = evaluate()
        progress.last_record = {
            "epoch": progress.epoch, "step": progress.step, "train_loss": train_loss,
            **{f"test_{name}": value for name, value in evaluation.metrics.items()}, "test_images": evaluation.count,
            "lr": self.optimizer.param_groups[0]["lr"] if self.optimizer else 0.0,
            "images_per_s": self.trained * rt.world_size / max(train_seconds, 1e-9),
            "epoch_s": time.perf_counter() - self.epoch_started, "peak_rss_mb": peak_rss_mb(rt), **gpu_figures(rt.device)}
        every = self.options.image_every
        self.logger.epoch(progress.last_record, evaluation, pictures=every > 0 and progress.epoch % every == 0)
        if self.wait_unjudged:
            self.judge_waiting()

    def epoch_done(self) -> None:
        """The epoch's steps are over: the next epoch starts at its first step (not when the
        --max-steps cap stopped this one in mid-epoch)."""
        progress = self.progress
        if progress.step_in_epoch >= self.plan.steps_per_epoch:
            progress.epoch, progress.step_in_epoch = progress.epoch + 1, 0
            self.loss.reset()

    def estimate_time_left(self) -> None:
        """Once, on rank 0, after the first epoch this process trained at least half of (a
        resumed one's rest would spread its evaluation over a few steps): how long the rest
        takes at this speed, and whether it fits in the job's time."""
        trained_here = self.progress.step - self.epoch_first_step
        if self.estimate_due and trained_here >= self.plan.steps_per_epoch / 2 and not self.done():
            seconds_per_step = (time.perf_counter() - self.epoch_started) / trained_here
            self.logger.note(self.estimate_due.fit_line(seconds_per_step, self.plan.last_step - self.progress.step),
                             self.progress.step)
            self.estimate_due = None

    def all_ranks_vote_on_stop(self) -> bool:
        """A collective every rank calls at the same point: whether any rank wants to stop now,
        outside a step (a signal during an evaluation), in an agreement of its own, waited for."""
        return read_agreement(start_agreement(self.stop, torch.zeros(()), self.clock, self.rt, self.agreement)).stopping

    def finish(self, evaluate: Callable[[], object], final_model: torch.nn.Module) -> None:
        """Training is over: the weights evaluated go to model.pt, and then a checkpoint says
        so, so that running the same command again finds nothing left to do. (A run stopped
        at its very last step, or at the cap, before the evaluation, evaluates here.)"""
        progress = self.progress
        if self.evaluation_due():
            self.startup = None  # (no step follows: no `ready in` line)
            self.epoch_begins()
            self.evaluate(evaluate)
            self.checkpoint()
        record = progress.last_record
        hangs.doing("saving model.pt", hangs.OWN)
        if self.rt.is_main:
            save_atomic(final_model.state_dict(), self.run_dir / "model.pt")
            print(f"saved {self.run_dir / 'model.pt'}; final test accuracy {100 * record['test_accuracy']:.2f}%",
                  flush=True)
        progress.finished = True
        self.checkpoint()
        self.logger.finish(final_figures(record), progress.step)
        hangs.doing(None)
        self.timer.remove()

    # ------------------------------------------------------------------ what they share

    def judge_speed(self, step_ms: tuple) -> None:
        """(rank 0) A window's times of every rank: the slowest and the median to TensorBoard,
        and a line when one rank stays slow (stragglers.py)."""
        _, slowest_ms, median_ms, line = self.stragglers.window(step_ms)
        self.logger.speed(self.progress.step, slowest_ms, median_ms)
        if line:
            self.logger.note(line, self.progress.step)

    def judge_waiting(self) -> None:
        """(rank 0, once) When DDP's own timing of this start's steps says that waiting for the
        gradient all-reduce took most of each forward and backward, a line says so."""
        self.wait_unjudged = False
        wait = gradient_wait(ddp_statistics(self.state.get("model")))
        if wait and wait[0] > MOSTLY_WAITING:
            line = waiting_line(wait, epoch=self.progress.epoch, images_per_rank=self.plan.batch_size)
            self.logger.note(line, self.progress.step)

    def this_step(self) -> Verdict:
        """This step's agreement, waited for: before a checkpoint and at the epoch's last step."""
        now, self.pending = read_agreement(self.pending), None
        if now.diverged:  # before any checkpoint could take the bad weights
            raise self.diverged("the loss stopped being finite")
        self.take(now)
        return now

    def take(self, verdict: Verdict) -> None:
        """What an agreement says besides a divergence: a stop, a profile asked for, and at a
        log window's end every rank's time a step."""
        self.stopping = self.stopping or verdict.stopping
        self.profile_asked = self.profile_asked or verdict.profile
        if verdict.step_ms and self.stragglers:
            self.judge_speed(verdict.step_ms)

    def watch_next_step(self) -> None:
        """The next step is watched for a hang; this start's first too (a rank may stop at any
        time), but not under --compile, where one rank may compile it long after another."""
        if self.progress.step > self.started_at or not self.options.compile:
            hangs.next_step(self.progress.step, GRADIENT_ALL_REDUCE)

    def diverged(self, what: str, step: int | None = None) -> Diverged:
        step = self.progress.step if step is None else step
        return Diverged(f"{what} at step {step} (epoch {self.progress.epoch})")

