"""The job's settings: the environment variables at submission (docs/clusters.md lists them)
and the job's own facts, each checked, with the defaults filled in (read_settings); a
container's words; a sweep's array task; the ranks' interpreter. A wrong one is a JobError:
one line on stderr and exit code 2. Python 3.6, standard library only (ddpkit/job/contract.py
says why)."""

import os
import re
import shlex
import shutil
from typing import Dict, List, Mapping  # noqa: F401 (Dict is in a type comment, which ruff does not read)

from ddpkit.job import sweeplines
from ddpkit.job.contract import RUN_NAME_RULE, JobPaths, default_run_name, is_run_name, port_from_job_id, this_job

PROG = "run_training.sbatch"
SIGNALS = ("USR1", "TERM", "HUP", "INT")
# The settings a job passes on to the one that continues it, as they were given (the
# directories and the run's name follow from these and are added to the line too).
PASSED_ON = ("PROJECT_DIR", "SCRIPT", "SETUP", "CONDA_ENV", "VENV", "PYTHON", "NODE_DATA_DIR", "LAUNCHER",
             "MAX_RESTARTS", "MIN_NODES", "OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "CONTAINER",
             "CONTAINER_RUNTIME", "CONTAINER_CMD", "SIGNAL")
# Every setting a job reads (run_training.sbatch's header lists them): the job that CHAIN
# submits gets those its line sets and no other, as a shell that ran the line would.
SETTINGS = PASSED_ON + ("SHARED_DIR", "SWEEP_FILE", "RUN_NAME", "DATA_DIR", "LOG_DIR", "MASTER_ADDR", "MASTER_PORT",
                        "NCCL_DEBUG", "CHECK", "CHAIN")


class JobError(Exception):
    """A setting or a state the user fixes: one line on stderr and exit code 2."""


class Settings:
    """What the job does, from the environment at submission (docs/clusters.md lists it) and
    the job's own facts. read_settings fills every field."""
    project = shared = script = data_dir = log_dir = run_name = launcher = signal = sweep_file = ""
    node_data_dir = python = environment = batch_file = job = ""
    passed_on = {}  # type: Dict[str, str]  # the PASSED_ON settings as given, before the supervisor sets any
    check = min_nodes_set = False
    max_restarts = master_port = tasks_per_node = 0
    chain = 0  # CHAIN: the jobs still to submit, one after another, where Slurm does not requeue a stopped job
    nodes = ntasks = 0  # the nodes and ranks the job was given (its steps' own: nodes.py's Step)
    min_nodes = 0  # the fewest nodes it goes on with after losing some
    container = []  # type: List[str]      # words before each rank's command (Apptainer, Singularity, CONTAINER_CMD)
    container_srun = []  # type: List[str]  # srun's own options (Pyxis)
    container_desc = "none"
    sweep_args = []  # type: List[str]      # the options of this array task's line of SWEEP_FILE
    args = []  # type: List[str]            # the training options given after the batch file's name

    @property
    def run_dir(self) -> str:
        return os.path.join(self.log_dir, self.run_name)

    @property
    def paths(self) -> JobPaths:
        """The files of the run directory and of this job's own folder in it."""
        return JobPaths(self.run_dir, self.job)

    @property
    def job_dir(self) -> str:
        """This job's own folder in the run directory."""
        return self.paths.job_dir


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


def read_settings(env: Mapping[str, str], *, project: str, batch_file: str, environment: str, args: List[str]
                  ) -> Settings:
    """Every setting checked, with the defaults filled in; a JobError names the first wrong one.
    `environment` says which Python environment the batch file activated; `args` are the
    training options given after the batch file's name."""
    s = Settings()
    s.project, s.batch_file, s.environment, s.args = project, batch_file, environment, list(args)
    s.job = this_job(env)
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
    s.chain = decimal(env, "CHAIN", 0, 100, 0)
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
    s.min_nodes, s.min_nodes_set = decimal(env, "MIN_NODES", 1, s.nodes, s.nodes), "MIN_NODES" in env
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
        raise JobError(f"ddpkit/job/sweeplines.py gave array task {env['SLURM_ARRAY_TASK_ID']} the run name '{s.run_name}', "
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
