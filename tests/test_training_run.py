"""ddpkit/training_run.py in one process, with a real (tiny) model, AdamW, checkpoints on
disk and the real per-step agreement: EpochLoss, checkpoints every N steps, a stop signal
acted on one step later with a checkpoint, a loss that is not finite reported with its step
and nothing saved, where the run stands (done(), schedule_step), an epoch's train_loss that
covers that epoch alone, and --ckpt-minutes counted from the last checkpoint.

    python -m pytest tests/test_training_run.py
"""

import signal
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from ddpkit.checkpoints import Progress, read_checkpoint
from ddpkit.distributed import Runtime
from ddpkit.launch import Diverged, Stopped, StopSignals
from ddpkit.options import RunOptions
from ddpkit.recovery import CheckpointClock
from ddpkit.runlog import NullLogger
from ddpkit.training_run import EpochLoss, TrainingRun

ONE = Runtime(0, 0, 1, torch.device("cpu"), "none", True)


def test_epoch_loss_weighs_each_step_by_its_images():
    loss = EpochLoss(torch.zeros(2, dtype=torch.float64))
    assert loss.mean_over_ranks() == 0.0  # nothing yet
    loss.add(torch.tensor(0.5), 10)
    loss.add(torch.tensor(1.5), 30)
    assert loss.mean_over_ranks() == pytest.approx(1.25)
    assert loss.sums.tolist() == pytest.approx([50.0, 40.0])  # the mean leaves the sums as they are


@pytest.fixture
def stop():
    signals = StopSignals()
    signals.restore()  # the test's own handlers back at once; the test sets .received by hand
    return signals


def make_run(tmp_path, stop, *, ckpt_every=2, epochs=2, max_steps=0, steps_per_epoch=5, progress=None,
             schedule_offset=0) -> TrainingRun:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    options = RunOptions(ckpt_every=ckpt_every, ckpt_minutes=0, keep_ckpts=10)
    return TrainingRun(options, ONE, stop, tmp_path, {"model": model, "optimizer": optimizer}, {"lr": 0.01},
                       ("a", "b"), progress or Progress(), torch.zeros(2, dtype=torch.float64), epochs, max_steps, steps_per_epoch,
                       schedule_offset, epochs * steps_per_epoch, NullLogger())


def saved(tmp_path) -> list[str]:
    folder = tmp_path / "checkpoints"
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_a_checkpoint_every_2_steps(tmp_path, stop):
    run = make_run(tmp_path, stop, ckpt_every=2)
    for _ in range(3):
        run.step_done(torch.tensor(0.7), 4)
    assert saved(tmp_path) == ["ckpt-00000002.pt"]
    ckpt = read_checkpoint(tmp_path / "checkpoints" / "ckpt-00000002.pt", "cpu")
    assert (ckpt["progress"]["step"], ckpt["progress"]["step_in_epoch"]) == (2, 2)
    assert ckpt["rank_states"][0]["loss_sum"].tolist() == pytest.approx([0.7 * 8, 8])
    assert (run.progress.step, run.loss.images) == (3, 12)


def test_a_stop_signal_ends_the_run_one_step_later_with_a_checkpoint(tmp_path, stop):
    run = make_run(tmp_path, stop, ckpt_every=0)  # checkpoints at epoch ends only
    run.step_done(torch.tensor(0.7), 4)
    stop.received = signal.SIGUSR1  # arrives during step 2
    run.step_done(torch.tensor(0.7), 4)  # step 2: its agreement starts, the run goes on
    with pytest.raises(Stopped) as stopped:
        run.step_done(torch.tensor(0.7), 4)  # step 3 reads step 2's agreement: save and stop
    path = tmp_path / "checkpoints" / "ckpt-00000003.pt"
    assert stopped.value.args == (path,)
    assert saved(tmp_path) == ["ckpt-00000003.pt"]
    assert read_checkpoint(path, "cpu")["progress"]["step"] == 3


def test_a_loss_that_is_not_finite_is_reported_with_its_step_and_not_saved(tmp_path, stop):
    run = make_run(tmp_path, stop, ckpt_every=2)
    run.step_done(torch.tensor(float("nan")), 4)
    with pytest.raises(Diverged) as diverged:
        run.step_done(torch.tensor(0.7), 4)  # a checkpoint step, but the bad step comes first
    assert str(diverged.value) == "the loss stopped being finite at step 1 (epoch 1)"
    assert saved(tmp_path) == []


def test_a_loss_that_is_not_finite_at_a_checkpoint_step_is_caught_before_saving(tmp_path, stop):
    run = make_run(tmp_path, stop, ckpt_every=1)
    with pytest.raises(Diverged) as diverged:
        run.step_done(torch.tensor(float("inf")), 4)
    assert str(diverged.value) == "the loss stopped being finite at step 1 (epoch 1)"
    assert saved(tmp_path) == []


def test_done_follows_the_epochs_and_the_step_cap(tmp_path, stop):
    assert not make_run(tmp_path, stop, epochs=2).done()
    assert not make_run(tmp_path, stop, epochs=2, progress=Progress(epoch=2, step_in_epoch=4, step=9)).done()
    assert make_run(tmp_path, stop, epochs=2, progress=Progress(epoch=3, step=10)).done()
    assert not make_run(tmp_path, stop, max_steps=7, progress=Progress(step=6, step_in_epoch=1, epoch=2)).done()
    assert make_run(tmp_path, stop, max_steps=7, progress=Progress(step=7, step_in_epoch=2, epoch=2)).done()


def test_schedule_step_counts_from_the_offset(tmp_path, stop):
    # Resumed under another world size: the step count goes on from the checkpoint's, the
    # schedule runs in this world size's steps.
    run = make_run(tmp_path, stop, ckpt_every=0, progress=Progress(epoch=2, step=12), schedule_offset=7)
    assert run.schedule_step == 5
    run.step_done(torch.tensor(0.7), 4)
    assert (run.progress.step, run.schedule_step) == (13, 6)


def evaluation(accuracy: float = 0.5) -> SimpleNamespace:
    """What the recipe's evaluate gives TrainingRun: its metrics and the test images counted."""
    return SimpleNamespace(metrics={"loss": 1.0, "accuracy": accuracy}, count=10)


def test_the_train_loss_of_a_later_epoch_covers_that_epoch_alone(tmp_path, stop):
    run = make_run(tmp_path, stop, ckpt_every=0, epochs=3, steps_per_epoch=2)
    records = []
    for losses in ((1.0, 3.0), (0.5, 0.25), (0.1, 0.1)):
        for loss in losses:
            run.step_done(torch.tensor(loss), 4)
        run.epoch_done(evaluation)
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
        run.step_done(torch.tensor(0.7), 4)
    # The minute is up at step 4 (60 s); the next step saves (75 s) and the clock starts
    # again there: up at step 9 (135 s), saved at step 10, and so on.
    assert saved(tmp_path) == [f"ckpt-{s:08d}.pt" for s in (5, 10, 15, 20)]
