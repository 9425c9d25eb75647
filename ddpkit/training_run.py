"""The training run as the loop sees it. mnist_ddp.train shows each event of the loop as a
line (a step done, a checkpoint when one is due, a stop when every rank agreed to one, an
evaluation, the epoch's end); TrainingRun holds what each one costs: the run's Progress and
loss sums, the one-step-late agreement between the ranks, the checkpoint files, the stop's
reasons (a signal, or the job's time limit near), the epoch's record, the run's log, and
after the first epoch whether the run fits in the job's time and whether its ranks mostly
wait for the gradient all-reduce. Every rank makes every call, in the same order: the calls
that talk to the other ranks are among them.

jobs.Job.start_run makes one (new_run); a loss or weights that are not finite end it with
launch.Diverged, raised from these calls; the loop itself ends a stop with launch.Stopped."""

import ctypes
import os
import signal
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from ddpkit import hangs
from ddpkit.checkpoints import Progress, run_is_done, save_atomic, save_checkpoint, weights_are_finite
from ddpkit.distributed import Runtime, all_reduce, ddp_statistics, gradient_wait, set_background
from ddpkit.launch import Diverged, StartupClock, StopSignals
from ddpkit.options import RunOptions
from ddpkit.profiling import StepProfiler
from ddpkit.recovery import AgreementBuffers, CheckpointClock, Verdict, read_agreement, start_agreement
from ddpkit.runlog import gpu_figures, peak_rss_mb
from ddpkit.stragglers import StepTimer, Stragglers
from ddpkit.time_limit import TimeLimit

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


