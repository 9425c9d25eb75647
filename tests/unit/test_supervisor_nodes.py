"""The job leaves a bad node out (ddpkit/supervisor/nodes.py and the supervisor's use of it),
without Slurm: which node a failure is pinned on, from the files the ranks leave (a hang
report's named rank, a rank killed by a signal, a rank whose node failed it, a node the job
lost), and what pins nothing (a bug, a lost peer alone, a failure on every node); which step
comes next (next_step, first_step), from plain values; then the supervisor run as run_training.sbatch hands over to it, with a stand-in srun whose steps
leave those files and a stand-in scontrol: a node pinned twice is left out, once; the step
starts again on the job's other nodes when MIN_NODES allows, else the job is requeued with
the node in its ExcNodeList; the line after END excludes it. The same on a real Slurm:
tests/cluster/mostly_waiting/test_recovery_across_nodes.py.

    python -m pytest tests/unit/test_supervisor_nodes.py
"""

import subprocess
import sys
from pathlib import Path

import pytest

from ddpkit.job.contract import JobEnv, JobPaths
from ddpkit.supervisor.nodes import (
    Held,
    Next,
    Pin,
    Step,
    Usable,
    cannot_keep_off_line,
    failure_pins,
    first_step,
    kept_off,
    leave_out_line,
    left_out,
    next_step,
    ranks_on_two_nodes,
    read_pins,
    record_pins,
    step_nodes,
    step_pins,
    usable_nodes,
    with_excluded,
)
from ddpkit.supervisor.outcome import Outcome
from ddpkit.supervisor.settings import Settings
from helpers.pages import assert_quoted_whole
from helpers.processes import clean_env
from helpers.supervisor import LINE, stand_in_project

LOST_PEER = Outcome(4, True, "rank 0 lost contact with a peer that died or hung")


def leave(job_dir: Path, files: dict) -> Path:
    job_dir.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (job_dir / name).write_text(text)
    return job_dir


# ----------------------------------------------------------------------------- which node a failure is pinned on

@pytest.mark.parametrize("files, outcome, pins", [
    # A hang report names rank 1, on n2, as the one the others wait for.
    ({JobPaths.NODES: "n1\nn2\nn3\n", JobPaths.HUNG: "1 n2\n"}, LOST_PEER, {"n2": Pin("1", "a hang report named rank 1 on it")}),
    # A rank killed by a signal, and the report of the hang that came before it: one pin.
    ({JobPaths.NODES: "n1\nn2\nn3\n", JobPaths.HUNG: "1 n2\n"}, Outcome(137, True, "", killed=(1,)),
     {"n2": Pin("1", "a hang report named rank 1 on it and rank 1 on it was killed by a signal")}),
    # A rank's node failed it (its CUDA error), before the ranks met (no node list).
    ({JobPaths.NODE_FAULT.format(2): "n3 CUDA error: uncorrectable ECC error encountered\n"},
     Outcome(5, True, "rank 2 failed on a fault of its node"),
     {"n3": Pin("2", "rank 2 on it failed with CUDA error: uncorrectable ECC error encountered")}),
    # A lost peer alone: every node that lost it records 4; none of them is pinned.
    ({JobPaths.NODES: "n1\nn2\nn3\n"}, LOST_PEER, {}),
    # Ranks killed on every node of the step (srun ended them all): nothing tells them apart.
    ({JobPaths.NODES: "n1\nn2\nn3\n"}, Outcome(137, True, "", killed=(0, 1, 2)), {}),
    # The same CUDA error on every node: the run's, or the site's, not one node's.
    ({JobPaths.NODES: "n1\nn2\n", JobPaths.NODE_FAULT.format(0): "n1 CUDA error: uncorrectable ECC error encountered\n",
      JobPaths.NODE_FAULT.format(1): "n2 CUDA error: uncorrectable ECC error encountered\n"}, Outcome(5, True, ""), {}),
    # A job on one node never pins its node: nothing tells its fault from the run's.
    ({JobPaths.NODES: "n1\nn1\n", JobPaths.HUNG: "1 n1\n"}, LOST_PEER, {}),
])
def test_which_node_a_failure_is_pinned_on(tmp_path, files, outcome, pins):
    assert failure_pins(str(leave(tmp_path / "job", files)), outcome, ["n1", "n2", "n3"]) == pins


HANG = Pin("1", "a hang report named rank 1 on it")
LOST = Pin("", "the job lost it (Slurm took it from the job)")


@pytest.mark.parametrize("pins, step, held, job_nodes, kept", [
    ({"n2": HANG}, ["n1", "n2"], ["n1", "n2"], ["n1", "n2"], {"n2": HANG}),
    ({"n2": HANG}, ["n1", "n2"], ["n1"], ["n1", "n2"], {"n2": LOST}),  # (lost: the hang was its loss)
    ({}, ["n1", "n2"], ["n1"], ["n1", "n2"], {"n2": LOST}),
    ({}, ["n1", "n2"], [], ["n1", "n2"], {}),  # (the nodes held unknown: none lost)
    ({"c9b2e": HANG}, ["c7f3a", "c9b2e"], ["n1"], ["n1", "n2"], {}),  # (names not the job's: none)
    ({"c9b2e": HANG}, ["c7f3a", "c9b2e"], [], [], {"c9b2e": HANG}),  # (the job's nodes unknown: as named)
])
def test_a_steps_pins_are_on_the_jobs_own_nodes_and_on_those_it_lost(pins, step, held, job_nodes, kept):
    assert step_pins(pins, step=step, held=held, job_nodes=job_nodes) == kept


