"""Data staging: getting a data set's files into the data directory (downloaded, or copied
from a file:// mirror), and into a node-local directory, once per node and once per shared
directory, behind a lock that holds across the nodes of any shared file system (data_lock).

The MNIST-like data sets are staged here in torchvision's layout (DATA_DIR/<Name>/raw), and
torchvision is imported only to fetch them: a run on staged data never loads it (seconds of
start-up). imagesets.py reads them, and image folders, into memory or a DataLoader."""

import contextlib
import errno
import fcntl
import hashlib
import io
import os
import shutil
import socket
import stat as stat_lib
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from ddpkit import hangs
from ddpkit.distributed import Runtime, all_ranks_agree
from ddpkit.files import LEASE_BEAT, NO_LOCKS, Lease, make_folder
from ddpkit.launch import PROG, HeldUp, UsageError
from ddpkit.options import RunOptions

REPOSITORY = Path(__file__).resolve().parents[2]
STATS_FILE = ".mnist-ddp-stats.json"  # an image folder's cached statistics (imagesets.py)
LOCK_FILE = ".mnist_ddp.lock"  # a data directory's lock, on one node (data_lock)
LOCK_LEASE = LOCK_FILE + ".lease"  # its lease, on every node, which names its holder (data_lock)
LOCK_NOTICE = 5.0  # seconds of waiting for the lock after which a line says who holds it


DIGITS = ("0 - zero", "1 - one", "2 - two", "3 - three", "4 - four", "5 - five", "6 - six", "7 - seven", "8 - eight",
          "9 - nine")
FASHION = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")
# The four IDX files of an MNIST-like set, unpacked: train images and labels, test images and labels.
RAW_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


@dataclass(frozen=True)
class MNISTLike:
    """An MNIST-format data set, staged as DATA_DIR/<name>/raw/RAW_FILES: torchvision's class
    `fetched_by` downloads and checks it, with `mirrors` and `resources` ((file, MD5) pairs)
    replacing that class's own when given."""
    name: str
    classes: tuple[str, ...]
    fetched_by: str
    mirrors: tuple[str, ...] = ()
    resources: tuple[tuple[str, str], ...] = ()

    def raw(self, data_dir: Path) -> Path:
        return data_dir / self.name / "raw"


# The bundled 4,000 + 1,000-image MNIST sample in data/mnist-sample (see its README). Its
# 'mirror' is that directory, so a smoke run stages it through the same download, checksum
# and parsing path as the full data sets.
MNIST_SAMPLE = MNISTLike("MNISTSample", DIGITS, "MNIST", mirrors=((REPOSITORY / "data" / "mnist-sample").as_uri() + "/",),
                         resources=(("train-images-idx3-ubyte.gz", "2ed410f5afecb048f3454a25670855ab"),
                                    ("train-labels-idx1-ubyte.gz", "3c3d8702adc7c424b6625947ddd63d9e"),
                                    ("t10k-images-idx3-ubyte.gz", "028fa3aaba12cfa6cc55aca87a16885c"),
                                    ("t10k-labels-idx1-ubyte.gz", "4d079c24de05debc9420a23a8263db82")))
MNIST_LIKE = {"mnist-sample": MNIST_SAMPLE, "mnist": MNISTLike("MNIST", DIGITS, "MNIST"),
              "fashion-mnist": MNISTLike("FashionMNIST", FASHION, "FashionMNIST")}