class TrainingRun:
    def __init__(self, *, options: RunOptions, rt: Runtime, stop: StopSignals, run_dir: Path,
                 state: Mapping[str, object], saved_options: dict, classes: tuple[str, ...], progress: Progress,
                 loss_sums: torch.Tensor, epochs: int, max_steps: int, steps_per_epoch: int, global_batch: int,
                 schedule_offset: int, total_steps: int, logger, startup: StartupClock | None = None,
                 time_limit: TimeLimit | None = None, shape: tuple[int, int, int] | None = None,
                 hosts: list[str] | None = None):
        self.options, self.rt, self.stop, self.run_dir, self.state = options, rt, stop, run_dir, state
        self.classes, self.shape = classes, shape  # what the data is, for every checkpoint
        self.saved_options, self.progress, self.loss = saved_options, progress, EpochLoss(loss_sums)
        self.epochs, self.max_steps, self.steps_per_epoch = epochs, max_steps, steps_per_epoch
        self.global_batch = global_batch  # a step's images over all ranks, as every checkpoint records
        # The learning-rate schedule runs in this global batch's steps (schedule_step of
        # total_steps); the step count goes on from the checkpoint's.
        self.schedule_offset, self.total_steps, self.logger = schedule_offset, total_steps, logger
        self.clock, self.pending = CheckpointClock(options.ckpt_minutes), None
        # What each rank's own part of a step takes (several ranks; not under --compile, whose
        # graph would take in the timer's forward hook; MNIST_DDP_STEP_TIMES=0, for the
        # benchmark of their cost, turns them off), rank 0's judgement of it, and a profile
        # when --profile or RUN_DIR/profile-now asks for one.
        timed = rt.world_size > 1 and not options.compile and os.environ.get("MNIST_DDP_STEP_TIMES") != "0"
        model = state.get("model") if timed else None
        self.timer = StepTimer(model if isinstance(model, torch.nn.Module) else None)
        self.agreement = AgreementBuffers(rt.device, rt.world_size if self.timer.hook else 0, rt.rank)
        self.earlier, self.stopping = Verdict(), False  # the previous step's agreement; a stop every rank agreed on
        self.profile_asked = False  # a profile every rank agreed on, to start at the next step's end
        self.optimizer = next((t for t in state.values() if isinstance(t, torch.optim.Optimizer)), None)
        self.epoch_started, self.trained = time.perf_counter(), 0
        self.startup = startup  # printed as `ready in ...` when the first step is about to run
        self.estimate_due = time_limit  # rank 0's watch on the job's end, until it said whether the run fits
        self.epoch_first_step = self.started_at = progress.step
        self.stragglers = Stragglers(hosts or []) if rt.is_main and self.timer.hook else None
        self.wait_unjudged = rt.is_main and rt.world_size > 1  # (rank 0, at this start's first evaluation)
        self.profiler = StepProfiler(run_dir=run_dir, rank=rt.rank, is_main=rt.is_main, device=rt.device,
                                     steps=options.profile, first_step=progress.step,
                                     last_step=schedule_offset + total_steps)

    # ------------------------------------------------------------------ the loop's calls

    def done(self) -> bool:
        """Nothing left to train: every epoch done, or the --max-steps cap reached."""
        return run_is_done(self.progress, self.epochs, self.max_steps)

    @property
    def schedule_step(self) -> int:
        """The step of the learning-rate schedule (of total_steps) that comes next."""
        return self.progress.step - self.schedule_offset

    def epoch_begins(self) -> None:
        """Called at the start of each epoch's steps (a resumed epoch too): its clock starts."""
        if self.startup:
            print(self.startup.ready_line(), flush=True)
            self.startup = None
        self.epoch_started, self.trained, self.epoch_first_step = time.perf_counter(), 0, self.progress.step
        if self.rt.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.rt.device)
        set_background(GRADIENT_ALL_REDUCE)
        self.timer.step_ended()  # (the epoch's first step: its own time starts here)
        self.watch_next_step()

    def step_done(self, loss: torch.Tensor, images: int) -> None:
        """After each optimiser step: count it and log it, read the previous step's agreement
        (a stop, a loss that is not finite, the checkpoint clock, a profile request; at a log
        window's end every rank's time a step) and start this one's."""
        progress = self.progress
        self.loss.add(loss, images)
        self.trained += images
        progress.step, progress.step_in_epoch = progress.step + 1, progress.step_in_epoch + 1
        if self.stop.time_limit:  # (rank 0) the stop before the time limit leaves room for two steps
            self.stop.time_limit.stepped(time.perf_counter())
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
        self.logger.step(progress.step, loss, progress.epoch, progress.step_in_epoch, self.steps_per_epoch)
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
        steps_end = self.progress.step_in_epoch >= self.steps_per_epoch or self.done()
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
        path = save_checkpoint(self.run_dir, self.saved_options, self.classes, self.state, self.rt, self.progress,
                               self.loss.saved(), self.options.keep_ckpts, global_batch=self.global_batch,
                               shape=self.shape)
        if self.stop.time_limit:  # the stop before the time limit leaves room for the slowest save
            self.stop.time_limit.saved(time.perf_counter() - started)
        self.clock.reset()
        self.timer.step_ended()  # (the next step's own time starts after the save)
        self.watch_next_step()
        return path

    def stop_agreed(self) -> bool:
        """Whether every rank agreed to stop (a signal, or the job's time limit near, on any
        rank), as the agreements read so far say."""
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
        if progress.step_in_epoch >= self.steps_per_epoch:
            progress.epoch, progress.step_in_epoch = progress.epoch + 1, 0
            self.loss.reset()

    def estimate_time_left(self) -> None:
        """Once, on rank 0, after the first epoch this process trained at least half of (a
        resumed one's rest would spread its evaluation over a few steps): how long the rest
        takes at this speed, and whether it fits in the job's time."""
        trained_here = self.progress.step - self.epoch_first_step
        if self.estimate_due and trained_here >= self.steps_per_epoch / 2 and not self.done():
            seconds_per_step = (time.perf_counter() - self.epoch_started) / trained_here
            self.logger.note(self.estimate_due.fit_line(seconds_per_step, self.total_steps - self.schedule_step),
                             self.progress.step)
            self.estimate_due = None

    def ranks_agree_to_stop(self) -> bool:
        """Whether any rank wants to stop now, outside a step (a signal during an evaluation):
        an agreement of its own, waited for, on every rank."""
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
        self.logger.finish({k: record[k] for k in ("test_accuracy", "test_loss", "train_loss")}, progress.step)
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
            line = waiting_line(wait, epoch=self.progress.epoch, images_per_rank=self.global_batch // self.rt.world_size)
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
        """The next step is watched for a hang, but not this start's first (it compiles, allocates)."""
        if self.progress.step > self.started_at:
            hangs.next_step(self.progress.step, GRADIENT_ALL_REDUCE)

    def diverged(self, what: str, step: int | None = None) -> Diverged:
        step = self.progress.step if step is None else step
        return Diverged(f"{what} at step {step} (epoch {self.progress.epoch})")


class InterruptingRun(TrainingRun):
    """A TrainingRun whose process sends itself a signal as step N ends (--interrupt-at
    N:USR1 or N:TERM, a testing aid), as Slurm or a user would: every rank then stops after
    step N+1 (or at N, a checkpoint step). new_run makes one on rank 0 alone, and only when
    the option is given: no other run looks at it."""

    def step_done(self, loss: torch.Tensor, images: int) -> None:
        step, name = self.options.interrupt_at.split(":")
        if self.progress.step + 1 == int(step):  # (before this step's agreement starts, which hears it)
            os.kill(os.getpid(), getattr(signal, f"SIG{name}"))
        super().step_done(loss, images)


class TroubledRun(TrainingRun):
    """Testing aids for the hang report and the straggler line, set by environment variables
    that users never see (not options): MNIST_DDP_TEST_HANG=R:N, rank R hangs in Python when
    step N ends (R:N:gil, in a C call that holds the interpreter's lock); MNIST_DDP_TEST_SLOW=R:S,
    rank R sleeps S seconds before each forward pass; MNIST_DDP_TEST_SLOW_SAVE=R:N:S, rank R's
    checkpoint of step N takes S seconds more."""

    def __init__(self, **fields):
        super().__init__(**fields)
        slow = os.environ.get("MNIST_DDP_TEST_SLOW", "")
        if slow and int(slow.split(":")[0]) == self.rt.rank:
            seconds = float(slow.split(":")[1])
            self.state["model"].register_forward_pre_hook(lambda *_: time.sleep(seconds))

    def checkpoint(self) -> Path:
        rank, step, seconds = os.environ.get("MNIST_DDP_TEST_SLOW_SAVE", "-1:0:0").split(":")
        if (int(rank), int(step)) == (self.rt.rank, self.progress.step):
            hangs.doing("saving a checkpoint", hangs.OWN)
            time.sleep(float(seconds))  # (a slow file system)
        return super().checkpoint()

    def step_done(self, loss: torch.Tensor, images: int) -> None:
        rank, step, *how = os.environ.get("MNIST_DDP_TEST_HANG", "-1:0").split(":")
        if (int(rank), int(step)) == (self.rt.rank, self.progress.step + 1):  # (until the test, or the launcher, ends it)
            if how == ["gil"]:  # a C call that keeps the interpreter's lock: no Python thread runs
                ctypes.PyDLL(None).sleep(3600)
            time.sleep(3600)
        super().step_done(loss, images)


def new_run(**fields) -> TrainingRun:
    """TrainingRun(**fields); on rank 0 with --interrupt-at an InterruptingRun; with a test's
    MNIST_DDP_TEST_HANG, _SLOW or _SLOW_SAVE a TroubledRun."""
    if any(os.environ.get(f"MNIST_DDP_TEST_{aid}") for aid in ("HANG", "SLOW", "SLOW_SAVE")):
        return TroubledRun(**fields)
    interrupting = fields["options"].interrupt_at and fields["rt"].is_main
    return (InterruptingRun if interrupting else TrainingRun)(**fields)
