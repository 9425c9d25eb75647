"""tensorboard.sh and torchrun_commands.sh as users run them, from real bash, on odd input:
every number they read is decimal with bounds (bash's arithmetic reads 00080 as octal),
whatever is pasted into a printed command line is checked first, and every printed line
is quoted so that a shell reads it back word for word: the torchrun lines, split with
shlex as a shell would, run for real with a SCRIPT path that holds a space. Bad input
gives one line on stderr and exit code 2. The view line a run prints works as printed in a
shell where no environment is active. (run_training.sbatch's checks run on a real Slurm, in
test_slurm.py.)

    python -m pytest tests/runs/test_shell_scripts.py
"""

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from helpers.images import read_metrics
from helpers.processes import ROOT, clean_env, free_port

TENSORBOARD_SH = ROOT / "tensorboard.sh"
TORCHRUN_COMMANDS = ROOT / "torchrun_commands.sh"
OMP_PREFIX = "OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}"  # printed as is: each machine's shell expands it


def venv_env(**extra: str) -> dict[str, str]:
    return clean_env(PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", **extra)


def run_to_the_end(cmd: list[str], env: dict[str, str], cwd: Path, seconds: float = 60) -> subprocess.CompletedProcess:
    """Run cmd; one still running after `seconds` (a server that accepted the input) is stopped, and the test fails."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        pytest.fail(f"{cmd} accepted its input and kept running:\n{out[-2000:]}\n{err[-2000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def first_lines_of_tensorboard(args: list[str], env: dict[str, str], cwd: Path) -> list[str]:
    """tensorboard.sh's lines up to "TensorBoard on ...", which it prints before it starts
    the server; then the server is stopped."""
    proc = subprocess.Popen([str(TENSORBOARD_SH), *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("TensorBoard on "):
                break
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.communicate(timeout=60)
    return lines


# ----------------------------------------------------------------------------- tensorboard.sh

@pytest.mark.parametrize("args, env", [
    (["--port", "00080"], {}),  # octal 64 passed the check, then TensorBoard listened on port 80
    (["--port=099999"], {}),  # not octal at all: a traceback and "ports ... are all taken"
    ([], {"PORT": "00080"}),
    (["--port", "099999999999999999999"], {}),  # more than bash's 64 bits
    (["--port", "65536"], {}),
])
def test_tensorboard_port_is_decimal_within_bounds(tmp_path, args, env):
    (tmp_path / "runs").mkdir()
    given = env.get("PORT") or args[-1].removeprefix("--port=")
    result = run_to_the_end([str(TENSORBOARD_SH), *args], venv_env(**env), tmp_path)
    assert (result.returncode, result.stdout) == (2, ""), result.stderr
    assert result.stderr == f"tensorboard.sh: --port must be a number from 1024 to 65535 or 'random', got '{given}'\n"


def test_tensorboard_reads_a_port_with_leading_zeros_as_decimal(tmp_path):
    (tmp_path / "runs").mkdir()
    port = free_port()
    lines = first_lines_of_tensorboard(["--port", f"00{port}"], venv_env(), tmp_path)
    assert lines[-1] == f"TensorBoard on 127.0.0.1:{port}, log directory runs (Ctrl-C to stop)", lines
    assert f"then browse to http://localhost:{port}/" in lines


@pytest.mark.parametrize("login", ["login.example.org", None])
def test_tensorboard_tunnel_line_is_quoted_for_the_shell(tmp_path, login):
    """A user name with a space: the printed ssh line, read back as a shell would, still
    names that user (from a compute node through LOGIN_HOST, and directly)."""
    (tmp_path / "runs").mkdir()
    port = free_port()
    env = venv_env(USER="first last", **({"LOGIN_HOST": login} if login else {}))
    lines = first_lines_of_tensorboard(["--port", str(port)], env, tmp_path)
    ssh = [shlex.split(line) for line in lines if line.startswith("  ssh ")]
    assert len(ssh) == 1, lines
    hop = ["-J", f"first last@{login}"] if login else []
    assert ssh[0][:-1] == ["ssh", "-N", *hop, "-L", f"{port}:localhost:{port}"]
    assert ssh[0][-1].startswith("first last@") and " " not in ssh[0][-1].removeprefix("first last@")


def test_tensorboard_help_opens_with_its_usage_not_the_sbatch_lines(tmp_path):
    result = run_to_the_end([str(TENSORBOARD_SH), "--help"], venv_env(), tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("Usage: tensorboard.sh "), lines[:3]
    assert not [line for line in lines if "SBATCH --" in line or line.startswith("#")]
    assert {"LOG_DIR", "PORT", "VENV", "LOGIN_HOST"} <= {line.split()[0] for line in lines if line.startswith("  ")}


def no_environment() -> dict[str, str]:
    """A fresh login shell's: no virtual environment active, and none on the PATH."""
    venv_bin = str(Path(sys.executable).parent)
    path = os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep) if d != venv_bin)
    assert shutil.which("tensorboard", path=path) is None, "a tensorboard outside the environment would hide the case"
    env = clean_env(PATH=path)
    env.pop("VIRTUAL_ENV", None)
    return env