def test_a_node_pinned_twice_is_left_out_and_the_record_outlives_the_jobs_folder(tmp_path):
    record = str(tmp_path / "runs" / "r" / JobPaths.JOB_DIRS / JobPaths.NODE_FAILURES.format("77"))
    assert read_pins(record) == {} and left_out(read_pins(record)) == []
    record_pins(record, {"n2": Pin("1", "a hang report named rank 1 on it")}, "attempt 1, exit 4")
    pins = record_pins(record, {"n2": Pin("1", "a hang report named rank 1 on it"),
                                "n3": Pin("2", "rank 2 on it was killed by a signal")},
                       "attempt 2, exit 137")
    assert left_out(pins) == ["n2"] and len(pins["n3"]) == 1
    assert leave_out_line("n2", pins["n2"]) == (
        "leaving n2 out of this job from now on: 2 failures were pinned on it (attempt 1, exit 4: a hang report named "
        "rank 1 on it; attempt 2, exit 137: a hang report named rank 1 on it)")
    assert with_excluded("(null)", ["n2"]) == "n2"
    assert with_excluded("gpu[3-4],n2", ["n2", "n5"]) == "gpu[3-4],n2,n5"  # (yours kept, each node once)


# ----------------------------------------------------------------------------- which step comes next, as data

def job(nodes: int, *, min_nodes: int = 0, per_node: int = 1) -> Settings:
    """The settings next_step and first_step read: the job's nodes and ranks, MIN_NODES (0: unset)."""
    s = Settings()
    s.nodes, s.ntasks, s.tasks_per_node = nodes, nodes * per_node, per_node
    s.min_nodes, s.min_nodes_set = min_nodes or nodes, bool(min_nodes)
    return s


WHOLE3 = Step(3, 3, (), "")
HELD3 = Held(3, "n[1-3]", ["n1", "n2", "n3"])


@pytest.mark.parametrize("s, step, held, left, world_sizes, again, kept, after", [
    pytest.param(job(3), WHOLE3, Held(3, "n[1-3]", []), [], [1, 3], False, None, Next(WHOLE3, "", "", False),
                 id="every node held: the same step"),
    pytest.param(job(2, min_nodes=1, per_node=2), Step(2, 4, (), ""), Held(1, "n1", []), [], [1, 2, 4], False, None,
                 Next(Step(1, 2, (), ""), ": the job holds 1 of its 2 nodes (n1), so on 1 node(s) with 2 rank(s) instead of 4",
                      "", False), id="a lost node, MIN_NODES=1: on the node left"),
    pytest.param(job(2, per_node=2), Step(2, 4, (), ""), Held(1, "n1", []), [], [1, 2, 4], False, None,
                 Next(None, "", "the job holds 1 of its 2 nodes (n1), fewer than MIN_NODES=2 (unset: every node of the job)",
                      True), id="a lost node, MIN_NODES unset: requeued"),
    pytest.param(job(2, min_nodes=1, per_node=2), Step(2, 4, (), ""), Held(1, "n1", []), [], [4], False, None,
                 Next(None, "", "the job holds 1 of its 2 nodes (n1), and no count of them from MIN_NODES=1 up, at 2 "
                      "rank(s) a node, keeps the global batch", True), id="a lost node, the batch splits among 4 alone"),
    pytest.param(job(3, min_nodes=2), WHOLE3, HELD3, ["n2"], [1, 2, 3], False, None,
                 Next(Step(2, 2, ("n2",), ""), ": the job holds 3 of its 3 nodes (n[1-3]), 2 without the node it leaves "
                      "out, so on 2 node(s) with 2 rank(s) instead of 3", "", False), id="a node left out, MIN_NODES=2"),
    pytest.param(job(3, min_nodes=2), WHOLE3, HELD3, ["n1"], [1, 2, 3], False, None,
                 Next(Step(2, 2, ("n1",), "n2,n3"), ": the job holds 3 of its 3 nodes (n[1-3]), 2 without the node it "
                      "leaves out, so on 2 node(s) with 2 rank(s) instead of 3", "", False),
                 id="the first node left out: the rendezvous moves"),
    pytest.param(job(3, min_nodes=1), Step(2, 2, ("n2",), ""), Held(2, "n[1-2]", ["n1", "n2"]), ["n2"], [1, 2, 3],
                 False, None, Next(Step(1, 1, ("n2",), ""), ": the job holds 2 of its 3 nodes (n[1-2]), 1 without the node "
                                   "it leaves out, so on 1 node(s) with 1 rank(s) instead of 2", "", False),
                 id="a node left out, then one lost: on the usable one"),
    pytest.param(job(2), Step(2, 2, (), ""), Held(2, "n[1-2]", ["n1", "n2"]), ["n2"], [1, 2], False, ["n2"],
                 Next(None, "", "the job holds 2 of its 2 nodes (n[1-2]), 1 without the node it leaves out, fewer than "
                      "MIN_NODES=2 (unset: every node of the job)", True), id="a node left out, too few without it"),
    pytest.param(job(3), WHOLE3, HELD3, ["n2"], [1, 3], False, [],
                 Next(WHOLE3, " with n2, which Slurm could not place the job without", "", False),
                 id="a node left out that Slurm cannot keep the job off"),
    pytest.param(job(3), WHOLE3, HELD3, ["n2", "n3"], [1, 3], False, ["n2"],
                 Next(WHOLE3, " with n3, which Slurm could not place the job without, and with n2, which the line that "
                      "continues the run excludes (not requeued without it: Slurm would place the job on n3 again)", "",
                      False), id="two left out, one kept off"),
    pytest.param(job(3), WHOLE3, HELD3, ["n3"], [1, 3], True, ["n3"],
                 Next(WHOLE3, " with n3 (not requeued a second time to leave a node out)", "", False),
                 id="requeued once to leave a node out, every node held"),
    pytest.param(job(3), WHOLE3, Held(2, "n[1,3]", ["n1", "n3"]), ["n3"], [1, 3], True, ["n3"],
                 Next(None, "", "the job holds 2 of its 3 nodes (n[1,3]), 1 without the node it leaves out, and it was "
                      "requeued once already to leave a node out", False), id="requeued once to leave a node out, one lost"),
])
def test_the_next_step_from_the_nodes_held_and_left_out(s, step, held, left, world_sizes, again, kept, after):
    """next_step, from plain values: the same step, the step on fewer nodes (without those left
    out, the rendezvous moved off one), a requeue, or none. Slurm is asked which nodes it can
    keep the job off (`kept`, None: not asked) only where the answer decides."""
    asked = []
    assert next_step(s, step, held, left=left, world_sizes=world_sizes, requeued_to_leave_out=again,
                     kept_off=lambda: asked.append(1) or list(kept)) == after
    assert bool(asked) == (kept is not None)


