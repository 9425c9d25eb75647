"""Which node a failure is pinned on, and the nodes a job leaves out. Python 3.6, standard
library only.

After a step that a restart may fix (settle's retry), the supervisor pins the failure on the
node that the ranks' files name (failure_pins): the node of a rank that a hang report named
as the one the others wait for (JobPaths.HUNG), of a rank killed by a signal (settle's
killed ranks, by the nodes rank 0 listed: JobPaths.NODES), of a rank whose node failed it (a
fault of its GPU, ECC, NVLink or a busy device: JobPaths.NODE_FAULT); and a node the job lost (the supervisor
sees the job's NodeList shrink). A lost peer (4) pins nothing by itself: every node that
lost the peer records it. Nor does a bug, a usage problem or a divergence (1, 2, 3): the run
fails so on any node. When one kind of failure names every node of the step, nothing tells
the nodes apart, and it pins none (so a job on one node never leaves its node out).

The job keeps its pins, across its restarts and requeues, in a file beside its folder
(JobPaths.node_failures: the folder is cleared at each start), each with the ranks it
followed; a node pinned LEAVE_OUT_AFTER times is left out from then on. But a rank pinned on
two different nodes carries its failure with it (rank 0 that deadlocks, or that runs out of
memory, wherever it runs): the run's own failure, for which no node is left out.

A node left out leaves the job's next steps where the nodes it holds allow (MIN_NODES); Slurm keeps
the job off the node (the requeue's ExcNodeList, the --exclude of the line that continues
the run) only while the job's partition, or its reservation, still has as many usable nodes
as the job asks for without it (kept_off): else Slurm would hold the job PENDING
(BadConstraints) for good, or refuse the line. Every later job of the run is told which of
its excluded nodes a job of the run left out, and how to take one back (exclusion_note).

Which step comes next is data: first_step (a requeued job's first step) and next_step (after
a step that a restart may fix) take the facts, as plain values, and hand back a Next: the Step
to start (its nodes, ranks, the nodes srun leaves out, the node of the rendezvous), or none,
and why; the supervisor runs it, prints its lines, and asks Slurm."""

import os
import re
import subprocess
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from ddpkit.job.contract import SCONTROL_TIMEOUT, JobPaths, job_fields, last_line, read_hung, read_node_fault, run
from ddpkit.supervisor.outcome import Outcome, nodes_to_go_on_with
from ddpkit.supervisor.settings import Settings

LEAVE_OUT_AFTER = 2  # failures pinned on one node after which the job leaves it out
# How sinfo's states (%T) of a node Slurm starts no job on until someone acts begin: down,
# drained or draining, failed or failing, not valid, not yet in service (whatever suffix, *~#!%$@^-+).
UNUSABLE = ("down", "drain", "fail", "inval", "future")

class Pin(NamedTuple):
    """One failure pinned on a node."""
    ranks: str  # the ranks it followed there, space-separated ("" for a node the job lost)
    why: str


def read_lines(path: str) -> List[str]:
    """The lines of a file the ranks or the supervisor left, [] when there is none."""
    try:
        with open(path) as file:
            return [line.strip() for line in file if line.strip()]
    except OSError:
        return []


def failure_pins(job_dir: str, outcome: Outcome, step: Sequence[str]) -> Dict[str, Pin]:
    """The nodes this step's failure is pinned on, each with why, from the files the ranks left
    in the job's folder; `step` is the step's nodes, should the ranks not have met (rank 0
    lists them by rank once they did: JobPaths.NODES). A kind of failure that names every node
    of the step pins none."""
    by_rank = read_lines(JobPaths.of_folder(job_dir).nodes)
    hung, killed = {}, {}  # type: Dict[str, List[str]], Dict[str, List[str]]
    faults = {}  # type: Dict[str, List[Pin]]
    for rank, node in read_hung("\n".join(read_lines(JobPaths.of_folder(job_dir).hung))):
        hung.setdefault(node, []).append(rank)
    for rank in outcome.killed:
        if rank < len(by_rank):
            killed.setdefault(by_rank[rank], []).append(str(rank))
    for name in sorted(os.listdir(job_dir)) if os.path.isdir(job_dir) else []:
        match = re.fullmatch(JobPaths.NODE_FAULT.format(r"(\d+)"), name)
        node, fault = read_node_fault("\n".join(read_lines(os.path.join(job_dir, name)))) if match else ("", "")
        if node:
            faults.setdefault(node, []).append(Pin(match.group(1), f"rank {match.group(1)} on it failed with {fault}"))
    kinds = [{node: Pin(" ".join(ranks), f"a hang report named rank {' '.join(ranks)} on it")
              for node, ranks in hung.items()},
             {node: Pin(" ".join(ranks), f"rank {' '.join(ranks)} on it was killed by a signal")
              for node, ranks in killed.items()},
             {node: Pin(" ".join(pin.ranks for pin in found), " and ".join(pin.why for pin in found))
              for node, found in faults.items()}]
    every = set(by_rank or step)
    pins = {}  # type: Dict[str, Pin]
    for kind in kinds:
        if every and every <= set(kind):  # (every node of the step: nothing tells them apart)
            continue
        for node, pin in kind.items():
            if node in pins:
                ranks = pins[node].ranks.split() + [rank for rank in pin.ranks.split() if rank not in pins[node].ranks.split()]
                pin = Pin(" ".join(ranks), f"{pins[node].why} and {pin.why}")
            pins[node] = pin
    return pins


