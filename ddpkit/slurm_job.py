"""The Slurm job's supervisor: run_training.sbatch hands the job over to it once the site's
setup has run and the Python environment is active. It reads the settings (environment
variables, listed in docs/clusters.md), keeps a copy of the code the job runs, checks the
ranks' interpreter (PREFLIGHT), starts the ranks as one srun step (or one torchrun per node),
decides from their exit codes what happened (settle), starts the step again after a killed
rank or a lost peer (on the nodes left, with MIN_NODES, when a node was lost), requeues the
job after a stop that asks for it, and prints the line that continues the run.

It runs on the host with the python3 on the PATH (the active environment's, else the
node's), outside the container when the ranks run in one (srun, scontrol and scancel are on
the host). That python3 may be as old as 3.6 (RHEL 8): so the standard library only, and
nothing newer than Python 3.6 (tests/test_slurm_job.py checks it with vermin). The rules the
ranks share with it are written here once, and ddpkit/launch.py, time_limit.py, rundir.py,
options.py and jobs.py import them: the run's name, the rendezvous port, the job's name in
scontrol, reading scontrol's line, the requeue, the exit codes.

    python3 ddpkit/slurm_job.py supervise --project DIR --batch-file FILE --environment TEXT -- [training options]
    PYTHON ddpkit/slurm_job.py task train|torchrun ARGS...   # what srun starts in each task
"""

import argparse
import datetime
import filecmp
import io
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Callable, Dict, List, Mapping, Optional, Tuple

if __name__ == "__main__" and not __package__:  # run as a file: ddpkit is its directory's parent
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from ddpkit import sweeplines  # (after the path above)

PROG = "run_training.sbatch"
SCONTROL_TIMEOUT = 60.0  # seconds; a slow controller must not hold the job forever
# The exit codes of the ranks and of the job (ddpkit/launch.py and the ranks use these).
EXIT_BUG = 1
EXIT_USAGE = 2
EXIT_DIVERGED = 3
EXIT_LOST_PEER = 4  # another rank died or hung: the one failure that running again fixes
EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped on request, try again to continue
REQUEUE_WAIT = 120  # seconds to wait for Slurm to end this job after a requeue, before the END line
SIGNALS = ("USR1", "TERM", "HUP", "INT")
# The settings a job passes on to the one that continues it, as they were given (the
# directories and the run's name follow from these and are added to the line too).
PASSED_ON = ("PROJECT_DIR", "SCRIPT", "SETUP", "CONDA_ENV", "VENV", "PYTHON", "NODE_DATA_DIR", "LAUNCHER",
             "MAX_RESTARTS", "MIN_NODES", "OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "CONTAINER",
             "CONTAINER_RUNTIME", "CONTAINER_CMD", "SIGNAL")
# The options that belong to a run's first start alone: where it started from (a restart or a
# requeue goes on from the run's own newest checkpoint, as --resume auto does; --resume never
# would refuse it) and the stop rehearsed at a chosen step (it would stop the run there again).
# The step that continues a run, and every line printed to continue it, leave them out.
FIRST_START_ONLY = ("--resume", "--interrupt-at")
CKPT_NAME = "ckpt-{:08d}.pt"  # the one name of the checkpoint of each step, in RUN_DIR/checkpoints


class JobError(Exception):
    """A setting or a state the user fixes: one line on stderr and exit code 2."""


# ----------------------------------------------------------------------------- rules the ranks share

def without_first_start_options(args: List[str]) -> List[str]:
    """The options with those of FIRST_START_ONLY left out, as --opt VALUE or --opt=VALUE."""
    kept, value_next = [], False  # type: List[str], bool
    for arg in args:
        if value_next:
            value_next = False
        elif arg in FIRST_START_ONLY:
            value_next = True
        elif arg.partition("=")[0] not in FIRST_START_ONLY:
            kept.append(arg)
    return kept


def option_value(args: List[str], option: str) -> str:
    """The value the last --option VALUE or --option=VALUE of args gives, or ""."""
    value = ""
    for i, arg in enumerate(args):
        if arg == option and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(option + "="):
            value = arg[len(option) + 1:]
    return value


def step_of_checkpoint(name: str) -> int:
    """The step in a checkpoint's file name (ckpt-00000120.pt: 120), -1 for any name but the one
    a run gives the checkpoint of that step: ckpt-best.pt, or ckpt-120.pt beside
    ckpt-00000120.pt, is a user's copy, never taken for the run's own."""
    match = re.fullmatch(r"ckpt-(\d+)\.pt", name)
    return int(match.group(1)) if match and name == CKPT_NAME.format(int(match.group(1))) else -1


def continuing_args(given: List[str], run_dir: str) -> List[str]:
    """The options of a restart or a requeue, which go on from the run's own newest checkpoint:
    without those of FIRST_START_ONLY. But while the run holds none (its first start ended
    before its first save), a --resume FILE stays: else it would start afresh, not from FILE."""
    kept = without_first_start_options(given)
    resume = option_value(given, "--resume")
    try:
        names = os.listdir(os.path.join(run_dir, "checkpoints"))
    except OSError:
        names = []
    if resume not in ("", "auto", "never") and not any(step_of_checkpoint(name) >= 0 for name in names):
        kept.append("--resume=" + resume)
    return kept


def is_run_name(name: str) -> bool:
    """The one rule for a run's name: one directory name, so that LOG_DIR/NAME stays in LOG_DIR."""
    return re.fullmatch(f"[{sweeplines.NAME_CHARS}]+", name) is not None and name not in (".", "..")


RUN_NAME_RULE = "one directory name of letters, digits and ._-+=,@ (no / or spaces, not . or ..)"


def run_name_setting() -> str:
    """How advice names another run: --run-name, or in a job of run_training.sbatch (which
    reads RUN_NAME and refuses --run-name after its file name) RUN_NAME."""
    return "RUN_NAME" if os.environ.get("MNIST_DDP_RESUBMIT") else "--run-name"


def this_job(env: Mapping[str, str]) -> str:
    """This job as scontrol and scancel name it: an array task is ARRAYID_TASK."""
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env.get("SLURM_JOB_ID", "")


def default_run_name(job: str) -> str:
    """The run's name when none is given: a requeued job finds its own directory again."""
    return "job-" + job


def port_from_job_id(job_id: str) -> int:
    """A rendezvous port every task of a job derives alike, different for jobs sharing a node.
    10000-29999 stays below Linux's ephemeral range (32768-60999), so an outgoing connection
    cannot already hold it."""
    return 10000 + int(job_id or 0) % 20000


def job_fields(info: str) -> Dict[str, str]:
    """The KEY=VALUE fields of one `scontrol show job -o` line."""
    return dict(re.findall(r"(\w+)=(\S*)", info))


def requeue_of(fields: Mapping[str, str]) -> Optional[bool]:
    """Whether the job's scontrol fields say it may be requeued (None: they do not say)."""
    if fields.get("BatchFlag") == "0":  # an interactive allocation (salloc) is never requeued
        return False
    return {"1": True, "0": False}.get(fields.get("Requeue", ""))


