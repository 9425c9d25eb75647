"""ddpkit/files.py with real files: each write replaces its file whole or leaves it as it was,
and leaves no temporary behind, when it fails for real (an object pickle refuses, a full
1 MB tmpfs) or succeeds; the atomic save's error names the file. A read-only folder, through
the image sets' cache: tests/unit/test_imagesets.py.

Shared storage: make_folder with processes racing to make one deep folder, and with the
answers NFS gives another host mid-race made at a chosen moment (a parent removed between
two of Path.mkdir's steps, EEXIST for a name not yet seen): it retries those, a bounded
number of times, and raises a real error (a file in the way, EROFS) at once.
read_written_elsewhere retries ENOENT, ESTALE and a file shorter than its writer saw, then
gives up in one line that names the file and its file system.

The lease, with real processes for holders: a live holder on this host is refused, and its
release leaves nothing; one whose process ended is taken over at once; one on another host
(its record written here, as its node leaves it) is taken over after its bound once it is
silent, never while it beats, at once when it was this process's own Slurm job, and as a
stand-in squeue says of its job; a holder frozen until it was taken over stops at its next
beat (on_lost); four starters racing for a dead holder's lease hold it one at a time.

    python -m pytest tests/unit/test_files.py
"""

import errno
import json
import multiprocessing
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import ddpkit.files
from ddpkit.files import (
    FileNotSeen,
    Lease,
    file_system,
    make_folder,
    read_written_elsewhere,
    replace_json,
    replace_text,
    save_atomic,
)
from ddpkit.run.checkpoints import remove_stale_temporaries
from helpers.checkpoints import names

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def full_disk(tmp_path):
    """A real 1 MB tmpfs (docs: /work/shared/notes/odd-cases.md), unmounted afterwards."""
    folder = tmp_path / "small"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield folder
    subprocess.run(["umount", str(folder)], check=True)


def test_save_atomic_writes_the_file_and_nothing_else(tmp_path):
    save_atomic({"x": torch.arange(3)}, tmp_path / "a.pt")
    assert names(tmp_path) == ["a.pt"]
    assert torch.equal(torch.load(tmp_path / "a.pt")["x"], torch.arange(3))


def test_a_failed_save_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "ckpt-00000002.pt"
    save_atomic({"step": 2}, path)
    before = path.read_bytes()
    with pytest.raises(Exception, match="pickle"):
        save_atomic({"step": 4, "hook": lambda: None}, path)  # a lambda cannot be pickled
    assert path.read_bytes() == before
    assert names(tmp_path) == ["ckpt-00000002.pt"]


def test_a_save_that_fills_the_disk_names_the_file_and_cleans_up(full_disk):
    path = full_disk / "ckpt-00000002.pt"
    save_atomic({"step": 2}, path)
    before = path.read_bytes()
    with pytest.raises(OSError) as failed:
        save_atomic({"weights": torch.zeros(500_000)}, path)  # 2 MB
    assert (failed.value.errno, failed.value.filename) == (errno.ENOSPC, str(path))
    assert path.read_bytes() == before
    assert names(full_disk) == ["ckpt-00000002.pt"]


def test_text_that_fills_the_disk_keeps_the_old_file_and_cleans_up(full_disk):
    path = full_disk / "metrics.jsonl"
    replace_text(path, "one\n")
    with pytest.raises(OSError) as failed:
        replace_text(path, "x" * 2_000_000)
    assert failed.value.errno == errno.ENOSPC
    assert path.read_text() == "one\n"
    assert names(full_disk) == ["metrics.jsonl"]


def test_json_is_one_line_or_indented_and_a_kept_temporary_is_not_swept(tmp_path):
    """suffix ".": a writer that outlives the run's claim of its directory (the tracker's
    sender) names its temporary so that remove_stale_temporaries leaves it alone."""
    replace_json(tmp_path / "run.json", {"a": [1, 2]})
    replace_json(tmp_path / "tracker.json", {"a": 1}, indent=1, suffix=".")
    assert (tmp_path / "run.json").read_text() == '{"a": [1, 2]}\n'
    assert json.loads((tmp_path / "tracker.json").read_text()) == {"a": 1}
    assert "\n " in (tmp_path / "tracker.json").read_text()
    (tmp_path / ".tracker.json.77").write_text("{")  # (another process's write under way)
    (tmp_path / ".run.json.tmp-77").write_text("{")  # (a write that never finished)
    assert remove_stale_temporaries(tmp_path) == [tmp_path / ".run.json.tmp-77"]
    assert names(tmp_path) == [".tracker.json.77", "run.json", "tracker.json"]


