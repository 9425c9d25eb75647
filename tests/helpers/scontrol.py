"""Stand-ins for Slurm's scontrol, for runs and units without Slurm: a script on a PATH of its
own that shows a job, or refuses to requeue it."""

from pathlib import Path


def fake_scontrol(directory: Path, body: str) -> dict[str, str]:
    directory.mkdir()
    path = directory / "scontrol"
    path.write_text(body)
    path.chmod(0o755)
    return {"PATH": str(directory)}  # alone, so that no real scontrol stands behind it


# A job line as Slurm prints it for a batch job that may be requeued (shortened).
REQUEUEABLE = "JobId=99 JobName=x JobState=RUNNING Requeue=1 Restarts=0 BatchFlag=1 TimeLimit=UNLIMITED"


def refusing_scontrol(directory: Path) -> dict[str, str]:
    """An scontrol that shows a requeueable batch job but whose `requeue` fails, as when the
    controller refuses it: the thing tested is the run's answer to that."""
    return fake_scontrol(directory, f"""#!/bin/sh
if [ "$1" = requeue ]; then echo "scontrol: error: Requested operation is presently disabled for job $2" >&2; exit 1; fi
echo "{REQUEUEABLE}"
""")
