#!/usr/bin/env python3
"""sweep.py: many runs of mnist_ddp.py at once, as one Slurm job array, and one table of
how they did.

A sweep is a text file of option lines for mnist_ddp.py, one line per run; write it by
hand or let `grid` write the combinations. Each line is split as a shell would, and #
starts a comment (`--lr 1e-3  # baseline`); blank lines are not runs. The sweep names
each run's directory itself, so a line takes no --run-name, --run-dir or --log-dir.

  python sweep.py grid --lr 1e-3 3e-3 --batch-size 64 128 --epochs 4 > sweeps/lr-bs.txt
      every combination of the listed values, one line each (an option with one value
      goes on every line)
  python sweep.py submit sweeps/lr-bs.txt [--parallel N] [sbatch options]
      copies the file to runs/lr-bs/sweep.txt and submits one array job,
      sbatch --array=0-3%N run_training.sbatch, whose task i trains line i+1 in its own
      run directory runs/lr-bs/<the options that vary>, with its own output file
      lr-bs-<array id>_<task>.out, port and requeue
  python sweep.py run sweeps/lr-bs.txt
      the same runs one after another on this machine, without Slurm; each run's exit
      code goes to its RUN_DIR/exit-code, as under Slurm
  python sweep.py summary runs/lr-bs [--json]
      the runs as a table, best test accuracy first: the options that vary, accuracy,
      losses, epochs done, wall time and state (done, running, requeued, pending,
      failed with its exit code, diverged); it reads only the run directories, so it
      works while the sweep runs and from a login node

submit and run check every line, with mnist_ddp.py's own parser and checks too, before
they write or submit anything. A sweep directory keeps the lines it was given once one of
its runs started, or `submit` handed it to Slurm: a file with other lines is then refused;
until then a new file replaces them (an sbatch that refused the array hands nothing over).

Settings, as environment variables: LOG_DIR (the directory that holds sweep
directories, [./runs]), PYTHON (for `run` [this interpreter]); `submit` passes the
environment on to run_training.sbatch (VENV, DATA_DIR, MAX_RESTARTS, ...).
"""

import argparse
import contextlib
import io
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from ddpkit.job.contract import EXIT_BUG, EXIT_DIVERGED, EXIT_LOST_PEER, EXIT_NODE_FAULT, EXIT_STOPPED, EXIT_USAGE, JobPaths
from ddpkit.job.sweeplines import PROG, SweepError, as_name, as_options, command, line_numbers, names_of, read_lines, varying

HERE = Path(__file__).resolve().parent


# ----------------------------------------------------------------------------- option lines

def grid(args: list[str]) -> list[str]:
    """'--lr 1e-3 3e-3 --amp --epochs 4' -> one line per combination of the listed values."""
    axes: list[tuple[str, list[str]]] = []
    for arg in args:
        if arg.startswith("--"):
            axes.append((arg, []))
        elif not axes:
            raise SweepError(f"grid: values must follow an --option, got {arg!r} first")
        else:
            axes[-1][1].append(arg)
    if not axes:
        raise SweepError(f"grid: nothing to combine; e.g. {command('grid', '--lr', '1e-3', '3e-3', '--batch-size', '64', '128')}")
    choices = [[[flag, value] for value in values] or [[flag]] for flag, values in axes]
    return [shlex.join([word for pair in combo for word in pair]) for combo in itertools.product(*choices)]


# ----------------------------------------------------------------------------- launching

def sweep_dir_for(sweep_file: Path, log_dir: Path) -> Path:
    name = as_name(sweep_file.stem)
    if name in ("", ".", ".."):
        raise SweepError(f"{sweep_file}: its name gives no directory for the sweep (LOG_DIR/{name}); rename the file")
    return log_dir / name


def recipe_module():
    """mnist_ddp, the script beside this file, whose options and HParams a sweep uses; imported
    here, not at the top, because summary must work without torch."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    try:
        import mnist_ddp
    except ImportError as err:
        raise SweepError(f"cannot check the lines with mnist_ddp.py's options ({err}): run sweep.py with the interpreter "
                         "that trains, e.g. .venv/bin/python sweep.py, or activate its environment") from None
    return mnist_ddp


def declare_hparams(sweep_dir: Path, runs: list[list[str]]) -> None:
    """The sweep's HParams tab, before any run writes its own: what it varies comes first."""
    mnist_ddp = recipe_module()
    from ddpkit.run.runlog import SHOWN_FIRST, HParams
    from ddpkit.run.runlog import declare_hparams as declare
    varied = [name.replace("-", "_") for name in varying(runs)]
    varied += ["global_batch"] if "batch_size" in varied else []
    recipe = mnist_ddp.Recipe()
    names = HParams.of_run(recipe, batch_size=recipe.global_batch, world_size=1, amp=False).values
    first = tuple(name for name in varied if name in names) or SHOWN_FIRST
    declare(sweep_dir, HParams.of_run(recipe, batch_size=recipe.global_batch, world_size=1, amp=False, first=first))