@pytest.mark.parametrize("s, left, after", [
    (job(3, min_nodes=2), [], Next(WHOLE3, "", "", False)),
    (job(3, min_nodes=2), ["n4"], Next(WHOLE3, "", "", False)),  # (Slurm kept the job off it)
    (job(3, min_nodes=2), ["n2"], Next(Step(2, 2, ("n2",), ""), "the job holds n2 again, which it leaves out: its step "
                                       "runs on 2 node(s) with 2 rank(s) instead of 3, without it", "", False)),
    (job(3), ["n2"], Next(WHOLE3, "the job holds n2 again, which it leaves out, and too few nodes without it (MIN_NODES="
                                  "3): it runs on them, and is not requeued again to leave them out", "", False)),
])
def test_a_requeued_jobs_first_step_leaves_out_the_nodes_it_holds_again(s, left, after):
    assert first_step(s, nodes=["n1", "n2", "n3"], left=left, world_sizes=[1, 2, 3]) == after


def test_the_nodes_srun_gives_a_step_are_the_first_it_does_not_leave_out():
    assert step_nodes(Step(2, 2, ("n1",), "n2,n3"), ["n1", "n2", "n3"]) == ["n2", "n3"]
    assert step_nodes(Step(1, 1, (), ""), ["n1", "n2"]) == ["n1"]


# ----------------------------------------------------------------------------- the supervisor with them

def supervised_job(tmp_path: Path, steps: list, nodes: list, *, excluded: str = "(null)", shown: str = "", **env: str
                   ) -> subprocess.CompletedProcess:
    """The supervisor, as run_training.sbatch hands over to it, in a job of one rank on each of
    `nodes`, its project a copy in tmp_path/project. Stand-ins on its PATH: srun records its
    options (srun.log, a line a step) and runs the next of `steps` (shell lines that leave the
    ranks' files in the job's folder, $EXITS, and exit as srun would); scontrol shows the job as
    `nodes` and `excluded` say (its line, with NumNodes, NodeList and ExcNodeList, and `shown`), lists a
    node list's nodes (comma-separated here), shows the reservation tmp_path/reservation
    holds, records each command (scontrol.log) and refuses every requeue, unless
    tmp_path/requeue-accepted exists: then it ends the supervisor as Slurm would, with SIGTERM
    and, 3 s later, SIGKILL; sinfo lists the partition's nodes and their states, those of
    tmp_path/partition (n1 to n4, idle, unless a test writes it), those of --nodes alone;
    PYTHON answers the supervisor's check that it imports torch."""
    project, tools = tmp_path / "project", tmp_path / "bin"
    if not project.exists():
        stand_in_project(project, tools)
        (tools / "srun").write_text(f"""#!/bin/bash
words=()
while [[ $1 == -* ]]; do words+=("$1"); shift; done
echo "${{words[*]}}" >> {tmp_path}/srun.log
EXITS=${JobEnv.EXIT_DIR}; mkdir -p "$EXITS"
source {tmp_path}/step-$(wc -l < {tmp_path}/srun.log)
""")
        (tools / "scontrol").write_text(f"""#!/bin/bash
echo "$*" >> {tmp_path}/scontrol.log
case "$1 $2" in
  "show job") cat {tmp_path}/shows ;;
  "show hostnames") echo "$3" | tr , '\\n' ;;
  "show reservation") cat {tmp_path}/reservation ;;
  "update "*) ;;
  "requeue "*) if [ -f {tmp_path}/requeue-accepted ]; then  # (then Slurm ends the job: SIGTERM, and SIGKILL later)
      kill -TERM $PPID; (sleep 3; kill -KILL $PPID) >/dev/null 2>&1 & exit 0; fi
    echo "scontrol: error: Requested operation is presently disabled for job $2" >&2; exit 1 ;;
esac
""")
        (tools / "sinfo").write_text(f"""#!/bin/bash
echo "$*" >> {tmp_path}/sinfo.log
[ -f {tmp_path}/partition ] || printf 'n1 idle\\nn2 idle\\nn3 idle\\nn4 idle\\n' > {tmp_path}/partition
nodes=$(printf '%s\\n' "$@" | sed -n 's/^--nodes=//p')
if [ -n "$nodes" ]; then grep -E "^(${{nodes//,/|}}) " {tmp_path}/partition; else cat {tmp_path}/partition; fi
""")
        (tools / "python").write_text("#!/bin/sh\necho python=here torch=2\n")
        for tool in tools.iterdir():
            tool.chmod(0o755)
    for n, step in enumerate(steps, 1):
        (tmp_path / f"step-{n}").write_text(step)
    for log in ("srun.log", "scontrol.log", "sinfo.log"):
        (tmp_path / log).unlink(missing_ok=True)
    (tmp_path / "shows").write_text(f"{LINE} NumNodes={len(nodes)} NodeList={','.join(nodes)} ExcNodeList={excluded} "
                                    f"{shown}\n")
    job = {"SLURM_JOB_ID": "77", "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_NTASKS": str(len(nodes)),
           "SLURM_JOB_NUM_NODES": str(len(nodes)), "SLURM_NTASKS_PER_NODE": "1", "SLURM_JOB_NODELIST": ",".join(nodes),
           "MASTER_ADDR": "127.0.0.1", "PYTHON": str(tools / "python"), **env}
    return subprocess.run([sys.executable, str(project / "ddpkit" / "supervisor" / "main.py"), "supervise", "--project",
                           str(project), "--batch-file", str(project / "run_training.sbatch"), "--environment", "VENV=/v",
                           "--", "--epochs", "3"], cwd=tmp_path, env=clean_env(PATH=f"{tools}:/usr/bin:/bin", **job),
                          capture_output=True, text=True, timeout=120)


