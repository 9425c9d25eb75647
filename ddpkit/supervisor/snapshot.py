"""The code a job runs: copied at its first start into RUN_DIR/code/job-<id>, which each
restart and requeue of the job runs (take_snapshot). Python 3.6, standard library only."""

import filecmp
import os
import shutil
import subprocess
from typing import List, Tuple

from ddpkit.job.contract import JobPaths
from ddpkit.supervisor.settings import JobError, Settings


def code_files(directory: str, leave_out: Tuple[str, ...] = ()) -> List[str]:
    """The code under a directory, relative to it: every .py file, outside hidden directories,
    virtual environments, __pycache__ and the directories in leave_out (the runs, the data).
    Not hidden files, nor links to nothing: an editor's lock (Emacs' .#mnist_ddp.py, a link
    while a file has unsaved edits) is no code, and nothing can import a dangling link."""
    names = []  # type: List[str]
    for top, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not (d.startswith(".") or d == "__pycache__"
                                                 or os.path.realpath(os.path.join(top, d)) in leave_out
                                                 or os.path.exists(os.path.join(top, d, "pyvenv.cfg"))
                                                 or os.path.isdir(os.path.join(top, d, "conda-meta"))))
        names += sorted(os.path.relpath(os.path.join(top, name), directory) for name in files
                        if name.endswith(".py") and not name.startswith(".") and os.path.exists(os.path.join(top, name)))
    return names


def code_copy(s: Settings) -> str:
    """Where this job's copy of its code lives: RUN_DIR/code/job-<id>."""
    return JobPaths(os.path.abspath(s.run_dir), s.job).code_copy


def take_snapshot(s: Settings) -> str:
    """The code this job runs, copied at its first start into RUN_DIR/code/job-<id>, which each
    restart and requeue of it runs, so that an edit to the project between its requeues
    changes nothing: every .py file of the training script's directory and below (with
    ddpkit/), the project's data/ and tensorboard.sh linked, and the git commit and the
    uncommitted changes when the project is a repository. Says in one line when the code
    differs from the run's previous job's (or from this job's own earlier start inside salloc)."""
    copy = code_copy(s)
    source = os.path.dirname(os.path.abspath(s.script))
    leave_out = tuple(os.path.realpath(d) for d in (s.log_dir, s.data_dir, s.shared and os.path.join(s.shared, "runs")))
    partial = copy + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        changed, previous = copy_code(s, source, leave_out, partial, copy)
    except BaseException as err:  # (Ctrl-C inside salloc too): no job-N.partial left behind
        shutil.rmtree(partial, ignore_errors=True)
        if isinstance(err, OSError):
            raise JobError(f"cannot copy the code this job runs into {copy} ({err.strerror or err}); set LOG_DIR to a "
                           "writable directory") from None
        raise
    if changed:
        print(f"code: this job runs code that differs from {os.path.basename(previous)}'s ({previous}): "
              f"{', '.join(changed)}", flush=True)
    return copy


def copy_code(s: Settings, source: str, leave_out: Tuple[str, ...], partial: str, copy: str) -> Tuple[List[str], str]:
    """take_snapshot's copy, into `partial`, then renamed to `copy`: (the files that differ from
    the previous copy, that copy or ""). A source file it cannot read is a JobError naming it;
    an OSError is the copy's own (LOG_DIR's)."""
    os.makedirs(os.path.join(partial, "ddpkit"))
    names = code_files(source, leave_out)
    if not os.path.isdir(os.path.join(source, "ddpkit")):  # a SCRIPT of the user's beside no ddpkit/
        names += [os.path.join("ddpkit", name) for name in code_files(os.path.join(s.project, "ddpkit"))]
    in_source = code_files(source)
    for name in names:
        os.makedirs(os.path.dirname(os.path.join(partial, name)), exist_ok=True)
        origin = os.path.join(s.project if name.startswith("ddpkit") and name not in in_source else source, name)
        check_readable(origin)
        shutil.copy2(origin, os.path.join(partial, name))
    for name in ("data", "tensorboard.sh"):
        if os.path.exists(os.path.join(s.project, name)) and not os.path.exists(os.path.join(partial, name)):
            os.symlink(os.path.join(os.path.abspath(s.project), name), os.path.join(partial, name))
    write_git_state(s.project, partial)
    previous = copy if os.path.isdir(copy) else newest_other_copy(os.path.dirname(copy), copy)
    changed = code_changes(previous, partial) if previous else []
    shutil.rmtree(copy, ignore_errors=True)  # (this job's own, from an earlier start inside salloc)
    os.rename(partial, copy)
    return changed, previous


def check_readable(path: str) -> None:
    """A source file of the code the job runs, which the copy must read: one line naming it
    when it cannot (a named pipe, a file the job's user may not read)."""
    why = "" if os.path.isfile(path) else "not a regular file"
    if not why:
        try:
            with open(path, "rb"):
                pass
        except OSError as err:
            why = err.strerror or str(err)
    if why:
        raise JobError(f"cannot copy {path} into the job's copy of its code ({why}); move it out of the project, or "
                       "make it a readable file")


def code_changes(previous: str, copy: str) -> List[str]:
    """The files that differ between two copies of the code (added, removed or changed)."""
    older, newer = code_files(previous), code_files(copy)
    return [name for name in sorted(set(older) | set(newer))
            if name not in older or name not in newer
            or not filecmp.cmp(os.path.join(previous, name), os.path.join(copy, name), shallow=False)]


def write_git_state(project: str, copy: str) -> None:
    """The commit and the uncommitted changes of the project, when it is a git repository (as
    bytes: a diff need not be text in any one encoding)."""
    if not shutil.which("git"):
        return
    try:
        commit = subprocess.run(["git", "-C", project, "rev-parse", "HEAD"], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, timeout=30)
        diff = subprocess.run(["git", "-C", project, "diff", "HEAD"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              timeout=30)
    except (OSError, subprocess.SubprocessError):
        return
    if commit.returncode == 0:
        with open(os.path.join(copy, "git-commit.txt"), "wb") as out:
            out.write(commit.stdout)
        with open(os.path.join(copy, "git.diff"), "wb") as out:
            out.write(diff.stdout)


def newest_other_copy(code: str, copy: str) -> str:
    """The copy of the run's previous job, or ""."""
    if not os.path.isdir(code):
        return ""
    others = [os.path.join(code, name) for name in os.listdir(code)
              if JobPaths.names_a_job(name) and not name.endswith(".partial") and os.path.join(code, name) != copy]
    return max(others, key=os.path.getmtime) if others else ""
