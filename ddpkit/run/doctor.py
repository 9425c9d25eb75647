"""--check (CHECK=1 for run_training.sbatch): a one-minute doctor for a job's ranks, instead
of training. Every rank joins the rendezvous within min(--dist-timeout, 60 s) and says who
it is; rank 0 names the ranks, and their hosts, that never came, and what to try. Then the
backend connects the ranks, one all-reduce with a known answer checks the sums, and one
timed all-reduce of 64 MB gives the bandwidth. Rank 0 prints each rank's host, device,
CPUs, GPUs, network interface and versions. Then the storage (storage_check.py): LOG_DIR's
and DATA_DIR's file system and lock options on each node, how soon the other nodes see a
file that rank 0 writes there, and whether a lock that rank 0 holds excludes their ranks; a
lock that does not is said in one line, and fails nothing.

Then the speeds: every rank times one training step of the recipe's own model on random
images of the run's shape, on its own device (recipe_step),
and the first ranks of each pair of nodes time an exchange of 16 MB; rank 0 names, one
line each, a rank, a node or a pair of nodes slower than 1.5 times the others (stragglers.py's
factor) and slower by STEP_NOISE (a step) or PAIR_NOISE (an exchange) at least, in every one
of STEP_ROUNDS (PAIR_ROUNDS) rounds, with the `sbatch --exclude=NODE` that leaves the node out
(where the job has other nodes: a rank slow against the ranks of its own node alone is not
its node's to leave out). The pairs' passes stop after PAIR_BUDGET seconds, so that the check
stays within a minute on many nodes.

Exit 0 when all is well, and when something is only slow: the job would train, and a
slowness seen once may be a neighbour's passing load, so the line says what to do and a
script that trains after a passing check is not stopped; 4 (a rank cannot reach another)
when they cannot meet; 5 when a rank cannot run a training step for a fault of its node's GPU
(ECC, NVLink, a busy device: recovery.node_fault, as in training); 1 when a sum comes out
wrong, or a rank cannot run a training step for any other error (the recipe's, or the
environment's, which a restart elsewhere would not fix)."""

import fcntl
import json
import math
import os
import platform
import socket
import statistics
import struct
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ddpkit.distributed import load_what_optimizers_load, pick_device
from ddpkit.job.contract import EXIT_BUG, EXIT_LOST_PEER, EXIT_NODE_FAULT
from ddpkit.launch import Launch, expand_hostlist, process_age, tasks_on_node
from ddpkit.options import RunOptions
from ddpkit.run.recovery import node_fault
from ddpkit.run.storage_check import VISIBLE_WAIT, check_storage_all_ranks
from ddpkit.run.stragglers import SLOW_FACTOR

CHECK_TIMEOUT = 60.0  # seconds the ranks wait for each other, at most (--dist-timeout, if shorter)
LATER = 20.0  # seconds more that the other ranks wait than rank 0
ACK_WAIT = 10.0  # seconds rank 0 waits, after a failed rendezvous, for the others to read its verdict
TIMED_BYTES = 64 * 2**20  # the timed all-reduce: large enough that the network, not latency, sets its time
TIMED_REPEATS = 3
# The timed training step: steps first run untimed, then rounds of steps timed (each round's
# median). A rank or node is slow only when it is slow in every round: a passing load (another
# rank's burst on shared cores, a neighbour's job) slows one round, a slow part slows them all.
STEP_WARMUP, STEP_ROUNDS, STEP_REPEATS = 3, 3, 5
PAIR_BYTES = 16 * 2**20  # sent each way between two nodes: large enough that the link, not latency, sets its time
# Timed passes over every pair of nodes, after one untimed, each a round: as a step, a link is
# slow only when it is slow in every round (a loaded node's scheduling, 10 ms more on a healthy
# link of the test cluster, slows a pass now and then; a slow link slows them all).
PAIR_ROUNDS = 5
PAIR_BUDGET = 15.0  # seconds of the pairs' passes after which no further timed pass starts (one always runs)
STEP_NOISE = 0.002  # seconds: a step slower by less is noise (a GPU step's jitter), however many times the others
# seconds: an exchange slower by less is noise, however many times the others. Small, since a
# fast network's exchange takes 1-2 ms (InfiniBand, 100 GbE), and one fallen back to 10 GbE TCP
# about 13 ms; a veth pair's takes about 18 ms.
PAIR_NOISE = 0.005
PREFIX = "mnist-ddp-check"  # its keys, apart from any others in torchrun's store


