"""Writes that a crash never leaves half done: each goes to a temporary file beside its
target, then is renamed over it (atomic on POSIX and NFS), so a reader or a kill meets the
old file or the new one, never half of one. A failed write removes its temporary file: left
there, it would keep a full disk full for every later attempt. Beside them, what shared
storage asks of files that several nodes touch: folders that many ranks create at once
(make_folder), a file another node wrote moments ago (read_written_elsewhere), and which
mount holds a path, with its options that decide what a lock does (parse_mountinfo).

Leases (Lease): a hold on a run's directory or a data folder that excludes across the nodes
of every shared file system, where fcntl's locks may not.

Standard library only (torch is imported by save_atomic alone): the hang watchdog and the
tracker's sender use it too."""

import contextlib
import dataclasses
import errno
import glob
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TypeVar

T = TypeVar("T")
TEMPORARY_SUFFIX = ".tmp-"  # a temporary is .NAME.tmp-PID beside NAME (remove_stale_temporaries knows it)


def temporary_beside(path: Path, suffix: str = TEMPORARY_SUFFIX) -> Path:
    return path.with_name(f".{path.name}{suffix}{os.getpid()}")


def replace_with(path: Path, write: Callable[[IO], None], *, binary: bool = False, fsync: bool = False,
                 suffix: str = TEMPORARY_SUFFIX) -> None:
    """Call `write` on a temporary file beside `path` (and fsync it, with `fsync`), then
    rename it over `path`. A failed write, a KeyboardInterrupt too, removes the temporary."""
    tmp = temporary_beside(path, suffix)
    try:
        with open(tmp, "wb" if binary else "w") as fh:
            write(fh)
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise


def replace_text(path: Path, text: str, *, suffix: str = TEMPORARY_SUFFIX) -> None:
    """Replace `path` with `text`, whole. `suffix`: see replace_json."""
    replace_with(path, lambda fh: fh.write(text), suffix=suffix)


def replace_json(path: Path, value, *, indent: int | None = None, suffix: str = TEMPORARY_SUFFIX) -> None:
    """Replace `path` with `value` as JSON, whole, one line unless `indent`. `suffix` "." names
    the temporary .NAME.PID, which remove_stale_temporaries leaves alone: for a file that a
    process outliving the run's claim of its directory writes (the tracker's sender)."""
    replace_text(path, json.dumps(value, indent=indent) + "\n", suffix=suffix)


def save_atomic(obj, path: Path) -> None:
    """torch.save `obj` to `path` through a temporary file, fsynced before the rename: a crash
    mid-write leaves the previous file intact.

    A failure raises an OSError that names `path`: torch.save reports a full disk as a
    RuntimeError raised while handling it, and a write's OSError names no file."""
    import torch  # (here alone: the rest of this module serves processes without torch)

    try:
        replace_with(path, lambda fh: torch.save(obj, fh), binary=True, fsync=True)
    except BaseException as err:  # KeyboardInterrupt too
        cause = err if isinstance(err, Exception) else None
        while cause is not None and not (isinstance(cause, OSError) and cause.errno is not None):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
        raise OSError(cause.errno, cause.strerror, str(path)) from err



# ----------------------------------------------------------------------------- shared storage
# What one node wrote, as another sees it on NFS: its lookup and attribute caches may answer
# for seconds with a name that is not there yet, a handle of the file a rename replaced, or
# the file's old size. Where ranks on several nodes create or read one file, they retry.

FOLDER_TRIES = 8  # make_folder's attempts, 0.05 s apart and doubling: 6.4 s of pauses at most
FOLDER_PAUSE = 0.05


def make_folder(path: Path | str) -> Path:
    """Create the folder `path` and its parents, as mkdir(parents=True, exist_ok=True), for a
    folder that several ranks or nodes may create at once. On NFS, another host's mkdir of the
    same component shows as EEXIST on a name this host does not see yet, or as ENOENT on a
    parent another host removed and made again (or that this host does not see yet):
    Path.mkdir raises either. Both are retried, FOLDER_TRIES times in all; any other error
    (EROFS, ENOSPC, EACCES, a file in the way) raises at once."""
    path, pause = Path(path), FOLDER_PAUSE
    for attempt in range(1, FOLDER_TRIES + 1):
        try:
            path.mkdir(parents=True, exist_ok=True)
            break
        except (FileExistsError, FileNotFoundError):
            in_the_way = any(os.path.exists(p) and not os.path.isdir(p) for p in (path, *path.parents))
            if in_the_way or attempt == FOLDER_TRIES:
                raise
        time.sleep(pause)
        pause *= 2
    return path


