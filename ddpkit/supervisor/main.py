"""The Slurm job's supervisor: run_training.sbatch hands the job over to it once the site's
setup has run and the Python environment is active. It reads the settings (environment
variables, listed in docs/clusters.md: settings.py), keeps a copy of the code the job runs
(snapshot.py), checks the ranks' interpreter (PREFLIGHT), starts the ranks as one srun step
or one torchrun per node (step.py), decides from their exit codes what happened
(outcome.py), starts the step again after a killed rank or a lost peer (on the nodes left,
with MIN_NODES, when a node was lost), requeues the job after a stop that asks for it, and
prints the line that continues the run. What it and the ranks must agree on is
ddpkit/contract.py; no rank imports this package.

It runs on the host with the python3 on the PATH (the active environment's, else the
node's), outside the container when the ranks run in one (srun, scontrol and scancel are on
the host). That python3 may be as old as 3.6 (RHEL 8): so the standard library only, and
nothing newer than Python 3.6 (tests/unit/test_supervisor_main.py checks it with vermin).

    python3 ddpkit/supervisor/main.py supervise --project DIR --batch-file FILE --environment TEXT -- [training options]
    PYTHON ddpkit/supervisor/main.py task train|torchrun ARGS...   # what srun starts in each task
"""

import argparse
import datetime
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
from typing import List, Optional

if __name__ == "__main__" and not __package__:  # run as a file: ddpkit is the parent of its directory's parent
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# (after the path above)
from ddpkit import sweeplines
from ddpkit.contract import (
    EXIT_DIVERGED,
    EXIT_STOPPED,
    EXIT_USAGE,
    JobEnv,
    JobPaths,
    continuing_args,
    job_fields,
    read_codes,
    requeue_job,
    show_job,
    this_job,
    unix_time,
)
from ddpkit.supervisor.outcome import Outcome, nodes_to_go_on_with, read_world_sizes, settle
from ddpkit.supervisor.settings import PROG, JobError, Settings, ranks_python, read_settings
from ddpkit.supervisor.snapshot import code_copy, take_snapshot
from ddpkit.supervisor.step import (
    flight_recorder,
    master_address,
    preflight,
    resubmit_line,
    step_command,
    task,
    training_args,
)

ENTRY = os.path.join("ddpkit", "supervisor", "main.py")  # this file, in the project and in a copy of its code
REQUEUE_WAIT = 120  # seconds to wait for Slurm to end this job after a requeue, before the END line


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).astimezone().isoformat(timespec="seconds")