def check_lines(sweep_file: Path, runs: list[list[str]], sweep_dir: Path) -> None:
    """Each line as its run will read it (with the run directory the sweep gives it), through
    mnist_ddp.py's own parser and checks, before anything is written or submitted: a
    misspelt option or a value the script refuses stops the sweep here, naming its line,
    instead of failing that task after its queue wait. (mnist_ddp imports torch: about a
    second, once; each line then takes a millisecond.)"""
    mnist_ddp = recipe_module()
    from ddpkit.launch import UsageError
    from ddpkit.options import parse_options
    for number, name, args in zip(line_numbers(sweep_file), names_of(runs), runs, strict=True):
        try:
            # argparse prints --help and exits: not a run.
            with contextlib.redirect_stdout(io.StringIO()):
                parse_options(mnist_ddp.Recipe, [*args, "--log-dir", str(sweep_dir), "--run-name", name], mnist_ddp.__doc__)
        except UsageError as err:
            helps = shlex.join([sys.executable, str(HERE / "mnist_ddp.py"), "--help"])
            message = str(err).replace("(see --help)", f"({helps} lists the options)")
            raise SweepError(f"{sweep_file}:{number}: {message}") from None
        except SystemExit:
            raise SweepError(f"{sweep_file}:{number}: --help trains nothing; delete it from the line") from None


SUBMITTED = "submitted"  # in a sweep directory: the sbatch command lines `submit` ran


def read_records(metrics_file: Path) -> list[dict]:
    """A run's metrics.jsonl, without a line that a crash cut short (the run itself drops
    it, with a warning, when it resumes)."""
    records = []
    with contextlib.suppress(FileNotFoundError):
        for line in metrics_file.read_text(errors="replace").splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                records.append(json.loads(line))
    return [r for r in records if isinstance(r, dict)]


def frozen_lines(copy: Path) -> list[list[str]] | None:
    try:
        return read_lines(copy, allow_run_dirs=True)
    except SweepError:
        return None  # an older sweep.py copied the file before checking it


def ever_started(sweep_dir: Path) -> bool:
    """Whether a run of the sweep directory ever started (its directory holds run.json or an
    exit code), or `submit` handed the sweep to Slurm, whose tasks may still wait in the queue."""
    return (sweep_dir / SUBMITTED).exists() or any((run_dir / "run.json").exists() or holds_job_files(run_dir)
                                                   for run_dir in sweep_dir.iterdir() if run_dir.is_dir())


def holds_job_files(run_dir: Path) -> bool:
    """Whether a run's directory holds the run's exit code or the folders of its jobs."""
    paths = JobPaths(str(run_dir))
    return os.path.exists(paths.exit_code) or os.path.exists(paths.job_dirs)


def prepare(sweep_file: Path) -> tuple[list[list[str]], Path]:
    """(the runs, the sweep directory), with the file copied there as sweep.txt and the
    HParams tab declared, once every line passed its checks. A copy that runs were started
    from stays: a file with other lines is refused; one that nothing ran from is replaced."""
    runs = read_lines(sweep_file)
    sweep_dir = sweep_dir_for(sweep_file, Path(os.environ.get("LOG_DIR", "runs")))
    check_lines(sweep_file, runs, sweep_dir)
    copy = sweep_dir / "sweep.txt"
    if copy.exists() and frozen_lines(copy) != runs:
        if ever_started(sweep_dir):
            raise SweepError(f"{copy} holds other option lines: this sweep ran (or was submitted) with them; rename "
                             f"{sweep_file} to start another sweep, or delete that directory")
        print(f"{copy}: no run of its lines started; replacing it with {sweep_file}", flush=True)
        # The tab is declared afresh too, with what the new lines vary first.
        (sweep_dir / ".hparams-declared").unlink(missing_ok=True)
        for declaration in sweep_dir.glob("events.out.tfevents.*.hparams"):
            declaration.unlink()
    sweep_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(sweep_file, copy)  # the tasks read this copy: editing the original later changes nothing
    declare_hparams(sweep_dir, runs)
    return runs, sweep_dir


