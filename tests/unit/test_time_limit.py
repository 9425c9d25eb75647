"""ddpkit/run/time_limit.py: the job's times read from Slurm's variables, from the line that
run_training.sbatch passes on or from scontrol itself; the stop --stop-before minutes
ahead of the end (auto: a minute plus twice the slowest save and step); the start line and
the estimate after the first epoch, on a clock the test moves. The real thing, a job that
saves and requeues itself before its time limit, is
tests/cluster/mostly_waiting/test_time_limit_on_slurm.py.

    python -m pytest tests/unit/test_time_limit.py
"""

import datetime
import math
import os
import subprocess

from ddpkit.job import contract
from ddpkit.run.time_limit import JobTimes, TimeLimit, duration, read_job_times, slurm_duration, times_from_job_info

# One line of `scontrol show job -o` as Slurm 22.05 prints it for `sbatch --time=2` (shortened).
INFO = ("JobId=7 JobName=mnist-ddp UserId=root(0) JobState=RUNNING Reason=None Dependency=(null) Requeue=1 Restarts=0 "
        "BatchFlag=1 Reboot=0 ExitCode=0:0 RunTime=00:00:00 TimeLimit=00:02:00 TimeMin=N/A "
        "SubmitTime=2026-11-24T13:15:52 EligibleTime=2026-11-24T13:15:52 AccrueTime=2026-11-24T13:15:52 "
        "StartTime=2026-11-24T13:15:52 EndTime=2026-11-24T13:17:52 Deadline=N/A SuspendTime=None "
        "Partition=local NodeList=vm Command=/home/u/run_training.sbatch WorkDir=/home/u")
START = datetime.datetime(2026, 11, 24, 13, 15, 52).timestamp()


def test_the_times_of_a_scontrol_line():
    assert times_from_job_info(INFO) == JobTimes(START, START + 120, requeue=True)
    assert times_from_job_info(INFO.replace("Requeue=1", "Requeue=0")).requeue is False
    # salloc: an interactive allocation, which Slurm never requeues
    assert times_from_job_info(INFO.replace("BatchFlag=1", "BatchFlag=0")).requeue is False
    unlimited = INFO.replace("TimeLimit=00:02:00", "TimeLimit=UNLIMITED").replace("EndTime=2026-11-24T13:17:52", "EndTime=Unknown")
    assert times_from_job_info(unlimited) is None
    assert times_from_job_info(INFO.replace("TimeLimit=00:02:00", "TimeLimit=UNLIMITED")) is None  # (whatever its end)
    assert times_from_job_info("") is None


def test_where_the_times_come_from(monkeypatch):
    # Slurm's own variables first (23.02 and later), then the batch file's Unix times, then
    # its scontrol line's local times; whether it requeues comes from that line. None
    # outside a job, or for a job without a limit.
    env = {"SLURM_JOB_START_TIME": "1000", "SLURM_JOB_END_TIME": "4600", "MNIST_DDP_JOB_INFO": INFO,
           "MNIST_DDP_JOB_TIMES": "2000 2120"}
    assert read_job_times(env, "7") == JobTimes(1000.0, 4600.0, requeue=True)
    no_line = subprocess.CompletedProcess([], 1, "", "")  # scontrol cannot say: whether it requeues is not known
    with monkeypatch.context() as scontrol:
        scontrol.setattr(contract, "run", lambda *a, **k: no_line)
        assert read_job_times({"SLURM_JOB_START_TIME": "1000", "SLURM_JOB_END_TIME": "4600"}, "7") == JobTimes(1000.0, 4600.0)
    batch = {"MNIST_DDP_JOB_INFO": INFO.replace("Requeue=1", "Requeue=0"), "MNIST_DDP_JOB_TIMES": "2000 2120"}
    assert read_job_times(batch, "7") == JobTimes(2000.0, 2120.0, requeue=False)  # (not the line's local times)
    assert read_job_times({"MNIST_DDP_JOB_INFO": INFO}, "7") == JobTimes(START, START + 120, requeue=True)
    assert read_job_times(env, "") is None
    a_year = {"SLURM_JOB_START_TIME": "1000", "SLURM_JOB_END_TIME": str(1000 + 365 * 24 * 3600)}
    assert read_job_times(a_year, "7") is None  # what Slurm gives a job without a time limit
    # A site's SLURM_TIME_FORMAT gives the line times of another form: the Unix times still count.
    other_form = INFO.replace("StartTime=", "StartTime=x").replace("EndTime=", "EndTime=x")
    assert read_job_times({"MNIST_DDP_JOB_INFO": other_form, "MNIST_DDP_JOB_TIMES": "2000 2120"}, "7") == (
        JobTimes(2000.0, 2120.0, requeue=True))
    assert read_job_times({"MNIST_DDP_JOB_INFO": other_form}, "7") is None
    unlimited = INFO.replace("TimeLimit=00:02:00", "TimeLimit=UNLIMITED")
    assert read_job_times({"MNIST_DDP_JOB_INFO": unlimited, "MNIST_DDP_JOB_TIMES": "2000 2120"}, "7") is None
    # No scontrol on the PATH (a container): no time limit known, no crash.
    monkeypatch.setenv("PATH", "/nonexistent")
    assert read_job_times({}, "7") is None


