"""ddpkit/run/training_run.py in one process, with a real (tiny) model, AdamW, checkpoints on
disk and the real per-step agreement: EpochLoss, checkpoints every N steps, a stop signal
acted on one step later with a checkpoint, a loss that is not finite reported with its step
and nothing saved, where the run stands (done(), batches_left(), lr_position()), an epoch's
train_loss that covers that epoch alone, and --ckpt-minutes counted from the last checkpoint. With a real
RunLogger and a clock the test moves: the epoch's record (speed, duration, lr) as printed,
in metrics.jsonl and TensorBoard, pictures every --image-every epochs, the estimate after
the first epoch, the `ready in` line, finish (model.pt, the final line, a finished
checkpoint), stops at an epoch's end, weights that are not finite, --interrupt-at. And that
save_checkpoint, RunLogger and StepProfiler take at most 6 parameters each.

    python -m pytest tests/unit/test_training_run.py
"""

import contextlib
import inspect
import json
import re
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ddpkit.distributed import Runtime, collective_of, set_background
from ddpkit.launch import Diverged, StartupClock, Stopped, StopSignals
from ddpkit.options import RunOptions
from ddpkit.run import training_run
from ddpkit.run.checkpoints import Progress, read_checkpoint, save_checkpoint
from ddpkit.run.profiling import StepProfiler
from ddpkit.run.recovery import CheckpointClock
from ddpkit.run.runlog import HParams, LogPlan, NullLogger, RunLogger
from ddpkit.run.time_limit import JobTimes, TimeLimit
from ddpkit.run.trackers import NoTracker
from ddpkit.run.training_run import EpochLoss, RunPlan, RunState, Surroundings, TrainingRun

ONE = Runtime(0, 0, 1, torch.device("cpu"), "none", True)


def test_epoch_loss_weighs_each_step_by_its_images():
    loss = EpochLoss(torch.zeros(2, dtype=torch.float64))
    assert loss.mean_over_ranks() == 0.0  # nothing yet
    loss.add(torch.tensor(0.5), 10)
    loss.add(torch.tensor(1.5), 30)
    assert loss.mean_over_ranks() == pytest.approx(1.25)
    assert loss.sums.tolist() == pytest.approx([50.0, 40.0])  # the mean leaves the sums as they are
    one = EpochLoss(torch.zeros(2, dtype=torch.float64))
    one.add(torch.tensor(0.5), 1)  # a single image: its own loss
    assert one.mean_over_ranks() == 0.5


@pytest.fixture
def stop():
    signals = StopSignals()
    signals.restore()  # the test's own handlers back at once; the test sets .received by hand
    return signals


