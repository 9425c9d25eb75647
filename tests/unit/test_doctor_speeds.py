"""ddpkit/run/doctor.py's verdict on the speeds that `mnist_ddp.py --check` measures: which rank,
node or pair of nodes is slower than 1.5 times the others, in every round of the timed steps
and by more than a noise floor (each line with the sbatch --exclude that leaves the node out,
never a one-node job's only node), and the rounds in which the nodes' first ranks time
their links, stopped by a time budget; the exit code of ranks that cannot run a step. The check in real runs: tests/runs/test_doctor.py (a slow rank on one host)
and tests/cluster/mostly_waiting/test_check_on_three_nodes.py (a slow node of three).

    python -m pytest tests/unit/test_doctor_speeds.py
"""

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ddpkit.job.contract import EXIT_BUG, EXIT_NODE_FAULT
from ddpkit.run import doctor
from ddpkit.run.doctor import broken_lines, check_code, pair_rounds, slow_lines, slower_than_the_others, speed_figures

FAST = 0.02  # seconds of an exchange on a healthy link


def steady(*seconds: float) -> list[list[float]]:
    """Each rank's step the same in every round of the check."""
    return [[each] * doctor.STEP_ROUNDS for each in seconds]


def same_links(*nodes: str, seconds: float = FAST) -> dict[tuple[str, str], float]:
    return dict.fromkeys(itertools.combinations(nodes, 2), seconds)


def every_round(links: dict[tuple[str, str], float]) -> dict[tuple[str, str], list[float]]:
    """Each pair's exchange the same in every round of the check."""
    return {pair: [seconds] * doctor.PAIR_ROUNDS for pair, seconds in links.items()}


def test_a_slow_node_of_three_is_named_with_the_exclude_that_leaves_it_out():
    lines = slow_lines(steady(0.040, 0.352, 0.041), ["ftn1", "ftn2", "ftn3"], every_round(same_links("ftn1", "ftn2", "ftn3")))
    assert lines == ["check: node ftn2 is slow: a training step takes 352.0 ms there (rank 1), 8.7x the other nodes' "
                     "median of 40.5 ms (a node busy with another job, or throttled?); leave it out: sbatch --exclude=ftn2"]


def test_a_node_is_as_fast_as_its_fastest_rank_and_a_slow_rank_of_a_healthy_node_is_named_alone():
    nodes = ["a", "a", "b", "b", "c", "c"]
    whole = slow_lines(steady(0.04, 0.04, 0.2, 0.21, 0.04, 0.04), nodes, every_round(same_links("a", "b", "c")))
    assert whole == ["check: node b is slow: a training step takes 200.0 ms there (the fastest of ranks 2-3), 5.0x the "
                     "other nodes' median of 40.0 ms (a node busy with another job, or throttled?); leave it out: sbatch "
                     "--exclude=b"]  # (its ranks are not named again)
    one = slow_lines(steady(0.04, 0.04, 0.2, 0.04, 0.04, 0.04), nodes, every_round(same_links("a", "b", "c")))
    assert one == ["check: rank 2 on b is slow: a training step takes 200.0 ms, 5.0x the other ranks' median of 40.0 ms "
                   "(its device, or its CPUs?); leave its node out: sbatch --exclude=b"]


def test_one_node_judges_its_ranks_alone_never_advising_to_leave_it_out_and_one_rank_says_nothing():
    """Against the ranks of its own node alone, a slow rank is not its node's fault: another
    node would not help (the job's only node, compared with itself)."""
    assert slow_lines(steady(0.04, 0.3, 0.04), ["h", "h", "h"], {}) == [
        "check: rank 1 on h is slow: a training step takes 300.0 ms, 7.5x the other ranks' median of 40.0 ms (its "
        "device, or its CPUs?); every rank runs on h, so leaving it out would not help: check that rank's GPU, and that "
        "each rank has CPUs of its own (--cpus-per-task)"]
    assert slow_lines(steady(0.3), ["h"], {}) == []
    assert slow_lines([], ["h", "h"], {}) == []  # (no step timed: nothing to say of it)


@pytest.mark.parametrize(("times", "slow"), [
    ({"a": 0.25, "b": 0.375}, {}),  # exactly 1.5x: not slower than it
    ({"a": 0.25, "b": 0.376}, {"b": 0.25}),  # of two, each is measured by the other
    ({"a": 0.1, "b": 0.1, "c": 0.1}, {}),  # all alike
    ({"a": 0.1, "b": 0.1, "c": 0.04}, {}),  # two of three alike and slow: each pulls the other's measure up
    ({"a": 0.1, "b": 0.1, "c": 0.04, "d": 0.04, "e": 0.04}, {"a": 0.04, "b": 0.04}),  # ... not of five
    ({"a": 1.0}, {}),  # one: no others to measure it by
])
def test_slower_than_the_others_is_15_times_the_median_of_the_others(times, slow):
    assert slower_than_the_others(times) == pytest.approx(slow)


