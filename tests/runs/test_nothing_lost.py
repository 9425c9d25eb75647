"""Nothing saved is lost and nothing is logged twice, in the odd cases a user meets: a stop
at the very last step or a kill during the last evaluation, a resume with another world
size or from an earlier checkpoint, a run directory with logs but no checkpoint that
loads, a --max-steps cap lifted later, a torn line in metrics.jsonl, two runs of one name
at once and unnamed runs started in the same second, Ctrl-C (also under torchrun, while
torch loads, and while rank 0 loads and rank 1 waits for it in the rendezvous: 130 on both;
SIGTERM then: 75 on both after saving), and an exit-code file that always tells how rank 0 ended. Real processes, real signals.

    python -m pytest tests/runs/test_nothing_lost.py
"""

import contextlib
import gzip
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ddpkit.job.contract import EXIT_DIVERGED, EXIT_STOPPED, JobEnv, JobPaths, read_codes
from ddpkit.run.checkpoints import read_checkpoint
from helpers.images import SAMPLE, read_metrics
from helpers.processes import SCRIPT, assert_ok, clean_env, press_ctrl_c, run_as_srun, run_python, run_single

BATCH = 256
ONE_EPOCH = ["--epochs", "1", "--batch-size", str(BATCH)]


def steps_per_epoch(batch: int = BATCH, ranks: int = 1) -> int:
    """From the sample's own label file, so the tests do not hard-code its size."""
    with gzip.open(SAMPLE / "train-labels-idx1-ubyte.gz") as fh:
        count = int.from_bytes(fh.read(8)[4:], "big")
    return math.ceil(count / (ranks * batch))  # (the last global batch is filled up)