REREAD_SECONDS = 60.0  # how long read_written_elsewhere retries a file it does not see whole
REREAD_PAUSES = (0.1, 5.0)  # its first pause, doubling up to the second
REREAD_ERRNOS = (errno.ENOENT, errno.ESTALE)


class FileNotSeen(Exception):
    """read_written_elsewhere gave up: the message is the one line for the user."""


def read_written_elsewhere(path: Path, read: Callable[[Path], T], *, size: int | None = None,
                           short_read: tuple[type[BaseException], ...] = ()) -> T:
    """`read(path)`, for a file another node may have written moments ago (the checkpoint
    rank 0 chose). ENOENT and ESTALE are retried for REREAD_SECONDS (read at each call), with pauses
    from 0.1 s doubling to 5 s, and so is a short file: one smaller than `size`, the size its
    writer saw (when it told it), or one whose `read` raised an exception of `short_read`
    (torch.load of a truncated file: RuntimeError, EOFError) while its size was not yet
    `size`. Then FileNotSeen, whose line names the file, its file system and what to do."""
    seconds = REREAD_SECONDS
    deadline, pause = time.monotonic() + seconds, REREAD_PAUSES[0]
    while True:
        try:
            seen = os.stat(path).st_size
            if size is None or seen >= size:
                try:
                    return read(path)
                except short_read:
                    if size is None:
                        raise
                    seen = os.stat(path).st_size
                    if seen >= size:
                        raise  # (whole, and unreadable all the same: not the file system's doing)
            why = f"{seen} of its {size} bytes"
        except OSError as err:
            if err.errno not in REREAD_ERRNOS:
                raise
            why = err.strerror or errno.errorcode.get(err.errno, str(err.errno))
        if time.monotonic() + pause > deadline:
            mount, kind = file_system(path)
            raise FileNotSeen(f"cannot read {path} ({why}) after {seconds:g} s of retries: it is on {kind} at {mount}, "
                              "where another node wrote it, and this node does not see it whole; check that the "
                              f"file system is mounted alike on every node (findmnt {mount}), then run the same "
                              "command again: nothing saved is lost")
        time.sleep(pause)
        pause = min(2 * pause, REREAD_PAUSES[1])


def file_system(path: Path | str) -> tuple[str, str]:
    """(the mount point, the file system's type) that holds `path`, from /proc/self/mountinfo;
    ("?", "an unknown file system") where it cannot be read."""
    with contextlib.suppress(OSError):
        with open("/proc/self/mountinfo") as fh:
            mount = mount_of(os.path.realpath(path), parse_mountinfo(fh.read()))
        if mount:
            return mount.point, mount.fstype
    return "?", "an unknown file system"


# The options that decide what a lock does across nodes (NFS: nolock, local_lock; Lustre:
# flock, localflock, noflock) and how soon another node sees a file (NFS's attribute and
# lookup caches).
LOCK_OPTIONS = ("nolock", "lock", "flock", "localflock", "noflock", "noac")
LOCK_OPTION_KEYS = ("local_lock", "actimeo", "lookupcache")


@dataclass(frozen=True)
class Mount:
    """A line of /proc/self/mountinfo: where it is mounted, its type and source, and its
    options that matter for locks (mount and super options together, in their order)."""
    point: str
    fstype: str
    source: str
    options: tuple[str, ...] = ()

    def words(self) -> str:
        """nfs4 srv:/home on /home (local_lock=all)"""
        return f"{self.fstype} {self.source} on {self.point}" + (f" ({', '.join(self.options)})" if self.options else "")

    def short(self) -> str:
        """nfs4, local_lock=all"""
        return ", ".join((self.fstype, *self.options))