def make_run(tmp_path, stop, *, ckpt_every=2, epochs=2, max_steps=0, steps_per_epoch=5, progress=None,
             schedule_offset=0, logger=None, rt=ONE, optimizer=True, startup=None, time_limit=None, shape=None,
             **options) -> TrainingRun:
    """A run of nn.Linear(3, 2) with AdamW (lr 0.01), or without an optimizer, at a global
    batch of 8; `options` are more of RunOptions (image_every, interrupt_at)."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    state = {"model": model, **({"optimizer": torch.optim.AdamW(model.parameters(), lr=0.01)} if optimizer else {})}
    run_options = RunOptions(ckpt_every=ckpt_every, ckpt_minutes=0, keep_ckpts=10, **options)
    plan = RunPlan(epochs=epochs, max_steps=max_steps, batch_size=8 // rt.world_size, global_batch=8,
                   steps_per_epoch=steps_per_epoch, schedule_offset=schedule_offset, total_steps=epochs * steps_per_epoch,
                   classes=("a", "b"), shape=shape)
    resumed = RunState(state, progress or Progress(), torch.zeros(2, dtype=torch.float64), {"lr": 0.01})
    around = Surroundings(run_dir=tmp_path, stop=stop, logger=logger or NullLogger(), startup=startup,
                          time_limit=time_limit)
    return TrainingRun(plan, rt=rt, options=run_options, state=resumed, around=around)


# What mnist_ddp.train does around each step and at each epoch's end, line for line.

def after_step(run: TrainingRun, loss: float = 0.7, images: int = 4) -> None:
    run.step_done(torch.tensor(loss), images)
    if run.checkpoint_due():
        saved = run.checkpoint()
        if run.stop_already_agreed():
            raise Stopped(saved)


def end_epoch(run: TrainingRun, evaluate) -> None:
    if run.evaluation_due():
        run.evaluate(evaluate)
    run.epoch_done()
    saved = run.checkpoint()
    run.estimate_time_left()
    if run.all_ranks_vote_on_stop() and not run.done():
        raise Stopped(saved)


def saved(tmp_path) -> list[str]:
    folder = tmp_path / "checkpoints"
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_a_checkpoint_every_2_steps(tmp_path, stop):
    run = make_run(tmp_path, stop, ckpt_every=2)
    for _ in range(3):
        after_step(run)
    assert saved(tmp_path) == ["ckpt-00000002.pt"]
    ckpt = read_checkpoint(tmp_path / "checkpoints" / "ckpt-00000002.pt", "cpu")
    assert (ckpt["progress"]["step"], ckpt["progress"]["step_in_epoch"]) == (2, 2)
    assert ckpt["rank_states"][0]["loss_sum"].tolist() == pytest.approx([0.7 * 8, 8])
    assert (run.progress.step, run.loss.images) == (3, 12)


def test_a_stop_signal_ends_the_run_one_step_later_with_a_checkpoint(tmp_path, stop):
    run = make_run(tmp_path, stop, ckpt_every=0)  # checkpoints at epoch ends only
    after_step(run)
    stop.received = signal.SIGUSR1  # arrives during step 2
    after_step(run)  # step 2: its agreement starts, the run goes on
    with pytest.raises(Stopped) as stopped:
        after_step(run)  # step 3 reads step 2's agreement: save and stop
    path = tmp_path / "checkpoints" / "ckpt-00000003.pt"
    assert stopped.value.args == (path,)
    assert saved(tmp_path) == ["ckpt-00000003.pt"]
    assert read_checkpoint(path, "cpu")["progress"]["step"] == 3


def test_a_loss_that_is_not_finite_is_reported_with_its_step_and_not_saved(tmp_path, stop):
    run = make_run(tmp_path, stop, ckpt_every=2)
    after_step(run, float("nan"))
    with pytest.raises(Diverged) as diverged:
        after_step(run)  # a checkpoint step, but the bad step comes first
    assert str(diverged.value) == "the loss stopped being finite at step 1 (epoch 1)"
    assert saved(tmp_path) == []


def test_a_loss_that_is_not_finite_at_a_checkpoint_step_is_caught_before_saving(tmp_path, stop):
    run = make_run(tmp_path, stop, ckpt_every=1)
    with pytest.raises(Diverged) as diverged:
        after_step(run, float("inf"))
    assert str(diverged.value) == "the loss stopped being finite at step 1 (epoch 1)"
    assert saved(tmp_path) == []


def test_done_follows_the_epochs_and_the_step_cap(tmp_path, stop):
    assert not make_run(tmp_path, stop, epochs=2).done()
    assert not make_run(tmp_path, stop, epochs=2, progress=Progress(epoch=2, step_in_epoch=4, step=9)).done()
    assert make_run(tmp_path, stop, epochs=2, progress=Progress(epoch=3, step=10)).done()
    assert not make_run(tmp_path, stop, max_steps=7, progress=Progress(step=6, step_in_epoch=1, epoch=2)).done()
    assert make_run(tmp_path, stop, max_steps=7, progress=Progress(step=7, step_in_epoch=2, epoch=2)).done()


def test_the_schedules_step_counts_from_the_offset(tmp_path, stop):
    # Resumed under another global batch: the step count goes on from the checkpoint's, the
    # schedule runs in this global batch's steps (2 epochs of 5).
    run = make_run(tmp_path, stop, ckpt_every=0, progress=Progress(epoch=2, step=12), schedule_offset=7)
    assert run.lr_position() == (5, 10)
    run.step_done(torch.tensor(0.7), 4)
    assert (run.progress.step, run.lr_position()) == (13, (6, 10))


def test_the_batches_left_start_at_the_step_the_epoch_stands_at(tmp_path, stop):
    """5 steps an epoch of 8 images (one rank): a fresh epoch trains all 5 batches of its
    shard, one resumed after 3 steps the last 2; epoch_begins says which epoch it is."""
    shard = torch.arange(40)
    run = make_run(tmp_path, stop, ckpt_every=0)
    assert run.epoch_begins() == 1
    assert [batch.tolist() for batch in run.batches_left(shard)] == [list(range(k, k + 8)) for k in range(0, 40, 8)]
    resumed = make_run(tmp_path, stop, ckpt_every=0, progress=Progress(epoch=2, step_in_epoch=3, step=8))
    assert resumed.epoch_begins() == 2
    assert [batch.tolist() for batch in resumed.batches_left(shard)] == [list(range(24, 32)), list(range(32, 40))]


def evaluation(accuracy: float = 0.5) -> SimpleNamespace:
    """What the recipe's evaluate gives TrainingRun: its metrics and the test images counted."""
    return SimpleNamespace(metrics={"loss": 1.0, "accuracy": accuracy}, count=10)