def run_driver(code: str, args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """mnist_ddp.main(args) in a process of its own, after `code` changed something in it."""
    driver = f"import os, signal, sys, mnist_ddp\n{code}\nsys.exit(mnist_ddp.main(sys.argv[1:]))"
    return run_python(args, cwd, code=driver, **env)


# The process dies half way through writing the first file whose name holds TARGET: the real
# torch.save writes half of its bytes, then a real SIGKILL.
DIE_HALF_WAY = """
import io, torch
real_save = torch.save
def save_half_then_die(obj, target, *args, **kwargs):
    if TARGET in getattr(target, "name", ""):
        whole = io.BytesIO()
        real_save(obj, whole, *args, **kwargs)
        target.write(whole.getvalue()[: len(whole.getvalue()) // 2])
        target.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    return real_save(obj, target, *args, **kwargs)
torch.save = save_half_then_die
"""


def test_keep_ckpts_keeps_exactly_that_many(workdir):
    """--keep-ckpts N through the command line: checkpoints every 5 steps and at the epoch's
    end, and only the newest N of them stay."""
    last = steps_per_epoch()
    for keep in (1, 2):
        assert_ok(run_single([*ONE_EPOCH, "--run-name", f"keep{keep}", "--ckpt-every", "5", "--keep-ckpts", str(keep)],
                             cwd=workdir))
        kept = sorted(p.name for p in (workdir / "runs" / f"keep{keep}" / "checkpoints").iterdir())
        newest = [f"ckpt-{step:08d}.pt" for step in sorted({*range(5, last + 1, 5), last})[-keep:]]
        assert kept == newest


@pytest.mark.parametrize("dies_in", ["ckpt-", "model.pt"])
def test_a_save_killed_half_way_leaves_the_checkpoints_and_model_before_it_whole(workdir, dies_in):
    """A finished run is trained one epoch longer, and the process is SIGKILLed half way
    through writing its next checkpoint, or its new model.pt: every file of the first run is
    byte for byte what it was and loads, and the same command then finishes the run, from the
    newest checkpoint, taking over at once the run's lease that the killed process left (its
    process has ended), also where fcntl's locks exclude nothing (NFS mounted nolock)."""
    run_dir, nolock = workdir / "runs" / "a", {"AID_LOCKS_EXCLUDE_NOTHING": "1"}
    assert_ok(run_single([*ONE_EPOCH, "--run-name", "a"], cwd=workdir))
    before = {path: path.read_bytes() for path in [*run_dir.glob("checkpoints/*.pt"), run_dir / "model.pt"]}
    longer = ["--epochs", "2", "--batch-size", str(BATCH), "--run-name", "a", "--allow-changes"]
    killed = run_driver(f"TARGET = {dies_in!r}\n{DIE_HALF_WAY}", longer, workdir, **nolock)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert list(run_dir.glob(f"**/.{dies_in}*.tmp*")) or list(run_dir.glob("**/.*tmp*"))  # it did die mid-write
    for path, data in before.items():
        assert path.read_bytes() == data, f"{path} changed"
        torch.load(path, weights_only=True)
    newest = max(run_dir.glob("checkpoints/ckpt-*.pt"))
    finished = run_single(longer, cwd=workdir, **nolock)
    assert_ok(finished)
    assert re.search(r"^took over runs/a/\.claim\.lease from pid \d+ on \S+ since [\d: -]+: its process has ended$",
                     finished.stderr, re.M), finished.stderr[-2000:]
    assert f"resumed from {newest.relative_to(workdir)}: " in finished.stdout, finished.stdout[-2000:]
    assert [m["epoch"] for m in read_metrics(run_dir)] == [1, 2]
    assert (run_dir / "model.pt").read_bytes() != before[run_dir / "model.pt"]  # trained longer
    assert list(run_dir.glob("**/.*tmp*")) == []  # the dead save's temporary file was removed


def test_tensorboard_has_no_doubled_steps_after_a_crash_past_the_last_checkpoint(workdir):
    """The process dies while saving epoch 2's checkpoint, after that epoch's steps and
    record went to TensorBoard and metrics.jsonl: the resumed run, from epoch 1's
    checkpoint, trains those steps again, and each step is in the logs once."""
    last = steps_per_epoch()
    args = ["--epochs", "2", "--batch-size", str(BATCH), "--run-name", "t", "--log-every", "1"]
    killed = run_driver(f"TARGET = 'ckpt-{2 * last:08d}'\n{DIE_HALF_WAY}", args, workdir)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    run_dir = workdir / "runs" / "t"

    def steps(tag: str) -> list[int]:
        events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
        events.Reload()
        return [e.step for e in events.Scalars(tag)]

    assert steps("train/batch_loss")[-1] == 2 * last  # logged past the newest checkpoint (step {last})
    assert_ok(run_single(args, cwd=workdir))
    assert steps("train/batch_loss") == list(range(1, 2 * last + 1))
    assert steps("test/accuracy") == [last, 2 * last]
    assert [m["step"] for m in read_metrics(run_dir)] == [last, 2 * last]


def test_weights_that_stop_being_finite_while_the_loss_is_finite_are_never_saved(workdir):
    """--lr 1e300 makes the weights infinite at the first step after a checkpoint, while
    that step's loss (computed before the update) is finite: exit 3, the weights named, and
    every checkpoint left holds finite weights."""
    first = ["--epochs", "1", "--batch-size", str(BATCH), "--run-name", "w", "--ckpt-every", "1", "--keep-ckpts", "10"]
    stopped = run_single([*first, "--interrupt-at", "2:USR1"], cwd=workdir)
    assert stopped.returncode == EXIT_STOPPED, stopped.stderr[-2000:]
    diverged = run_single([*first, "--lr", "1e300", "--allow-changes"], cwd=workdir)
    assert diverged.returncode == EXIT_DIVERGED, diverged.stderr[-2000:]
    assert "error: the weights stopped being finite at step 3 (epoch 1); nothing from this step on was saved" in (
        diverged.stderr)
    saved = sorted((workdir / "runs" / "w" / "checkpoints").glob("ckpt-*.pt"))
    assert [p.name for p in saved] == ["ckpt-00000001.pt", "ckpt-00000002.pt"]
    for path in saved:
        assert all(torch.isfinite(v).all() for v in read_checkpoint(path, "cpu")["model"].values())
    assert not (workdir / "runs" / "w" / "model.pt").exists()


def test_stop_at_the_very_last_step_still_finishes_the_run(workdir):
    last = steps_per_epoch()
    stopped = run_single([*ONE_EPOCH, "--run-name", "a", "--interrupt-at", f"{last}:USR1"], cwd=workdir)
    assert stopped.returncode == EXIT_STOPPED, stopped.stderr[-2000:]
    assert f"stopping on SIGUSR1 at step {last}" in stopped.stdout
    finished = run_single([*ONE_EPOCH, "--run-name", "a"], cwd=workdir)
    assert_ok(finished)
    assert "already complete" not in finished.stdout and "saved runs/a/model.pt" in finished.stdout
    assert [(m["epoch"], m["step"]) for m in read_metrics(workdir / "runs" / "a")] == [(1, last)]
    again = run_single([*ONE_EPOCH, "--run-name", "a"], cwd=workdir)
    assert_ok(again)
    assert f"runs/a is already complete (epoch 1, step {last})" in again.stdout


def test_kill_during_the_last_evaluation_still_finishes_the_run(workdir):
    """A checkpoint comes at the last step (--ckpt-every divides it), then the process dies
    in the evaluation that follows: the next run evaluates and writes model.pt."""
    last = steps_per_epoch()
    args = [*ONE_EPOCH, "--run-name", "k", "--ckpt-every", str(last)]
    killed = run_driver("mnist_ddp.evaluate = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)", args, workdir)
    assert killed.returncode == -signal.SIGKILL
    assert (workdir / "runs" / "k" / "checkpoints" / f"ckpt-{last:08d}.pt").is_file()
    again = run_single(args, cwd=workdir)
    assert_ok(again)
    assert (workdir / "runs" / "k" / "model.pt").is_file()
    assert [m["epoch"] for m in read_metrics(workdir / "runs" / "k")] == [1]


# 128 images per rank (not the default global batch): two ranks then take fewer steps an
# epoch. With --keep-ckpts 1 the one-process run leaves one checkpoint, where it stopped.
ONE_THEN_TWO = ["--epochs", "2", "--batch-size", "128", "--ckpt-every", "10", "--keep-ckpts", "1", "--run-name", "w"]


@pytest.fixture(scope="module")
def stopped_in_epoch_2(tmp_path_factory) -> Path:
    """A working directory whose runs/w one process stopped in epoch 2 (made once; each test
    continues a copy of it)."""
    workdir = tmp_path_factory.mktemp("one-process")
    first = run_single([*ONE_THEN_TWO, "--interrupt-at", f"{steps_per_epoch(128) + 10}:USR1"], cwd=workdir)
    assert first.returncode == EXIT_STOPPED, first.stderr[-2000:]
    return workdir


def test_another_world_size_keeps_the_step_count_and_the_logged_epochs(workdir, stopped_in_epoch_2):
    """One process stops in epoch 2; two ranks go on (restarting that epoch, in their own
    steps), finish, and the finished run stays finished, with every epoch logged once and
    the newest checkpoint the last one written."""
    per_epoch, args = steps_per_epoch(128), ONE_THEN_TWO
    shutil.copytree(stopped_in_epoch_2 / "runs", workdir / "runs")
    for second in run_as_srun(2, args, cwd=workdir, job_id=""):
        assert_ok(second)
    run_dir = workdir / "runs" / "w"
    steps = [m["step"] for m in read_metrics(run_dir)]
    assert [m["epoch"] for m in read_metrics(run_dir)] == [1, 2]
    assert steps == [per_epoch, per_epoch + steps_per_epoch(128, ranks=2)]
    newest = sorted((run_dir / "checkpoints").glob("ckpt-*.pt"))[-1]
    assert newest.name == f"ckpt-{steps[-1]:08d}.pt"
    for third in run_as_srun(2, args, cwd=workdir, job_id="")[::-1]:  # (rank 0's last)
        assert_ok(third)
    assert f"runs/w is already complete (epoch 2, step {steps[-1]})" in third.stdout
    assert [m["step"] for m in read_metrics(run_dir)] == steps


def test_rollback_to_an_earlier_checkpoint_is_the_path_that_continues(workdir):
    args = ["--epochs", "1", "--batch-size", "128", "--ckpt-every", "5", "--keep-ckpts", "20", "--run-name", "r"]
    assert_ok(run_single(args, cwd=workdir))
    checkpoints = workdir / "runs" / "r" / "checkpoints"
    back = checkpoints / "ckpt-00000010.pt"
    rolled = run_single([*args, "--resume", str(back), "--epochs", "2", "--allow-changes", "--interrupt-at", "15:USR1"],
                        cwd=workdir)
    assert rolled.returncode == EXIT_STOPPED, rolled.stderr[-2000:]
    assert "stopping on SIGUSR1 at step 15: saved runs/r/checkpoints/ckpt-00000015.pt" in rolled.stdout
    assert (checkpoints / "ckpt-00000015.pt").is_file()  # the file the stop line names is there
    resumed = run_single([*args, "--epochs", "2", "--allow-changes"], cwd=workdir)
    assert_ok(resumed)
    assert "resumed from runs/r/checkpoints/ckpt-00000015.pt: epoch 1, step 15" in resumed.stdout
    assert [m["epoch"] for m in read_metrics(workdir / "runs" / "r")] == [1, 2]


def test_no_checkpoint_that_loads_starts_over_and_says_so(workdir):
    args = [*ONE_EPOCH, "--run-name", "n"]
    assert_ok(run_single(args, cwd=workdir))
    for path in (workdir / "runs" / "n" / "checkpoints").glob("ckpt-*.pt"):
        path.write_bytes(b"not a checkpoint")
    again = run_single(args, cwd=workdir)
    assert_ok(again)
    assert "no checkpoint that loads: starting the run over from step 0" in again.stderr
    assert [m["epoch"] for m in read_metrics(workdir / "runs" / "n")] == [1]  # not 1, 1


def test_lifting_the_step_cap_trains_on(workdir):
    """--max-steps stops the run in mid-epoch 2; the printed "to train it longer" lifts the
    cap, and the run finishes epoch 2 from where the cap stopped it."""
    per_epoch = steps_per_epoch()
    args = ["--epochs", "2", "--batch-size", str(BATCH), "--run-name", "m"]
    capped = run_single([*args, "--max-steps", str(per_epoch + 4)], cwd=workdir)
    assert_ok(capped)
    done = run_single([*args, "--max-steps", str(per_epoch + 4)], cwd=workdir)
    assert_ok(done)
    assert f"runs/m is already complete (epoch 2, step {per_epoch + 4}); to train it longer: " in done.stdout
    line = done.stdout.split("to train it longer: ")[1].splitlines()[0]
    assert "--max-steps 0" in line and "--allow-changes" in line
    longer = run_single([*args, "--max-steps", "0", "--allow-changes"], cwd=workdir)
    assert_ok(longer)
    assert f"resumed from runs/m/checkpoints/ckpt-{per_epoch + 4:08d}.pt: epoch 2, step {per_epoch + 4}" in longer.stdout
    assert [m["step"] for m in read_metrics(workdir / "runs" / "m")] == [per_epoch, per_epoch + 4, 2 * per_epoch]


def test_torn_last_line_of_metrics_is_dropped_with_a_warning(workdir):
    args = ["--epochs", "2", "--batch-size", str(BATCH), "--run-name", "t"]
    assert run_single([*args, "--interrupt-at", f"{steps_per_epoch() + 2}:USR1"], cwd=workdir).returncode == EXIT_STOPPED
    metrics = workdir / "runs" / "t" / "metrics.jsonl"
    with open(metrics, "a") as fh:
        fh.write('{"epoch": 2, "step": 6')
    again = run_single(args, cwd=workdir)
    assert_ok(again)
    assert "warning: dropping line 2 of runs/t/metrics.jsonl" in again.stderr
    assert [m["epoch"] for m in read_metrics(workdir / "runs" / "t")] == [1, 2]


def test_a_metrics_line_without_the_epoch_figures_is_dropped_with_a_warning(workdir):
    """A whole JSON line with a step but none of an epoch's figures (hand-edited, or another
    tool's): the resume drops it with the torn line's warning and finishes the run."""
    args = ["--epochs", "2", "--batch-size", str(BATCH), "--run-name", "h"]
    assert run_single([*args, "--interrupt-at", f"{steps_per_epoch() + 2}:USR1"], cwd=workdir).returncode == EXIT_STOPPED
    with open(workdir / "runs" / "h" / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 1, "note": "checked by hand"}\n')
    again = run_single(args, cwd=workdir)
    assert_ok(again)
    assert ("warning: dropping line 2 of runs/h/metrics.jsonl, which is not a whole record: "
            "'{\"step\": 1, \"note\": \"checked by hand\"}'") in again.stderr.splitlines()
    assert [m["epoch"] for m in read_metrics(workdir / "runs" / "h")] == [1, 2]


@pytest.mark.slow
@pytest.mark.parametrize("locks", [{}, {"AID_LOCKS_EXCLUDE_NOTHING": "1"}], ids=["locks", "locks-exclude-nothing"])
def test_two_runs_of_one_name_at_once(workdir, locks):
    """Also where fcntl's locks exclude nothing (NFS mounted nolock, between nodes): the run's lease refuses the second."""
    args = ["--epochs", "2", "--batch-size", str(BATCH), "--run-name", "twice", "--ckpt-every", "1", "--keep-ckpts", "1"]
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), *args], cwd=workdir, env=clean_env(**locks),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.wait(timeout=300), *p.communicate()) for p in procs]
    assert sorted(code for code, _, _ in results) == [0, 2], results
    refused = next(err for code, _, err in results if code == 2)
    assert refused.count("\n") == 1 and "error: another run is using runs/twice (pid " in refused
    assert [m["epoch"] for m in read_metrics(workdir / "runs" / "twice")] == [1, 2]
    assert (workdir / "runs" / "twice" / "exit-code").read_text() == "0\n"


