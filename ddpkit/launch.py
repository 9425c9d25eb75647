"""The launch environment: who this process is in the job (torchrun, Slurm's srun, or one
process), the stop signals, the start-up clock, and the exit files the job's supervisor
reads (their names and the exit codes: ddpkit/job/contract.py).

Standard library only, so that mnist_ddp.py can import it, and catch a stop signal, before
torch has loaded (which takes seconds on shared storage)."""

import contextlib
import dataclasses
import os
import re
import signal
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ddpkit.files import make_folder
from ddpkit.job.contract import NOT_RETRIED, JobEnv, JobPaths, node_fault_text, port_from_job_id, read_codes, this_job

PROG = "mnist_ddp.py"
INTERRUPTED = "interrupted (Ctrl-C) before training started; nothing was saved"
CTRL_C_GRACE = 2.0  # seconds a Ctrl-C before training leaves the main thread to end the process by itself


class UsageError(Exception):
    """A problem the user can fix: printed as one line on stderr, exit code 2."""


class Diverged(Exception):
    """The loss stopped being finite: printed as one line, exit code 3, nothing saved."""


class HeldUp(Exception):
    """Another process held this one up past --dist-timeout outside a collective (it holds the
    data lock): exit 4, as a lost peer, which a restart may fix; the message is the line."""


class Stopped(Exception):
    """A stop signal was agreed on and a checkpoint saved (its path is the argument): the
    job runner requeues the job or says how to continue, and exits 75."""


class AlreadyComplete(Exception):
    """The run had nothing left to do (its message says how to train it longer): exit 0."""


