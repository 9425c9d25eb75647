"""Sweep files, without Slurm: what sweep.py takes from a sweep file (# comments anywhere,
quoted values) and what it refuses (a line that names its run's directory, a file that is
not UTF-8, a directory), each with one line and exit code 2 before it writes anything;
that `sweep.py run` records every run's exit code for the summary; and when a sweep
directory takes a new file (the summary's table, called in this process:
tests/unit/test_sweep_summary.py). Everything runs as a user runs it, through `python sweep.py`
(an array task's line is read as the job's supervisor reads it: sweeplines.task); a command
that a message prints is run as printed.

    python -m pytest tests/runs/test_sweep_files.py
"""

import contextlib
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from test_sweep import hparams_sessions

from ddpkit.job import sweeplines
from helpers.processes import ROOT, clean_env, press_ctrl_c, run_python

BIN = Path(sys.executable).parent
NO_SLURM = str(BIN)  # a PATH without sbatch: `submit` checks and copies, and can reach no cluster


def run_sweep(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """`python sweep.py ARGS`, forked with torch imported as run_single is (the runs it starts
    are processes of their own)."""
    return run_python(args, cwd, script=ROOT / "sweep.py", timeout=600, **env)


def read_task(sweep_file: str, index: int, cwd: Path) -> list[str] | str:
    """What the job's supervisor reads for array task `index` of a sweep file named from `cwd`
    (sweeplines.task, which it imports): the run's name, then its options; or the line of
    its refusal."""
    with contextlib.chdir(cwd):
        try:
            return sweeplines.task(Path(sweep_file), index)
        except sweeplines.SweepError as refusal:
            return str(refusal)


def summary_states(sweep_dir: Path, option: str) -> dict[str, str]:
    rows = json.loads(run_sweep(["summary", str(sweep_dir), "--json"], sweep_dir).stdout)
    return {r["options"][option]: r["state"] for r in rows}


def run_printed(message: str, marker: str, cwd: Path) -> subprocess.CompletedProcess:
    """Run the command that follows `marker` in a message, as a user pastes it, with no
    environment active (the venv's bin/ is not on the PATH)."""
    printed = message.split(marker, 1)[1].strip()
    return subprocess.run(shlex.split(printed), cwd=cwd, env=clean_env(PATH="/usr/bin:/bin"),
                          capture_output=True, text=True, timeout=600)


# ----------------------------------------------------------------------------- what a line may hold

def test_a_line_that_names_its_run_directory_is_refused_before_anything_is_written(tmp_path):
    """The sweep names each run's directory itself: --run-name, --run-dir and --log-dir are
    refused on every command that reads the file, naming the line; an abbreviation of one
    is no option of mnist_ddp.py's, and run and submit refuse it as such."""
    for option in ("--run-name mine", "--run-name=mine", "--run-dir d", "--run-dir=d", "--log-dir d", "--log-dir=d"):
        (tmp_path / "named.txt").write_text(f"--lr 1e-3 --max-steps 1 --epochs 1\n# the second run\n"
                                            f"--lr 3e-3 {option} --max-steps 1 --epochs 1\n")
        flag = option.split()[0].split("=")[0]
        refusal = f"named.txt:3: {flag}: a sweep names each run's directory itself"
        assert read_task("named.txt", 0, tmp_path).startswith(refusal)
        for command in (["run", "named.txt"], ["submit", "named.txt"]):
            result = run_sweep(command, tmp_path, PATH=NO_SLURM)
            assert result.returncode == 2, (option, command, result.stdout[-2000:], result.stderr[-2000:])
            assert result.stderr.startswith(f"sweep.py: error: {refusal}") and result.stderr.count("\n") == 1, result.stderr
            assert not (tmp_path / "runs").exists(), "something was written before the check"

    helps = shlex.join([sys.executable, str(ROOT / "mnist_ddp.py"), "--help"])
    for option in ("--run-n mine", "--run-d=d", "--log-d d", "--log-di=d"):
        (tmp_path / "named.txt").write_text(f"--lr 1e-3 --max-steps 1 --epochs 1\n--lr 3e-3 {option} --max-steps 1\n")
        for command in (["run", "named.txt"], ["submit", "named.txt"]):
            result = run_sweep(command, tmp_path, PATH=NO_SLURM)
            assert result.returncode == 2, (option, command, result.stdout[-2000:], result.stderr[-2000:])
            assert result.stderr == (f"sweep.py: error: named.txt:2: unrecognized arguments: {option} ({helps} lists the "
                                     "options)\n"), result.stderr
            assert not (tmp_path / "runs").exists(), "something was written before the check"


@pytest.mark.slow
def test_a_hash_starts_a_comment_anywhere_and_quoted_values_keep_theirs(tmp_path):
    """`# ...` after the options is a comment, as in a shell; a # inside quotes, or escaped,
    is part of the value, and the runs get those values for real."""
    (tmp_path / "notes.txt").write_text("# two data directories whose names hold a #\n"
                                        "--lr 3e-3 --max-steps 2 --epochs 1 --data-dir 'data #1'  # baseline\n"
                                        "   # an indented comment\n"
                                        "--lr 3e-3 --max-steps 2 --epochs 1 --data-dir data\\#2  # the same, escaped\n")
    assert read_task("notes.txt", 0, tmp_path) == ["data-dir=data__1", "--lr", "3e-3", "--max-steps", "2", "--epochs", "1",
                                                   "--data-dir", "data #1"]
    result = run_sweep(["run", "notes.txt"], tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    sweep_dir = tmp_path / "runs" / "notes"
    assert summary_states(sweep_dir, "data-dir") == {"data #1": "done", "data#2": "done"}
    for run, data_dir in (("data-dir=data__1", "data #1"), ("data-dir=data_2", "data#2")):
        assert json.loads((sweep_dir / run / "run.json").read_text())["config"]["data_dir"] == data_dir
        assert (tmp_path / data_dir).is_dir()


# ----------------------------------------------------------------------------- files that are not sweep files

def test_a_sweep_file_that_is_not_utf8_or_is_a_directory_gets_one_line(tmp_path):
    """Not UTF-8, a directory, a file that is not there: one line each, exit 2, nothing
    written; the commands the messages suggest work as printed."""
    (tmp_path / "latin1.txt").write_bytes("--lr 1e-3\n--lr 3e-3  # réglage\n".encode("latin-1"))
    (tmp_path / "sweeps").mkdir()
    for name, error in (("latin1.txt", "latin1.txt:2: not UTF-8 text (byte 0xe9); save the file as UTF-8"),
                        ("sweeps", "sweeps is a directory, not a sweep file")):
        assert read_task(name, 0, tmp_path) == error
        for command in (["run", name], ["submit", name]):
            result = run_sweep(command, tmp_path, PATH=NO_SLURM)
            assert (result.returncode, result.stderr) == (2, f"sweep.py: error: {error}\n"), (command, result.stderr[-2000:])
    assert not (tmp_path / "runs").exists()
    # A file that is not there: the message's example writes one, as printed (through a shell: it redirects).
    missing = run_sweep(["run", "my sweep.txt"], tmp_path)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1, missing.stderr
    example = missing.stderr.split("let grid write them, e.g. ", 1)[1]
    assert example.endswith(" > 'my sweep.txt'\n")
    subprocess.run(["bash", "-c", example], cwd=tmp_path, env=clean_env(PATH="/usr/bin:/bin"), check=True, timeout=60)
    assert read_task("my sweep.txt", 1, tmp_path) == ["lr=3e-3", "--lr", "3e-3", "--epochs", "4"]
    # A sweep directory where a sweep file goes: the message names the command for its table,
    # and that command works as printed, from a LOG_DIR whose name needs quoting.
    (tmp_path / "lr.txt").write_text("--lr 1e-3 --max-steps 2\n--lr 3e-3 --max-steps 2\n")
    assert run_sweep(["submit", "lr.txt"], tmp_path, PATH=NO_SLURM, LOG_DIR="my runs").returncode == 2  # no sbatch here
    result = run_sweep(["run", "my runs/lr"], tmp_path)
    assert result.returncode == 2 and result.stderr.startswith("sweep.py: error: my runs/lr is a directory, not a sweep file; "
                                                               f"the table of its runs: {shlex.quote(sys.executable)} "), result.stderr
    table = run_printed(result.stderr, "the table of its runs: ", tmp_path)
    assert table.returncode == 0, table.stderr
    assert [line.split()[1:2] + line.split()[-2:] for line in table.stdout.splitlines()[1:]] == [
        ["1e-3", "pending", "lr=1e-3"], ["3e-3", "pending", "lr=3e-3"]]


# ----------------------------------------------------------------------------- running and re-running a sweep

@pytest.mark.slow
def test_sweep_run_records_each_exit_code_so_a_bad_option_shows_as_failed(tmp_path):
    """A line whose data is missing passes the options' checks but stops mnist_ddp.py before
    it makes its run directory; the summary still shows it failed with its exit code, as
    under Slurm, not pending."""
    (tmp_path / "bad.txt").write_text("--lr 1e-3 --dataset folder --data-dir nowhere --epochs 1 --max-steps 2\n"
                                      "--lr 3e-3 --epochs 1 --max-steps 2\n")
    result = run_sweep(["run", "bad.txt"], tmp_path)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "mnist_ddp.py: error: --data-dir nowhere does not exist" in result.stderr
    failed = "lr=1e-3,dataset=folder,data-dir=nowhere"
    assert result.stderr.endswith(f"sweep.py: 1 of 2 runs failed: {failed} (exit 2)\n")
    sweep_dir = tmp_path / "runs" / "bad"
    assert summary_states(sweep_dir, "lr") == {"1e-3": "failed (exit 2: usage)", "3e-3": "done"}
    assert [(sweep_dir / run / "exit-code").read_text() for run in (failed, "lr=3e-3")] == ["2\n", "0\n"]


@pytest.mark.slow
def test_every_line_is_checked_with_the_scripts_own_options_before_anything_is_written(tmp_path):
    """A misspelt option, or a value mnist_ddp.py refuses, on any line: run and submit say
    so in one line that names the line and the problem, exit 2, and write, run and submit
    nothing."""
    helps = shlex.join([sys.executable, str(ROOT / "mnist_ddp.py"), "--help"])  # (the printed help line runs as it is)
    assert subprocess.run(shlex.split(helps), capture_output=True, env=clean_env(PATH="/usr/bin:/bin")).returncode == 0
    for bad, error in (("--lrr 1e-3", f"unrecognized arguments: --lrr 1e-3 ({helps} lists the options)"),
                       ("--epochs 0", "--epochs must be at least 1, got 0"),
                       ("--lr -1", "--lr must be a positive number, got -1.0"),
                       ("--model vgg", "argument --model: invalid choice: 'vgg' (choose from "),
                       ("--ep 3", f"unrecognized arguments: --ep 3 ({helps} lists the options)"),
                       ("--help", "--help trains nothing; delete it from the line")):
        (tmp_path / "typo.txt").write_text(f"--lr 3e-3 --max-steps 2 --epochs 1\n# the second run\n"
                                           f"--max-steps 2 --epochs 1 {bad}\n")
        for command in (["run", "typo.txt"], ["submit", "typo.txt"]):
            result = run_sweep(command, tmp_path, PATH=NO_SLURM)
            assert (result.returncode, result.stdout) == (2, ""), (bad, command, result.stdout[-2000:])
            assert result.stderr.startswith(f"sweep.py: error: typo.txt:3: {error}"), (bad, command, result.stderr[-2000:])
            assert result.stderr.count("\n") == 1, result.stderr
            assert not (tmp_path / "runs").exists(), "something was written before the check"


@pytest.mark.slow
def test_a_refused_file_can_be_fixed_and_a_copy_that_nothing_ran_from_is_replaced(tmp_path):
    """The lines are checked before the file is copied, so a fixed file runs; a copy that
    no run started from (submit on a machine without sbatch) gives way to a new file, the
    HParams tab too; once runs started from it, it stays and another file is refused."""
    sweep_file = tmp_path / "lr sweep.txt"
    sweep_file.write_text("--lr 1e-3 3e-3 --max-steps 2 --epochs 1\n")  # a grid line, meant for `grid`
    typo = run_sweep(["run", sweep_file.name], tmp_path)
    assert not (tmp_path / "runs").exists(), "the refused file was copied"
    assert (typo.returncode, typo.stderr) == (2, "sweep.py: error: lr sweep.txt:1: expected an --option, got '3e-3' in: "
                                                 "--lr 1e-3 3e-3 --max-steps 2 --epochs 1\n")
    sweep_dir = tmp_path / "runs" / "lr_sweep"
    copy = sweep_dir / "sweep.txt"
    sweep_file.write_text("--lr 1e-3 --max-steps 2 --epochs 1\n--lr 3e-3 --max-steps 2 --epochs 1\n")
    no_slurm = run_sweep(["submit", sweep_file.name], tmp_path, PATH=NO_SLURM)
    assert no_slurm.returncode == 2 and "sbatch is not on the PATH" in no_slurm.stderr and copy.exists()
    # Changed again before anything ran: the command the message prints runs the new lines.
    sweep_file.write_text("--batch-size 32 --max-steps 2 --epochs 1\n--batch-size 64 --max-steps 2 --epochs 1\n")
    ran = run_printed(no_slurm.stderr, "without Slurm use: ", tmp_path)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert f"{copy.relative_to(tmp_path)}: no run of its lines started; replacing it with lr sweep.txt" in ran.stdout
    assert copy.read_text() == sweep_file.read_text()
    assert summary_states(sweep_dir, "batch-size") == {"32": "done", "64": "done"}
    hparams_sessions(sweep_dir, first=["batch_size", "global_batch"])
    # Now runs started from it: a changed file is refused and the copy stays.
    frozen = copy.read_text()
    sweep_file.write_text("--lr 1e-2 --max-steps 2 --epochs 1\n")
    for command in (["run", sweep_file.name], ["submit", sweep_file.name]):
        refused = run_sweep(command, tmp_path, PATH=NO_SLURM)
        assert refused.returncode == 2 and "holds other option lines: this sweep ran" in refused.stderr, refused.stderr
        assert copy.read_text() == frozen


def test_summary_labels_every_exit_code_as_documented(tmp_path):
    """Each exit code a run can end with, as its exit-code file holds it, gets the state
    that docs/sweeps.md lists: done, a bug, usage, diverged, a lost peer, a node's fault, stopped, killed
    by a signal; a run with no exit code yet is running (or requeued, and running), a run
    the sweep file names that never started is pending."""
    sweep_dir = tmp_path / "runs" / "codes"
    expected = {0: "done", 1: "failed (exit 1: a bug)", 2: "failed (exit 2: usage)", 3: "diverged (exit 3)",
                4: "failed (exit 4: lost a peer)", 75: "stopped (exit 75)", 137: "failed (exit 137: killed by SIGKILL)",
                143: "failed (exit 143: killed by SIGTERM)", 5: "failed (exit 5: a node's fault)", 6: "failed (exit 6)"}
    for code in expected:
        (sweep_dir / f"c{code}").mkdir(parents=True)
        (sweep_dir / f"c{code}" / "exit-code").write_text(f"{code}\n")
    for name, requeues in (("running", 0), ("requeued", 2)):
        (sweep_dir / name).mkdir()
        (sweep_dir / name / "metrics.jsonl").write_text("")
        (sweep_dir / name / "run.json").write_text(json.dumps({"config": {}, "environment": {"slurm_requeues": requeues}}))
    rows = json.loads(run_sweep(["summary", str(sweep_dir), "--json"], tmp_path).stdout)
    states = {row["run"]: row["state"] for row in rows}
    assert states == {**{f"c{code}": state for code, state in expected.items()}, "running": "running",
                      "requeued": "requeued (2x), running"}
    documented = (ROOT / "docs" / "sweeps.md").read_text()
    for state in ("done", "failed (exit 1: a bug)", "failed (exit 2: usage)", "diverged (exit 3)",
                  "failed (exit 4: lost a peer)", "failed (exit 5: a node's fault)", "stopped (exit 75)",
                  "failed (exit 128+N: killed by SIGNAME)",
                  "failed (exit N)", "running", "requeued (Nx), running", "pending"):
        assert f"`{state}`" in documented, state
    pending = tmp_path / "pending.txt"
    pending.write_text("--lr 1e-3\n--lr 3e-3\n")
    assert set(summary_states(make_sweep_dir(pending, tmp_path / "runs"), "lr").values()) == {"pending"}


def make_sweep_dir(sweep_file: Path, runs: Path) -> Path:
    """A sweep directory as `sweep.py submit` leaves it before any task ran: the file's copy."""
    sweep_dir = runs / sweep_file.stem
    sweep_dir.mkdir(parents=True)
    (sweep_dir / "sweep.txt").write_text(sweep_file.read_text())
    return sweep_dir


def test_summary_reads_past_a_torn_metrics_line(tmp_path):
    """A crash while a run appended to its metrics.jsonl leaves half a line: the summary
    still lists the run, from its whole lines."""
    run_dir = tmp_path / "runs" / "torn" / "lr=1e-3"
    run_dir.mkdir(parents=True)
    whole = {"epoch": 1, "step": 16, "test_accuracy": 0.9, "test_loss": 0.3, "train_loss": 0.4, "epoch_s": 1.5}
    (run_dir / "metrics.jsonl").write_text(json.dumps(whole) + '\n{"epoch": 2, "step": 3')
    result = run_sweep(["summary", str(tmp_path / "runs" / "torn"), "--json"], tmp_path)
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [(r["run"], r["epochs"], r["test_accuracy"]) for r in rows] == [("lr=1e-3", 1, 0.9)]


def test_summary_names_a_run_json_that_is_empty_torn_or_of_an_older_format_and_goes_on(tmp_path):
    """run.json says how often a running run was requeued. One that is empty, cut short, or
    written in another shape is named in one warning line each, and the table still lists
    every run."""
    sweep_dir = tmp_path / "runs" / "odd"
    contents = {"empty": "", "torn": '{"config": {"lr": 0.001}, "environ', "older": '{"config": {}}', "list": "[1, 2]",
                "whole": json.dumps({"config": {}, "environment": {"slurm_requeues": 2}})}
    for name, text in contents.items():
        (sweep_dir / name).mkdir(parents=True)
        (sweep_dir / name / "metrics.jsonl").write_text("")
        (sweep_dir / name / "run.json").write_text(text)
    for args in (["summary", str(sweep_dir)], ["summary", str(sweep_dir), "--json"]):
        result = run_sweep(args, tmp_path)
        assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
        warnings = result.stderr.splitlines()
        assert len(warnings) == 4 and all(line.startswith("sweep.py: warning: ") for line in warnings), warnings
        for name in ("empty", "torn", "older", "list"):
            assert sum(f"{sweep_dir / name / 'run.json'}: " in line for line in warnings) == 1, (name, warnings)
    states = {row["run"]: row["state"] for row in json.loads(result.stdout)}
    assert states == {"empty": "running", "torn": "running", "older": "running", "list": "running",
                      "whole": "requeued (2x), running"}


def test_run_json_is_replaced_whole_so_a_kill_while_writing_it_leaves_the_last_one(tmp_path):
    """A run is continued, and its process is SIGKILLed half way through writing run.json
    at the start: the file still holds the last attempt's JSON, and the summary reads it."""
    from test_nothing_lost import run_driver

    from helpers.processes import run_single

    args = ["--log-dir", "runs/k", "--run-name", "lr=1e-3", "--epochs", "1", "--max-steps", "2"]
    first = run_single(args, tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    run_json = tmp_path / "runs" / "k" / "lr=1e-3" / "run.json"
    before = run_json.read_text()
    die_half_way = ("import io\nfrom ddpkit import files\nreal_replace_with = files.replace_with\n"
                    "def write_half_then_die(path, write, **kwargs):\n"
                    "    def half(fh):\n"
                    "        whole = io.StringIO()\n"
                    "        write(whole)\n"
                    "        fh.write(whole.getvalue()[: len(whole.getvalue()) // 2])\n"
                    "        fh.flush()\n"
                    "        os.kill(os.getpid(), signal.SIGKILL)\n"
                    "    return real_replace_with(path, half if path.name == 'run.json' else write, **kwargs)\n"
                    "files.replace_with = write_half_then_die\n")
    killed = run_driver(die_half_way, [*args[:-1], "4", "--allow-changes"], tmp_path)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert run_json.read_text() == before
    result = run_sweep(["summary", str(tmp_path / "runs" / "k"), "--json"], tmp_path)
    assert (result.returncode, result.stderr) == (0, ""), result.stderr
    assert [row["state"] for row in json.loads(result.stdout)] == ["running"]


@pytest.mark.slow
def test_ctrl_c_in_a_local_sweep_lets_the_run_save_and_the_printed_line_goes_on(tmp_path):
    """Ctrl-C reaches `sweep.py run` and its training run alike: the run saves and exits 75,
    the sweep stops there and prints how to go on, and that line finishes both runs."""

    (tmp_path / "cc.txt").write_text("--epochs 2 --batch-size 256 --lr 3e-3\n--epochs 2 --batch-size 256 --lr 1e-3\n")
    code, out = press_ctrl_c([sys.executable, str(ROOT / "sweep.py"), "run", "cc.txt"], tmp_path, 1)
    assert code == 75, out[-3000:]
    assert "stopping on SIGINT at step " in out and "Traceback" not in out
    assert (tmp_path / "runs" / "cc" / "lr=3e-3" / "exit-code").read_text() == "75\n"
    assert not (tmp_path / "runs" / "cc" / "lr=1e-3").exists()
    again = run_printed(out, "a stopped one resumes): ", tmp_path)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert summary_states(tmp_path / "runs" / "cc", "lr") == {"3e-3": "done", "1e-3": "done"}


def test_sweep_names_that_would_leave_the_sweep_dir_are_refused(tmp_path):
    """A line `--..` would name its run '..', and a file named `...txt` its sweep '..':
    both are refused in one line before anything is written or submitted."""
    (tmp_path / "dots.txt").write_text("--..\n--epochs 1 --max-steps 2\n")
    (tmp_path / "...txt").write_text("--epochs 1 --max-steps 2\n")
    for sweep_file, words in (("dots.txt", "dots.txt:1: '--..' is not an option name"),
                              ("...txt", "...txt: its name gives no directory for the sweep")):
        for command in ("submit", "run"):
            result = run_sweep([command, sweep_file], tmp_path, PATH=NO_SLURM)
            assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
            assert result.stderr.startswith(f"sweep.py: error: {words}"), result.stderr
    assert not (tmp_path / "runs").exists()


def test_sweep_py_takes_no_abbreviation_of_its_own_options(tmp_path):
    """--js is not --json: an abbreviation is refused in argparse's line, exit 2, as mnist_ddp.py refuses one."""
    result = run_sweep(["summary", str(tmp_path), "--js"], tmp_path)
    assert (result.returncode, result.stdout) == (2, ""), result.stdout[-2000:]
    assert result.stderr.endswith("sweep.py: error: unrecognized arguments: --js\n"), result.stderr