def test_durations_as_people_say_them_and_as_slurm_reads_them():
    assert [duration(s) for s in (40, 89, 90, 720, 3600, 3900, 7800)] == [
        "40 s", "89 s", "2 min", "12 min", "1 h", "1 h 05 min", "2 h 10 min"]
    assert [slurm_duration(s) for s in (61, 3000, 8580, 36001, 86400 * 1.5)] == [
        "0:02:00", "0:50:00", "2:30:00", "10:30:00", "1-12:00:00"]


class Clock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_the_stop_comes_a_minute_and_twice_the_slowest_save_and_step_before_the_end():
    clock = Clock(0.0)
    limit = TimeLimit(JobTimes(0.0, 3600.0), "auto", clock)
    assert "it saves and stops 60 s before that (--stop-before auto)" in limit.start_line()
    clock.now = 3539.0
    assert not limit.up()
    clock.now = 3540.0
    assert limit.up()
    limit.saved(10.0)  # a slow file system: the stop comes sooner
    limit.saved(2.0)
    clock.now = 3519.0
    assert not limit.up() and limit.margin() == 80.0
    for now in (100.0, 102.0, 104.0):  # steps of 2 s: the stop comes two steps sooner still
        limit.stepped(now)
    assert limit.margin() == 84.0
    clock.now = 3520.0
    assert limit.up()


def test_stop_before_in_minutes_and_0_for_never():
    clock = Clock(0.0)
    limit = TimeLimit(JobTimes(0.0, 3600.0), "1.5", clock)
    limit.saved(100.0)  # (a fixed --stop-before does not grow)
    clock.now = 3509.0
    assert not limit.up()
    clock.now = 3510.0
    assert limit.up()
    never = TimeLimit(JobTimes(0.0, 3600.0), "0", clock)
    assert "--stop-before 0: it does not stop for that by itself" in never.start_line()
    clock.now = 3599.0
    assert not never.up()
    assert not TimeLimit(None, "auto", clock).up() and TimeLimit(None, "auto", clock).start_line() == ""


def test_a_job_that_starts_with_less_time_than_the_margin_does_not_stop_at_its_first_step():
    clock = Clock(3570.0)  # e.g. requeued onto a shorter limit: it would save and requeue over and over
    limit = TimeLimit(JobTimes(0.0, 3600.0), "auto", clock)
    line = limit.start_line()
    assert line.startswith("warning: Slurm ends this job in 30 s, less than the 60 s it stops before the end")
    assert line.endswith("ask for a longer --time, or pass a smaller --stop-before")
    assert not limit.up()