@contextlib.contextmanager
def data_lock(data_dir: Path, flag: str = "--data-dir", lacking: str = "", rt: Runtime | None = None):
    """Hold DATA_DIR/.mnist_ddp.lock: concurrent jobs, and nodes sharing a data directory,
    take turns at writing into it. Two holds, both needed: an fcntl lock on that file (on
    one node; across nodes only where the file system's locks reach, which NFS mounted
    nolock or local_lock and Lustre mounted localflock do not), and a lease beside it,
    DATA_DIR/.mnist_ddp.lock.lease (ddpkit.files.Lease), which excludes on every shared file
    system. A directory that cannot be written is refused in one line (`lacking` says what for).

    The lease names its holder (host, pid, rank, Slurm job, since when), and while it holds
    it a thread of its own rewrites that record every LEASE_BEAT seconds (a beat counter): a holder
    that works, however long (a download, measuring a whole training set), shows that it is
    alive. A waiter names the holder after LOCK_NOTICE seconds and waits while the beats go on;
    --dist-timeout (`rt`'s; outside a run, its default) after the last beat it saw, it ends
    with HeldUp (exit 4), naming the holder again: a holder that stopped, hung in a C call or
    is gone (a rank of this job, on another node) beats no more. A holder known to be gone
    (its process ended, on this host; its Slurm job no longer running; an earlier start of
    this process's own job) is taken over at once.
    (A holder that finds its lease taken from it says so and finishes: what two stagers
    write are the same checked files, each renamed into place whole.)"""
    path = data_dir / LOCK_FILE
    lease = Lease(data_dir / LOCK_LEASE, stale_after=None, own_job_takes_over=True, rank=rt.rank if rt else None,
                  on_lost=lambda: print(f"warning: another process took over {data_dir / LOCK_LEASE}, judging this "
                                        "one gone; this one finishes what it stages", file=sys.stderr, flush=True))
    with contextlib.ExitStack() as held:
        try:
            make_folder(data_dir)  # (each node's first rank, and other jobs, at once)
            lock_file = held.enter_context(open(os.open(path, os.O_RDWR | os.O_CREAT, 0o666), "r+b", buffering=0))
            wait_for_lock(lock_file, lease, path, rt)
        except OSError as err:
            raise UsageError(f"cannot write to {flag} {data_dir} ({err.strerror}){lacking}; pass a writable {flag}, "
                             "or stage the data into it elsewhere first") from None
        try:
            yield
        finally:
            lease.release()


