"""The job's contract: what the Slurm job's supervisor (ddpkit/supervisor/), the ranks
(mnist_ddp.py and the rest of ddpkit/) and sweep.py must agree on, each written once here
and imported by both sides: the exit codes and which of them a restart may fix, the run's
name, the job's name in scontrol and its rendezvous port, the one reader of `scontrol show
job` and the one requeue, the environment variables the supervisor passes to the ranks
(JobEnv), the files of the run directory and of the job's folder (JobPaths), how a setting
and an option are written, the options of a run's first start alone, and the name of each
step's checkpoint.

The supervisor runs it with the node's python3, outside any container, which may be as old
as 3.6 (RHEL 8): so the standard library only, and nothing newer than Python 3.6
(tests/unit/test_supervisor_main.py checks it with vermin)."""

import os
import re
import shlex
import shutil
import subprocess
import time
from typing import Callable, Dict, List, Mapping, Optional, Tuple

from ddpkit.job import sweeplines

# ----------------------------------------------------------------------------- exit codes

# The exit codes of the ranks, and of the job that runs them.
EXIT_BUG = 1
EXIT_USAGE = 2
EXIT_DIVERGED = 3
EXIT_LOST_PEER = 4  # another rank died or hung: a failure that running again fixes
EXIT_NODE_FAULT = 5  # a fault of this rank's node's GPU (ECC, NVLink, a busy device): running again fixes it, elsewhere
EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped on request, try again to continue
# The codes after which nothing starts the ranks again (the supervisor's restarts, torchrun's):
# a restart would repeat a bug, a usage problem or a divergence, and a stop asked to stop.
NOT_RETRIED = (EXIT_BUG, EXIT_USAGE, EXIT_DIVERGED, EXIT_STOPPED)


# ----------------------------------------------------------------------------- the run and the job

RUN_NAME_RULE = "one directory name of letters, digits and ._-+=,@ (no / or spaces, not . or ..)"


def is_run_name(name: str) -> bool:
    """The one rule for a run's name: one directory name, so that LOG_DIR/NAME stays in LOG_DIR."""
    return re.fullmatch(f"[{sweeplines.NAME_CHARS}]+", name) is not None and name not in (".", "..")


def default_run_name(job: str) -> str:
    """The run's name when none is given: a requeued job finds its own directory again."""
    return JobPaths.job_name(job)


def this_job(env: Mapping[str, str]) -> str:
    """This job as scontrol and scancel name it: an array task is ARRAYID_TASK."""
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env.get("SLURM_JOB_ID", "")


def port_from_job_id(job_id: str) -> int:
    """A rendezvous port every task of a job derives alike, different for jobs sharing a node.
    10000-29999 stays below Linux's ephemeral range (32768-60999), so an outgoing connection
    cannot already hold it."""
    return 10000 + int(job_id or 0) % 20000


# ----------------------------------------------------------------------------- what passes to the ranks

class JobEnv:
    """Every environment variable the supervisor sets for the ranks, named once (as submitit's
    `_env` table names its own). SIDES says who writes each one and who reads it, itself or
    through a function of this module: the supervisor (ddpkit/supervisor/), the ranks
    (mnist_ddp.py and the rest of ddpkit/) or sweep.py (tests/unit/test_contract.py checks
    that each side does)."""
    EXIT_DIR = "MNIST_DDP_EXIT_DIR"              # the job's folder (JobPaths.job_dir), where each rank leaves its files
    ATTEMPT = "MNIST_DDP_ATTEMPT"                # "k/N": this start of the step is the k-th of at most N
    REQUEUE_SIGNAL = "MNIST_DDP_REQUEUE_SIGNAL"  # SIGNAL: a stop on it, or on the time limit, asks for a requeue
    JOB_INFO = "MNIST_DDP_JOB_INFO"              # the job's `scontrol show job -o` line, for rank 0's time limit
    JOB_TIMES = "MNIST_DDP_JOB_TIMES"            # its start and end in Unix seconds, "START END" (scontrol prints local time)
    RESUBMIT = "MNIST_DDP_RESUBMIT"              # the beginning of the sbatch line that continues the run
    CHAIN = "MNIST_DDP_CHAIN"                    # CHAIN: the jobs it may still chain where Slurm does not requeue a stop
    SIDES = {  # name: (who writes it, who reads it)
        "EXIT_DIR": ("supervisor", "ranks"),
        "ATTEMPT": ("supervisor", "ranks"),
        "REQUEUE_SIGNAL": ("supervisor", "ranks"),
        "JOB_INFO": ("supervisor", "ranks"),
        "JOB_TIMES": ("supervisor", "ranks"),
        "RESUBMIT": ("supervisor", "ranks"),
        "CHAIN": ("supervisor", "ranks"),
    }


