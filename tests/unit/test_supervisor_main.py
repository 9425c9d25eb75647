"""The job's supervisor (ddpkit/supervisor/main.py) as Python, without Slurm: the job from its
START line to its END line with an srun that records each step, restarts and the options
they leave out, the nodes it goes on with after a lost one; that it and what it imports
need nothing newer than Python 3.6 (vermin); and run_training.sbatch's own one-line
refusals (outside Slurm, no python3 on the node). tests/cluster/ runs it all on a real
Slurm.

    python -m pytest tests/unit/test_supervisor_main.py
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ddpkit.job.contract import JobEnv, JobPaths
from ddpkit.supervisor.main import Supervisor
from ddpkit.supervisor.outcome import Outcome
from helpers.cluster import SBATCH_FILE
from helpers.pages import assert_quoted_whole
from helpers.processes import ROOT, clean_env
from helpers.supervisor import LINE, settings, stand_in_project

BIN = Path(sys.executable).parent


def scontrol_showing(directory: Path, line: str) -> str:
    """A PATH whose scontrol shows `line` for any job and refuses every requeue."""
    directory.mkdir()
    (directory / "scontrol").write_text(f"""#!/bin/sh
if [ "$1" = requeue ]; then echo "scontrol: error: Job has been denied requeue" >&2; exit 1; fi
echo "{line}"
""")
    (directory / "scontrol").chmod(0o755)
    return str(directory)


def test_the_supervisor_goes_on_with_the_nodes_scontrol_shows_or_says_why_it_cannot(tmp_path, monkeypatch, capsys):
    """After a step lost to a node: all nodes held, the same step again; 1 of 2 held with
    MIN_NODES=1, 2 ranks on it (settled as 2 from then on); with MIN_NODES unset, a requeue,
    which Slurm refuses here, and the outcome says so."""
    killed = Outcome(137, True, "rank 2 3 ended without an exit code")
    monkeypatch.setenv("PATH", scontrol_showing(tmp_path / "all", LINE + " NumNodes=2 NodeList=n[1-2]"))
    supervisor = Supervisor(settings(tmp_path, MIN_NODES="1"), LINE, "/code/ddpkit/supervisor/main.py")
    assert supervisor.nodes_held_now(killed) == ""
    monkeypatch.setenv("PATH", scontrol_showing(tmp_path / "one", LINE + " NumNodes=1 NodeList=n1"))
    assert supervisor.nodes_held_now(killed) == (": the job holds 1 of its 2 nodes (n1), so on 1 node(s) with 2 rank(s) "
                                                 "instead of 4")
    assert (supervisor.step.nodes, supervisor.step.ntasks, supervisor.s.nodes) == (1, 2, 2)
    whole = Supervisor(settings(tmp_path), LINE, "/code/ddpkit/supervisor/main.py")
    assert whole.nodes_held_now(killed) is None
    assert ("requeueing Slurm job 77 after exit 137: the job holds 1 of its 2 nodes (n1), fewer than MIN_NODES=2 "
            "(unset: every node of the job); it resumes") in capsys.readouterr().out
    assert killed.why.endswith("and it was not requeued") and (whole.step.nodes, whole.step.ntasks) == (2, 4)
    weak = Supervisor(settings(tmp_path, MIN_NODES="1"), LINE, "/code/ddpkit/supervisor/main.py")
    os.makedirs(weak.s.job_dir, exist_ok=True)
    Path(weak.s.job_dir, JobPaths.WORLD_SIZES).write_text("4\n")  # (--batch-size per rank: 4 ranks alone keep it)
    assert weak.nodes_held_now(Outcome(4, True, "rank 0 lost contact")) is None
    assert ("the job holds 1 of its 2 nodes (n1), and no count of them from MIN_NODES=1 up, at 2 rank(s) a node, keeps "
            "the global batch; it resumes") in capsys.readouterr().out


def test_a_step_killed_by_a_signal_is_128_plus_its_number_as_a_shell_says(tmp_path):
    """What settle reads as killed (and restarts): Popen's -9 is the shell's 137."""
    supervisor = Supervisor(settings(tmp_path), "", "t.py")
    assert supervisor.run_step(["sh", "-c", "kill -KILL $$"]) == 137
    assert supervisor.run_step(["sh", "-c", "exit 4"]) == 4


# ----------------------------------------------------------------------------- what runs on the host

def test_what_the_host_runs_needs_nothing_newer_than_python_3_6():
    """run_training.sbatch hands over to ddpkit/supervisor/main.py with the host's python3 (the
    ranks' PYTHON may exist only in a container), which may be 3.6 (RHEL 8): it and what it
    imports (the whole supervisor, the contract, the sweep lines) use nothing newer, as
    vermin reads them."""
    assert 'exec python3 "$project/ddpkit/supervisor/main.py" supervise' in SBATCH_FILE.read_text()
    result = subprocess.run([str(BIN / "vermin"), "--target=3.6-", "--no-tips", "--violations", "ddpkit/supervisor",
                             "ddpkit/job"], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    imports = subprocess.run(["python3", "-c", "import sys; import ddpkit.supervisor.main; "
                              "print(sorted(m for m in sys.modules if m.startswith('ddpkit')))"],
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
    wing = [f"ddpkit.supervisor.{path.stem}" for path in (ROOT / "ddpkit" / "supervisor").glob("[!_]*.py")]
    assert imports.stdout.strip() == str(sorted(["ddpkit", "ddpkit.job", "ddpkit.job.contract", "ddpkit.supervisor", "ddpkit.job.sweeplines",
                                                 *wing])), imports.stderr


def test_the_supervisor_outside_slurm_is_one_line():
    result = subprocess.run(["python3", str(ROOT / "ddpkit" / "supervisor" / "main.py"), "supervise", "--project", str(ROOT),
                             "--batch-file", str(SBATCH_FILE), "--environment", "python3 on the PATH", "--",
                             "--epochs", "1", "--", "x"],
                            env=clean_env(PATH="/usr/bin:/bin"), capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stderr) == (2, "run_training.sbatch: error: not inside a Slurm job. Submit it: "
                                                     "sbatch run_training.sbatch [options]\n")


@pytest.mark.parametrize("env, error", [
    ({}, "not inside a Slurm job. Submit it: sbatch run_training.sbatch [options]; without Slurm use: torchrun "
         "--standalone --nproc-per-node N mnist_ddp.py [options]"),
    ({"SLURM_JOB_ID": "5"}, "this node has no python3 on the PATH, which runs the job's supervisor "
                            "(ddpkit/supervisor/main.py, Python 3.6 or newer); load a python module in cluster-env.sh or SETUP"),
])
def test_the_batch_file_without_slurm_or_without_python3_is_one_line(tmp_path, env, error):
    """Run as bash would run it (a copy, in a project without a .venv) on a node whose PATH has
    the shell's tools and no python3."""
    tools, project = tmp_path / "bin", tmp_path / "project"
    tools.mkdir()
    for name in ("dirname", "realpath", "basename"):
        (tools / name).symlink_to(f"/usr/bin/{name}")
    (project / "ddpkit" / "supervisor").mkdir(parents=True)
    shutil.copy(ROOT / "ddpkit" / "supervisor" / "main.py", project / "ddpkit" / "supervisor")
    shutil.copy(SBATCH_FILE, project)
    result = subprocess.run(["/bin/bash", str(project / "run_training.sbatch"), "--epochs", "1"], cwd=tmp_path,
                            env={"PATH": str(tools), "SLURM_SUBMIT_DIR": str(tmp_path), **env},
                            capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stderr) == (2, f"run_training.sbatch: error: {error}\n")
    assert sorted(os.listdir(tmp_path)) == ["bin", "project"]  # nothing written