def test_a_rank_or_node_slow_in_one_round_only_is_noise_and_named_only_when_slow_in_every_round():
    """The 2-core case: two ranks on one busy node, rank 0 at 1.5x in one round of three (its
    cores taken by the other rank for a moment), then alike; and a node slow once of three."""
    assert slow_lines([[0.024, 0.015, 0.016], [0.0158, 0.016, 0.015]], ["vm", "vm"], {}) == []
    assert slow_lines([[0.04, 0.04, 0.04], [0.04, 0.3, 0.04], [0.04, 0.04, 0.04]], ["a", "b", "c"], {}) == []
    slow = slow_lines([[0.04, 0.04, 0.04], [0.3, 0.3, 0.2], [0.04, 0.04, 0.04]], ["a", "b", "c"], {})
    assert slow == ["check: node b is slow: a training step takes 300.0 ms there (rank 1), 7.5x the other nodes' median "
                    "of 40.0 ms (a node busy with another job, or throttled?); leave it out: sbatch --exclude=b"]


def test_a_node_whose_links_are_all_slow_is_named_even_of_three_where_the_median_pair_is_slow():
    links = {("a", "b"): 0.3, ("a", "c"): 0.31, ("b", "c"): FAST}
    assert slow_lines(steady(0.04, 0.04, 0.04), ["a", "b", "c"], every_round(links)) == [
        "check: the network of node a is slow: an exchange of 16 MB with b, c takes 0.300-0.310 s, up to 15.5x the "
        "median node's fastest exchange of 0.020 s; leave it out: sbatch --exclude=a"]


def test_one_slow_link_names_the_pair_since_either_end_may_be_at_fault():
    links = {**same_links("a", "b", "c", "d"), ("b", "d"): 0.3}
    assert slow_lines([], ["a", "b", "c", "d"], every_round(links)) == [
        "check: the link between b and d is slow: an exchange of 16 MB takes 0.300 s, 15.0x the median node's fastest "
        "exchange of 0.020 s; leave one of them out: sbatch --exclude=b (or --exclude=d)"]
    two = {**same_links("a", "b", "c", "d"), ("a", "b"): 0.3, ("c", "d"): 0.3}  # no node in both
    assert [line.split(" is slow")[0] for line in slow_lines([], ["a", "b", "c", "d"], every_round(two))] == [
        "check: the link between a and b", "check: the link between c and d"]


def test_two_slow_nodes_of_five_are_each_named_for_their_links():
    links = same_links("a", "b", "c", "d", "e")
    links.update({pair: 0.3 for pair in links if {"b", "d"} & set(pair)})
    lines = slow_lines([], ["a", "b", "c", "d", "e"], every_round(links))
    assert [line.split(":")[1] for line in lines] == [" the network of node b is slow", " the network of node d is slow"]
    assert " with a, c, d, e takes 0.300 s, " in lines[0] and " with a, c, e takes 0.300 s, " in lines[1]
    assert [line.split("; ")[-1] for line in lines] == ["leave it out: sbatch --exclude=b", "leave it out: sbatch --exclude=d"]


def test_two_nodes_have_one_pair_and_nothing_to_measure_it_by():
    assert slow_lines(steady(0.04, 0.04), ["a", "b"], every_round({("a", "b"): 3.0})) == []


def test_a_link_slow_in_one_round_only_is_noise_and_named_only_when_slow_in_every_round():
    """On a loaded cluster a healthy link's exchange of 16 MB came out 10 ms slower, 1.5x an
    exchange of 20 ms, once: noise; slower in every round, it is a slow link."""
    once = {pair: [FAST] * doctor.PAIR_ROUNDS for pair in same_links("a", "b", "c", "d")}
    once[("b", "d")] = [FAST + 0.030] + [FAST] * (doctor.PAIR_ROUNDS - 1)
    assert slow_lines([], ["a", "b", "c", "d"], once) == []
    once[("b", "d")] = [FAST + 0.030] * (doctor.PAIR_ROUNDS - 1) + [FAST + 0.005]
    assert slow_lines([], ["a", "b", "c", "d"], once) == []
    always = every_round({**same_links("a", "b", "c", "d"), ("b", "d"): FAST + 0.030})
    assert slow_lines([], ["a", "b", "c", "d"], always) == [
        "check: the link between b and d is slow: an exchange of 16 MB takes 0.050 s, 2.5x the median node's fastest "
        "exchange of 0.020 s; leave one of them out: sbatch --exclude=b (or --exclude=d)"]