def interface_address(name: str) -> str:
    """The IPv4 address of network interface `name`, or "" (no such interface, or none)."""
    siocgifaddr = 0x8915
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            packed = fcntl.ioctl(probe.fileno(), siocgifaddr, struct.pack("256s", name[:15].encode()))
    except OSError:
        return ""
    return socket.inet_ntoa(packed[20:24])


def interface_of(address: str) -> str:
    return next((name for _, name in socket.if_nameindex() if interface_address(name) == address), "")


def network_words(backend: str) -> str:
    """Which interface this rank's backend talks through, as far as it can be known here."""
    if backend == "nccl":
        chosen = os.environ.get("NCCL_SOCKET_IFNAME")
        return f"nccl via NCCL_SOCKET_IFNAME={chosen}" if chosen else "nccl via the interface NCCL picks (NCCL_DEBUG=INFO names it)"
    chosen = os.environ.get("GLOO_SOCKET_IFNAME")
    if chosen:
        return f"gloo via {chosen} {interface_address(chosen) or '(no IPv4 address: not an interface here?)'}"
    host = socket.gethostname()  # Gloo binds the address its host's name resolves to
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return f"gloo via the address of {host}, which does not resolve: set GLOO_SOCKET_IFNAME"
    return f"gloo via {interface_of(address) or '?'} {address} (the address of {host})"


def cpu_list(cpus: list[int]) -> str:
    """0-3,8 for CPUs 0, 1, 2, 3 and 8."""
    runs: list[list[int]] = []
    for cpu in cpus:
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def describe_rank(rank: int, device: torch.device, backend: str) -> dict:
    cpus = sorted(os.sched_getaffinity(0))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    versions = f"torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}, python {platform.python_version()}"
    if device.type == "cuda":
        versions += f", NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}"
    return {
        "rank": rank, "host": socket.gethostname(), "node": os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
        "device": f"{device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else str(device),
        "cpus": f"{len(cpus)} CPU{'s' if len(cpus) > 1 else ''} ({cpu_list(cpus)})",
        "gpus": f"{gpus} GPU{'s' if gpus != 1 else ''}" + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""),
        "network": network_words(backend) if backend != "none" else "one rank: no network", "versions": versions,
    }


def expected_hosts(world_size: int) -> list[str]:
    """The host each rank runs on under srun's default (block) distribution, or "" each."""
    nodelist = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST", "")
    per_node = os.environ.get("SLURM_STEP_TASKS_PER_NODE") or os.environ.get("SLURM_TASKS_PER_NODE", "")
    hosts: list[str] = []
    try:
        for node, host in enumerate(expand_hostlist(nodelist) if nodelist else []):
            hosts += [host] * tasks_on_node(per_node, node)
    except Exception:  # (a host list it cannot read: the ranks go unnamed)
        hosts = []
    return hosts if len(hosts) == world_size else [""] * world_size


def ranks_and_hosts(ranks: list[int], hosts: list[str]) -> str:
    on = sorted({hosts[r] for r in ranks if hosts[r]})
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}" + (f" (on {', '.join(on)})" if on else "")


def network_hints(launch: Launch, backend: str, where: str) -> str:
    address = f"{launch.master_addr}:{launch.master_port}"
    interface = "NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME"
    return (f"check that {where} reach{'es' if ' ' not in where else ''} {address} over TCP (a firewall between the "
            f"nodes?), that MASTER_ADDR={launch.master_addr} is an address of the first node that the others reach, and "
            f"set {interface} to the interface between the nodes (e.g. ib0 or eth0)")


def say(line: str) -> None:
    print(line, flush=True)


def first_line(err: Exception) -> str:
    return (str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__)[:200]


# The piece of work that every rank times: for this rank's device, the words that name it
# and a function that runs it once (recipe_step makes it of the recipe's own parts).
StepMaker = Callable[[torch.device], tuple[str, Callable[[], object]]]


@dataclass(frozen=True)
class StepParts:
    """The recipe's parts that --check builds its timed step of, as the training loop uses them:
    build_model(recipe, shape, classes), build_optimizer(recipe, model) and
    train_step(model, optimizer, lr, x, y); and, for data of the recipe's own (a --dataset
    the kit does not know), image_shape(recipe, options): ((C, H, W), classes)."""
    build_model: Callable
    build_optimizer: Callable
    train_step: Callable
    image_shape: Callable | None = None


