"""ddpkit/run/rundir.py: the run's directory as rank 0 chooses it (--run-dir, LOG_DIR/RUN_NAME,
the Slurm job's, or a new one named by the time, which two runs started in the same second
never share), and RunClaim, the hold on it: a second claim from another process (a real
forked process holding the lock and the lease) is refused with a line that names the holder,
release writes exit-code and removes the lease, and a new claim removes the exit-code an
earlier attempt left; a holder whose lease was taken over while it was frozen stops at its
next beat with exit 2. (The lease's rules: tests/unit/test_files.py.)

    python -m pytest tests/unit/test_rundir.py
"""

import json
import multiprocessing
import os
import re
import signal
import socket
import time
from pathlib import Path

import pytest

from ddpkit.files import Lease
from ddpkit.launch import Launch
from ddpkit.options import RunOptions
from ddpkit.run import rundir
from ddpkit.run.rundir import RunClaim, RunDirTaken, choose_run_dir

ALONE = Launch("single", 0, 0, 1, "127.0.0.1", 0, "", 0)
IN_A_JOB = Launch("slurm", 0, 0, 2, "node01", 11234, "1234", 0)


def test_run_dir_wins_then_run_name_then_the_job(tmp_path):
    logs = tmp_path / "runs"
    assert choose_run_dir(RunOptions(log_dir=str(logs), run_dir=str(tmp_path / "x" / "y")), IN_A_JOB) == tmp_path / "x" / "y"
    assert choose_run_dir(RunOptions(log_dir=str(logs), run_name="lr3e-3"), IN_A_JOB) == logs / "lr3e-3"
    assert choose_run_dir(RunOptions(log_dir=str(logs)), IN_A_JOB) == logs / "job-1234"
    assert not logs.exists()  # a named directory is made by its claim, not here


def test_an_unnamed_run_gets_a_new_directory_named_by_the_time(tmp_path):
    logs = tmp_path / "runs"
    before = time.strftime("%Y%m%d-%H%M%S")
    path = choose_run_dir(RunOptions(log_dir=str(logs)), ALONE)
    assert path.parent == logs and path.is_dir()
    assert re.fullmatch(r"\d{8}-\d{6}(-\d+)?", path.name)
    assert before <= path.name[:15] <= time.strftime("%Y%m%d-%H%M%S")


def test_runs_started_in_the_same_second_get_their_own_directories(tmp_path, monkeypatch):
    # The clock stands still, so every call falls in the same second.
    monkeypatch.setattr(rundir.time, "strftime", lambda fmt: "20250101-120000")
    logs = tmp_path / "runs"
    logs.mkdir()
    (logs / "20250101-120000").mkdir()  # another run's, from this very second
    options = RunOptions(log_dir=str(logs))
    first, second = choose_run_dir(options, ALONE), choose_run_dir(options, ALONE)
    assert (first.name, second.name) == ("20250101-120000-2", "20250101-120000-3")
    assert first.is_dir() and second.is_dir()


def _hold(run_dir: str, held, done) -> None:
    claim = RunClaim(Path(run_dir))
    held.set()
    done.wait(30)
    claim.release(0)


def _hold_on(run_dir: str, held) -> None:
    RunClaim(Path(run_dir))
    held.set()
    time.sleep(60)


def test_a_second_claim_from_another_process_names_the_holder(tmp_path):
    run_dir = tmp_path / "runs" / "exp"
    fork = multiprocessing.get_context("fork")  # a process of its own: POSIX locks are per process
    held, done = fork.Event(), fork.Event()
    holder = fork.Process(target=_hold, args=(str(run_dir), held, done))
    holder.start()
    try:
        assert held.wait(30)
        with pytest.raises(RunDirTaken) as taken:
            RunClaim(run_dir)
        assert re.fullmatch(rf"another run is using {re.escape(str(run_dir))} \(pid {holder.pid} on "
                            rf"{re.escape(socket.gethostname())} since \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d\); wait for it "
                            r"to end, or pass another --run-name to start a separate run", str(taken.value)), taken.value
    finally:
        done.set()
        holder.join(30)
    assert holder.exitcode == 0
    assert (run_dir / "exit-code").read_text() == "0\n"  # its release
    claim = RunClaim(run_dir)  # free again, and the earlier attempt's exit-code is gone
    assert not (run_dir / "exit-code").exists()
    claim.release(75)


def test_a_claim_writes_its_holder_and_release_writes_the_exit_code(tmp_path):
    run_dir = tmp_path / "exp"
    claim = RunClaim(run_dir)  # makes the directory
    [record] = (run_dir / ".claim.lease").glob("holder-*")
    holder = json.loads(record.read_text())
    assert (holder["pid"], holder["host"], holder["rank"]) == (os.getpid(), socket.gethostname(), 0)
    assert not (run_dir / "exit-code").exists()
    claim.release(4)
    assert (run_dir / "exit-code").read_text() == "4\n"
    assert claim.file.closed
    assert sorted(path.name for path in run_dir.iterdir()) == [".claim", "exit-code"]  # the lease is gone


def test_a_claim_removes_a_stale_exit_code(tmp_path):
    (tmp_path / "exit-code").write_text("4\n")
    claim = RunClaim(tmp_path)
    assert not (tmp_path / "exit-code").exists()
    claim.release(0)


def test_a_run_whose_claim_was_taken_over_while_it_was_frozen_stops_with_exit_2(tmp_path, capfd, monkeypatch):
    """A holder frozen (SIGSTOP) long enough to be judged gone, as if on another node (its
    record says so) whose storage was away: another run takes the lease over; the frozen one,
    running again, meets its record gone at its next beat and stops at once, exit 2, in one line."""
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm"))  # (squeue cannot tell: its beats decide)
    run_dir = tmp_path / "exp"
    fork = multiprocessing.get_context("fork")
    held = fork.Event()
    holder = fork.Process(target=_hold_on, args=(str(run_dir), held))  # (no Event it waits on: it dies waiting)
    holder.start()
    try:
        assert held.wait(30)
        os.kill(holder.pid, signal.SIGSTOP)
        [record] = (run_dir / ".claim.lease").glob("holder-*")
        record.write_text(record.read_text().replace(socket.gethostname(), "node-elsewhere"))
        taker, deadline = Lease(run_dir / ".claim.lease", stale_after=1.0), time.monotonic() + 60
        while taker.attempt() is not None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(holder.pid, signal.SIGCONT)
        holder.join(30)
    finally:
        holder.kill()
        holder.join(30)
    assert holder.exitcode == 2
    assert (f"mnist_ddp.py: error: another run took over {run_dir} ({run_dir}/.claim.lease no longer holds this run's "
            "record: it judged this one gone, stopped or cut off from the storage); this run stops at once so that two "
            "runs never write into one directory\n") in capfd.readouterr().err
    assert [path.name for path in (run_dir / ".claim.lease").iterdir()] == [taker.record_path.name]
    taker.release()