def run(command: List[str], timeout: float = SCONTROL_TIMEOUT, env: Optional[Mapping[str, str]] = None
        ) -> subprocess.CompletedProcess:
    """A command's exit code and its output as UTF-8 text, whatever the locale (Python 3.6 reads
    a C locale as ASCII; subprocess.run's text= and capture_output= are newer)."""
    return subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, encoding="utf-8", errors="replace",
                          timeout=timeout, env=env)


def last_line(text: str) -> str:
    """The last line a command wrote (scontrol's error follows its warnings), or ""."""
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


def show_job(job: str, timeout: float = SCONTROL_TIMEOUT) -> str:
    """This job's one `scontrol show job -o` line, times in ISO form ("" when scontrol cannot say)."""
    try:
        result = run(["scontrol", "show", "job", "-o", job], timeout, dict(os.environ, SLURM_TIME_FORMAT="standard"))
    except (OSError, subprocess.SubprocessError):
        return ""
    return result.stdout.partition("\n")[0] if result.returncode == 0 else ""


def requeue_job(job: str, after: str = "", before: str = "", timeout: float = SCONTROL_TIMEOUT,
                about_to_requeue: Callable[[], None] = lambda: None) -> bool:
    """Ask Slurm to requeue this job, if it may: the one requeue, of the supervisor and of a rank
    0 that runs without it. Any failure (no scontrol, a timeout, a refusal) means 'not
    requeued', said in one line, never a crash. When Slurm accepts, it ends the job's processes."""
    if not job or shutil.which("scontrol") is None:
        return False
    try:
        shown = run(["scontrol", "show", "job", "-o", job], timeout)
        if shown.returncode != 0:
            print(f"could not requeue Slurm job {job} (scontrol show job: {last_line(shown.stderr)})", flush=True)
            return False
        fields = job_fields(shown.stdout.partition("\n")[0])
        if fields.get("BatchFlag") == "0":
            print(f"Slurm job {job} is an interactive allocation (salloc), which Slurm does not requeue", flush=True)
            return False
        if not requeue_of(fields):  # (the rule the time limit's estimate follows too)
            print(f"Slurm job {job} may not be requeued (it was submitted without --requeue)", flush=True)
            return False
        after = " after " + after if after else ""
        print(f"requeueing Slurm job {job}{after}; it resumes from its last checkpoint{before}", flush=True)
        about_to_requeue()
        result = run(["scontrol", "requeue", job], timeout)
    except (OSError, subprocess.SubprocessError) as err:
        print(f"could not requeue Slurm job {job} (scontrol: {err})", flush=True)
        return False
    if result.returncode != 0:
        why = last_line(result.stderr) or f"exit {result.returncode}"
        print(f"could not requeue Slurm job {job} (scontrol requeue: {why})", flush=True)
    return result.returncode == 0


