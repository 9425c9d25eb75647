"""Run directories: choosing the run's directory (LOG_DIR/RUN_NAME, the Slurm job's, or a
new one named by the time) and holding it for as long as the run lives, so that a second
run of the same name stops with one line instead of writing into the first one's files.

What holds the run's directory on which storage (RunClaim: an fcntl lock and a lease, both held):
- node-local scratch, a default NFS mount (with its lock service), Lustre mounted flock, GPFS:
  the lock excludes across processes and nodes, and the lease does too;
- NFS mounted nolock or local_lock=all|posix|flock, Lustre mounted localflock: the lock excludes
  only the processes of one node, the lease every node (a rename is atomic on the server);
- a file system that offers no locks at all (ENOLCK, ENOSYS): the lease alone.
A claim whose holder is gone never blocks: see RunClaim for how soon it is taken over."""

import contextlib
import errno
import fcntl
import itertools
import os
import sys
import time
from pathlib import Path

from ddpkit import hangs
from ddpkit.distributed import Runtime, broadcast_from_main
from ddpkit.files import LEASE_BEAT, NO_LOCKS, Lease, LeaseHolder, make_folder
from ddpkit.job.contract import EXIT_USAGE, JobPaths, default_run_name, run_name_setting
from ddpkit.launch import PROG, Launch, UsageError, record_exit, write_exit_file
from ddpkit.options import RunOptions
from ddpkit.run.recovery import storage_problem


def choose_run_dir(config: RunOptions, launch: Launch) -> Path:
    """Rank 0's choice of the run's directory: LOG_DIR/RUN_NAME; without a name, the Slurm
    job id when there is one (a requeued job finds its own directory again), else a new
    directory named by the time, created here so that runs started in the same second
    each get their own."""
    if config.run_dir:
        return Path(config.run_dir)
    if config.run_name:
        return Path(config.log_dir, config.run_name)
    if launch.job_id:
        return Path(config.log_dir, default_run_name(launch.job_id))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    make_folder(config.log_dir)  # (other jobs may make it at the same moment, on other nodes)
    for n in itertools.count(1):
        path = Path(config.log_dir, stamp if n == 1 else f"{stamp}-{n}")
        with contextlib.suppress(FileExistsError):
            path.mkdir()
            return path


class RunDirTaken(UsageError):
    """Another run holds the run directory."""


CLAIM_FILE = ".claim"  # RUN_DIR/.claim: the kernel's lock on the run's directory, on one node
CLAIM_LEASE = ".claim.lease"  # RUN_DIR/.claim.lease: the lease on it, across nodes (ddpkit.files.Lease)
CLAIM_STALE = 60.0  # seconds without a sign of life after which a claim that neither its host nor Slurm vouches for is gone