def recipe_step(parts: StepParts, recipe: object, images: Callable[[], tuple[tuple[int, int, int], int]]) -> StepMaker:
    """One training step of the recipe's model with its options (`recipe`: the
    model, --lr, the global batch, or --batch-size a rank), on a batch of random images of the
    run's shape and class count (`images()`: ((C, H, W), classes)). The same work on every
    rank, for any world size."""
    def make(device: torch.device) -> tuple[str, Callable[[], object]]:
        shape, classes = images()  # (an error here is said as the step's, once the ranks met)
        batch = recipe.batch_size or recipe.global_batch
        torch.manual_seed(0)
        model = parts.build_model(recipe, shape, classes).to(device)
        optimizer = parts.build_optimizer(recipe, model)
        x = torch.randn(batch, *shape, device=device)
        y = torch.randint(classes, (batch,), device=device)
        named = f"{recipe.model}, " if hasattr(recipe, "model") else ""
        what = f"a training step of the recipe's model ({named}{batch} images of {' x '.join(map(str, shape))})"
        return what, lambda: parts.train_step(model, optimizer, recipe.lr, x, y)
    return make


def check_job(options: RunOptions, launch: Launch, make_step: StepMaker | None = None) -> int:
    """Run the check as this rank; returns the exit code. Without make_step no step is timed."""
    timeout = min(options.dist_timeout, CHECK_TIMEOUT)
    cuda = torch.cuda.is_available()
    device, backend = pick_device(options, launch, cuda, torch.cuda.device_count() if cuda else 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    n, rank, main = launch.world_size, launch.rank, launch.rank == 0
    me = describe_rank(rank, device, backend if n > 1 else "none")
    if n == 1:
        say(f"check: one rank, nothing to meet: {table_line(me)}")
        for line in check_storage_all_ranks(storage_folders(options), [me["node"]], 0):
            say(line)
        say(f"check passed in {process_age():.1f} s")
        return 0
    # 1. The rendezvous: every rank leaves its description in the store that rank 0 holds
    # (torchrun's agent holds it when it shares its own).
    # The other ranks wait longer than rank 0, so that rank 0's verdict, which names every
    # rank missing, comes first (srun and torchrun then end the rest).
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    try:
        store = dist.TCPStore(launch.master_addr, launch.master_port, n, is_master=main and not agent_store,
                              timeout=timedelta(seconds=timeout + (0 if main else LATER)), wait_for_workers=False)
    except Exception as err:  # (DistNetworkError, a RuntimeError: cannot connect, or the port is taken)
        if main and not agent_store:
            say(f"check failed: rank 0 on {me['host']} cannot open the rendezvous port {launch.master_addr}:"
                f"{launch.master_port} ({first_line(err)}); submit with another MASTER_PORT, or check MASTER_ADDR")
            return EXIT_LOST_PEER
        say(f"check failed: rank {rank} on {me['host']} cannot reach the rendezvous at {launch.master_addr}:"
            f"{launch.master_port} within {timeout + (0 if main else LATER):g} s ({first_line(err)}); {network_hints(launch, backend, me['host'])}")
        return EXIT_LOST_PEER
    store = dist.PrefixStore(f"{PREFIX}/{launch.attempt}", store)
    store.set(f"joined/{rank}", json.dumps(me))
    if main:
        code, joined = wait_for_ranks(store, launch, backend, timeout)
        nodes = [joined[r]["node"] for r in range(n)] if not code else []
        store.set("nodes", json.dumps(nodes))  # (each rank's node, for the pairs of nodes below)
        store.set("verdict", str(code))
        if code:  # the ranks that came read it before rank 0, and the store, are gone
            wait_for_keys(store, [f"read/{r}" for r in joined if r], ACK_WAIT)
            return code
    else:
        try:
            store.wait(["verdict"], timedelta(seconds=timeout + LATER))
            code = int(store.get("verdict"))
            nodes = json.loads(store.get("nodes"))
            store.set(f"read/{rank}", "")
        except Exception:
            say(f"check failed: rank {rank} on {me['host']} heard nothing from rank 0 within {timeout + LATER:g} s")
            return EXIT_LOST_PEER
        if code:
            return code  # (rank 0 says why)
    made = make_check_step(make_step, device)
    load_what_optimizers_load()  # (the step may have made none: a model it could not build)
    # 2. The backend connects every pair of ranks.
    started = time.monotonic()
    try:
        dist.init_process_group(backend, store=dist.PrefixStore("group", store), rank=rank, world_size=n,
                                timeout=timedelta(seconds=timeout), device_id=device if device.type == "cuda" else None)
        right = known_answer(device, n)
        seconds = timed_all_reduce(device)
    except Exception as err:
        say(f"check failed: the ranks met, but {backend} could not connect rank {rank} on {me['host']} with the others "
            f"within {timeout:g} s ({first_line(err)}); {network_hints(launch, backend, 'every node')}")
        return EXIT_LOST_PEER
    if main:
        hosts = {joined[r]["host"] for r in range(n)}
        say(f"check: the {backend} group of {n} ranks on {len(hosts)} host{'s' if len(hosts) > 1 else ''} connected in "
            f"{time.monotonic() - started:.1f} s")
        if not right:
            say(f"check failed: an all-reduce of 1 + 2 + ... + {n} did not give {n * (n + 1) // 2} on every rank: the "
                f"backend or a device computes wrong sums; run it again, and report it to the site if it stays")
        else:
            size = TIMED_BYTES / 2**20
            bus = TIMED_BYTES * 2 * (n - 1) / n / seconds
            say(f"check: the all-reduce with a known answer is right; a {size:.0f} MB all-reduce takes {seconds:.3f} s "
                f"({TIMED_BYTES / seconds / 1e9:.2f} GB/s, bus bandwidth {bus / 1e9:.2f} GB/s)")
    if not right:
        return EXIT_BUG
    # 3. The storage: LOG_DIR's and DATA_DIR's file system on each node, what another node
    # sees of a file rank 0 wrote, and whether a lock excludes across nodes (never a failure).
    try:
        storage = check_storage_all_ranks(storage_folders(options), nodes, rank, min(VISIBLE_WAIT, timeout / 2))
    except Exception as err:
        say(f"check failed: rank {rank} on {me['host']} lost contact with the others while the storage was probed "
            f"({first_line(err)}); {network_hints(launch, backend, 'every node')}")
        return EXIT_LOST_PEER
    for line in storage:
        say(line)
    # 4. The speeds: every rank's training step, and the link between each pair of nodes.
    return check_speeds(made, device, nodes, me=me, hints=network_hints(launch, backend, "every node"))


def storage_folders(options: RunOptions) -> dict[str, Path]:
    """The folders whose storage the check looks at, by the names the batch file gives them."""
    return {"LOG_DIR": Path(options.log_dir), "DATA_DIR": Path(options.data_dir)}


def make_check_step(make_step: StepMaker | None, device: torch.device) -> tuple[str, Callable[[], object]] | Exception | None:
    """The recipe's step for this rank's device (its words and the step), the error that making
    it raised, or None without make_step. Made before the process group exists, as its
    optimizer's imports must be (distributed.load_what_optimizers_load): else a check that
    had passed could abort at its exit (SIGABRT, "terminate called without an active
    exception")."""
    if make_step is None:
        return None
    try:
        return make_step(device)
    except Exception as err:  # (said once the group exists, in check_speeds, so that rank 0 names it)
        return err


def check_speeds(made: tuple[str, Callable[[], object]] | Exception | None, device: torch.device, nodes: list[str], *,
                 me: dict, hints: str) -> int:
    """Every rank times the recipe's step and the first ranks of the nodes their links; rank 0
    prints the figures and names what is slow (exit 0 still), or a rank that could not run a
    step (check_code). Returns the exit code."""
    rank = me["rank"]
    what, seconds = "a training step", [math.nan] * STEP_ROUNDS
    if made is not None:
        try:
            if isinstance(made, Exception):
                raise made
            what, step = made
            seconds = time_step(step, device)
        except Exception as err:  # (it goes on to the collectives below, so that rank 0 names it)
            say(f"check: rank {rank} on {me['host']} cannot run a training step on {device}: {first_line(err)}")
            seconds = [-math.inf if node_fault(err) else math.nan] * STEP_ROUNDS  # (-inf: a fault of its node's GPU)
    try:
        step_seconds = gather_step_times_all_ranks(seconds, device) if made is not None else []
        link_times = time_pairs_of_nodes_all_ranks(device, nodes, rank)
    except Exception as err:
        say(f"check failed: rank {rank} on {me['host']} lost contact with the others while the speeds were timed "
            f"({first_line(err)}); {hints}")
        return EXIT_LOST_PEER
    broken = [r for r, rounds in enumerate(step_seconds) if not all(map(math.isfinite, rounds))]
    faulty = [r for r in broken if -math.inf in step_seconds[r]]
    if rank == 0:
        for line in speed_figures(what, [statistics.median(rounds) for rounds in step_seconds],
                                  {pair: statistics.median(rounds) for pair, rounds in link_times.items()}):
            say(line)
        for line in broken_lines(broken, faulty, nodes):
            say(line)
        if not broken:
            slow = slow_lines(step_seconds, nodes, link_times)
            for line in slow:
                say(line)
            say(f"check passed in {process_age():.1f} s: every rank joined, connected and reduced correctly; training "
                "with the same settings will meet" + ("; every step will wait for the slow ones above" if slow else ""))
    return check_code(broken, faulty)


def broken_lines(broken: list[int], faulty: list[int], nodes: list[str]) -> list[str]:
    """Rank 0's lines for the ranks that could not run a step: the nodes to leave out only for
    those whose node's GPU failed them (`faulty`); any other error is the recipe's or the
    environment's, which fails alike on every node, so no node is blamed for it."""
    lines = []
    others = [r for r in broken if r not in faulty]
    if faulty:
        gpus = "its GPU" if len(faulty) == 1 else "their GPUs"
        lines.append(f"check failed: {ranks_and_hosts(faulty, nodes)} cannot run a training step for a fault of {gpus} "
                     "(the line above from each says why); leave the node out, sbatch --exclude="
                     f"{','.join(dict.fromkeys(nodes[r] for r in faulty))}, or report it to the site")
    if others:
        lines.append(f"check failed: {ranks_and_hosts(others, nodes)} cannot run a training step "
                     "(the line above from each says why): an error of the recipe's step (its build_model, "
                     "build_optimizer or train_step) or of the environment, which another node would not fix; fix it, and run the "
                     "check again")
    return lines


def check_code(broken: list[int], faulty: list[int]) -> int:
    """The check's exit code from the ranks that could not run a step (`broken`) and those of
    them that failed on a fault of their node's GPU (`faulty`): 5 when every one did (the node's
    fault, as in training), 1 when any other error stopped one (the recipe's or the
    environment's), 0 when none."""
    if not broken:
        return 0
    return EXIT_NODE_FAULT if set(broken) == set(faulty) else EXIT_BUG


def table_line(info: dict) -> str:
    return "  ".join(str(info[k]) for k in ("host", "device", "cpus", "gpus", "network", "versions"))


def wait_for_keys(store, keys: list[str], timeout: float) -> list[str]:
    """Wait until the store holds every key, or the time is up; returns the keys still missing."""
    deadline = time.monotonic() + timeout
    missing = list(keys)
    while missing and time.monotonic() < deadline:
        missing = [key for key in missing if not store.check([key])]
        if missing:
            time.sleep(0.1)
    return missing


def wait_for_ranks(store, launch: Launch, backend: str, timeout: float) -> tuple[int, dict[int, dict]]:
    """Rank 0: wait until every rank has joined, or the time is up; print who came (and who
    did not). Returns the exit code and the description of each rank that joined."""
    n = launch.world_size
    missing = [int(key.split("/")[1]) for key in wait_for_keys(store, [f"joined/{r}" for r in range(n)], timeout)]
    hosts = expected_hosts(n)
    joined = {}
    for r in range(n):
        if r not in missing:
            joined[r] = json.loads(store.get(f"joined/{r}"))
            hosts[r] = joined[r]["host"]
            say(f"check: rank {r}  {table_line(joined[r])}")
    if not missing:
        say(f"check: all {n} ranks joined the rendezvous at {launch.master_addr}:{launch.master_port} in "
            f"{process_age():.1f} s")
        return 0, joined
    away = sorted({hosts[r] for r in missing if hosts[r]}) or ["their nodes"]
    say(f"check failed after {process_age():.0f} s: {ranks_and_hosts(missing, hosts)} never joined the rendezvous at "
        f"{launch.master_addr}:{launch.master_port} within {timeout:g} s; {network_hints(launch, backend, ', '.join(away))}")
    return EXIT_LOST_PEER, joined


def known_answer(device: torch.device, n: int) -> bool:
    """One all-reduce whose sum every rank knows: 1 + 2 + ... + n, the same on every rank."""
    value = torch.tensor([float(dist.get_rank() + 1)], device=device)
    dist.all_reduce(value)
    wrong = torch.tensor([0.0 if value.item() == n * (n + 1) / 2 else 1.0], device=device)
    dist.all_reduce(wrong)
    return wrong.item() == 0


def timed_all_reduce(device: torch.device) -> float:
    """The median time of an all-reduce of TIMED_BYTES, over a few after one warm-up, as the
    slowest rank saw it."""
    data = torch.ones(TIMED_BYTES // 4, device=device)
    dist.all_reduce(data)  # warm-up: connections, buffers
    times = []
    for _ in range(TIMED_REPEATS):
        dist.barrier()
        started = time.perf_counter()
        dist.all_reduce(data)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    slowest = torch.tensor([sorted(times)[len(times) // 2]], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.item()


# ----------------------------------------------------------------------------- the speeds

def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_step(step: Callable[[], object], device: torch.device) -> list[float]:
    """The median seconds of `step` in each of STEP_ROUNDS rounds of STEP_REPEATS runs, after
    STEP_WARMUP untimed ones (the first ones allocate memory and choose their kernels)."""
    for _ in range(STEP_WARMUP):
        step()
    rounds = []
    for _ in range(STEP_ROUNDS):
        times = []
        for _ in range(STEP_REPEATS):
            synchronize(device)
            started = time.perf_counter()
            step()
            synchronize(device)
            times.append(time.perf_counter() - started)
        rounds.append(statistics.median(times))
    return rounds


def gather_step_times_all_ranks(seconds: list[float], device: torch.device) -> list[list[float]]:
    """Every rank's seconds a step in each round (NaN: it could not run one; -inf: for a fault
    of its node's GPU), on every rank."""
    mine = torch.tensor(seconds, dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [t.tolist() for t in every]


def pair_rounds(count: int) -> list[list[tuple[int, int]]]:
    """Every pair of `count` nodes once, in rounds in which each node meets one other at most
    (the circle method of a round-robin tournament): count - 1 rounds, or count if it is odd."""
    seats = list(range(count)) + [-1] * (count % 2)  # (-1: the node facing it rests that round)
    rounds = []
    for _ in range(len(seats) - 1):
        half = len(seats) // 2
        rounds.append([(min(a, b), max(a, b)) for a, b in zip(seats[:half], reversed(seats[half:]), strict=True) if min(a, b) >= 0])
        seats = [seats[0], seats[-1], *seats[1:-1]]
    return [pairs for pairs in rounds if pairs]


def exchange(peer: int, data: torch.Tensor, into: torch.Tensor) -> None:
    """Send `data` to rank `peer` while receiving as much from it into `into` (what an
    all-reduce of two ranks moves)."""
    for request in dist.batch_isend_irecv([dist.P2POp(dist.isend, data, peer), dist.P2POp(dist.irecv, into, peer)]):
        request.wait()
    synchronize(data.device)


def time_pairs_of_nodes_all_ranks(device: torch.device, nodes: list[str], rank: int) -> dict[tuple[str, str], list[float]]:
    """{(node, node): [seconds a round]} of an exchange of PAIR_BYTES each way between the first
    ranks of each pair of nodes, on every rank. The first ranks go through pair_rounds' order
    (a round's pairs share no node and run at once; no rank is in two exchanges at a time) 1 +
    PAIR_ROUNDS times, the first untimed (NCCL builds each pair's communicator), each timed
    pass a round: a busy moment on either node slows one, whereas a slow link (a NIC at a
    lower rate, a bad cable, a congested route) is slow every time, and the passes spread
    each pair's exchanges over the whole schedule. A small exchange before each timed one
    starts both ends together. After each timed pass every rank learns whether the slowest
    first rank has spent PAIR_BUDGET seconds on them (on many nodes, a pass is long), and then
    no pass follows: the ranks agree, so that no first rank waits for a peer that stopped, and
    every pair has as many rounds."""
    names = list(dict.fromkeys(nodes))  # (in the order of their first ranks)
    first = {node: nodes.index(node) for node in names}
    pairs = [pair for round_pairs in pair_rounds(len(names)) for pair in round_pairs]
    if not pairs:  # (one node)
        return {}
    began = time.monotonic()
    peers: dict[int, int] = {}
    if first[nodes[rank]] == rank:
        me = names.index(nodes[rank])
        peers = {i: first[names[b if me == a else a]] for i, (a, b) in enumerate(pairs) if me in (a, b)}
        data, ready = torch.ones(PAIR_BYTES // 4, device=device), torch.ones(1, device=device)
        into, ready_into = torch.empty_like(data), torch.empty_like(ready)
    rounds: dict[int, list[float]] = {i: [] for i in peers}
    done = 0
    for timed in [False] + [True] * PAIR_ROUNDS:
        for i, peer in peers.items():
            exchange(peer, ready, ready_into)
            started = time.perf_counter()
            exchange(peer, data, into)
            if timed:
                rounds[i].append(time.perf_counter() - started)
        if timed:
            done += 1
            if over_budget_all_ranks(began, PAIR_BUDGET, device):
                break
    times = torch.zeros(len(pairs), done, dtype=torch.float64, device=device)
    for i, seconds in rounds.items():
        times[i] = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # (both ends timed it: the slower counts)
    return {(names[a], names[b]): seconds for (a, b), seconds in zip(pairs, times.tolist(), strict=True)}


def over_budget_all_ranks(began: float, budget: float, device: torch.device) -> bool:
    """Whether any rank has spent `budget` seconds since `began` (monotonic), on every rank
    alike: a collective, which every rank must call at the same point."""
    spent = torch.tensor([time.monotonic() - began], dtype=torch.float64, device=device)
    dist.all_reduce(spent, op=dist.ReduceOp.MAX)
    return spent.item() >= budget


def speed_figures(what: str, step_seconds: list[float], pair_seconds: dict[tuple[str, str], float]) -> list[str]:
    """Rank 0's lines of the median and the range of the step's time and of the pairs' exchange."""
    lines = []
    ms = [1000 * seconds for seconds in step_seconds if math.isfinite(seconds)]
    if ms:
        lines.append(f"check: {what} takes {statistics.median(ms):.1f} ms on the median rank ({min(ms):.1f}-"
                     f"{max(ms):.1f} ms over {len(ms)} rank{'s' if len(ms) > 1 else ''})")
    if pair_seconds:
        times = list(pair_seconds.values())
        lines.append(f"check: an exchange of {PAIR_BYTES // 2**20} MB each way between the first ranks of two nodes "
                     f"takes {statistics.median(times):.3f} s for the median pair ({min(times):.3f}-{max(times):.3f} s "
                     f"over {len(times)} pair{'s' if len(times) > 1 else ''})")
    return lines


def slower_than_the_others(times: dict, noise: float = 0.0) -> dict:
    """{key: the median of the other keys' times} for each key whose time is more than
    SLOW_FACTOR times that median, and more than `noise` seconds above it, as stragglers.py
    judges a rank: a slow one cannot pull its own measure up, and of two, each is measured by
    the other. None of fewer than two keys."""
    ordered = sorted(times.values())
    slow = {}
    for key, seconds in times.items():
        others = list(ordered)
        others.remove(seconds)
        if others and seconds > SLOW_FACTOR * statistics.median(others) and seconds - statistics.median(others) > noise:
            slow[key] = statistics.median(others)
    return slow


def slower_in_every_round(rounds: dict, noise: float) -> dict:
    """{key: (the median of its rounds, the median of the other keys' medians)} for each key
    that slower_than_the_others names in every round of `rounds` ({key: [seconds a round]}):
    a difference that repeats, not one sample."""
    count = len(next(iter(rounds.values()), []))
    verdicts = [slower_than_the_others({key: times[k] for key, times in rounds.items()}, noise) for k in range(count)]
    return {key: (statistics.median(rounds[key]), statistics.median(verdict[key] for verdict in verdicts))
            for key in rounds if verdicts and all(key in verdict for verdict in verdicts)}


def slow_links_in_every_round(link_times: dict[tuple[str, str], list[float]]) -> tuple[list[tuple[str, str]], float]:
    """(the pairs of nodes slow in every round, the median of the rounds' measures): in each
    round a pair is slow above SLOW_FACTOR times the median node's fastest exchange of that
    round, and PAIR_NOISE above it."""
    measures, slow = [], set(link_times)
    for k in range(len(next(iter(link_times.values())))):
        fastest = {}
        for pair, rounds in link_times.items():
            for node in pair:
                fastest[node] = min(fastest.get(node, math.inf), rounds[k])
        typical = statistics.median(fastest.values())
        measures.append(typical)
        slow &= {pair for pair, rounds in link_times.items()
                 if rounds[k] > SLOW_FACTOR * typical and rounds[k] - typical > PAIR_NOISE}
    if not measures:  # (no round timed: nothing is slow)
        return [], math.nan
    return [pair for pair in link_times if pair in slow], statistics.median(measures)


def slow_lines(step_seconds: list[list[float]], nodes: list[str], link_times: dict[tuple[str, str], list[float]]) -> list[str]:
    """Rank 0's verdict on the speeds, one line for each node, rank or pair of nodes that is
    slow, with the sbatch option that leaves the node out; none when nothing is.

    step_seconds: each rank's median step in each round ([] if none was timed); nodes: each
    rank's node; link_times: {(node, node): [seconds]} of each pair's exchange in each round
    (its median is its time in the lines). A node's step is
    its fastest rank's, so that a node is slow when all its ranks are; a rank is named apart
    only on a node that is not (its device, its CPUs), and its node is left out only where the
    job has others to run on (compared with the ranks of its own node alone, the rank's node is
    not the slow part). Each is slow only in every round. A pair of nodes is slow
    against the median node's fastest exchange, not the median pair: on three nodes, one with
    a slow link slows two of the three pairs. A node in two slow pairs or more is named for
    them all (the one that most share first), and a slow pair that shares no node with
    another is named as a pair, since either end may be at fault."""
    lines = []
    named = set()
    if step_seconds:
        ranks_of = {node: [r for r in range(len(nodes)) if nodes[r] == node] for node in dict.fromkeys(nodes)}
        node_rounds = {node: [min(times) for times in zip(*(step_seconds[r] for r in ranks), strict=True)]
                       for node, ranks in ranks_of.items()}
        for node, (seconds, others) in slower_in_every_round(node_rounds, STEP_NOISE).items():
            named.add(node)
            ranks = ranks_of[node]
            lines.append(f"check: node {node} is slow: a training step takes {1000 * seconds:.1f} ms there "
                         f"({f'the fastest of ranks {cpu_list(ranks)}' if len(ranks) > 1 else f'rank {ranks[0]}'}), "
                         f"{seconds / others:.1f}x the "
                         f"other nodes' median of {1000 * others:.1f} ms (a node busy with another job, or throttled?); "
                         f"leave it out: sbatch --exclude={node}")
        for r, (seconds, others) in slower_in_every_round(dict(enumerate(step_seconds)), STEP_NOISE).items():
            if nodes[r] not in named:
                advice = (f"leave its node out: sbatch --exclude={nodes[r]}" if len(ranks_of) > 1 else
                          f"every rank runs on {nodes[r]}, so leaving it out would not help: check that rank's GPU, and "
                          "that each rank has CPUs of its own (--cpus-per-task)")
                lines.append(f"check: rank {r} on {nodes[r]} is slow: a training step takes {1000 * seconds:.1f} ms, "
                             f"{seconds / others:.1f}x the other ranks' median of {1000 * others:.1f} ms (its device, or "
                             f"its CPUs?); {advice}")
    if link_times:
        slow, typical = slow_links_in_every_round(link_times)
        pair_seconds = {pair: statistics.median(rounds) for pair, rounds in link_times.items()}
        order = {node: i for i, node in enumerate(dict.fromkeys(nodes))}
        slow = sorted(slow, key=lambda pair: sorted(order.get(node, len(order)) for node in pair))
        exchange = f"an exchange of {PAIR_BYTES // 2**20} MB"
        measure = f"the median node's fastest exchange of {typical:.3f} s"
        while slow:
            node, count = Counter(end for pair in slow for end in pair).most_common(1)[0]
            if count < 2:
                break
            mine = [pair for pair in slow if node in pair]
            slow = [pair for pair in slow if node not in pair]
            partners = [b if a == node else a for a, b in mine]
            times = [pair_seconds[pair] for pair in mine]
            took = f"{min(times):.3f}" + (f"-{max(times):.3f}" if f"{max(times):.3f}" != f"{min(times):.3f}" else "")
            lines.append(f"check: the network of node {node} is slow: {exchange} with {', '.join(partners)} takes "
                         f"{took} s, up to {max(times) / typical:.1f}x {measure}; leave it out: sbatch --exclude={node}")
        for a, b in slow:
            lines.append(f"check: the link between {a} and {b} is slow: {exchange} takes {pair_seconds[(a, b)]:.3f} s, "
                         f"{pair_seconds[(a, b)] / typical:.1f}x {measure}; leave one of them out: sbatch --exclude={a} "
                         f"(or --exclude={b})")
    return lines