def test_after_the_first_epoch_it_says_whether_the_run_fits():
    clock = Clock(300.0)
    assert TimeLimit(None, "auto", clock).fit_line(0.5, 240) == "about 2 min to finish at this speed"
    job = JobTimes(0.0, 3600.0, requeue=True)
    fits = TimeLimit(job, "auto", clock)
    assert fits.fit_line(1.0, 1800) == "about 30 min to finish at this speed; the job ends in 55 min: it fits"
    # 2 h 10 min of training, 55 min left: about 54 min of it here, then 58 min in each run
    # of the job after its start-up (300 s here) and the margin (60 s).
    clock.now = 900.0
    long = TimeLimit(job, "auto", Clock(300.0))
    long.clock = clock
    assert long.fit_line(1.0, 7800) == ("needs about 2 h 10 min at this speed, the job ends in 45 min: it will be "
                                        "requeued about 2 times; --time=2:50:00 would do it in one")
    once = TimeLimit(job, "auto", Clock(300.0))
    once.clock = clock
    assert "it will be requeued about once;" in once.fit_line(1.0, 4000)
    stays = TimeLimit(JobTimes(0.0, 3600.0, requeue=False), "auto", clock)
    assert "it saves and stops 60 s before the end, and is not requeued (the line it prints continues it)" in (
        stays.fit_line(1.0, 7800))
    short = TimeLimit(JobTimes(0.0, 400.0), "auto", Clock(350.0))
    assert "its time limit leaves no time to train after start-up" in short.fit_line(1.0, 7800)


def test_a_job_slurm_does_not_requeue_says_what_chain_will_do(monkeypatch):
    """With CHAIN (which the supervisor passes on to the ranks as JobEnv.CHAIN), a job Slurm
    does not requeue chains the job that continues the run: the estimate says so, and how
    many jobs it takes; where CHAIN is too small for them, that the last job's line continues
    the run, and the CHAIN that would do. Without CHAIN, the line it prints continues it."""
    given = {"SLURM_JOB_START_TIME": "0", "SLURM_JOB_END_TIME": "3600",
             contract.JobEnv.JOB_INFO: INFO.replace("Requeue=1", "Requeue=0")}
    assert read_job_times(given, "7") == JobTimes(0.0, 3600.0, requeue=False)
    assert read_job_times({**given, contract.JobEnv.CHAIN: "3"}, "7") == JobTimes(0.0, 3600.0, requeue=False, chain=3)
    head = "needs about 2 h 10 min at this speed, the job ends in 45 min: it saves and stops 60 s before the end, and is not requeued"
    for chain, said in (("3", ": it chains the job that continues it, about 2 more jobs (CHAIN=3); --time=2:50:00 would do "
                              "it in one"),
                        ("2", ": it chains the job that continues it, about 2 more jobs (CHAIN=2); --time=2:50:00 would do "
                              "it in one"),
                        ("1", ": it chains the job that continues it, 1 more job (CHAIN=1) of the about 2 it takes: the "
                              "last prints the line that continues the run, and CHAIN=2 would chain them all; "
                              "--time=2:50:00 would do it in one"),
                        ("0", " (the line it prints continues it); --time=2:50:00 would do it in one")):
        limit = TimeLimit(read_job_times({**given, contract.JobEnv.CHAIN: chain}, "7"), "auto", Clock(300.0))
        limit.clock = Clock(900.0)
        assert limit.fit_line(1.0, 7800) == head + said, chain
    once = TimeLimit(JobTimes(0.0, 3600.0, requeue=False, chain=1), "auto", Clock(300.0))
    once.clock = Clock(900.0)
    assert ": it chains the job that continues it, about 1 more job (CHAIN=1);" in once.fit_line(1.0, 4000)


def test_a_line_without_a_start_or_with_its_end_at_its_start_gives_no_times():
    assert times_from_job_info(INFO.replace("StartTime=2026-11-24T13:15:52", "StartTime=Unknown")) is None
    assert times_from_job_info(INFO.replace("EndTime=2026-11-24T13:17:52", "EndTime=2026-11-24T13:15:52")) is None
    assert read_job_times({"SLURM_JOB_START_TIME": "1000", "SLURM_JOB_END_TIME": "1000"}, "7") is None


