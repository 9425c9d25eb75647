"""Seeing inside a running job, with real processes over Gloo: a rank hung in Python is named
with its host and line in one line before --dist-timeout, every rank's stacks are kept and the
run then goes on from its checkpoint; a rank stuck in a backward hook that is neither the
recipe's nor torch's is named at the hook's line, and not as waiting in a collective (on a
GPU, from autograd's own thread); a rank that holds the others up with a slow save is
named with its line, and the run goes on; a rank stuck with the interpreter's lock held is
named from its faulthandler stacks; a slowed rank is named as the straggler and the speed scalars reach
TensorBoard, and a clean run leaves no RUN_DIR/hangs; a rank that stops at start-up is named
before the first step, and a rank whose peer never joins ends within --dist-timeout; --profile writes traces and a table
without changing the run's results, and RUN_DIR/profile-now profiles a running run.
ddpkit/hangs.py and stragglers.py at unit level: tests/unit/test_hangs_and_stragglers.py; the
SIGSTOP of a rank under a real Slurm: tests/cluster/one_node/test_recovery_on_slurm.py.

    python -m pytest tests/runs/test_hangs.py
"""

import json
import os
import re
import socket
import time
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ddpkit.job.contract import EXIT_LOST_PEER
from helpers.images import load_params, on_folder, read_results
from helpers.processes import ROOT, assert_ok, free_port, run_as_srun, run_single

HOST = socket.gethostname()


def run_with_rank_1_hung(args: list[str], cwd: Path, how: str = "", env: dict[str, str] | None = None) -> tuple[int, str]:
    """Two srun-style ranks with rank 1 hung as step 7 ends (the testing aid AID_HANG=1:7<how>), or
    hung by what `env` sets up instead: rank 0's exit code and stderr, once it gave up; then
    rank 1 is killed, as srun would."""
    env = env or {"AID_HANG": "1:7" + how}
    procs = run_as_srun(2, args, cwd=cwd, job_id="", detach=True, env=env)
    try:
        _, err = procs[0].communicate(timeout=150)
    finally:
        procs[1].kill()
    procs[1].communicate()
    return procs[0].returncode, err


@pytest.mark.slow
def test_a_rank_hung_in_python_is_named_with_its_host_and_line_and_the_run_then_goes_on(tiny_folder, tmp_path):
    """Rank 1 hangs in Python as step 7 ends (a test-only hook). Before --dist-timeout (40 s),
    one line on rank 0 names rank 1, its host, the file and line it is at, and the collective
    rank 0 waits in; both ranks' stacks are in RUN_DIR/hangs. Rank 0 then ends with the lost
    peer's code, and the same command continues from the newest checkpoint to the end."""
    args = [*on_folder(tiny_folder), "--batch-size", "4", "--epochs", "4", "--ckpt-every", "2", "--dist-timeout", "40",
            "--hang-after", "5", "--run-dir", "run"]
    code, err = run_with_rank_1_hung(args, tmp_path, "")
    assert code == EXIT_LOST_PEER, err[-3000:]
    verdict = re.search(r"^hang after step (\d+): rank 1 on (\S+) is at tests/aids/training_aids\.py:\d+ in step_done; "
                        r"rank\(s\) 0 wait for it in the gradient all-reduce of a training step for (\d+) s; every "
                        r"rank's stacks: (\S+); --dist-timeout ends the wait$", err, re.M)
    assert verdict, err[-3000:]
    print(verdict.group(0))
    assert verdict.group(2) == HOST and int(verdict.group(1)) in (6, 7) and int(verdict.group(3)) < 40
    assert err.index(verdict.group(0)) < err.index("error: lost contact with another rank")
    folder = Path(verdict.group(4))
    assert folder.parent == (tmp_path / "run" / "hangs").resolve()
    assert (folder / "verdict.txt").read_text() == verdict.group(0).removesuffix("; --dist-timeout ends the wait") + "\n"
    for rank in (0, 1):
        stacks = (folder / f"rank-{rank}-{HOST}.txt").read_text()
        assert "(most recent call first)" in stacks and "mnist_ddp.py\", line" in stacks
        print(stacks.splitlines()[0])
    assert re.search(r'File "\S+/tests/aids/training_aids\.py", line \d+ in step_done', (folder / f"rank-1-{HOST}.txt").read_text())
    assert re.search(r"waits in the gradient all-reduce of a training step .* at mnist_ddp\.py:\d+ in train_step",
                     (folder / f"rank-0-{HOST}.txt").read_text())
    healed = run_as_srun(2, args, cwd=tmp_path, job_id="")
    for result in healed:
        assert_ok(result)
    assert re.search(r"^resumed from \S+/ckpt-00000006\.pt: epoch 3, step 6 ", healed[0].stdout, re.M), healed[0].stdout
    assert [r["epoch"] for r in read_results(tmp_path / "run")] == [1, 2, 3, 4]