def test_the_train_loss_of_a_later_epoch_covers_that_epoch_alone(tmp_path, stop):
    run = make_run(tmp_path, stop, ckpt_every=0, epochs=3, steps_per_epoch=2)
    records = []
    for losses in ((1.0, 3.0), (0.5, 0.25), (0.1, 0.1)):
        for loss in losses:
            after_step(run, loss)
        end_epoch(run, evaluation)
        records.append(run.progress.last_record)
    assert [r["epoch"] for r in records] == [1, 2, 3]
    assert [r["train_loss"] for r in records] == pytest.approx([2.0, 0.375, 0.1])
    assert [r["test_loss"] for r in records] == [1.0] * 3 and records[0]["test_images"] == 10
    assert run.done()


def test_after_a_checkpoint_on_the_clock_the_next_one_waits_the_interval_again(tmp_path, stop):
    """--ckpt-minutes 1: one checkpoint a minute, counted from the last one, not from the start."""
    now = [0.0]
    run = make_run(tmp_path, stop, ckpt_every=0, epochs=10, steps_per_epoch=100)
    run.clock = CheckpointClock(1, clock=lambda: now[0])
    for step in range(1, 21):
        now[0] = 15.0 * step  # a step every 15 s
        after_step(run)
    # The minute is up at step 4 (60 s); the next step saves (75 s) and the clock starts
    # again there: up at step 9 (135 s), saved at step 10, and so on.
    assert saved(tmp_path) == [f"ckpt-{s:08d}.pt" for s in (5, 10, 15, 20)]


# ----------------------------------------------------------------------------- what a user sees of a run
# A real RunLogger (stdout lines, metrics.jsonl, TensorBoard events) instead of NullLogger,
# and the run's perf_counter as a clock the test moves, so that the record's figures are exact.

@pytest.fixture
def clock(monkeypatch) -> list[float]:
    """The run's time.perf_counter: now[0] seconds, moved by the test."""
    now = [1000.0]
    monkeypatch.setattr(training_run, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    return now


@pytest.fixture
def background():
    """Put the background label back as it was (epoch_begins sets it)."""
    before = collective_of(Exception())
    yield
    set_background(before)


@pytest.fixture
def live_stop():
    """StopSignals with its handlers on: a signal sent to this process sets .received."""
    signals = StopSignals()
    signals.training = True
    yield signals
    signals.restore()


@contextlib.contextmanager
def job_output(path: Path):
    """stdout as in a batch job: a block-buffered file. What the file holds is what a user
    reading the job's output sees now, and what a kill would leave."""
    with open(path, "w") as out, contextlib.redirect_stdout(out):
        yield path.read_text


def run_logger(run_dir: Path) -> RunLogger:
    """Rank 0's logger, with the batch loss and a progress line at every step."""
    run_dir.mkdir(parents=True, exist_ok=True)
    plan = LogPlan(options={"lr": 0.01}, hparams=HParams({"lr": 0.01}), environment={}, classes=("a", "b"),
                   resumed_step=0, log_every=1, progress_every=1e-9)
    return RunLogger(run_dir, plan, tracker=NoTracker())


def tensorboard(run_dir: Path) -> EventAccumulator:
    return EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "images": 0, "tensors": 0}).Reload()


def scalars(events: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(event.step, event.value) for event in events.Scalars(tag)]


