"""ddpkit/run/training_run.py's plan_run alone, a pure function: the batch geometry and the
learning-rate schedule's place and length of a new run, of one resumed in mid-epoch on its
own global batch, of one resumed under another global batch (whose epoch starts again while
the step count goes on), and under the --max-steps cap; the plan cannot be changed.

    python -m pytest tests/unit/test_run_plan.py
"""

import dataclasses

import pytest

from ddpkit.run.checkpoints import Progress
from ddpkit.run.training_run import RunPlan, plan_run

DIGITS = tuple("0123456789")


def plan(progress: Progress | None = None, *, images: int = 4000, world_size: int = 2, batch_size: int = 64,
         epochs: int = 8, max_steps: int = 0) -> RunPlan:
    """The plan of 4,000 images (the sample) on 2 ranks of 64, 8 epochs, from `progress` (a new run)."""
    return plan_run(progress or Progress(), images=images, world_size=world_size, batch_size=batch_size, epochs=epochs,
                    max_steps=max_steps, classes=DIGITS, shape=(1, 28, 28))


def test_a_new_run_plans_every_epoch_from_step_0():
    assert plan() == RunPlan(epochs=8, max_steps=0, batch_size=64, global_batch=128, steps_per_epoch=32,
                             schedule_offset=0, total_steps=256, classes=DIGITS, shape=(1, 28, 28))
    assert plan().last_step == 256


def test_the_last_global_batch_of_an_epoch_is_filled_up():
    """100 images in global batches of 30: 4 steps an epoch, the last one filled up (epoch_shard)."""
    assert plan(images=100, world_size=3, batch_size=10).steps_per_epoch == 4
    assert plan(images=90, world_size=3, batch_size=10).steps_per_epoch == 3


def test_the_step_cap_shortens_the_schedule():
    assert (plan(max_steps=100).total_steps, plan(max_steps=100).last_step) == (100, 100)
    assert plan(max_steps=1000).total_steps == 256  # (a cap past the epochs changes nothing)


def test_a_run_resumed_in_mid_epoch_on_its_own_global_batch_keeps_its_schedule():
    resumed = plan(Progress(epoch=2, step_in_epoch=5, step=37))
    assert (resumed.schedule_offset, resumed.total_steps, resumed.last_step) == (0, 256, 256)


def test_a_run_resumed_under_another_global_batch_runs_a_schedule_of_its_own_steps():
    """Saved in epoch 2 by a global batch of 128 (32 steps an epoch) and resumed with 256 (2 x
    128): epoch 2 starts again at step 32 (checkpoints.resume_from), and the schedule of 8
    epochs of 16 steps counts from step 16, where its own epoch 2 would have started; the
    cap ends it at step 100."""
    resumed = Progress(epoch=2, step_in_epoch=0, step=32)
    wider = plan(resumed, batch_size=128)
    assert (wider.global_batch, wider.steps_per_epoch, wider.schedule_offset, wider.total_steps) == (256, 16, 16, 128)
    assert wider.last_step == 144
    capped = plan(resumed, batch_size=128, max_steps=100)
    assert (capped.total_steps, capped.last_step) == (84, 100)


def test_the_plan_is_a_pure_function_of_its_numbers_and_cannot_change():
    progress = Progress(epoch=3, step_in_epoch=2, step=66)
    first = plan(progress)
    assert plan(progress) == first and progress == Progress(epoch=3, step_in_epoch=2, step=66)
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.total_steps = 1
