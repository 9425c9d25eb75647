"""CHECK=1 on three nodes in network namespaces (local-slurm.sh; ftn1, ftn2, ftn3), one of
them slowed from outside: with the aid AID_SLOW_HOST=ftn2:0.5 each of the doctor's timed
training steps sleeps 0.5 s more on ftn2. The check names ftn2 in one line with the `sbatch
--exclude=ftn2` that leaves it out, and no other node or rank, times the links between the
three pairs of nodes (none of them slowed: no line blames ftn2's network for its slow
steps), and still passes (exit 0: slow, not broken). The links are veth pairs on one
machine of 2 cores, which other tests' jobs may load at the same moment (one run here timed
ftn1-ftn2 at 1.6x the median), so whether any one link passes for slow is left to the unit
tests of the rule: tests/unit/test_doctor_speeds.py. In the same job, fcntl's locks lock
nothing on ftn2 (the aid AID_LOCKS_EXCLUDE_NOTHING=ftn2, as a mount with nolock or local_lock
between nodes): for LOG_DIR and DATA_DIR the check names each node's file system, sees rank
0's file on ftn2 and ftn3, finds that rank 0's lock excludes ftn3's rank but not ftn2's, and
says so in one line a folder, with the lease that covers it (exit 0 still). The lines and
times it prints are docs/clusters.md's.

    python -m pytest tests/cluster/mostly_waiting/test_check_on_three_nodes.py
"""

import re
import time

from helpers.cluster import finish


def test_check_names_the_slow_node_of_three_and_the_exclude_that_leaves_it_out(three_nodes, tmp_path):
    options = ["--nodes=3", "--ntasks-per-node=1", "--cpus-per-task=1", "--mem=1G"]
    submitted = time.monotonic()
    job_id, out = finish(three_nodes.sbatch(tmp_path, options, [], CHECK="1", AID_SLOW_HOST="ftn2:0.5",
                                            AID_LOCKS_EXCLUDE_NOTHING="ftn2"), tmp_path)
    print(f"\n{chr(10).join(re.findall(r'^(?:0: check.*|START .*|END .*)$', out, re.M))}\n"
          f"from sbatch to END: {time.monotonic() - submitted:.1f} s")
    slow = re.findall(r"^0: check: (?:node|rank) .* is slow: .*$", out, re.M)
    assert slow, out[-3000:]
    assert re.fullmatch(r"0: check: node ftn2 is slow: a training step takes \d+\.\d ms there \(rank \d\), \d+\.\dx the "
                        r"other nodes' median of \d+\.\d ms \(a node busy with another job, or throttled\?\); leave it "
                        r"out: sbatch --exclude=ftn2", slow[0]), out[-3000:]
    assert len(slow) == 1, slow  # (ftn1 and ftn3 alike; ftn2's ranks not named again)
    assert not re.search(r"^0: check: the network of node ftn2 ", out, re.M), out[-3000:]
    assert re.search(r"^0: check: a training step of the recipe's model \(cnn, 128 images of 1 x 28 x 28\) takes [\d.]+ ms "
                     r"on the median rank \([\d.]+-[\d.]+ ms over 3 ranks\)$", out, re.M), out[-3000:]
    assert re.search(r"^0: check: an exchange of 16 MB each way between the first ranks of two nodes takes [\d.]+ s for "
                     r"the median pair \([\d.]+-[\d.]+ s over 3 pairs\)$", out, re.M), out[-3000:]
    assert re.search(r"^0: check passed in [\d.]+ s: every rank joined, .*; every step will wait for the slow ones "
                     r"above$", out, re.M), out[-3000:]
    assert re.search(rf"^END .* job={job_id} exit=0 \(CHECK=1: nothing was trained\)$", out, re.M)
    for label in ("LOG_DIR", "DATA_DIR"):
        storage = re.findall(rf"^0: check: (?:locks on )?{label} .*$", out, re.M)
        fs = r"\S+ \S+ on /\S*(?: \([^)]*\))?"  # (the host's file system: the nodes share it)
        where = rf"{label} /\S+(?: \(not there yet: probed in its parent\))?"
        expected = [
            rf"0: check: {where} on ftn1: {fs}; rank 0 wrote a file here and holds a lock on it",
            rf"0: check: {label} on ftn2: {fs}; the file written on ftn1 was seen after \d+\.\d\d s; a lock held on ftn1 "
            r"does not exclude a rank here",
            rf"0: check: {label} on ftn3: {fs}; the file written on ftn1 was seen after \d+\.\d\d s; a lock held on ftn1 "
            r"excludes a rank here",
            rf"0: check: locks on {label} \([^)]+\) do not exclude across nodes \(ftn2 took one that ftn1 held\): the "
            r"run's claim and the data lock use a lease \(a folder renamed into place\), which does"]
        assert len(storage) == len(expected), storage or out[-3000:]
        assert all(re.fullmatch(line, text) for line, text in zip(expected, storage, strict=True)), storage