def wait_for_lock(lock_file, lease: Lease, path: Path, rt: Runtime | None) -> None:
    """Take the lock of `lock_file` (at `path`) and the lease, waiting for their holder while
    it beats, and at most --dist-timeout after the last change of its record that this
    process saw. Beats are timed on this process's own clock when it sees them, so clocks
    that differ between nodes do not matter. The wait is labelled for the hang watch, so that
    a rank of this job that holds the lock and stopped is named as the one the others wait for."""
    limit = rt.timeout if rt else Runtime.timeout
    started, said, before = time.monotonic(), False, None
    try:
        while True:
            try:
                fcntl.lockf(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
            except OSError as err:
                if err.errno not in (errno.EACCES, errno.EAGAIN, *NO_LOCKS):
                    raise
                locked = err.errno in NO_LOCKS  # (a file system without locks: the lease alone)
            seen = lease.attempt() if locked else lease.look()  # (the lock's holder names itself in the lease)
            if locked and seen is None:
                return
            holder = lock_holder(seen.record if seen else None)
            if before is None:
                before = hangs.doing(f"the lock {path}, held by {holder}")
            if lease.silent_for() >= limit:
                raise HeldUp(f"waited for the lock {path}, held by {holder}, which showed no sign of life for {limit:g} s "
                             "(--dist-timeout): that process stopped or hangs. Nothing saved is lost: run_training.sbatch "
                             "starts the job again by itself (a rank of its own that holds the lock ends with it); elsewhere "
                             "end that process or wait for it, and run the same command again") from None
            if not said and time.monotonic() - started >= LOCK_NOTICE:
                print(f"{PROG}: waiting for the lock {path}, held by {holder}, as long as it shows it is alive (every "
                      f"{LEASE_BEAT:g} s), and at most {limit:g} s (--dist-timeout) after its last sign of life",
                      file=sys.stderr, flush=True)
                said = True
            time.sleep(0.2)
    finally:
        if before is not None:
            hangs.restore(before)


def lock_holder(record: dict | None) -> str:
    """Who holds a lock, as its holder wrote in its lease's record (on this host, how its
    process looks from outside: stopped, in uninterruptible I/O, gone)."""
    try:
        pid, host, rank = int(record["pid"]), str(record["host"]), record.get("rank")
        since = str(record["since"])
    except (ValueError, KeyError, TypeError):
        return "a process that has not said who it is"
    seen = f", {hangs.process_state(pid)}" if host == socket.gethostname() else ""
    who = f"rank {rank} " if isinstance(rank, int) else ""
    return f"{who}(pid {pid} on {host}, since {since}{seen})"


def remove_staging_leftovers(directory: Path) -> None:
    """Remove the .staging-* folders of stagings that were killed (SIGKILL, a node lost) in
    `directory`. Call it holding its data_lock: a staging folder is made and removed only
    under that lock, so none of them belongs to a staging still under way."""
    for leftover in sorted(directory.glob(".staging-*")):
        shutil.rmtree(leftover, ignore_errors=True)
        if not leftover.exists():
            print(f"removed {leftover}, left by a staging that never finished", file=sys.stderr, flush=True)


def mnist_like(dataset: str, mirror: str = "") -> MNISTLike:
    """The --dataset's description, its mirrors replaced by --data-mirror when given (the
    same name, so the files land in the same DATA_DIR/<Name>/raw folder)."""
    spec = MNIST_LIKE[dataset]
    return replace(spec, mirrors=(mirror.rstrip("/") + "/",)) if mirror else spec


def fetcher(spec: MNISTLike) -> type:
    """torchvision's class that downloads and checks `spec`'s files (imported only here)."""
    import torchvision.datasets

    base = getattr(torchvision.datasets, spec.fetched_by)
    changes = {"mirrors": list(spec.mirrors)} if spec.mirrors else {}
    if spec.resources:
        changes["resources"] = list(spec.resources)
    return type(spec.name, (base,), changes)


def copy_from_file_mirror(cls: type, raw: Path) -> None:
    """torchvision cannot fetch file:// URLs; copy such a mirror's files and let it check them."""
    from torchvision.datasets.utils import check_integrity

    mirror = cls.mirrors[0]
    if not mirror.startswith("file://"):
        return
    raw.mkdir(parents=True)
    for name, md5 in cls.resources:
        source = Path(urllib.request.url2pathname(urllib.parse.urlparse(mirror + name).path))
        shutil.copyfile(source, raw / name)
        if not check_integrity(str(raw / name), md5):
            raise RuntimeError(f"{source} does not have the expected MD5 {md5}")


def is_staged(spec: MNISTLike, data_dir: Path) -> bool:
    return all((spec.raw(data_dir) / name).is_file() for name in RAW_FILES)


def stage_dataset(spec: MNISTLike, data_dir: Path, source: Path | None = None, flag: str = "--data-dir", *,
                  rt: Runtime | None = None) -> bool:
    """Make DATA_DIR/<Name>/raw hold the unpacked files, downloaded or copied from the
    staged data directory `source`; True if it had to fetch them.

    A data directory that already holds the data is only read (it may be read-only). To
    fetch, a file lock in the data directory makes concurrent jobs (and nodes sharing an
    NFS data directory) take turns. Files are fetched and checked in a private staging
    directory and then renamed into place, so a reader never sees half a file and a
    crash mid-download leaves nothing behind that looks complete."""
    if is_staged(spec, data_dir):
        return False
    raw = spec.raw(data_dir)
    with data_lock(data_dir, flag, f" and it does not hold {spec.name} yet", rt):
        remove_staging_leftovers(data_dir)
        if is_staged(spec, data_dir):
            return False
        chatter = io.StringIO()
        try:
            with tempfile.TemporaryDirectory(dir=data_dir, prefix=".staging-") as staging:
                staged_raw = spec.raw(Path(staging))
                if source is not None:
                    shutil.copytree(spec.raw(source), staged_raw)
                else:
                    cls = fetcher(spec)
                    copy_from_file_mirror(cls, staged_raw)
                    with contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
                        cls(staging, train=True, download=True)
                raw.mkdir(parents=True, exist_ok=True)
                for name in RAW_FILES:
                    os.replace(staged_raw / name, raw / name)
        except (RuntimeError, OSError) as err:
            if source is not None:
                raise UsageError(f"cannot copy {spec.name} from {source} into the node-local {data_dir} "
                                 f"({getattr(err, 'strerror', None) or err}); free space there or pass another --node-data-dir") from None
            lines = [line.strip() for line in str(err).splitlines() + chatter.getvalue().splitlines() if line.strip()]
            reason = lines[-1] if lines else type(err).__name__
            names = ", ".join(name + ".gz" for name in RAW_FILES)
            raise UsageError(f"cannot download {spec.name} into {raw} ({reason}). Put {names} (or the unpacked files) "
                             f"there, e.g. run `python {PROG} --dataset ... --download-only` on a machine with internet, "
                             "or pass --data-mirror URL or --data-dir DIR") from None
    return True


def node_data_dir(config: RunOptions) -> Path | None:
    """--node-data-dir with $VARS and ~ expanded here, on the node (not at submission)."""
    if not config.node_data_dir:
        return None
    path = os.path.expandvars(os.path.expanduser(config.node_data_dir))
    if "$" in path:
        raise UsageError(f"--node-data-dir {config.node_data_dir}: {path} names a variable that is not set on "
                         f"{socket.gethostname()}; name a directory that exists on every node, e.g. '$TMPDIR/data'")
    return Path(path)


def stage(run: RunOptions, dataset: str, rt: Runtime, check_folder: Callable[[Path], object] | None = None) -> Path:
    """The first rank of each node stages the data set while the others wait; returns the
    directory every rank reads it from. An image folder has nothing to fetch: with
    --download-only, `check_folder` (imagesets.stage passes its read_folder) reads it as
    training would, so that a folder that would fail the job fails here, before its queue wait.

    One rank per node (not one per job) also covers node-local data directories; on a
    shared one, the lock lets only the first of them download. With --node-data-dir the
    shared directory is the source, and each node reads its own copy."""
    data_dir, local = Path(run.data_dir), None
    error = ""
    if rt.local_rank == 0:
        try:
            local = node_data_dir(run)
            if dataset in MNIST_LIKE:
                spec = mnist_like(dataset, run.data_mirror)
                if stage_dataset(spec, data_dir, rt=rt):
                    print(f"[rank {rt.rank}] staged {spec.name} in {spec.raw(data_dir)}", flush=True)
                if local is not None and stage_dataset(spec, local, source=data_dir, flag="--node-data-dir", rt=rt):
                    print(f"[rank {rt.rank}] copied {spec.name} to {local} on {socket.gethostname()}", flush=True)
            else:
                if run.download_only and check_folder:
                    check_folder(data_dir)
                if local is not None and copy_folder(data_dir, local, rt):
                    print(f"[rank {rt.rank}] copied {data_dir} to {local} on {socket.gethostname()}", flush=True)
        except UsageError as err:
            error = str(err)
    if not all_ranks_agree(not error, rt, "the barrier around staging the data"):
        raise UsageError(error or "another rank could not stage the data set; see its error above")
    return node_data_dir(run) or data_dir


def walk_readable(top: Path) -> tuple[list[str], list[str]]:
    """(folders, files) under `top`, `top` first, as os.walk(followlinks=True) orders them
    (each folder's files by name, then its subfolders by name), hidden entries skipped.

    Symlinks to files and to folders are followed, but no folder is entered twice: a symlink
    loop (class/loop -> ..) or a second link to a folder already read would count its images
    again, so it is refused by name, as are a broken symlink and a folder that cannot be
    listed. Every reader of an image folder (the listing, its fingerprint, the node-local
    copy) walks it here, on every rank: a plain file or folder is told by the type its
    directory entry records, so only folders and symlinks cost a stat (files_stamp makes the
    one stat of each file). A file that cannot be read is named by whatever reads it first
    (cannot_read)."""
    folders, files, seen = [], [], {}

    def visit(folder: str) -> None:
        stat = readable_stat(folder)
        if (stat.st_dev, stat.st_ino) in seen:
            raise UsageError(f"{folder} leads to {seen[stat.st_dev, stat.st_ino]} again (a symlink loop, or a second "
                             "link to one folder), so its images would count twice: remove that link")
        seen[stat.st_dev, stat.st_ino] = folder
        folders.append(folder)
        try:
            with os.scandir(folder) as listed:
                entries = sorted((entry for entry in listed if not entry.name.startswith(".")), key=lambda e: e.name)
                subfolders = []
                for entry in entries:
                    # is_dir() of a plain entry reads the type scandir already has (no stat), unless
                    # the file system leaves it unknown; a symlink is stat'ed to follow it.
                    is_folder = (stat_lib.S_ISDIR(readable_stat(entry.path).st_mode) if entry.is_symlink()
                                 else entry.is_dir(follow_symlinks=False))
                    (subfolders if is_folder else files).append(entry.path)
        except OSError as err:
            raise UsageError(f"cannot list {folder} ({err.strerror or err}): make it readable, or remove it") from None
        for path in subfolders:
            visit(path)

    visit(str(top))
    return folders, files


def readable_stat(path: str) -> os.stat_result:
    """The stat of what `path` names (through symlinks), refused in one line when it is a
    broken symlink or cannot be reached."""
    try:
        return os.stat(path)
    except OSError as err:
        if os.path.islink(path) and err.errno in (errno.ENOENT, errno.ENOTDIR):
            raise UsageError(f"{path} is a broken symlink (to {os.readlink(path)}, which does not exist): remove it, or "
                             "restore what it points to") from None
        raise cannot_read(path, err) from None


def cannot_read(path: str, err: OSError) -> UsageError:
    """The one line for a file or folder that cannot be read, named (a permission, an I/O error)."""
    if err.errno in (errno.EACCES, errno.EPERM):
        return UsageError(f"cannot read {path} (permission denied): make it readable (chmod a+r), or remove it")
    return UsageError(f"cannot read {path} ({err.strerror or err}): make it readable, or remove it")


def files_stamp(paths: list[str], root: Path) -> str:
    """A hash of each file's path relative to root, size and modification time: it changes
    when any of them does (imagesets' statistics cache and the node-local copy go by it)."""
    stamps = []
    for path in paths:
        stat = readable_stat(path)
        stamps.append(f"{os.path.relpath(path, root)}\t{stat.st_size}\t{stat.st_mtime_ns}\n")
    return hashlib.sha256("".join(stamps).encode()).hexdigest()


def copy_folder(source: Path, local: Path, rt: Runtime | None = None) -> bool:
    """Copy an image folder's train/ and test/ (and its cached statistics) to the node-local
    directory, unless a copy of the folder as it is now is there already; True if it copied."""
    missing = [part for part in ("train", "test") if not (source / part).is_dir()]
    if missing:
        raise UsageError(f"--data-dir {source} has no {missing[0]}/ folder: --dataset folder reads "
                         f"{source}/train/<class>/*.png|jpg and {source}/test/<class>/*")
    walked = {part: walk_readable(source / part) for part in ("train", "test")}  # (refuses what it cannot read)
    every_file = [path for _, files in walked.values() for path in files]
    done, stamp = local / ".copied-from", f"{source.resolve()}\n{files_stamp(every_file, source)}"
    if done.is_file() and done.read_text() == stamp:
        return False
    with data_lock(local, "--node-data-dir", rt=rt):
        remove_staging_leftovers(local)
        if done.is_file() and done.read_text() == stamp:
            return False
        try:
            for part, (folders, files) in walked.items():
                with tempfile.TemporaryDirectory(dir=local, prefix=".staging-") as staging:
                    # What was walked, symlinks copied as the files they point to (copy2: sizes and times kept).
                    for path in folders:
                        Path(staging, part, os.path.relpath(path, source / part)).mkdir(parents=True, exist_ok=True)
                    for path in files:
                        shutil.copy2(path, Path(staging, part, os.path.relpath(path, source / part)))
                    if (local / part).exists():
                        shutil.rmtree(local / part)
                    os.replace(Path(staging, part), local / part)
            if (source / STATS_FILE).is_file():
                shutil.copy2(source / STATS_FILE, local / STATS_FILE)
            done.write_text(stamp)
        except OSError as err:
            if err.errno in (errno.EACCES, errno.EPERM) and err.filename in every_file:
                raise cannot_read(err.filename, err) from None  # an image this user cannot read: not the copy's fault
            raise UsageError(f"cannot copy {source} into the node-local {local} ({err.strerror or err}); free space "
                             "there or pass another --node-data-dir") from None
    return True
