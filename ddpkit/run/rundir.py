"""Run directories: choosing the run's directory (LOG_DIR/RUN_NAME, the Slurm job's, or a
new one named by the time) and holding it for as long as the run lives, so that a second
run of the same name stops with one line instead of writing into the first one's files."""

import contextlib
import errno
import fcntl
import itertools
import os
import socket
import time
from pathlib import Path

from ddpkit.distributed import Runtime, broadcast_from_main
from ddpkit.files import make_folder
from ddpkit.job.contract import JobPaths, default_run_name, run_name_setting
from ddpkit.launch import Launch, UsageError, write_exit_file
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


class RunClaim:
    """Rank 0's hold on its run directory for as long as the run lives: an exclusive lock
    on RUN_DIR/.claim. POSIX locks also work across NFS clients, and the kernel releases
    them when the process dies, even by SIGKILL, so a restart or a requeue gets it again.
    (On NFS, the lock of a node that was lost outright lasts until the server notices,
    its lock recovery; the refusal names the holder.) A second run of the same name (a
    resubmission while the first still runs) meets it and stops with one line, before it
    reads a checkpoint that the first one is writing."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        make_folder(run_dir)  # (its LOG_DIR too, which other jobs may be making)
        self.file = open(run_dir / ".claim", "a+")
        try:
            fcntl.lockf(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno == errno.ENOLCK:
                self.file.close()
                raise UsageError(f"cannot lock {run_dir / '.claim'}: its file system offers no locks (NFS without a lock "
                                 "service); ask your admins, or pass a --log-dir on another file system") from None
            if err.errno not in (errno.EACCES, errno.EAGAIN):
                raise
            holder = ""
            for _ in range(20):  # the holder writes who it is just after it locks: give it a second
                self.file.seek(0)
                holder = self.file.read().strip()
                if holder:
                    break
                time.sleep(0.05)
            self.file.close()
            holder = holder or "another process"
            raise RunDirTaken(f"another run is using {run_dir} ({holder}); wait for it to end, or pass another "
                              f"{run_name_setting()} to start a separate run") from None
        self.file.seek(0)
        self.file.truncate()
        self.file.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        self.file.flush()
        Path(JobPaths(str(run_dir)).exit_code).unlink(missing_ok=True)  # written again when this attempt ends

    def release(self, code: int) -> None:
        """Record how this attempt ended, for run_training.sbatch, sweep.py summary and
        whoever reads the directory, then let the next run in."""
        with contextlib.suppress(OSError):
            Path(JobPaths(str(self.run_dir)).exit_code).write_text(f"{code}\n")
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
            claim = RunClaim(run_dir)
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
