"""Failures across nodes, on a three-node cluster in network namespaces (local-slurm.sh): a
node that hangs at every start left out (in training, or at start-up), and a node lost (the
job requeued onto the nodes left by Slurm, or under --no-kill by the supervisor; with
MIN_NODES going on with the node it still holds). On one node: tests/cluster/one_node/test_recovery_on_slurm.py; a torchrun
worker killed across two nodes: tests/cluster/own_clusters/test_slurm_on_own_clusters.py.

The times these tests print (node lost to training again) are the README's "Failures and
recovery" figures; nothing asserts on them.

    python -m pytest tests/cluster/mostly_waiting/test_recovery_across_nodes.py
"""

import contextlib
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.cluster import FAST, LOCAL_SLURM, finish, output_of, signal_rank, wait_for
from helpers.images import read_metrics
from helpers.processes import clean_env


@pytest.fixture(autouse=True)
def three_idle_nodes(three_nodes):
    """Each test starts on three idle nodes, whatever the one before it cut off or drained."""
    three_nodes.every_node_idle()


def test_a_job_leaves_out_a_node_that_hangs_at_every_start_and_finishes_on_the_other_two(three_nodes, tmp_path):
    """A 2-node job whose rank on ftn2 hangs at every start (AID_HANG_HOST=ftn2:3): a hang report
    names it, --dist-timeout ends the wait, and the step starts again; after its second failure
    the job leaves ftn2 out (one line says so, and why), and, holding no other node, is
    requeued with ftn2 in its ExcNodeList: it runs again on ftn1 and ftn3 and ends with exit 0.
    The first test on a fresh cluster: Slurm gives a job the lowest free nodes, ftn1 and ftn2."""
    args = [*FAST, "--epochs", "2", "--dist-timeout", "10", "--hang-after", "5"]
    client = three_nodes.sbatch(tmp_path, ["--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", "--mem=1G"], args,
                                RUN_NAME="sick", AID_HANG_HOST="ftn2:3", MAX_RESTARTS="5")
    started = wait_for(tmp_path, r"^START .* restart=0 nodes=ftn\[1-2\] ")
    events = {"second attempt": wait_for(tmp_path, r"^ATTEMPT 2/6 after exit \d+ ", timeout=300),
              "ftn2 left out, requeued": wait_for(tmp_path, r"^requeueing Slurm job ", timeout=300),
              "running again": wait_for(tmp_path, r"^START .* restart=1 ", timeout=300),
              "training again": wait_for(tmp_path, r"^0: epoch   1 \|", timeout=300)}
    job_id, out = finish(client, tmp_path)
    events["END"] = time.monotonic()
    print("\n" + "; ".join(f"{what} at {when - started:.1f} s" for what, when in events.items()) + " after the job's START")
    left = re.findall(r"^leaving ftn2 out of this job from now on: .*$", out, re.M)
    assert len(left) == 1 and re.fullmatch(
        r"leaving ftn2 out of this job from now on: 2 failures were pinned on it \(attempt 1, exit \d+: a hang report "
        r"named rank 1 on it.*; attempt 2, exit \d+: a hang report named rank 1 on it.*\)", left[0]), out[-4000:]
    print(left[0])
    assert re.search(rf"^requeueing Slurm job {job_id} after exit \d+: the job holds 2 of its 2 nodes \(ftn\[1-2\]\), 1 "
                     r"without the node it leaves out, fewer than MIN_NODES=2 \(unset: every node of the job\); it resumes", out, re.M)
    assert re.search(rf"^START .* job={job_id} restart=1 nodes=ftn\[1,3\] ", out, re.M), out[-4000:]
    assert re.search(rf"^END .* job={job_id} exit=0$", out, re.M)
    # The supervisor names ftn2 once, as left out (the ranks' lines and srun's name it as they run there).
    assert [line for line in out.splitlines() if "ftn2" in line and not re.match(r"\d+: |srun: ", line)] == left
    assert [m["epoch"] for m in read_metrics(tmp_path / "runs" / "sick")] == [1, 2]