@pytest.mark.slow
def test_a_rank_stuck_in_a_c_call_that_holds_the_interpreter_is_named_from_its_faulthandler_stacks(tiny_folder, tmp_path):
    """Rank 1 hangs in a C call that keeps Python's lock (a test-only hook): its watchdog thread
    cannot run, but faulthandler, armed from it, writes its stacks from C, and rank 0's line
    names where it is from them."""
    args = [*on_folder(tiny_folder), "--batch-size", "4", "--epochs", "4", "--dist-timeout", "30", "--hang-after", "5",
            "--run-dir", "run"]
    code, err = run_with_rank_1_hung(args, tmp_path, ":gil")
    verdict = re.search(r"^hang after step \d+: rank 1 on \S+ is alive but silent \(state S, [^)]*\), at "
                        r"tests/aids/training_aids\.py:\d+ in step_done \(faulthandler's stacks\); rank\(s\) 0 wait", err, re.M)
    assert verdict and code == EXIT_LOST_PEER, err[-3000:]
    print(verdict.group(0))


@pytest.mark.slow
def test_a_rank_that_stops_at_start_up_is_named_before_the_first_step_and_the_other_ends_with_exit_4(tiny_folder, tmp_path):
    """Rank 1 stops itself (SIGSTOP) at start-up, before any training step, as it wraps its
    model in DDP (a testing aid, AID_STOP). Rank 0 waits for it in DDP's broadcast of rank 0's
    weights; past --hang-after a line names rank 1, stopped, and rank 0's wait, before any step
    ran, and --dist-timeout then ends rank 0 with the lost peer's code."""
    args = [*on_folder(tiny_folder), "--batch-size", "4", "--epochs", "1", "--dist-timeout", "20", "--hang-after", "5",
            "--run-dir", "run"]
    code, err = run_with_rank_1_hung(args, tmp_path, env={"AID_STOP": "1"})
    assert code == EXIT_LOST_PEER, err[-3000:]
    verdict = re.search(r"^hang at start-up, before the first step: rank 1 on (\S+) is stopped \(state T, [^;]*; rank\(s\) 0 "
                        r"wait for it in (.+) for \d+ s; every rank's stacks: (\S+); --dist-timeout ends the wait$", err, re.M)
    assert verdict and verdict.group(1) == HOST, err[-3000:]
    print(verdict.group(0))
    assert err.index(verdict.group(0)) < err.index("error: ")
    assert re.search(r"error: (lost contact with another rank during |waited for the lock )", err)
    assert (Path(verdict.group(3)) / "verdict.txt").exists()
    assert re.match(r"rank 0 on \S+ \(pid \d+\), at start-up, before the first step: waits in ",
                    (Path(verdict.group(3)) / f"rank-0-{HOST}.txt").read_text())
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_a_rank_whose_peer_never_joins_ends_with_exit_4_naming_the_rendezvous(tmp_path):
    """Rank 0 of 2, whose rank 1 never starts: the rendezvous waits at most --dist-timeout, then
    one line names it and how many ranks came, exit 4 (the batch file starts the step again)."""
    env = {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0",
           "SLURM_STEP_NUM_TASKS": "2", "SLURM_JOB_NODELIST": HOST, "SLURM_STEP_NODELIST": HOST,
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    result = run_single(["--epochs", "1", "--dist-timeout", "10", "--run-name", "alone"], cwd=tmp_path, timeout=120, **env)
    assert result.returncode == EXIT_LOST_PEER, result.stderr[-3000:]
    line = result.stderr.strip().splitlines()[-1]
    print(line)
    assert re.match(r"mnist_ddp\.py \[rank 0/2 on \S+\]: error: lost contact with another rank during joining the process "
                    r"group .*1/2 clients joined", line), line


# A user's backward hook, reached from outside the recipe as a library's would be: a
# sitecustomize on PYTHONPATH hooks the gradient of the model's output, so it runs inside
# loss.backward(); on rank 1 it never returns from the 8th backward pass.
STALL_IN_BACKWARD = """\
import time

import torch
import torch.distributed as dist

passes = [0]


def stall_on_rank_1(grad):
    passes[0] += 1
    while passes[0] == 8 and dist.get_rank() == 1:
        time.sleep(1)
    return grad


def hook_the_output(module, inputs, output):
    if isinstance(module, torch.nn.parallel.DistributedDataParallel) and output.requires_grad:
        output.register_hook(stall_on_rank_1)


torch.nn.modules.module.register_module_forward_hook(hook_the_output)
"""


@pytest.mark.slow
def test_a_rank_stuck_in_a_backward_hook_outside_the_recipe_is_named_at_the_hooks_line(tiny_folder, tmp_path):
    """Rank 1 is stuck in a backward hook that is neither the recipe's nor torch's, inside
    loss.backward() of step 8: the line names the hook's file, line and function for rank 1,
    called from the recipe's backward, and does not say that rank 1 waits in a collective."""
    hook = tmp_path / "hooks" / "sitecustomize.py"
    hook.parent.mkdir()
    hook.write_text(STALL_IN_BACKWARD)
    line = STALL_IN_BACKWARD.splitlines().index("        time.sleep(1)") + 1
    args = [*on_folder(tiny_folder), "--batch-size", "4", "--epochs", "4", "--dist-timeout", "30", "--hang-after", "5",
            "--run-dir", "run"]
    code, err = run_with_rank_1_hung(args, tmp_path, env={"PYTHONPATH": f"{hook.parent}{os.pathsep}{ROOT}"})
    assert code == EXIT_LOST_PEER, err[-3000:]
    verdict = re.search(r"^hang after step 7: .*; --dist-timeout ends the wait$", err, re.M)
    assert verdict, err[-3000:]
    print(verdict.group(0))
    assert "rank 1 in the gradient all-reduce" not in verdict.group(0)
    assert re.search(rf"rank 1 on {re.escape(HOST)} is at {re.escape(str(hook))}:{line} in stall_on_rank_1, called from "
                     r"mnist_ddp\.py:\d+ in train_step; rank\(s\) 0 wait for it in the gradient all-reduce of a training "
                     r"step for \d+ s;", verdict.group(0)), verdict.group(0)
    stacks = (tmp_path / "run" / "hangs").glob(f"*/rank-1-{HOST}.txt")
    assert "runs code outside the recipe, ddpkit and torch, before the gradient all-reduce" in next(stacks).read_text()


@pytest.mark.slow
def test_a_slow_save_that_holds_the_others_up_is_named_and_the_run_goes_on(tiny_folder, tmp_path):
    """Rank 0's checkpoint of step 4 takes 12 s more (a test-only hook; only it writes the
    file): rank 1 waits for it past --hang-after, so rank 0 answers with where it is, the
    line names it, and the run then finishes by itself, its report kept."""
    args = [*on_folder(tiny_folder), "--batch-size", "4", "--epochs", "2", "--ckpt-every", "2", "--dist-timeout", "40",
            "--hang-after", "5", "--run-dir", "run"]
    results = run_as_srun(2, args, cwd=tmp_path, job_id="", env={"AID_SLOW_SAVE": "0:4:12"})
    for result in results:
        assert_ok(result)
    verdict = re.search(r"^hang after step 4: rank 0 on \S+ is at tests/aids/training_aids\.py:\d+ in checkpoint \(saving a "
                        r"checkpoint\); rank\(s\) 1 wait for it in .* for \d+ s; every rank's stacks: (\S+);",
                        results[1].stderr, re.M)
    assert verdict, results[1].stderr[-3000:]
    print(verdict.group(0))
    assert (Path(verdict.group(1)) / "verdict.txt").exists()
    assert [r["epoch"] for r in read_results(tmp_path / "run")] == [1, 2]


@pytest.mark.slow
def test_a_slowed_rank_is_named_as_the_straggler_and_tensorboard_has_the_speed_scalars(tmp_path):
    """Rank 1 sleeps 40 ms before each forward pass: rank 0 names it, with its host, and logs
    the slowest and the median rank's ms every --log-every steps."""
    args = ["--epochs", "1", "--batch-size", "64", "--log-every", "4", "--image-every", "0", "--run-dir", "run"]
    results = run_as_srun(2, args, cwd=tmp_path, job_id="", env={"AID_SLOW": "1:0.04"})
    for result in results:
        assert_ok(result)
    line = re.search(r"^straggler: rank 1 on (\S+) takes ([\d.]+) ms of its own a step .*, ([\d.]+)x the other ranks' median", results[0].stdout, re.M)
    assert line and line.group(1) == HOST and float(line.group(2)) >= 40, results[0].stdout[-2000:]
    print(line.group(0))
    assert not (tmp_path / "run" / "hangs").exists()  # (a clean run leaves no report behind)
    events = EventAccumulator(str(tmp_path / "run")).Reload()
    slowest = [e.value for e in events.Scalars("speed/slowest_rank_ms")]
    median = [e.value for e in events.Scalars("speed/median_rank_ms")]
    assert len(slowest) >= 6 and all(s >= 40 for s in slowest) and all(m < s for m, s in zip(median, slowest, strict=True))


@pytest.fixture(scope="module")
def unprofiled(tmp_path_factory) -> Path:
    workdir = tmp_path_factory.mktemp("unprofiled")
    for result in run_as_srun(2, PROFILED_ARGS, cwd=workdir, job_id=""):
        assert_ok(result)
    return workdir / "run"


PROFILED_ARGS = ["--epochs", "1", "--batch-size", "64", "--log-every", "4", "--image-every", "0", "--run-dir", "run"]


def check_traces(folder: Path) -> None:
    for rank in (0, 1):
        trace = json.loads((folder / f"rank-{rank}.json").read_text())
        assert any(e.get("name") == "aten::convolution" for e in trace["traceEvents"])
    table = (folder / "top-operators.txt").read_text()
    assert "Self CPU" in table and "communication under way" in table


@pytest.mark.slow
def test_profile_writes_a_trace_per_rank_and_a_table_and_changes_no_result(unprofiled, tmp_path):
    results = run_as_srun(2, [*PROFILED_ARGS, "--profile", "5"], cwd=tmp_path, job_id="")
    for result in results:
        assert_ok(result)
    out = results[0].stdout
    assert "profiling steps 4 to 8 on every rank" in out
    summary = re.search(r"^profile of steps 4 to 8 \(5 steps, [\d.]+ ms a step on rank 0\): communication under way "
                        r"\d+ % of the time; traces of every rank in (\S+) \(open one in", out, re.M)
    assert summary and "Self CPU" in out, out[-3000:]
    print(summary.group(0))
    check_traces(Path(summary.group(1)))
    assert read_results(tmp_path / "run") == read_results(unprofiled)
    mine, theirs = load_params(tmp_path / "run"), load_params(unprofiled)
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)


