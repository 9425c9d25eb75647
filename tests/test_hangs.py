"""Seeing inside a running job, with real processes over Gloo: a rank hung in Python is named
with its host and line in one line before --dist-timeout, every rank's stacks are kept and the
run then goes on from its checkpoint; a rank stuck in a backward hook that is neither the
recipe's nor torch's is named at the hook's line, and not as waiting in a collective (on a
GPU, from autograd's own thread); a rank that holds the others up with a slow save is
named with its line, and the run goes on; a rank stuck with the interpreter's lock held is
named from its faulthandler stacks; a rank stopped or gone is named from outside (/proc of a
real stopped process); a slowed rank is named as the straggler (only after three slow
windows of its own, not of several ranks in turn) and the speed scalars reach
TensorBoard, and a clean run leaves no RUN_DIR/hangs; --profile writes traces and a table
without changing the run's results, and RUN_DIR/profile-now profiles a running run. The SIGSTOP of a rank under a real Slurm is in test_slurm.py.

    python -m pytest tests/test_hangs.py
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import ROOT, assert_ok, load_params, on_folder, read_results, run_as_srun
from ddpkit import hangs, stragglers
from ddpkit.launch import EXIT_LOST_PEER

HOST = socket.gethostname()


def run_with_rank_1_hung(args: list[str], cwd: Path, how: str = "", env: dict[str, str] | None = None) -> tuple[int, str]:
    """Two srun-style ranks with rank 1 hung as step 7 ends (MNIST_DDP_TEST_HANG=1:7<how>), or
    hung by what `env` sets up instead: rank 0's exit code and stderr, once it gave up; then
    rank 1 is killed, as srun would."""
    env = env or {"MNIST_DDP_TEST_HANG": "1:7" + how}
    procs = run_as_srun(2, args, cwd=cwd, job_id="", detach=True, env=env)
    try:
        _, err = procs[0].communicate(timeout=150)
    finally:
        procs[1].kill()
    procs[1].communicate()
    return procs[0].returncode, err


def test_a_rank_hung_in_python_is_named_with_its_host_and_line_and_the_run_then_goes_on(tiny_folder, tmp_path):
    """Rank 1 hangs in Python as step 7 ends (a test-only hook). Before --dist-timeout (40 s),
    one line on rank 0 names rank 1, its host, the file and line it is at, and the collective
    rank 0 waits in; both ranks' stacks are in RUN_DIR/hangs. Rank 0 then ends with the lost
    peer's code, and the same command continues from the newest checkpoint to the end."""
    args = [*on_folder(tiny_folder), "--batch-size", "4", "--epochs", "4", "--ckpt-every", "2", "--dist-timeout", "40",
            "--hang-after", "5", "--run-dir", "run"]
    code, err = run_with_rank_1_hung(args, tmp_path, "")
    assert code == EXIT_LOST_PEER, err[-3000:]
    verdict = re.search(r"^hang after step (\d+): rank 1 on (\S+) is at ddpkit/training_run\.py:\d+ in step_done; "
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
    assert re.search(r'File "\S+/ddpkit/training_run\.py", line \d+ in step_done', (folder / f"rank-1-{HOST}.txt").read_text())
    assert re.search(r"waits in the gradient all-reduce of a training step .* at mnist_ddp\.py:\d+ in train_step",
                     (folder / f"rank-0-{HOST}.txt").read_text())
    healed = run_as_srun(2, args, cwd=tmp_path, job_id="")
    for result in healed:
        assert_ok(result)
    assert re.search(r"^resumed from \S+/ckpt-00000006\.pt: epoch 3, step 6 ", healed[0].stdout, re.M), healed[0].stdout
    assert [r["epoch"] for r in read_results(tmp_path / "run")] == [1, 2, 3, 4]


def test_a_rank_stuck_in_a_c_call_that_holds_the_interpreter_is_named_from_its_faulthandler_stacks(tiny_folder, tmp_path):
    """Rank 1 hangs in a C call that keeps Python's lock (a test-only hook): its watchdog thread
    cannot run, but faulthandler, armed from it, writes its stacks from C, and rank 0's line
    names where it is from them."""
    args = [*on_folder(tiny_folder), "--batch-size", "4", "--epochs", "4", "--dist-timeout", "30", "--hang-after", "5",
            "--run-dir", "run"]
    code, err = run_with_rank_1_hung(args, tmp_path, ":gil")
    verdict = re.search(r"^hang after step \d+: rank 1 on \S+ is alive but silent \(state S, [^)]*\), at "
                        r"ddpkit/training_run\.py:\d+ in step_done \(faulthandler's stacks\); rank\(s\) 0 wait", err, re.M)
    assert verdict and code == EXIT_LOST_PEER, err[-3000:]
    print(verdict.group(0))


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


def test_a_slow_save_that_holds_the_others_up_is_named_and_the_run_goes_on(tiny_folder, tmp_path):
    """Rank 0's checkpoint of step 4 takes 12 s more (a test-only hook; only it writes the
    file): rank 1 waits for it past --hang-after, so rank 0 answers with where it is, the
    line names it, and the run then finishes by itself, its report kept."""
    args = [*on_folder(tiny_folder), "--batch-size", "4", "--epochs", "2", "--ckpt-every", "2", "--dist-timeout", "40",
            "--hang-after", "5", "--run-dir", "run"]
    results = run_as_srun(2, args, cwd=tmp_path, job_id="", env={"MNIST_DDP_TEST_SLOW_SAVE": "0:4:12"})
    for result in results:
        assert_ok(result)
    verdict = re.search(r"^hang after step 4: rank 0 on \S+ is at ddpkit/training_run\.py:\d+ in checkpoint \(saving a "
                        r"checkpoint\); rank\(s\) 1 wait for it in .* for \d+ s; every rank's stacks: (\S+);",
                        results[1].stderr, re.M)
    assert verdict, results[1].stderr[-3000:]
    print(verdict.group(0))
    assert (Path(verdict.group(1)) / "verdict.txt").exists()
    assert [r["epoch"] for r in read_results(tmp_path / "run")] == [1, 2]


def test_a_stopped_or_gone_process_is_named_from_outside():
    """What a rank's peer on the same host reads in /proc: a real stopped process, a live one
    and one that has exited."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        sleeper.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while "stopped" not in hangs.process_state(sleeper.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert hangs.process_state(sleeper.pid).startswith("stopped (state T, stopped: SIGSTOP or a debugger")
        sleeper.send_signal(signal.SIGCONT)
        time.sleep(0.2)
        assert hangs.process_state(sleeper.pid).startswith("alive but silent (state S, sleeping")
    finally:
        sleeper.kill()
        sleeper.wait()
    assert hangs.process_state(sleeper.pid) == "gone (no such process)"


def test_the_verdict_names_each_rank_behind_and_how_it_was_seen():
    peers = [hangs.Peer(0, "a", 10), hangs.Peer(1, "a", 11), hangs.Peer(2, "b", 12), hangs.Peer(3, "c", 13)]
    summaries = {0: {"rank": 0, "step": 7, "waiting": "the agreement", "where": "mnist_ddp.py:1 in train"},
                 1: {"rank": 1, "host": "a", "outside": "stopped (state T, ...)"},
                 2: {"rank": 2, "step": 6, "waiting": "", "where": "ddpkit/imagesets.py:9 in batches"}}
    line = hangs.verdict_line(summaries, peers, 12.4, Path("/r/hangs/x"))
    assert line == ("hang after step 6: rank 1 on a is stopped (state T, ...); rank 2 on b is at "
                    "ddpkit/imagesets.py:9 in batches; rank 3 on c: no answer; rank(s) 0 wait for it in the agreement "
                    "for 12 s; every rank's stacks: /r/hangs/x")


def test_innermost_frame_of_the_recipe_or_the_kit_from_a_real_faulthandler_dump(tmp_path):
    """A C call that holds the interpreter's lock leaves only faulthandler's dump: its main
    thread's innermost frame in the project is found in it, frames of an environment inside
    the project are not the project's."""
    code = ("import faulthandler, sys, threading, time\n"
            "def stuck():\n    faulthandler.dump_traceback(open(sys.argv[1], 'w'), all_threads=True)\n"
            "threading.Thread(target=time.sleep, args=(5,), daemon=True).start()\nstuck()\n")
    script = tmp_path / "project" / "train.py"
    script.parent.mkdir()
    script.write_text(code)
    subprocess.run([sys.executable, str(script), str(tmp_path / "dump.txt")], check=True, timeout=60)
    frames = hangs.faulthandler_frames((tmp_path / "dump.txt").read_text())
    assert frames[-1][2] == "stuck" and frames[0][2] == "<module>"
    assert hangs.where_it_runs(frames, (script.parent, hangs.KIT)) == ("train.py:3 in stuck", hangs.OWN_CODE)
    inside = [("/p/.venv/lib/python3.11/site-packages/torch/x.py", 5, "wait")]
    assert hangs.where_it_runs(frames + inside, (script.parent, Path("/p"))) == ("train.py:3 in stuck", hangs.TORCH_CODE)


TRAIN = [("/p/mnist_ddp.py", 400, "main"), ("/p/mnist_ddp.py", 311, "train_step"),
         ("/p/.venv/lib/python3.11/site-packages/torch/_tensor.py", 626, "backward"),
         ("/p/.venv/lib/python3.11/site-packages/torch/autograd/graph.py", 823, "_engine_run_backward")]
HOOK = [("/home/u/hooks.py", 7, "clip_hook"), (str(hangs.PYTHON_LIBRARY / "threading.py"), 320, "wait")]


def test_code_outside_the_project_and_torch_is_named_and_does_not_wait():
    """A rank in a library's or a user's code, below the recipe, is at that code's innermost
    frame, called from the recipe's, and runs that code (it does not wait); the same code
    waiting in torch below it is named, and runs torch's (it may wait); a hook in the recipe
    itself runs the recipe's."""
    roots = (Path("/p"), hangs.KIT)
    hooked = [*TRAIN, *HOOK]
    assert hangs.where_it_runs(hooked, roots) == ("/home/u/hooks.py:7 in clip_hook, called from mnist_ddp.py:311 in "
                                                  "train_step", hangs.OTHER_CODE)
    library = [*TRAIN[:2], ("/p/.venv/lib/python3.11/site-packages/somelib/sync.py", 12, "gather")]
    assert hangs.where_it_runs(library, roots) == ("somelib/sync.py:12 in gather, called from mnist_ddp.py:311 in "
                                                   "train_step", hangs.OTHER_CODE)
    collective = [*library, ("/p/.venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", 9, "all_reduce")]
    assert hangs.where_it_runs(collective, roots) == ("somelib/sync.py:12 in gather, called from mnist_ddp.py:311 in "
                                                      "train_step", hangs.TORCH_CODE)
    assert hangs.where_it_runs(TRAIN, roots) == ("mnist_ddp.py:311 in train_step", hangs.TORCH_CODE)
    in_the_recipe = [*TRAIN, ("/p/mnist_ddp.py", 40, "clip_hook"), HOOK[1]]
    assert hangs.where_it_runs(in_the_recipe, roots) == ("mnist_ddp.py:40 in clip_hook", hangs.OWN_CODE)
    # --compile's generated code is torch's: a rank in it is not said to run someone else's code.
    for generated in ("<eval_with_key>.3", "/tmp/torchinductor_me/ab/cabcdef.py"):
        assert hangs.code_of(generated, roots) == hangs.TORCH_CODE


def test_a_hook_on_autograds_own_thread_is_joined_to_the_main_threads_backward():
    """On a GPU autograd runs a tensor's hooks in a thread of its own while the main thread
    waits in backward(): that thread's frames count as the main thread's innermost; outside
    backward() no other thread's do."""
    joined = hangs.joined_stack(TRAIN, [HOOK])
    assert joined == TRAIN + HOOK
    assert hangs.where_it_runs(joined, (Path("/p"),))[0].startswith("/home/u/hooks.py:7 in clip_hook, called from")
    assert hangs.joined_stack(TRAIN[:2], [HOOK]) == TRAIN[:2]


def test_hang_after_defaults_to_a_fifth_of_the_timeout_and_at_least_ten_seconds():
    assert hangs.default_hang_after(300) == 60
    assert hangs.default_hang_after(30) == 10
    assert hangs.default_hang_after(10) == 0  # (not below the timeout: no report)


def test_a_rank_slower_in_three_windows_in_a_row_is_named_once():
    judge = stragglers.Stragglers(["a", "b", "c"])
    seen = [judge.window(ms) for ms in [(10, 30, 11), (10, 31, 12), (11, 10, 10), (10, 30, 11), (10, 30, 11),
                                        (10, 32, 11), (10, 33, 11)]]
    assert [s[:3] for s in seen[:2]] == [(1, 30, 11), (1, 31, 12)]
    lines = [s[3] for s in seen]
    assert [bool(line) for line in lines] == [False, False, False, False, False, True, False]
    assert lines[5].startswith("straggler: rank 1 on b takes 32.0 ms of its own a step (data loading and forward pass), "
                               "3.0x the other ranks' median of 10.5 ms, in 3 windows of --log-every steps in a row")


def test_three_slow_windows_of_different_ranks_in_a_row_name_no_straggler():
    """Ranks 0, 1, 2 and 0 again are each the slow one in a window of their own (a busy node
    in turn): no rank stayed slow, so none is named; rank 0's own third window in a row,
    counted from its first of them, names it."""
    judge = stragglers.Stragglers(["a", "b", "c"])
    lines = [judge.window(ms)[3] for ms in [(30, 10, 11), (10, 30, 11), (10, 11, 30), (30, 10, 11), (31, 10, 11)]]
    assert lines == ["", "", "", "", ""]
    third = judge.window((32, 10, 11))[3]
    assert third.startswith("straggler: rank 0 on a takes 32.0 ms") and "in 3 windows" in third


def test_a_slowed_rank_is_named_as_the_straggler_and_tensorboard_has_the_speed_scalars(tmp_path):
    """Rank 1 sleeps 40 ms before each forward pass: rank 0 names it, with its host, and logs
    the slowest and the median rank's ms every --log-every steps."""
    args = ["--epochs", "1", "--batch-size", "64", "--log-every", "4", "--image-every", "0", "--run-dir", "run"]
    results = run_as_srun(2, args, cwd=tmp_path, job_id="", env={"MNIST_DDP_TEST_SLOW": "1:0.04"})
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
