"""ddpkit/job/contract.py's requeue_job (rank 0's and the supervisor's) with a stand-in
scontrol (helpers.scontrol): a missing, failing or hanging scontrol means "not requeued",
not a crash; a refused requeue is not claimed; one Slurm accepts is announced before it and claimed; a job Slurm would not
requeue is not asked, and the output says why at once. The printed lines in real runs:
tests/runs/test_continue.py.

    python -m pytest tests/unit/test_requeue.py
"""

import contextlib
from pathlib import Path

import pytest

from ddpkit.job import contract
from helpers.scontrol import REQUEUEABLE, fake_scontrol, refusing_scontrol


@pytest.mark.parametrize("body", ["#!/nonexistent/interpreter\n", "#!/bin/sh\nexec /bin/sleep 30\n"], ids=["broken", "hangs"])
def test_scontrol_failure_means_not_requeued(tmp_path, monkeypatch, capsys, body):
    for name, value in fake_scontrol(tmp_path / "bin", body).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(contract, "SCONTROL_TIMEOUT", 1.0)
    assert contract.requeue_job("77") is False
    assert "could not requeue Slurm job 77 (scontrol: " in capsys.readouterr().out


def test_a_refused_requeue_is_not_claimed(tmp_path, monkeypatch, capsys):
    for name, value in refusing_scontrol(tmp_path / "bin").items():
        monkeypatch.setenv(name, value)
    assert contract.requeue_job("99") is False
    assert "could not requeue Slurm job 99 (scontrol requeue: scontrol: error: Requested operation is presently " \
           "disabled for job 99)" in capsys.readouterr().out


def recording_scontrol(directory: Path, output: Path, job_line: str, *, show: str = "", requeue: str = "") -> Path:
    """An scontrol that writes each call's arguments to directory/calls and answers `show job`
    with `job_line` (or runs `show` instead); `requeue` saves what the job's output file held
    at that moment (the requeue ends the job's processes) and runs `requeue` (default: succeeds)."""
    calls = directory / "calls"
    fake_scontrol(directory, f"""#!/bin/sh
echo "$*" >> {calls}
if [ "$1" = requeue ]; then /bin/cp {output} {directory}/output-at-requeue; {requeue or "exit 0"}; fi
{show or f'echo "{job_line}"'}
""")
    return calls


@contextlib.contextmanager
def job_output(path: Path):
    """stdout as in a batch job: a block-buffered file. What the file holds is what a user
    reading the job's output sees now, and what a kill would leave."""
    with open(path, "w") as out, contextlib.redirect_stdout(out):
        yield path.read_text


def test_a_requeue_that_slurm_accepts_is_announced_before_it_and_claimed(tmp_path, monkeypatch):
    output = tmp_path / "slurm-99.out"
    calls = recording_scontrol(tmp_path / "bin", output, REQUEUEABLE)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    with job_output(output):
        assert contract.requeue_job("99") is True
    assert calls.read_text() == "show job -o 99\nrequeue 99\n"
    assert (tmp_path / "bin" / "output-at-requeue").read_text() == \
        "requeueing Slurm job 99; it resumes from its last checkpoint\n"


@pytest.mark.parametrize("job_line, line", [
    (REQUEUEABLE.replace("BatchFlag=1", "BatchFlag=0"),
     "Slurm job 99 is an interactive allocation (salloc), which Slurm does not requeue"),
    (REQUEUEABLE.replace("Requeue=1", "Requeue=0"),
     "Slurm job 99 may not be requeued (it was submitted without --requeue)"),
], ids=["salloc", "no-requeue"])
def test_a_job_that_slurm_would_not_requeue_is_not_asked_and_the_output_says_why_at_once(tmp_path, monkeypatch, job_line,
                                                                                       line):
    output = tmp_path / "slurm-99.out"
    calls = recording_scontrol(tmp_path / "bin", output, job_line)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    with job_output(output) as printed:
        assert contract.requeue_job("99") is False
        assert printed() == line + "\n"
    assert calls.read_text() == "show job -o 99\n"


def test_a_job_scontrol_cannot_show_is_not_requeued_and_its_error_is_named(tmp_path, monkeypatch):
    output = tmp_path / "slurm-99.out"
    calls = recording_scontrol(tmp_path / "bin", output, "",
                               show='echo "scontrol: warning: slow"; echo "slurm_load_jobs error: Invalid job id '
                                    'specified" >&2; exit 1')
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    with job_output(output) as printed:
        assert contract.requeue_job("99") is False
        assert printed() == "could not requeue Slurm job 99 (scontrol show job: slurm_load_jobs error: Invalid job id " \
                            "specified)\n"
    assert calls.read_text() == "show job -o 99\n"


@pytest.mark.parametrize("requeue, line", [
    ("echo 'scontrol: error: Requested operation is presently disabled for job 99' >&2; exit 1",
     "could not requeue Slurm job 99 (scontrol requeue: scontrol: error: Requested operation is presently disabled "
     "for job 99)"),
    ("exit 3", "could not requeue Slurm job 99 (scontrol requeue: exit 3)"),
    ("exec /bin/sleep 30", "could not requeue Slurm job 99 (scontrol: Command '['scontrol', 'requeue', '99']' timed out "
                           "after 1.0 seconds)"),
], ids=["refused", "silent", "hangs"])
def test_a_requeue_that_fails_is_not_claimed_and_the_output_says_why_at_once(tmp_path, monkeypatch, requeue, line):
    output = tmp_path / "slurm-99.out"
    recording_scontrol(tmp_path / "bin", output, REQUEUEABLE, requeue=requeue)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.setattr(contract, "SCONTROL_TIMEOUT", 1.0)
    with job_output(output) as printed:
        assert contract.requeue_job("99") is False
        assert printed() == f"requeueing Slurm job 99; it resumes from its last checkpoint\n{line}\n"


def test_no_job_id_or_no_scontrol_means_not_requeued_and_nothing_asked(tmp_path, monkeypatch):
    output = tmp_path / "slurm-99.out"
    calls = recording_scontrol(tmp_path / "bin", output, REQUEUEABLE)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    with job_output(output) as printed:
        assert contract.requeue_job("") is False
        monkeypatch.setenv("PATH", str(tmp_path / "empty"))
        assert contract.requeue_job("99") is False
        assert printed() == ""
    assert not calls.exists()