# ----------------------------------------------------------------------------- the supervisor's steps

def supervised_job(tmp_path: Path, srun_exits: str, args: list, requeue_wait: int = 0, **env: str
                   ) -> subprocess.CompletedProcess:
    """The supervisor as run_training.sbatch hands over to it, in a job of 1 node and 2 ranks
    whose project is a copy in tmp_path/project. On its PATH, srun records each step's command
    (a line of srun.log: the copy's mnist_ddp.py it runs, then the training options), runs
    tmp_path/srun-leaves when there is one (the files the ranks leave) and exits with the next
    of `srun_exits` (137: killed, as srun reports it); scontrol shows the job N whose line
    tmp_path/shows-N holds and knows no other, and refuses every requeue, unless
    tmp_path/requeue-accepted exists (then it accepts it, and leaves the job running as a slow
    Slurm would: `requeue_wait` shortens the supervisor's wait for its end); sbatch records its arguments (sbatch-args),
    some of its environment (sbatch-env) and where it ran (sbatch-cwd), and submits job 1234,
    or fails with the message tmp_path/sbatch-refuses holds; PYTHON answers the supervisor's
    check that it imports torch."""
    project, tools = tmp_path / "project", tmp_path / "bin"
    if not project.exists():
        stand_in_project(project, tools)
        (tools / "srun").write_text(f"""#!/bin/bash
while [[ $1 == -* ]]; do shift; done   # srun's own options
shift 3                                # PYTHON, the task entry, "task"
mode=$1; shift
while [[ $1 == --* ]]; do shift; done  # (torchrun's own options)
echo "$mode $(cat "$1") ${{*:2}}" >> {tmp_path}/srun.log
set -- $(cat {tmp_path}/srun-exits)
n=$(wc -l < {tmp_path}/srun.log)
if [[ -f {tmp_path}/srun-leaves ]]; then source {tmp_path}/srun-leaves; fi
exit "${{!n}}"
""")
        (tools / "scontrol").write_text(f"""#!/bin/sh
if [ "$1" = show ] && [ -f "{tmp_path}/shows-$4" ]; then cat "{tmp_path}/shows-$4"; exit 0; fi
if [ "$1" = requeue ] && [ -f "{tmp_path}/requeue-accepted" ]; then exit 0; fi
exit 1
""")
        (tools / "sbatch").write_text(f"""#!/bin/sh
printf '%s\\n' "$@" > {tmp_path}/sbatch-args
for v in CHAIN RUN_NAME SHARED_DIR PYTHON SLURM_JOB_ID SLURM_NTASKS MASTER_ADDR; do eval "echo $v=\\${{$v-unset}}"; done \\
    > {tmp_path}/sbatch-env
pwd > {tmp_path}/sbatch-cwd
if [ -f {tmp_path}/sbatch-refuses ]; then cat {tmp_path}/sbatch-refuses >&2; exit 1; fi
echo 1234
""")
        (tools / "python").write_text("#!/bin/sh\necho python=here torch=2\n")
        for tool in tools.iterdir():
            tool.chmod(0o755)
    (tmp_path / "srun-exits").write_text(srun_exits)
    job = {"SLURM_JOB_ID": "77", "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_NTASKS": "2", "SLURM_JOB_NUM_NODES": "1",
           "SLURM_NTASKS_PER_NODE": "2", "MASTER_ADDR": "127.0.0.1", "PYTHON": str(tools / "python")}
    entry = [str(project / "ddpkit" / "supervisor" / "main.py")]
    if requeue_wait:  # (the copy's supervisor, its wait for Slurm after a requeue set from here)
        entry = ["-c", f"import sys; sys.path[0] = {str(project)!r}; from ddpkit.supervisor import main; "
                       f"main.REQUEUE_WAIT = {requeue_wait}; sys.exit(main.main(sys.argv[1:]))"]
    return subprocess.run([sys.executable, *entry, "supervise", "--project", str(project), "--batch-file",
                           str(project / "run_training.sbatch"), "--environment", "VENV=/v", "--", *args], cwd=tmp_path,
                          env=clean_env(PATH=f"{tools}:/usr/bin:/bin", **{**job, **env}), capture_output=True, text=True,
                          timeout=60)