def unescape(field: str) -> str:
    r"""A mountinfo field as the path it names (the kernel writes a space as \040, a tab as
    \011, a newline as \012 and a backslash as \134)."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def parse_mountinfo(text: str) -> list[Mount]:
    """The mounts of /proc/self/mountinfo's text, in its order (a later one over an earlier).
    A line: ID PARENT MAJ:MIN ROOT POINT OPTIONS [OPTIONAL...] - TYPE SOURCE SUPER_OPTIONS."""
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        if "-" not in fields[6:]:
            continue
        dash = fields.index("-", 6)
        fstype, source, extra = (fields[dash + 1:] + ["", "", ""])[:3]
        options = []
        for option in fields[5].split(",") + extra.split(","):
            if (option in LOCK_OPTIONS or option.split("=")[0] in LOCK_OPTION_KEYS) and option not in options:
                options.append(option)
        mounts.append(Mount(unescape(fields[4]), fstype, unescape(source), tuple(options)))
    return mounts


def mount_of(path: str, mounts: list[Mount]) -> Mount | None:
    """The mount that holds `path` (absolute, resolved): the last one of the longest mount
    point that contains it."""
    best = None
    for mount in mounts:
        point = mount.point.rstrip("/") + "/"
        if (path + "/").startswith(point) and (best is None or len(mount.point) >= len(best.point)):
            best = mount
    return best


# ----------------------------------------------------------------------------- leases

LEASE_BEAT = 2.0  # seconds between a lease holder's signs of life (its record rewritten, its beat counted)
RECORD_PREFIX = "holder-"  # a lease's record: holder-<token>, the holder's own random token
ASIDE = (".new-", ".stale-", ".released-")  # LEASE.new-T: being placed; .stale-T: taken over; .released-T: let go
SLURM_LIVE = frozenset({"RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "STOPPED", "RESIZING", "SIGNALING",
                        "STAGE_OUT"})  # the job states whose processes may still run (squeue %T)
NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP)  # fcntl's locks where a file system has none (a lease holds there)
SLURM_RECHECK = 30.0  # seconds a waiter trusts what squeue said of a holder's job
NO_RECORD_BEATS = 10  # beats after which a lease that holds no record is gone, whatever its bound


@dataclasses.dataclass
class LeaseHolder:
    """A lease's holder as a waiter judges it: what its record says, whether it showed itself
    alive, or why it is gone (then the lease is taken over from it)."""
    names: tuple[str, ...]  # the records in the lease (one, in practice; none: not written yet)
    record: dict | None  # the record, or None where it is not (yet) whole JSON
    alive: bool = False  # shown alive: its pid lives (this host), its Slurm job runs, or its record changed lately
    gone: str = ""  # why it is gone, once judged so

    def __str__(self) -> str:
        return holder_text(self.record)


def holder_text(record: dict | None) -> str:
    """Who holds a lease, from its record: 'pid P on HOST since T' (', Slurm job J')."""
    try:
        text = f"pid {int(record['pid'])} on {record['host']} since {record['since']}"
    except (TypeError, KeyError, ValueError):
        return "a process that has not said who it is"
    return f"{text}, Slurm job {record['job']}" if record.get("job") else text


def process_start(pid: int) -> str | None:
    """When the process `pid` of this host started (field 22 of /proc/PID/stat, in clock ticks
    since boot: a pid reused by a later process has another), or None where it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()  # (the name in parentheses may hold spaces)
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def slurm_job_state(job: str, *, step: bool = False) -> str | None:
    """The state Slurm gives `job` ('' once Slurm no longer knows it), or None where squeue
    cannot tell (missing, failing, or showing nothing: a job of another user that PrivateData
    hides). With `step`, of the job step JOB.STEP of this process's own job: '' once squeue
    no longer lists it."""
    # (--jobs=, --steps=: squeue's short forms take their value only when written -j77, -s77.0)
    command = (["squeue", "-h", f"--steps={job}", "-o", "%i"] if step else
               ["squeue", "-h", "--states=all", f"--jobs={job}", "-o", "%T"])
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return "" if "invalid job id" in done.stderr.lower() else None
    states = done.stdout.split()
    if step:
        return "RUNNING" if job in states else ""
    return states[0] if states else None


def remove_folder(path: Path) -> None:
    """Remove a lease's folder set aside, as far as it goes (best-effort: it blocks nothing)."""
    shutil.rmtree(path, ignore_errors=True)