def step(nodes: list, codes: dict, status: int, *, hung: str = "", world_sizes: str = "", then: str = "") -> str:
    """A step's shell lines: rank 0 lists the nodes (and the world sizes) once the ranks met,
    and its line that continues the run; a hang report names `hung` ("RANK NODE"); each rank
    of `codes` records its code; `then` runs; srun exits with `status`."""
    lines = [f"printf '{''.join(n + chr(92) + 'n' for n in nodes)}' > $EXITS/{JobPaths.NODES}",
             f'echo "${JobEnv.RESUBMIT} --epochs 3" > $EXITS/{JobPaths.CONTINUE_COMMAND}']
    if world_sizes:
        lines.append(f"echo {world_sizes} > $EXITS/{JobPaths.WORLD_SIZES}")
    if hung:
        lines.append(f"echo '{hung}' > $EXITS/{JobPaths.HUNG}")
    lines += [f"echo {code} > $EXITS/{JobPaths.RANK_CODE.format(rank)}" for rank, code in codes.items()]
    return "\n".join(lines + [then, f"exit {status}"]) + "\n"


def printed(result: subprocess.CompletedProcess, start: str) -> list:
    return [line for line in result.stdout.splitlines() if line.startswith(start)]


def test_a_node_pinned_twice_is_left_out_and_the_step_goes_on_on_the_jobs_other_nodes(tmp_path):
    """MIN_NODES=2 of 3 nodes: rank 1's node, n2, hangs at two starts. After the second, one
    line leaves it out, and the step starts again on n1 and n3 (srun excludes n2), on which
    it ends with exit 0; the job's record keeps both failures."""
    nodes = ["n1", "n2", "n3"]
    hang = step(nodes, {0: 4, 2: 4}, 137, hung="1 n2", world_sizes="1 2 3")
    result = supervised_job(tmp_path, [hang, hang, step(["n1", "n3"], {0: 0, 1: 0}, 0)], nodes, MIN_NODES="2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "srun.log").read_text().splitlines() == [
        "--label --kill-on-bad-exit=1", "--label --kill-on-bad-exit=1",
        "--label --kill-on-bad-exit=1 --nodes=2 --ntasks=2 --exclude=n2"]
    why = "a hang report named rank 1 on it and rank 1 on it was killed by a signal"
    assert printed(result, "leaving") == [f"leaving n2 out of this job from now on: 2 failures were pinned on it "
                                          f"(attempt 1, exit 137: {why}; attempt 2, exit 137: {why})"]
    assert printed(result, "ATTEMPT 3/4")[0].endswith(
        ": the job holds 3 of its 3 nodes (n1,n2,n3), 2 without the node it leaves out, so on 2 node(s) with 2 rank(s) instead of 3; "
        "it resumes from the newest checkpoint")
    assert list(read_pins(JobPaths(str(tmp_path / "runs" / "job-77"), "77").node_failures)) == ["n2"]


def test_with_too_few_nodes_left_the_job_is_requeued_without_the_node_and_the_line_after_end_excludes_it(tmp_path):
    """2 nodes, MIN_NODES unset: after n2's second failure the job is requeued, and right after
    (Slurm changes the ExcNodeList of a pending job alone) asked to keep off n2, the SIGTERM
    that ends the job held off meanwhile. Where Slurm refuses the requeue, the line after END
    excludes n2. Requeued (SLURM_RESTART_COUNT) onto n1 and n3 with n2 excluded, the job does
    not name n2 again, and its line still excludes it."""
    nodes = ["n1", "n2"]
    hang = step(nodes, {0: 4}, 4, hung="1 n2")
    (tmp_path / "requeue-accepted").touch()
    result = supervised_job(tmp_path, [hang, hang], nodes)
    asked = [line for line in (tmp_path / "scontrol.log").read_text().splitlines() if not line.startswith("show")]
    assert (result.returncode, asked) == (-9, ["requeue 77", "update JobId=77 ExcNodeList=n2"]), result.stdout
    assert len(printed(result, "leaving n2 out of this job from now on: 2 failures")) == 1
    (tmp_path / "requeue-accepted").unlink()
    (tmp_path / "runs" / "job-77" / JobPaths.JOB_DIRS / JobPaths.NODE_FAILURES.format("77")).unlink()
    result = supervised_job(tmp_path, [hang, hang], nodes)
    assert result.returncode == 4, result.stdout + result.stderr
    assert printed(result, "requeueing Slurm job 77 after exit 4: the job holds 2 of its 2 nodes (n1,n2), 1 without the node "
                           "it leaves out, fewer than MIN_NODES=2 (unset: every node of the job); it resumes")
    assert_quoted_whole("docs/recovery.md", printed(result, "requeueing")[0])
    end, note = result.stdout.splitlines()[-2:]
    assert end.startswith("to continue from the newest checkpoint, from ") and \
        " --exclude=n2 " in end and end.endswith("run_training.sbatch --epochs 3"), end
    assert note.startswith("--exclude=n2 in that line: n2 left out by this job (2 failures were pinned on it); "), note
    requeued = supervised_job(tmp_path, [step(["n1", "n3"], {0: 4}, 4, hung="1 n3"),
                                         step(["n1", "n3"], {}, 0, then=f'echo "${JobEnv.RESUBMIT}" > {tmp_path}/line')],
                              ["n1", "n3"], excluded="n2", SLURM_RESTART_COUNT="1")
    assert requeued.returncode == 0 and "leaving" not in requeued.stdout, requeued.stdout + requeued.stderr
    assert " --exclude=n2 " in (tmp_path / "line").read_text()
    pins = read_pins(JobPaths(str(tmp_path / "runs" / "job-77"), "77").node_failures)
    assert pins["n3"] == [Pin("1", "attempt 1 after 1 requeue(s), exit 4: a hang report named rank 1 on it")]