def steps_run(tmp_path: Path) -> list:
    return (tmp_path / "srun.log").read_text().splitlines()


FIRST_START = ["--resume", "/base/ckpt-00000016.pt", "--interrupt-at=30:USR1", "--epochs", "3", "--interrupt-at",
               "9:TERM"]


def test_a_restart_and_a_requeue_leave_out_the_options_of_the_first_start(tmp_path):
    """--resume (where the run started from) and --interrupt-at (a stop rehearsed at a chosen
    step), in either spelling, go to the first start alone: a restart of the step after a
    killed rank, and the job requeued, go on from the run's own newest checkpoint. Before the
    run saved one, a --resume FILE stays (else the restart would train afresh)."""
    result = supervised_job(tmp_path, "137 0", FIRST_START)
    assert result.returncode == 0, result.stdout + result.stderr
    first, restart = steps_run(tmp_path)
    data, runs = tmp_path / "data", tmp_path / "runs"
    options = f"--data-dir={data} --log-dir={runs} --run-name=job-77"
    assert first == f"train v1 {options} {' '.join(FIRST_START)}"
    assert restart == f"train v1 {options} --epochs 3 --resume=/base/ckpt-00000016.pt"  # (nothing saved yet)
    assert "ATTEMPT 2/4 after exit 137" in result.stdout
    (runs / "job-77" / "checkpoints").mkdir()
    (runs / "job-77" / "checkpoints" / "ckpt-00000030.pt").write_bytes(b"")  # (as the ranks save)
    for exits, restart_count, steps in (("137 0", "0", 2), ("0", "1", 1)):
        (tmp_path / "srun.log").unlink()
        again = supervised_job(tmp_path, exits, FIRST_START, SLURM_RESTART_COUNT=restart_count)
        assert again.returncode == 0, again.stdout + again.stderr
        assert steps_run(tmp_path)[-1] == f"train v1 {options} --epochs 3" and len(steps_run(tmp_path)) == steps
    # Killed at every attempt, before rank 0 wrote the line that continues the run: the line
    # after END is built from the options as given, less those of the first start.
    (tmp_path / "srun.log").unlink()
    gave_up = supervised_job(tmp_path, "137 137 137 137", FIRST_START, SLURM_RESTART_COUNT="1")
    assert gave_up.returncode == 137
    assert gave_up.stdout.endswith(f"to continue from the newest checkpoint, from {tmp_path}: SHARED_DIR={tmp_path} "
                                   f"DATA_DIR={data} LOG_DIR={runs} RUN_NAME=job-77 PYTHON={tmp_path}/bin/python sbatch "
                                   f"--nodes=1 --ntasks-per-node=2 {tmp_path}/project/run_training.sbatch --epochs 3\n")
    assert "--resume" not in gave_up.stdout + gave_up.stderr