def test_a_job_on_every_node_of_its_partition_never_leaves_a_node_out_that_slurm_cannot_place_it_without(three_nodes,
                                                                                                         tmp_path):
    """A 3-node job on the 3-node partition whose rank on ftn2 hangs at every start: after the
    second failure pinned on ftn2, leaving it out would requeue the job where Slurm can never
    place it (PENDING, BadConstraints, for good). One line says Slurm cannot keep the job off ftn2,
    naming the partition and its counts; the step starts again on the same nodes until
    MAX_RESTARTS, then the END line and a line that continues the run without --exclude=ftn2,
    which sbatch accepts, run as printed."""
    args = [*FAST, "--epochs", "2", "--dist-timeout", "10", "--hang-after", "5"]
    client = three_nodes.sbatch(tmp_path, ["--nodes=3", "--ntasks-per-node=1", "--cpus-per-task=1", "--mem=1G"], args,
                                RUN_NAME="everynode", AID_HANG_HOST="ftn2:3", MAX_RESTARTS="2")
    wait_for(tmp_path, r"^START .* restart=0 nodes=ftn\[1-3\] ")
    job_id = next(tmp_path.glob("mnist-ddp-*.out")).name.removeprefix("mnist-ddp-").removesuffix(".out")
    try:
        wait_for(tmp_path, r"^(Slurm cannot keep this job off ftn2|requeueing Slurm job)", timeout=300)
        assert "requeueing" not in output_of(tmp_path), output_of(tmp_path)[-4000:]  # (else PENDING for good)
        client.communicate(timeout=400)
    finally:
        three_nodes.run("scancel", job_id)  # (a job left PENDING for good would hold the next tests' cluster)
    out = output_of(tmp_path)
    cannot = re.findall(r"^Slurm cannot keep this job off ftn2, .*$", out, re.M)
    print("\n" + "\n".join(cannot))
    assert len(cannot) == 1 and re.search(r"\): partition local has 3 usable nodes, 2 without ftn2, and the job asks for "
                                          r"3, ", cannot[0]), out[-4000:]
    assert "requeueing" not in out and not re.search(r"^START .* restart=1 ", out, re.M)
    assert re.search(r"^ATTEMPT 3/3 after exit \d+ .* with ftn2, which Slurm could not place the job without; ", out, re.M), out[-4000:]
    assert re.search(rf"^END .* job={job_id} exit=\d+ gave up after 3 attempts", out, re.M), out[-4000:]
    line = re.search(r"^to continue from the newest checkpoint, from (\S+): (.*)$", out, re.M)
    assert line and "--exclude" not in line.group(2), out[-2000:]
    # As printed, through a shell, in the directory it names: sbatch accepts it (the job is cancelled at once).
    again = subprocess.run([str(LOCAL_SLURM), "exec", str(three_nodes.dir), "bash", "-c", line.group(2)],
                           cwd=line.group(1), env=three_nodes.env, capture_output=True, text=True, timeout=120)
    submitted = re.search(r"Submitted batch job (\d+)", again.stdout)
    if submitted:
        three_nodes.run("scancel", submitted.group(1))
    assert again.returncode == 0 and submitted, again.stdout + again.stderr


def test_the_line_after_end_says_which_node_the_job_left_out_and_runs_as_printed(three_nodes, tmp_path):
    """A 2-node job whose rank on ftn2 hangs at every start gives up (MAX_RESTARTS=1) just as
    ftn2 is left out: its line after END excludes ftn2, the next line says the job left it
    out and how to take it back once repaired, and sbatch accepts the line, run as printed."""
    args = [*FAST, "--epochs", "2", "--dist-timeout", "10", "--hang-after", "5"]
    client = three_nodes.sbatch(tmp_path, ["--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", "--mem=1G"], args,
                                RUN_NAME="gaveup", AID_HANG_HOST="ftn2:3", MAX_RESTARTS="1")
    client.communicate(timeout=400)
    out = output_of(tmp_path)
    assert re.search(r"^END .* exit=\d+ gave up after 2 attempts", out, re.M), out[-4000:]
    line = re.search(r"^to continue from the newest checkpoint, from (\S+): (.*)\n(.*)$", out, re.M)
    assert line and " --exclude=ftn2 " in line.group(2), out[-3000:]
    assert line.group(3) == ("--exclude=ftn2 in that line: ftn2 left out by this job (2 failures were pinned on it); "
                             "every later line keeps ftn2 excluded: take it out of --exclude once it is repaired")
    again = subprocess.run([str(LOCAL_SLURM), "exec", str(three_nodes.dir), "bash", "-c", line.group(2)],
                           cwd=line.group(1), env=three_nodes.env, capture_output=True, text=True, timeout=120)
    submitted = re.search(r"Submitted batch job (\d+)", again.stdout)
    if submitted:
        three_nodes.run("scancel", submitted.group(1))  # (accepted is all this test asks)
    assert again.returncode == 0 and submitted, again.stdout + again.stderr


