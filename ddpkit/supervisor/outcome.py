"""What a step's end means (settle): the job's exit code, whether a restart may fix it, why;
and after a lost node, how many of the nodes left the step goes on with. Python 3.6,
standard library only."""

from typing import List, Mapping, Tuple

from ddpkit.job.contract import EXIT_LOST_PEER, EXIT_NODE_FAULT, EXIT_STOPPED, NOT_RETRIED, JobPaths


class Outcome:
    """What one step's end means: the job's exit code, whether a restart can fix it, why; and
    the ranks it found killed by a signal, which the supervisor pins the failure on."""

    def __init__(self, status: int, retry: bool = False, why: str = "", note: str = "", killed: Tuple[int, ...] = ()):
        self.status, self.retry, self.why, self.note, self.killed = status, retry, why, note, killed

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Outcome) and vars(self) == vars(other)

    def __repr__(self) -> str:
        return f"Outcome({self.status}, retry={self.retry}, why={self.why!r}, note={self.note!r}, killed={self.killed})"


def settle(srun_status: int, codes: Mapping[int, int], ntasks: int) -> Outcome:
    """The step's outcome from srun's status and the codes the ranks recorded (read_codes:
    missing for a rank that recorded none). srun reports only its worst task (128+N for a
    task killed by signal N, or ended by srun after another failed), and ranks that lost a
    peer record 4 even when the peer died of a bug: so a code no restart fixes (NOT_RETRIED
    but a stop: 1, 2, 3), on any rank, decides first; then a stop (75); then ranks that
    recorded nothing though srun saw a signal (killed); then 4. A rank whose node failed it (5:
    a fault of its GPU: ECC, NVLink, a busy device) is restarted, as a killed one. A rank records 0 once all it
    wrote is on disk: when every rank did, the job succeeded, whatever befell a rank in the
    process group's teardown after that."""
    killed, lost, faulty, stopped, finished = [], [], [], False, 0
    for rank in range(ntasks):
        code = codes.get(rank)
        if code == 0:
            finished += 1
        elif code == EXIT_STOPPED:
            stopped = True
        elif code in NOT_RETRIED:
            return Outcome(code, why=f"rank {rank} exited with {code}")
        elif code == EXIT_LOST_PEER:
            lost.append(str(rank))
        elif code == EXIT_NODE_FAULT:
            faulty.append(str(rank))
        else:
            killed.append(str(rank))
    if stopped:
        return Outcome(EXIT_STOPPED)
    if srun_status != 0 and finished == ntasks:
        return Outcome(0, note=f"every rank had finished and saved (each recorded exit 0) before srun's exit "
                               f"{srun_status} (a rank that died as it shut down, see above): the job succeeded")
    if faulty:
        return Outcome(EXIT_NODE_FAULT, True, f"rank {' '.join(faulty)} failed on a fault of its node (a CUDA or NCCL "
                                              "error, above)")
    if srun_status > 128 and killed:
        return Outcome(srun_status, True, f"rank {' '.join(killed)} ended without an exit code: killed by a signal "
                                          "(srun's lines above say which)", killed=tuple(int(rank) for rank in killed))
    if lost:
        return Outcome(EXIT_LOST_PEER, True, f"rank {' '.join(lost)} lost contact with a peer that died or hung")
    return Outcome(srun_status)


def read_world_sizes(directory: str, ntasks: int) -> List[int]:
    """The world sizes rank 0 left in the job's folder (JobPaths.WORLD_SIZES); without them, the divisors of the
    world size (a global batch split among ntasks ranks splits among those too)."""
    try:
        with open(JobPaths.of_folder(directory).world_sizes) as file:
            return [int(word) for word in file.read().split()]
    except (OSError, ValueError):
        return [n for n in range(1, ntasks + 1) if ntasks % n == 0]


def nodes_to_go_on_with(held: int, min_nodes: int, tasks_per_node: int, world_sizes: List[int]) -> int:
    """The most of the `held` nodes, and at least min_nodes, whose ranks are a world size the
    run's batch splits among; 0 when there are none."""
    return next((n for n in range(held, min_nodes - 1, -1) if n * tasks_per_node in world_sizes), 0)