@pytest.mark.slow
def test_unnamed_runs_started_in_the_same_second_get_their_own_directories(workdir):
    fixed_clock = "import time\ntime.strftime = lambda fmt, *t: '20260101-000000'"
    driver = f"import sys, mnist_ddp\n{fixed_clock}\nsys.exit(mnist_ddp.main(sys.argv[1:]))"
    assert_ok(run_single(["--download-only"], cwd=workdir))
    procs = [subprocess.Popen([sys.executable, "-c", driver, "--epochs", "1", "--max-steps", "2"], cwd=workdir,
                              env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(4)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0, 0, 0], [p.communicate()[1][-1000:] for p in procs]
    run_dirs = sorted(p.name for p in (workdir / "runs").iterdir() if p.is_dir())
    assert run_dirs == ["20260101-000000", "20260101-000000-2", "20260101-000000-3", "20260101-000000-4"]
    assert all(len(read_metrics(workdir / "runs" / name)) == 1 for name in run_dirs)


@pytest.mark.slow
def test_ctrl_c_saves_a_checkpoint_and_records_it(workdir):
    code, out = press_ctrl_c([sys.executable, str(SCRIPT), "--epochs", "3", "--run-name", "c"], workdir, times=1)
    assert code == EXIT_STOPPED, out[-3000:]
    assert "stopping on SIGINT at step " in out and "Traceback" not in out
    assert "requeueing" not in out and f"to continue: {shlex.quote(sys.executable)} " in out
    assert (workdir / "runs" / "c" / "exit-code").read_text() == f"{EXIT_STOPPED}\n"
    assert list((workdir / "runs" / "c" / "checkpoints").glob("ckpt-*.pt"))


@pytest.mark.slow
def test_ctrl_c_twice_under_torchrun_saves_and_leaves_no_traceback_on_the_ranks(workdir):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(SCRIPT),
               "--epochs", "3", "--run-name", "c2"]
    _, out = press_ctrl_c(command, workdir, times=2)
    assert "stopping on SIGINT at step " in out, out[-3000:]
    assert "KeyboardInterrupt" not in out  # torchrun's own agent may print its SignalException
    assert (workdir / "runs" / "c2" / "exit-code").read_text() == f"{EXIT_STOPPED}\n"
    saved = sorted((workdir / "runs" / "c2" / "checkpoints").glob("ckpt-*.pt"))
    assert saved and torch.load(saved[-1], weights_only=True)["progress"]["step"] >= steps_per_epoch(128, ranks=2)


