"""Checkpoints, resume and failures, with real processes over Gloo: a run stopped by a real
SIGUSR1 or SIGTERM at several steps (mid-epoch, at an epoch's last step, the first step)
and run again ends bit-identical to an uninterrupted run; damaged, garbage and malicious
newest checkpoints are skipped with a warning (the malicious one runs nothing); a
SIGKILLed rank ends the job quickly with the lost-peer code 4 and an intact checkpoint; a
diverging loss stops the run before bad weights are saved; TensorBoard and
metrics.jsonl carry on without doubled steps; a run stopped in mid-epoch and finished on
fewer ranks logs the epoch's train_loss of the run that kept its ranks.

    python -m pytest tests/runs/test_resume.py
"""

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ddpkit.job.contract import EXIT_DIVERGED, EXIT_LOST_PEER, EXIT_STOPPED
from ddpkit.run.checkpoints import read_checkpoint
from helpers.images import load_params, on_folder, read_metrics, read_results
from helpers.processes import assert_ok, run_as_srun, run_single

# 4000 images, 2 ranks x 64: 32 steps an epoch; 2 epochs, 64 steps; dropout exercises the RNG state.
ARGS = ["--epochs", "2", "--batch-size", "64", "--dropout", "0.2", "--ckpt-every", "10"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    workdir = tmp_path_factory.mktemp("full")
    for result in run_as_srun(2, [*ARGS, "--run-dir", "run"], cwd=workdir, job_id="100"):
        assert_ok(result)
    return workdir / "run"


def assert_same_run(run_dir: Path, reference: Path) -> None:
    a, b = load_params(run_dir), load_params(reference)
    assert all(torch.equal(a[k], b[k]) for k in a), "parameters differ from the uninterrupted run"
    assert read_results(run_dir) == read_results(reference)


def stopped_at(at: str) -> int:
    """The step a run signalled after step N stops at: the ranks agree on each step while the
    next one runs, so N+1, on every rank alike; but a checkpoint step (every 10 here) and an
    epoch's end (every 32) read their own agreement before saving, so there N."""
    step = int(at.split(":")[0])
    return step if step % 32 == 0 or step % 10 == 0 else step + 1


def interrupt_and_resume(workdir: Path, at: str, env: dict[str, str] | None = None) -> list[subprocess.CompletedProcess]:
    first = run_as_srun(2, [*ARGS, "--run-dir", "run", "--interrupt-at", at], cwd=workdir, job_id="")
    for result in first:
        assert result.returncode == EXIT_STOPPED, result.stderr[-2000:]
    step = stopped_at(at)
    assert f"stopping on SIG{at.split(':')[1]} at step {step}" in first[0].stdout
    assert "stopping on another rank's signal" not in first[0].stdout
    assert (workdir / "run" / "checkpoints" / f"ckpt-{step:08d}.pt").is_file()
    second = run_as_srun(2, [*ARGS, "--run-dir", "run"], cwd=workdir, job_id="", env=env)
    for result in second:
        assert_ok(result)
    return second


# The resume of 47:TERM on a file system that shows rank 1 a stale handle of the checkpoint
# for its first three opens (NFS, just after rank 0's node renamed it into place): it retries.
STALE = {"AID_ESTALE_OPENS": "1:3:ckpt-*.pt"}


@pytest.mark.parametrize("at, env", [("13:USR1", None), ("32:TERM", None), ("47:TERM", STALE), ("1:USR1", None)],
                         ids=["mid-epoch-USR1", "epoch-end-TERM", "second-epoch-TERM-rank-1-ESTALE", "first-step-USR1"])
def test_interrupted_run_resumes_bit_identical(workdir, uninterrupted, at, env):
    second = interrupt_and_resume(workdir, at, env)
    assert f"resumed from run/checkpoints/ckpt-{stopped_at(at):08d}.pt" in second[0].stdout
    if env:
        assert second[1].stderr.count(": ESTALE\n") == 3, second[1].stderr[-2000:]
    assert_same_run(workdir / "run", uninterrupted)


def test_tensorboard_and_metrics_carry_on_without_doubled_steps(workdir, uninterrupted):
    interrupt_and_resume(workdir, "40:USR1")
    events = EventAccumulator(str(workdir / "run"), size_guidance={"scalars": 0})
    events.Reload()
    batch_steps = [e.step for e in events.Scalars("train/batch_loss")]
    assert batch_steps == [50]  # --log-every 50 over 64 steps, once despite the replayed steps 41-50
    assert [e.step for e in events.Scalars("test/accuracy")] == [32, 64]
    assert [m["epoch"] for m in read_metrics(workdir / "run")] == [1, 2]


def plant(path: Path, kind: str, real: Path, marker: Path) -> None:
    if kind == "truncated":
        data = real.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif kind == "garbage":
        path.write_bytes(os.urandom(4096))
    else:  # a pickle that runs a command when unpickled, saved the way a checkpoint is
        class Payload:
            def __reduce__(self):
                return (os.system, (f"touch {marker}",))
        torch.save({"format": 1, "model": Payload()}, path)
        assert not marker.exists()


@pytest.mark.parametrize("kind", ["truncated", "garbage", "pickle-bomb"])
def test_bad_newest_checkpoint_falls_back(workdir, uninterrupted, kind):
    first = run_as_srun(2, [*ARGS, "--run-dir", "run", "--interrupt-at", "13:USR1"], cwd=workdir, job_id="")
    assert [r.returncode for r in first] == [EXIT_STOPPED] * 2
    checkpoints = workdir / "run" / "checkpoints"
    bad, marker = checkpoints / "ckpt-00000020.pt", workdir / "payload-ran"
    plant(bad, kind, checkpoints / "ckpt-00000014.pt", marker)  # stopped one step after the signal
    second = run_as_srun(2, [*ARGS, "--run-dir", "run"], cwd=workdir, job_id="")
    for result in second:
        assert_ok(result)
    assert "warning: skipping checkpoint run/checkpoints/ckpt-00000020.pt" in second[0].stderr
    assert "resumed from run/checkpoints/ckpt-00000014.pt" in second[0].stdout
    assert not marker.exists(), "the planted pickle ran its payload"
    assert_same_run(workdir / "run", uninterrupted)


def test_pickle_bomb_given_explicitly_is_refused(workdir):
    bomb, marker = workdir / "bomb.pt", workdir / "payload-ran"
    plant(bomb, "pickle-bomb", bomb, marker)
    result = run_single(["--resume", str(bomb), "--run-dir", "run"], cwd=workdir)
    assert result.returncode == 2
    assert result.stderr.startswith(f"mnist_ddp.py: error: cannot resume from {bomb}: Weights only load failed")
    assert not marker.exists()


def test_checkpoint_from_another_configuration(workdir):
    first = run_single([*ARGS, "--run-dir", "run", "--interrupt-at", "5:TERM"], cwd=workdir)
    assert first.returncode == EXIT_STOPPED
    result = run_single([*ARGS, "--run-dir", "run", "--batch-size", "32", "--lr", "0.01"], cwd=workdir)
    assert result.returncode == 2
    assert "--batch-size 64 there, 32 here; --lr 0.003 there, 0.01 here" in result.stderr
    assert result.stderr.count("\n") == 1


def test_another_world_size_with_batch_size_per_rank_restarts_its_epoch_and_says_why(workdir):
    """--batch-size N per rank (weak scaling): 1 rank after 2 halves the global batch, so the
    batches differ, and the interrupted epoch starts again from its saved start."""
    first = run_as_srun(2, [*ARGS, "--run-dir", "run", "--interrupt-at", "40:USR1"], cwd=workdir, job_id="")
    assert [r.returncode for r in first] == [EXIT_STOPPED] * 2
    result = run_single([*ARGS, "--run-dir", "run"], cwd=workdir)
    assert_ok(result)
    assert ("was written by 2 ranks, this run has 1: its global batch was 128, this run's is 64 (--batch-size per "
            "rank); continuing from the start of epoch 2") in result.stderr
    assert [m["epoch"] for m in read_metrics(workdir / "run")] == [1, 2]


# ----------------------------------------------------------------------------- another world size, in mid-epoch

# The sample's 4,000 images at the default global batch of 128: 32 steps an epoch on any
# number of ranks; a checkpoint every 4 steps, all kept, to compare step by step.
SAME_BATCH = ["--epochs", "2", "--dropout", "0", "--ckpt-every", "4", "--keep-ckpts", "100"]
# How far the weights of a run that changed its world size in mid-epoch may stray from
# the run that kept it, over the 22 steps to the end (docs/recovery.md: measured up to 5e-8
# here over 22 steps, 4e-4 over 106; two runs started on 1 and 2 ranks differ by 2e-2 at step 150).
STRAY = 1e-5


def run_on(ranks: int, args: list[str], cwd: Path) -> list[subprocess.CompletedProcess]:
    return [run_single(args, cwd=cwd, OMP_NUM_THREADS="1")] if ranks == 1 else run_as_srun(ranks, args, cwd=cwd, job_id="")


@pytest.fixture(scope="module")
def kept_world_size(tmp_path_factory) -> Path:
    """Runs of 1 and 4 ranks that never stopped, in <dir>/1 and <dir>/4."""
    workdir = tmp_path_factory.mktemp("kept")
    for ranks in (1, 4):
        for result in run_on(ranks, [*SAME_BATCH, "--run-dir", str(ranks)], cwd=workdir):
            assert_ok(result)
    return workdir


def checkpoint_weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return read_checkpoint(run_dir / "checkpoints" / f"ckpt-{step:08d}.pt", "cpu")["model"]


@pytest.mark.parametrize("before, after", [(1, 2), (4, 2)], ids=["1-then-2", "4-then-2"])
@pytest.mark.slow
def test_a_run_goes_on_in_mid_epoch_on_another_number_of_ranks_as_if_it_had_kept_its_own(workdir, kept_world_size,
                                                                                         before, after):
    """Stopped at step 42 (epoch 2, 10 steps in) on `before` ranks, continued on `after`: it
    goes on at step 42, redoes no step, sets no checkpoint aside, logs each epoch once, and
    its weights stay within STRAY of the run that kept `before` ranks at every checkpoint to
    the end, with the same test accuracy."""
    stopped = run_on(before, [*SAME_BATCH, "--run-dir", "run", "--interrupt-at", "41:USR1"], cwd=workdir)
    assert [r.returncode for r in stopped] == [EXIT_STOPPED] * before
    assert "stopping on SIGUSR1 at step 42" in stopped[0].stdout
    went_on = run_on(after, [*SAME_BATCH, "--run-dir", "run"], cwd=workdir)
    for result in went_on:
        assert_ok(result)
    out = went_on[0].stdout
    assert (f"run/checkpoints/ckpt-00000042.pt was written by {before} ranks, this run has {after}: the same global "
            "batch of 128, so the run goes on at step 42 (epoch 2, step 10 of it)") in out
    assert "warning" not in went_on[0].stderr, went_on[0].stderr
    run_dir, kept = workdir / "run", kept_world_size / str(before)
    assert not (run_dir / "checkpoints" / "superseded").exists()
    assert [(m["epoch"], m["step"]) for m in read_metrics(run_dir)] == [(1, 32), (2, 64)]
    strays = []
    for step in range(44, 65, 4):
        ours, theirs = checkpoint_weights(run_dir, step), checkpoint_weights(kept, step)
        strays.append(max(float((ours[k] - theirs[k]).abs().max()) for k in ours))
        for name in ours:
            torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=STRAY, msg=f"step {step}, {name}")
    print(f"{before} then {after} ranks: largest difference from the run that kept {before} at steps 44-64: "
          + ", ".join(f"{d:.1e}" for d in strays))
    accuracy, kept_accuracy = read_metrics(run_dir)[-1]["test_accuracy"], read_metrics(kept)[-1]["test_accuracy"]
    assert abs(accuracy - kept_accuracy) <= 0.002, (accuracy, kept_accuracy)


