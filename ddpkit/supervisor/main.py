"""The Slurm job's supervisor: run_training.sbatch hands the job over to it once the site's
setup has run and the Python environment is active. It reads the settings (environment
variables, listed in docs/clusters.md: settings.py), keeps a copy of the code the job runs
(snapshot.py), checks the ranks' interpreter (PREFLIGHT), starts the ranks as one srun step
or one torchrun per node (step.py), decides from their exit codes what happened
(outcome.py), starts the step again after a killed rank or a lost peer (on the nodes left,
with MIN_NODES, when a node was lost; without a node that two failures were pinned on,
nodes.py), requeues the job after a stop that asks for it (or,
where Slurm does not, submits the job that continues the run: CHAIN), and prints the line
that continues the run. What it and the ranks must agree on is
ddpkit/job/contract.py; no rank imports this package.

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
from typing import Dict, List, Optional, Tuple  # noqa: F401 (Tuple is in a type comment, which ruff does not read)

if __name__ == "__main__" and not __package__:  # run as a file: ddpkit is the parent of its directory's parent
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# (after the path above)
from ddpkit.job import sweeplines
from ddpkit.job.contract import (
    EXIT_BUG,
    EXIT_DIVERGED,
    EXIT_STOPPED,
    EXIT_USAGE,
    SCONTROL_TIMEOUT,
    JobEnv,
    JobPaths,
    continuing_args,
    job_fields,
    last_line,
    read_codes,
    requeue_job,
    run,
    show_job,
    this_job,
    unix_time,
)
from ddpkit.supervisor.nodes import (
    Held,
    Step,
    Usable,  # noqa: F401 (in a type comment)
    cannot_keep_off_line,
    exclusion_note,
    failure_pins,
    first_step,
    job_usable,
    kept_off,
    leave_out_line,
    left_out,
    left_out_by_jobs,
    next_step,
    of_one_step,
    ranks_on_two_nodes,
    read_lines,
    read_pins,
    record_pins,
    run_failure_line,
    step_nodes,
    step_pins,
    whole_job,
    with_excluded,
)
from ddpkit.supervisor.outcome import Outcome, read_world_sizes, settle
from ddpkit.supervisor.settings import PROG, JobError, Settings, ranks_python, read_settings
from ddpkit.supervisor.snapshot import code_copy, take_snapshot
from ddpkit.supervisor.step import (
    chained_submission,
    flight_recorder,
    hostnames,
    master_address,
    preflight,
    resubmit_line,
    step_command,
    task,
    training_args,
)

ENTRY = os.path.join("ddpkit", "supervisor", "main.py")  # this file, in the project and in a copy of its code
REQUEUE_WAIT = 120  # seconds to wait for Slurm to end this job after a requeue, before the END line
SBATCH_TIMEOUT = 60.0  # seconds for the sbatch that chains the next job (a busy controller answers slowly)
# The states of a job that Slurm will still run, or runs: a job CHAIN submitted in one of them
# already continues the run (`scontrol show job`'s JobState).
QUEUED = ("PENDING", "CONFIGURING", "RUNNING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED")


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).astimezone().isoformat(timespec="seconds")


class Supervisor:
    """The job from its first line to its exit code, after run_training.sbatch."""

    def __init__(self, s: Settings, info: str, task_file: str):
        self.s, self.info, self.fields, self.task_file = s, info, job_fields(info), task_file
        self.monitor = None  # type: Optional[subprocess.Popen]
        self.end_time = None  # type: Optional[int]
        self.resubmit = ""  # the beginning of the sbatch line that continues the run (resubmit_line)
        self.handed_over = dict(os.environ)  # the job's environment before the supervisor sets any (for CHAIN)
        self.not_requeued = False  # a stop asked for a requeue, and Slurm did not make it
        # Slurm accepted the requeue but had not ended the job when the wait for it ran out: Slurm
        # runs this job again, which continues the run (the END line and the line after it say so).
        self.requeued = False
        # This job started again with nodes left out (a requeue that left them out): it is not
        # requeued a second time to leave a node out (each round might leave out another).
        self.left_out_at_start = False
        self.step = whole_job(s)  # the step to start next (nodes.py: first_step, next_step)
        # The nodes Slurm may place the job on (nodes.py's Usable, None where Slurm cannot say,
        # and why), asked once, when a node is first left out.
        self.usable = None  # type: Optional[Tuple[Optional[Usable], str]]
        self.excluded_at_start = None  # type: Optional[List[str]]  # (own_excluded's, once asked)

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
        env[JobEnv.CHAIN] = str(s.chain)  # (where Slurm does not requeue, rank 0's time estimate counts on the chain)
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
        if int(env.get("SLURM_RESTART_COUNT") or 0) > 0:  # (the world sizes the job's last start left, before they go)
            self.leave_out_from_the_start(read_world_sizes(s.job_dir, s.ntasks))
        shutil.rmtree(s.job_dir, ignore_errors=True)
        if chained_job(s.run_dir) == s.job:  # this job, chained to continue the run, runs now: no longer queued
            try:
                os.remove(s.paths.chained_job)
            except OSError:
                pass
        signal.signal(getattr(signal, "SIG" + s.signal), self.forward_signal)
        script = os.path.join(code, os.path.basename(s.script)) if code else s.script
        requeued = int(env.get("SLURM_RESTART_COUNT") or 0) > 0
        attempts = s.max_restarts + 1
        for attempt in range(1, attempts + 1):
            train = training_args(s, script, first_start=attempt == 1 and not requeued)
            for name in os.listdir(s.job_dir) if os.path.isdir(s.job_dir) else []:
                if JobPaths.is_rank_code(name) or name == JobPaths.REQUEUE or of_one_step(name):
                    os.remove(os.path.join(s.job_dir, name))
            env[JobEnv.ATTEMPT] = f"{attempt}/{attempts}"
            command = step_command(s, self.task_file, train, step=self.step)
            outcome = settle(self.run_step(command), read_codes(s.job_dir), self.step.ntasks)
            if outcome.note:
                print(outcome.note, flush=True)
            held = self.pin_failure(outcome, attempt) if outcome.retry else {}
            if not (s.launcher == "srun" and outcome.retry and attempt < attempts):
                break
            fewer = self.nodes_held_now(outcome, held)
            if fewer is None:
                break  # (too few nodes left: requeued, or it could not be)
            print(f"ATTEMPT {attempt + 1}/{attempts} after exit {outcome.status} ({outcome.why}): starting the step "
                  f"again in this allocation{fewer}; it resumes from the newest checkpoint", flush=True)
        self.stop_monitor()
        if outcome.status == EXIT_STOPPED and os.path.exists(s.paths.requeue):
            with open(s.paths.requeue) as file:
                self.requeue(file.read().strip())
        return self.end(outcome, attempt if s.launcher == "srun" else attempts)

    def nodes_held_now(self, outcome: Outcome, fields: Optional[Dict[str, str]] = None) -> Optional[str]:
        """After a step that a restart may fix: the step that comes next (nodes.py's next_step),
        from the nodes Slurm still gives the job (`fields`: its scontrol fields, when they were
        just read), less those the job leaves out. What the ATTEMPT line adds ("" for the same
        step); None where no step comes next: too few nodes are left, and the job was requeued
        (or could not be)."""
        s = self.s
        if not fields:
            fields = job_fields(show_job(s.job)) if s.nodes > 1 else {}
        count = re.match(r"\d+", fields.get("NumNodes", ""))
        if not count:
            return ""
        bad = self.left_out()
        held = Held(int(count.group()), fields.get("NodeList", "?"),
                    self.nodes_of(fields.get("NodeList", "")) if bad else [])
        after = next_step(s, self.step, held, left=bad, world_sizes=read_world_sizes(s.job_dir, self.step.ntasks),
                          requeued_to_leave_out=self.left_out_at_start, kept_off=self.kept_off)
        if after.requeue:
            self.stop_monitor()
            self.requeue(f"exit {outcome.status}: {after.why}")
            outcome.why += f"; then {after.why}" + ("" if self.requeued else ", and it was not requeued")
        elif after.step is None:
            outcome.why += f"; then {after.why}"
        else:
            self.go_on_with(after.step)
        return after.said if after.step else None

    def go_on_with(self, step: Step) -> None:
        """The next steps are `step`; the rendezvous moves where it says (MASTER_ADDR, which the
        ranks inherit)."""
        if step.master != self.step.master:
            os.environ["MASTER_ADDR"] = master_address({"SLURM_JOB_NODELIST": step.master})
        self.step = step

    # ----------------------------------------------------------------------------- the nodes left out

    def leave_out_from_the_start(self, world_sizes: List[int]) -> None:
        """A requeued job leaves out the nodes its record leaves out from its first step
        (nodes.py's first_step), and is not requeued a second time to leave a node out."""
        bad = self.left_out()
        if not bad:
            return
        self.left_out_at_start = True
        first = first_step(self.s, nodes=self.nodes_of(os.environ.get("SLURM_JOB_NODELIST", "")), left=bad,
                           world_sizes=world_sizes)
        self.go_on_with(first.step)
        if first.said:
            print(first.said, flush=True)

    def node_record(self) -> str:
        return self.s.paths.node_failures

    def left_out(self) -> List[str]:
        """The nodes this job leaves out: those two of its failures were pinned on (nodes.py)."""
        return left_out(read_pins(self.node_record()))

    def nodes_of(self, nodelist: str) -> List[str]:
        """The nodes of a node list, [] when scontrol cannot say."""
        try:
            return hostnames(nodelist)
        except (OSError, subprocess.SubprocessError):
            return []

    def pin_failure(self, outcome: Outcome, attempt: int) -> Dict[str, str]:
        """Pin a failure that a restart may fix on the nodes it names (nodes.py) and on those the
        job lost, in the job's record; a node pinned twice is left out from now on, which one
        line says, and which the line that continues the run excludes. The job's scontrol
        fields, as read now ({} on one node)."""
        s = self.s
        fields = job_fields(show_job(s.job)) if s.nodes > 1 else {}
        step = read_lines(s.paths.nodes)
        if not step:  # (the ranks never met: the nodes the step was given)
            step = step_nodes(self.step, self.nodes_of(os.environ.get("SLURM_JOB_NODELIST", "")))
        pins = failure_pins(s.job_dir, outcome, step)
        held = self.nodes_of(fields.get("NodeList", "")) if fields else []
        pins = step_pins(pins, step=step, held=held, job_nodes=self.nodes_of(os.environ.get("SLURM_JOB_NODELIST", "")))
        requeues = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
        failure = f"attempt {attempt}{f' after {requeues} requeue(s)' if requeues else ''}, exit {outcome.status}"
        before, record = self.left_out(), read_pins(self.node_record())
        try:
            pinned = record_pins(self.node_record(), pins, failure)
        except OSError as err:
            print(f"could not record which node the failure was pinned on ({err})", flush=True)
            return fields
        wandering = ranks_on_two_nodes(record)
        for rank, nodes in ranks_on_two_nodes(pinned).items():
            if rank not in wandering:
                print(run_failure_line(rank, nodes), flush=True)
        new = [node for node in left_out(pinned) if node not in before]
        kept = self.kept_off() if new else []
        usable = self.usable[0] if self.usable else None
        for node in new:
            print(leave_out_line(node, pinned[node]) if node in kept or not usable else
                  cannot_keep_off_line(node, failures=pinned[node], usable=usable, excluded=self.own_excluded() + kept,
                                       count=s.nodes), flush=True)
        if set(new) & set(kept):
            self.exclude_in_line([node for node in new if node in kept])
        return fields

    def own_excluded(self) -> List[str]:
        """The nodes the job's own ExcNodeList named as it started (yours, and those a requeue added),
        listed (scontrol show hostnames) once."""
        if self.excluded_at_start is None:
            given = job_fields(self.info).get("ExcNodeList", "")
            self.excluded_at_start = self.nodes_of(given) if given not in ("", "(null)") else []
        return self.excluded_at_start

    def kept_off(self) -> List[str]:
        """The nodes left out that Slurm can keep the job off (nodes.py's kept_off): those its
        requeue and the line that continues the run exclude."""
        bad = self.left_out()
        if bad and self.usable is None:
            fields = dict({"Partition": os.environ.get("SLURM_JOB_PARTITION", "")}, **job_fields(self.info))
            self.usable = job_usable(fields)
            if self.usable[0] is None:
                print(f"could not ask Slurm which nodes Slurm job {self.s.job} may run on ({self.usable[1]}); it leaves "
                      f"{','.join(bad)} out of its requeue and of the line that continues the run, as before", flush=True)
        return kept_off(bad, self.usable[0], self.own_excluded(), self.s.nodes) if bad and self.usable else []

    def exclude_in_line(self, nodes: List[str]) -> None:
        """The line that continues the run excludes `nodes` too: the one the ranks get, and rank
        0's line of the step that ended."""
        s, old = self.s, self.resubmit
        self.fields["ExcNodeList"] = with_excluded(self.fields.get("ExcNodeList", ""), nodes)
        os.environ[JobEnv.RESUBMIT] = self.resubmit = resubmit_line(s, os.environ, self.fields)
        path = s.paths.continue_command
        line = " ".join(read_lines(path))
        if line.startswith(old + " "):
            try:
                with open(path, "w") as file:
                    file.write(self.resubmit + line[len(old):] + "\n")
            except OSError as err:  # (the job goes on: the line after END then lacks the --exclude)
                print(f"could not add --exclude={','.join(nodes)} to the line that continues the run ({err})",
                      flush=True)

    def exclude_left_out(self) -> None:
        """Right after a requeue, while the job waits to run again: Slurm keeps it off the nodes
        it left out (a job's ExcNodeList outlives its requeue). Slurm changes the ExcNodeList of
        a pending job alone ("Job is no longer pending execution" before the requeue); the
        SIGTERM with which it ends this job meanwhile is held off (SIGKILL follows KillWait
        seconds later, 30 by default)."""
        s, kept = self.s, self.kept_off()
        if not kept:
            return
        excluded = with_excluded(self.fields.get("ExcNodeList", ""), kept)
        try:
            result = run(["scontrol", "update", f"JobId={s.job}", f"ExcNodeList={excluded}"], SCONTROL_TIMEOUT)
            why = (last_line(result.stderr) or f"exit {result.returncode}") if result.returncode != 0 else ""
        except (OSError, subprocess.SubprocessError) as err:
            why = str(err)
        if why:
            print(f"could not keep Slurm job {s.job} off {excluded} (scontrol update: {why}); it may run there again, "
                  "and leave them out again", flush=True)

    def requeue(self, after: str) -> None:
        """Requeue the job (the ranks saved and stopped on a signal that asks for it, or too few
        nodes are left). Slurm then ends this process too, and runs the job again with the same
        id, on as many nodes as it asked for."""
        s = self.s
        if not shutil.which("scontrol"):
            print(f"could not requeue Slurm job {s.job} (no scontrol on the PATH of the batch step)")
            self.not_requeued = True
            return
        before = f" ({self.end_time - int(time.time())} s before the job's time limit)" if self.end_time else ""

        held_off = []  # (SIGTERM's handler, while it is held off)
        kept = self.kept_off()  # (asked before the requeue, after which Slurm soon ends the job)

        def about_to_requeue() -> None:
            signal.signal(getattr(signal, "SIG" + s.signal), signal.SIG_DFL)  # (Slurm's own signal now ends this job)
            if kept:  # (until the nodes left out are excluded, right after the requeue)
                held_off.append(signal.signal(signal.SIGTERM, signal.SIG_IGN))
            try:
                os.remove(s.paths.exit_code)  # (not "stopped" while the job waits to run again)
            except OSError:
                pass

        requeued = requeue_job(s.job, after, before, about_to_requeue=about_to_requeue)
        if requeued:
            self.exclude_left_out()
        if held_off:
            signal.signal(signal.SIGTERM, held_off[0])
        if requeued:
            time.sleep(REQUEUE_WAIT)  # (Slurm ends this process now; past this, the END line tells)
            self.requeued = True
        else:
            self.not_requeued = True

    def end(self, outcome: Outcome, attempts: int) -> int:
        """The job that continues the run, when CHAIN asks for it and Slurm did not requeue this
        one after a stop that needed it; the END line, the job's outcome in RUN_DIR/exit-code
        (for sweep.py summary and whoever reads the run directory), and the line that continues
        the run, or where a job already continues it (the one CHAIN submitted, or this one,
        requeued), that job (the line, run again, would queue a second one)."""
        s, status = self.s, outcome.status
        line = self.continue_line() if status not in (0, EXIT_USAGE) else ""
        # Not after a finished run (0) nor a failure that a new job would repeat (1, 2, 3).
        chains = self.not_requeued and s.chain and status not in (0, EXIT_BUG, EXIT_USAGE, EXIT_DIVERGED)
        queued = self.queued_successor() if chains else ""
        next_job = self.chain(line) if chains and not queued else ""
        said = how_it_ended(outcome=outcome, attempts=attempts, max_restarts=s.max_restarts, next_job=next_job,
                            requeued=self.requeued)
        print(f"END {now()} job={os.environ['SLURM_JOB_ID']} exit={status}{said}", flush=True)
        # Not when another job holds the run directory, nor once requeued: their outcome is still to come.
        if not self.requeued and not os.path.exists(s.paths.run_dir_taken):
            try:
                os.makedirs(s.run_dir, exist_ok=True)
                with open(s.paths.exit_code, "w") as file:
                    file.write(f"{status}\n")
            except OSError:
                pass
        continued_by = s.job if self.requeued else next_job or queued
        if continued_by:
            continues = "(this job, requeued) continues the run once Slurm runs it again" if self.requeued else \
                "already continues the run"
            print(f"nothing to submit: Slurm job {continued_by} {continues} (squeue --job {continued_by})")
        elif line:
            why = "to continue from the last checkpoint with a lower --lr" if status == EXIT_DIVERGED else \
                "to continue from the newest checkpoint"
            print(f"{why}, from {shlex.quote(submit_dir())}: {line}")
            self.say_exclusions(line)
        sys.stdout.flush()
        return status

    def say_exclusions(self, line: str) -> None:
        """After the line that continues the run: which nodes of its --exclude a job of the run
        left out, which are yours, and how to take one back (nodes.py's exclusion_note)."""
        try:
            value = next((word.split("=", 1)[1] for word in shlex.split(line) if word.startswith("--exclude=")), "")
        except ValueError:
            value = ""
        note = exclusion_note(value, self.nodes_of(value), left_out_by_jobs(self.s.run_dir, self.s.job)) if value else ""
        if note:
            print(note)

    def continue_line(self) -> str:
        """The sbatch line that continues the run: rank 0's, else the options a restart would get."""
        s = self.s
        try:
            with open(s.paths.continue_command) as file:
                line = file.read().strip()
        except OSError:
            line = ""
        if not line:  # rank 0 ended before it wrote it
            given = sweeplines.quote_words(continuing_args(s.sweep_args + s.args, s.run_dir))
            line = f"{self.resubmit} {given}".rstrip()
        return line

    def queued_successor(self) -> str:
        """The job CHAIN submitted earlier (RUN_DIR/chained-job) while Slurm still holds it,
        said in one line: it already continues the run, and no second job is chained; "" when
        there is none."""
        s = self.s
        queued = chained_job(s.run_dir)
        state = job_fields(show_job(queued)).get("JobState", "") if queued and queued != s.job else ""
        if state not in QUEUED:
            return ""
        print(f"not chaining another job: Slurm job {queued} ({state}) already continues the run "
              f"({s.paths.chained_job})", flush=True)
        return queued

    def chain(self, line: str) -> str:
        """CHAIN: submit `line`, the sbatch line that continues the run (its CHAIN one fewer), as a
        job that starts once this one has ended, and record its id in RUN_DIR/chained-job. The
        new job's id, said in one line; "" and one line that says why, where sbatch fails."""
        s = self.s
        try:
            command, env = chained_submission(line, s.job, self.handed_over)
            result = run(command, SBATCH_TIMEOUT, env, cwd=submit_dir())
            why = last_line(result.stderr) or f"exit {result.returncode}, printed '{last_line(result.stdout)}'"
        except (OSError, subprocess.SubprocessError, ValueError) as err:
            result, why = None, str(err)
        new = last_line(result.stdout).partition(";")[0] if result and result.returncode == 0 else ""  # (ID;CLUSTER)
        if not re.fullmatch(r"[0-9]+", new):
            print(f"could not chain the job that continues the run (sbatch: {why}); submit the line below yourself",
                  flush=True)
            return ""
        try:
            with open(s.paths.chained_job, "w") as file:
                file.write(new + "\n")
        except OSError:
            pass
        print(f"Slurm did not requeue job {s.job}: chained Slurm job {new}, which continues the run once this one "
              f"has ended (sbatch --dependency=afterany:{s.job}, CHAIN={s.chain - 1})", flush=True)
        return new


def how_it_ended(*, outcome: Outcome, attempts: int, max_restarts: int, next_job: str, requeued: bool) -> str:
    """What the END line says after the exit code: after a failure a restart may fix, whether
    the restarts ran out (gave up) or the job ended with some unused (its nodes: requeued, or
    not); and what continues the run: this job, requeued (Slurm accepted it and runs the job
    again), or the job CHAIN submitted."""
    said = ""
    if outcome.retry and attempts > max_restarts:
        said = f" gave up after {attempts} attempts ({outcome.why}; MAX_RESTARTS={max_restarts})"
    elif outcome.retry:
        said = f" ended after {attempts} of {max_restarts + 1} attempts ({outcome.why})"
    if requeued:
        return said + " requeued: Slurm accepted it and runs this job again, which continues the run"
    return said + (f" chained: Slurm job {next_job} continues the run" if next_job else "")


def submit_dir() -> str:
    """Where the job was submitted from, which the line that continues the run is run from."""
    return os.environ.get("SLURM_SUBMIT_DIR", os.getcwd())


def chained_job(run_dir: str) -> str:
    """The id of the job CHAIN last submitted to continue the run (RUN_DIR/chained-job), or ""."""
    try:
        with open(JobPaths(run_dir).chained_job) as file:
            return file.read().strip()
    except OSError:
        return ""


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