def test_scontrol_is_asked_once_and_only_when_no_line_was_passed_on(monkeypatch):
    """Through the contract's one reader of `scontrol show job`, with its one timeout."""
    calls = []

    def scontrol(returncode: int, stdout: str = INFO):
        def run(args, timeout, env=None):
            calls.append((args, timeout, env))
            return subprocess.CompletedProcess(args, returncode, stdout, "")
        return run

    monkeypatch.setattr(contract, "run", scontrol(0))
    assert read_job_times({}, "7") == JobTimes(START, START + 120, requeue=True)
    assert calls == [(["scontrol", "show", "job", "-o", "7"], contract.SCONTROL_TIMEOUT,
                      {**os.environ, "SLURM_TIME_FORMAT": "standard"})]
    monkeypatch.setattr(contract, "run", scontrol(1))
    assert read_job_times({}, "7") is None  # (an unknown job: what it printed is no job line)
    calls.clear()
    given = {"SLURM_JOB_START_TIME": "1000", "SLURM_JOB_END_TIME": "4600"}
    # Slurm's own times, but only the line says whether the job may be requeued: asked once.
    monkeypatch.setattr(contract, "run", scontrol(0))
    assert read_job_times(given, "7") == JobTimes(1000.0, 4600.0, requeue=True) and len(calls) == 1

    def timed_out(args, timeout, env=None):
        raise subprocess.TimeoutExpired(args, timeout)
    monkeypatch.setattr(contract, "run", timed_out)
    assert read_job_times({}, "7") is None


def test_durations_at_their_edges():
    assert [duration(s) for s in (0, -5, 7260)] == ["0 s", "0 s", "2 h 01 min"]
    assert [slurm_duration(s) for s in (3600, 3600.5, 3601, 36000, 36000.5, 86400)] == [
        "1:00:00", "1:10:00", "1:10:00", "10:00:00", "10:30:00", "1-00:00:00"]


def test_the_step_time_is_a_running_average_from_the_second_step_on():
    limit = TimeLimit(JobTimes(0.0, 3600.0), "auto", Clock(0.0))
    limit.stepped(100.0)
    assert limit.step_seconds == 0.0
    limit.stepped(102.0)
    assert limit.step_seconds == 2.0
    limit.stepped(106.0)
    assert abs(limit.step_seconds - 2.2) < 1e-9


def test_the_start_line_at_the_margin_and_with_minutes_given():
    assert TimeLimit(JobTimes(0.0, 3600.0), "auto", Clock(3540.0)).start_line().startswith(
        "warning: Slurm ends this job in 60 s, less than the 60 s it stops before the end")
    assert TimeLimit(JobTimes(0.0, 3600.0), "1.5", Clock(0.0)).start_line() == (
        "Slurm ends this job in 1 h: it saves and stops 2 min before that (--stop-before 1.5), if no signal comes first")
    late = TimeLimit(JobTimes(0.0, 3600.0), "auto", Clock(3590.0))
    late.start_line()
    assert late.up() is False
    assert TimeLimit(None, "auto").left() == math.inf
    second = TimeLimit(JobTimes(0.0, 3600.0), str(1 / 60), Clock(3599.0))  # a stop one second before the end
    assert second.up() is True