@pytest.mark.slow
def test_a_mid_epoch_resume_on_fewer_ranks_logs_the_epochs_train_loss_of_the_run_that_kept_its_own(workdir,
                                                                                                      tiny_folder):
    """The epoch's train_loss is the mean over all its images, those trained before the stop
    too: stopped at step 2 of 3 on 2 ranks and finished on 1, the one rank carries on both
    saved ranks' loss sums, and the epoch's line and metrics.jsonl give the figure of the run
    that kept 2 ranks (within rounding: the last step's sums are added in another order)."""
    args = [*on_folder(tiny_folder), "--global-batch", "8", "--epochs", "1", "--dropout", "0"]  # 24 images: 3 steps
    for result in run_as_srun(2, [*args, "--run-dir", "kept"], cwd=workdir, job_id=""):
        assert_ok(result)
    stopped = run_as_srun(2, [*args, "--run-dir", "run", "--interrupt-at", "1:USR1"], cwd=workdir, job_id="")
    assert [r.returncode for r in stopped] == [EXIT_STOPPED] * 2 and "at step 2" in stopped[0].stdout, stopped[0].stdout
    went_on = run_on(1, [*args, "--run-dir", "run"], cwd=workdir)[0]
    assert_ok(went_on)
    assert "so the run goes on at step 2 (epoch 1, step 2 of it)" in went_on.stdout
    ours, theirs = read_metrics(workdir / "run"), read_metrics(workdir / "kept")
    assert [m["step"] for m in ours] == [m["step"] for m in theirs] == [3]
    assert ours[0]["train_loss"] == pytest.approx(theirs[0]["train_loss"], rel=1e-6, abs=0)
    assert f"train loss {theirs[0]['train_loss']:.4f}" in went_on.stdout