def resubmit_start() -> str:
    """Under run_training.sbatch, the beginning of the sbatch line that continues this run (its
    settings, the job's request, the batch file), which the ranks end with the run's
    options; "" elsewhere."""
    return os.environ.get(JobEnv.RESUBMIT, "")


def chains_left(env: Mapping[str, str]) -> int:
    """Under run_training.sbatch, the jobs its CHAIN may still submit to continue the run where
    Slurm does not requeue a stop that asked for it (JobEnv.CHAIN); 0 elsewhere."""
    value = env.get(JobEnv.CHAIN, "")
    return int(value) if value.isdigit() else 0


def run_name_setting() -> str:
    """How advice names another run: --run-name, or in a job of run_training.sbatch (which
    reads RUN_NAME and refuses --run-name after its file name) RUN_NAME."""
    return "RUN_NAME" if resubmit_start() else "--run-name"


class JobPaths:
    """Every file of the job's folder and the run directory that passes between the supervisor,
    the ranks and sweep.py (the run's log, run.json and metrics.jsonl, is runlog.py's): a property of one
    object for each (as submitit's JobPaths(folder, job_id) has one for each file of a job), so
    that no side joins a name by hand. JobPaths(RUN_DIR, job) holds the run directory's files
    and job_dir, the job's own folder (RUN_DIR/exit-codes/job-<id>), with the rest: one folder
    for each job of the run, so that a second job of the same run, refused while the first one
    runs, never touches the first one's files. JobPaths.of_folder(folder) holds a job's folder
    alone, as the ranks know it (JobEnv.EXIT_DIR). Each file's property is its name's below in
    lower case (REQUEUE: requeue; RANK_CODE: rank_code(rank)). SIDES says who writes each file
    and who reads it, as JobEnv.SIDES does; a file of the run directory may also pass between
    two jobs of one side."""
    EXIT_CODE = "exit-code"                # how the run's last attempt ended, for sweep.py and whoever reads RUN_DIR
    JOB_DIRS = "exit-codes"                # RUN_DIR/exit-codes/job-<id>: each job's folder
    RANK_CODE = "rank-{}"                  # rank-<r>: that rank's exit code, once all it wrote is on disk
    REQUEUE = "requeue"                    # rank 0 stopped on a signal that asks for a requeue: why
    CONTINUE_COMMAND = "continue-command"  # rank 0's command that continues the run, printed after END
    RUN_DIR_TAKEN = "run-dir-taken"        # another job holds the run directory: leave its files alone
    WORLD_SIZES = "world-sizes"            # the world sizes the run's global batch splits among, after a lost node
    CHAINED_JOB = "chained-job"            # RUN_DIR/chained-job: the id of the job CHAIN submitted to continue the run
    NODES = "nodes-by-rank"                # each rank's Slurm node, one a line in rank order, once the ranks met
    HUNG = "hung"                          # the ranks a hang report named as those the others wait for (hung_text)
    NODE_FAULT = "node-fault-rank-{}"      # node-fault-rank-<r>: that rank's node's GPU failed it, exit 5 (node_fault_text)
    NODE_FAILURES = "node-failures-job-{}"  # RUN_DIR/exit-codes/node-failures-job-<id>: the job's failures pinned on a node
    TRACKER = "tracker.json"               # RUN_DIR/tracker.json: the experiment tracker's run id and what it has (trackers.py)
    SIDES = {  # name: (who writes it, who reads it), several sides separated by spaces
        "EXIT_CODE": ("ranks supervisor sweep", "sweep"),
        "JOB_DIRS": ("supervisor", "sweep"),
        "RANK_CODE": ("ranks", "supervisor"),
        "REQUEUE": ("ranks", "supervisor"),
        "CONTINUE_COMMAND": ("ranks", "supervisor"),
        "RUN_DIR_TAKEN": ("ranks", "supervisor"),
        "WORLD_SIZES": ("ranks", "supervisor"),
        "CHAINED_JOB": ("supervisor", "supervisor"),  # (from the job that chained to the next one's and any later one's)
        "NODES": ("ranks", "supervisor"),
        "HUNG": ("ranks", "supervisor"),
        "NODE_FAULT": ("ranks", "supervisor"),
        "NODE_FAILURES": ("supervisor", "supervisor"),  # (from each start of the job, its requeues too, to the next)
        "TRACKER": ("ranks", "ranks"),  # (rank 0, from each start of the run to the next)
    }

    def __init__(self, run_dir: str, job: str = "", job_dir: Optional[str] = None) -> None:
        """The paths of the run directory `run_dir` and of its job `job`; `job_dir`: that job's
        folder where it is known alone (of_folder)."""
        self.run_dir, self.job, self.given_job_dir = run_dir, job, job_dir

    @classmethod
    def of_folder(cls, job_dir: str) -> "JobPaths":
        """The paths of a job's folder alone (the files of job_dir), as the ranks know it from
        JobEnv.EXIT_DIR: not those of its run directory."""
        return cls("", "", job_dir)

    @property
    def job_dir(self) -> str:
        """The job's own folder, which each start of the job clears."""
        if self.given_job_dir is not None:
            return self.given_job_dir
        return os.path.join(self.run_dir, JobPaths.JOB_DIRS, JobPaths.job_name(self.job))

    @staticmethod
    def job_name(job: str) -> str:
        """job-<id>: the name of the job's folder, of its copy of the code and of the run's
        directory when the run is given no name (default_run_name)."""
        return "job-" + job

    @staticmethod
    def names_a_job(name: str) -> bool:
        """Whether a name in the run directory is a job's (job_name): its folder, its copy of the code."""
        return name.startswith(JobPaths.job_name(""))

    @staticmethod
    def is_rank_code(name: str) -> bool:
        """Whether a file of the job's folder is a rank's exit code."""
        return re.fullmatch(JobPaths.RANK_CODE.format(r"\d+"), name) is not None

    # The run directory's files.

    @property
    def exit_code(self) -> str:
        return os.path.join(self.run_dir, JobPaths.EXIT_CODE)

    @property
    def chained_job(self) -> str:
        return os.path.join(self.run_dir, JobPaths.CHAINED_JOB)

    @property
    def tracker(self) -> str:
        return os.path.join(self.run_dir, JobPaths.TRACKER)

    @property
    def code_copy(self) -> str:
        """RUN_DIR/code/job-<id>: the copy of the code the job runs, made at its first start."""
        return os.path.join(self.run_dir, "code", JobPaths.job_name(self.job))

    @property
    def job_dirs(self) -> str:
        """The folder of the run's jobs' folders and their node_failures records."""
        return os.path.join(self.run_dir, JobPaths.JOB_DIRS)

    @property
    def node_failures(self) -> str:
        """The file of the failures pinned on a node in the job, beside its folder: it outlives
        the folder, which each start of the job clears."""
        return os.path.join(self.job_dirs, JobPaths.NODE_FAILURES.format(self.job))

    def node_failure_records(self) -> List[Tuple[str, str]]:
        """(job, its node_failures file) of each job of the run that pinned a failure on a node, in
        the order the jobs came (job 9 before job 10)."""
        found = []  # type: List[Tuple[str, str]]
        for name in os.listdir(self.job_dirs) if os.path.isdir(self.job_dirs) else []:
            match = re.fullmatch(JobPaths.NODE_FAILURES.format("(.+)"), name)
            if match:
                found.append((match.group(1), JobPaths(self.run_dir, match.group(1)).node_failures))
        return sorted(found, key=lambda job_path: (len(job_path[0]), job_path[0]))

    # The job's folder's files.

    def rank_code(self, rank: int) -> str:
        return os.path.join(self.job_dir, JobPaths.RANK_CODE.format(rank))

    def node_fault(self, rank: int) -> str:
        return os.path.join(self.job_dir, JobPaths.NODE_FAULT.format(rank))

    @property
    def requeue(self) -> str:
        return os.path.join(self.job_dir, JobPaths.REQUEUE)

    @property
    def continue_command(self) -> str:
        return os.path.join(self.job_dir, JobPaths.CONTINUE_COMMAND)

    @property
    def run_dir_taken(self) -> str:
        return os.path.join(self.job_dir, JobPaths.RUN_DIR_TAKEN)

    @property
    def world_sizes(self) -> str:
        return os.path.join(self.job_dir, JobPaths.WORLD_SIZES)

    @property
    def nodes(self) -> str:
        return os.path.join(self.job_dir, JobPaths.NODES)

    @property
    def hung(self) -> str:
        return os.path.join(self.job_dir, JobPaths.HUNG)