def test_under_torchrun_the_supervisor_leaves_restarts_to_its_agents(tmp_path):
    """torchrun's agents restart the workers MAX_RESTARTS times themselves: a step that ends
    as a killed one would be restarted under srun is not started again on top of them."""
    result = supervised_job(tmp_path, "137 137 137", ["--epochs", "1"], LAUNCHER="torchrun", MAX_RESTARTS="2")
    assert len(steps_run(tmp_path)) == 1 and "ATTEMPT" not in result.stdout, result.stdout
    assert result.returncode == 137 and "gave up after 3 attempts" in result.stdout
    (tmp_path / "srun.log").unlink()
    result = supervised_job(tmp_path, "137 137 137", ["--epochs", "1"], MAX_RESTARTS="2")
    assert len(steps_run(tmp_path)) == 3 and "ATTEMPT 3/3" in result.stdout  # (srun: the supervisor restarts)


def test_a_job_run_again_inside_salloc_takes_a_new_copy_and_a_requeue_keeps_its_own(tmp_path):
    """Inside salloc, running the batch file again is a new start of the same job id: it runs
    the code as it is now. A requeue of the job (SLURM_RESTART_COUNT) runs the copy it has."""
    supervised_job(tmp_path, "0 0 0", ["--epochs", "1"], RUN_NAME="r")
    (tmp_path / "project" / "mnist_ddp.py").write_text("v2\n")
    again = supervised_job(tmp_path, "0 0 0", ["--epochs", "1"], RUN_NAME="r")
    (tmp_path / "project" / "mnist_ddp.py").write_text("v3\n")
    copied = tmp_path / "runs" / "r" / "code" / "job-77" / "ddpkit" / "supervisor" / "main.py"
    copied.write_text('print("the copy supervises", flush=True)\n' + copied.read_text())
    requeued = supervised_job(tmp_path, "0 0 0", ["--epochs", "1"], RUN_NAME="r", SLURM_RESTART_COUNT="1")
    assert [line.split()[1] for line in steps_run(tmp_path)] == ["v1", "v2", "v2"]
    assert "the copy supervises" in requeued.stdout and "the copy supervises" not in again.stdout
    assert "code: this job runs code that differs from job-77's" in again.stdout