def test_a_checkpoint_from_before_the_global_batch_was_saved_restarts_its_epoch_at_another_world_size(workdir):
    """Such a file does not say what its steps counted in: the interrupted epoch starts again
    from its saved start, with the warning, as it did before."""
    assert run_single([*SAME_BATCH, "--run-dir", "run", "--interrupt-at", "41:USR1"], cwd=workdir).returncode == EXIT_STOPPED
    path = workdir / "run" / "checkpoints" / "ckpt-00000042.pt"
    ckpt = read_checkpoint(path, "cpu")
    del ckpt["global_batch"]
    torch.save(ckpt, path)
    went_on = run_as_srun(2, [*SAME_BATCH, "--run-dir", "run"], cwd=workdir, job_id="")
    for result in went_on:
        assert_ok(result)
    assert ("run/checkpoints/ckpt-00000042.pt was written by 1 ranks, this run has 2: the data order changed; "
            "continuing from the start of epoch 2") in went_on[0].stderr
    assert [(m["epoch"], m["step"]) for m in read_metrics(workdir / "run")] == [(1, 32), (2, 64)]
    assert (workdir / "run" / "checkpoints" / "superseded").is_dir()  # steps 33-42 are trained again


def test_resume_never_refuses_to_mix_runs(workdir):
    assert run_single([*ARGS, "--run-dir", "run", "--interrupt-at", "3:USR1"], cwd=workdir).returncode == EXIT_STOPPED
    result = run_single([*ARGS, "--run-dir", "run", "--resume", "never"], cwd=workdir)
    assert result.returncode == 2 and "holds checkpoints and --resume is never" in result.stderr


