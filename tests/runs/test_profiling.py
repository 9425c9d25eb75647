"""--profile's steps and the line about waiting for the other ranks, with real runs of
mnist_ddp.py (one process, or two ranks over Gloo): a profile cut short by the run's end
names only the steps it recorded and holds no evaluation; a resumed run profiles the steps
after the one it resumed at; when rank 0 of two Gloo ranks waits for the gradient
all-reduce most of each step (its peer slowed), it says so once, from DDP's own timing, and
a single process never does. The rule behind the line: tests/unit/test_gradient_wait.py.

    python -m pytest tests/runs/test_profiling.py
"""

import json
import re
from pathlib import Path

import pytest

from helpers.images import on_folder
from helpers.processes import assert_ok, run_as_srun, run_single

FAST = ["--image-every", "0", "--run-dir", "run"]
TWELVE_STEPS = ["--batch-size", "2"]  # (an epoch of the tiny folder's 24 images)


def trace_names(folder: Path) -> list[str]:
    return [e.get("name") for e in json.loads((folder / "rank-0.json").read_text())["traceEvents"]]


@pytest.mark.slow
def test_a_profile_cut_short_by_the_runs_end_names_only_the_steps_it_recorded(tiny_folder, workdir):
    result = run_single([*on_folder(tiny_folder), *TWELVE_STEPS, "--max-steps", "5", "--profile", "5", *FAST], cwd=workdir)
    assert_ok(result)
    out = result.stdout
    assert re.search(r"^profiling steps 4 to 5 on every rank \(the run ends at step 5\)$", out, re.M), out[-3000:]
    summary = re.search(r"^profile of steps 4 to 5 \(2 steps, [\d.]+ ms a step on rank 0\).* in (\S+) \(open", out, re.M)
    assert summary, out[-3000:]
    folder = Path(summary.group(1))
    assert [f.name for f in (workdir / "run" / "profile").iterdir()] == ["steps-4-5"] == [folder.name]
    # The two steps' forward passes (2 convolutions each), and not the evaluation's (argmax)
    names = trace_names(folder)
    assert names.count("aten::convolution") == 4 and "aten::argmax" not in names


def test_a_profile_that_would_begin_after_the_runs_end_says_so(tiny_folder, workdir):
    result = run_single([*on_folder(tiny_folder), *TWELVE_STEPS, "--max-steps", "3", "--profile", "5", *FAST], cwd=workdir)
    assert_ok(result)
    assert "--profile 5 records nothing: this start trains 3 steps, and a profile begins after 3 of warm-up" \
        in result.stdout, result.stdout[-3000:]
    assert not (workdir / "run" / "profile").exists()


@pytest.mark.slow
def test_a_resumed_run_profiles_the_steps_after_the_one_it_resumed_at(tiny_folder, workdir):
    args = [*on_folder(tiny_folder), *TWELVE_STEPS, "--max-steps", "20", *FAST]
    first = run_single([*args, "--interrupt-at", "6:USR1"], cwd=workdir)
    assert first.returncode == 75, first.stderr[-3000:]
    resumed_at = max(int(p.stem.split("-")[1]) for p in (workdir / "run" / "checkpoints").glob("ckpt-*.pt"))
    assert resumed_at >= 6
    second = run_single([*args, "--profile", "3"], cwd=workdir)
    assert_ok(second)
    first_step = resumed_at + 4  # (after 3 steps of warm-up of this start)
    assert f"profiling steps {first_step} to {first_step + 2} on every rank\n" in second.stdout, second.stdout[-3000:]
    assert [f.name for f in (workdir / "run" / "profile").iterdir()] == [f"steps-{first_step}-{first_step + 2}"]


WAIT_LINE = re.compile(r"^waiting for the other ranks: .*$", re.M)


@pytest.mark.slow
def test_rank_0_says_once_when_it_mostly_waits_for_the_other_ranks(tiny_folder, tmp_path):
    """Rank 1 sleeps 0.3 s before each forward pass (the testing aid AID_SLOW), so rank 0
    computes a few ms a step and waits the rest in the gradient all-reduce, as DDP times it.
    (On 2 CPU cores, 1 image a rank alone left the all-reduce's wait at 24-48 % of the
    forward and backward: too close to the line's threshold for a test.)"""
    args = [*on_folder(tiny_folder), "--epochs", "2", "--batch-size", "4", *FAST]
    results = run_as_srun(2, args, cwd=tmp_path, job_id="", env={"AID_SLOW": "1:0.3"})
    for result in results:
        assert_ok(result)
    out = results[0].stdout
    lines = WAIT_LINE.findall(out)
    assert len(lines) == 1, out[-3000:]  # (once, after the first epoch, not again after the second)
    print(lines[0])
    share = re.search(r"in epoch 1, (\d+) % of rank 0's forward and backward passes went to waiting", lines[0])
    assert share and int(share.group(1)) > 50, lines[0]
    assert "at 4 images a rank, fewer ranks" in lines[0] and "--lr" in lines[0] and "docs/defaults.md" in lines[0]
    assert out.index("epoch   1 |") < out.index(lines[0]) < out.index("epoch   2 |")
    assert not WAIT_LINE.search(results[1].stdout)


def test_a_single_process_never_says_it_waits(tiny_folder, workdir):
    result = run_single([*on_folder(tiny_folder), "--epochs", "2", "--batch-size", "4", *FAST], cwd=workdir)
    assert_ok(result)
    assert not WAIT_LINE.search(result.stdout)