def hung_text(ranks: List[Tuple[int, str]]) -> str:
    """JobPaths.HUNG's text: the ranks a hang report named, each with its node, "RANK NODE" a line."""
    return "".join(f"{rank} {node}\n" for rank, node in ranks)


def read_hung(text: str) -> List[Tuple[str, str]]:
    """(rank, node) of each line of JobPaths.HUNG's text."""
    return [(line.partition(" ")[0], line.partition(" ")[2].strip()) for line in text.splitlines() if line.strip()]


def node_fault_text(node: str, fault: str) -> str:
    """JobPaths.NODE_FAULT's text: the rank's node and its fault's class, "NODE CLASS"."""
    return f"{node} {fault}\n"


def read_node_fault(text: str) -> Tuple[str, str]:
    """(node, class) of JobPaths.NODE_FAULT's text; ("", "") when it holds none."""
    line = text.strip().partition("\n")[0]
    node, _, fault = line.partition(" ")
    return node, fault.strip()


def read_codes(job_dir: str) -> Dict[int, int]:
    """The exit codes the ranks left in the job's folder, by rank: the one reader of them, for
    the supervisor and for ranks restarted by torchrun. A rank that left none, or a file
    that holds no code, is missing."""
    codes = {}  # type: Dict[int, int]
    for name in os.listdir(job_dir) if os.path.isdir(job_dir) else []:
        if JobPaths.is_rank_code(name):
            try:
                with open(os.path.join(job_dir, name)) as file:
                    text = file.read().strip()
            except OSError:
                continue
            if re.fullmatch("[0-9]+", text):
                codes[int(name.rpartition("-")[2])] = int(text)
    return codes


