"""ddpkit/hangs.py and ddpkit/run/stragglers.py at unit level: a rank stopped or gone is named
from outside (/proc of a real stopped process), the verdict names each rank behind and how
it was seen, the innermost frame of the recipe or the kit is read from a real faulthandler
dump, code outside the project and torch is named, a hook on autograd's own thread is joined
to the main thread's backward, the default hang delay, and a straggler is named once after
three slow windows of its own, not of several ranks in turn. Hung ranks in real runs:
tests/runs/test_hangs.py.

    python -m pytest tests/unit/test_hangs_and_stragglers.py
"""

import io
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from ddpkit import hangs
from ddpkit.files import replace_json
from ddpkit.run import stragglers


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
                 2: {"rank": 2, "step": 6, "waiting": "", "where": "ddpkit/data/imagesets.py:9 in batches"}}
    line = hangs.verdict_line(summaries, peers, 12.4, Path("/r/hangs/x"))
    assert line == ("hang after step 6: rank 1 on a is stopped (state T, ...); rank 2 on b is at "
                    "ddpkit/data/imagesets.py:9 in batches; rank 3 on c: no answer; rank(s) 0 wait for it in the agreement "
                    "for 12 s; every rank's stacks: /r/hangs/x")
    # (the ranks it names, which the job's supervisor pins the failure on by their nodes)
    assert [peer.rank for peer in hangs.not_waiting(summaries, peers)] == [1, 2, 3]


def test_a_verdict_at_start_up_says_so_and_one_slow_collective_that_every_rank_waits_in_has_none():
    """Before the first step of a start the report says "at start-up"; every rank waiting in the
    same collective at start-up (a slow one: a Gloo group's first, under load) names no rank and
    has no line; ranks waiting in different ones get a line that says so."""
    peers = [hangs.Peer(0, "a", 10), hangs.Peer(1, "b", 11)]
    stopped = {0: {"rank": 0, "step": hangs.STARTING, "waiting": "the broadcast", "where": "ddpkit/distributed.py:3 in x"}}
    line = hangs.verdict_line(stopped, peers, 8.2, Path("/r/hangs/x"))
    assert line == ("hang at start-up, before the first step: rank 1 on b: no answer; rank(s) 0 wait for it in the "
                    "broadcast for 8 s; every rank's stacks: /r/hangs/x")
    both = {**stopped, 1: {**stopped[0], "rank": 1}}
    assert hangs.verdict_line(both, peers, 8.2, Path("/r/hangs/x")) == ""
    assert hangs.not_waiting(both, peers) == []
    apart = {**both, 1: {**both[1], "waiting": "the barrier"}}
    assert hangs.verdict_line(apart, peers, 8.2, Path("/r/hangs/x")).startswith(
        "hang at start-up, before the first step: every rank waits in a collective, not all in the same one? ")


def test_every_rank_waiting_in_one_collective_in_training_gets_a_line_that_names_no_rank(tmp_path):
    """In training, every rank waiting in the gradient all-reduce (a network or NCCL that
    stalls) is a hang the job must hear of: the lowest rank prints one line, which names no
    rank, and hands none to the job's supervisor (which would pin a node). At start-up the
    same wait prints nothing."""
    label = "the gradient all-reduce of a training step"
    peers = [hangs.Peer(0, "a", 10), hangs.Peer(1, "b", 11)]
    both = {r: {"rank": r, "step": 6, "waiting": label, "where": "mnist_ddp.py:3 in train"} for r in (0, 1)}
    assert hangs.verdict_line(both, peers, 9.4, Path("/r/hangs/x")) == (
        "hang after step 6: every rank waits in the gradient all-reduce of a training step for 9 s, none behind: the "
        "network or the collective backend (NCCL, Gloo) stalls, not a rank; every rank's stacks: /r/hangs/x")

    def report(step: int) -> tuple[str, list]:
        """Rank 0's report of a wait in `label`, rank 1 (another host) waiting in it too."""
        folder, stream, named = tmp_path / str(step), io.StringIO(), []
        watch = hangs.HangWatch(rank=0, peers=[hangs.Peer(0, socket.gethostname(), os.getpid()), peers[1]],
                                folder=folder, hang_after=10, roots=(hangs.KIT,), stream=stream, named=named.append)
        watch.arm_faulthandler()
        replace_json(folder / "rank-1.json", {**both[1], "host": "b", "step": step, "time": time.time()})
        before = hangs.main_thread.step
        hangs.main_thread.step = step
        try:
            watch.report(label, time.monotonic() - 12, hangs.WAITS)
        finally:
            hangs.main_thread.step = before
            watch.stop()
        return stream.getvalue(), named

    line, named = report(6)
    assert re.fullmatch(r"hang after step 6: every rank waits in the gradient all-reduce of a training step for \d+ s, "
                        r"none behind: .*; --dist-timeout ends the wait\n", line), line
    assert named == []
    assert report(hangs.STARTING) == ("", [])


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


def test_a_hang_report_that_resolved_is_taken_back_once_a_step_finishes_after_it(tmp_path):
    """The rank that named ranks in a verdict takes it back (the job's supervisor must not pin
    a failure on their nodes) once the run finished a step after it; not before, for a lost
    peer's error ends the wait too, and then the verdict stands."""
    taken_back = []
    watch = hangs.HangWatch(rank=0, peers=[], folder=tmp_path, hang_after=10, roots=(), resolved=lambda: taken_back.append(1))
    before = hangs.main_thread.step
    try:
        hangs.main_thread.step = 6
        watch.forget_a_resolved_hang()  # (no verdict yet)
        watch.named_after = 6  # (as a verdict that named ranks after step 6 leaves it)
        watch.forget_a_resolved_hang()
        assert taken_back == []
        hangs.main_thread.step = 7
        watch.forget_a_resolved_hang()
        watch.forget_a_resolved_hang()
        assert taken_back == [1] and watch.named_after is None
    finally:
        hangs.main_thread.step = before
