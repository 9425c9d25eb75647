"""--check (CHECK=1 for run_training.sbatch): a one-minute doctor for a job's ranks, instead
of training. Every rank joins the rendezvous within min(--dist-timeout, 60 s) and says who
it is; rank 0 names the ranks, and their hosts, that never came, and what to try. Then the
backend connects the ranks, one all-reduce with a known answer checks the sums, and one
timed all-reduce of 64 MB gives the bandwidth. Rank 0 prints each rank's host, device,
CPUs, GPUs, network interface and versions.

Exit 0 when all is well; 4 (a rank cannot reach another) when they cannot meet; 1 when a
sum comes out wrong."""

import fcntl
import json
import os
import platform
import socket
import struct
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ddpkit.contract import EXIT_BUG, EXIT_LOST_PEER
from ddpkit.distributed import pick_device
from ddpkit.launch import Launch, expand_hostlist, process_age, tasks_on_node
from ddpkit.options import RunOptions

CHECK_TIMEOUT = 60.0  # seconds the ranks wait for each other, at most (--dist-timeout, if shorter)
LATER = 20.0  # seconds more that the other ranks wait than rank 0
ACK_WAIT = 10.0  # seconds rank 0 waits, after a failed rendezvous, for the others to read its verdict
TIMED_BYTES = 64 * 2**20  # the timed all-reduce: large enough that the network, not latency, sets its time
TIMED_REPEATS = 3
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
        "rank": rank, "host": socket.gethostname(),
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


def check_job(options: RunOptions, launch: Launch) -> int:
    """Run the check as this rank; returns the exit code."""
    timeout = min(options.dist_timeout, CHECK_TIMEOUT)
    cuda = torch.cuda.is_available()
    device, backend = pick_device(options, launch, cuda, torch.cuda.device_count() if cuda else 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    n, rank, main = launch.world_size, launch.rank, launch.rank == 0
    me = describe_rank(rank, device, backend if n > 1 else "none")
    if n == 1:
        say(f"check: one rank, nothing to meet: {table_line(me)}")
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
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if main and not agent_store:
            say(f"check failed: rank 0 on {me['host']} cannot open the rendezvous port {launch.master_addr}:"
                f"{launch.master_port} ({first[:200]}); submit with another MASTER_PORT, or check MASTER_ADDR")
            return EXIT_LOST_PEER
        say(f"check failed: rank {rank} on {me['host']} cannot reach the rendezvous at {launch.master_addr}:"
            f"{launch.master_port} within {timeout + (0 if main else LATER):g} s ({first[:200]}); {network_hints(launch, backend, me['host'])}")
        return EXIT_LOST_PEER
    store = dist.PrefixStore(f"{PREFIX}/{launch.attempt}", store)
    store.set(f"joined/{rank}", json.dumps(me))
    if main:
        code, joined = wait_for_ranks(store, launch, backend, timeout)
        store.set("verdict", str(code))
        if code:  # the ranks that came read it before rank 0, and the store, are gone
            wait_for_keys(store, [f"read/{r}" for r in joined if r], ACK_WAIT)
            return code
    else:
        try:
            store.wait(["verdict"], timedelta(seconds=timeout + LATER))
            code = int(store.get("verdict"))
            store.set(f"read/{rank}", "")
        except Exception:
            say(f"check failed: rank {rank} on {me['host']} heard nothing from rank 0 within {timeout + LATER:g} s")
            return EXIT_LOST_PEER
        if code:
            return code  # (rank 0 says why)
    # 2. The backend connects every pair of ranks.
    started = time.monotonic()
    try:
        dist.init_process_group(backend, store=dist.PrefixStore("group", store), rank=rank, world_size=n,
                                timeout=timedelta(seconds=timeout), device_id=device if device.type == "cuda" else None)
        right = known_answer(device, n)
        seconds = timed_all_reduce(device)
    except Exception as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        say(f"check failed: the ranks met, but {backend} could not connect rank {rank} on {me['host']} with the others "
            f"within {timeout:g} s ({first[:200]}); {network_hints(launch, backend, 'every node')}")
        return EXIT_LOST_PEER
    if main:
        joined = time.monotonic() - started
        hosts = {json.loads(store.get(f"joined/{r}"))["host"] for r in range(n)}
        say(f"check: the {backend} group of {n} ranks on {len(hosts)} host{'s' if len(hosts) > 1 else ''} connected in "
            f"{joined:.1f} s")
        if not right:
            say(f"check failed: an all-reduce of 1 + 2 + ... + {n} did not give {n * (n + 1) // 2} on every rank: the "
                f"backend or a device computes wrong sums; run it again, and report it to the site if it stays")
            return EXIT_BUG
        size = TIMED_BYTES / 2**20
        bus = TIMED_BYTES * 2 * (n - 1) / n / seconds
        say(f"check: the all-reduce with a known answer is right; a {size:.0f} MB all-reduce takes {seconds:.3f} s "
            f"({TIMED_BYTES / seconds / 1e9:.2f} GB/s, bus bandwidth {bus / 1e9:.2f} GB/s)")
        say(f"check passed in {process_age():.1f} s: every rank joined, connected and reduced correctly; training with "
            "the same settings will meet")
    return 0 if right else EXIT_BUG


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


def wait_for_ranks(store, launch: Launch, backend: str, timeout: float) -> tuple[int, list[int]]:
    """Rank 0: wait until every rank has joined, or the time is up; print who came (and who
    did not). Returns the exit code and the ranks that joined."""
    n = launch.world_size
    missing = [int(key.split("/")[1]) for key in wait_for_keys(store, [f"joined/{r}" for r in range(n)], timeout)]
    hosts = expected_hosts(n)
    for r in range(n):
        if r not in missing:
            info = json.loads(store.get(f"joined/{r}"))
            hosts[r] = info["host"]
            say(f"check: rank {r}  {table_line(info)}")
    if not missing:
        say(f"check: all {n} ranks joined the rendezvous at {launch.master_addr}:{launch.master_port} in "
            f"{process_age():.1f} s")
        return 0, list(range(n))
    away = sorted({hosts[r] for r in missing if hosts[r]}) or ["their nodes"]
    say(f"check failed after {process_age():.0f} s: {ranks_and_hosts(missing, hosts)} never joined the rendezvous at "
        f"{launch.master_addr}:{launch.master_port} within {timeout:g} s; {network_hints(launch, backend, ', '.join(away))}")
    return EXIT_LOST_PEER, [r for r in range(n) if r not in missing]


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