class RunClaim:
    """Rank 0's hold on its run directory for as long as the run lives, so that a second run
    of the same name (a resubmission while the first still runs) stops with one line naming
    the holder, exit 2, before it reads a checkpoint that the first one is writing.

    Two holds, both needed: an fcntl lock on RUN_DIR/.claim (on one node, and across nodes
    where the file system's locks reach; the kernel drops it when the process dies), and the
    lease RUN_DIR/.claim.lease (ddpkit.files.Lease), whose record names the holder (pid, host,
    Slurm job, since) and is rewritten every 2 s. A lease whose holder is gone never blocks:
    on the same host it is taken over at once when the holder's process has ended; a later
    start of the holder's own Slurm job takes it over at once (a requeue; a restarted step
    once squeue no longer lists the holder's step); a holder in another job of this Slurm
    cluster is gone once squeue no longer shows that job running; else once its record has
    not changed for CLAIM_STALE (60) seconds, at most half of --dist-timeout (which the other
    ranks wait with), timed by the newcomer. A holder shown alive (its pid, its running job,
    a beat) is refused at once. A holder judged gone while it lived (frozen, or cut off from
    the storage for longer) finds its record gone at its next beat and stops at once, exit 2:
    two runs overlap by one beat (2 s) at most."""

    def __init__(self, run_dir: Path, launch: Launch | None = None, *, stale_after: float = CLAIM_STALE):
        self.run_dir, self.launch = run_dir, launch
        make_folder(run_dir)  # (its LOG_DIR too, which other jobs may be making)
        self.lease = Lease(run_dir / CLAIM_LEASE, stale_after=stale_after, own_job_takes_over=True, on_lost=self.lost,
                           rank=0)
        self.file = open(run_dir / CLAIM_FILE, "a+")
        try:
            fcntl.lockf(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in NO_LOCKS:  # (a file system without locks: the lease alone)
                self.file.close()
                if err.errno in (errno.EACCES, errno.EAGAIN):
                    raise self.taken(self.lock_holder()) from None
                raise
        try:
            self.take_lease()
        except BaseException:
            self.file.close()
            raise
        Path(JobPaths(str(run_dir)).exit_code).unlink(missing_ok=True)  # written again when this attempt ends

    def lock_holder(self) -> LeaseHolder | None:
        """The holder of the lock, as its lease names it (it takes the lease just after it
        locks: this gives it a second)."""
        holder = None
        for _ in range(20):
            holder = self.lease.look()
            if holder and holder.record:
                break
            time.sleep(0.05)
        return holder

    def take_lease(self) -> None:
        """Take the lease, waiting only while its holder may be gone and has not shown itself alive."""
        before = None
        try:
            while (holder := self.lease.attempt()) is not None:
                if holder.alive:
                    raise self.taken(holder)
                if before is None:
                    print(f"{PROG}: {self.run_dir} is held by {holder}, which this host and Slurm cannot vouch for: "
                          f"waiting for a sign of its life, at most {self.lease.stale_after:g} s, before this run takes "
                          "it over", file=sys.stderr, flush=True)
                    before = hangs.doing(f"waiting for a sign of life of {holder}, which holds {self.run_dir}")
                time.sleep(0.2)
        finally:
            if before is not None:
                hangs.restore(before)

    def taken(self, holder: LeaseHolder | None) -> "RunDirTaken":
        return RunDirTaken(f"another run is using {self.run_dir} ({holder or 'another process'}); wait for it to end, or "
                           f"pass another {run_name_setting()} to start a separate run")

    def lost(self) -> None:
        """The lease was taken from this run, judged gone while it lived: stop at once, before
        it writes once more into a directory that another run now uses."""
        print(f"{PROG}: error: another run took over {self.run_dir} ({self.run_dir / CLAIM_LEASE} no longer holds this "
              "run's record: it judged this one gone, stopped or cut off from the storage); this run stops at once so "
              "that two runs never write into one directory", file=sys.stderr, flush=True)
        if self.launch:
            with contextlib.suppress(OSError):
                write_exit_file(self.launch, self.launch.paths.run_dir_taken, "")
            record_exit(EXIT_USAGE, self.launch)
        os._exit(EXIT_USAGE)

    def release(self, code: int) -> None:
        """Record how this attempt ended, for run_training.sbatch, sweep.py summary and
        whoever reads the directory, then let the next run in."""
        with contextlib.suppress(OSError):
            Path(JobPaths(str(self.run_dir)).exit_code).write_text(f"{code}\n")
        self.lease.release()
        self.file.close()


def agree_on_run_dir(config: RunOptions, launch: Launch, rt: Runtime) -> tuple[Path, bool]:
    """Rank 0 chooses the run's directory (choose_run_dir) and tells every rank, right after
    the process group is made (the hang reports of the start-up go there): (it, whether it is
    new, a directory this start made or will make, which end_job removes again if the start
    left nothing in it)."""
    choice = ["", False, ""]
    if rt.is_main:
        try:
            if config.run_dir or config.run_name or launch.job_id:
                path = choose_run_dir(config, launch)
                choice = [str(path), not path.exists(), ""]
            else:  # a new directory named by the time, made here
                choice = [str(choose_run_dir(config, launch)), True, ""]
        except OSError as err:  # a log directory that is a file, read-only or full
            choice = ["", False, storage_problem(err, config)]
            if not choice[2]:
                raise
    run_dir, new, error = broadcast_from_main(choice, "sharing the run directory's name")
    if error:
        raise UsageError(error if rt.is_main else "rank 0 cannot use the run directory; see its error")
    return Path(run_dir), new


def claim_run_dir(config: RunOptions, launch: Launch, rt: Runtime, run_dir: Path) -> RunClaim | None:
    """Rank 0 claims the run's directory (agree_on_run_dir's), and tells every rank whether it could."""
    claim, error = None, ""
    if rt.is_main:
        try:
            # (the other ranks wait for the claim with --dist-timeout: a silent holder is waited for less)
            claim = RunClaim(run_dir, launch, stale_after=max(5 * LEASE_BEAT, min(CLAIM_STALE, config.dist_timeout / 2)))
        except UsageError as err:
            error = str(err)
            if isinstance(err, RunDirTaken):  # so the batch file leaves that run's files alone
                write_exit_file(launch, launch.paths.run_dir_taken, "")
        except OSError as err:  # a log directory that is a file, read-only or full
            error = storage_problem(err, config)
            if not error:
                raise
    error = broadcast_from_main(error, "claiming the run directory")
    if error:
        raise UsageError(error if rt.is_main else "rank 0 cannot use the run directory; see its error")
    return claim