# ----------------------------------------------------------------------------- make_folder

def make_folders(root: str, start: threading.Barrier, rounds: int) -> None:
    start.wait()
    for n in range(rounds):
        make_folder(f"{root}/{n}/a/b/c/d/e")


def test_processes_racing_to_make_one_deep_folder_all_succeed(tmp_path):
    start = multiprocessing.Barrier(6)
    racers = [multiprocessing.Process(target=make_folders, args=(str(tmp_path), start, 40)) for _ in range(6)]
    for racer in racers:
        racer.start()
    for racer in racers:
        racer.join(60)
    assert [racer.exitcode for racer in racers] == [0] * 6
    assert all((tmp_path / str(n) / "a/b/c/d/e").is_dir() for n in range(40))


@pytest.fixture
def mkdir_calls(monkeypatch):
    """os.mkdir as Path.mkdir calls it, with `before(path, call)` run first: another host's
    doing at that moment. Returns the paths it was called with."""
    calls, plain = [], os.mkdir

    def install(before):
        def mkdir(path, *args, **kwargs):
            calls.append(os.fspath(path))
            before(os.fspath(path), len(calls))
            return plain(path, *args, **kwargs)
        monkeypatch.setattr(os, "mkdir", mkdir)
        return calls
    monkeypatch.setattr(ddpkit.files, "FOLDER_PAUSE", 0.001)
    return install


def test_a_parent_another_rank_removes_mid_make_is_made_again(tmp_path, mkdir_calls):
    leaf = tmp_path / "shared" / "hangs"
    leaf.parent.mkdir()
    removed = []

    def remove_parent_twice(path, _):  # (another rank's cleanup of an empty folder, before each try at the leaf)
        if path == str(leaf) and len(removed) < 2:
            removed.append(path)
            os.rmdir(leaf.parent)
    mkdir_calls(remove_parent_twice)
    with pytest.raises(FileNotFoundError):  # what Path.mkdir does alone
        leaf.mkdir(parents=True, exist_ok=True)
    removed.clear()
    leaf.parent.mkdir(exist_ok=True)
    assert make_folder(leaf) == leaf and leaf.is_dir()


def test_a_folder_another_host_made_but_this_one_does_not_see_yet_is_waited_for(tmp_path, mkdir_calls):
    leaf = tmp_path / "profile" / "steps-1-3"

    def exists_elsewhere(path, call):  # (NFS: EEXIST from the server, no such name in this host's cache)
        if path == str(leaf) and call <= 2:
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), path)
    mkdir_calls(exists_elsewhere)
    with pytest.raises(FileExistsError):
        leaf.mkdir(parents=True, exist_ok=True)
    assert make_folder(leaf).is_dir()


def test_make_folder_gives_up_after_its_tries(tmp_path, mkdir_calls):
    leaf = tmp_path / "gone" / "leaf"

    def parent_always_gone(path, _):
        if path == str(leaf) and leaf.parent.is_dir():
            os.rmdir(leaf.parent)
    calls = mkdir_calls(parent_always_gone)
    with pytest.raises(FileNotFoundError):
        make_folder(leaf)
    assert calls.count(str(leaf)) == 2 * ddpkit.files.FOLDER_TRIES  # (Path.mkdir tries the leaf twice each time)


@pytest.mark.parametrize("blocker", ["the folder", "a parent"])
def test_a_file_in_the_way_raises_at_once(tmp_path, mkdir_calls, blocker):
    calls = mkdir_calls(lambda *_: None)
    (tmp_path / "runs").write_text("")
    folder = tmp_path / "runs" if blocker == "the folder" else tmp_path / "runs" / "sub"
    with pytest.raises((FileExistsError, NotADirectoryError)):
        make_folder(folder)
    assert len(calls) == 1


def test_a_read_only_file_system_raises_at_once(tmp_path, mkdir_calls):
    def read_only(path, _):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
    calls = mkdir_calls(read_only)
    with pytest.raises(OSError) as raised:
        make_folder(tmp_path / "runs")
    assert raised.value.errno == errno.EROFS and len(calls) == 1


