"""mnist_ddp.py --check, the one-minute doctor, without Slurm: one process (its storage's file
systems: one node cannot tell what locks do across nodes), two ranks under
torchrun (each rank's line, the known-answer and the timed all-reduce, the timed training
step, exit 0), three ranks under torchrun of which one is slow (named, without the --exclude
of its host, the job's only one; exit 0 still), and a rank that never comes (exit 4 within
--dist-timeout, naming it). The two-node cluster with a firewall between the nodes is
tests/cluster/own_clusters/test_slurm_on_own_clusters.py's
test_check_reports_every_rank_of_two_nodes_and_names_the_node_a_firewall_cuts_off; a slow
node of three, tests/cluster/mostly_waiting/test_check_on_three_nodes.py.

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
    for label in ("LOG_DIR", "DATA_DIR"):  # (their file system; what locks do across nodes, one node cannot tell)
        assert re.search(rf"^check: {label} /\S+ \(not there yet: probed in its parent\): \S+ \S+ on /\S*.*; whether its "
                         r"locks exclude across nodes cannot be told with one node$", result.stdout, re.M), result.stdout
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
    assert re.search(r"^check: a training step of the recipe's model \(cnn, 128 images of 1 x 28 x 28\) takes [\d.]+ ms on "
                     r"the median rank \([\d.]+-[\d.]+ ms over 2 ranks\)$", result.stdout, re.M), result.stdout
    assert "exchange of" not in result.stdout  # (one host: no pair of nodes to time)
    assert re.search(r"^check passed in [\d.]+ s: every rank joined, connected and reduced correctly", result.stdout, re.M)


@pytest.mark.slow
def test_a_check_that_passed_ends_its_process_group_and_its_threads_before_the_interpreter_exits(tmp_path):
    """Under torchrun, as the abort was seen (once in 13 runs under load: "terminate called
    without an active exception" after "check passed", torchrun's exit 1): as each rank's
    interpreter begins to exit, none of torch's native threads is left (Gloo's loop and
    workers, the store's server), which could otherwise take the interpreter's lock during
    its finalization and abort the process. The aid AID_THREADS_AT_EXIT names them."""
    result = run_torchrun(2, ["--check"], tmp_path, AID_THREADS_AT_EXIT="1")
    assert_ok(result)
    left = re.findall(r"^aid: rank (\d) threads at exit: (.*)$", result.stderr, re.M)
    assert sorted(rank for rank, _ in left) == ["0", "1"], result.stderr[-3000:]
    for rank, threads in left:
        assert not [name for name in threads.split() if name.startswith(("gloo", "pt_"))], (rank, threads)


@pytest.mark.slow
def test_check_names_the_slow_rank_of_three_but_not_the_exclude_of_its_only_host(tmp_path):
    """Rank 1's timed training steps take 0.5 s more (the aid AID_SLOW): rank 0 names it in one
    line, more than 1.5x the other ranks' median, and says that leaving out its host, where
    the other ranks run as fast as they should, would not help; the check still passes (exit
    0: slow, not broken)."""
    result = run_torchrun(3, ["--check"], tmp_path, AID_SLOW="1:0.5")
    assert_ok(result)
    host = re.escape(socket.gethostname())
    slow = re.findall(r"^check: .* is slow: .*$", result.stdout, re.M)
    assert len(slow) == 1 and re.fullmatch(
        rf"check: rank 1 on {host} is slow: a training step takes (\d+\.\d) ms, (\d+\.\d)x the other ranks' median of "
        rf"\d+\.\d ms \(its device, or its CPUs\?\); every rank runs on {host}, so leaving it out would not help: check "
        r"that rank's GPU, and that each rank has CPUs of its own \(--cpus-per-task\)", slow[0]), result.stdout
    assert float(re.search(r"takes (\d+\.\d) ms", slow[0]).group(1)) >= 500
    assert re.search(r"^check passed in [\d.]+ s: .*; every step will wait for the slow ones above$", result.stdout, re.M)


@pytest.mark.slow
def test_a_rank_that_never_comes_is_named_within_the_timeout(tmp_path):
    ranks = run_as_srun(2, ["--check", "--dist-timeout", "10"], tmp_path, detach=True)
    ranks[1].kill()  # before it could join
    out, err = ranks[0].communicate(timeout=120)
    ranks[1].wait()
    assert ranks[0].returncode == 4, out + err
    assert re.search(r"^check failed after \d+ s: rank 1 never joined the rendezvous at 127\.0\.0\.1:\d+ within 10 s; "
                     r"check that their nodes reach ", out, re.M), out