@pytest.mark.slow
def test_killed_rank_ends_the_job(workdir):
    """SIGKILL rank 1 mid-training: rank 0 must fail on its own, well inside --dist-timeout."""
    procs = run_as_srun(2, ["--epochs", "50", "--ckpt-every", "5", "--dist-timeout", "60", "--run-dir", "run"],
                        cwd=workdir, job_id="", detach=True)
    checkpoints = workdir / "run" / "checkpoints"
    deadline = time.monotonic() + 120
    while not list(checkpoints.glob("ckpt-*.pt")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert list(checkpoints.glob("ckpt-*.pt")), "training never reached a checkpoint"
    procs[1].send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    procs[0].wait(timeout=120)  # a hang fails the test here
    seconds = time.monotonic() - killed_at
    print(f"rank 0 ended {seconds:.1f} s after rank 1 was killed")
    procs[1].wait(timeout=10)
    assert procs[0].returncode == EXIT_LOST_PEER and procs[1].returncode == -signal.SIGKILL
    errors = [line for line in procs[0].communicate()[1].splitlines() if "error" in line]
    assert len(errors) == 1 and re.match(r"mnist_ddp.py \[rank 0/2 on \S+\]: error: lost contact with another rank during .* at step \d+ "
                                         r"\(epoch \d+\): a peer probably died or hung \(", errors[0]), errors
    newest = sorted(checkpoints.glob("ckpt-*.pt"))[-1]
    assert read_checkpoint(newest, "cpu")["progress"]["step"] > 0
    procs[1].communicate()


def test_diverging_loss_stops_before_bad_weights_are_saved(workdir):
    results = run_as_srun(2, ["--lr", "1e5", "--epochs", "1", "--ckpt-every", "1", "--run-dir", "run"], cwd=workdir, job_id="")
    for result in results:
        assert result.returncode == EXIT_DIVERGED, result.stderr[-2000:]
    assert "mnist_ddp.py [rank 0/2 on " in results[0].stderr and "]: error: the loss stopped being finite at step " in results[0].stderr
    assert f"with a lower learning rate: srun --nodes=1 --ntasks=2 {shlex.quote(sys.executable)} " in results[0].stderr
    assert "--lr 3.33e+04 --allow-changes" in results[0].stderr
    saved = sorted((workdir / "run" / "checkpoints").glob("ckpt-*.pt"))
    assert saved
    for path in saved:
        model = read_checkpoint(path, "cpu")["model"]
        assert all(torch.isfinite(v).all() for v in model.values()), f"{path} holds non-finite weights"


@pytest.mark.slow
def test_a_mirrored_run_resumes_bit_identical_in_the_middle_of_an_epoch(tiny_folder, tmp_path):
    """--mirror-images on a folder: each image mirrored in every other epoch and each test
    image scored with its mirror. 2 ranks stopped by SIGUSR1 in the middle of the second
    epoch (mirrored the other way from the first) and resumed end where the run that was
    never stopped ends, bit for bit."""
    args = [*on_folder(tiny_folder), "--mirror-images", "--epochs", "3", "--batch-size", "4", "--ckpt-every", "1"]
    for result in run_as_srun(2, [*args, "--run-dir", "whole"], cwd=tmp_path, job_id=""):
        assert_ok(result)
    for result in run_as_srun(2, [*args, "--run-dir", "run", "--interrupt-at", "4:USR1"], cwd=tmp_path, job_id=""):
        assert result.returncode == EXIT_STOPPED, result.stderr[-2000:]
    second = run_as_srun(2, [*args, "--run-dir", "run"], cwd=tmp_path, job_id="")
    for result in second:
        assert_ok(result)
    assert "resumed from run/checkpoints/ckpt-00000004.pt" in second[0].stdout
    assert_same_run(tmp_path / "run", tmp_path / "whole")