# ----------------------------------------------------------------------------- read_written_elsewhere

def test_stale_handles_are_retried(tmp_path):
    path, opens = tmp_path / "ckpt-00000010.pt", []
    path.write_bytes(b"weights")

    def read(p):
        opens.append(p)
        if len(opens) <= 3:
            raise OSError(errno.ESTALE, os.strerror(errno.ESTALE), str(p))
        return p.read_bytes()
    assert read_written_elsewhere(path, read) == b"weights" and len(opens) == 4


def test_a_file_shorter_than_its_writer_saw_is_read_once_whole(tmp_path):
    path = tmp_path / "ckpt-00000010.pt"
    path.write_bytes(b"half")
    threading.Timer(0.3, lambda: path.write_bytes(b"half and the rest")).start()
    assert read_written_elsewhere(path, lambda p: p.read_bytes(), size=len(b"half and the rest")) == b"half and the rest"


def test_a_whole_file_that_does_not_load_raises_at_once(tmp_path):
    path = tmp_path / "ckpt-00000010.pt"
    path.write_bytes(b"garbage")

    loads = []

    def load(p):
        loads.append(p)
        raise RuntimeError("PytorchStreamReader failed reading zip archive")
    with pytest.raises(RuntimeError):
        read_written_elsewhere(path, load, size=len(b"garbage"), short_read=(RuntimeError,))
    assert loads == [path]  # (tried once: not retried for REREAD_SECONDS)


def test_a_file_never_seen_is_named_with_its_file_system(tmp_path, monkeypatch):
    path = tmp_path / "checkpoints" / "ckpt-00000010.pt"
    mount, kind = file_system(tmp_path)
    monkeypatch.setattr(ddpkit.files, "REREAD_SECONDS", 0.3)
    with pytest.raises(FileNotSeen) as gave_up:
        read_written_elsewhere(path, lambda p: p.read_bytes())
    assert str(gave_up.value) == (
        f"cannot read {path} (No such file or directory) after 0.3 s of retries: it is on {kind} at {mount}, where another "
        "node wrote it, and this node does not see it whole; check that the file system is mounted alike on every node "
        f"(findmnt {mount}), then run the same command again: nothing saved is lost")


def test_the_file_system_is_the_innermost_mount(full_disk):
    assert file_system(full_disk / "ckpt.pt") == (str(full_disk), "tmpfs")


# ----------------------------------------------------------------------------- leases
# Each holder is a real process of its own. A holder on "another host" is what such a node
# leaves on the shared file system: its record, written here as a file (and rewritten by a
# process of its own where it beats).

HOLDER = """
import os, sys, time
from pathlib import Path
import ddpkit.files
from ddpkit.files import Lease

ddpkit.files.LEASE_BEAT = 0.2  # (beats ten times as often: the test waits less)

def lost():
    print("lost", flush=True)
    os._exit(3)

lease = Lease(Path(sys.argv[1]), stale_after=60.0, on_lost=lost)
while lease.attempt() is not None:
    time.sleep(0.05)
print("held", flush=True)
sys.stdin.readline()
lease.release()
"""

# Rewrites a record of a holder on another host every 0.2 s, as such a holder's beats do.
BEATS_ELSEWHERE = """
import json, sys, time
record = json.loads(sys.argv[2])
while True:
    record["beat"] += 1
    with open(sys.argv[1], "w") as fh:
        fh.write(json.dumps(record) + "\\n")
    time.sleep(0.2)
"""


def start_holder(lease: Path) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(lease)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert holder.stdout.readline() == "held\n"
    return holder


def elsewhere(lease: Path, **fields) -> Path:
    """A lease held by a process of another host (no job unless `fields` give one), as its node left it."""
    lease.mkdir()
    record = lease / "holder-0123456789abcdef"
    record.write_text(json.dumps({"host": "node-elsewhere", "pid": 4242, "start": "77", "job": None, "cluster": None,
                                  "rank": 0, "since": "2026-11-28 07:00:00", "beat": 0, **fields}) + "\n")
    return record


