"""mnist_ddp.py --check, the one-minute doctor, without Slurm: one process, two ranks under
torchrun (each rank's line, the known-answer and the timed all-reduce, exit 0), and a rank
that never comes (exit 4 within --dist-timeout, naming it). The two-node cluster with a
firewall between the nodes is tests/cluster/own_clusters/test_slurm_on_own_clusters.py's
test_check_reports_every_rank_of_two_nodes_and_names_the_node_a_firewall_cuts_off.

    python -m pytest tests/runs/test_doctor.py
"""

import re
import socket

import pytest

from helpers.processes import assert_ok, run_as_srun, run_single, run_torchrun


def test_check_of_one_process(tmp_path):
    result = run_single(["--check"], tmp_path)
    assert_ok(result)
    assert re.search(r"^check: one rank, nothing to meet: \S+  cpu  \d+ CPUs? \([\d,-]+\)  0 GPUs", result.stdout, re.M)
    assert re.search(r"^check passed in [\d.]+ s$", result.stdout, re.M)
    assert not (tmp_path / "runs").exists()  # nothing trained, nothing written


@pytest.mark.slow
def test_check_of_two_ranks_under_torchrun(tmp_path):
    result = run_torchrun(2, ["--check"], tmp_path)
    assert_ok(result)
    host = socket.gethostname()
    for rank in (0, 1):
        assert re.search(rf"^check: rank {rank}  {re.escape(host)}  cpu  .*  gloo via \S+ [\d.]+ .*  torch ",
                         result.stdout, re.M), result.stdout
    assert "check: the all-reduce with a known answer is right; a 64 MB all-reduce takes " in result.stdout
    assert re.search(r"^check passed in [\d.]+ s: every rank joined, connected and reduced correctly", result.stdout, re.M)


@pytest.mark.slow
def test_a_rank_that_never_comes_is_named_within_the_timeout(tmp_path):
    ranks = run_as_srun(2, ["--check", "--dist-timeout", "10"], tmp_path, detach=True)
    ranks[1].kill()  # before it could join
    out, err = ranks[0].communicate(timeout=120)
    ranks[1].wait()
    assert ranks[0].returncode == 4, out + err
    assert re.search(r"^check failed after \d+ s: rank 1 never joined the rendezvous at 127\.0\.0\.1:\d+ within 10 s; "
                     r"check that their nodes reach ", out, re.M), out