def submit(sweep_file: Path, parallel: int, sbatch_options: list[str]) -> int:
    runs, sweep_dir = prepare(sweep_file)
    if shutil.which("sbatch") is None:
        raise SweepError(f"sbatch is not on the PATH; on a machine without Slurm use: {command('run', sweep_file)}")
    array = f"0-{len(runs) - 1}" + (f"%{parallel}" if parallel else "")
    cmd = ["sbatch", f"--array={array}", f"--job-name={sweep_dir.name}", f"--output={sweep_dir.name}-%A_%a.out",
           *sbatch_options, str(HERE / "run_training.sbatch")]
    env = {"SWEEP_FILE": str((sweep_dir / "sweep.txt").resolve()), "LOG_DIR": str(sweep_dir.resolve())}
    line = " ".join([*(f"{name}={shlex.quote(value)}" for name, value in env.items()), shlex.join(cmd)])
    print(f"{len(runs)} runs in {sweep_dir}: {line}", flush=True)
    # The sweep counts as submitted once sbatch says it queued the array (its job id), or
    # ends with 0 (--quiet says nothing): from then on sweep.txt stays, since queued tasks
    # will read it. An sbatch that refused it records nothing, so the fixed command works.
    recorded = False
    with subprocess.Popen(cmd, env={**os.environ, **env}, stdout=subprocess.PIPE, text=True) as sbatch:
        for output in sbatch.stdout:  # (with --wait, sbatch ends only when the tasks have)
            print(output, end="", flush=True)
            if not recorded and re.fullmatch(r"Submitted batch job \d+.*|\d+(;\S+)?", output.strip()):
                record_submission(sweep_dir, line)
                recorded = True
    if not recorded and sbatch.returncode == 0:
        record_submission(sweep_dir, line)
        recorded = True
    if not recorded:
        raise SweepError(f"sbatch submitted nothing (exit {sbatch.returncode}, its message above); no submission is "
                         "recorded, so once what it names is fixed, submit again")
    return sbatch.returncode


def record_submission(sweep_dir: Path, line: str) -> None:
    with open(sweep_dir / SUBMITTED, "a") as record:
        record.write(line + "\n")