def test_exit_code_is_rewritten_by_every_end_of_rank_0(workdir):
    """A stop records 75; a refused resume afterwards records 2, and "already complete" 0,
    instead of leaving the 75 of the earlier attempt."""
    args = [*ONE_EPOCH, "--run-name", "e"]
    exit_code = workdir / "runs" / "e" / "exit-code"
    assert run_single([*args, "--interrupt-at", "3:USR1"], cwd=workdir).returncode == EXIT_STOPPED
    assert exit_code.read_text() == "75\n"
    refused = run_single([*args, "--lr", "1e-3"], cwd=workdir)  # another --lr without --allow-changes
    assert refused.returncode == 2 and exit_code.read_text() == "2\n"
    assert_ok(run_single(args, cwd=workdir))
    (exit_code).write_text("75\n")
    assert_ok(run_single(args, cwd=workdir))  # already complete
    assert exit_code.read_text() == "0\n"
    assert json.loads((workdir / "runs" / "e" / "run.json").read_text())["config"]["run_name"] == "e"


def test_stop_at_the_step_cap_still_finishes_the_run(workdir):
    """The stop lands on the --max-steps step, before its evaluation: the next run has no
    step left to train, and evaluates, writes model.pt and finishes."""
    cap = steps_per_epoch() + 4
    args = ["--epochs", "2", "--batch-size", str(BATCH), "--max-steps", str(cap), "--run-name", "cap"]
    stopped = run_single([*args, "--interrupt-at", f"{cap}:USR1"], cwd=workdir)
    assert stopped.returncode == EXIT_STOPPED, stopped.stderr[-2000:]
    finished = run_single(args, cwd=workdir)
    assert_ok(finished)
    assert "saved runs/cap/model.pt" in finished.stdout
    assert [(m["epoch"], m["step"]) for m in read_metrics(workdir / "runs" / "cap")] == [(1, cap - 4), (2, cap)]