def unix_time(text: str) -> Optional[int]:
    """Unix seconds of a time as scontrol prints it (2026-11-24T10:00:00, local time on the
    host); None for Unknown, None or N/A."""
    try:
        return int(time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%S")))
    except ValueError:
        return None


# ----------------------------------------------------------------------------- the settings

class Settings:
    """What the job does, from the environment at submission (docs/clusters.md lists it) and
    the job's own facts. read_settings fills every field."""
    project = shared = script = data_dir = log_dir = run_name = launcher = signal = sweep_file = ""
    node_data_dir = python = environment = batch_file = job = ""
    passed_on = {}  # type: Dict[str, str]  # the PASSED_ON settings as given, before the supervisor sets any
    check = interactive = min_nodes_set = False
    max_restarts = master_port = ntasks = nodes = tasks_per_node = 0
    job_nodes = min_nodes = 0  # the nodes the job was given; the fewest it goes on with after losing some
    container = []  # type: List[str]      # words before each rank's command (Apptainer, Singularity, CONTAINER_CMD)
    container_srun = []  # type: List[str]  # srun's own options (Pyxis)
    container_desc = "none"
    sweep_args = []  # type: List[str]      # the options of this array task's line of SWEEP_FILE
    args = []  # type: List[str]            # the training options given after the batch file's name

    @property
    def run_dir(self) -> str:
        return os.path.join(self.log_dir, self.run_name)

    @property
    def job_dir(self) -> str:
        """This job's own folder in the run directory: each rank's exit code (rank-<r>), the
        command that continues the run, `requeue`, `run-dir-taken`. Another job of the same
        run, refused while this one runs, never touches it."""
        return os.path.join(self.run_dir, "exit-codes", "job-" + self.job)


def decimal(env: Mapping[str, str], name: str, low: int, high: int, default: int) -> int:
    """A number setting, read as decimal (08 and 00080 too), from low to high."""
    value = env.get(name, "")
    if not value:
        return default
    if not re.fullmatch(r"[0-9]{1,9}", value.lstrip("0") or "0") or not low <= int(value) <= high:
        raise JobError(f"{name} must be a number from {low} to {high}, got '{value}'")
    return int(value)


def sweep_dir_name(sweep_file: str) -> str:
    return sweeplines.as_name(os.path.splitext(os.path.basename(sweep_file))[0])


def read_settings(env: Mapping[str, str], project: str, batch_file: str, environment: str, args: List[str],
                  fields: Mapping[str, str]) -> Settings:
    """Every setting checked, with the defaults filled in; a JobError names the first wrong one."""
    s = Settings()
    s.project, s.batch_file, s.environment, s.args = project, batch_file, environment, list(args)
    s.job, s.interactive = this_job(env), fields.get("BatchFlag") == "0"
    s.passed_on = {name: env[name] for name in PASSED_ON if env.get(name)}
    s.shared = env.get("SHARED_DIR") or env.get("SLURM_SUBMIT_DIR") or os.getcwd()
    s.script = env.get("SCRIPT") or os.path.join(project, "mnist_ddp.py")
    s.data_dir = env.get("DATA_DIR") or os.path.join(s.shared, "data")
    s.sweep_file, s.node_data_dir = env.get("SWEEP_FILE", ""), env.get("NODE_DATA_DIR", "")
    s.log_dir = env.get("LOG_DIR", "")
    if s.sweep_file and not s.log_dir:
        name = sweep_dir_name(s.sweep_file)
        if not is_run_name(name):
            raise JobError(f"SWEEP_FILE={s.sweep_file} gives no name for the sweep's directory; set LOG_DIR, or submit "
                           "it with: python sweep.py submit FILE")
        s.log_dir = os.path.join(s.shared, "runs", name)
    s.log_dir = s.log_dir or os.path.join(s.shared, "runs")
    s.launcher, s.signal = env.get("LAUNCHER") or "srun", env.get("SIGNAL") or "USR1"
    if s.launcher not in ("srun", "torchrun"):
        raise JobError(f"LAUNCHER must be srun or torchrun, got '{s.launcher}'")
    if env.get("CHECK", "0") not in ("0", "1", ""):
        raise JobError(f"CHECK must be 1 (check the job's ranks instead of training) or 0, got '{env['CHECK']}'")
    s.check = env.get("CHECK") == "1"
    if s.signal not in SIGNALS:
        raise JobError(f"SIGNAL must be USR1, TERM, HUP or INT (without SIG), got '{s.signal}'")
    s.max_restarts = decimal(env, "MAX_RESTARTS", 0, 100, 3)
    s.master_port = decimal(env, "MASTER_PORT", 1024, 65535, port_from_job_id(env.get("SLURM_JOB_ID", "")))
    s.run_name = env.get("RUN_NAME") or default_run_name(s.job)
    if not is_run_name(s.run_name):
        raise JobError(f"RUN_NAME must be {RUN_NAME_RULE}, got '{s.run_name}'")
    if not os.path.isfile(s.script):
        raise JobError(f"{s.script} not found; submit from the project directory or set SCRIPT")
    for arg in args:
        if arg.partition("=")[0] in sweeplines.RUN_DIR_OPTIONS:  # the job names the run's directory itself
            raise JobError(f"name the run as RUN_NAME=NAME sbatch ... and its directory as LOG_DIR=DIR, not with "
                           f"{arg.partition('=')[0]}: this file reads them to restart and resume the run")
    s.ntasks = int(env.get("SLURM_NTASKS", "1"))
    s.nodes = int(env.get("SLURM_JOB_NUM_NODES", "1"))
    s.tasks_per_node = int(env.get("SLURM_NTASKS_PER_NODE") or s.ntasks // s.nodes)
    s.job_nodes, s.min_nodes, s.min_nodes_set = s.nodes, decimal(env, "MIN_NODES", 1, s.nodes, s.nodes), "MIN_NODES" in env
    if s.min_nodes < s.nodes and s.launcher != "srun":
        raise JobError(f"MIN_NODES={env['MIN_NODES']} is for LAUNCHER=srun: under torchrun, its agents restart the "
                       "workers themselves; unset MIN_NODES or LAUNCHER")
    read_container(s, env)
    if s.sweep_file:
        read_sweep_task(s, env)
    return s


def read_container(s: Settings, env: Mapping[str, str]) -> None:
    """CONTAINER (with CONTAINER_RUNTIME) or CONTAINER_CMD: how each rank's command runs inside it."""
    image, words = env.get("CONTAINER", ""), env.get("CONTAINER_CMD", "")
    if image and words:
        raise JobError("set CONTAINER (with CONTAINER_RUNTIME) or CONTAINER_CMD, not both")
    if words:
        try:
            s.container, s.container_desc = shlex.split(words), "CONTAINER_CMD=" + words
        except ValueError as err:  # an unbalanced quote
            raise JobError(f"CONTAINER_CMD={words}: {err}; quote it as a shell would") from None
        return
    if not image:
        return
    runtime = env.get("CONTAINER_RUNTIME") or ("apptainer" if shutil.which("apptainer") else "singularity")
    if runtime not in ("apptainer", "singularity", "pyxis"):
        raise JobError(f"CONTAINER_RUNTIME must be apptainer, singularity or pyxis, got '{runtime}'")
    # Each directory bound under the path the ranks use (a runtime refuses a missing one).
    try:
        for directory in (s.data_dir, s.log_dir):
            os.makedirs(directory, exist_ok=True)
    except OSError:
        raise JobError(f"cannot create DATA_DIR={s.data_dir} or LOG_DIR={s.log_dir} to bind into the container") from None
    binds = []  # type: List[str]
    for directory in (s.project, s.shared, s.data_dir, s.log_dir):
        bind = f"{os.path.realpath(directory)}:{directory}"
        if bind not in binds:
            binds.append(bind)
    if runtime == "pyxis":
        s.container_srun = ["--container-image=" + image, "--container-mounts=" + ",".join(binds),
                            "--container-workdir=" + os.getcwd()]
    else:
        if not shutil.which(runtime):
            raise JobError(f"CONTAINER={image} needs {runtime}, which is not on the PATH; load its module in SETUP, or set "
                           "CONTAINER_RUNTIME")
        if not os.path.isfile(image):
            raise JobError(f"CONTAINER={image}: no such image file")
        s.container = [runtime, "exec", "--nv", "--bind", ",".join(binds), image]
    s.container_desc = f"{runtime}:{image}"


def read_sweep_task(s: Settings, env: Mapping[str, str]) -> None:
    """An array task of a sweep trains line TASK+1 of SWEEP_FILE, in a run named by its options."""
    if not env.get("SLURM_ARRAY_TASK_ID"):
        raise JobError(f"SWEEP_FILE is set but this is not an array job; submit it with: "
                       f"python sweep.py submit {shlex.quote(s.sweep_file)}")
    try:
        lines = sweeplines.task(sweeplines.Path(s.sweep_file), int(env["SLURM_ARRAY_TASK_ID"]))
    except sweeplines.SweepError as err:
        raise JobError(str(err)) from None
    s.run_name, s.sweep_args = lines[0], lines[1:]
    if not is_run_name(s.run_name):
        raise JobError(f"ddpkit/sweeplines.py gave array task {env['SLURM_ARRAY_TASK_ID']} the run name '{s.run_name}', "
                       f"not {RUN_NAME_RULE}; change the options of that line in {s.sweep_file}")


def ranks_python(s: Settings, env: Mapping[str, str]) -> str:
    """The interpreter of the ranks: PYTHON, else python3 on the PATH of the active environment;
    in a container the container's (its PATH is not the host's)."""
    given = env.get("PYTHON") or "python3"
    if s.container or s.container_srun:
        return given
    if "/" in given:
        if not os.path.exists(given):
            raise JobError(f"PYTHON={given} does not exist; fix the path, or unset PYTHON to use VENV, CONDA_ENV or the "
                           "project's .venv")
        if not (os.path.isfile(given) and os.access(given, os.X_OK)):
            raise JobError(f"PYTHON={given} is not an executable file; point it at a python interpreter, or unset PYTHON to "
                           "use VENV, CONDA_ENV or the project's .venv")
    found = shutil.which(given)
    if not found:
        raise JobError(f"no {given} on the PATH ({s.environment}); set VENV, CONDA_ENV or PYTHON")
    return os.path.abspath(found)


# ----------------------------------------------------------------------------- the code the job runs

def code_files(directory: str, leave_out: Tuple[str, ...] = ()) -> List[str]:
    """The code under a directory, relative to it: every .py file, outside hidden directories,
    virtual environments, __pycache__ and the directories in leave_out (the runs, the data).
    Not hidden files, nor links to nothing: an editor's lock (Emacs' .#mnist_ddp.py, a link
    while a file has unsaved edits) is no code, and nothing can import a dangling link."""
    names = []  # type: List[str]
    for top, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not (d.startswith(".") or d == "__pycache__"
                                                 or os.path.realpath(os.path.join(top, d)) in leave_out
                                                 or os.path.exists(os.path.join(top, d, "pyvenv.cfg"))
                                                 or os.path.isdir(os.path.join(top, d, "conda-meta"))))
        names += sorted(os.path.relpath(os.path.join(top, name), directory) for name in files
                        if name.endswith(".py") and not name.startswith(".") and os.path.exists(os.path.join(top, name)))
    return names


def code_copy(s: Settings) -> str:
    """Where this job's copy of its code lives: RUN_DIR/code/job-<id>."""
    return os.path.join(os.path.abspath(s.run_dir), "code", "job-" + s.job)


def take_snapshot(s: Settings) -> str:
    """The code this job runs, copied at its first start into RUN_DIR/code/job-<id>, which each
    restart and requeue of it runs, so that an edit to the project between its requeues
    changes nothing: every .py file of the training script's directory and below (with
    ddpkit/), the project's data/ and tensorboard.sh linked, and the git commit and the
    uncommitted changes when the project is a repository. Says in one line when the code
    differs from the run's previous job's (or from this job's own earlier start inside salloc)."""
    copy = code_copy(s)
    source = os.path.dirname(os.path.abspath(s.script))
    leave_out = tuple(os.path.realpath(d) for d in (s.log_dir, s.data_dir, s.shared and os.path.join(s.shared, "runs")))
    partial = copy + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        changed, previous = copy_code(s, source, leave_out, partial, copy)
    except BaseException as err:  # (Ctrl-C inside salloc too): no job-N.partial left behind
        shutil.rmtree(partial, ignore_errors=True)
        if isinstance(err, OSError):
            raise JobError(f"cannot copy the code this job runs into {copy} ({err.strerror or err}); set LOG_DIR to a "
                           "writable directory") from None
        raise
    if changed:
        print(f"code: this job runs code that differs from {os.path.basename(previous)}'s ({previous}): "
              f"{', '.join(changed)}", flush=True)
    return copy


def copy_code(s: Settings, source: str, leave_out: Tuple[str, ...], partial: str, copy: str) -> Tuple[List[str], str]:
    """take_snapshot's copy, into `partial`, then renamed to `copy`: (the files that differ from
    the previous copy, that copy or ""). A source file it cannot read is a JobError naming it;
    an OSError is the copy's own (LOG_DIR's)."""
    os.makedirs(os.path.join(partial, "ddpkit"))
    names = code_files(source, leave_out)
    if not os.path.isdir(os.path.join(source, "ddpkit")):  # a SCRIPT of the user's beside no ddpkit/
        names += [os.path.join("ddpkit", name) for name in code_files(os.path.join(s.project, "ddpkit"))]
    in_source = code_files(source)
    for name in names:
        os.makedirs(os.path.dirname(os.path.join(partial, name)), exist_ok=True)
        origin = os.path.join(s.project if name.startswith("ddpkit") and name not in in_source else source, name)
        check_readable(origin)
        shutil.copy2(origin, os.path.join(partial, name))
    for name in ("data", "tensorboard.sh"):
        if os.path.exists(os.path.join(s.project, name)) and not os.path.exists(os.path.join(partial, name)):
            os.symlink(os.path.join(os.path.abspath(s.project), name), os.path.join(partial, name))
    write_git_state(s.project, partial)
    previous = copy if os.path.isdir(copy) else newest_other_copy(os.path.dirname(copy), copy)
    changed = code_changes(previous, partial) if previous else []
    shutil.rmtree(copy, ignore_errors=True)  # (this job's own, from an earlier start inside salloc)
    os.rename(partial, copy)
    return changed, previous


def check_readable(path: str) -> None:
    """A source file of the code the job runs, which the copy must read: one line naming it
    when it cannot (a named pipe, a file the job's user may not read)."""
    why = "" if os.path.isfile(path) else "not a regular file"
    if not why:
        try:
            with open(path, "rb"):
                pass
        except OSError as err:
            why = err.strerror or str(err)
    if why:
        raise JobError(f"cannot copy {path} into the job's copy of its code ({why}); move it out of the project, or "
                       "make it a readable file")


def code_changes(previous: str, copy: str) -> List[str]:
    """The files that differ between two copies of the code (added, removed or changed)."""
    older, newer = code_files(previous), code_files(copy)
    return [name for name in sorted(set(older) | set(newer))
            if name not in older or name not in newer
            or not filecmp.cmp(os.path.join(previous, name), os.path.join(copy, name), shallow=False)]


def write_git_state(project: str, copy: str) -> None:
    """The commit and the uncommitted changes of the project, when it is a git repository (as
    bytes: a diff need not be text in any one encoding)."""
    if not shutil.which("git"):
        return
    try:
        commit = subprocess.run(["git", "-C", project, "rev-parse", "HEAD"], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, timeout=30)
        diff = subprocess.run(["git", "-C", project, "diff", "HEAD"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              timeout=30)
    except (OSError, subprocess.SubprocessError):
        return
    if commit.returncode == 0:
        with open(os.path.join(copy, "git-commit.txt"), "wb") as out:
            out.write(commit.stdout)
        with open(os.path.join(copy, "git.diff"), "wb") as out:
            out.write(diff.stdout)


def newest_other_copy(code: str, copy: str) -> str:
    """The copy of the run's previous job, or ""."""
    if not os.path.isdir(code):
        return ""
    others = [os.path.join(code, name) for name in os.listdir(code)
              if name.startswith("job-") and not name.endswith(".partial") and os.path.join(code, name) != copy]
    return max(others, key=os.path.getmtime) if others else ""


# ----------------------------------------------------------------------------- commands

def where_ranks_run(s: Settings, command: List[str]) -> List[str]:
    """One command run where the ranks run: inside the container, if there is one."""
    if s.container_srun:
        return ["srun", "--nodes=1", "--ntasks=1"] + s.container_srun + command
    return s.container + command


def preflight(s: Settings) -> str:
    """One check before any rank starts, instead of one traceback per rank after the queue
    wait: the ranks' interpreter imports torch; what it found, as one line."""
    code = "\n".join([
        "import os, sys",
        "try:",
        "    import torch",
        "except Exception as err:",
        "    print('{}: {}'.format(type(err).__name__, err).splitlines()[0])",
        "    sys.exit(1)",
        "gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0",
        "print('python={} torch={} cuda_build={} gpus_visible={} cpus_per_task={}'.format(sys.executable,",
        "      torch.__version__, torch.version.cuda or 'none', gpus, os.environ.get('SLURM_CPUS_PER_TASK', 'unset')))",
    ])
    try:
        result = subprocess.run(where_ranks_run(s, [s.python, "-c", code]), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, encoding="utf-8", errors="replace")
    except OSError as err:
        raise JobError(f"{s.python} ({s.environment}) cannot run: {err}; set VENV, CONDA_ENV or PYTHON") from None
    if result.returncode != 0:
        raise JobError(f"{s.python} ({s.environment}) cannot import torch: {last_line(result.stdout)}. Install it "
                       "there (pip install -r requirements.txt), or set VENV, CONDA_ENV or SETUP")
    return last_line(result.stdout)


def training_args(s: Settings, script: str, first_start: bool = True) -> List[str]:
    """The training script's command line: the directories and run name of this job, then the
    sweep line's options and the ones given after the batch file's name (they win); after the
    first start, continuing_args. The directories and the name as
    --opt=VALUE, one word whatever the value (RUN_NAME=-lr3: `--run-name -lr3` is two options)."""
    args = [script, "--data-dir=" + s.data_dir, "--log-dir=" + s.log_dir, "--run-name=" + s.run_name]
    if s.node_data_dir:
        args.append("--node-data-dir=" + s.node_data_dir)
    given = s.sweep_args + s.args
    return args + (given if first_start else continuing_args(given, s.run_dir))


def step_command(s: Settings, task_file: str, train: List[str], launcher: str = "") -> List[str]:
    """The job step that runs the ranks: srun starts each task through `task_file task`, which
    becomes the training process (srun) or the node's torchrun agent."""
    launcher = launcher or s.launcher
    srun = ["srun", "--label", "--kill-on-bad-exit=1"]
    if s.nodes < s.job_nodes:  # going on with the nodes left after a node was lost (MIN_NODES), from the
        srun += [f"--nodes={s.nodes}", f"--ntasks={s.ntasks}", "--relative=0"]  # first: rank 0 by MASTER_ADDR
    if launcher == "torchrun":
        # One torchrun per node starts tasks_per_node workers; c10d rendezvous on the first
        # node. Its agents restart all workers when one fails, MAX_RESTARTS times at most.
        cpus = s.tasks_per_node * int(os.environ.get("SLURM_CPUS_PER_TASK") or 1)
        srun += [f"--nodes={s.nodes}", f"--ntasks={s.nodes}", "--ntasks-per-node=1",
                 f"--cpus-per-task={cpus}"]
        agent = ["torchrun", f"--nnodes={s.nodes}", f"--nproc-per-node={s.tasks_per_node}",
                 f"--max-restarts={s.max_restarts}", "--rdzv-backend=c10d",
                 f"--rdzv-endpoint={os.environ['MASTER_ADDR']}:{s.master_port}",
                 f"--rdzv-id={os.environ.get('SLURM_JOB_ID', s.job)}"]
        return srun + s.container_srun + s.container + [s.python, task_file, "task"] + agent + train
    return srun + s.container_srun + s.container + [s.python, task_file, "task", "train"] + train


def resubmit_line(s: Settings, env: Mapping[str, str], fields: Mapping[str, str]) -> str:
    """The beginning of the sbatch line that continues this run: its directories and the
    settings as given, the same request (nodes, tasks, CPUs, GPUs, memory, time, partition,
    account) and the original batch file. The ranks add the run's options to it."""
    request = ["sbatch", f"--nodes={s.nodes}"]
    # srun's tasks may be spread unevenly (--nodes=2 --ntasks=3: 2 and 1), which only --ntasks
    # asks for again; torchrun starts tasks_per_node workers on each node.
    if s.launcher == "srun" and s.ntasks != s.nodes * s.tasks_per_node:
        request.append(f"--ntasks={s.ntasks}")
    else:
        request.append(f"--ntasks-per-node={s.tasks_per_node}")
    if s.min_nodes < s.nodes:
        request.append("--no-kill")  # (MIN_NODES goes on with the nodes left only so)
    for variable, option, unit in (("SLURM_CPUS_PER_TASK", "--cpus-per-task", ""), ("SLURM_MEM_PER_NODE", "--mem", "M"),
                                   ("SLURM_MEM_PER_CPU", "--mem-per-cpu", "M")):
        if env.get(variable):
            request.append(f"{option}={env[variable]}{unit}")
    # UNLIMITED and Partition_Limit are no --time to ask for: the partition's own limit applies again.
    if fields.get("TimeLimit") not in (None, "", "UNLIMITED", "Partition_Limit"):
        request.append("--time=" + fields["TimeLimit"])
    for option, value in gpu_request(fields, env):
        request.append(f"{option}={value}")
    if env.get("SLURM_JOB_PARTITION"):
        request.append("--partition=" + env["SLURM_JOB_PARTITION"])
    if env.get("SLURM_JOB_ACCOUNT"):
        request.append("--account=" + env["SLURM_JOB_ACCOUNT"])
    if env.get("SLURM_JOB_NAME", "mnist-ddp") != "mnist-ddp":
        request.append("--job-name=" + env["SLURM_JOB_NAME"])
    request.append(s.batch_file or os.path.join(s.project, PROG))
    settings = [("SHARED_DIR", s.shared), ("DATA_DIR", s.data_dir), ("LOG_DIR", s.log_dir), ("RUN_NAME", s.run_name)]
    settings += list(s.passed_on.items())
    # NAME=value with the value alone quoted: a shell reads a quoted 'NAME=value' as a command.
    return " ".join(f"{name}={shlex.quote(value)}" for name, value in settings) + " " + sweeplines.quote_words(request)


def gpu_request(fields: Mapping[str, str], env: Mapping[str, str]) -> List[Tuple[str, str]]:
    """The GPUs, however they were asked for (--gpus-per-node, --gres=gpu:N, --gpus,
    --gpus-per-task), as the job's TRES say (gres:gpu:2, gres/gpu:a100:2, older Slurm's
    gpu:2); without them, the variables two of those options set."""
    asked = []  # type: List[Tuple[str, str]]
    for field, option in (("TresPerNode", "--gpus-per-node"), ("TresPerJob", "--gpus"), ("TresPerTask", "--gpus-per-task")):
        for item in fields.get(field, "").split(","):
            match = re.fullmatch(r"(?:gres[:/])?gpu:(.+)", item)
            if match:
                asked.append((option, match.group(1)))
                break
    if not asked:
        for variable, option in (("SLURM_GPUS_PER_NODE", "--gpus-per-node"), ("SLURM_GPUS_PER_TASK", "--gpus-per-task")):
            if env.get(variable):
                asked.append((option, env[variable]))
    return asked


# ----------------------------------------------------------------------------- the outcome

class Outcome:
    """What one step's end means: the job's exit code, whether a restart can fix it, why."""

    def __init__(self, status: int, retry: bool = False, why: str = "", note: str = ""):
        self.status, self.retry, self.why, self.note = status, retry, why, note

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Outcome) and vars(self) == vars(other)

    def __repr__(self) -> str:
        return f"Outcome({self.status}, retry={self.retry}, why={self.why!r}, note={self.note!r})"


def settle(srun_status: int, codes: Mapping[int, str], ntasks: int) -> Outcome:
    """The step's outcome from srun's status and the codes the ranks recorded (rank -> the text
    of its file, missing when it wrote none). srun reports only its worst task (128+N for a
    task killed by signal N, or ended by srun after another failed), and ranks that lost a
    peer record 4 even when the peer died of a bug: so a code no restart fixes (1, 2, 3), on
    any rank, decides first; then a stop (75); then ranks that recorded nothing though srun saw
    a signal (killed); then 4. A rank records 0 once all it wrote is on disk: when every rank
    did, the job succeeded, whatever befell a rank in the process group's teardown after that."""
    killed, lost, stopped, finished = [], [], False, 0
    for rank in range(ntasks):
        code = codes.get(rank, "").strip()
        if code == "0":
            finished += 1
        elif code in (str(EXIT_BUG), str(EXIT_USAGE), str(EXIT_DIVERGED)):
            return Outcome(int(code), why=f"rank {rank} exited with {code}")
        elif code == str(EXIT_LOST_PEER):
            lost.append(str(rank))
        elif code == str(EXIT_STOPPED):
            stopped = True
        else:
            killed.append(str(rank))
    if stopped:
        return Outcome(EXIT_STOPPED)
    if srun_status != 0 and finished == ntasks:
        return Outcome(0, note=f"every rank had finished and saved (each recorded exit 0) before srun's exit "
                               f"{srun_status} (a rank that died as it shut down, see above): the job succeeded")
    if srun_status > 128 and killed:
        return Outcome(srun_status, True, f"rank {' '.join(killed)} ended without an exit code: killed by a signal "
                                          "(srun's lines above say which)")
    if lost:
        return Outcome(EXIT_LOST_PEER, True, f"rank {' '.join(lost)} lost contact with a peer that died or hung")
    return Outcome(srun_status)


def read_codes(directory: str) -> Dict[int, str]:
    """The exit codes the ranks left in this job's folder, by rank."""
    codes = {}  # type: Dict[int, str]
    for name in os.listdir(directory) if os.path.isdir(directory) else []:
        if re.fullmatch(r"rank-\d+", name):
            try:
                with open(os.path.join(directory, name)) as file:
                    codes[int(name[5:])] = file.read()
            except OSError:
                pass
    return codes


WORLD_SIZES = "world-sizes"  # rank 0's list, in the job's folder, of the world sizes the run's batch splits among


def read_world_sizes(directory: str, ntasks: int) -> List[int]:
    """The world sizes rank 0 left in the job's folder; without them, the divisors of the
    world size (a global batch split among ntasks ranks splits among those too)."""
    try:
        with open(os.path.join(directory, WORLD_SIZES)) as file:
            return [int(word) for word in file.read().split()]
    except (OSError, ValueError):
        return [n for n in range(1, ntasks + 1) if ntasks % n == 0]


def nodes_to_go_on_with(held: int, min_nodes: int, tasks_per_node: int, world_sizes: List[int]) -> int:
    """The most of the `held` nodes, and at least min_nodes, whose ranks are a world size the
    run's batch splits among; 0 when there are none."""
    return next((n for n in range(held, min_nodes - 1, -1) if n * tasks_per_node in world_sizes), 0)


# ----------------------------------------------------------------------------- the rendezvous

def first_ipv4(host: str) -> str:
    """The first IPv4 address a host name resolves to, or ""."""
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]
    except (OSError, IndexError):
        return ""


