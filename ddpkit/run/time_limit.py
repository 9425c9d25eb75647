"""The job's time limit: when Slurm ends this job, the stop --stop-before minutes ahead of it
(a checkpoint, then a requeue, with or without a --signal from Slurm), and whether the run
fits in the time that is left, or how many requeues (or jobs chained by CHAIN) it takes.

The end time comes from SLURM_JOB_END_TIME where Slurm sets it (23.02 and later); else
from `scontrol show job`, which the job's supervisor (ddpkit/supervisor/) runs once on the
host (a container may have no scontrol) and passes on as JobEnv.JOB_INFO, with its times in
Unix seconds as JobEnv.JOB_TIMES (scontrol prints local time, and a container's time zone
may differ from the host's). Without that line rank 0 runs scontrol once itself: whether the job may
be requeued (a batch job with Requeue=1) comes from the line alone, and a run that does not
know promises no requeue. Whether it has a limit at all is one rule for every source
(job_times).
Only rank 0 watches the clock: the ranks' per-step agreement carries its stop to the rest.

Standard library only, like launch.py."""

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from ddpkit.job.contract import JobEnv, chains_left, job_fields, requeue_allowed, show_job, unix_time

# Seconds left for what follows the stop when nothing slower was measured: the step in
# flight, the save, the ranks' exit and the requeue, with room for a busy file system.
BASE_MARGIN = 60.0
NO_LIMIT = 365 * 24 * 3600.0  # Slurm gives a job without a time limit an end a year away


@dataclass(frozen=True)
class JobTimes:
    """When this run of the Slurm job started and when Slurm ends it (Unix seconds)."""
    start: float
    end: float
    requeue: bool | None = None  # whether Slurm may requeue it (--requeue); None: not known
    chain: int = 0  # where Slurm does not, the jobs run_training.sbatch's CHAIN may still submit to continue the run

    @property
    def limit(self) -> float:
        return self.end - self.start


def times_from_job_info(info: str) -> JobTimes | None:
    """The times in one `scontrol show job -o` line; None for a job without a time limit."""
    fields = job_fields(info)
    return job_times(fields, unix_time(fields.get("StartTime", "")), unix_time(fields.get("EndTime", "")))


def job_times(fields: Mapping[str, str], start: float | None, end: float | None) -> JobTimes | None:
    """The one rule, whichever way the times came, for 'no time limit' (None): TimeLimit=UNLIMITED,
    or an end a year away or not after the start. TimeLimit=Partition_Limit is a limit: the
    partition's MaxTime, real when finite; the end time says which."""
    if start is None or end is None or fields.get("TimeLimit") == "UNLIMITED" or not start < end < start + NO_LIMIT:
        return None
    return JobTimes(start, end, requeue_allowed(fields)[0])


def unix_times(text: str) -> tuple[float, float] | None:
    """'START END' in Unix seconds, or None."""
    parts = text.split()
    return (float(parts[0]), float(parts[1])) if len(parts) == 2 and all(p.isdigit() for p in parts) else None


def read_job_times(env: Mapping[str, str], job_id: str) -> JobTimes | None:
    """This job's times, or None outside Slurm, for a job without a time limit, or when
    scontrol cannot say (it is asked once, by the contract's show_job); with the CHAIN the
    job's supervisor passed on."""
    if not job_id:
        return None
    info = env.get(JobEnv.JOB_INFO, "")
    given = (unix_times(f"{env.get('SLURM_JOB_START_TIME', '')} {env.get('SLURM_JOB_END_TIME', '')}")
             or unix_times(env.get(JobEnv.JOB_TIMES, "")))
    if not info:  # (with Slurm's own times too: only the line says whether the job may be requeued)
        info = show_job(job_id)
    text = info.splitlines()[0] if info.strip() else ""
    # Unix seconds win over the line's times, which a site's SLURM_TIME_FORMAT may change.
    times = job_times(job_fields(text), *given) if given else times_from_job_info(text)
    return replace(times, chain=chains_left(env)) if times else None


def duration(seconds: float) -> str:
    """2 h, 1 h 05 min, 12 min, 40 s: as a person says it, to the minute above 90 s."""
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f} s"
    minutes = round(seconds / 60)
    if minutes < 60:
        return f"{minutes} min"
    return f"{minutes // 60} h {minutes % 60:02d} min" if minutes % 60 else f"{minutes // 60} h"


def slurm_duration(seconds: float) -> str:
    """A --time value that is at least `seconds`, rounded up to a whole minute below an hour,
    to 10 minutes below 10 hours, else to 30 minutes: 0:06:00, 2:30:00, 1-04:00:00."""
    unit = 60 if seconds < 3600 else 600 if seconds < 36000 else 1800
    minutes = math.ceil(seconds / unit) * unit // 60
    days, hours, minutes = minutes // 1440, minutes % 1440 // 60, minutes % 60
    return f"{days}-{hours:02d}:{minutes:02d}:00" if days else f"{hours}:{minutes:02d}:00"