def test_the_batch_file_is_its_sbatch_lines_the_environment_and_one_hand_over():
    """run_training.sbatch stays a file a user reads in one sitting (at most 120 lines): its
    #SBATCH lines first, right after the shebang (Slurm reads none after the first command),
    and its last command the hand-over to this supervisor, which holds the job's logic."""
    lines = SBATCH_FILE.read_text().splitlines()
    assert len(lines) <= 120, f"run_training.sbatch has {len(lines)} lines"
    assert lines[0] == "#!/usr/bin/env bash"
    directives = [n for n, line in enumerate(lines) if line.startswith(("#SBATCH", "##SBATCH"))]  # (## a switched-off one)
    assert directives == list(range(1, len(directives) + 1)) and len(directives) >= 8
    command = [line for line in lines if line and not line.startswith("#")][-2:]
    assert command[0].startswith('exec python3 "$project/ddpkit/supervisor/main.py" supervise '), command


# ----------------------------------------------------------------------------- CHAIN

NOT_REQUEUEABLE = LINE.replace("Requeue=1", "Requeue=0")  # (as sbatch --no-requeue leaves it)
CONTINUED_BY_1234 = "nothing to submit: Slurm job 1234 already continues the run (squeue --job 1234)"


def ranks_leave(tmp_path: Path, codes: str, continue_line: str = "", requeue: bool = True) -> None:
    """What the ranks leave in the job's folder as the stand-in srun ends: each rank's code, the
    requeue file (a stop on SIGUSR1 asks for a requeue; one on SIGTERM or Ctrl-C, or no stop,
    for none: `requeue`) and rank 0's line that continues the run; it records the CHAIN the
    ranks were given (ranks-chain)."""
    folder = f'"${JobEnv.EXIT_DIR}"'
    leaves = [f"mkdir -p {folder}"]
    leaves += [f"echo {code} > {folder}/{JobPaths.RANK_CODE.format(rank)}" for rank, code in enumerate(codes.split())]
    leaves.append(f'echo "${JobEnv.CHAIN}" > {tmp_path}/ranks-chain')  # (what CHAIN rank 0's time estimate counts on)
    if requeue:
        leaves.append(f"echo SIGUSR1 > {folder}/{JobPaths.REQUEUE}")
    if continue_line:
        leaves.append(f'echo "${JobEnv.RESUBMIT} {continue_line}" > {folder}/{JobPaths.CONTINUE_COMMAND}')
    (tmp_path / "srun-leaves").write_text("\n".join(leaves) + "\n")


def sbatch_calls(tmp_path: Path) -> list:
    return (tmp_path / "sbatch-args").read_text().splitlines() if (tmp_path / "sbatch-args").exists() else []