class Lease:
    """A hold on something shared that works on every file system that many nodes mount: a
    folder PATH that holds one record, PATH/holder-<token>, of who holds it (JSON: host, pid and
    the pid's start time, Slurm job and cluster, rank, since when, a beat counter). It is
    placed by renaming a folder made beside it, with the record already in it, onto PATH:
    a rename onto a folder that is there and not empty fails, and a rename is atomic on the
    server of NFSv3 and v4 (whatever the lock options: nolock, local_lock), Lustre (flock or
    localflock) and GPFS, where fcntl's locks may exclude only the processes of one node. PATH
    is never empty where it stands, so no rename can replace a held lease.

    While it holds the lease, a thread of the holder rewrites its record every LEASE_BEAT seconds
    (the beat counted), opening it by its path: if the record is gone, the lease was taken
    from this holder, judged gone while it lived (stopped, or its storage away), and
    `on_lost` is called (in that thread) so that two holders never go on together past a beat. (On NFS, a
    client that still has the moved folder cached meets the record removed: ESTALE.)

    A waiter judges the holder by its record, read anew at each look:
    - on this host (socket.gethostname()), it lives while its pid does with the same start
      time (a pid reused is caught); else it is gone at once;
    - a holder of this process's own Slurm job (and cluster) on another host: with
      `own_job_takes_over`, it is gone at once when it was a start of the job before a requeue
      (SLURM_RESTART_COUNT), or a step of it that squeue no longer lists (a restarted step);
      else (a rank of this very step, a step still listed) its beats decide;
    - a holder in another Slurm job of this cluster lives while squeue shows its job in a
      state whose processes may run (SLURM_LIVE), and is gone at once when squeue shows
      another state or no longer knows it ('Invalid job id'); where squeue is missing, fails
      or shows nothing (a job that PrivateData hides), its beats decide:
    - it lives while its record changes; with `stale_after`, it is gone once its record has
      not changed for `stale_after` seconds, timed on this process's own clock (the clocks of
      nodes differ). Without `stale_after`, silence never makes it gone: the caller decides
      how long to wait (silent_for). A lease whose record never appears (its holder died as
      it placed it) is gone after `stale_after`, or NO_RECORD_BEATS beats without it.

    A holder judged gone is taken over without ever letting two in: the lease is renamed
    aside to PATH.stale-<token> (of two takers, one rename succeeds), and is removed only if it
    still holds the very record judged gone; else (taken over by a third between the look and
    the rename) it is renamed back, and where that fails it is removed, so that its holder
    meets its record gone at its next beat and stops (on_lost, once a second look a moment
    later confirms it). Release renames the lease aside the same way before removing it."""

    def __init__(self, path: Path, *, stale_after: float | None, own_job_takes_over: bool = False,
                 on_lost: Callable[[], object] | None = None, rank: int | None = None):
        self.path, self.stale_after, self.own_job_takes_over = Path(path), stale_after, own_job_takes_over
        self.on_lost, self.beat = on_lost, LEASE_BEAT  # (read here: a test may shorten it)
        self.token = secrets.token_hex(8)
        self.host, self.job = socket.gethostname(), os.environ.get("SLURM_JOB_ID") or None
        self.cluster = os.environ.get("SLURM_CLUSTER_NAME") or None
        # which start of its job this is: the requeues before it, and its step
        self.restarts = os.environ.get("SLURM_RESTART_COUNT", "0") if self.job else None
        self.step = os.environ.get("SLURM_STEP_ID") or os.environ.get("SLURM_STEPID") or None
        self.record = {"host": self.host, "pid": os.getpid(), "start": process_start(os.getpid()), "job": self.job,
                       "cluster": self.cluster, "restarts": self.restarts, "step": self.step, "rank": rank,
                       "since": "", "beat": 0}
        self.held = False
        self.released = threading.Event()
        self.beats: threading.Thread | None = None
        self.seen: tuple | None = None  # what the last look found (records and bytes), to time its changes
        self.last_change = 0.0  # when it last changed, on this process's monotonic clock
        self.changed = False  # whether the holder's record changed while this process watched it
        self.jobs: dict[str, tuple[float, str | None]] = {}  # job -> (when asked, what squeue said)

    @property
    def record_path(self) -> Path:
        return self.path / f"{RECORD_PREFIX}{self.token}"

    def attempt(self) -> LeaseHolder | None:
        """Take the lease if it is free, or over from a holder judged gone (said in one line);
        None once this process holds it, else its holder as judged now. Call it again to go on
        watching the holder's signs of life."""
        holder = None
        for tries in range(10):  # (each race lost to another starter or taker looks again)
            if (tries or not self.path.exists()) and self.place():  # (a waiter mostly only looks)
                self.held = True
                self.beats = threading.Thread(target=self.beat_while_held, daemon=True, name="lease-beat")
                self.beats.start()
                self.tidy()
                return None
            holder = self.look()
            if holder is None:
                continue  # let go meanwhile
            if not holder.gone:
                return holder
            if self.take_over(holder):
                print(f"took over {self.path} from {holder}: {holder.gone}", file=sys.stderr, flush=True)
        return holder or LeaseHolder((), None)

    def place(self) -> bool:
        """Put this process's lease in place: its record written in a folder beside PATH, which
        is renamed onto PATH. False where PATH is held (or a cleanup removed the folder)."""
        fresh = self.path.with_name(f"{self.path.name}{ASIDE[0]}{self.token}")
        fresh.mkdir()  # (a folder that cannot be written to fails here, for the caller to say)
        self.record["since"] = time.strftime("%Y-%m-%d %H:%M:%S")
        try:
            fd = os.open(fresh / self.record_path.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                write_record(fd, self.record)
            finally:
                os.close(fd)
            os.rename(fresh, self.path)
            return self.record_path.exists()  # (not if a cleanup emptied the folder before the rename)
        except OSError as err:
            remove_folder(fresh)
            if err.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOENT, errno.ENOTDIR, errno.EISDIR):
                raise
            # (ENOENT: another holder's tidy removed the folder; or, on NFS, a rename whose answer
            # was lost and that was sent again: it did happen, and the record is in place)
            return self.record_path.exists()

    def look(self) -> LeaseHolder | None:
        """The lease's holder, judged now (None where nobody holds it)."""
        try:
            names = tuple(sorted(name for name in os.listdir(self.path) if name.startswith(RECORD_PREFIX)))
            raw = (self.path / names[0]).read_bytes() if names else b""  # (opened anew: on NFS, what the server holds)
        except FileNotFoundError:
            names, raw = None, b""  # (let go, or moved aside, meanwhile)
        except OSError:  # (a file server that answers ESTALE or EIO this once: nothing new seen)
            names, raw = self.seen if self.seen is not None else ((), b"")
        now = time.monotonic()
        if self.seen is None or self.seen[0] != names:  # another holder, or none
            self.last_change, self.changed = now, False
        elif self.seen[1] != raw:
            self.last_change, self.changed = now, True
        self.seen = (names, raw)
        if names is None:
            return None
        try:
            record = json.loads(raw)
            record = record if isinstance(record, dict) else None
        except ValueError:
            record = None
        holder = LeaseHolder(names, record)
        holder.alive, holder.gone = self.judge(record, now)
        return holder

    def judge(self, record: dict | None, now: float) -> tuple[bool, str]:
        """(shown alive, why gone) of a holder with `record`, as the class docstring says."""
        if record:
            pid, host, job = record.get("pid"), record.get("host"), record.get("job")
            if host == self.host and isinstance(pid, int):
                if process_start(pid) == record.get("start"):
                    return True, ""
                return False, "its process has ended"
            same_cluster = record.get("cluster") == self.cluster
            if job and job == self.job and same_cluster:  # this very job, on another node
                gone = self.own_job_start_gone(record) if self.own_job_takes_over else ""
                if gone:
                    return False, gone
            elif job and same_cluster:
                state = self.job_state(job)
                if state:
                    return (True, "") if state in SLURM_LIVE else (False, f"its Slurm job {job} is {state}")
                if state == "":
                    return False, f"Slurm no longer knows its job {job}"
        silent = now - self.last_change
        if self.stale_after is not None and silent >= self.stale_after:
            what = "showed no sign of life" if record else "never said who it is"
            return False, f"it {what} for {silent:.0f} s (the bound is {self.stale_after:g} s)"
        if record is None and silent >= NO_RECORD_BEATS * self.beat:
            return False, f"it never said who it is in {silent:.0f} s"
        return self.changed and (self.stale_after is None or silent < self.stale_after), ""

    def own_job_start_gone(self, record: dict) -> str:
        """Why a holder of this process's own Slurm job is an earlier start of it, and so gone
        ('' where it may be this very start, or squeue cannot tell)."""
        job, step = record.get("job"), record.get("step")
        if record.get("restarts") != self.restarts:
            return f"it was a start of this Slurm job ({job}) before it was requeued"
        if step and step != self.step and self.job_state(f"{job}.{step}", step=True) == "":
            return f"its step {job}.{step} of this Slurm job has ended"
        return ""

    def job_state(self, job: str, *, step: bool = False) -> str | None:
        """squeue's state of `job` (a job step JOB.STEP with `step`), asked at most every
        SLURM_RECHECK seconds."""
        asked, state = self.jobs.get(job, (-SLURM_RECHECK, None))
        if time.monotonic() - asked >= SLURM_RECHECK:
            asked, state = time.monotonic(), slurm_job_state(job, step=step)
            self.jobs[job] = (asked, state)
        return state

    def silent_for(self) -> float:
        """Seconds since the lease's record last changed (or its holder did), as this process saw it."""
        return time.monotonic() - self.last_change

    def take_over(self, holder: LeaseHolder) -> bool:
        """Remove the lease of `holder`, judged gone: True once it is gone, False where another
        process took it first (the lease is then left, or put back, as it is)."""
        return self.set_aside(ASIDE[1], holder.names)

    def set_aside(self, suffix: str, names: tuple[str, ...]) -> bool:
        """Rename the lease to PATH<suffix><token> and remove it there if it holds the records
        `names`; else rename it back (someone else's), as far as that goes."""
        aside = self.path.with_name(f"{self.path.name}{suffix}{self.token}")
        try:
            os.rename(self.path, aside)
        except OSError:  # (moved by another process first)
            return False
        try:
            found = tuple(sorted(name for name in os.listdir(aside) if name.startswith(RECORD_PREFIX)))
        except OSError:
            found = None
        if found == names:
            remove_folder(aside)
            return True
        try:
            os.rename(aside, self.path)
        except OSError:  # (a new lease in its place: this one's holder must meet its record gone)
            remove_folder(aside)
        return False

    def tidy(self) -> None:
        """Remove what other processes' leases left beside this one (killed while placing,
        taking over or letting go), best-effort."""
        for suffix in ASIDE[1:]:  # (not .new-: a starter may be placing it this moment)
            for leftover in self.path.parent.glob(f"{glob.escape(self.path.name)}{suffix}*"):
                if not leftover.name.endswith(self.token):
                    remove_folder(leftover)

    def beat_while_held(self) -> None:
        """The holder's sign of life: its record rewritten every `beat` seconds, its beat counted,
        until release; on_lost once the record is gone."""
        record = dict(self.record)
        while not self.released.wait(self.beat):
            record["beat"] += 1
            try:
                fd = os.open(self.record_path, os.O_WRONLY)  # (no O_CREAT: a record taken away stays away)
            except OSError as err:
                if err.errno not in (errno.ENOENT, errno.ESTALE) or self.back_in_place():
                    continue  # (a file server that is away: the waiters judge by the beats they see)
                if not self.released.is_set():
                    self.held = False  # (its release must leave the new holder's lease alone)
                    if self.on_lost:
                        self.on_lost()
                return
            try:
                write_record(fd, record)
            except OSError:
                pass
            finally:
                os.close(fd)

    def back_in_place(self) -> bool:
        """Whether this holder's record is there again a moment later (a taker that moved the
        lease aside by mistake puts it back at once)."""
        time.sleep(min(0.5, self.beat / 4))
        return self.record_path.exists()

    def release(self) -> None:
        """Let the lease go: stop the beats, and remove it (renamed aside first, so that it
        never stands empty) if it still holds this process's record."""
        self.released.set()
        if self.beats is not None and self.beats is not threading.current_thread():
            self.beats.join()
        if self.held and self.record_path.exists():
            self.set_aside(ASIDE[2], (self.record_path.name,))
        self.held = False


def write_record(fd: int, record: dict) -> None:
    """Write a lease's record over its file's, in one write from its start, cut to its length.
    Closing the file pushes it to the file server (NFS's close-to-open): a waiter on another
    node opens it anew."""
    data = (json.dumps(record) + "\n").encode()
    os.pwrite(fd, data, 0)
    os.ftruncate(fd, len(data))