@pytest.mark.slow
def test_touching_profile_now_profiles_the_next_steps_of_a_running_run(tmp_path):
    args = ["--epochs", "3", "--batch-size", "64", "--log-every", "2", "--image-every", "0", "--run-dir", "run"]
    procs = run_as_srun(2, args, cwd=tmp_path, job_id="", detach=True)
    try:
        deadline = time.monotonic() + 200
        while not (tmp_path / "run" / "metrics.jsonl").exists() or not (tmp_path / "run" / "metrics.jsonl").read_text():
            assert time.monotonic() < deadline and procs[0].poll() is None, "the run never finished its first epoch"
            time.sleep(0.2)
        (tmp_path / "run" / "profile-now").touch()
        outs = [proc.communicate(timeout=200) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    assert [proc.returncode for proc in procs] == [0, 0], outs[0][1][-3000:]
    started = re.search(r"^profiling steps (\d+) to (\d+) on every rank$", outs[0][0], re.M)
    assert started and int(started.group(2)) - int(started.group(1)) == 9 and int(started.group(1)) > 32, outs[0][0][-3000:]
    folders = list((tmp_path / "run" / "profile").iterdir())
    assert [f.name for f in folders] == [f"steps-{started.group(1)}-{started.group(2)}"]
    check_traces(folders[0])
    assert not (tmp_path / "run" / "profile-now").exists()