def test_a_job_leaves_out_a_node_that_stops_at_every_start_up_and_finishes_on_the_other_two(three_nodes, tmp_path):
    """A 2-node job whose rank on ftn2 stops itself (SIGSTOP) at every start as it wraps its model
    in DDP (AID_STOP_HOST=ftn2), before any step: rank 0 waits for it in DDP's broadcast of the
    weights, a hang report names it (no answer, from another node), and
    --dist-timeout ends the wait; after its second failure the job leaves ftn2 out and finishes
    on ftn1 and ftn3 with exit 0. (Slurm gives a job on idle nodes the lowest: ftn1 and ftn2.)"""
    args = [*FAST, "--epochs", "1", "--dist-timeout", "10", "--hang-after", "5"]
    client = three_nodes.sbatch(tmp_path, ["--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", "--mem=1G"], args,
                                RUN_NAME="stops", AID_STOP_HOST="ftn2", MAX_RESTARTS="5")
    job_id, out = finish(client, tmp_path)
    reports = re.findall(r"^0: hang at start-up, before the first step: rank 1 on ftn2: no answer; rank\(s\) 0 wait for it "
                         r"in .*$", out, re.M)
    assert len(reports) == 2, out[-4000:]
    print(reports[0])
    left = re.findall(r"^leaving ftn2 out of this job from now on: .*$", out, re.M)
    assert len(left) == 1 and re.fullmatch(
        r"leaving ftn2 out of this job from now on: 2 failures were pinned on it \(attempt 1, exit \d+: a hang report "
        r"named rank 1 on it.*; attempt 2, exit \d+: a hang report named rank 1 on it.*\)", left[0]), out[-4000:]
    assert re.search(rf"^START .* job={job_id} restart=1 nodes=ftn\[1,3\] ", out, re.M), out[-4000:]
    assert re.search(rf"^END .* job={job_id} exit=0$", out, re.M)
    assert len(re.findall(r"^0: hang ", out, re.M)) == 2  # (none on ftn1 and ftn3, where nothing hangs)
    assert [m["epoch"] for m in read_metrics(tmp_path / "runs" / "stops")] == [1]


@contextlib.contextmanager
def rank_1_node_cut_off(submit_dir: Path, run_name: str):
    """Rank 1's node drops off the network (its link into the cluster's bridge goes down) and
    its rank is killed; yields (rank 0's node, the lost node, when); the link comes back after."""
    first, node = (re.search(rf"^{r}: \[rank {r}/2\] (\S+) ", output_of(submit_dir), re.M).group(1) for r in (0, 1))
    link = ["ip", "-n", f"{node[:-2]}-ctl", "link", "set", f"v{node[-1]}"]  # (local-slurm.sh's names: ftn2 is v2 in ft-ctl)
    subprocess.run([*link, "down"], check=True)
    try:
        yield first, node, signal_rank(run_name, 1, signal.SIGKILL)
    finally:
        subprocess.run([*link, "up"], check=True)


def test_a_job_that_loses_a_node_goes_on_with_the_node_left_at_half_the_world_size(three_nodes, tmp_path):
    """MIN_NODES=1, --no-kill: a 2-node job's second node drops off the network (its link down)
    and its rank is killed. Slurm declares the node down and leaves the job the first one;
    the supervisor starts the step there with 1 rank, which goes on in mid-epoch from the
    checkpoint of 2 with the same global batch, and the job ends with exit 0, each epoch
    logged once, within 0.3 points of the accuracy of a run that lost nothing."""
    args = ["--ckpt-every", "10", "--epochs", "4"]
    client = three_nodes.sbatch(tmp_path, ["--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", "--mem=1G",
                                           "--no-kill"], args, RUN_NAME="shrunk", MIN_NODES="1")
    wait_for(tmp_path, r"^0: epoch   1 \|")
    with rank_1_node_cut_off(tmp_path, "shrunk") as (first, _, lost):
        went_on = wait_for(tmp_path, r"^ATTEMPT 2/4 after exit .*: the job holds 1 of its 2 nodes", timeout=300)
        job_id, out = finish(client, tmp_path)
        ended = time.monotonic()
    print(f"\nnode lost at 0 s; the job went on with 1 node at {went_on - lost:.1f} s; it finished at {ended - lost:.1f} s")
    shrunk = re.search(r"^ATTEMPT 2/4 after exit .*$", out, re.M).group(0)
    print(shrunk)
    assert shrunk.endswith(f"the job holds 1 of its 2 nodes ({first}), so on 1 node(s) with 1 rank(s) "
                           "instead of 2; it resumes from the newest checkpoint"), shrunk
    assert re.search(r"^0: global batch 128 \(1 x 128\)", out, re.M), out[-3000:]
    assert re.search(r"^0: \S+ckpt-\d+\.pt was written by 2 ranks, this run has 1: the same global batch of 128, so the run "
                     r"goes on at step \d+", out, re.M), out[-3000:]
    assert re.search(rf"^END .* job={job_id} exit=0$", out, re.M)
    run_dir = tmp_path / "runs" / "shrunk"
    metrics = read_metrics(run_dir)
    assert [m["epoch"] for m in metrics] == [1, 2, 3, 4]
    assert not (run_dir / "checkpoints" / "superseded").exists()
    healthy = subprocess.run([sys.executable, str(LOCAL_SLURM.parent / "mnist_ddp.py"), *args, "--run-dir", "healthy"],
                             cwd=tmp_path, env=clean_env(OMP_NUM_THREADS="1"), capture_output=True, text=True)
    assert healthy.returncode == 0, healthy.stderr[-2000:]
    accuracy, expected = metrics[-1]["test_accuracy"], read_metrics(tmp_path / "healthy")[-1]["test_accuracy"]
    print(f"accuracy {accuracy:.4f}, a run that lost nothing {expected:.4f}")
    assert abs(accuracy - expected) <= 0.003