def took_over(lease: Lease, seconds: float) -> bool:
    """Whether `lease` was taken within `seconds` of attempts."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if lease.attempt() is None:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def no_slurm(tmp_path_factory, monkeypatch):
    """No squeue on the PATH (a machine outside Slurm): a folder of its own, for a stand-in."""
    folder = tmp_path_factory.mktemp("bin")
    monkeypatch.setenv("PATH", str(folder))
    for name in ("SLURM_JOB_ID", "SLURM_CLUSTER_NAME"):
        monkeypatch.delenv(name, raising=False)
    return folder


def test_a_live_holder_on_this_host_is_refused_and_its_release_frees_the_lease(tmp_path, no_slurm):
    path = tmp_path / "x.lease"
    holder = start_holder(path)
    try:
        seen = Lease(path, stale_after=1.0).attempt()
        assert seen is not None and seen.alive and not seen.gone
        assert str(seen).startswith(f"pid {holder.pid} on {socket.gethostname()} since ")
    finally:
        holder.communicate("\n", timeout=30)
    assert names(tmp_path) == []  # released: nothing left
    lease = Lease(path, stale_after=1.0)
    assert lease.attempt() is None
    lease.release()
    assert names(tmp_path) == []


def test_a_holder_whose_process_ended_on_this_host_is_taken_over_at_once(tmp_path, no_slurm, capfd):
    path = tmp_path / "x.lease"
    holder = start_holder(path)
    holder.kill()
    holder.wait()
    lease = Lease(path, stale_after=3600.0)
    assert lease.attempt() is None  # at once: not after an hour
    assert re.fullmatch(rf"took over {re.escape(str(path))} from pid {holder.pid} on {re.escape(socket.gethostname())} "
                        r"since [\d: -]+: its process has ended\n", capfd.readouterr().err)
    lease.release()
    assert names(tmp_path) == []


def test_a_silent_holder_on_another_host_is_taken_over_after_stale_after(tmp_path, no_slurm):
    path = tmp_path / "x.lease"
    elsewhere(path)
    lease = Lease(path, stale_after=1.5)
    began = time.monotonic()
    seen = lease.attempt()
    assert seen is not None and not seen.alive and not seen.gone and str(seen).endswith("since 2026-11-28 07:00:00")
    assert took_over(lease, 60)
    assert time.monotonic() - began >= 1.5  # (not before its bound, timed on this process's clock)
    lease.release()


@pytest.mark.slow
def test_a_beating_holder_on_another_host_is_alive_and_never_taken_over(tmp_path, no_slurm):
    path = tmp_path / "x.lease"
    record = elsewhere(path)
    beats = subprocess.Popen([sys.executable, "-c", BEATS_ELSEWHERE, str(record), record.read_text()])
    try:
        lease = Lease(path, stale_after=2.0)  # (ten of its beats: a loaded machine may hold one back a while)
        assert not took_over(lease, 6.0)  # three times its bound
        seen = lease.attempt()
        assert seen is not None and seen.alive and not seen.gone
    finally:
        beats.kill()
        beats.wait()


def stand_in_squeue(folder: Path, answer: str) -> Path:
    """A squeue on the PATH that records what it was asked and answers as Slurm does: `answer`
    on stdout, or with "invalid", Slurm's error for a job it no longer knows."""
    squeue = folder / "squeue"
    said = ('echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1' if answer == "invalid"
            else f"echo {answer}")
    squeue.write_text(f"#!/bin/sh\necho \"$*\" >> {folder / 'asked'}\n{said}\n")
    squeue.chmod(0o755)
    return folder / "asked"


def test_an_earlier_start_of_the_own_slurm_job_is_taken_over_at_once_where_the_lease_says_so(tmp_path, no_slurm,
                                                                                                monkeypatch):
    """A holder of this very job on another node: a start before a requeue is gone at once
    (own_job_takes_over: the run's claim, the data lock); the tracker's lease (without it)
    weighs its beats, and never asks squeue about the job it runs in."""
    path = tmp_path / "x.lease"
    elsewhere(path, job="4242", restarts="0", step="0")
    asked = stand_in_squeue(no_slurm, "RUNNING")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # this process: the job's start after a requeue
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    seen = Lease(path, stale_after=3600.0).attempt()
    assert seen is not None and not seen.gone and not seen.alive
    lease = Lease(path, stale_after=3600.0, own_job_takes_over=True)
    assert lease.attempt() is None
    lease.release()
    assert not asked.exists()