class TimeLimit:
    """Rank 0's watch on the job's end. `up()` says when to stop: --stop-before minutes ahead
    of it, or with --stop-before auto, one minute plus twice the slowest checkpoint save and
    twice the time of a step (the stop lands one step after it is asked for), as measured
    so far. The clock is a parameter so that tests can move time."""

    def __init__(self, times: JobTimes | None, stop_before: str, clock: Callable[[], float] = time.time):
        self.times, self.clock = times, clock
        self.fixed = None if stop_before == "auto" else float(stop_before) * 60
        self.slowest_save = self.step_seconds = self.last_step = 0.0
        self.started = clock()  # when this process began training (its start-up is behind it)
        self.watching = times is not None and self.fixed != 0

    def margin(self) -> float:
        if self.fixed is not None:
            return self.fixed
        return BASE_MARGIN + 2 * self.slowest_save + 2 * self.step_seconds

    def left(self) -> float:
        """Seconds until Slurm ends the job."""
        return self.times.end - self.clock() if self.times else math.inf

    def up(self) -> bool:
        return self.watching and self.left() <= self.margin()

    def saved(self, seconds: float) -> None:
        self.slowest_save = max(self.slowest_save, seconds)

    def stepped(self, now: float) -> None:
        """After each step (rank 0): a running average of the time between steps."""
        if self.last_step:
            between = now - self.last_step
            self.step_seconds = between if not self.step_seconds else 0.9 * self.step_seconds + 0.1 * between
        self.last_step = now

    def start_line(self) -> str:
        """What the run does about the time limit, said once as training starts ("" without one).
        A job that starts with less than the margin left does not stop for it at all: it would
        save and requeue at its first step, again and again."""
        if self.times is None:
            return ""
        left, margin = self.left(), self.margin()
        if self.fixed == 0:
            return f"Slurm ends this job in {duration(left)}; --stop-before 0: it does not stop for that by itself"
        if left <= margin:
            self.watching = False
            return (f"warning: Slurm ends this job in {duration(left)}, less than the {duration(margin)} it stops before "
                    "the end (--stop-before): it does not stop for the time limit; ask for a longer --time, or pass a "
                    "smaller --stop-before")
        return (f"Slurm ends this job in {duration(left)}: it saves and stops {duration(margin)} before that "
                f"(--stop-before {'auto' if self.fixed is None else f'{self.fixed / 60:g}'}), if no signal comes first")

    def chain_said(self, jobs: int) -> str:
        """What continues a job that Slurm does not requeue, which `jobs` more jobs would finish:
        the line it prints, or the jobs CHAIN submits, as many as it may."""
        chain = self.times.chain if self.times else 0
        if not chain:
            return " (the line it prints continues it)"
        if jobs <= chain:
            return f": it chains the job that continues it, about {jobs} more job{'s' if jobs > 1 else ''} (CHAIN={chain})"
        return (f": it chains the job that continues it, {chain} more job{'s' if chain > 1 else ''} (CHAIN={chain}) of "
                f"the about {jobs} it takes: the last prints the line that continues the run, and CHAIN={jobs} would "
                "chain them all")

    def fit_line(self, seconds_per_step: float, steps_left: int) -> str:
        """After the first epoch: the time the rest of the run needs at this speed (evaluations
        and checkpoints included), and whether it fits in what is left of the job."""
        needed = seconds_per_step * steps_left
        if self.times is None:
            return f"about {duration(needed)} to finish at this speed"
        left, margin = self.left(), self.margin()
        if needed <= left - margin:
            return f"about {duration(needed)} to finish at this speed; the job ends in {duration(left)}: it fits"
        in_one = slurm_duration(1.1 * (self.clock() - self.times.start + needed + margin))
        start_up = max(0.0, self.started - self.times.start)
        per_job = self.times.limit - start_up - margin  # the training time of each run of the job
        head = f"needs about {duration(needed)} at this speed, the job ends in {duration(left)}"
        if per_job <= 0:
            return f"{head}: its time limit leaves no time to train after start-up; --time={in_one} would do it in one"
        requeues = math.ceil((needed - max(0.0, left - margin)) / per_job)  # (or jobs chained)
        if not self.times.requeue:  # (not known to be requeued: a requeue must not be promised)
            head += f": it saves and stops {duration(margin)} before the end, and is not requeued"
            return f"{head}{self.chain_said(requeues)}; --time={in_one} would do it in one"
        return (f"{head}: it will be requeued about {'once' if requeues == 1 else f'{requeues} times'}; "
                f"--time={in_one} would do it in one")