def test_what_a_bug_a_divergence_or_a_lost_peer_alone_leaves_pins_nothing(tmp_path):
    """A bug on rank 1 after a hang report named it (exit 1): never restarted, nothing pinned;
    nor after ranks that only lost a peer, restarted until the restarts run out."""
    nodes = ["n1", "n2"]
    bug = supervised_job(tmp_path, [step(nodes, {0: 4, 1: 1}, 1, hung="1 n2")], nodes)
    assert bug.returncode == 1 and "leaving" not in bug.stdout
    lost = supervised_job(tmp_path, [step(nodes, {0: 4, 1: 4}, 4)] * 2, nodes, MAX_RESTARTS="1")
    assert lost.returncode == 4 and "ATTEMPT 2/2" in lost.stdout and "leaving" not in lost.stdout
    assert not Path(JobPaths(str(tmp_path / "runs" / "job-77"), "77").node_failures).exists()


# ----------------------------------------------------------------------------- what caps the nodes left out

def test_a_rank_pinned_on_two_nodes_is_the_runs_own_failure_and_leaves_no_node_out(tmp_path):
    """Rank 0 killed twice on n1 (out of memory, say) leaves n1 out; killed again on n2, where it
    runs next, the failure follows the rank: neither node is left out for it. A node the job
    lost (no rank) still counts."""
    record = str(tmp_path / JobPaths.NODE_FAILURES.format("77"))
    killed = Pin("0", "rank 0 on it was killed by a signal")
    record_pins(record, {"n1": killed}, "attempt 1, exit 137")
    assert left_out(record_pins(record, {"n1": killed}, "attempt 2, exit 137")) == ["n1"]
    pins = record_pins(record, {"n2": killed, "n3": Pin("", "the job lost it")}, "attempt 1 after 1 requeue(s), exit 137")
    assert ranks_on_two_nodes(pins) == {"0": ["n1", "n2"]} and left_out(pins) == []
    pins = record_pins(record, {"n3": Pin("", "the job lost it")}, "attempt 2 after 1 requeue(s), exit 137")
    assert left_out(pins) == ["n3"]


def test_a_rank_that_fails_on_every_node_it_runs_on_leaves_none_out_and_says_so(tmp_path):
    """A hang report names rank 0 each time (the run's own deadlock): on n1 at two starts, n1 is
    left out and the step goes on without it, rank 0 now on n2; named there too, the failure
    is the run's, one line says so, and no second node is left out."""
    nodes = ["n1", "n2", "n3"]
    on_n1 = step(nodes, {1: 4, 2: 4}, 4, hung="0 n1", world_sizes="1 2 3")
    on_n2 = step(["n2", "n3"], {1: 4}, 4, hung="0 n2", world_sizes="1 2 3")
    result = supervised_job(tmp_path, [on_n1, on_n1, on_n2, on_n2], nodes, MIN_NODES="1")
    assert result.returncode == 4, result.stdout + result.stderr
    assert printed(result, "leaving") == [line for line in printed(result, "leaving n1 ")]
    assert printed(result, "rank 0 failed") == [
        "rank 0 failed on n1 and on n2: the failure follows the rank, the run's own, and no node is left out for it"]
    assert (tmp_path / "srun.log").read_text().splitlines()[2:] == ["--label --kill-on-bad-exit=1 --nodes=2 --ntasks=2 "
                                                                    "--exclude=n1"] * 2
    assert "gave up after 4 attempts" in printed(result, "END")[0]


def test_a_job_is_requeued_once_to_leave_a_node_out_never_twice(tmp_path):
    """A job requeued to leave n2 out (its record says so), then n3 pinned twice, with too few
    nodes left without it: not requeued again (each round might leave out another healthy
    node); it starts again as before until MAX_RESTARTS, then its END line and the line that
    continues the run, which excludes both."""
    record = Path(JobPaths(str(tmp_path / "runs" / "job-77"), "77").node_failures)
    record.parent.mkdir(parents=True)
    record.write_text("n2\t\tattempt 1, exit 137: the job lost it (Slurm took it from the job)\n" * 2)
    (tmp_path / "requeue-accepted").touch()
    hang = step(["n1", "n3"], {0: 4}, 4, hung="1 n3")
    result = supervised_job(tmp_path, [hang] * 3, ["n1", "n3"], excluded="n2", SLURM_RESTART_COUNT="1",
                            MAX_RESTARTS="2")
    assert result.returncode == 4, result.stdout + result.stderr
    assert "requeue 77" not in (tmp_path / "scontrol.log").read_text()
    assert printed(result, "ATTEMPT 3/3")[0].endswith(" with n3 (not requeued a second time to leave a node out); it "
                                                      "resumes from the newest checkpoint")
    assert "gave up after 3 attempts" in printed(result, "END")[0]
    assert " --exclude=n2,n3 " in printed(result, "to continue")[0]