def run_locally(sweep_file: Path) -> int:
    """One run after another in this process's environment, each in its own run directory."""
    runs, sweep_dir = prepare(sweep_file)
    python = os.environ.get("PYTHON", sys.executable)
    failed, interrupted = [], []
    # Ctrl-C reaches the run too, which saves a checkpoint and exits 75: wait for that, then
    # stop here instead of dying at once and leaving the run to be killed mid-save.
    previous = signal.signal(signal.SIGINT, lambda signum, frame: interrupted.append(signum))
    for i, (name, args) in enumerate(zip(names_of(runs), runs, strict=True)):
        print(f"== run {i + 1}/{len(runs)}: {name}", flush=True)
        code = subprocess.run([python, str(HERE / "mnist_ddp.py"), *args, "--log-dir", str(sweep_dir), "--run-name", name]).returncode
        code = 128 - code if code < 0 else code  # killed by signal N: 128+N, as a shell and Slurm say
        # For summary, as run_training.sbatch writes it: also when mnist_ddp.py stopped before
        # it made the run's directory (a bad option, exit 2).
        (sweep_dir / name).mkdir(exist_ok=True)
        Path(JobPaths(str(sweep_dir / name)).exit_code).write_text(f"{code}\n")
        if code:
            failed.append(f"{name} (exit {code})")
        if interrupted:
            signal.signal(signal.SIGINT, previous)
            print(f"{PROG}: stopped on Ctrl-C in run {i + 1} of {len(runs)}; to go on (finished runs say so, a stopped "
                  f"one resumes): {command('run', sweep_file)}", file=sys.stderr, flush=True)
            return EXIT_STOPPED
    signal.signal(signal.SIGINT, previous)
    print(summary_table(collect(sweep_dir)))
    if failed:
        print(f"{PROG}: {len(failed)} of {len(runs)} runs failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


# ----------------------------------------------------------------------------- summary

STATES = {0: "done", EXIT_BUG: "failed (exit 1: a bug)", EXIT_USAGE: "failed (exit 2: usage)",
          EXIT_DIVERGED: "diverged (exit 3)", EXIT_LOST_PEER: "failed (exit 4: lost a peer)",
          EXIT_NODE_FAULT: "failed (exit 5: a node's fault)",
          EXIT_STOPPED: "stopped (exit 75)", 130: "failed (exit 130: Ctrl-C before training)"}


def exit_state(code: int) -> str:
    """The state of a run that ended with `code`, as docs/sweeps.md lists them."""
    if code in STATES:
        return STATES[code]
    if 128 < code < 128 + signal.NSIG:
        try:
            return f"failed (exit {code}: killed by {signal.Signals(code - 128).name})"
        except ValueError:  # (a number no signal has)
            pass
    return f"failed (exit {code})"


def run_state(run_dir: Path) -> str:
    if not run_dir.is_dir():
        return "pending"
    code_file = Path(JobPaths(str(run_dir)).exit_code)
    if code_file.exists():
        code = int(code_file.read_text().strip() or 1)
        return exit_state(code)
    requeues = requeues_of(run_dir / "run.json")
    return f"requeued ({requeues}x), running" if requeues else "running"


def requeues_of(started: Path) -> int:
    """How often Slurm requeued a run, from the run.json that mnist_ddp.py writes as each
    attempt starts: 0 without one. One that cannot tell (empty, cut short by a crash, or
    written by an older version) is named on stderr and counts as 0: the summary goes on."""
    try:
        text = started.read_text(errors="replace")
    except FileNotFoundError:
        return 0
    except OSError as err:
        return unreadable(started, f"cannot read it ({err.strerror})")
    try:
        return int(json.loads(text)["environment"].get("slurm_requeues") or 0)
    except ValueError:
        return unreadable(started, "empty" if not text.strip() else "not whole JSON (cut short?)")
    except (KeyError, TypeError, AttributeError):
        return unreadable(started, "not in the format this sweep.py reads (an older version wrote it?)")


def unreadable(path: Path, reason: str) -> int:
    print(f"{PROG}: warning: {path}: {reason}; that run's requeues are not counted", file=sys.stderr)
    return 0


def collect(sweep_dir: Path) -> list[dict]:
    """What every run of the sweep wrote so far; runs the sweep file names but that have not started are pending."""
    if not sweep_dir.is_dir():
        raise SweepError(f"{sweep_dir}: no such sweep directory; pass LOG_DIR/NAME, e.g. runs/lr-bs")
    sweep_file = sweep_dir / "sweep.txt"
    runs = read_lines(sweep_file, allow_run_dirs=True) if sweep_file.exists() else []
    varied = varying(runs) if runs else []
    names = names_of(runs) if runs else sorted(p.name for p in sweep_dir.iterdir() if (p / "metrics.jsonl").exists()
                                               or holds_job_files(p))
    rows = []
    for i, name in enumerate(names):
        run_dir = sweep_dir / name
        metrics_file = run_dir / "metrics.jsonl"
        records = read_records(metrics_file)
        last = records[-1] if records else {}
        options = as_options(runs[i]) if runs else {}
        rows.append({"run": name, "options": {k: options.get(k) for k in varied},
                     "test_accuracy": last.get("test_accuracy"), "test_loss": last.get("test_loss"),
                     "train_loss": last.get("train_loss"), "epochs": last.get("epoch", 0),
                     "wall_s": round(sum(r.get("epoch_s", 0) for r in records), 1), "state": run_state(run_dir)})
    rows.sort(key=lambda r: (r["test_accuracy"] is None, -(r["test_accuracy"] or 0)))
    return rows


def summary_table(rows: list[dict]) -> str:
    varied = list(rows[0]["options"]) if rows else []
    header = ["#", *varied, "test acc", "test loss", "train loss", "epochs", "wall s", "state", "run"]

    def fmt(value, spec):
        return "-" if value is None else format(value, spec)
    lines = [header]
    for n, r in enumerate(rows, 1):
        lines.append([str(n), *(str(r["options"][k] if r["options"][k] is not None else "-") for k in varied),
                      "-" if r["test_accuracy"] is None else f"{100 * r['test_accuracy']:.2f}%",
                      fmt(r["test_loss"], ".4f"), fmt(r["train_loss"], ".4f"), str(r["epochs"]), f"{r['wall_s']:.1f}",
                      r["state"], r["run"]])
    widths = [max(len(line[c]) for line in lines) for c in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in lines)


# ----------------------------------------------------------------------------- command line

def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("grid", allow_abbrev=False,
                        help="print every combination of the listed option values: --lr 1e-3 3e-3 --epochs 4")
    p = commands.add_parser("submit", allow_abbrev=False,
                            help="submit the sweep file as one Slurm job array; other options go to sbatch")
    p.add_argument("sweep_file", type=Path)
    p.add_argument("--parallel", type=int, default=0, help="at most N tasks at once (sbatch --array=...%%N; 0: no limit)")
    commands.add_parser("run", allow_abbrev=False,
                        help="run the sweep file's runs one after another here").add_argument("sweep_file", type=Path)
    p = commands.add_parser("summary", allow_abbrev=False, help="the runs of a sweep directory, best first")
    p.add_argument("sweep_dir", type=Path)
    p.add_argument("--json", action="store_true", help="the same data as JSON")
    # grid's options and submit's sbatch options are not ours to know: they come back unparsed.
    args, rest = parser.parse_known_args(argv)
    if rest and args.command not in ("grid", "submit"):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        if args.command == "grid":
            print("\n".join(grid(rest)))
        elif args.command == "submit":
            if args.parallel < 0:
                raise SweepError(f"--parallel must be 0 (no limit) or more, got {args.parallel}")
            return submit(args.sweep_file, args.parallel, rest)
        elif args.command == "run":
            return run_locally(args.sweep_file)
        elif args.command == "summary":
            rows = collect(args.sweep_dir)
            print(json.dumps(rows, indent=1) if args.json else summary_table(rows))
        return 0
    except SweepError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
