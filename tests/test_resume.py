"""Checkpoints, resume and failures, with real processes over Gloo: a run stopped by a real
SIGUSR1 or SIGTERM at several steps (mid-epoch, at an epoch's last step, the first step)
and run again ends bit-identical to an uninterrupted run; damaged, garbage and malicious
newest checkpoints are skipped with a warning (the malicious one runs nothing); a
SIGKILLed rank ends the job quickly with the lost-peer code 4 and an intact checkpoint; a
diverging loss stops the run before bad weights are saved; TensorBoard and
metrics.jsonl carry on without doubled steps.

    python -m pytest tests/test_resume.py
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

from conftest import assert_ok, load_params, read_metrics, read_results, run_as_srun, run_single
from ddpkit.checkpoints import read_checkpoint
from ddpkit.launch import EXIT_DIVERGED, EXIT_LOST_PEER, EXIT_STOPPED

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


def interrupt_and_resume(workdir: Path, at: str) -> list[subprocess.CompletedProcess]:
    first = run_as_srun(2, [*ARGS, "--run-dir", "run", "--interrupt-at", at], cwd=workdir, job_id="")
    for result in first:
        assert result.returncode == EXIT_STOPPED, result.stderr[-2000:]
    step = stopped_at(at)
    assert f"stopping on SIG{at.split(':')[1]} at step {step}" in first[0].stdout
    assert "stopping on another rank's signal" not in first[0].stdout
    assert (workdir / "run" / "checkpoints" / f"ckpt-{step:08d}.pt").is_file()
    second = run_as_srun(2, [*ARGS, "--run-dir", "run"], cwd=workdir, job_id="")
    for result in second:
        assert_ok(result)
    return second


@pytest.mark.parametrize("at", ["13:USR1", "32:TERM", "47:TERM", "1:USR1"],
                         ids=["mid-epoch-USR1", "epoch-end-TERM", "second-epoch-TERM", "first-step-USR1"])
def test_interrupted_run_resumes_bit_identical(workdir, uninterrupted, at):
    second = interrupt_and_resume(workdir, at)
    assert f"resumed from run/checkpoints/ckpt-{stopped_at(at):08d}.pt" in second[0].stdout
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


def test_other_world_size_continues_with_a_warning(workdir):
    first = run_as_srun(2, [*ARGS, "--run-dir", "run", "--interrupt-at", "40:USR1"], cwd=workdir, job_id="")
    assert [r.returncode for r in first] == [EXIT_STOPPED] * 2
    result = run_single([*ARGS, "--run-dir", "run"], cwd=workdir)
    assert_ok(result)
    assert "was written by 2 ranks, this run has 1: the data order changed; continuing from the start of epoch 2" in result.stderr
    assert [m["epoch"] for m in read_metrics(workdir / "run")] == [1, 2]


def test_resume_never_refuses_to_mix_runs(workdir):
    assert run_single([*ARGS, "--run-dir", "run", "--interrupt-at", "3:USR1"], cwd=workdir).returncode == EXIT_STOPPED
    result = run_single([*ARGS, "--run-dir", "run", "--resume", "never"], cwd=workdir)
    assert result.returncode == 2 and "holds checkpoints and --resume is never" in result.stderr


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