def test_a_crash_right_after_a_world_size_change_loses_nothing(workdir, stopped_in_epoch_2):
    """With --keep-ckpts 1 the only checkpoint is the one a 2-rank run resumes from (written
    by one process in mid-epoch). The 2-rank run saves where it goes on from before
    anything else, so a SIGKILL at its first step costs nothing: the next run resumes there."""
    per_epoch, args = steps_per_epoch(128), ONE_THEN_TWO
    shutil.copytree(stopped_in_epoch_2 / "runs", workdir / "runs")
    crash_at_first_step = ("import os, signal, sys\nsys.path.insert(0, os.environ['PYTHONPATH'])\nimport mnist_ddp\n"
                           "mnist_ddp.train_step = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)\n"
                           "sys.exit(mnist_ddp.main(sys.argv[1:]))\n")
    crashed = run_as_srun(2, args, cwd=workdir, job_id="", command=[sys.executable, "-c", crash_at_first_step])
    assert all(rank.returncode != 0 for rank in crashed)
    for again in run_as_srun(2, args, cwd=workdir, job_id="")[::-1]:  # (rank 0's last)
        assert_ok(again)
    assert f"resumed from runs/w/checkpoints/ckpt-{per_epoch:08d}.pt: epoch 2, step {per_epoch}" in again.stdout
    assert "starting the run over" not in again.stderr
    set_aside = [p.name for p in (workdir / "runs" / "w" / "checkpoints" / "superseded").glob("*/ckpt-*.pt")]
    assert set_aside == [f"ckpt-{per_epoch + 11:08d}.pt"]  # the one-process file, stopped one step after the signal