def test_a_link_of_a_fast_network_fallen_back_to_a_slow_one_is_named():
    """InfiniBand or 100 GbE exchange 16 MB in about 1.5 ms; a link fallen back to 10 GbE TCP
    takes 12 ms, 8x, in every round: named. A few ms more, 4x, is under the noise floor."""
    fast = every_round(same_links("a", "b", "c", "d", seconds=0.0015))
    assert slow_lines([], ["a", "b", "c", "d"], {**fast, **every_round({("b", "d"): 0.012})}) == [
        "check: the link between b and d is slow: an exchange of 16 MB takes 0.012 s, 8.0x the median node's fastest "
        "exchange of 0.002 s; leave one of them out: sbatch --exclude=b (or --exclude=d)"]
    assert slow_lines([], ["a", "b", "c", "d"], {**fast, **every_round({("b", "d"): 0.006})}) == []


def test_the_figures_give_the_median_and_the_range():
    assert speed_figures("a step", [0.040, 0.352, 0.041], same_links("a", "b", "c")) == [
        "check: a step takes 41.0 ms on the median rank (40.0-352.0 ms over 3 ranks)",
        "check: an exchange of 16 MB each way between the first ranks of two nodes takes 0.020 s for the median pair "
        "(0.020-0.020 s over 3 pairs)"]


@pytest.mark.parametrize("count", range(1, 10))
def test_the_rounds_pair_every_two_nodes_once_and_no_node_twice_in_a_round(count):
    rounds = pair_rounds(count)
    pairs = [pair for round_pairs in rounds for pair in round_pairs]
    assert sorted(pairs) == list(itertools.combinations(range(count), 2))
    assert all(len({node for pair in round_pairs for node in pair}) == 2 * len(round_pairs) for round_pairs in rounds)
    assert len(rounds) == (0 if count == 1 else count - 1 + count % 2)


def test_a_step_slower_by_less_than_the_noise_floor_names_nothing():
    """2.9x the others but 1.9 ms slower: a GPU step's jitter, not a slow node; 2.5 ms slower is."""
    assert slow_lines(steady(0.0010, 0.0029, 0.0010), ["a", "b", "c"], every_round(same_links("a", "b", "c"))) == []
    assert slower_than_the_others({"a": 0.001, "b": 0.0029}, doctor.STEP_NOISE) == {}
    assert slow_lines(steady(0.0010, 0.0035, 0.0010), ["a", "b", "c"], {})[0].startswith("check: node b is slow")


def test_a_rank_that_cannot_run_a_step_is_a_nodes_fault_only_for_its_gpu():
    """Every broken rank failed on its GPU (ECC, NVLink, a busy device): 5, as in training; any
    other error on one of them: 1; none broken: 0."""
    assert check_code([], []) == 0
    assert check_code([1, 2], [1, 2]) == EXIT_NODE_FAULT
    assert check_code([1, 2], [1]) == EXIT_BUG


def test_only_ranks_whose_nodes_gpu_failed_them_get_the_exclude_of_their_nodes():
    """A fault of the node's GPU: leave the node out; any other error (the recipe's step on
    every rank, say) is no node's: no --exclude, and the line says another node would not
    fix it."""
    nodes = ["a", "a", "b", "b"]
    [faulty, other] = broken_lines([0, 2, 3], [2, 3], nodes)
    assert faulty == ("check failed: ranks 2, 3 (on b) cannot run a training step for a fault of their GPUs (the line "
                      "above from each says why); leave the node out, sbatch --exclude=b, or report it to the site")
    assert other == ("check failed: rank 0 (on a) cannot run a training step (the line above from each says why): an "
                     "error of the recipe's step (its build_model, build_optimizer or train_step) or of the environment, "
                     "which another node would not fix; fix it, and run the check again")
    assert ["--exclude" in line for line in broken_lines([0, 1, 2, 3], [], nodes)] == [False]
    assert broken_lines([], [], nodes) == []


def _pairs_within_a_budget(rank: int, init: str, budget: float, result: dict) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    doctor.PAIR_BYTES, doctor.PAIR_BUDGET = 4096, budget
    exchanges = []
    real = doctor.exchange
    doctor.exchange = lambda peer, data, into: (exchanges.append(peer), real(peer, data, into))
    times = doctor.time_pairs_of_nodes_all_ranks(torch.device("cpu"), ["a", "b"], rank)
    result[rank] = (len(exchanges), {pair: len(rounds) for pair, rounds in times.items()})
    dist.destroy_process_group()


@pytest.mark.parametrize(("budget", "rounds"), [(0.0, 1), (60.0, doctor.PAIR_ROUNDS)])
def test_the_pairs_passes_stop_once_the_budget_is_spent_on_every_rank_alike(tmp_path, budget, rounds):
    """Two real Gloo ranks on two nodes: with the budget spent at once, the untimed pass and one
    timed pass, a round (2 exchanges each: the start, then the data), on both ends; within it,
    all, and each pair's time in every round."""
    result = mp.Manager().dict()
    ctx = mp.get_context("spawn")
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [ctx.Process(target=_pairs_within_a_budget, args=(rank, init, budget, result)) for rank in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert dict(result) == {0: (2 * (1 + rounds), {("a", "b"): rounds}), 1: (2 * (1 + rounds), {("a", "b"): rounds})}