class Evaluate:
    """The recipe's evaluate: takes `seconds` of the run's clock and gives the metrics, two
    example pictures and a confusion matrix; counts its calls."""

    def __init__(self, clock: list[float] | None = None, seconds: float = 0.0, then=None):
        self.clock, self.seconds, self.then, self.calls = clock, seconds, then, 0

    def __call__(self) -> SimpleNamespace:
        self.calls += 1
        if self.clock:
            self.clock[0] += self.seconds
        if self.then:
            self.then()
        examples = (torch.zeros(2, 1, 8, 8, dtype=torch.uint8), torch.tensor([0, 1]), torch.tensor([0, 0]))
        return SimpleNamespace(metrics={"loss": 0.25, "accuracy": 0.875}, count=8, examples={"examples": examples},
                               confusion=torch.tensor([[3, 1], [0, 4]]))


def train_epoch(run: TrainingRun, clock: list[float], evaluate, losses=(0.5, 1.5), step_seconds=0.25) -> None:
    """One epoch as mnist_ddp.py's loop runs it, 4 images a step, each step `step_seconds` long."""
    run.epoch_begins()
    for loss in losses:
        clock[0] += step_seconds
        after_step(run, loss)
    end_epoch(run, evaluate)


def test_an_epochs_record_reaches_the_epoch_line_metrics_jsonl_and_tensorboard(tmp_path, stop, clock, capsys):
    """Two steps of 4 images, 0.25 s each, then an evaluation of 0.5 s: the record says 16
    images a second over the training alone, an epoch of 1 s, AdamW's lr; the logger prints a
    progress line a step and the epoch line, appends the record to metrics.jsonl and writes
    the scalars; the epoch's checkpoint is at the next epoch's start."""
    run_dir = tmp_path / "run"
    logger = run_logger(run_dir)
    run = make_run(run_dir, stop, ckpt_every=0, steps_per_epoch=2, logger=logger)
    train_epoch(run, clock, Evaluate(clock, seconds=0.5))
    logger.close()
    record = dict(run.progress.last_record)
    assert record.pop("peak_rss_mb") > 0
    logged_at = record.pop("time")  # (when it was logged)
    assert logged_at > 0
    assert record == {"epoch": 1, "step": 2, "train_loss": 1.0, "test_loss": 0.25, "test_accuracy": 0.875,
                      "test_images": 8, "lr": 0.01, "images_per_s": 16.0, "epoch_s": 1.0, "seconds_to_best": 1.0}
    lines = capsys.readouterr().out.splitlines()
    assert lines[-3:] == ["epoch 1 step 1/2 (step 1 in all) batch loss 0.5000",
                          "epoch 1 step 2/2 (step 2 in all) batch loss 1.5000",
                          "epoch   1 | train loss 1.0000 | test loss 0.2500 | test acc  87.50% | lr 1.00e-02 "
                          "|       16 img/s |   1.00 s"]
    assert [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [
        {**run.progress.last_record, "time": logged_at}]
    events = tensorboard(run_dir)
    assert {tag: scalars(events, tag) for tag in ("train/batch_loss", "train/loss", "test/accuracy", "train/lr",
                                                  "speed/images_per_s", "speed/epoch_s")} == {
        "train/batch_loss": [(1, 0.5), (2, 1.5)], "train/loss": [(2, 1.0)], "test/accuracy": [(2, 0.875)],
        "train/lr": [(2, pytest.approx(0.01))], "speed/images_per_s": [(2, 16.0)], "speed/epoch_s": [(2, 1.0)]}
    progress = read_checkpoint(run_dir / "checkpoints" / "ckpt-00000002.pt", "cpu")["progress"]
    assert (progress["epoch"], progress["step_in_epoch"], progress["last_record"]["step"]) == (2, 0, 2)


@pytest.mark.parametrize("image_every, epochs", [(0, []), (1, [1, 2]), (2, [2])])
def test_pictures_go_to_tensorboard_every_image_every_epochs(tmp_path, stop, clock, image_every, epochs):
    run_dir = tmp_path / "run"
    logger = run_logger(run_dir)
    run = make_run(run_dir, stop, ckpt_every=0, steps_per_epoch=2, logger=logger, image_every=image_every)
    for _ in range(2):
        train_epoch(run, clock, Evaluate())
    logger.close()
    events = tensorboard(run_dir)
    for tag in ("test/confusion_matrix", "test/examples"):
        shown = [event.step for event in events.Images(tag)] if tag in events.Tags()["images"] else []
        assert shown == [2 * epoch for epoch in epochs], tag


def test_the_speed_counts_the_images_of_every_rank(tmp_path, stop, clock):
    """Rank 0 of 2 (each rank trains as many images): 8 images a rank in 0.5 s are 32 a second."""
    two = Runtime(0, 0, 2, torch.device("cpu"), "gloo", True)  # (no process group: nothing to reduce)
    run = make_run(tmp_path, stop, ckpt_every=0, steps_per_epoch=2, rt=two)
    run.epoch_begins()
    for _ in range(2):
        clock[0] += 0.25
        after_step(run)
    run.evaluate(Evaluate())
    assert run.progress.last_record["images_per_s"] == 32.0


def test_a_recipe_without_an_optimizer_records_lr_0(tmp_path, stop, clock):
    run = make_run(tmp_path, stop, ckpt_every=0, steps_per_epoch=2, optimizer=False)
    train_epoch(run, clock, Evaluate())
    assert run.progress.last_record["lr"] == 0.0


def test_finish_writes_model_pt_prints_the_final_accuracy_at_once_and_saves_a_finished_checkpoint(tmp_path, stop,
                                                                                                  clock):
    """The last epoch's evaluation is the final one (not repeated); the line that names
    model.pt is in the job's output as soon as it is printed."""
    run_dir = tmp_path / "run"
    logger = run_logger(run_dir)
    run = make_run(run_dir, stop, ckpt_every=0, epochs=1, steps_per_epoch=2, logger=logger)
    model, evaluate = run.state["model"], Evaluate()
    with job_output(tmp_path / "slurm-7.out") as output:
        train_epoch(run, clock, evaluate)
        run.finish(evaluate, model)
        printed = output()
    logger.close()
    assert evaluate.calls == 1
    assert printed.splitlines()[-1] == f"saved {run_dir / 'model.pt'}; final test accuracy 87.50%"
    weights = torch.load(run_dir / "model.pt", weights_only=True)
    assert weights.keys() == model.state_dict().keys()
    assert all(torch.equal(weights[name], value) for name, value in model.state_dict().items())
    progress = read_checkpoint(run_dir / "checkpoints" / "ckpt-00000002.pt", "cpu")["progress"]
    assert (progress["step"], progress["finished"]) == (2, True)
    events = tensorboard(run_dir)
    assert {tag: scalars(events, tag) for tag in ("final/test_accuracy", "final/test_loss", "final/train_loss")} == {
        "final/test_accuracy": [(2, 0.875)], "final/test_loss": [(2, 0.25)], "final/train_loss": [(2, 1.0)]}


def test_a_run_stopped_before_its_last_evaluation_is_evaluated_by_finish_without_a_ready_line(tmp_path, stop, clock):
    """Resumed from a checkpoint saved at the --max-steps cap before its evaluation (a stop
    landed there): nothing is left to train, so finish evaluates, records the epoch and
    writes model.pt; no step follows, so no `ready in` line."""
    run_dir = tmp_path / "run"
    logger = run_logger(run_dir)
    run = make_run(run_dir, stop, ckpt_every=0, max_steps=3, progress=Progress(epoch=1, step_in_epoch=3, step=3),
                   logger=logger, startup=StartupClock())
    assert run.done()
    evaluate = Evaluate()
    with job_output(tmp_path / "slurm-7.out") as output:
        run.finish(evaluate, run.state["model"])
        printed = output()
    logger.close()
    assert evaluate.calls == 1 and "ready in" not in printed
    assert printed.splitlines()[-1] == f"saved {run_dir / 'model.pt'}; final test accuracy 87.50%"
    assert [(r["epoch"], r["step"]) for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())] == [
        (1, 3)]
    assert read_checkpoint(run_dir / "checkpoints" / "ckpt-00000003.pt", "cpu")["progress"]["finished"] is True