def step_pins(pins: Dict[str, Pin], *, step: Sequence[str], held: Sequence[str], job_nodes: Sequence[str]
              ) -> Dict[str, Pin]:
    """A step's `pins` (failure_pins) on the job's own nodes alone (a rank that could not name
    its node, as in a container without SLURMD_NODENAME, names another, which the job never
    held nor lost; every one where the job's nodes are unknown), and on each node of the
    `step` that the job no longer holds ([]: unknown), the job's lost it."""
    pins = {node: pin for node, pin in pins.items() if node in job_nodes or not job_nodes}
    for node in step:
        if held and node not in held and node in job_nodes:
            pins[node] = Pin("", "the job lost it (Slurm took it from the job)")
    return pins


def read_pins(path: str) -> Dict[str, List[Pin]]:
    """The failures pinned on each node so far (JobPaths.node_failures: a line each, the node,
    the ranks and the failure and why, separated by tabs), in the order they came."""
    pins = {}  # type: Dict[str, List[Pin]]
    for line in read_lines(path):
        node, _, rest = line.partition("\t")
        ranks, _, why = rest.partition("\t")
        pins.setdefault(node, []).append(Pin(ranks.strip(), why))
    return pins


def record_pins(path: str, pins: Dict[str, Pin], failure: str) -> Dict[str, List[Pin]]:
    """Add one failure's pins (node -> its ranks and why) to the job's record, the why as
    "<failure>: <why>", and return every node's pins so far."""
    if pins:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "a") as file:
            file.write("".join(f"{node}\t{pin.ranks}\t{failure}: {pin.why}\n" for node, pin in pins.items()))
    return read_pins(path)


def ranks_on_two_nodes(pins: Dict[str, List[Pin]]) -> Dict[str, List[str]]:
    """The ranks pinned on two different nodes or more, each with those nodes: their failure
    follows the rank, not a node."""
    nodes = {}  # type: Dict[str, List[str]]
    for node, failures in pins.items():
        for rank in {rank for pin in failures for rank in pin.ranks.split()}:
            nodes.setdefault(rank, []).append(node)
    return {rank: sorted(on) for rank, on in nodes.items() if len(on) > 1}


def left_out(pins: Dict[str, List[Pin]]) -> List[str]:
    """The nodes the job leaves out: those LEAVE_OUT_AFTER failures or more were pinned on,
    not counting a failure that followed a rank pinned on another node too."""
    wandering = set(ranks_on_two_nodes(pins))
    return [node for node, failures in pins.items()
            if len([pin for pin in failures if not set(pin.ranks.split()) & wandering]) >= LEAVE_OUT_AFTER]


def run_failure_line(rank: str, nodes: List[str]) -> str:
    """The one line that says a rank's failure is the run's own, not a node's."""
    return (f"rank {rank} failed on {' and on '.join(nodes)}: the failure follows the rank, the run's own, and no node "
            "is left out for it")


def leave_out_line(node: str, failures: List[Pin]) -> str:
    """The one line that says a node is left out, and why."""
    whys = "; ".join(pin.why for pin in failures)
    return f"leaving {node} out of this job from now on: {len(failures)} failures were pinned on it ({whys})"


def with_excluded(excluded: str, nodes: Sequence[str]) -> str:
    """A job's ExcNodeList (as scontrol shows it: "(null)" for none) with `nodes` added, as a
    list that scontrol update and sbatch --exclude read."""
    given = [] if excluded in ("", "(null)") else re.findall(r"(?:[^,\[]|\[[^\]]*\])+", excluded)  # (node[1-3],gpu4)
    return ",".join(given + [node for node in nodes if node not in given])


