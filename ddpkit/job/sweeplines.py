"""A sweep file's option lines and the run names sweep.py gives them (sweep.py's docstring
says what a sweep file holds).

The job's supervisor, which run_training.sbatch starts on the host with the host's python3,
finds the line and run name of its array task here (task): the training's own interpreter
may live in a container the host cannot run, and a login or compute node's python3 may be
as old as 3.6 (RHEL 8). So this file uses the standard library alone and nothing newer
than Python 3.6, which the tests check with vermin.
"""

import os
import re
import shlex
import sys
from pathlib import Path
from typing import Dict, List

PROG = "sweep.py"


class SweepError(Exception):
    """One line on stderr and exit code 2."""


def quote_words(words: List[str]) -> str:
    """shlex.join, which Python 3.6 lacks."""
    return " ".join(shlex.quote(word) for word in words)


def command(*args: object) -> str:
    """A sweep.py command line for a message, quoted so that it works when pasted: it starts
    with the interpreter that runs now (a bare `python` may be missing, or lack torch)."""
    script = sys.argv[0] if os.path.basename(sys.argv[0]) == PROG else PROG
    return quote_words([sys.executable or "python3", script] + [str(arg) for arg in args])


# The options that name a run's directory: a sweep sets them (LOG_DIR/<sweep>/<run name>), and
# run_training.sbatch passes them itself (from LOG_DIR and RUN_NAME).
RUN_DIR_OPTIONS = ("--run-name", "--run-dir", "--log-dir")


def names_run_dir(word: str) -> bool:
    """Whether a word of an option line is one of RUN_DIR_OPTIONS, as --opt or --opt=value
    (mnist_ddp.py takes no abbreviation of an option)."""
    return word.partition("=")[0] in RUN_DIR_OPTIONS


NAME_CHARS = r"\w.+=,@-"  # what the name of a run's or a sweep's directory is made of (contract.is_run_name)


def as_name(text: str) -> str:
    """Text as a directory name: what is not a letter, digit or ._-+=,@ becomes _ (the result
    may still be "", . or .., which name no directory)."""
    return re.sub(f"[^{NAME_CHARS}]", "_", text)


def read_lines(path: Path, allow_run_dirs: bool = False) -> List[List[str]]:
    """The runs of a sweep file: each line split as a shell would, # starting a comment,
    blank ones left out. Every line is checked here, before anything is written: it must
    be --options and values, and name no run directory (allow_run_dirs: reading back a
    sweep directory that an older sweep.py wrote)."""
    if path.is_dir():
        hint = "; the table of its runs: {}".format(command("summary", path)) if (path / "sweep.txt").is_file() else ""
        raise SweepError(f"{path} is a directory, not a sweep file{hint}")
    if not path.is_file():
        raise SweepError(f"{path}: no such sweep file; write one option line per run, or let grid write them, e.g. "
                         f"{command('grid', '--lr', '1e-3', '3e-3', '--epochs', '4')} > {shlex.quote(str(path))}")
    try:
        data = path.read_bytes()
        text = data.decode("utf-8")
    except OSError as err:
        raise SweepError(f"{path}: cannot read it ({err.strerror})") from None
    except UnicodeDecodeError as err:
        number = data.count(b"\n", 0, err.start) + 1
        raise SweepError(f"{path}:{number}: not UTF-8 text (byte {data[err.start]:#04x}); save the file as UTF-8") from None
    runs = []
    for number, line in enumerate(text.splitlines(), 1):
        try:
            words = shlex.split(line, comments=True)
            as_options(words)
        except (ValueError, SweepError) as err:
            raise SweepError(f"{path}:{number}: {err}") from None
        named = [word.partition("=")[0] for word in words if names_run_dir(word)]
        if named and not allow_run_dirs:
            raise SweepError(f"{path}:{number}: {named[0]}: a sweep names each run's directory itself (LOG_DIR/<sweep file's "
                             "name>/<the options that vary>), so a line takes no --run-name, --run-dir or --log-dir; "
                             "delete it, and set LOG_DIR to put the sweep elsewhere")
        if words:
            runs.append(words)
    if not runs:
        raise SweepError(f"{path} holds no option lines")
    return runs


def line_numbers(path: Path) -> List[int]:
    """The number in the file of each run's line, as read_lines reads them (run i is line line_numbers[i])."""
    lines = path.read_bytes().decode("utf-8").splitlines()
    return [number for number, line in enumerate(lines, 1) if shlex.split(line, comments=True)]


def as_options(args: List[str]) -> Dict[str, str]:
    """'--lr 1e-3 --amp' -> {'lr': '1e-3', 'amp': ''}; the last of a repeated option wins."""
    options, i = {}, 0
    while i < len(args):
        if not args[i].startswith("--"):
            raise SweepError(f"expected an --option, got {args[i]!r} in: {quote_words(args)}")
        name, eq, value = args[i][2:].partition("=")
        if not re.fullmatch(r"[a-z][a-z0-9-]*", name):
            raise SweepError(f"{args[i].partition('=')[0]!r} is not an option name (--lower-case-words)")
        if not eq and i + 1 < len(args) and not args[i + 1].startswith("--"):
            value, i = args[i + 1], i + 1
        options[name] = value
        i += 1
    return options


def varying(runs: List[List[str]]) -> List[str]:
    """The options whose values are not the same on every line, in order of appearance."""
    parsed = [as_options(run) for run in runs]
    names = []  # (in order of appearance: a dict keeps it only from Python 3.7)
    for options in parsed:
        names += [name for name in options if name not in names]
    return [name for name in names if len({options.get(name) for options in parsed}) > 1]


def run_name(args: List[str], varied: List[str], index: int) -> str:
    """A directory name that tells the runs apart: the varied options, as lr=1e-3,batch-size=64."""
    options = as_options(args)
    parts = [f"{name}={options[name]}" if options.get(name) else name for name in varied if name in options]
    name = as_name(",".join(parts))[:120]
    return name or f"task-{index}"


def names_of(runs: List[List[str]]) -> List[str]:
    varied = varying(runs)
    names = [run_name(run, varied, i) for i, run in enumerate(runs)]
    return [name if names.count(name) == 1 else f"{i}-{name}" for i, name in enumerate(names)]


def task(sweep_file: Path, index: int) -> List[str]:
    """For the job's supervisor: the run name of array task `index`, then its options."""
    runs = read_lines(sweep_file)
    if not 0 <= index < len(runs):
        raise SweepError(f"array task {index} has no line in {sweep_file} ({len(runs)} runs): submit with --array=0-{len(runs) - 1}")
    return [names_of(runs)[index], *runs[index]]