def test_the_ready_line_comes_at_once_before_the_first_epoch_alone_and_steps_are_named_as_the_gradient_all_reduce(
        tmp_path, stop, background):
    """A peer lost during a step (no label of its own) is named as the gradient all-reduce."""
    run = make_run(tmp_path, stop, ckpt_every=0, startup=StartupClock())
    set_background("start-up")
    with job_output(tmp_path / "slurm-7.out") as output:
        run.epoch_begins()
        first = output()
        run.epoch_begins()
        assert output() == first
    assert re.fullmatch(r"ready in \d+\.\d\d s \(imports \d+\.\d\d s, the rest \d+\.\d\d s\)\n", first)
    assert collective_of(RuntimeError("Connection closed by peer")) == "the gradient all-reduce of a training step"


def test_after_the_first_epoch_the_log_says_the_rest_does_not_fit_in_the_job(tmp_path, stop, clock, capsys):
    """Steps of 10 s: 8 steps left need 80 s; the job ends in 2 min and the run stops 80 s
    before that (1 min, twice a step, twice the slowest save: here instant). Said once, after
    the first epoch, on stdout and in the TEXT tab's log."""
    wall = [100.0]
    limit = TimeLimit(JobTimes(0.0, 10000.0, requeue=False), "auto", clock=lambda: wall[0])
    stop.time_limit = limit
    run_dir = tmp_path / "run"
    logger = run_logger(run_dir)
    run = make_run(run_dir, stop, ckpt_every=0, epochs=3, steps_per_epoch=4, logger=logger, time_limit=limit)
    wall[0] = 9880.0  # 2 min left
    for _ in range(2):
        train_epoch(run, clock, Evaluate(), losses=(0.7,) * 4, step_seconds=10.0)
    logger.close()
    line = ("needs about 80 s at this speed, the job ends in 2 min: it saves and stops 80 s before the end, and is "
            "not requeued (the line it prints continues it); --time=3:10:00 would do it in one")
    assert [out for out in capsys.readouterr().out.splitlines() if "at this speed" in out] == [line]
    logged = [(event.step, event.tensor_proto.string_val[0].decode()) for event in tensorboard(run_dir).Tensors(
        "log/text_summary")]
    assert (4, line) in logged


