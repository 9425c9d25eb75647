"""A run's name is its identity: the command that a stopped or diverged run prints is run
verbatim and carries that run on; --allow-changes lets it train longer or with another
learning rate; a finished run says so; a stop signal during start-up is kept, not fatal;
a missing, hanging or refusing scontrol means "not requeued", not a crash (contract.requeue_job
itself: tests/unit/test_requeue.py).

    python -m pytest tests/runs/test_continue.py
"""

import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpkit.job.contract import EXIT_DIVERGED, EXIT_STOPPED
from ddpkit.run.checkpoints import read_checkpoint
from helpers.images import on_folder, read_metrics
from helpers.processes import SCRIPT, assert_ok, clean_env, press_ctrl_c, run_as_srun, run_single, run_torchrun
from helpers.scontrol import refusing_scontrol

FAST = ["--epochs", "2", "--batch-size", "256"]  # 16 steps per epoch on the sample


def printed_command(text: str, after: str) -> list[str]:
    """The command printed after `after`, as a list: this interpreter, then the script."""
    line = text[text.index(after) + len(after):].splitlines()[0].strip()
    argv = shlex.split(line)
    assert argv[:2] == [sys.executable, str(SCRIPT)], line
    return argv


@pytest.mark.slow
def test_stopped_run_prints_the_command_that_continues_it(workdir):
    first = run_single([*FAST, "--interrupt-at", "5:USR1"], cwd=workdir)
    assert first.returncode == EXIT_STOPPED, first.stderr[-2000:]
    command = printed_command(first.stdout, "to continue: ")
    run_dirs = [p for p in (workdir / "runs").iterdir() if p.is_dir()]  # beside the HParams declaration
    run_dir = run_dirs[0]
    assert command[-2:] == ["--run-name", run_dir.name]  # the timestamped run, named
    again = subprocess.run(command, cwd=workdir, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert_ok(again)
    assert f"resumed from runs/{run_dir.name}/checkpoints/ckpt-00000006.pt: epoch 1, step 6" in again.stdout  # one step later
    assert [p for p in (workdir / "runs").iterdir() if p.is_dir()] == run_dirs  # no second run directory
    assert [m["epoch"] for m in read_metrics(run_dir)] == [1, 2]
    assert (run_dir / "exit-code").read_text() == "0\n"


@pytest.mark.slow
def test_same_run_name_continues_and_a_finished_run_says_so(workdir):
    stopped = run_single([*FAST, "--run-name", "mine", "--interrupt-at", "20:TERM"], cwd=workdir)
    assert stopped.returncode == EXIT_STOPPED and (workdir / "runs" / "mine" / "exit-code").read_text() == "75\n"
    assert_ok(run_single([*FAST, "--run-name", "mine"], cwd=workdir))
    done = run_single([*FAST, "--run-name", "mine"], cwd=workdir)
    assert_ok(done)
    assert f"runs/mine is already complete (epoch 2, step 32); to train it longer: {sys.executable} " in done.stdout
    # ... and that printed command really trains it longer.
    longer = printed_command(done.stdout, "to train it longer: ")
    assert longer[-3:] == ["--epochs", "6", "--allow-changes"]
    result = subprocess.run(longer, cwd=workdir, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert_ok(result)
    assert "resumed with changed options (--allow-changes): --epochs 2 there, 6 here" in result.stdout
    assert [m["epoch"] for m in read_metrics(workdir / "runs" / "mine")] == [1, 2, 3, 4, 5, 6]


def test_changes_are_refused_unless_allowed_and_never_for_the_model(workdir):
    assert run_single([*FAST, "--run-name", "r", "--interrupt-at", "3:USR1"], cwd=workdir).returncode == EXIT_STOPPED
    refused = run_single([*FAST, "--run-name", "r", "--lr", "1e-3"], cwd=workdir)
    assert refused.returncode == 2
    assert "(--lr 0.003 there, 0.001 here)" in refused.stderr and "add --allow-changes to carry on" in refused.stderr
    model = run_single([*FAST, "--run-name", "r", "--model", "mlp", "--allow-changes"], cwd=workdir)
    assert model.returncode == 2 and "--model cnn there, mlp here" in model.stderr
    assert "--allow-changes to carry on" not in model.stderr
    allowed = run_single([*FAST, "--run-name", "r", "--lr", "1e-3", "--weight-decay", "0", "--allow-changes"], cwd=workdir)
    assert_ok(allowed)
    ckpt = read_checkpoint(sorted((workdir / "runs" / "r" / "checkpoints").glob("ckpt-*.pt"))[-1], "cpu")
    assert ckpt["optimizer"]["param_groups"][0]["weight_decay"] == 0  # the new value, not the saved one
    assert ckpt["config"]["lr"] == 1e-3


def test_divergence_advice_runs_as_printed(workdir):
    """The loss diverges at --lr 1e5; the printed command resumes with a third of it and
    --allow-changes. Here it diverges again, and says so again: the advice is a real command."""
    result = run_single(["--lr", "1e5", "--epochs", "1", "--ckpt-every", "2", "--run-name", "hot"], cwd=workdir)
    assert result.returncode == EXIT_DIVERGED
    command = printed_command(result.stderr, "with a lower learning rate: ")
    assert command[-3:] == ["--lr", "3.33e+04", "--allow-changes"]
    again = subprocess.run(command, cwd=workdir, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert "resumed with changed options (--allow-changes): --lr 100000.0 there, 33300.0 here" in again.stdout
    assert re.search(r"resumed from runs/hot/checkpoints/ckpt-\d+\.pt", again.stdout)


@pytest.mark.slow
def test_signal_during_start_up_is_kept(workdir):
    """Rank 0 is signalled while it waits for rank 1 (or still imports torch): it must not
    die, and both ranks stop with a checkpoint at the second step boundary, where they read the
    first step's agreement."""
    procs = run_as_srun(2, [*FAST, "--run-dir", "run"], cwd=workdir, job_id="", detach=True)
    first, second = procs
    time.sleep(2.0)
    first.send_signal(signal.SIGUSR1)
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [EXIT_STOPPED, EXIT_STOPPED], results[0][1][-2000:]
    assert "stopping on SIGUSR1 at step 2: saved run/checkpoints/ckpt-00000002.pt" in results[0][0]  # agreed at step 2


@pytest.mark.slow
def test_stop_when_scontrol_cannot_reach_slurm_still_exits_75(workdir):
    """Ranks that believe they are in Slurm job 99 with no controller to ask: the stop must
    still end every rank with 75 and the command that continues, not a traceback on rank 0
    while rank 1 waits at a barrier."""
    procs = run_as_srun(2, [*FAST, "--run-dir", "run", "--interrupt-at", "4:USR1"], cwd=workdir, job_id="99", detach=True)
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [EXIT_STOPPED, EXIT_STOPPED], outputs[0][1][-2000:]
    assert f"to continue: srun --nodes=1 --ntasks=2 {shlex.quote(sys.executable)} " in outputs[0][0]


def run_printed(text: str, after: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """Run the command printed after `after` exactly as printed, as a user would paste it,
    with this environment's bin/ (python, torchrun) first on the PATH."""
    line = text[text.index(after) + len(after):].splitlines()[0].strip()
    path = f"{Path(sys.executable).parent}:{clean_env()['PATH']}"
    return subprocess.run(line, shell=True, cwd=cwd, env=clean_env(PATH=path, **env), capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
def test_continue_line_leaves_out_resume_and_interrupt_at(workdir):
    """--resume never and --interrupt-at would refuse the run's own checkpoints or stop it
    again: the printed line carries the run on without them, twice in a row."""
    args = ["--epochs", "2", "--batch-size", "256", "--run-name", "p", "--resume", "never"]
    first = run_single([*args, "--interrupt-at", "3:USR1"], cwd=workdir)
    assert first.returncode == EXIT_STOPPED, first.stderr[-2000:]
    line = first.stdout.split("to continue: ")[1].splitlines()[0]
    assert "--resume" not in line and "--interrupt-at" not in line
    again = run_printed(first.stdout, "to continue: ", workdir)
    assert_ok(again)
    assert "resumed from runs/p/checkpoints/ckpt-00000004.pt" in again.stdout
    assert [m["epoch"] for m in read_metrics(workdir / "runs" / "p")] == [1, 2]


@pytest.mark.slow
def test_train_it_longer_works_as_printed_twice(workdir, tiny_folder):
    """Each "to train it longer" line, run as printed, trains 4 more epochs; the second one
    too (it must not lose a token after a flag that the first one changed)."""
    base = [*on_folder(tiny_folder), "--epochs", "1", "--batch-size", "8", "--run-name", "l"]
    assert_ok(run_single(base, cwd=workdir))
    done = run_single(base, cwd=workdir)
    for epochs in (5, 9):
        assert_ok(done)
        longer = run_printed(done.stdout, "to train it longer: ", workdir)
        assert_ok(longer)
        assert len(read_metrics(workdir / "runs" / "l")) == epochs
        done = run_printed(done.stdout, "to train it longer: ", workdir)  # the same line again: complete now


def test_divergence_advice_keeps_every_other_option(workdir):
    args = ["--lr", "1e5", "--allow-changes", "--epochs", "1", "--ckpt-every", "2", "--run-name", "hot"]
    result = run_single(args, cwd=workdir)
    assert result.returncode == EXIT_DIVERGED
    words = shlex.split(result.stderr.split("with a lower learning rate: ")[1].splitlines()[0])
    assert words[-3:] == ["--lr", "3.33e+04", "--allow-changes"] and words.count("--allow-changes") == 1
    for option, value in (("--epochs", "1"), ("--ckpt-every", "2"), ("--run-name", "hot")):
        assert words[words.index(option) + 1] == value, words
    again = run_printed(result.stderr, "with a lower learning rate: ", workdir)
    assert again.returncode == EXIT_DIVERGED, again.stderr[-2000:]
    assert "resumed with changed options (--allow-changes): --lr 100000.0 there, 33300.0 here" in again.stdout


@pytest.mark.slow
def test_torchrun_continue_line_runs_as_printed(workdir, tiny_folder):
    stopped = run_torchrun(2, [*on_folder(tiny_folder), "--epochs", "1", "--batch-size", "2", "--run-name", "tr",
                               "--interrupt-at", "3:USR1"], cwd=workdir)
    assert "stopping on SIGUSR1 at step " in stopped.stdout, stopped.stderr[-2000:]  # torchrun itself exits 1
    assert f"to continue: {sys.executable} -m torch.distributed.run --standalone --nproc-per-node=2 " in stopped.stdout
    again = run_printed(stopped.stdout, "to continue: ", workdir, OMP_NUM_THREADS="1")
    assert_ok(again)
    assert "resumed from runs/tr/checkpoints/ckpt-00000004.pt" in again.stdout


# No environment active, as under `make run` (.venv/bin/python): the PATH has no bin/ of it.
BARE_PATH = ":".join(p for p in clean_env()["PATH"].split(":") if p and Path(p) != Path(sys.executable).parent)


def run_as_printed(line: str, cwd: Path) -> subprocess.CompletedProcess:
    """The printed line, split as a shell splits it, run with no environment on the PATH."""
    return subprocess.run(shlex.split(line), cwd=cwd, env=clean_env(PATH=BARE_PATH, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_after_ctrl_c_the_continue_line_works_with_no_environment_on_the_path(workdir):
    """A real Ctrl-C (SIGINT to the process group) of a run started as the environment's
    interpreter by its path: the line printed runs that interpreter, and works as printed."""
    code, out = press_ctrl_c([sys.executable, str(SCRIPT), *FAST, "--run-name", "bare"], workdir, PATH=BARE_PATH)
    assert code == EXIT_STOPPED, out[-3000:]
    again = run_as_printed(out.split("to continue: ")[1].splitlines()[0], workdir)
    assert_ok(again)
    assert re.search(r"resumed from runs/bare/checkpoints/ckpt-\d+\.pt: epoch 2", again.stdout), again.stdout[-2000:]
    assert [m["epoch"] for m in read_metrics(workdir / "runs" / "bare")] == [1, 2]


@pytest.mark.slow
def test_torchrun_continue_line_works_with_no_torchrun_on_the_path(workdir, tiny_folder):
    """torchrun started as the interpreter's module (no torchrun on the PATH): the printed
    line starts the same ranks the same way."""
    stopped = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                              str(SCRIPT), *on_folder(tiny_folder), "--epochs", "1", "--batch-size", "2", "--run-name", "tb",
                              "--interrupt-at", "3:USR1"], cwd=workdir,
                             env=clean_env(PATH=BARE_PATH, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                             timeout=300)
    assert "stopping on SIGUSR1 at step " in stopped.stdout, stopped.stderr[-2000:]
    again = run_as_printed(stopped.stdout.split("to continue: ")[1].splitlines()[0], workdir)
    assert_ok(again)
    assert "resumed from runs/tb/checkpoints/ckpt-00000004.pt" in again.stdout


def test_a_resume_on_ranks_that_do_not_split_the_global_batch_names_the_ones_that_do(workdir):
    """A 1-process run stopped, then continued on 3 ranks (128 does not split among 3): the
    line names the rank counts that split it, exit 2; on 2 of them, as advised, it resumes."""
    args = ["--epochs", "1", "--run-name", "b"]
    assert run_single([*args, "--interrupt-at", "5:USR1"], cwd=workdir).returncode == EXIT_STOPPED
    three = run_as_srun(3, args, cwd=workdir, job_id="")
    assert [r.returncode for r in three] == [2, 2, 2], three[0].stderr[-2000:]
    assert "does not split evenly among 3 ranks; run it on 1, 2, 4, 8, 16, 32, 64 or 128 ranks" in three[0].stderr
    assert "for a new run (another --run-name), pass --global-batch 126 or 129" in three[0].stderr
    two = run_as_srun(2, args, cwd=workdir, job_id="")
    assert_ok(two[0])
    assert "resumed from runs/b/checkpoints/ckpt-00000006.pt: epoch 1, " in two[0].stdout
    assert [m["epoch"] for m in read_metrics(workdir / "runs" / "b")] == [1]


@pytest.mark.slow
def test_a_stop_whose_requeue_fails_prints_the_continue_line_and_it_works(workdir, monkeypatch):
    """Two ranks of "job 99" stop on USR1; scontrol shows a requeueable job but refuses the
    requeue: rank 0 says so and prints the command that continues, which works as printed
    (without its srun: there is no real job 99)."""
    monkeypatch.setenv("PATH", f"{refusing_scontrol(workdir / 'bin')['PATH']}:{BARE_PATH}")  # (the ranks' PATH)
    procs = run_as_srun(2, [*FAST, "--run-dir", "run", "--interrupt-at", "4:USR1"], cwd=workdir, job_id="99",
                        detach=True)
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [EXIT_STOPPED, EXIT_STOPPED], outputs[0][1][-2000:]
    out = outputs[0][0]
    assert "requeueing Slurm job 99;" in out and "could not requeue Slurm job 99 (scontrol requeue: " in out
    again = run_as_printed(out.split("to continue: ")[1].splitlines()[0].replace("srun --nodes=1 --ntasks=2 ", ""), workdir)
    assert_ok(again)
    assert re.search(r"resumed from run/checkpoints/ckpt-\d+\.pt", again.stdout)


@pytest.mark.parametrize("continuing", [{"MNIST_DDP_ATTEMPT": "2/4"}, {"SLURM_RESTART_COUNT": "1"}],
                         ids=["a-restart", "a-requeue"])
@pytest.mark.slow
def test_a_start_that_continues_the_job_goes_on_from_the_runs_own_checkpoint_not_back_to_resume_file(workdir,
                                                                                                     continuing):
    """A fine-tune started with --resume FILE is restarted (by torchrun's agents, or the batch
    file, which says so in MNIST_DDP_ATTEMPT) or requeued (SLURM_RESTART_COUNT) with the same
    options: it goes on from its own newest checkpoint, and sets aside none of them."""
    base = run_single([*FAST, "--run-name", "base"], cwd=workdir)
    assert_ok(base)
    start = workdir / "runs" / "base" / "checkpoints" / "ckpt-00000016.pt"
    tune = [*FAST, "--epochs", "3", "--allow-changes", "--run-name", "tune", "--resume", str(start), "--ckpt-every", "5"]
    first = run_as_srun(1, [*tune, "--interrupt-at", "24:USR1"], cwd=workdir, job_id="")[0]
    assert first.returncode == EXIT_STOPPED, first.stderr[-2000:]
    assert f"resumed from {start}" in first.stdout
    newest = max((workdir / "runs" / "tune" / "checkpoints").glob("ckpt-*.pt")).relative_to(workdir)
    again = run_as_srun(1, tune, cwd=workdir, job_id="", env=continuing)[0]
    assert_ok(again)
    assert f"resumed from {newest}: epoch 2" in again.stdout, again.stdout[-2000:]
    assert "set aside" not in again.stderr
    assert [m["epoch"] for m in read_metrics(workdir / "runs" / "tune")] == [2, 3]