def route_to(address: str, field: str) -> str:
    """This node's route towards an address, as `ip route get` says it: its src or its dev."""
    try:
        shown = run(["ip", "-o", "route", "get", address or "0.0.0.0"], 10).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    match = re.search(rf" {field} (\S+)", shown)
    return match.group(1) if match else ""


def master_address(env: Mapping[str, str]) -> str:
    """Rank 0 runs on the first node of the allocation, where the supervisor runs too. The other
    nodes get an address, not a name: on many clusters a node's own name resolves to 127.0.1.1
    in its /etc/hosts, which no other node can reach. Then the address this node reaches the
    second node from, which the second node can reach back."""
    if env.get("MASTER_ADDR"):
        return env["MASTER_ADDR"]
    try:
        hosts = run(["scontrol", "show", "hostnames", env.get("SLURM_JOB_NODELIST", "")]).stdout.split()
    except (OSError, subprocess.SubprocessError) as err:
        raise JobError(f"cannot list the job's nodes (scontrol show hostnames: {err}); set MASTER_ADDR") from None
    address = first_ipv4(hosts[0]) if hosts else ""
    if len(hosts) > 1 and (not address or address.startswith("127.")):
        address = route_to(first_ipv4(hosts[1]), "src")
    if not address:
        first = hosts[0] if hosts else "the first node"
        raise JobError(f"cannot find an address of {first} that the other nodes reach; set MASTER_ADDR")
    return address


