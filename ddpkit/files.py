"""Writes that a crash never leaves half done: each goes to a temporary file beside its
target, then is renamed over it (atomic on POSIX and NFS), so a reader or a kill meets the
old file or the new one, never half of one. A failed write removes its temporary file: left
there, it would keep a full disk full for every later attempt. Beside them, what shared
storage asks of files that several nodes touch: folders that many ranks create at once
(make_folder), a file another node wrote moments ago (read_written_elsewhere), and which
mount holds a path, with its options that decide what a lock does (parse_mountinfo).

Standard library only (torch is imported by save_atomic alone): the hang watchdog and the
tracker's sender use it too."""

import contextlib
import errno
import json
import os
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
                           short_read: tuple[type[BaseException], ...] = (), seconds: float | None = None) -> T:
    """`read(path)`, for a file another node may have written moments ago (the checkpoint
    rank 0 chose). ENOENT and ESTALE are retried for `seconds` (REREAD_SECONDS), with pauses
    from 0.1 s doubling to 5 s, and so is a short file: one smaller than `size`, the size its
    writer saw (when it told it), or one whose `read` raised an exception of `short_read`
    (torch.load of a truncated file: RuntimeError, EOFError) while its size was not yet
    `size`. Then FileNotSeen, whose line names the file, its file system and what to do."""
    seconds = REREAD_SECONDS if seconds is None else seconds
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