# ----------------------------------------------------------------------------- scontrol

# Seconds: a slow controller must not hold the job, nor keep the other ranks waiting on rank 0
# (which asks it under a plain srun) as long as --hang-after's default (60 s) or beyond.
SCONTROL_TIMEOUT = 30.0


def run(command: List[str], timeout: float, env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None
        ) -> subprocess.CompletedProcess:
    """A command's exit code and its output as UTF-8 text, whatever the locale (Python 3.6 reads
    a C locale as ASCII; subprocess.run's text= and capture_output= are newer)."""
    return subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, encoding="utf-8", errors="replace",
                          timeout=timeout, env=env, cwd=cwd)


def last_line(text: str) -> str:
    """The last line a command wrote (scontrol's error follows its warnings), or ""."""
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


def scontrol_show_job(job: str) -> subprocess.CompletedProcess:
    """`scontrol show job -o` of this job, times in ISO form; OSError or SubprocessError when it
    cannot run or hangs."""
    return run(["scontrol", "show", "job", "-o", job], SCONTROL_TIMEOUT, dict(os.environ, SLURM_TIME_FORMAT="standard"))


def show_job(job: str) -> str:
    """This job's one `scontrol show job -o` line ("" when scontrol cannot say)."""
    try:
        result = scontrol_show_job(job)
    except (OSError, subprocess.SubprocessError):
        return ""
    return result.stdout.partition("\n")[0] if result.returncode == 0 else ""