@pytest.mark.parametrize("step_in_epoch, estimated_at, line", [(3, 6, "about 2 min to finish at this speed"),
                                                               (4, 12, "about 60 s to finish at this speed")],
                         ids=["half-left", "a-third-left"])
def test_a_resumed_epoch_gives_the_estimate_only_when_it_trained_half_an_epoch(tmp_path, stop, clock, capsys,
                                                                               step_in_epoch, estimated_at, line):
    """6 steps an epoch, 3 epochs, 10 s a step: resumed with half the epoch left, its end says
    how long the 12 steps left take; with a third left, the next epoch's end says it of 6."""
    run_dir = tmp_path / "run"
    logger = run_logger(run_dir)
    run = make_run(run_dir, stop, ckpt_every=0, epochs=3, steps_per_epoch=6, logger=logger,
                   progress=Progress(step_in_epoch=step_in_epoch, step=step_in_epoch),
                   time_limit=TimeLimit(None, "auto"))
    while run.progress.step < 12:
        train_epoch(run, clock, Evaluate(), losses=(0.7,) * (6 - run.progress.step_in_epoch), step_seconds=10.0)
    logger.close()
    assert [out for out in capsys.readouterr().out.splitlines() if "at this speed" in out] == [line]
    logged = [event.step for event in tensorboard(run_dir).Tensors("log/text_summary")
              if event.tensor_proto.string_val[0].decode() == line]
    assert logged == [estimated_at]


def test_a_stop_at_an_epochs_last_step_saves_before_its_evaluation(tmp_path, stop):
    run = make_run(tmp_path, stop, ckpt_every=0, steps_per_epoch=2)
    after_step(run)
    stop.received = signal.SIGUSR1  # arrives during the epoch's last step
    evaluate = Evaluate()
    with pytest.raises(Stopped) as stopped:
        after_step(run)
        end_epoch(run, evaluate)
    path = tmp_path / "checkpoints" / "ckpt-00000002.pt"
    assert stopped.value.args == (path,) and evaluate.calls == 0
    progress = read_checkpoint(path, "cpu")["progress"]
    assert (progress["epoch"], progress["step_in_epoch"], progress["last_record"]) == (1, 2, {})