@pytest.mark.slow
def test_ctrl_c_before_training_stops_at_once(workdir):
    """Before training there is nothing to save: Ctrl-C during a download that hangs ends
    the run at once with one line and 130, as a shell reports an interrupt."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        command = [sys.executable, str(SCRIPT), "--dataset", "mnist", "--download-only",
                   "--data-mirror", f"http://127.0.0.1:{server.getsockname()[1]}/"]
        proc = subprocess.Popen(command, cwd=workdir, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        server.settimeout(120)
        connection, _ = server.accept()  # the download has started, and gets no answer
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        connection.close()
    assert proc.returncode == 130, err[-2000:]
    assert err.splitlines() == ["mnist_ddp.py: error: interrupted (Ctrl-C) before training started; nothing was saved"]


# Makes `import torch` as slow as on busy shared storage: every rank says on stderr when it
# starts to import torch (its stop signals' handlers are set by then), and rank 0 (one process,
# or SLURM_PROCID 0) is held there until the file HOLD_TORCH names exists: a stop signal sent
# meanwhile lands while rank 0 loads.
HOLD_TORCH = """
import os, sys, time

class HeldTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            print("loading torch", file=sys.stderr, flush=True)
            while os.environ.get("SLURM_PROCID", "0") == "0" and not os.path.exists(os.environ["HOLD_TORCH"]):
                time.sleep(0.05)
        return None