def of_one_step(name: str) -> bool:
    """Whether a file of the job's folder tells of one step alone, cleared before the next."""
    return name in (JobPaths.NODES, JobPaths.HUNG) or re.fullmatch(JobPaths.NODE_FAULT.format(r"\d+"), name) is not None


# ----------------------------------------------------------------------------- which step comes next

class Step(NamedTuple):
    """The job step the supervisor starts: how many of the job's nodes and ranks, which of its
    nodes srun leaves out (those left out, and those a smaller step leaves: it then runs on
    exactly the nodes chosen, rank 0 on the first), and where the rendezvous moved: the nodes
    chosen then, as a node list, whose first gives MASTER_ADDR ("": as the job started)."""
    nodes: int
    ntasks: int
    excluded: Tuple[str, ...]
    master: str


def whole_job(s: Settings) -> Step:
    """The step on every node and rank the job was given."""
    return Step(s.nodes, s.ntasks, (), "")


def step_nodes(step: Step, job_nodes: Sequence[str]) -> List[str]:
    """The nodes srun gives `step` of the job's nodes (listed as Slurm gave them): the first
    ones it does not leave out."""
    return [node for node in job_nodes if node not in step.excluded][:step.nodes]


class Next(NamedTuple):
    """What comes after a step: `step`, the step to start (None: none in this allocation); `said`,
    what the ATTEMPT line adds (first_step: the line to print); `why`, where there is no step,
    what the outcome's why adds after "; then "; `requeue`: the job is requeued for `why` first."""
    step: Optional[Step]
    said: str
    why: str
    requeue: bool


def narrowed(step: Step, go_on: int, tasks_per_node: int, *, nodes: Sequence[str], usable: Sequence[str]) -> Step:
    """`step` on `go_on` nodes. Where the job leaves some of the `nodes` it holds out (fewer are
    `usable`), srun runs it on exactly the nodes chosen, rank 0 on the first, where the
    rendezvous moves when it was on a node left out; else on the first of the nodes held."""
    if len(usable) == len(nodes):
        return step._replace(nodes=go_on, ntasks=go_on * tasks_per_node)
    chosen = list(usable[:go_on])
    return Step(go_on, go_on * tasks_per_node, tuple(node for node in nodes if node not in chosen),
                ",".join(chosen) if chosen[0] != nodes[0] else step.master)


def first_step(s: Settings, *, nodes: Sequence[str], left: Sequence[str], world_sizes: List[int]) -> Next:
    """A requeued job's first step, which leaves out the nodes its record leaves out (`left`):
    srun excludes those of the job's `nodes` it holds again (Slurm could not keep it off them),
    on fewer nodes where MIN_NODES and the batch allow; else it runs on them as before (and
    gives up after MAX_RESTARTS, not requeued a second time to leave them out)."""
    step = whole_job(s)
    usable = [node for node in nodes if node not in left]
    if len(usable) == len(nodes):
        return Next(step, "", "", False)
    held = ",".join(node for node in nodes if node in left)
    go_on = nodes_to_go_on_with(min(len(usable), s.nodes), s.min_nodes, s.tasks_per_node, world_sizes)
    if not go_on:
        return Next(step, f"the job holds {held} again, which it leaves out, and too few nodes without it (MIN_NODES="
                          f"{s.min_nodes}): it runs on them, and is not requeued again to leave them out", "", False)
    new = narrowed(step, go_on, s.tasks_per_node, nodes=nodes, usable=usable)
    instead = f" instead of {step.ntasks}" if new.ntasks != step.ntasks else ""
    return Next(new, f"the job holds {held} again, which it leaves out: its step runs on {go_on} node(s) with "
                     f"{new.ntasks} rank(s){instead}, without it", "", False)


class Held(NamedTuple):
    """The job's nodes as Slurm gives them now: scontrol's NumNodes and NodeList, and its
    nodes listed ([] where the job leaves none out: no need to list them)."""
    count: int
    nodelist: str
    nodes: List[str]


