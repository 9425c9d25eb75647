"""The testing aids (tests/aids/training_aids.py) reach a run however the tests start it:
forked from the server that imported ddpkit before the run's environment was known, and
started afresh, where sitecustomize.py brings them in. AID_STEP_SECONDS gives every step
at least its seconds and changes no result.

    python -m pytest tests/runs/test_training_aids.py
"""

import pytest

from helpers.images import on_folder, read_metrics, read_results
from helpers.processes import assert_ok, run_as_srun, run_single

# The tiny folder's 24 training images, 8 a step: 3 steps an epoch.
ARGS = ["--batch-size", "8", "--epochs", "2", "--image-every", "0"]


@pytest.mark.slow
def test_step_seconds_makes_every_step_of_a_forked_run_last_that_long_and_changes_no_result(tiny_folder, workdir):
    slow = run_single([*on_folder(tiny_folder), *ARGS, "--run-dir", "slow"], cwd=workdir, AID_STEP_SECONDS="0.5")
    assert_ok(slow)
    plain = run_single([*on_folder(tiny_folder), *ARGS, "--run-dir", "plain"], cwd=workdir)
    assert_ok(plain)
    assert [record["epoch_s"] >= 1.5 for record in read_metrics(workdir / "slow")] == [True, True]
    assert read_results(workdir / "slow") == read_results(workdir / "plain")


@pytest.mark.slow
def test_ranks_started_afresh_get_the_aids(tiny_folder, workdir):
    """2 ranks of 4 images, started afresh (not forked) with AID_STEP_SECONDS=0.4: each epoch
    lasts the 3 steps' 1.2 s at least."""
    args = [*on_folder(tiny_folder), *ARGS, "--batch-size", "4", "--log-every", "1"]
    procs = run_as_srun(2, [*args, "--run-dir", "aided"], cwd=workdir, job_id="", detach=True,
                        env={"AID_STEP_SECONDS": "0.4"})
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
    assert [record["epoch_s"] >= 1.2 for record in read_metrics(workdir / "aided")] == [True, True]