def gloo_interface(env: Mapping[str, str]) -> str:
    """Gloo binds the address its host's name resolves to (127.0.1.1 on many clusters): on a
    job of several nodes, this node's interface towards the master instead."""
    if env.get("GLOO_SOCKET_IFNAME") or int(env.get("SLURM_JOB_NUM_NODES") or 1) < 2 or not shutil.which("ip"):
        return env.get("GLOO_SOCKET_IFNAME", "")
    device = route_to(env["MASTER_ADDR"], "dev")
    if device == "lo":  # the master is on this node: the interface that holds its address
        try:
            shown = run(["ip", "-o", "addr", "show", "to", env["MASTER_ADDR"]], 10).stdout.split()
        except (OSError, subprocess.SubprocessError):
            shown = []
        device = shown[1] if len(shown) > 1 else ""
    return device


def task(argv: List[str]) -> None:
    """What srun starts in each task: it becomes the training process (train ARGS) or this
    node's torchrun agent (torchrun ARGS), with the ranks' interpreter."""
    mode, args = argv[0], argv[1:]
    interface = gloo_interface(os.environ)
    if interface:
        os.environ["GLOO_SOCKET_IFNAME"] = interface
    if mode == "torchrun":
        # Slurm's --signal reaches every process of the step, the agent too, which would die
        # of SIGUSR1 and, under proctrack/cgroup, take its workers with it. So the agent
        # ignores it; the workers install their own handler at once and save. is_host: this
        # node hosts the rendezvous, which torchrun cannot tell from an address it may not
        # know as its own.
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        # A store of its own for each restart's workers: in the agent's shared store, restarted
        # workers read the addresses that the failed ones left there and cannot connect
        # (pytorch/pytorch#135712).
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        is_host = int((os.environ.get("SLURM_NODEID") or "0") == "0")
        args = ["-m", "torch.distributed.run", f"--rdzv-conf=is_host={is_host}"] + args
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable] + args)