def next_step(s: Settings, step: Step, held: Held, *, left: Sequence[str], world_sizes: List[int],
              requeued_to_leave_out: bool, kept_off: Callable[[], List[str]]) -> Next:
    """After `step` ended in a failure that a restart may fix: the step that comes next, from the
    nodes the job `held` now (a lost node leaves a job submitted with --no-kill running without
    it) less those it leaves out (`left`). With all that the step used, the step starts again as
    it was. With fewer, and MIN_NODES and the run's batch (`world_sizes`) allowing it, the step
    goes on with the most of them it can use, without those left out; with too few, the job is
    requeued, and Slurm keeps it off those left out; not where it was requeued once already to
    leave a node out (`requeued_to_leave_out`), nor for a node left out that Slurm could not
    place the job without: `kept_off()`, those Slurm can keep it off, asked only then (the
    answer costs a query of Slurm)."""
    count = held.count
    bad_held = [node for node in held.nodes if node in left and node not in step.excluded]
    usable = [node for node in held.nodes if node not in left]
    leaves_out = len(usable) < len(held.nodes)  # (a node left out is held: count only the others)
    if leaves_out:
        count = len(usable)
    if count >= step.nodes and not bad_held:
        return Next(step, "", "", False)
    go_on = nodes_to_go_on_with(count, s.min_nodes, s.tasks_per_node, world_sizes)
    lost = f"the job holds {held.count} of its {s.nodes} nodes ({held.nodelist})"
    if leaves_out:
        out = len(held.nodes) - len(usable)
        lost += f", {count} without the {'node' if out == 1 else 'nodes'} it leaves out"
    # (a requeue to leave out a node that Slurm could not place the job without would leave it
    # PENDING for good: the step starts again as it was, while the job holds every node it had)
    kept = kept_off() if not go_on and bad_held else []
    unkept = [node for node in bad_held if node not in kept] if not go_on else []
    if unkept and not requeued_to_leave_out and held.count >= step.nodes:
        said = f" with {','.join(unkept)}, which Slurm could not place the job without"
        excludes = [node for node in bad_held if node in kept]  # (excluded in the line alone: no requeue for it)
        if excludes:
            said += (f", and with {','.join(excludes)}, which the line that continues the run excludes (not "
                     f"requeued without {'it' if len(excludes) == 1 else 'them'}: Slurm would place the job on "
                     f"{','.join(unkept)} again)")
        return Next(step, said, "", False)
    if not go_on and bad_held and requeued_to_leave_out:  # (a second requeue might leave out a healthy node)
        if held.count >= step.nodes:
            return Next(step, f" with {','.join(bad_held)} (not requeued a second time to leave a node out)", "", False)
        return Next(None, "", f"{lost}, and it was requeued once already to leave a node out", False)
    if not go_on:
        unset = "" if s.min_nodes_set else " (unset: every node of the job)"
        per_node = f"at {s.tasks_per_node} rank(s) a node"
        why = f"fewer than MIN_NODES={s.min_nodes}{unset}" if count < s.min_nodes else \
            f"and no count of them from MIN_NODES={s.min_nodes} up, {per_node}, keeps the global batch"
        return Next(None, "", f"{lost}, {why}", True)
    new = narrowed(step, go_on, s.tasks_per_node, nodes=held.nodes, usable=usable)
    instead = f" instead of {step.ntasks}" if new.ntasks != step.ntasks else ""
    return Next(new, f": {lost}, so on {go_on} node(s) with {new.ntasks} rank(s){instead}", "", False)


# ----------------------------------------------------------------------------- what Slurm can keep the job off

class Usable(NamedTuple):
    """The nodes of the job's partition (of its reservation, if it has one) Slurm can place it on."""
    where: str  # "partition gpu", "reservation big (partition gpu)"
    nodes: List[str]


def usable_nodes(listing: str) -> List[str]:
    """The nodes of `sinfo --Node --format='%N %T'`'s listing (a node and its state a line) that
    Slurm starts a job on: not down, drained or failed (UNUSABLE); busy ones count."""
    usable = []  # type: List[str]
    for line in listing.splitlines():
        node, _, state = line.strip().partition(" ")
        if node and node not in usable and not state.strip().lower().startswith(UNUSABLE):
            usable.append(node)
    return usable