sys.meta_path.insert(0, HeldTorch())
"""


def test_ctrl_c_while_torch_loads_is_one_line_and_130(workdir):
    """Ctrl-C while `import torch` runs (seconds on shared storage): the line and exit code of
    a Ctrl-C before training, not a traceback through the import; nothing trained."""
    slow = workdir / "slow-storage"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text(HOLD_TORCH)
    env = clean_env(PYTHONPATH=f"{slow}{os.pathsep}{SCRIPT.parent}", HOLD_TORCH=str(workdir / "never"))
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--epochs", "1", "--run-name", "i"], cwd=workdir, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stderr.readline() == "loading torch\n"
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert (proc.returncode, out) == (130, ""), err[-3000:]
    assert err.splitlines() == ["mnist_ddp.py: error: interrupted (Ctrl-C) before training started; nothing was saved"]
    assert not (workdir / "runs").exists()


def start_two_ranks_with_rank_0_held_in_import_torch(workdir: Path, master_port: int = 0,
                                                     env: dict[str, str] | None = None) -> tuple[list, Path]:
    """Two ranks started as srun starts them (with `env` too), both with their handlers set,
    rank 0 held in `import torch` until the returned file exists (HOLD_TORCH)."""
    held = workdir / "held"
    held.mkdir()
    (held / "sitecustomize.py").write_text(HOLD_TORCH)
    release = workdir / "release-torch"
    ranks = run_as_srun(2, ["--epochs", "1", "--batch-size", str(BATCH), "--run-name", "held", "--dist-timeout", "300"],
                        workdir, job_id="", command=[sys.executable, str(SCRIPT)], detach=True, master_port=master_port,
                        env={**(env or {}), "PYTHONPATH": f"{held}{os.pathsep}{SCRIPT.parent}", "HOLD_TORCH": str(release)})
    assert [rank.stderr.readline() for rank in ranks] == ["loading torch\n"] * 2
    return ranks, release


def finish(ranks: list, timeout: float) -> list[tuple[int, str, str]]:
    """Each rank's (exit code, stdout, stderr) once it ended, within `timeout` seconds each;
    past that, a failure that says which ranks had ended (a rank that ended while a process it
    started still holds its output would show so) and what each wrote."""
    try:
        return [(rank.returncode, out, err) for rank in ranks for out, err in [rank.communicate(timeout=timeout)]]
    except subprocess.TimeoutExpired:
        ended = [rank.poll() for rank in ranks]
        for rank in ranks:
            rank.kill()
        said = [rank.communicate(timeout=30) for rank in ranks]
        pytest.fail(f"not every rank ended within {timeout:g} s; exit codes then: {ended}; their output: {said}")
    finally:
        for rank in ranks:
            rank.kill()


@pytest.mark.slow
def test_ctrl_c_while_rank_0_loads_torch_ends_every_rank_with_130_at_once(workdir):
    """Ctrl-C (srun passes it to every task) while rank 0 is held in `import torch` and rank 1
    waits in the rendezvous for it (the test holds the rendezvous port and answers nothing,
    as rank 0 would not yet): both end at once with the line and 130, before anything could
    be saved, and leave their 130 in the job's folder for run_training.sbatch, as a Ctrl-C
    that the job runner ends does. Before, rank 0 did, and rank 1 waited on for --dist-timeout
    (300 s here); then both ended without leaving their codes."""
    job_dir = JobPaths(str(workdir), "1").job_dir
    with socket.socket() as rendezvous:
        rendezvous.bind(("127.0.0.1", 0))
        rendezvous.listen()
        rendezvous.settimeout(120)
        ranks, _ = start_two_ranks_with_rank_0_held_in_import_torch(workdir, rendezvous.getsockname()[1],
                                                                    env={JobEnv.EXIT_DIR: job_dir})
        waiting, _ = rendezvous.accept()  # rank 1 is in the rendezvous, in torch's C++
        for rank in ranks:
            rank.send_signal(signal.SIGINT)
        with waiting:
            ended = finish(ranks, timeout=60)  # (far less than --dist-timeout)
    assert [code for code, _, _ in ended] == [130, 130], ended
    for _, _, err in ended:
        assert err.splitlines()[-1] == "mnist_ddp.py: error: interrupted (Ctrl-C) before training started; nothing was saved"
    assert read_codes(job_dir) == {0: 130, 1: 130}
    assert not list(workdir.glob("runs/*/checkpoints/*.pt"))


@pytest.mark.slow
def test_a_stop_signal_while_rank_0_loads_torch_stops_every_rank_with_75_after_saving(workdir):
    """SIGTERM to every rank while rank 0 is held in `import torch`: kept, as the handlers are
    set before torch loads; once rank 0 has loaded, the ranks meet, train, agree to stop at
    the first step, rank 0 saves, and both end with 75."""
    ranks, release = start_two_ranks_with_rank_0_held_in_import_torch(workdir)
    for rank in ranks:
        rank.send_signal(signal.SIGTERM)
    release.touch()
    ended = finish(ranks, timeout=300)
    assert [code for code, _, _ in ended] == [EXIT_STOPPED, EXIT_STOPPED], ended
    assert "stopping on SIGTERM at step " in ended[0][1], ended[0][1][-2000:]
    assert any((workdir / "runs" / "held" / "checkpoints").glob("ckpt-*.pt"))


@pytest.mark.parametrize("delay", [0.2, 0.4, 0.6, 0.8, 1.0, 1.3, 1.6])
def test_ctrl_c_soon_after_the_start_is_never_lost_nor_a_traceback(workdir, delay):
    """Ctrl-C at a few moments of the start, without any seam: wherever it lands (in torch's
    own imports, some of which catch every exception and go on; in the data; in training),
    the run ends as a Ctrl-C does there, one line before training, a save once training ran."""
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--epochs", "2", "--run-name", "s"],
                            cwd=workdir, env=clean_env(OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=delay)
        assert proc.returncode is None, proc.communicate()
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert "Traceback" not in out + err and proc.returncode in (130, EXIT_STOPPED), (proc.returncode, out, err)
    if proc.returncode == 130:
        assert err.splitlines()[-1] == "mnist_ddp.py: error: interrupted (Ctrl-C) before training started; nothing was saved"
        assert "epoch" not in out
    else:
        assert "stopping on SIGINT at step " in out
