"""What the ranks' exit codes mean to the supervisor (ddpkit/supervisor/outcome.py): which
outcomes it restarts (settle, over the files the ranks write), and after a lost node, how
many nodes the step goes on with.

    python -m pytest tests/unit/test_supervisor_outcome.py
"""

import pytest

from ddpkit.job.contract import JobPaths, job_fields, read_codes
from ddpkit.supervisor.nodes import Step
from ddpkit.supervisor.outcome import Outcome, nodes_to_go_on_with, read_world_sizes, settle
from ddpkit.supervisor.step import resubmit_line, step_command
from helpers.supervisor import JOB, LINE, settings


@pytest.mark.parametrize("srun_status, codes, status, retry", [
    (0, {0: 0, 1: 0}, 0, False),
    (137, {0: 4}, 137, True),             # rank 1 killed (SIGKILL, the OOM killer), rank 0 lost it
    (143, {0: 4}, 143, True),             # ... and srun ended rank 0 with SIGTERM
    (4, {0: 4, 1: 4}, 4, True),           # both lost a peer (a hang ended by --dist-timeout)
    (4, {0: 4, 1: 1}, 1, False),          # rank 1's bug, rank 0 lost it: the bug decides
    (4, {0: 4, 1: 3}, 3, False),          # rank 1 diverged, rank 0 lost it: never retried
    (143, {0: 3, 1: 4}, 3, False),        # ... the other way round, srun ending the rest
    (4, {0: 4, 1: 2}, 2, False),          # rank 1's usage problem, rank 0 lost it
    (137, {0: 75, 1: 4}, 75, False),      # rank 0 stopped on a signal, rank 1 lost it on the way out
    (137, {0: 3, 1: 75}, 3, False),       # a divergence beats a stop
    (2, {0: 2, 1: 2}, 2, False),          # a usage problem
    (3, {0: 3, 1: 3}, 3, False),          # diverged
    (75, {0: 75, 1: 75}, 75, False),      # stopped on a signal, not requeued
    (1, {}, 1, False),                    # died before main() (an import error): no codes, no signal
    (139, {0: 0, 1: 0}, 0, False),        # every rank finished and saved, then one died at exit: done
    (134, {0: 0}, 134, True),             # rank 1 died before it recorded anything: killed
    (137, {0: 4, 1: 5}, 5, True),         # rank 1's node failed it (a CUDA error), rank 0 lost it: restarted
    (4, {0: 1, 1: 5}, 1, False),          # ... but a bug on any rank decides
])
def test_which_outcomes_the_supervisor_retries(tmp_path, srun_status, codes, status, retry):
    """settle over the files the ranks write (rank-<r>, the code and a newline)."""
    for rank, code in codes.items():
        (tmp_path / JobPaths.RANK_CODE.format(rank)).write_text(f"{code}\n")
    outcome = settle(srun_status, read_codes(str(tmp_path)), 2)
    assert (outcome.status, outcome.retry) == (status, retry), outcome
    assert not retry or outcome.why
    assert outcome.note.startswith(f"every rank had finished and saved (each recorded exit 0) before srun's exit "
                                   f"{srun_status} ") == (srun_status != 0 and status == 0)


def test_settle_names_the_first_rank_that_decided_and_every_killed_one():
    assert settle(4, {0: 4, 1: 2, 2: 1}, 3) == Outcome(2, why="rank 1 exited with 2")
    assert settle(137, {1: 4}, 4).why.startswith("rank 0 2 3 ended without an exit code: killed by a signal")
    assert settle(137, {1: 4}, 4).killed == (0, 2, 3)  # (which the supervisor pins the failure on)
    assert settle(4, {0: 4, 1: 4}, 2) == Outcome(4, True, "rank 0 1 lost contact with a peer that died or hung")


def test_after_a_lost_node_the_step_goes_on_with_the_most_nodes_the_batch_splits_among(tmp_path):
    """MIN_NODES=1 on 2 nodes x 2 tasks: with 1 node left, 2 ranks if the batch splits among
    them, none if it does not; without rank 0's list, the divisors of the world size. The
    step then asks srun for that many nodes and tasks (its variables still say 2 and 4)."""
    s = settings(tmp_path, MIN_NODES="01")
    assert (s.nodes, s.min_nodes, settings(tmp_path).min_nodes) == (2, 1, 2)
    assert nodes_to_go_on_with(1, 1, 2, [1, 2, 4]) == 1
    assert nodes_to_go_on_with(1, 1, 2, [1, 4]) == 0
    assert nodes_to_go_on_with(1, 2, 2, [1, 2, 4]) == 0  # fewer than MIN_NODES
    assert nodes_to_go_on_with(3, 1, 4, [1, 2, 4, 8, 16]) == 2  # 12 ranks do not split 128; 8 do
    assert read_world_sizes(str(tmp_path / "none"), 12) == [1, 2, 3, 4, 6, 12]
    (tmp_path / JobPaths.WORLD_SIZES).write_text("1 2 3 4 6\n")
    assert read_world_sizes(str(tmp_path), 12) == [1, 2, 3, 4, 6]
    assert "--no-kill" in resubmit_line(s, JOB, job_fields(LINE)).split()  # (MIN_NODES needs it)
    assert "--no-kill" not in resubmit_line(settings(tmp_path), JOB, job_fields(LINE)).split()
    s.python = "/v/bin/python"
    assert step_command(s, "/code/ddpkit/supervisor/main.py", ["t.py"], step=Step(1, 2, (), ""))[:7] == [
        "srun", "--label", "--kill-on-bad-exit=1", "--nodes=1", "--ntasks=2", "--relative=0", "/v/bin/python"]