def ask_usable(partition: str, reservation: str) -> Usable:
    """Ask Slurm for the usable nodes of `partition`, within `reservation`'s where the job has
    one: the one query of them. OSError (or SubprocessError) when Slurm cannot say."""
    where, command = "partition " + partition, ["sinfo", "--noheader", "--Node", "--partition=" + partition]
    if reservation:
        shown = run(["scontrol", "show", "reservation", "--oneliner", reservation], SCONTROL_TIMEOUT)
        nodes = job_fields(shown.stdout).get("Nodes", "")
        if shown.returncode != 0 or not nodes:
            raise OSError(why_failed("scontrol show reservation", shown) if shown.returncode != 0 else
                          f"scontrol show reservation: no nodes for {reservation}")
        where, command = f"reservation {reservation} ({where})", command + ["--nodes=" + nodes]
    result = run(command + ["--format=%N %T"], SCONTROL_TIMEOUT)
    if result.returncode != 0:
        raise OSError(why_failed("sinfo", result))
    return Usable(where, usable_nodes(result.stdout))


def why_failed(command: str, result: subprocess.CompletedProcess) -> str:
    """Why `command` failed, its tool named once: Slurm's tools name themselves ("sinfo: error:
    ...")."""
    said = last_line(result.stderr) or f"exit {result.returncode}"
    return said if said.startswith(command.split()[0] + ":") else f"{command}: {said}"


def job_usable(fields: Dict[str, str]) -> Tuple[Optional[Usable], str]:
    """ask_usable for the job whose scontrol fields are `fields`: (None, why) where Slurm cannot say."""
    partition, reservation = fields.get("Partition", ""), fields.get("Reservation", "")
    if not partition:
        return None, "its partition is unknown"
    try:
        return ask_usable(partition, "" if reservation == "(null)" else reservation), ""
    except (OSError, subprocess.SubprocessError) as err:
        return None, str(err)


def kept_off(left: Sequence[str], usable: Optional[Usable], excluded: Sequence[str], count: int) -> List[str]:
    """Which nodes of `left` (left out, in that order) Slurm can keep a job of `count` nodes off,
    with `excluded` (its own ExcNodeList): each while the usable nodes left without it and those
    before it still number `count`. Every one where Slurm cannot say (usable None): as before."""
    if usable is None:
        return list(left)
    kept = []  # type: List[str]
    for node in left:
        if len([n for n in usable.nodes if n not in excluded and n not in kept and n != node]) >= count:
            kept.append(node)
    return kept


def cannot_keep_off_line(node: str, *, failures: List[Pin], usable: Usable, excluded: Sequence[str], count: int) -> str:
    """The one line that says Slurm cannot keep the job off a node left out, and why (the
    counts): no requeue, no --exclude; the job's steps in this allocation still leave it out
    where MIN_NODES allows, which the ATTEMPT line says."""
    without = len([n for n in usable.nodes if n != node and n not in excluded])
    also = " and the nodes the job excludes" if any(n in usable.nodes for n in excluded if n != node) else ""
    return (f"Slurm cannot keep this job off {node}, though {len(failures)} failures were pinned on it "
            f"({'; '.join(pin.why for pin in failures)}): {usable.where} has {len(usable.nodes)} usable nodes, "
            f"{without} without {node}{also}, and the job asks for {count}, so neither a requeue nor the line that "
            f"continues the run excludes {node}")


def left_out_by_jobs(run_dir: str, this_job: str) -> Dict[str, str]:
    """The nodes a job of the run left out, from each job's record (JobPaths.node_failures):
    node -> by whom and why, as "job 12 of this run (2 failures were pinned on it)" (or "this
    job (...)", for `this_job`)."""
    found = {}  # type: Dict[str, str]
    for job, path in JobPaths(run_dir).node_failure_records():
        pins = read_pins(path)
        for node in left_out(pins):
            by = "this job" if job == this_job else f"job {job} of this run"
            found.setdefault(node, f"{by} ({len(pins[node])} failures were pinned on it)")
    return found


def exclusion_note(value: str, excluded: Sequence[str], by_jobs: Dict[str, str]) -> str:
    """The line after the line that continues the run, on its --exclude=`value` (the nodes
    `excluded`): which nodes a job of the run left out (`by_jobs`), which are yours, and how
    to take a node back once repaired. "" where none was left out by a job."""
    ours = [node for node in excluded if node in by_jobs]
    if not ours:
        return ""
    yours = [node for node in excluded if node not in by_jobs]
    said = ", ".join(f"{node} left out by {by_jobs[node]}" for node in ours)
    own = f", {','.join(yours)} yours" if yours else ""
    them = ",".join(ours)
    return (f"--exclude={value} in that line: {said}{own}; every later line keeps {them} excluded: take "
            f"{'it' if len(ours) == 1 else 'each'} out of --exclude once {'it is' if len(ours) == 1 else 'they are'} "
            "repaired")