def test_a_stop_slurm_does_not_requeue_is_continued_by_a_chained_job_and_never_by_two(tmp_path):
    """CHAIN=2, a job Slurm may not requeue, stopped on SIGUSR1: the supervisor submits rank 0's
    line that continues the run, with CHAIN=1, as a job that waits for this one to end (the
    ranks were told CHAIN, which rank 0's time estimate counts on); says so
    in one line with its id, and on the END line (exit 75); records its id in the run
    directory; and after END says that job continues the run, not the line it was submitted
    with (run again, that line would queue a second job for the run). While that job is
    pending, a second stop of the run chains nothing and says, after END too, which job
    continues the run; once it has ended, a stop chains again. The chained job, when it runs,
    clears the record."""
    (tmp_path / "shows-77").write_text(NOT_REQUEUEABLE + "\n")
    ranks_leave(tmp_path, "75 75", "--epochs 3 --lr 0.5")
    result = supervised_job(tmp_path, "75", ["--epochs", "3", "--lr", "0.5"], CHAIN="2", MASTER_PORT="29500")
    assert result.returncode == 75, result.stdout + result.stderr
    project, runs = tmp_path / "project", tmp_path / "runs"
    printed = (f"SHARED_DIR={tmp_path} DATA_DIR={tmp_path}/data LOG_DIR={runs} RUN_NAME=job-77 "
               f"PYTHON={tmp_path}/bin/python CHAIN=1 sbatch --nodes=1 --ntasks-per-node=2 --time=00:30:00 "
               f"{project}/run_training.sbatch --epochs 3 --lr 0.5")
    assert sbatch_calls(tmp_path) == ["--parsable", "--dependency=afterany:77", *printed.split(" sbatch ")[1].split()]
    assert (tmp_path / "sbatch-env").read_text().splitlines() == [
        "CHAIN=1", "RUN_NAME=job-77", f"SHARED_DIR={tmp_path}", f"PYTHON={tmp_path}/bin/python", "SLURM_JOB_ID=unset",
        "SLURM_NTASKS=unset", "MASTER_ADDR=unset"]  # (the line's settings alone, and none of this job's)
    assert (tmp_path / "sbatch-cwd").read_text() == f"{tmp_path}\n"
    lines = result.stdout.splitlines()
    assert [line for line in lines if "1234" in line] == [
        "Slurm did not requeue job 77: chained Slurm job 1234, which continues the run once this one has ended "
        "(sbatch --dependency=afterany:77, CHAIN=1)", lines[-2], lines[-1]]
    assert re.fullmatch(r"END \S+ job=77 exit=75 chained: Slurm job 1234 continues the run", lines[-2])
    assert lines[-1] == CONTINUED_BY_1234
    assert "run_training.sbatch --epochs" not in result.stdout  # (no line to run: it would queue a second job)
    assert "Slurm job 77 may not be requeued (it was submitted without --requeue)" in lines
    record = runs / "job-77" / JobPaths.CHAINED_JOB
    assert record.read_text() == "1234\n" and (tmp_path / "ranks-chain").read_text() == "2\n"

    for done in ("sbatch-args", "srun.log"):
        (tmp_path / done).unlink()
    (tmp_path / "shows-1234").write_text("JobId=1234 JobName=mnist-ddp JobState=PENDING Reason=Dependency\n")
    again = supervised_job(tmp_path, "75", ["--epochs", "3"], CHAIN="2")
    assert sbatch_calls(tmp_path) == [] and again.returncode == 75
    assert f"not chaining another job: Slurm job 1234 (PENDING) already continues the run ({record})" in again.stdout
    assert re.fullmatch(r"END \S+ job=77 exit=75", again.stdout.splitlines()[-2]) and record.read_text() == "1234\n"
    assert again.stdout.splitlines()[-1] == CONTINUED_BY_1234 and "run_training.sbatch --epochs" not in again.stdout
    (tmp_path / "shows-1234").write_text("JobId=1234 JobName=mnist-ddp JobState=CANCELLED Reason=None\n")
    (tmp_path / "srun.log").unlink()
    supervised_job(tmp_path, "75", ["--epochs", "3"], CHAIN="2")
    assert sbatch_calls(tmp_path)[:2] == ["--parsable", "--dependency=afterany:77"]

    for done in ("srun-leaves", "srun.log"):
        (tmp_path / done).unlink()
    chained = supervised_job(tmp_path, "0", ["--epochs", "3"], SLURM_JOB_ID="1234", RUN_NAME="job-77", CHAIN="1")
    assert chained.returncode == 0 and not record.exists(), chained.stdout + chained.stderr


@pytest.mark.parametrize("codes, chain", [("0 0", "2"), ("1 4", "2"), ("2 75", "2"), ("3 4", "2"), ("75 75", "0")])
def test_nothing_is_chained_after_a_finished_run_a_failure_no_restart_fixes_or_with_chain_0(tmp_path, codes, chain):
    """The ranks left the requeue file each time, and Slurm would not requeue the job: a run
    that finished (0), a bug (1), a usage problem (2), a divergence (3) chain nothing, nor
    does a stop with CHAIN=0 (the default)."""
    (tmp_path / "shows-77").write_text(NOT_REQUEUEABLE + "\n")
    ranks_leave(tmp_path, codes)
    result = supervised_job(tmp_path, codes.split()[0], ["--epochs", "3"], CHAIN=chain)
    assert result.returncode == int(codes.split()[0]), result.stdout + result.stderr
    assert sbatch_calls(tmp_path) == [] and not re.search(r"chain(ed|ing)? (Slurm|the|another)", result.stdout)
    assert not (tmp_path / "runs" / "job-77" / JobPaths.CHAINED_JOB).exists()