def job_fields(info: str) -> Dict[str, str]:
    """The KEY=VALUE fields of one `scontrol show job -o` line."""
    return dict(re.findall(r"(\w+)=(\S*)", info))


def unix_time(text: str) -> Optional[int]:
    """Unix seconds of a time as scontrol prints it (2026-11-24T10:00:00, local time on the
    host); None for Unknown, None or N/A."""
    try:
        return int(time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%S")))
    except ValueError:
        return None


def requeue_allowed(fields: Mapping[str, str]) -> Tuple[Optional[bool], str]:
    """Whether the job's scontrol fields allow a requeue (None: they do not say), and when they
    do not, why not, to follow "Slurm job <id>"."""
    if fields.get("BatchFlag") == "0":
        return False, "is an interactive allocation (salloc), which Slurm does not requeue"
    allowed = {"1": True, "0": False}.get(fields.get("Requeue", ""))
    return allowed, "" if allowed else "may not be requeued (it was submitted without --requeue)"


def requeue_job(job: str, after: str = "", before: str = "", about_to_requeue: Callable[[], None] = lambda: None
                ) -> bool:
    """Ask Slurm to requeue this job, if it may: the one requeue, of the supervisor and of a rank
    0 that runs without it. Any failure (no scontrol, a timeout, a refusal) means 'not
    requeued', said in one line, never a crash. When Slurm accepts, it ends the job's processes."""
    if not job or shutil.which("scontrol") is None:
        return False
    try:
        shown = scontrol_show_job(job)
        if shown.returncode != 0:
            print(f"could not requeue Slurm job {job} (scontrol show job: {last_line(shown.stderr)})", flush=True)
            return False
        allowed, why_not = requeue_allowed(job_fields(shown.stdout.partition("\n")[0]))
        if not allowed:
            print(f"Slurm job {job} {why_not}", flush=True)
            return False
        after = " after " + after if after else ""
        print(f"requeueing Slurm job {job}{after}; it resumes from its last checkpoint{before}", flush=True)
        about_to_requeue()
        result = run(["scontrol", "requeue", job], SCONTROL_TIMEOUT)
    except (OSError, subprocess.SubprocessError) as err:
        print(f"could not requeue Slurm job {job} (scontrol: {err})", flush=True)
        return False
    if result.returncode != 0:
        why = last_line(result.stderr) or f"exit {result.returncode}"
        print(f"could not requeue Slurm job {job} (scontrol requeue: {why})", flush=True)
    return result.returncode == 0


# ----------------------------------------------------------------------------- the ranks' command line

def shell_setting(name: str, value: str) -> str:
    """A setting as a shell line writes it before a command: NAME=value with the value alone
    quoted (a shell reads a quoted 'NAME=value' as a command)."""
    return f"{name}={shlex.quote(value)}"


def option_word(option: str, value: str) -> str:
    """An option the ranks are given, as --option=value: one word, whatever the value (a run
    named -lr3: `--run-name -lr3` would be two options)."""
    return f"{option}={value}"


# The options that belong to a run's first start alone: where it started from (a restart or a
# requeue goes on from the run's own newest checkpoint, as --resume auto does; --resume never
# would refuse it) and the stop rehearsed at a chosen step (it would stop the run there again).
# The step that continues a run, and every line printed to continue it, leave them out.
FIRST_START_ONLY = ("--resume", "--interrupt-at")
CKPT_DIR = "checkpoints"  # RUN_DIR/checkpoints: the run's own checkpoints
CKPT_NAME = "ckpt-{:08d}.pt"  # the one name of the checkpoint of each step, in RUN_DIR/checkpoints


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
        names = os.listdir(os.path.join(run_dir, CKPT_DIR))
    except OSError:
        names = []
    if resume not in ("", "auto", "never") and not any(step_of_checkpoint(name) >= 0 for name in names):
        kept.append(option_word("--resume", resume))
    return kept