def test_a_no_kill_job_that_loses_a_node_without_min_nodes_is_requeued_onto_whole_nodes(three_nodes, tmp_path):
    """--no-kill without MIN_NODES: the job that lost a node would wait for it forever (srun
    asks for 2 nodes, the job holds 1): the supervisor requeues it instead, and it reruns
    on 2 nodes that work, resuming."""
    client = three_nodes.sbatch(tmp_path, ["--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", "--mem=1G",
                                           "--no-kill"], ["--ckpt-every", "10", "--epochs", "3"], RUN_NAME="whole")
    wait_for(tmp_path, r"^0: epoch   1 \|")
    with rank_1_node_cut_off(tmp_path, "whole") as (first, node, _):
        job_id, out = finish(client, tmp_path)
    assert re.search(rf"^requeueing Slurm job {job_id} after exit \d+: the job holds 1 of its 2 nodes \({first}\), fewer "
                     r"than MIN_NODES=2 \(unset: every node of the job\); it resumes from its last checkpoint", out, re.M), \
        out[-3000:]
    rerun_nodes = re.findall(r"^START .* restart=1 nodes=(\S+) ", out, re.M)[0]
    assert node not in three_nodes.run("scontrol", "show", "hostnames", rerun_nodes).split()
    assert re.search(r"^0: resumed from .*\(attempt 1/4, requeued 1x\)", out, re.M)
    assert re.search(rf"^END .* job={job_id} exit=0$", out, re.M)
    assert [m["epoch"] for m in read_metrics(tmp_path / "runs" / "whole")] == [1, 2, 3]


def test_a_lost_node_requeues_the_job_onto_the_nodes_left(three_nodes, tmp_path):
    """A 2-node job loses its second node (slurmd, the step's daemon and the rank: every
    process in that node's namespace, SIGKILLed). Slurm declares the node down and
    requeues the job (--requeue), which reruns on the other two nodes and resumes."""
    client = three_nodes.sbatch(tmp_path, ["--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", "--mem=1G"],
                                [*FAST, "--epochs", "6"], RUN_NAME="survivor")
    wait_for(tmp_path, r"^0: epoch   1 \|")
    node = re.search(r"^1: \[rank 1/2\] (\S+) ", output_of(tmp_path), re.M).group(1)
    pids = subprocess.run(["ip", "netns", "pids", node], capture_output=True, text=True, check=True).stdout.split()
    subprocess.run(["kill", "-9", *pids], check=True)
    lost = time.monotonic()
    resumed = wait_for(tmp_path, r"^0: resumed from ", timeout=300)
    job_id, out = finish(client, tmp_path)
    print(f"\nnode lost to training again on the nodes left: {resumed - lost:.1f} s")
    assert re.search(rf"^START .* job={job_id} restart=1 nodes=\S+ ", out, re.M)
    rerun_nodes = re.findall(r"^START .* restart=1 nodes=(\S+) ", out, re.M)[0]
    assert node not in three_nodes.run("scontrol", "show", "hostnames", rerun_nodes).split()
    assert re.search(r"^0: resumed from .*\(attempt 1/4, requeued 1x\)", out, re.M)
    assert [m["epoch"] for m in read_metrics(tmp_path / "runs" / "survivor")] == list(range(1, 7))
