"""The copy of the code a job runs (ddpkit/supervisor/snapshot.py): what it holds, what it
leaves out, a new copy for a new job, one line when the code differs or a file cannot be
copied.

    python -m pytest tests/unit/test_supervisor_snapshot.py
"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from ddpkit.supervisor.settings import JobError
from ddpkit.supervisor.snapshot import code_files, take_snapshot
from helpers.supervisor import settings


def test_a_job_runs_a_copy_of_its_code_taken_at_its_first_start(tmp_path, capsys):
    """What the copy holds; a new job of the run, or the same job run again inside salloc,
    takes a new one and says in one line when the code differs. (That a requeue runs the
    copy it has: tests/cluster/one_node/test_slurm.py, on a real Slurm.)"""
    s = settings(tmp_path)
    project = Path(s.project)
    (project / "ddpkit" / "jobs.py").write_text("A = 1\n")
    (project / "sweep.py").write_text("")
    (project / "models").mkdir()
    (project / "models" / "resnet.py").write_text("")  # a package of the user's, beside the script
    (project / "data").mkdir()
    subprocess.run(["git", "init", "-q", str(project)], check=True)
    subprocess.run(["git", "-C", str(project), "add", "."], check=True)
    subprocess.run(["git", "-C", str(project), "-c", "user.name=a", "-c", "user.email=a@b", "commit", "-qm", "x"], check=True)
    (project / "mnist_ddp.py").write_text("print('edited before the job started: é')\n")
    for name in (".git/hooks/x.py", ".venv/lib/site.py", "__pycache__/m.py", "runs/job-1/code/job-1/m.py"):
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text("")
    (project / ".venv" / "pyvenv.cfg").write_text("")
    (project / "env" / "conda-meta").mkdir(parents=True)
    (project / "env" / "lib.py").write_text("")
    copy = Path(take_snapshot(settings(tmp_path, LOG_DIR=str(project / "runs"))))
    assert copy == project / "runs" / "job-77" / "code" / "job-77"
    assert code_files(str(copy)) == ["mnist_ddp.py", "sweep.py", "ddpkit/jobs.py", "models/resnet.py"]
    assert (copy / "data").resolve() == project / "data"
    assert len((copy / "git-commit.txt").read_text().strip()) == 40
    assert "+print('edited before the job started: é')" in (copy / "git.diff").read_text()
    assert capsys.readouterr().out == ""
    # The same job started again (inside salloc) takes the code as it is now.
    (project / "mnist_ddp.py").write_text("raise SystemExit(1)\n")
    again = settings(tmp_path, LOG_DIR=str(project / "runs"))
    assert take_snapshot(again) == str(copy)
    assert (copy / "mnist_ddp.py").read_text() == "raise SystemExit(1)\n"
    assert capsys.readouterr().out == f"code: this job runs code that differs from job-77's ({copy}): mnist_ddp.py\n"
    # A new job of the same run takes a new copy, and says so when the code differs.
    (project / "ddpkit" / "jobs.py").unlink()
    take_snapshot(settings(tmp_path, LOG_DIR=str(project / "runs"), SLURM_JOB_ID="78", RUN_NAME="job-77"))
    assert capsys.readouterr().out == f"code: this job runs code that differs from job-77's ({copy}): ddpkit/jobs.py\n"
    take_snapshot(settings(tmp_path, LOG_DIR=str(project / "runs"), SLURM_JOB_ID="79", RUN_NAME="job-77"))
    assert capsys.readouterr().out == ""  # (the same as job 78's)


def test_a_copy_that_cannot_be_written_is_one_line(tmp_path):
    s = settings(tmp_path, LOG_DIR="/proc/version/runs")
    with pytest.raises(JobError, match="cannot copy the code this job runs into /proc/version/runs/job-77/code/job-77"):
        take_snapshot(s)


def test_the_copy_takes_what_the_job_runs_and_names_a_file_it_cannot_copy(tmp_path):
    """Emacs leaves .#mnist_ddp.py, a dangling symlink, beside a file with unsaved edits: the
    copy leaves it out, as any dangling link (nothing can import it). A .py it cannot read
    (here a named pipe) is named in one line that does not blame LOG_DIR, and no
    job-N.partial folder is left behind."""
    s = settings(tmp_path)
    project = Path(s.project)
    (project / ".#mnist_ddp.py").symlink_to("ann@login1.4242:1764000000")
    (project / "old.py").symlink_to("moved-away.py")
    copy = Path(take_snapshot(s))
    assert code_files(str(copy)) == ["mnist_ddp.py"]
    os.mkfifo(project / "pipe.py")
    with pytest.raises(JobError) as raised:
        take_snapshot(s)
    assert str(raised.value) == (f"cannot copy {project}/pipe.py into the job's copy of its code (not a regular file); "
                                 "move it out of the project, or make it a readable file")
    assert sorted(os.listdir(copy.parent)) == ["job-77"]  # (the earlier copy kept, no .partial)
    shutil.rmtree(copy)
    with pytest.raises(JobError):
        take_snapshot(s)
    assert os.listdir(copy.parent) == []