@pytest.mark.parametrize("listed, taken", [("4242.0", False), ("", True)])
def test_an_earlier_step_of_the_own_slurm_job_is_taken_over_once_squeue_no_longer_lists_it(tmp_path, no_slurm,
                                                                                             monkeypatch, listed, taken):
    """A restarted step (the same start of the job, another step) takes over at once a step
    that squeue no longer lists; a step it still lists (a second srun of the same run at once)
    is judged by its beats, and a rank of this very step is never asked about."""
    path = tmp_path / "x.lease"
    elsewhere(path, job="4242", restarts="0", step="0")
    asked = stand_in_squeue(no_slurm, listed)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    seen = Lease(path, stale_after=3600.0, own_job_takes_over=True).attempt()  # a rank of the same step
    assert seen is not None and not seen.gone and not asked.exists()
    monkeypatch.setenv("SLURM_STEP_ID", "1")
    lease = Lease(path, stale_after=3600.0, own_job_takes_over=True)
    seen = lease.attempt()
    assert (seen is None) == taken
    if taken:
        lease.release()
    else:
        assert not seen.gone and not seen.alive  # (its beats decide)
    assert asked.read_text() == "-h --steps=4242.0 -o %i\n"


@pytest.mark.parametrize("state, taken", [("RUNNING", False), ("SUSPENDED", False), ("PENDING", True), ("invalid", True),
                                          ("", False)])
def test_a_holder_in_another_slurm_job_lives_while_squeue_shows_it_running(tmp_path, no_slurm, state, taken):
    """squeue (a stand-in that answers as Slurm does, and records what it was asked) decides at
    once where it shows the job, or says it no longer knows it; where it shows nothing (a job
    of another user that PrivateData hides), the holder's beats decide."""
    path = tmp_path / "x.lease"
    elsewhere(path, job="77")
    asked = stand_in_squeue(no_slurm, state)
    lease = Lease(path, stale_after=3600.0)
    seen = lease.attempt()
    assert (seen is None) == taken
    if not taken:
        assert seen.alive == bool(state) and not seen.gone
    assert asked.read_text() == "-h --states=all --jobs=77 -o %T\n"


def test_a_holder_judged_gone_while_alive_finds_its_record_taken_and_stops(tmp_path, no_slurm):
    """A holder frozen (SIGSTOP) long enough to be judged gone, as if on another node: once it
    runs again, its next beat finds its record gone, and on_lost stops it."""
    path = tmp_path / "x.lease"
    holder = start_holder(path)
    try:
        os.kill(holder.pid, signal.SIGSTOP)
        [record] = path.glob("holder-*")
        record.write_text(record.read_text().replace(socket.gethostname(), "node-elsewhere"))
        lease = Lease(path, stale_after=1.0)
        assert took_over(lease, 60)
        os.kill(holder.pid, signal.SIGCONT)
        assert holder.stdout.readline() == "lost\n"
        assert holder.wait(30) == 3
        assert [p.name for p in path.iterdir()] == [lease.record_path.name]  # the taker's lease, untouched
        lease.release()
    finally:
        holder.kill()
        holder.wait()


TAKE_TURNS = """
import os, sys, time
from pathlib import Path
from ddpkit.files import Lease

lease = Lease(Path(sys.argv[1]), stale_after=60.0)
while lease.attempt() is not None:
    time.sleep(0.01)
with open(sys.argv[2], "a") as log:
    log.write(f"in {os.getpid()}\\n")
    log.flush()
    time.sleep(0.3)
    log.write(f"out {os.getpid()}\\n")
lease.release()
"""


def test_starters_racing_for_a_lease_left_by_a_dead_holder_take_turns(tmp_path, no_slurm):
    """Four processes started at once at a lease whose holder died: each holds it alone in turn."""
    path, log = tmp_path / "x.lease", tmp_path / "log"
    holder = start_holder(path)
    holder.kill()
    holder.wait()
    racers = [subprocess.Popen([sys.executable, "-c", TAKE_TURNS, str(path), str(log)], stderr=subprocess.DEVNULL,
                               env={**os.environ, "PYTHONPATH": str(ROOT)}) for _ in range(4)]
    assert [racer.wait(120) for racer in racers] == [0, 0, 0, 0]
    lines = log.read_text().split()
    assert len(lines) == 16 and all(lines[i] == "in" and lines[i + 2] == "out" and lines[i + 1] == lines[i + 3]
                                    for i in range(0, 16, 4)), lines
    assert names(tmp_path) == ["log"]