def test_a_requeued_job_leaves_its_nodes_out_from_its_first_step(tmp_path):
    """Requeued, the job holds n2 again (Slurm could not keep it off): with MIN_NODES=2 its first
    step runs without n2; with MIN_NODES unset (every node), it runs on n2 as before, and a
    failure pinned there requeues it no more."""
    record = Path(JobPaths(str(tmp_path / "runs" / "job-77"), "77").node_failures)
    record.parent.mkdir(parents=True)
    record.write_text("n2\t1\tattempt 1, exit 4: a hang report named rank 1 on it\n" * 2)
    (record.parent / "job-77").mkdir()
    (record.parent / "job-77" / JobPaths.WORLD_SIZES).write_text("1 2 3\n")  # (the job's last start left them)
    nodes = ["n1", "n2", "n3"]
    result = supervised_job(tmp_path, [step(["n1", "n3"], {0: 0, 1: 0}, 0)], nodes, SLURM_RESTART_COUNT="1",
                            MIN_NODES="2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "srun.log").read_text().splitlines() == ["--label --kill-on-bad-exit=1 --nodes=2 --ntasks=2 "
                                                                "--exclude=n2"]
    assert printed(result, "the job holds n2 again") == [
        "the job holds n2 again, which it leaves out: its step runs on 2 node(s) with 2 rank(s) instead of 3, without it"]
    (tmp_path / "requeue-accepted").touch()
    hang = step(["n1", "n2"], {0: 4}, 4, hung="1 n2")
    result = supervised_job(tmp_path, [hang] * 2, ["n1", "n2"], SLURM_RESTART_COUNT="1", MAX_RESTARTS="1")
    assert result.returncode == 4 and "gave up after 2 attempts" in printed(result, "END")[0], result.stdout
    assert "requeue 77" not in (tmp_path / "scontrol.log").read_text()
    assert (tmp_path / "srun.log").read_text().splitlines() == ["--label --kill-on-bad-exit=1"] * 2


def test_after_a_node_left_out_a_lost_node_leaves_the_step_on_the_usable_nodes_alone(tmp_path):
    """n2 left out (the step on n1 and n3), then n3 lost: the job holds n1 and n2, of which n1
    alone is usable: the step goes on on 1 node, still without n2."""
    nodes = ["n1", "n2", "n3"]
    hang = step(nodes, {0: 4, 2: 4}, 137, hung="1 n2", world_sizes="1 2 3")
    lose_n3 = step(["n1", "n3"], {0: 4}, 137, world_sizes="1 2 3",
                   then=f"echo '{LINE} NumNodes=2 NodeList=n1,n2 ExcNodeList=(null)' > {tmp_path}/shows")
    result = supervised_job(tmp_path, [hang, hang, lose_n3, step(["n1"], {0: 0}, 0)], nodes, MIN_NODES="1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "srun.log").read_text().splitlines()[2:] == [
        "--label --kill-on-bad-exit=1 --nodes=2 --ntasks=2 --exclude=n2",
        "--label --kill-on-bad-exit=1 --nodes=1 --ntasks=1 --exclude=n2"]


def test_a_node_left_out_after_the_step_went_on_with_fewer_nodes_leaves_the_line_asking_for_the_jobs_nodes(tmp_path):
    """MIN_NODES=1 of 3 nodes: n3 lost, the step goes on with 2; then n2 pinned twice is left out
    (the line that continues the run excludes it from then on) and the step goes on on n1
    alone. That line still asks for the job's 3 nodes, as its first version did, not for the
    2 of the step that was running when n2 was left out."""
    nodes = ["n1", "n2", "n3"]
    lose_n3 = step(nodes, {0: 4, 1: 4}, 137, world_sizes="1 2 3",
                   then=f"echo '{LINE} NumNodes=2 NodeList=n1,n2 ExcNodeList=(null)' > {tmp_path}/shows")
    hang = step(["n1", "n2"], {0: 4}, 4, hung="1 n2", world_sizes="1 2 3")
    result = supervised_job(tmp_path, [lose_n3, hang, hang, step(["n1"], {0: 4}, 4)], nodes, MIN_NODES="1")
    assert result.returncode == 4, result.stdout + result.stderr
    assert (tmp_path / "srun.log").read_text().splitlines()[1:] == [
        "--label --kill-on-bad-exit=1 --nodes=2 --ntasks=2 --relative=0"] * 2 + [
        "--label --kill-on-bad-exit=1 --nodes=1 --ntasks=1 --exclude=n2"]
    line = printed(result, "to continue")[0]
    assert " --nodes=3 " in line and " --exclude=n2 " in line, line


def test_a_lost_node_with_min_nodes_starts_the_step_again_on_the_node_left_as_recovery_md_quotes(tmp_path):
    """MIN_NODES=1 of 2 nodes, n2 lost (scontrol shows n1 alone): the step starts again on n1
    with 1 rank, and its ATTEMPT line is the one docs/recovery.md quotes, whole."""
    lose_n2 = step(["n1", "n2"], {0: 4}, 137, world_sizes="1 2",
                   then=f"echo '{LINE} NumNodes=1 NodeList=n1 ExcNodeList=(null)' > {tmp_path}/shows")
    result = supervised_job(tmp_path, [lose_n2, step(["n1"], {0: 0}, 0)], ["n1", "n2"], MIN_NODES="1")
    assert result.returncode == 0, result.stdout + result.stderr
    attempt = printed(result, "ATTEMPT 2/4")[0]
    assert attempt.endswith(": the job holds 1 of its 2 nodes (n1), so on 1 node(s) with 1 rank(s) instead of 2; it resumes "
                            "from the newest checkpoint"), attempt
    assert_quoted_whole("docs/recovery.md", attempt)