def test_whether_it_fits_at_the_edges():
    clock = Clock(300.0)
    job = JobTimes(0.0, 3600.0, requeue=True)
    assert TimeLimit(job, "auto", clock).fit_line(1.0, 3240).endswith(": it fits")  # exactly the time left
    assert TimeLimit(job, "auto", clock).fit_line(1.0, 3300).startswith("needs about 55 min")
    # A job that started at 1000 s and trains from its start: 3540 s in each run of it.
    clock = Clock(1000.0)
    late = JobTimes(1000.0, 4600.0, requeue=True)
    assert TimeLimit(late, "auto", clock).fit_line(1.0, 7080) == (
        "needs about 1 h 58 min at this speed, the job ends in 1 h: it will be requeued about once; "
        "--time=2:20:00 would do it in one")
    assert "requeued about 2 times" in TimeLimit(late, "auto", clock).fit_line(1.0, 7081)
    clock.now = 4540.0  # at the margin: all of it in the runs that follow
    at_margin = TimeLimit(late, "auto", Clock(1000.0))
    at_margin.clock = clock
    assert "requeued about once" in at_margin.fit_line(1.0, 3540)
    assert "requeued about 2 times" in at_margin.fit_line(1.0, 3541)
    # Start-up takes all but the margin (0 s to train), or leaves one second.
    assert "leaves no time to train after start-up" in TimeLimit(JobTimes(0.0, 400.0), "auto", Clock(340.0)).fit_line(1.0, 10)
    assert "requeued about 9 times" in TimeLimit(JobTimes(0.0, 400.0, requeue=True), "auto", Clock(339.0)).fit_line(1.0, 10)


PARTITION_LIMIT = INFO.replace("TimeLimit=00:02:00", "TimeLimit=Partition_Limit")


def test_both_paths_agree_on_partition_limit_and_unlimited():
    """The line's local times and the Unix times beside it give the same answer for every
    TimeLimit: Partition_Limit is the partition's MaxTime, a limit when its end is (here 2
    minutes); UNLIMITED, or an end a year away (MaxTime=INFINITE), is none."""
    a_year = 365 * 24 * 3600
    cases = [(INFO, 120, True), (PARTITION_LIMIT, 120, True), (PARTITION_LIMIT, a_year, False),
             (INFO.replace("TimeLimit=00:02:00", "TimeLimit=UNLIMITED"), 120, False)]
    for line, seconds, limited in cases:
        end = datetime.datetime.fromtimestamp(START + seconds).isoformat(timespec="seconds")
        line = line.replace("EndTime=2026-11-24T13:17:52", f"EndTime={end}")
        from_line = read_job_times({"MNIST_DDP_JOB_INFO": line}, "7")
        from_unix = read_job_times({"MNIST_DDP_JOB_INFO": line, "MNIST_DDP_JOB_TIMES": f"{START:.0f} {START + seconds:.0f}"},
                                   "7")
        from_slurm = read_job_times({"SLURM_JOB_START_TIME": f"{START:.0f}", "SLURM_JOB_END_TIME": f"{START + seconds:.0f}",
                                     "MNIST_DDP_JOB_INFO": line}, "7")
        expected = JobTimes(START, START + seconds, requeue=True) if limited else None
        assert from_line == from_unix == from_slurm == expected, (line, seconds)


def test_a_requeue_is_promised_only_to_a_batch_job_that_may_be_requeued(monkeypatch):
    """After the first epoch, a run that does not fit says "requeued about N times" only in a
    batch job with Requeue=1; in an salloc, a job submitted with --no-requeue, or one whose
    line scontrol cannot give (Slurm's own times alone), it says that it stops and that the
    line it prints continues it."""
    given = {"SLURM_JOB_START_TIME": "0", "SLURM_JOB_END_TIME": "3600"}
    lines = {"batch": INFO, "salloc": INFO.replace("BatchFlag=1", "BatchFlag=0"),
             "no-requeue": INFO.replace("Requeue=1", "Requeue=0"), "unknown": None}
    for case, line in lines.items():
        answer = subprocess.CompletedProcess([], 0 if line else 1, line or "", "")
        monkeypatch.setattr(contract, "run", lambda *a, answer=answer, **k: answer)
        times = read_job_times(given, "7")
        said = TimeLimit(times, "auto", Clock(0.0)).fit_line(1.0, 7800)
        if case == "batch":
            assert "it will be requeued about 2 times" in said, said
        else:
            assert "requeued about" not in said and "is not requeued (the line it prints continues it)" in said, (case, said)