class Supervisor:
    """The job from its first line to its exit code, after run_training.sbatch."""

    def __init__(self, s: Settings, info: str, task_file: str):
        self.s, self.info, self.fields, self.task_file = s, info, job_fields(info), task_file
        self.monitor = None  # type: Optional[subprocess.Popen]
        self.end_time = None  # type: Optional[int]
        self.resubmit = ""  # the beginning of the sbatch line that continues the run (resubmit_line)

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
        os.environ[JobEnv.EXIT_DIR] = exit_dir
        status = self.run_step(step_command(s, self.task_file, [s.script] + s.args + ["--check"], "srun"))
        status = read_codes(exit_dir).get(0, status)
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
        env[JobEnv.EXIT_DIR] = s.job_dir
        # Rank 0 leaves JobPaths.REQUEUE when the ranks stopped on a signal that asks for a
        # requeue; the supervisor then requeues the job, on the host (a container may have no scontrol).
        env[JobEnv.REQUEUE_SIGNAL] = s.signal
        # The job's times as scontrol gave them, for rank 0's stop before the time limit; in Unix
        # seconds too (scontrol prints local time, and a container's time zone may differ).
        env.pop(JobEnv.JOB_TIMES, None)
        env.pop(JobEnv.JOB_INFO, None)
        if self.info:
            env[JobEnv.JOB_INFO] = self.info
        start, self.end_time = unix_time(self.fields.get("StartTime", "")), unix_time(self.fields.get("EndTime", ""))
        if start and self.end_time:
            env[JobEnv.JOB_TIMES] = f"{start} {self.end_time}"
        env[JobEnv.RESUBMIT] = self.resubmit = resubmit_line(s, env, self.fields)
        shutil.rmtree(s.job_dir, ignore_errors=True)
        signal.signal(getattr(signal, "SIG" + s.signal), self.forward_signal)
        script = os.path.join(code, os.path.basename(s.script)) if code else s.script
        requeued = int(env.get("SLURM_RESTART_COUNT") or 0) > 0
        attempts = s.max_restarts + 1
        for attempt in range(1, attempts + 1):
            train = training_args(s, script, first_start=attempt == 1 and not requeued)
            for name in os.listdir(s.job_dir) if os.path.isdir(s.job_dir) else []:
                if JobPaths.is_rank_code(name) or name == JobPaths.REQUEUE:
                    os.remove(os.path.join(s.job_dir, name))
            env[JobEnv.ATTEMPT] = f"{attempt}/{attempts}"
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
        if outcome.status == EXIT_STOPPED and os.path.exists(os.path.join(s.job_dir, JobPaths.REQUEUE)):
            with open(os.path.join(s.job_dir, JobPaths.REQUEUE)) as file:
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
        if not shutil.which("scontrol"):
            print(f"could not requeue Slurm job {s.job} (no scontrol on the PATH of the batch step)")
            return
        before = f" ({self.end_time - int(time.time())} s before the job's time limit)" if self.end_time else ""

        def about_to_requeue() -> None:
            signal.signal(getattr(signal, "SIG" + s.signal), signal.SIG_DFL)  # (Slurm's own signal now ends this job)
            try:
                os.remove(os.path.join(s.run_dir, JobPaths.EXIT_CODE))  # (not "stopped" while the job waits to run again)
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
        if not os.path.exists(os.path.join(s.job_dir, JobPaths.RUN_DIR_TAKEN)):
            try:
                os.makedirs(s.run_dir, exist_ok=True)
                with open(os.path.join(s.run_dir, JobPaths.EXIT_CODE), "w") as file:
                    file.write(f"{status}\n")
            except OSError:
                pass
        if status not in (0, EXIT_USAGE):
            why = "to continue from the last checkpoint with a lower --lr" if status == EXIT_DIVERGED else \
                "to continue from the newest checkpoint"
            try:
                with open(os.path.join(s.job_dir, JobPaths.CONTINUE_COMMAND)) as file:
                    line = file.read().strip()
            except OSError:
                line = ""
            if not line:  # rank 0 ended before it wrote it: the options a restart would get
                given = sweeplines.quote_words(continuing_args(s.sweep_args + s.args, s.run_dir))
                line = f"{self.resubmit} {given}".rstrip()
            print(f"{why}, from {shlex.quote(os.environ.get('SLURM_SUBMIT_DIR', os.getcwd()))}: {line}")
        sys.stdout.flush()
        return status


def supervise(project: str, batch_file: str, environment: str, args: List[str]) -> int:
    env = os.environ
    if not env.get("SLURM_JOB_ID"):
        raise JobError(f"not inside a Slurm job. Submit it: sbatch {PROG} [options]")
    info = show_job(this_job(env))  # the one `scontrol show job` of the job
    s = read_settings(env, project=project, batch_file=batch_file, environment=environment, args=args)
    copy = code_copy(s)
    running_copy = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) == copy
    # (a copy without this file was made by an older version of it: this job copies its code again)
    requeued = int(env.get("SLURM_RESTART_COUNT") or 0) > 0 and os.path.isfile(os.path.join(copy, ENTRY)) and not s.check
    if requeued and not running_copy:  # a requeue of this job runs its copy, this supervisor included
        sys.stdout.flush()
        os.execv(sys.executable, [sys.executable, os.path.join(copy, ENTRY)] + sys.argv[1:])
    s.python = ranks_python(s, env)
    found = preflight(s)  # (before START and the copy: a job whose ranks cannot run is one line)
    code = "" if s.check else copy if requeued else take_snapshot(s)
    supervisor = Supervisor(s, info, os.path.join(code or project, ENTRY))
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