def flight_recorder(run_dir: str) -> Dict[str, str]:
    """NCCL's Flight Recorder: on a collective's timeout every NCCL rank dumps its last
    collectives to RUN_DIR/hangs/nccl-trace-rank-<r>, beside the hang report's stacks (the
    folder exists while the hang watch runs: the whole run, unless --hang-after -1), under
    torch's older names and its newer ones. Gloo ignores it. Not run here: no GPU
    (docs/recovery.md says how to read the dumps)."""
    dump = os.path.join(run_dir, "hangs", "nccl-trace-rank-")
    return {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": dump, "TORCH_FR_DUMP_TEMP_FILE": dump}


# ----------------------------------------------------------------------------- the job

def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).astimezone().isoformat(timespec="seconds")


class Supervisor:
    """The job from its first line to its exit code, after run_training.sbatch."""

    def __init__(self, s: Settings, info: str, task_file: str):
        self.s, self.info, self.fields, self.task_file = s, info, job_fields(info), task_file
        self.monitor = None  # type: Optional[subprocess.Popen]
        self.end_time = None  # type: Optional[int]

    def start(self) -> None:
        """The ranks' environment, the START and PREFLIGHT lines, the GPU monitor."""
        s, env = self.s, os.environ
        # Since Slurm 22.05, srun does not inherit --cpus-per-task from the batch job: without
        # this, task/affinity or cgroups bind each rank to one core while OMP_NUM_THREADS says more.
        if env.get("SLURM_CPUS_PER_TASK"):
            env["SRUN_CPUS_PER_TASK"] = env["SLURM_CPUS_PER_TASK"]
        env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS") or env.get("SLURM_CPUS_PER_TASK") or "1"
        env["MASTER_ADDR"], env["MASTER_PORT"] = master_address(env), str(s.master_port)
        for name, value in flight_recorder(s.run_dir).items():
            env.setdefault(name, value)  # (yours win)
        print(f"START {now()} job={env['SLURM_JOB_ID']} restart={env.get('SLURM_RESTART_COUNT', '0')} "
              f"nodes={env.get('SLURM_JOB_NODELIST', '')} tasks={s.ntasks} launcher={s.launcher} "
              f"master={env['MASTER_ADDR']}:{s.master_port} threads={env['OMP_NUM_THREADS']} run={s.run_dir}", flush=True)

    def preflight_line(self, found: str, code: str) -> None:
        code = " code=" + code if code else ""
        print(f"PREFLIGHT {found} env={self.s.environment}{code} container={self.s.container_desc}", flush=True)

    def start_monitor(self) -> None:
        """GPU use beside the job, on this (the first) node, when it has NVIDIA GPUs."""
        if shutil.which("nvidia-smi"):
            os.makedirs(self.s.log_dir, exist_ok=True)
            name = f"gpu-{os.environ['SLURM_JOB_ID']}-{socket.gethostname().split('.')[0]}.log"
            log = open(os.path.join(self.s.log_dir, name), "w")
            self.monitor = subprocess.Popen(["nvidia-smi", "dmon", "-s", "um", "-o", "T"], stdout=log,
                                            stderr=subprocess.STDOUT)

    def stop_monitor(self) -> None:
        if self.monitor:
            self.monitor.kill()

    def check(self) -> int:
        """CHECK=1: the one-minute doctor instead of training (mnist_ddp.py --check); rank 0
        gives the verdict (srun's status is that of a rank it ended)."""
        s = self.s
        if s.launcher == "torchrun":
            print("CHECK=1 starts the ranks as srun tasks (LAUNCHER=torchrun is for training)", flush=True)
        exit_dir = os.path.join(s.log_dir, ".check-" + s.job)
        try:
            os.makedirs(exit_dir, exist_ok=True)
        except OSError:
            raise JobError(f"cannot create {exit_dir}; set LOG_DIR to a writable directory") from None
        os.environ["MNIST_DDP_EXIT_DIR"] = exit_dir
        status = self.run_step(step_command(s, self.task_file, [s.script] + s.args + ["--check"], "srun"))
        verdict = read_codes(exit_dir).get(0, "").strip()
        status = int(verdict) if verdict.isdigit() else status
        shutil.rmtree(exit_dir, ignore_errors=True)
        self.stop_monitor()
        print(f"END {now()} job={os.environ['SLURM_JOB_ID']} exit={status} (CHECK=1: nothing was trained)", flush=True)
        return status

    def run_step(self, command: List[str]) -> int:
        """Run the step; its exit status, as a shell gives it."""
        step = subprocess.Popen(command)
        while True:
            try:
                status = step.wait()
                return 128 - status if status < 0 else status  # (killed by signal N: 128+N, as a shell says)
            except KeyboardInterrupt:  # Ctrl-C in an salloc shell reached srun too, which handles it
                continue

    def forward_signal(self, signum: int, frame: object) -> None:
        """With --signal=B:SIG@N, or scancel --batch, the supervisor's SIGNAL reaches it alone:
        pass it on to the ranks."""
        print(f"passing SIG{self.s.signal} on to the ranks of job {self.s.job}", flush=True)
        try:
            if subprocess.call(["scancel", "--signal=" + self.s.signal, self.s.job]) == 0:
                return
        except OSError:
            pass
        print(f"could not pass SIG{self.s.signal} on: scancel failed", flush=True)

    def train(self, code: str) -> int:
        """The step, started again after a killed rank or a lost peer (srun mode), then the
        requeue, the END line and the line that continues the run."""
        s, env = self.s, os.environ
        env["MNIST_DDP_EXIT_DIR"] = s.job_dir
        # Rank 0 leaves job_dir/requeue when the ranks stopped on a signal that asks for a
        # requeue; the supervisor then requeues the job, on the host (a container may have no scontrol).
        env["MNIST_DDP_REQUEUE_SIGNAL"] = s.signal
        # The job's times as scontrol gave them, for rank 0's stop before the time limit; in Unix
        # seconds too (scontrol prints local time, and a container's time zone may differ).
        env.pop("MNIST_DDP_JOB_TIMES", None)
        env.pop("MNIST_DDP_JOB_INFO", None)
        if self.info:
            env["MNIST_DDP_JOB_INFO"] = self.info
        start, self.end_time = unix_time(self.fields.get("StartTime", "")), unix_time(self.fields.get("EndTime", ""))
        if start and self.end_time:
            env["MNIST_DDP_JOB_TIMES"] = f"{start} {self.end_time}"
        env["MNIST_DDP_RESUBMIT"] = resubmit_line(s, env, self.fields)
        shutil.rmtree(s.job_dir, ignore_errors=True)
        signal.signal(getattr(signal, "SIG" + s.signal), self.forward_signal)
        script = os.path.join(code, os.path.basename(s.script)) if code else s.script
        requeued = int(env.get("SLURM_RESTART_COUNT") or 0) > 0
        attempts = s.max_restarts + 1
        for attempt in range(1, attempts + 1):
            train = training_args(s, script, first_start=attempt == 1 and not requeued)
            for name in os.listdir(s.job_dir) if os.path.isdir(s.job_dir) else []:
                if name.startswith("rank-") or name == "requeue":
                    os.remove(os.path.join(s.job_dir, name))
            env["MNIST_DDP_ATTEMPT"] = f"{attempt}/{attempts}"
            outcome = settle(self.run_step(step_command(s, self.task_file, train)), read_codes(s.job_dir), s.ntasks)
            if outcome.note:
                print(outcome.note, flush=True)
            if not (s.launcher == "srun" and outcome.retry and attempt < attempts):
                break
            fewer = self.nodes_held_now(outcome)
            if fewer is None:
                break  # (too few nodes left: requeued, or it could not be)
            print(f"ATTEMPT {attempt + 1}/{attempts} after exit {outcome.status} ({outcome.why}): starting the step "
                  f"again in this allocation{fewer}; it resumes from the newest checkpoint", flush=True)
        self.stop_monitor()
        if outcome.status == EXIT_STOPPED and os.path.exists(os.path.join(s.job_dir, "requeue")):
            with open(os.path.join(s.job_dir, "requeue")) as file:
                self.requeue(file.read().strip())
        return self.end(outcome, attempt if s.launcher == "srun" else attempts)

    def nodes_held_now(self, outcome: Outcome) -> Optional[str]:
        """After a step that a restart may fix: the nodes Slurm still gives the job (a lost node
        leaves a job submitted with --no-kill running without it). With all of them, "": the
        step starts again as it was. With fewer, and MIN_NODES and the run's batch allowing
        it, the step goes on with the most of them it can use (what the ATTEMPT line adds);
        with too few, the job is requeued (None; None too if Slurm would not)."""
        s = self.s
        fields = job_fields(show_job(s.job)) if s.job_nodes > 1 else {}
        held = re.match(r"\d+", fields.get("NumNodes", ""))
        if not held or int(held.group()) >= s.nodes:
            return ""
        held_nodes, ntasks = int(held.group()), s.ntasks
        go_on = nodes_to_go_on_with(held_nodes, s.min_nodes, s.tasks_per_node, read_world_sizes(s.job_dir, s.ntasks))
        lost = f"the job holds {held_nodes} of its {s.job_nodes} nodes ({fields.get('NodeList', '?')})"
        if not go_on:
            unset = "" if s.min_nodes_set else " (unset: every node of the job)"
            per_node = f"at {s.tasks_per_node} rank(s) a node"
            why = f"fewer than MIN_NODES={s.min_nodes}{unset}" if held_nodes < s.min_nodes else \
                f"and no count of them from MIN_NODES={s.min_nodes} up, {per_node}, keeps the global batch"
            self.stop_monitor()
            self.requeue(f"exit {outcome.status}: {lost}, {why}")
            outcome.why += f"; then {lost}, {why}, and it was not requeued"
            return None
        s.nodes, s.ntasks = go_on, go_on * s.tasks_per_node
        return f": {lost}, so on {go_on} node(s) with {s.ntasks} rank(s) instead of {ntasks}"

    def requeue(self, after: str) -> None:
        """Requeue the job (the ranks saved and stopped on a signal that asks for it, or too few
        nodes are left). Slurm then ends this process too, and runs the job again with the same
        id, on as many nodes as it asked for."""
        s = self.s
        if s.interactive:
            print(f"Slurm job {s.job} is an interactive allocation (salloc), which Slurm does not requeue")
            return
        if not shutil.which("scontrol"):
            print(f"could not requeue Slurm job {s.job} (no scontrol on the PATH of the batch step)")
            return
        before = f" ({self.end_time - int(time.time())} s before the job's time limit)" if self.end_time else ""

        def about_to_requeue() -> None:
            signal.signal(getattr(signal, "SIG" + s.signal), signal.SIG_DFL)  # (Slurm's own signal now ends this job)
            try:
                os.remove(os.path.join(s.run_dir, "exit-code"))  # (not "stopped" while the job waits to run again)
            except OSError:
                pass

        if requeue_job(s.job, after, before, about_to_requeue=about_to_requeue):
            time.sleep(REQUEUE_WAIT)  # (Slurm ends this process now; past this, the END line tells)

    def end(self, outcome: Outcome, attempts: int) -> int:
        """The END line, the job's outcome in RUN_DIR/exit-code (for sweep.py summary and whoever
        reads the run directory), and the line that continues the run."""
        s, status = self.s, outcome.status
        gave_up = f" gave up after {attempts} attempts ({outcome.why}; MAX_RESTARTS={s.max_restarts})" \
            if outcome.retry else ""
        print(f"END {now()} job={os.environ['SLURM_JOB_ID']} exit={status}{gave_up}", flush=True)
        # Not when another job holds the run directory: that one's outcome is still to come.
        if not os.path.exists(os.path.join(s.job_dir, "run-dir-taken")):
            try:
                os.makedirs(s.run_dir, exist_ok=True)
                with open(os.path.join(s.run_dir, "exit-code"), "w") as file:
                    file.write(f"{status}\n")
            except OSError:
                pass
        if status not in (0, EXIT_USAGE):
            why = "to continue from the last checkpoint with a lower --lr" if status == EXIT_DIVERGED else \
                "to continue from the newest checkpoint"
            try:
                with open(os.path.join(s.job_dir, "continue-command")) as file:
                    line = file.read().strip()
            except OSError:
                line = ""
            if not line:  # rank 0 ended before it wrote it: the options a restart would get
                given = sweeplines.quote_words(continuing_args(s.sweep_args + s.args, s.run_dir))
                line = f"{os.environ['MNIST_DDP_RESUBMIT']} {given}".rstrip()
            print(f"{why}, from {shlex.quote(os.environ.get('SLURM_SUBMIT_DIR', os.getcwd()))}: {line}")
        sys.stdout.flush()
        return status