def test_a_stop_asked_for_during_an_evaluation_stops_after_the_epochs_checkpoint_unless_the_run_is_done(tmp_path, stop,
                                                                                                       clock):
    def signal_arrives():
        stop.received = signal.SIGUSR1

    run = make_run(tmp_path / "a", stop, ckpt_every=0, epochs=2, steps_per_epoch=2)
    with pytest.raises(Stopped) as stopped:
        train_epoch(run, clock, Evaluate(then=signal_arrives))
    path = tmp_path / "a" / "checkpoints" / "ckpt-00000002.pt"
    assert stopped.value.args == (path,)
    assert read_checkpoint(path, "cpu")["progress"]["last_record"]["step"] == 2
    stop.received = 0
    last = make_run(tmp_path / "b", stop, ckpt_every=0, epochs=1, steps_per_epoch=2)
    train_epoch(last, clock, Evaluate(then=signal_arrives))  # finishing is quicker than stopping
    assert last.done()


def test_an_epoch_end_at_a_step_already_evaluated_does_not_evaluate_again(tmp_path, stop):
    """A checkpoint saved after its step's evaluation (at the --max-steps cap) carries the
    record: the epoch's end at that step keeps it."""
    record = {"epoch": 1, "step": 2, "test_accuracy": 0.5}
    run = make_run(tmp_path, stop, ckpt_every=0, steps_per_epoch=4,
                   progress=Progress(step_in_epoch=2, step=2, last_record=record))
    evaluate = Evaluate()
    end_epoch(run, evaluate)
    assert evaluate.calls == 0 and run.progress.last_record == record


def test_a_signal_during_a_checkpoint_step_stops_at_that_checkpoint(tmp_path, stop):
    run = make_run(tmp_path, stop, ckpt_every=2)
    after_step(run)
    stop.received = signal.SIGUSR1  # arrives during step 2, which saves anyway
    with pytest.raises(Stopped) as stopped:
        after_step(run)
    assert stopped.value.args == (tmp_path / "checkpoints" / "ckpt-00000002.pt",)
    assert saved(tmp_path) == ["ckpt-00000002.pt"]


def test_weights_that_stopped_being_finite_are_reported_and_not_saved(tmp_path, stop):
    run = make_run(tmp_path, stop, ckpt_every=2)
    after_step(run)
    with torch.no_grad():
        run.state["model"].weight[0, 0] = float("nan")
    with pytest.raises(Diverged) as diverged:
        after_step(run)
    assert str(diverged.value) == "the weights stopped being finite at step 2 (epoch 1)"
    assert saved(tmp_path) == []


def test_every_checkpoint_records_the_images_shape(tmp_path, stop):
    run = make_run(tmp_path, stop, ckpt_every=1, shape=(1, 8, 8))
    after_step(run)
    assert read_checkpoint(tmp_path / "checkpoints" / "ckpt-00000001.pt", "cpu")["shape"] == [1, 8, 8]


def test_interrupt_at_makes_rank_0_signal_itself_after_that_step_and_the_run_stops_a_step_later(tmp_path, live_stop):
    run = make_run(tmp_path, live_stop, ckpt_every=0, interrupt_at="3:USR1")
    for _ in range(2):
        after_step(run)
    assert live_stop.received == 0
    after_step(run)
    assert live_stop.received == signal.SIGUSR1
    with pytest.raises(Stopped) as stopped:
        after_step(run)
    assert stopped.value.args == (tmp_path / "checkpoints" / "ckpt-00000004.pt",)


def test_interrupt_at_is_for_rank_0_alone(tmp_path, live_stop):
    rank_1 = Runtime(1, 1, 2, torch.device("cpu"), "gloo", False)  # (no process group: nothing to reduce)
    run = make_run(tmp_path, live_stop, ckpt_every=0, interrupt_at="1:USR1", rt=rank_1)
    after_step(run)
    assert live_stop.received == 0


# ----------------------------------------------------------------------------- the calls' signatures

@pytest.mark.parametrize("call", [save_checkpoint, RunLogger.__init__, StepProfiler.__init__],
                         ids=lambda call: call.__qualname__)
def test_what_the_run_calls_takes_a_handful_of_things_not_a_long_list(call):
    """The plan and the state the run holds go as objects (RunPlan, RunState, LogPlan), so
    that a reader never counts positions in a list of 10 values."""
    parameters = [name for name in inspect.signature(call).parameters if name != "self"]
    assert len(parameters) <= 6, parameters