@pytest.mark.parametrize("codes, exits", [
    ("75 75", "75"),                # a stop on SIGTERM (scancel) or Ctrl-C: it asks for no requeue
    ("4 4", "4 4 4 4"),             # a lost peer at every attempt: it gave up at MAX_RESTARTS
    ("137 137", "137 137 137 137"),  # a rank killed at every attempt: the same
])
def test_nothing_is_chained_where_no_stop_asked_for_a_requeue(tmp_path, codes, exits):
    """CHAIN=2 in a job Slurm may not requeue: only a stop that asked for a requeue, refused,
    chains a job. A stop that asks for none (SIGTERM, Ctrl-C) ends with the line that
    continues the run, and so does a job that gave up after MAX_RESTARTS."""
    (tmp_path / "shows-77").write_text(NOT_REQUEUEABLE + "\n")
    ranks_leave(tmp_path, codes, requeue=False)
    result = supervised_job(tmp_path, exits, ["--epochs", "3"], CHAIN="2")
    assert result.returncode == int(codes.split()[0]), result.stdout + result.stderr
    assert sbatch_calls(tmp_path) == [] and not re.search(r"chain(ed|ing)? (Slurm|the|another)", result.stdout)
    assert "requeue" not in result.stdout and not (tmp_path / "runs" / "job-77" / JobPaths.CHAINED_JOB).exists()
    end, line = result.stdout.splitlines()[-2:]
    assert ("gave up after 4 attempts" in end) == (exits != "75"), end
    assert line.startswith(f"to continue from the newest checkpoint, from {tmp_path}: SHARED_DIR=")


REQUEUED = " requeued: Slurm accepted it and runs this job again, which continues the run"
CONTINUED_BY_77 = ("nothing to submit: Slurm job 77 (this job, requeued) continues the run once Slurm runs it again "
                   "(squeue --job 77)")


@pytest.mark.parametrize("chain", ["2", "0"])
def test_nothing_is_chained_after_a_requeue_slurm_accepted_however_slowly(tmp_path, chain):
    """A stop on SIGUSR1, and Slurm accepts the requeue but has not ended the job when the
    supervisor's wait for it ends: the job is requeued, so it chains nothing (CHAIN=2); its END
    line says it was requeued, and after it, in place of a line to submit (run as told, it
    would queue a second job for the run), one line says this job continues the run. The run
    directory keeps no exit code meanwhile (the job runs again)."""
    (tmp_path / "shows-77").write_text(LINE + "\n")
    (tmp_path / "requeue-accepted").touch()
    ranks_leave(tmp_path, "75 75", "--epochs 3")
    result = supervised_job(tmp_path, "75", ["--epochs", "3"], requeue_wait=1, CHAIN=chain)
    assert result.returncode == 75, result.stdout + result.stderr
    assert "requeueing Slurm job 77 after SIGUSR1; it resumes from its last checkpoint" in result.stdout
    assert sbatch_calls(tmp_path) == [] and not re.search(r"chain(ed|ing)? (Slurm|the|another)", result.stdout)
    end, line = result.stdout.splitlines()[-2:]
    assert re.fullmatch(rf"END \S+ job=77 exit=75{REQUEUED}", end) and line == CONTINUED_BY_77, result.stdout
    for printed in (end, line):
        assert_quoted_whole("docs/recovery.md", printed)
    assert "sbatch" not in result.stdout.partition("\nEND ")[2]
    assert not (tmp_path / "runs" / "job-77" / JobPaths.EXIT_CODE).exists()


def test_a_job_requeued_for_too_few_nodes_slurm_accepted_slowly_says_it_was_requeued(tmp_path):
    """A 2-node job loses a node (MIN_NODES unset: every node) and Slurm accepts the requeue but
    has not ended the job when the supervisor's wait for it ends: its END line says the job was
    requeued, not "not requeued", and after it one line says this job continues the run, in
    place of a line to submit."""
    (tmp_path / "shows-77").write_text(LINE + " NumNodes=1 NodeList=n1\n")
    (tmp_path / "requeue-accepted").touch()
    result = supervised_job(tmp_path, "137", ["--epochs", "3"], requeue_wait=1, CHAIN="2", SLURM_JOB_NUM_NODES="2",
                            SLURM_NTASKS="4")
    assert result.returncode == 137, result.stdout + result.stderr
    lost = ("rank 0 1 2 3 ended without an exit code: killed by a signal (srun's lines above say which); then "
            "the job holds 1 of its 2 nodes (n1), fewer than MIN_NODES=2 (unset: every node of the job)")
    end, line = result.stdout.splitlines()[-2:]
    assert re.fullmatch(rf"END \S+ job=77 exit=137 ended after 1 of 4 attempts \({re.escape(lost)}\){REQUEUED}", end), end
    assert line == CONTINUED_BY_77 and sbatch_calls(tmp_path) == [], result.stdout
    assert_quoted_whole("docs/recovery.md", end)