@pytest.mark.parametrize("interpreter", ["a-venv-elsewhere", "the-projects-venv"])
@pytest.mark.slow
def test_the_view_line_of_a_run_starts_tensorboard_sh_as_printed(tmp_path, interpreter):
    """What a run prints to view its logs, pasted into a shell where no environment is active,
    in the directory the run started from: the project's tensorboard.sh on the run's log
    directory, with the run's own interpreter named when tensorboard.sh would not find it
    (the project's .venv it finds by itself)."""
    project = tmp_path / "project"
    shutil.copytree(ROOT, project, ignore=shutil.ignore_patterns(".git", ".venv", "runs", "mutants", "__pycache__"))
    python = sys.executable
    if interpreter == "the-projects-venv":
        (project / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)
        python = str(project / ".venv" / "bin" / Path(sys.executable).name)
    run = subprocess.run([python, "mnist_ddp.py", "--epochs", "1", "--max-steps", "2", "--image-every", "0"],
                         cwd=project, env=no_environment() | {"OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    view = next(line for line in run.stdout.splitlines() if line.startswith("TensorBoard logs: "))
    line = view.split("(view: ", 1)[1].removesuffix(")")
    named = f"PYTHON={shlex.quote(python)} " if interpreter == "a-venv-elsewhere" else ""
    assert line == f"{named}./tensorboard.sh --logdir runs", view
    printed = subprocess.Popen(["bash", "-c", line], cwd=project, env=no_environment(), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []
    try:
        for said in printed.stdout:  # up to the line it prints as TensorBoard starts
            lines.append(said)
            if said.startswith("TensorBoard on "):
                break
        port = int(lines[-1].split(":")[1].split(",")[0]) if lines[-1].startswith("TensorBoard on ") else 0
        answer = tensorboard_answer(port) if port else ""
    finally:
        os.killpg(printed.pid, signal.SIGTERM)
        rest = printed.communicate(timeout=60)[0]
    assert lines[0] == "On your own computer, open the tunnel:\n", lines + [rest]
    assert lines[-1].endswith(", log directory runs (Ctrl-C to stop)\n"), lines + [rest]
    assert "TensorBoard" in answer


def test_tensorboard_with_a_python_that_lacks_it_says_how_to_install_it(tmp_path):
    """PYTHON without TensorBoard, and none on the PATH or in a .venv: one line naming the pip
    install. With a tensorboard on the PATH (PYTHON was a path inside a run's container), that one runs."""
    (tmp_path / "runs").mkdir()
    bare = tmp_path / "bare" / "bin" / "python"  # an environment made without the requirements
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare.parents[1])], check=True, timeout=120)
    alone = tmp_path / "project" / "tensorboard.sh"  # a copy of the file with no .venv beside it
    alone.parent.mkdir()
    shutil.copy2(TENSORBOARD_SH, alone)
    no_venv = clean_env(PYTHON=str(bare), PATH="/usr/bin:/bin")
    result = run_to_the_end([str(alone)], no_venv, tmp_path)
    assert (result.returncode, result.stdout) == (2, ""), result.stderr
    assert result.stderr == (f"tensorboard.sh: PYTHON={bare} cannot run TensorBoard; run: {bare} -m pip install -r "
                             "requirements.txt\n")
    on_path = tmp_path / "bin" / "tensorboard"  # stands in for the host's TensorBoard: says how it was started
    on_path.parent.mkdir()
    on_path.write_text('#!/bin/sh\necho "tensorboard $*"\n')
    on_path.chmod(0o755)
    result = run_to_the_end([str(alone)], {**no_venv, "PATH": f"{on_path.parent}:/usr/bin:/bin"}, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "tensorboard --logdir runs --host 127.0.0.1" in result.stdout


def tensorboard_answer(port: int, seconds: float = 60) -> str:
    """The page TensorBoard serves on 127.0.0.1:port, once it listens."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as page:
                return page.read().decode(errors="replace")
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


# ----------------------------------------------------------------------------- torchrun_commands.sh

def torchrun_commands(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(TORCHRUN_COMMANDS), *args], cwd=cwd, env=venv_env(**env), capture_output=True,
                          text=True, timeout=60)


def printed_lines(stdout: str) -> list[list[str]]:
    """The lines to run, one per machine, split with shlex as a shell would."""
    return [shlex.split(line) for line in stdout.splitlines() if not line.startswith("#")]


def test_torchrun_commands_numbers_are_decimal_within_bounds(tmp_path):
    result = torchrun_commands(["010", "08", "head-node"], tmp_path, PORT="029400", RUN_ID="r")
    assert result.returncode == 0, result.stderr
    lines = printed_lines(result.stdout)
    assert len(lines) == 10
    for node, words in enumerate(lines):
        assert words == [OMP_PREFIX, "torchrun", "--nnodes=10", "--nproc-per-node=8", "--rdzv-backend=c10d",
                         "--rdzv-endpoint=head-node:29400", "--rdzv-id=r", f"--node-rank={node}", "mnist_ddp.py"]


@pytest.mark.parametrize("args, env, message", [
    (["99999999999999999999", "1", "h"], {}, "NODES must be a number from 1 to 10000, got '99999999999999999999'"),
    (["1", "0", "h"], {}, "PROCS_PER_NODE must be a number from 1 to 1024, got '0'"),
    (["2", "1", "h"], {"PORT": "29400; touch pwned"}, "PORT must be a number from 1024 to 65535, got '29400; touch pwned'"),
    (["2", "1", "h"], {"PORT": "00080"}, "PORT must be a number from 1024 to 65535, got '00080'"),
    (["2", "1", "h"], {"RUN_ID": "a; touch pwned"}, "RUN_ID must be letters, digits and ._-, got 'a; touch pwned'"),
    (["2", "1", "h;touch pwned"], {},
     "HEAD_ADDRESS must be a host name or an address of the first machine, got 'h;touch pwned'"),
    (["2", "1", "-h"], {}, "HEAD_ADDRESS must be a host name or an address of the first machine, got '-h'"),
])
def test_torchrun_commands_refuse_what_would_break_the_printed_line(tmp_path, args, env, message):
    result = torchrun_commands(args, tmp_path, **env)
    assert (result.returncode, result.stdout, result.stderr) == (2, "", f"torchrun_commands.sh: {message}\n")


@pytest.mark.slow
def test_printed_torchrun_lines_run_with_a_space_in_the_script_path(tmp_path):
    """Two 'machines' on this one, each running the line printed for it, split with shlex as
    a shell would; the project sits in a directory whose name holds a space, and so does an
    option's value."""
    project = tmp_path / "my project"
    project.symlink_to(ROOT, target_is_directory=True)
    script = str(project / "mnist_ddp.py")
    work = tmp_path / "work"
    work.mkdir()
    result = torchrun_commands(["2", "1", "127.0.0.1", "--max-steps", "4", "--epochs", "1", "--run-dir", "runs/my run"],
                               work, SCRIPT=script, PORT=str(free_port()), RUN_ID="spaces")
    assert result.returncode == 0, result.stderr
    lines = printed_lines(result.stdout)
    assert len(lines) == 2 and all(words[0] == OMP_PREFIX and script in words for words in lines), result.stdout
    env = venv_env(OMP_NUM_THREADS="1")  # what each machine's shell makes of the prefix
    machines = [subprocess.Popen(words[1:], cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                for words in lines]
    outputs = [m.communicate(timeout=300)[0] for m in machines]
    assert [m.returncode for m in machines] == [0, 0], outputs
    assert read_metrics(work / "runs" / "my run")[0]["step"] == 4