def test_a_node_name_outside_the_jobs_node_list_is_never_pinned(tmp_path):
    """Ranks that name their nodes otherwise than Slurm (a container without SLURMD_NODENAME: its
    own host name) pin nothing, though a hang report names one and the job loses n2: no
    bogus name in the record or in --exclude, and no lost node pinned for names not the job's."""
    nodes = ["n1", "n2"]
    shows_n1 = f"echo '{LINE} NumNodes=1 NodeList=n1 ExcNodeList=(null)' > {tmp_path}/shows"
    hang = step(["c7f3a", "c9b2e"], {0: 4}, 4, hung="1 c9b2e", world_sizes="1 2", then=shows_n1)
    result = supervised_job(tmp_path, [hang, hang, step(["c7f3a"], {0: 0}, 0)], nodes, MIN_NODES="1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "leaving" not in result.stdout and "c9b2e" not in (tmp_path / "srun.log").read_text()
    assert not Path(JobPaths(str(tmp_path / "runs" / "job-77"), "77").node_failures).exists()


# ----------------------------------------------------------------------------- what Slurm can keep the job off

def test_a_node_is_kept_off_only_while_the_partition_has_enough_usable_nodes_without_it():
    """sinfo's usable nodes (busy ones count, down, drained and failed ones not); each node left
    out is kept off while the nodes left, less the job's own ExcNodeList, still number the job's
    nodes; where Slurm cannot say, every one as before."""
    listing = "n1 allocated\nn2 mixed\nn3 idle*\nn4 down*\nn5 drained\nn6 draining\nn7 fail\nn1 allocated\n"
    assert usable_nodes(listing) == ["n1", "n2", "n3"]
    usable = Usable("partition gpu", ["n1", "n2", "n3", "n4"])
    assert kept_off(["n2"], usable, [], 3) == ["n2"]
    assert kept_off(["n2"], usable, [], 4) == []
    assert kept_off(["n2"], usable, ["n4"], 3) == []  # (yours count)
    assert kept_off(["n2", "n3"], usable, [], 2) == ["n2", "n3"] and kept_off(["n2", "n3"], usable, [], 3) == ["n2"]
    assert kept_off(["n2"], None, [], 4) == ["n2"]
    pins = [Pin("1", "a hang report named rank 1 on it")] * 2
    assert cannot_keep_off_line("n2", failures=pins, usable=usable, excluded=["n4"], count=3) == (
        "Slurm cannot keep this job off n2, though 2 failures were pinned on it (a hang report named rank 1 on it; a hang "
        "report named rank 1 on it): partition gpu has 4 usable nodes, 2 without n2 and the nodes the job excludes, and "
        "the job asks for 3, so neither a requeue nor the line that continues the run excludes n2")


@pytest.mark.parametrize("partition, reservation, where", [
    ("n1 idle\nn2 idle\nn3 idle\n", "", "partition gpu has 3 usable nodes, 2 without n2"),
    ("n1 idle\nn2 idle\nn3 idle\nn4 drained\n", "", "partition gpu has 3 usable nodes, 2 without n2"),
    ("n1 idle\nn2 idle\nn3 idle\nn4 idle\n", "n1,n2,n3", "reservation big (partition gpu) has 3 usable nodes, 2 without n2"),
], ids=["partition", "partition with a drained node", "reservation"])
def test_a_job_on_every_usable_node_starts_again_on_them_and_its_line_excludes_none(tmp_path, partition, reservation,
                                                                                   where):
    """3 nodes of a partition (or reservation) of 3 usable ones; n2 hangs at every start. Once
    two failures are pinned on n2, a requeue without it would leave the job PENDING for good:
    one line says n2 cannot be left out and why; the job is not requeued, but starts again
    on the same nodes until MAX_RESTARTS, and the line after END excludes nothing."""
    nodes = ["n1", "n2", "n3"]
    (tmp_path / "partition").write_text(partition)
    (tmp_path / "reservation").write_text(f"ReservationName=big Nodes={reservation} NodeCnt=3\n")
    (tmp_path / "requeue-accepted").touch()  # (a requeue would end the supervisor: exit -9)
    hang = step(nodes, {0: 4, 2: 4}, 4, hung="1 n2")
    result = supervised_job(tmp_path, [hang] * 3, nodes, shown=f"Reservation={reservation and 'big' or '(null)'}",
                            MAX_RESTARTS="2")
    assert result.returncode == 4, result.stdout + result.stderr
    assert "requeue" not in (tmp_path / "scontrol.log").read_text() and "leaving" not in result.stdout
    [cannot] = printed(result, "Slurm cannot keep this job off n2, though 2 failures were pinned on it (")
    assert f"): {where}, and the job asks for 3, so neither a requeue nor " in cannot, cannot
    assert (tmp_path / "srun.log").read_text().splitlines() == ["--label --kill-on-bad-exit=1"] * 3
    assert printed(result, "ATTEMPT 3/3")[0].endswith(
        ": starting the step again in this allocation with n2, which Slurm could not place the job without; it resumes "
        "from the newest checkpoint")
    assert "gave up after 3 attempts" in printed(result, "END")[0]
    assert "--exclude" not in result.stdout.splitlines()[-1]


def test_where_slurm_cannot_say_which_nodes_are_usable_the_node_is_left_out_as_before(tmp_path):
    """sinfo fails: one line says so, and the job leaves n2 out as before (requeued without it)."""
    nodes = ["n1", "n2"]
    hang = step(nodes, {0: 4}, 4, hung="1 n2")
    supervised_job(tmp_path, [], nodes)  # (makes the stand-ins)
    (tmp_path / "bin" / "sinfo").write_text("#!/bin/sh\necho 'sinfo: error: Unable to contact slurm controller' >&2\n"
                                            "exit 1\n")
    result = supervised_job(tmp_path, [hang, hang], nodes)
    assert result.returncode == 4, result.stdout + result.stderr
    assert printed(result, "could not ask Slurm which nodes Slurm job 77 may run on (sinfo: error: Unable to contact "
                           "slurm controller); it leaves n2 out of its requeue and of the line that continues the "
                           "run, as before")
    assert len(printed(result, "leaving n2 out")) == 1 and " --exclude=n2 " in printed(result, "to continue")[0]


def test_where_min_nodes_lets_the_step_go_on_its_lines_agree_it_leaves_out_the_node_slurm_cannot_keep_it_off(
        tmp_path):
    """3 nodes of a partition of 3, MIN_NODES=2; n2 hangs at two starts. Slurm cannot keep the
    job off n2, which one line says (no requeue, no --exclude); the step in this allocation
    still leaves n2 out, on n1 and n3, which the ATTEMPT line says: no line says n2 cannot be
    left out."""
    nodes = ["n1", "n2", "n3"]
    (tmp_path / "partition").write_text("n1 idle\nn2 idle\nn3 idle\n")
    hang = step(nodes, {0: 4, 2: 4}, 137, hung="1 n2", world_sizes="1 2 3")
    result = supervised_job(tmp_path, [hang, hang, step(["n1", "n3"], {0: 0, 1: 0}, 0)], nodes, MIN_NODES="2")
    assert result.returncode == 0, result.stdout + result.stderr
    [cannot] = printed(result, "Slurm cannot keep this job off n2, though 2 failures were pinned on it (")
    assert cannot.endswith(": partition gpu has 3 usable nodes, 2 without n2, and the job asks for 3, so neither a "
                           "requeue nor the line that continues the run excludes n2"), cannot
    assert "cannot leave" not in result.stdout and "leaving" not in result.stdout
    assert printed(result, "ATTEMPT 3/4")[0].endswith(
        ": the job holds 3 of its 3 nodes (n1,n2,n3), 2 without the node it leaves out, so on 2 node(s) with 2 rank(s) "
        "instead of 3; it resumes from the newest checkpoint")
    assert (tmp_path / "srun.log").read_text().splitlines()[2] == "--label --kill-on-bad-exit=1 --nodes=2 --ntasks=2 --exclude=n2"
    assert "requeue" not in (tmp_path / "scontrol.log").read_text()


def test_two_nodes_left_out_at_once_one_slurm_can_keep_the_job_off_and_one_not_the_attempt_line_names_each(tmp_path):
    """3 nodes of a partition of 4, MIN_NODES unset, the job's own ExcNodeList n9: ranks on n2
    and n3 hang at two starts. Slurm can keep the job off n2 (n1, n3, n4 are left), not off
    both: no requeue (it would place the job on n3 again); the step starts again on every node,
    and the ATTEMPT line names both, and what happens to each; the line after END excludes n2
    alone. The job's own ExcNodeList is listed once (scontrol show hostnames), however often
    the supervisor asks which nodes Slurm can keep the job off."""
    nodes = ["n1", "n2", "n3"]
    hang = step(nodes, {0: 4}, 4, hung="1 n2\n2 n3")
    result = supervised_job(tmp_path, [hang] * 3, nodes, excluded="n9", MAX_RESTARTS="2")
    assert result.returncode == 4, result.stdout + result.stderr
    assert "requeue" not in (tmp_path / "scontrol.log").read_text()
    assert len(printed(result, "leaving n2 out")) == 1 and len(printed(result, "Slurm cannot keep this job off n3, ")) == 1
    assert printed(result, "ATTEMPT 3/3")[0].endswith(
        ": starting the step again in this allocation with n3, which Slurm could not place the job without, and with n2, "
        "which the line that continues the run excludes (not requeued without it: Slurm would place the job on n3 "
        "again); it resumes from the newest checkpoint")
    line = printed(result, "to continue")[0]
    assert " --exclude=n9,n2 " in line and "n3" not in line, line
    assert (tmp_path / "scontrol.log").read_text().splitlines().count("show hostnames n9") == 1


def test_the_line_after_end_says_which_excluded_nodes_a_job_of_the_run_left_out_and_how_to_take_one_back(tmp_path):
    """A job submitted with the line that job 12 printed (--exclude=n2, which job 12 left out,
    and n5, the user's own): its line after END still excludes both, and the next line says
    which is which, and how to take n2 back once repaired."""
    record = Path(JobPaths(str(tmp_path / "runs" / "job-77"), "12").node_failures)
    record.parent.mkdir(parents=True)
    record.write_text("n2\t1\tattempt 1, exit 4: a hang report named rank 1 on it\n" * 2
                      + "n3\t2\tattempt 2, exit 4: a hang report named rank 2 on it\n")
    nodes = ["n1", "n3"]
    result = supervised_job(tmp_path, [step(nodes, {0: 4}, 4)], nodes, excluded="n2,n5", MAX_RESTARTS="0")
    assert result.returncode == 4, result.stdout + result.stderr
    line, note = result.stdout.splitlines()[-2:]
    assert " --exclude=n2,n5 " in line, line
    assert note == ("--exclude=n2,n5 in that line: n2 left out by job 12 of this run (2 failures were pinned on it), n5 "
                    "yours; every later line keeps n2 excluded: take it out of --exclude once it is repaired")