def test_a_job_that_hands_the_run_on_before_max_restarts_does_not_say_it_gave_up(tmp_path):
    """A 2-node job loses a node (MIN_NODES unset: every node), is not requeued (Slurm may not),
    with 3 restarts unused: its END line says it ended after 1 of 4 attempts, and, with
    CHAIN=2, that the job it chained continues the run; without CHAIN, the line after END
    does."""
    (tmp_path / "shows-77").write_text(NOT_REQUEUEABLE + " NumNodes=1 NodeList=n1\n")
    two_nodes = {"SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS": "4"}
    lost = ("rank 0 1 2 3 ended without an exit code: killed by a signal (srun's lines above say which); then "
            "the job holds 1 of its 2 nodes (n1), fewer than MIN_NODES=2 (unset: every node of the job), and it was not "
            "requeued")
    for chain, said in (("2", " chained: Slurm job 1234 continues the run"), ("0", "")):
        result = supervised_job(tmp_path, "137", ["--epochs", "3"], CHAIN=chain, **two_nodes)
        assert result.returncode == 137, result.stdout + result.stderr
        end = [line for line in result.stdout.splitlines() if line.startswith("END ")]
        assert re.fullmatch(rf"END \S+ job=77 exit=137 ended after 1 of 4 attempts \({re.escape(lost)}\){said}", end[0]), end
        for done in (tmp_path / "runs" / "job-77" / JobPaths.CHAINED_JOB, tmp_path / "srun.log"):
            done.unlink(missing_ok=True)
    assert result.stdout.splitlines()[-1].startswith(f"to continue from the newest checkpoint, from {tmp_path}: ")


def test_a_chain_sbatch_refuses_is_one_line_and_the_printed_line_remains(tmp_path):
    (tmp_path / "shows-77").write_text(NOT_REQUEUEABLE + "\n")
    (tmp_path / "sbatch-refuses").write_text("sbatch: error: Batch job submission failed: Invalid account\n")
    ranks_leave(tmp_path, "75 75")
    result = supervised_job(tmp_path, "75", ["--epochs", "3"], CHAIN="1")
    assert result.returncode == 75 and sbatch_calls(tmp_path)[:2] == ["--parsable", "--dependency=afterany:77"]
    lines = result.stdout.splitlines()
    assert "could not chain the job that continues the run (sbatch: sbatch: error: Batch job submission failed: Invalid " \
           "account); submit the line below yourself" in lines
    assert re.fullmatch(r"END \S+ job=77 exit=75", lines[-2])
    assert lines[-1].startswith(f"to continue from the newest checkpoint, from {tmp_path}: SHARED_DIR=")
    assert " CHAIN=0 sbatch " in lines[-1] and lines[-1].endswith(" --epochs 3")
    assert not (tmp_path / "runs" / "job-77" / JobPaths.CHAINED_JOB).exists()


def test_a_line_that_continues_the_run_it_cannot_rewrite_leaves_the_supervisor_and_its_end_line(tmp_path, monkeypatch,
                                                                                                capsys):
    """Adding --exclude to rank 0's line that continues the run fails (a full disk, say): one line
    says so, and the job still ends with its END line and the line that continues the run."""
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv(JobEnv.RESUBMIT, "")  # (restored after the test: the supervisor sets it)
    supervisor = Supervisor(settings(tmp_path), LINE, "/code/ddpkit/supervisor/main.py")
    supervisor.resubmit = "sbatch run_training.sbatch"
    os.makedirs(supervisor.s.job_dir)
    Path(supervisor.s.job_dir, JobPaths.CONTINUE_COMMAND).write_text("sbatch run_training.sbatch --epochs 3\n")
    real_open = open

    def open_but_not_to_write(path, mode="r", *args, **kwargs):
        if "w" in mode:
            raise OSError(28, "No space left on device")
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr("ddpkit.supervisor.main.open", open_but_not_to_write, raising=False)
    supervisor.exclude_in_line(["n2"])
    assert supervisor.end(Outcome(4, True, "rank 0 lost contact"), 4) == 4
    out = capsys.readouterr().out
    assert "could not add --exclude=n2 to the line that continues the run ([Errno 28] No space left on device)" in out
    assert re.search(r"^END .* exit=4 gave up after 4 attempts", out, re.MULTILINE)
    assert out.rstrip().endswith("run_training.sbatch --epochs 3")
