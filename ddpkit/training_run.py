"""The training run as the loop sees it: one call after each step (step_done), one at each
epoch's end (epoch_done) and one at the end (finish). TrainingRun owns what happens around
the steps: the run's Progress and loss sums, the one-step-late agreement between the ranks,
checkpoints (every N steps, every M minutes, at epoch ends, on a stop), the stop itself (on
a signal, or ahead of the job's time limit), the testing aid --interrupt-at, the epoch's
record, the run's log, and after the first epoch whether the run fits in the job's time.

jobs.Job.start_run makes one; a stop ends it with launch.Stopped, a loss or weights that
are not finite with launch.Diverged, both raised from these calls."""

import os
import signal
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from ddpkit.checkpoints import Progress, run_is_done, save_atomic, save_checkpoint, weights_are_finite
from ddpkit.distributed import Runtime, all_reduce, set_background
from ddpkit.launch import Diverged, StartupClock, Stopped, StopSignals
from ddpkit.options import RunOptions
from ddpkit.recovery import AgreementBuffers, CheckpointClock, Verdict, read_agreement, start_agreement
from ddpkit.runlog import gpu_figures, peak_rss_mb
from ddpkit.time_limit import TimeLimit


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
    def __init__(self, options: RunOptions, rt: Runtime, stop: StopSignals, run_dir: Path, state: Mapping[str, object],
                 saved_options: dict, classes: tuple[str, ...], progress: Progress, loss_sums: torch.Tensor, epochs: int,
                 max_steps: int, steps_per_epoch: int, schedule_offset: int, total_steps: int, logger,
                 startup: StartupClock | None = None, time_limit: TimeLimit | None = None,
                 shape: tuple[int, int, int] | None = None):
        self.options, self.rt, self.stop, self.run_dir, self.state = options, rt, stop, run_dir, state
        self.classes, self.shape = classes, shape  # what the data is, for every checkpoint
        self.saved_options, self.progress, self.loss = saved_options, progress, EpochLoss(loss_sums)
        self.epochs, self.max_steps, self.steps_per_epoch = epochs, max_steps, steps_per_epoch
        # The learning-rate schedule runs in this world size's steps (schedule_step of
        # total_steps); the step count goes on from the checkpoint's.
        self.schedule_offset, self.total_steps, self.logger = schedule_offset, total_steps, logger
        self.clock, self.pending, self.agreement = CheckpointClock(options.ckpt_minutes), None, AgreementBuffers(rt.device)
        interrupt_step, self.interrupt_signal = (options.interrupt_at.split(":") + [""])[:2]
        self.interrupt_step = int(interrupt_step or 0)
        self.optimizer = next((t for t in state.values() if isinstance(t, torch.optim.Optimizer)), None)
        self.epoch_started, self.trained = time.perf_counter(), 0
        self.startup = startup  # printed as `ready in ...` when the first step is about to run
        self.estimate_due = time_limit  # rank 0's watch on the job's end, until it said whether the run fits
        self.epoch_first_step = progress.step

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
        set_background("the gradient all-reduce of a training step")

    def step_done(self, loss: torch.Tensor, images: int) -> None:
        """After each optimiser step: count it, log it, and act on the previous step's
        agreement (stop, divergence, checkpoint time), while this step's runs behind it."""
        progress = self.progress
        self.loss.add(loss, images)
        self.trained += images
        progress.step, progress.step_in_epoch = progress.step + 1, progress.step_in_epoch + 1
        if self.stop.time_limit:  # (rank 0) the stop before the time limit leaves room for two steps
            self.stop.time_limit.stepped(time.perf_counter())
        if self.rt.is_main and self.interrupt_step and progress.step == self.interrupt_step:
            os.kill(os.getpid(), getattr(signal, f"SIG{self.interrupt_signal}"))
        # The ranks agree on the previous step while this one runs: a stop lands one step
        # after its signal, on every rank alike, and no step waits for the host.
        earlier = read_agreement(self.pending) if self.pending else Verdict()
        self.pending = start_agreement(self.stop, loss, self.clock, self.rt, self.agreement)
        if earlier.diverged:  # before any checkpoint could take the bad weights
            raise self.diverged("the loss stopped being finite", progress.step - 1)
        self.logger.step(progress.step, loss, progress.epoch, progress.step_in_epoch, self.steps_per_epoch)
        every = self.options.ckpt_every
        if earlier.stopping or earlier.ckpt_due or (every and progress.step % every == 0):
            now = self.this_step()  # saving waits for the step anyway
            path = self.checkpoint()
            if earlier.stopping or now.stopping:
                raise Stopped(path)

    def epoch_done(self, evaluate: Callable[[], object]) -> None:
        """At an epoch's end, or where the --max-steps cap stopped it: evaluate (once per
        step), move on to the next epoch, save."""
        progress = self.progress
        if self.pending and self.this_step().stopping:  # at the epoch's last step
            raise Stopped(self.checkpoint())
        # A checkpoint saved at this very step before its evaluation (a stop at the epoch's
        # last step, a crash during the evaluation) is evaluated now; one saved after it (at
        # the --max-steps cap) is not evaluated twice.
        if progress.last_record.get("step") != progress.step:
            self.evaluate_here(evaluate)
        if progress.step_in_epoch >= self.steps_per_epoch:  # not when the cap stopped it in mid-epoch
            progress.epoch, progress.step_in_epoch = progress.epoch + 1, 0
            self.loss.reset()
        path = self.checkpoint()
        # After the first epoch this process trained at least half of (a resumed one's rest
        # would spread its evaluation over a few steps).
        trained_here = progress.step - self.epoch_first_step
        if self.estimate_due and trained_here >= self.steps_per_epoch / 2 and not self.done():
            seconds_per_step = (time.perf_counter() - self.epoch_started) / trained_here
            self.logger.note(self.estimate_due.fit_line(seconds_per_step, self.total_steps - self.schedule_step),
                             progress.step)
            self.estimate_due = None
        # A stop asked for during the evaluation; after the last one, finishing is quicker.
        now = read_agreement(start_agreement(self.stop, torch.zeros(()), self.clock, self.rt, self.agreement))
        if now.stopping and not self.done():
            raise Stopped(path)

    def finish(self, evaluate: Callable[[], object], final_model: torch.nn.Module) -> None:
        """Training is over: the weights evaluated go to model.pt, and then a checkpoint says
        so, so that running the same command again finds nothing left to do. (A run stopped
        at its very last step, or at the cap, before the evaluation, evaluates here.)"""
        progress = self.progress
        if progress.last_record.get("step") != progress.step:
            self.startup = None  # (no step follows: no `ready in` line)
            self.epoch_begins()
            self.evaluate_here(evaluate)
            self.checkpoint()
        record = progress.last_record
        if self.rt.is_main:
            save_atomic(final_model.state_dict(), self.run_dir / "model.pt")
            print(f"saved {self.run_dir / 'model.pt'}; final test accuracy {100 * record['test_accuracy']:.2f}%",
                  flush=True)
        progress.finished = True
        self.checkpoint()
        self.logger.finish({k: record[k] for k in ("test_accuracy", "test_loss", "train_loss")}, progress.step)

    # ------------------------------------------------------------------ what they share

    def this_step(self) -> Verdict:
        """This step's agreement, waited for: before a checkpoint and at an epoch's end."""
        now, self.pending = read_agreement(self.pending), None
        if now.diverged:  # before any checkpoint could take the bad weights
            raise self.diverged("the loss stopped being finite")
        return now

    def checkpoint(self) -> Path:
        if not weights_are_finite(self.state):
            raise self.diverged("the weights stopped being finite")
        started = time.perf_counter()
        path = save_checkpoint(self.run_dir, self.saved_options, self.classes, self.state, self.rt, self.progress,
                               self.loss.saved(), self.options.keep_ckpts, shape=self.shape)
        if self.stop.time_limit:  # the stop before the time limit leaves room for the slowest save
            self.stop.time_limit.saved(time.perf_counter() - started)
        self.clock.reset()
        return path

    def diverged(self, what: str, step: int | None = None) -> Diverged:
        step = self.progress.step if step is None else step
        return Diverged(f"{what} at step {step} (epoch {self.progress.epoch})")

    def evaluate_here(self, evaluate: Callable[[], object]) -> None:
        """Evaluate where training stands and log it as the epoch's record. `evaluate` returns
        the recipe's Evaluation: each of its metrics (name -> float; "loss" and "accuracy"
        among them) goes into the record as test_<name>."""
        rt, progress = self.rt, self.progress
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