def supervise(project: str, batch_file: str, environment: str, args: List[str]) -> int:
    env = os.environ
    if not env.get("SLURM_JOB_ID"):
        raise JobError(f"not inside a Slurm job. Submit it: sbatch {PROG} [options]")
    info = show_job(this_job(env))  # the one `scontrol show job` of the job
    s = read_settings(env, project, batch_file, environment, args, job_fields(info))
    copy = code_copy(s)
    running_copy = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) == copy
    requeued = int(env.get("SLURM_RESTART_COUNT") or 0) > 0 and os.path.isdir(copy) and not s.check
    if requeued and not running_copy:  # a requeue of this job runs its copy, this supervisor included
        sys.stdout.flush()
        os.execv(sys.executable, [sys.executable, os.path.join(copy, "ddpkit", "slurm_job.py")] + sys.argv[1:])
    s.python = ranks_python(s, env)
    found = preflight(s)  # (before START and the copy: a job whose ranks cannot run is one line)
    code = "" if s.check else copy if requeued else take_snapshot(s)
    supervisor = Supervisor(s, info, os.path.join(code or project, "ddpkit", "slurm_job.py"))
    supervisor.start()
    supervisor.preflight_line(found, code)
    supervisor.start_monitor()
    return supervisor.check() if s.check else supervisor.train(code)


def main(argv: List[str]) -> int:
    if sys.stdout.encoding.lower().replace("-", "") != "utf8":  # (a C locale on Python 3.6: paths are UTF-8)
        sys.stdout = io.TextIOWrapper(sys.stdout.buffer, encoding="utf-8", errors="replace", line_buffering=True)
    if argv[:1] == ["task"]:
        task(argv[1:])
    parser = argparse.ArgumentParser(prog=__file__, allow_abbrev=False,
                                     usage="python3 %(prog)s supervise --project DIR --batch-file FILE --environment TEXT "
                                           "-- [training options]")
    parser.add_argument("command", choices=["supervise"])
    for name in ("--project", "--batch-file", "--environment"):
        parser.add_argument(name, default="")
    ours, args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    given = parser.parse_args(ours)
    try:
        return supervise(given.project or ".", given.batch_file, given.environment, args)
    except JobError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:  # Ctrl-C inside salloc, before or after the step
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