class StopSignals:
    """SIGUSR1 (Slurm's --signal), SIGTERM (preemption, time limit, torchrun), SIGHUP (a
    site's preemption signal, a closed terminal) and, once
    training runs, SIGINT (Ctrl-C, which torchrun passes on to its workers) only set a flag
    here; the training loop acts on it at the next step boundary, where every rank agrees,
    rank 0 saves and (on USR1, TERM or HUP) the job is requeued. Saving inside a handler
    could interrupt a half-written file or a collective. A Ctrl-C pressed again while that
    save is a step away changes nothing (torchrun passes a second one on as SIGTERM, and
    kills workers still saving after 30 s). Before training starts there is nothing to
    save: Ctrl-C then stops at once (KeyboardInterrupt), e.g. during a download; while the
    program still loads (torch takes seconds), with no traceback through the import; and
    while it waits in torch's C++ (a rendezvous, a barrier), where Python runs no handler
    until the wait ends, after CTRL_C_GRACE seconds: so every rank ends alike when one still
    loads and another waits for it in the rendezvous. A SIGINT or SIGHUP that the parent set
    to be ignored (nohup) stays ignored.
    Under run_training.sbatch only its SIGNAL (USR1 by default) requeues the job; the
    others save and stop. On rank 0 the job's time limit asks for a stop and a requeue too,
    when it comes near (time_limit.TimeLimit, set once the run starts)."""

    def __init__(self, loading: bool = False):
        self.received, self.training = 0, False
        # Made while the program's code still loads (until the job runner takes over): a
        # Ctrl-C then has nothing to tear down, and ends the process here.
        self.loading = loading
        self.time_limit, self.time_up = None, False
        # A Ctrl-C's KeyboardInterrupt can land where Python only ignores exceptions (a weakref
        # callback of the import system, a __del__), and the run would go on: it is kept here,
        # and training does not begin (begin_training).
        self.interrupted = False
        self.unraisable = sys.unraisablehook
        sys.unraisablehook = self.ignored
        signals = [signal.SIGUSR1, signal.SIGTERM]
        # One the parent set to be ignored stays ignored: SIGHUP under nohup, SIGINT in a
        # shell's background job.
        signals += [sig for sig in (signal.SIGHUP, signal.SIGINT) if signal.getsignal(sig) is not signal.SIG_IGN]
        self.previous = {sig: signal.signal(sig, self.handle) for sig in signals}
        self.wakeup = self.watch_ctrl_c() if signal.SIGINT in self.previous else None

    def watch_ctrl_c(self) -> int | None:
        """Python's own C handler writes each signal's number to the wakeup fd at once, even while
        the main thread waits in C++; a thread reads them, and ends the process after a Ctrl-C
        before training that the main thread did not act on within CTRL_C_GRACE seconds.
        Returns the fd's writing end (None where another part holds the wakeup fd)."""
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)
        try:
            earlier = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        except ValueError:  # (not the main thread: a handler could not be set either)
            earlier = None
        if earlier != -1:  # someone else's (or none could be set): leave it as it was
            if earlier is not None:
                signal.set_wakeup_fd(earlier)
            os.close(read_end)
            os.close(write_end)
            return None
        import threading  # (here, once the handlers are set: the start-up before them stays as short)

        threading.Thread(target=self.read_wakeups, args=(read_end,), name="ctrl-c watch", daemon=True).start()
        return write_end

    def read_wakeups(self, read_end: int) -> None:
        with open(read_end, "rb", buffering=0) as wakeups:
            for byte in iter(lambda: wakeups.read(1), b""):
                if byte[0] != signal.SIGINT or self.training:
                    continue
                deadline = time.monotonic() + CTRL_C_GRACE
                while not self.interrupted and time.monotonic() < deadline:
                    time.sleep(0.05)
                if not (self.interrupted or self.training):
                    self.end_at_once()

    @staticmethod
    def end_at_once() -> None:
        """End this process after a Ctrl-C before training as the job runner ends it (its line,
        and 130 left by record_exit where the job's supervisor reads each rank's code), but at
        once: the program still loads, with nothing to save or tear down, or its main thread
        waits in C++ and cannot act."""
        code = 128 + signal.SIGINT
        try:
            print(f"{PROG}: error: {INTERRUPTED}", file=sys.stderr, flush=True)
            record_exit(code, read_launch_env(os.environ, alone_ok=True))
        finally:  # (whatever fails above: the Ctrl-C still ends the process)
            os._exit(code)

    def handle(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.loading:
            # Not an exception: code being imported may catch every one (a bare except) and go on.
            self.end_at_once()
        if signum == signal.SIGINT and not self.training:
            self.interrupted = True
            raise KeyboardInterrupt
        # The first one says why: a Ctrl-C stays a Ctrl-C, which asks for no requeue.
        self.received = self.received or signum

    def ignored(self, unraisable) -> None:
        """(sys.unraisablehook) A Ctrl-C's KeyboardInterrupt that Python could only ignore: no
        traceback, as begin_training stops the run; anything else as Python reports it."""
        if not (self.interrupted and isinstance(unraisable.exc_value, KeyboardInterrupt)):
            self.unraisable(unraisable)

    def begin_training(self) -> None:
        """From now on Ctrl-C saves first; a Ctrl-C that came before and was swallowed stops here."""
        if self.interrupted:
            raise KeyboardInterrupt
        self.training = True

    def asked(self) -> bool:
        """Whether this rank asks every rank to stop: a signal came, or the time limit is near."""
        if not (self.received or self.time_up) and self.time_limit is not None:
            self.time_up = self.time_limit.up()
        return bool(self.received or self.time_up)

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        sys.unraisablehook = self.unraisable
        if self.wakeup is not None:  # (its reader then reads the end of the pipe, and ends)
            current = signal.set_wakeup_fd(-1)
            if current != self.wakeup:  # another part set its own since: it keeps it
                signal.set_wakeup_fd(current)
            os.close(self.wakeup)
            self.wakeup = None


IMPORTED_AT = time.monotonic()


def process_age() -> float:
    """Seconds since this process started (Linux: its start time in /proc/self/stat against
    the time since boot), so the interpreter's own start counts; elsewhere, since this module
    was imported."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rpartition(")")[2].split()[19])
        return time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return time.monotonic() - IMPORTED_AT


class StartupClock:
    """Where the time to the first training step went: the imports (from the process's start
    to the clock's), then the phases timed with `phase`; `ready_line` adds the rest."""

    def __init__(self):
        self.phases = {"imports": process_age()}

    @contextlib.contextmanager
    def phase(self, name: str):
        started = time.monotonic()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.monotonic() - started

    def ready_line(self) -> str:
        total = process_age()
        parts = {**self.phases, "the rest": max(0.0, total - sum(self.phases.values()))}
        return f"ready in {total:.2f} s ({', '.join(f'{name} {seconds:.2f} s' for name, seconds in parts.items())})"


@dataclass(frozen=True)
class Launch:
    """Who this process is in the job, as the launcher said (nothing initialised yet)."""
    source: str             # "torchrun", "slurm" or "single"
    rank: int
    local_rank: int
    world_size: int
    master_addr: str
    master_port: int
    job_id: str             # Slurm job id ("123" or "123_4" for an array task), "" outside Slurm
    num_threads: int        # CPU threads for this rank; 0 = leave torch's default
    local_world_size: int = 1   # ranks on this node
    gpus_granted: str = ""      # the variable that says this job was given GPUs, e.g. "SLURM_JOB_GPUS=0,1"
    gpu_per_task: bool = False  # srun --gpus-per-task: Slurm shows each task only its own GPU(s)
    attempt: str = "1/1"        # "k/N": the k-th start of this job step out of at most N (restarts after failures)
    restarts_left: int = 0      # how often torchrun's agent would still restart this worker if it failed
    exit_dir: str = ""          # where each rank records its exit code as rank-<r> (run_training.sbatch reads them)
    requeues: int = 0           # how often Slurm has requeued this job (SLURM_RESTART_COUNT)
    nodes: int = 1              # machines the ranks run on
    node: str = ""              # this machine as Slurm names it (SLURMD_NODENAME), else its host name

    @property
    def paths(self) -> JobPaths:
        """The files this rank leaves for the job's supervisor in the job's folder (exit_dir),
        which write_exit_file writes only where there is one."""
        return JobPaths.of_folder(self.exit_dir)

    @property
    def continues_job(self) -> bool:
        """Whether this start goes on with a job that started before: a restart of its step
        (run_training.sbatch's or torchrun's) or a requeue by Slurm."""
        return not self.attempt.startswith("1/") or self.requeues > 0


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand Slurm's compressed host list: 'node[01-03,07],gpu3' -> node01 node02 node03 node07 gpu3."""
    hosts: list[str] = []
    for item in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", hostlist):
        expanded = [""]
        for text, ranges in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", item):
            choices = [text]
            if ranges:
                choices = []
                for part in ranges.split(","):
                    low, dash, high = part.partition("-")
                    if not low.isdigit() or (dash and not high.isdigit()):
                        raise UsageError(f"cannot parse Slurm host list {hostlist!r}")
                    for n in range(int(low), int(high or low) + 1):
                        choices.append(text + str(n).zfill(len(low)))
            expanded = [prefix + choice for prefix in expanded for choice in choices]
        hosts.extend(expanded)
    if not hosts:
        raise UsageError(f"cannot parse Slurm host list {hostlist!r}")
    return hosts


def tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """This node's entry of Slurm's compressed task counts: '2(x3),1' is 2, 2, 2, 1."""
    counts: list[int] = []
    for count, repeat in re.findall(r"(\d+)(?:\(x(\d+)\))?", tasks_per_node):
        counts += [int(count)] * int(repeat or 1)
    return counts[node_id] if node_id < len(counts) else 0


def gpus_granted(env: Mapping[str, str]) -> str:
    """Which variable says that GPUs were given to this job ("" if none does)."""
    for name in ("SLURM_GPUS_ON_NODE", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS", "CUDA_VISIBLE_DEVICES"):
        value = env.get(name, "").strip()
        if name == "SLURM_GPUS_ON_NODE":  # a count; the others list devices, where 0 is the first GPU
            given = value.isdigit() and int(value) > 0
        else:
            given = value not in ("", "-1", "NoDevFiles")
        if given:
            return f"{name}={value}"
    return ""


def _int_var(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise UsageError(f"{name}={env[name]!r} is not an integer; unset it or fix the launcher") from None


def refuse_training_alone(env: Mapping[str, str]) -> None:
    """A job of several tasks, but this process is not one of srun's (a batch script's or an
    salloc shell's `python mnist_ddp.py`): it would train alone on a share of the allocation."""
    ntasks = _int_var(env, "SLURM_NTASKS")
    if ntasks > 1 and "SLURM_STEP_ID" not in env:
        raise UsageError(f"SLURM_NTASKS={ntasks} but this process was not started by srun, so it would train alone. "
                         "HINT: run it as `srun python mnist_ddp.py ...` (run_training.sbatch does), or ask for --ntasks=1")


def read_launch_env(env: Mapping[str, str], alone_ok: bool = False) -> Launch:
    """The one place that reads the launcher's variables: torchrun, then Slurm, then one
    process. `alone_ok`: one process in an salloc shell of several tasks is not refused (it
    may train nothing: --help, --download-only)."""
    job_id = this_job(env)
    # torchrun and srun set OMP_NUM_THREADS as they see fit; torch honours it. Otherwise use
    # the CPUs Slurm gave this task, so that tasks sharing a node do not fight over cores.
    num_threads = 0 if "OMP_NUM_THREADS" in env else int(env.get("SLURM_CPUS_PER_TASK", "0") or 0)

    if "RANK" in env and "WORLD_SIZE" in env:
        missing = [v for v in ("LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if v not in env]
        if missing:
            raise UsageError(f"RANK and WORLD_SIZE are set but {', '.join(missing)} not; launch with torchrun, or unset RANK/WORLD_SIZE")
        local_world = _int_var(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else _int_var(env, "LOCAL_RANK") + 1
        launch = Launch("torchrun", _int_var(env, "RANK"), _int_var(env, "LOCAL_RANK"), _int_var(env, "WORLD_SIZE"),
                        env["MASTER_ADDR"], _int_var(env, "MASTER_PORT"), job_id, num_threads, local_world)
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        ntasks = _int_var(env, "SLURM_NTASKS")
        if not env.get("SLURM_JOB_ID", "0").isdigit():
            raise UsageError(f"SLURM_JOB_ID={env['SLURM_JOB_ID']!r} is not a job id; unset it or set MASTER_PORT")
        refuse_training_alone(env)
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
        if not nodelist and ntasks > 1:
            raise UsageError("SLURM_JOB_NODELIST is not set, so the first host is unknown; set MASTER_ADDR")
        master_addr = env.get("MASTER_ADDR") or (expand_hostlist(nodelist)[0] if nodelist else "127.0.0.1")
        master_port = _int_var(env, "MASTER_PORT") if "MASTER_PORT" in env else port_from_job_id(env.get("SLURM_JOB_ID", ""))
        local_rank = _int_var(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
        per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "")
        local_world = tasks_on_node(per_node, int(env.get("SLURM_NODEID", "0") or 0)) if per_node else ntasks
        launch = Launch("slurm", _int_var(env, "SLURM_PROCID"), local_rank, ntasks, master_addr, master_port, job_id,
                        num_threads, max(local_world, local_rank + 1), gpu_per_task=bool(env.get("SLURM_GPUS_PER_TASK")))
    else:
        if "SLURM_JOB_ID" in env and "SLURM_NTASKS" in env and not alone_ok:  # an salloc shell sets no SLURM_PROCID
            refuse_training_alone(env)
        launch = Launch("single", 0, 0, 1, "127.0.0.1", 0, job_id, num_threads)
    # Restarts: run_training.sbatch numbers its attempts (srun mode); torchrun counts its own.
    attempt = env.get(JobEnv.ATTEMPT, "1/1")
    if launch.source == "torchrun" and "TORCHELASTIC_MAX_RESTARTS" in env:
        done, most = _int_var(env, "TORCHELASTIC_RESTART_COUNT"), _int_var(env, "TORCHELASTIC_MAX_RESTARTS")
        attempt = f"{done + 1}/{most + 1}"
        launch = dataclasses.replace(launch, restarts_left=most - done)
    if not re.fullmatch(r"[1-9]\d*/[1-9]\d*", attempt):
        raise UsageError(f"{JobEnv.ATTEMPT}={attempt!r} is not k/N; unset it")
    launch = dataclasses.replace(launch, gpus_granted=gpus_granted(env), attempt=attempt,
                                 exit_dir=env.get(JobEnv.EXIT_DIR, ""), node=env.get("SLURMD_NODENAME") or socket.gethostname(),
                                 requeues=_int_var(env, "SLURM_RESTART_COUNT") if "SLURM_RESTART_COUNT" in env else 0)
    if launch.source == "torchrun":
        launch = dataclasses.replace(launch, nodes=max(1, launch.world_size // launch.local_world_size))
    elif launch.source == "slurm":
        nodes = next((name for name in ("SLURM_STEP_NUM_NODES", "SLURM_NNODES") if name in env), "")
        launch = dataclasses.replace(launch, nodes=_int_var(env, nodes) if nodes else 1)

    if launch.world_size < 1 or not 0 <= launch.rank < launch.world_size or not 0 <= launch.local_rank <= launch.rank:
        raise UsageError(f"ranks do not add up ({launch.source}: rank {launch.rank}, local rank {launch.local_rank}, "
                         f"world size {launch.world_size}); HINT: start one task per rank, e.g. srun --ntasks-per-node=N")
    if not 0 < launch.master_port < 65536 and launch.world_size > 1:
        raise UsageError(f"master port {launch.master_port} is not a TCP port; set MASTER_PORT to 1024-65535")
    return launch


def write_exit_file(launch: Launch, path: str, text: str) -> None:
    """Leave a file for the job's supervisor in the job's folder (JobEnv.EXIT_DIR), if there is
    one: `path`, one of launch.paths."""
    if launch.exit_dir:
        make_folder(launch.exit_dir)  # (every rank: make_folder bears the others' race)
        Path(path).write_text(text)


def remove_exit_file(launch: Launch, path: str) -> None:
    """Take back a file left for the job's supervisor (write_exit_file), if it is there."""
    if launch.exit_dir:
        with contextlib.suppress(OSError):
            Path(path).unlink()


def record_exit(code: int, launch: Launch | None) -> None:
    """Leave this rank's exit code where run_training.sbatch reads it: it restarts after
    a lost peer or a killed rank, never after a code in NOT_RETRIED on any rank."""
    if launch:
        with contextlib.suppress(OSError):
            write_exit_file(launch, launch.paths.rank_code(launch.rank), f"{code}\n")


def record_node_fault(fault: str, launch: Launch | None) -> None:
    """Tell the job's supervisor that this rank's node failed it (exit 5) and how (`fault`, the
    error's class): it pins the failure on that node. Before the exit code, which ends the wait."""
    if launch:
        with contextlib.suppress(OSError):
            write_exit_file(launch, launch.paths.node_fault(launch.rank), node_fault_text(launch.node, fault))


def unfixable_exit(launch: Launch) -> tuple[int, str]:
    """(code, rank file) of an earlier attempt of this step that a restart cannot fix, or (0, "").

    torchrun restarts every worker when one fails. When one rank hit a bug (1) or a usage
    error (2) and the others lost it, the restarted workers find its code here and end
    at once instead of repeating it."""
    if not launch.exit_dir or launch.attempt.startswith("1/"):
        return 0, ""
    codes = read_codes(launch.exit_dir)
    return next(((code, JobPaths.RANK_CODE.format(rank)) for rank, code in sorted(codes.items()) if code in NOT_RETRIED),
                (0, ""))


def exit_status(code: int) -> int:
    """The process's exit status for its launcher. torchrun restarts every worker group in
    which a worker exited non-zero, whatever the code; so while it would restart, a code
    that a restart cannot fix goes to the exit file only and the worker exits 0. Users of
    torchrun without run_training.sbatch (no job's folder) get the code itself."""
    with contextlib.suppress(UsageError):
        launch = read_launch_env(os.environ)
        if launch.exit_dir and launch.restarts_left > 0 and code in NOT_RETRIED:
            return 0
    return code
