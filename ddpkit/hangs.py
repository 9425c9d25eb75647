"""Hang reports: where each rank is when the ranks stop moving together, in one line, with
every rank's stacks kept.

Each rank marks what it does that the others may wait on (`doing`): a training step, whose
gradient all-reduce waits for every rank; a labelled collective (distributed.py's
`collective`); its own work (a save, an evaluation). Its own watchdog thread (HangWatch)
sees when one of these has lasted longer than --hang-after seconds, well before
--dist-timeout ends it. A rank that waits then writes every thread's stack to
RUN_DIR/hangs/<attempt>/rank-<r>-<host>.txt and a summary beside it: its innermost frame in
the recipe or ddpkit, and the collective it waits in; a rank busy with its own work does
the same once another rank waits. A rank whose innermost frame is not torch's (nor
Python's own) runs Python code and does not wait: a rank in code that is neither the
project's nor torch's (a library, a user's backward hook, on a GPU in autograd's own thread)
is named at that code's innermost frame. The waiting ranks read the others' summaries a few
seconds later; for a rank that wrote none, a waiting rank on the same host reads /proc:
stopped (state T), in uninterruptible I/O (state D), or gone. The lowest waiting rank
prints the verdict in one line. A C call that holds the interpreter's lock stops the
watchdog thread too: faulthandler, armed by it at every look, then writes that rank's
stacks from C. Healing is as before: --dist-timeout ends the wait, and the job starts
again from its newest checkpoint. The watch starts once the ranks have exchanged their
hosts (jobs.py; the two collectives before it, the run directory's broadcast and the host
names' gather, are bounded by --dist-timeout alone): from then on, a rank that never answers
at start-up, in a barrier, the staging lock or the first broadcast of the weights, is named
as in training.

Standard library only: distributed.py marks its collectives here."""

import contextlib
import faulthandler
import json
import os
import re
import socket
import sys
import sysconfig
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ddpkit.files import make_folder, replace_json

KIT = Path(__file__).resolve().parent   # ddpkit/
PYTHON_LIBRARY = Path(sysconfig.get_paths()["stdlib"]).resolve()
SLACK = 2.0     # seconds between hosts' clocks that a summary's time may be off by
GRACE = 2.0     # seconds a waiting rank gives the others to write their summaries
TICK = 1.0      # seconds between the watchdog's looks
# Where a rank that is inside torch's collectives or its backward pass waits: it has
# reached the collective (DDP's gradient all-reduce runs inside backward()).
TORCH_WAITS = re.compile(r"torch/(distributed|nn/parallel|autograd)/")
TORCH_BACKWARD = re.compile(r"torch/autograd/")  # (where backward() hands the graph to autograd's engine)

WAITS, STEP, OWN = "waits", "step", "own"  # the kinds of what the main thread does (MainThread.doing)
STARTING = -1  # (as MainThread.step) this start of the run has not watched a training step yet: it starts up


@dataclass
class MainThread:
    """What this process's main thread does that the other ranks may wait on, which the
    watchdog's thread reads. `doing`: (what, since, kind), kind one of WAITS (a labelled
    collective: it waits), STEP (a training step: it waits once inside torch's collectives or
    backward) and OWN (its own work, a save or an evaluation, which answers only when another
    rank already waits), or None. `step`: the steps this rank has finished, for the report."""
    doing: tuple[str, float, str] | None = None
    step: int = STARTING


main_thread = MainThread()  # (one a process: its main thread writes it through the functions below)


def doing(what: str | None, kind: str = WAITS) -> object:
    """From now on, the main thread does `what` (None: nothing the others wait on). Returns
    what it did before, for `restore`."""
    before = main_thread.doing
    main_thread.doing = (what, time.monotonic(), kind) if what else None
    return before


def restore(before: object) -> None:
    main_thread.doing = before


def next_step(finished: int, label: str) -> None:
    """`finished` steps are done; the next one, whose gradient all-reduce (`label`) waits on
    every rank, is watched from now on."""
    main_thread.step = finished
    doing(label, STEP)


@dataclass(frozen=True)
class Peer:
    rank: int
    host: str
    pid: int
    node: str = ""  # its node as Slurm names it (SLURMD_NODENAME), which may differ from its host's name


def when(step: int) -> str:
    """When a hang came, as a report says it: after the steps finished, or at start-up."""
    return "at start-up, before the first step" if step == STARTING else f"after step {step}"


def default_hang_after(dist_timeout: float) -> float:
    """--hang-after 0: a fifth of --dist-timeout, at least 10 s (0, off, when that is not below it)."""
    seconds = max(10.0, dist_timeout / 5)
    return seconds if seconds < dist_timeout else 0.0


# What a frame's code is: the recipe's or ddpkit's (OWN_CODE), torch's, Python's own (its
# standard library), or anyone else's (a library, a user's hook or autograd function).
OWN_CODE, TORCH_CODE, PYTHON_CODE, OTHER_CODE = "own", "torch", "python", "other"


def code_of(filename: str, roots: tuple[Path, ...]) -> str:
    """Whose code a frame's file is (an environment inside the project's folder is not the
    project's, nor Python's when it lies inside Python's own folder)."""
    if filename.startswith("<frozen "):
        return PYTHON_CODE
    if filename.startswith("<"):  # code made from a string, as torch.fx's graphs (<eval_with_key>.3) under --compile
        return TORCH_CODE
    path = Path(filename).resolve()
    if any(part.startswith("torchinductor_") for part in path.parts):  # the kernels --compile wrote to its cache
        return TORCH_CODE
    package = installed_as(path)
    if package:
        return TORCH_CODE if package[0] == "torch" or path.is_relative_to(torch_folder()) else OTHER_CODE
    if path.is_relative_to(PYTHON_LIBRARY):
        return PYTHON_CODE
    if any(path.is_relative_to(root) for root in roots):
        return OWN_CODE
    return TORCH_CODE if path.is_relative_to(torch_folder()) else OTHER_CODE


def installed_as(path: Path) -> tuple[str, ...]:
    """The parts of `path` inside the environment it is installed in (after its innermost
    site-packages), or () when it is not installed."""
    places = [i for i, part in enumerate(path.parts[:-1]) if part in ("site-packages", "dist-packages")]
    return path.parts[places[-1] + 1:] if places else ()


def torch_folder() -> Path:
    """Where the torch this process imported lies (a source build need not be in an environment)."""
    torch = sys.modules.get("torch")
    file = getattr(torch, "__file__", None)
    return Path(file).resolve().parent if file else Path("/nonexistent")


def shown(filename: str, roots: tuple[Path, ...]) -> str:
    """A frame's file as the report names it: relative to the project, or to the environment
    it is installed in, else as it is."""
    path = Path(filename).resolve()
    if installed_as(path):
        return str(Path(*installed_as(path)))
    for root in roots:
        if path.is_relative_to(root):
            return str(path.relative_to(root.parent if root == KIT else root))
    return filename


def where_it_runs(frames: list[tuple[str, int, str]], roots: tuple[Path, ...]) -> tuple[str, str]:
    """Where a rank is, from its frames (file, line, function; outermost first): its innermost
    frame in `roots` (the recipe's directory, ddpkit/), as `file.py:LINE in function`; or,
    when code that is neither the project's, torch's nor Python's runs inside it (a library,
    a user's backward hook or autograd function, often inside backward()), that code's
    innermost frame, `called from` the project's. And whose code runs there: that of the
    innermost frame outside Python's own (OWN_CODE, TORCH_CODE or OTHER_CODE): only a rank
    in torch's may wait in a collective it did not label."""
    codes = [code_of(filename, roots) for filename, _, _ in frames]
    named = [f"{shown(filename, roots)}:{line} in {function}" for filename, line, function in frames]
    inner = [i for i in reversed(range(len(frames))) if codes[i] != PYTHON_CODE]  # (innermost first)
    runs = codes[inner[0]] if inner else PYTHON_CODE
    own = next((i for i in inner if codes[i] == OWN_CODE), -1)
    other = next((i for i in inner if codes[i] == OTHER_CODE), -1)
    if other > own:
        return named[other] + (f", called from {named[own]}" if own >= 0 else ""), runs
    return (named[own] if own >= 0 else "no frame of the recipe or ddpkit (see its stacks)"), runs


def stack_of(frame) -> list[tuple[str, int, str]]:
    frames = []
    while frame is not None:
        frames.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return frames[::-1]


def main_thread_frames() -> list[tuple[str, int, str]]:
    """The main thread's frames, outermost first, and those of the threads that Python did not
    start, should it be in backward() (joined_stack)."""
    current = sys._current_frames()
    # (a thread of autograd's that called threading.current_thread() is listed there as a dummy)
    started = {t.ident for t in threading.enumerate() if not isinstance(t, threading._DummyThread)}
    others = [stack_of(frame) for ident, frame in current.items() if ident not in started]
    return joined_stack(stack_of(current.get(threading.main_thread().ident)), others)


def joined_stack(main: list[tuple[str, int, str]], unstarted: list[list[tuple[str, int, str]]]) -> list[tuple[str, int, str]]:
    """The main thread's frames (outermost first); while it waits in backward(), followed by
    those of the threads Python did not start (`unstarted`) that run Python code: autograd
    runs the hooks and autograd functions of a GPU's tensors in a thread of its own for that
    device, while the main thread waits for it (a CPU's run in the main thread itself)."""
    if not main or not TORCH_BACKWARD.search(main[-1][0].replace(os.sep, "/")):
        return main
    return main + [frame for frames in unstarted for frame in frames]


def faulthandler_frames(text: str) -> list[tuple[str, int, str]]:
    """The main thread's frames (outermost first) from a faulthandler dump, which lists the
    threads newest first (the main thread last), each most recent call first."""
    blocks = [b for b in re.split(r"\n(?=(?:Current thread|Thread) 0x)", text) if "(most recent call first)" in b]
    block = blocks[-1] if blocks else ""
    frames = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', block)
    return [(f, int(n), name) for f, n, name in frames][::-1]


def process_state(pid: int, proc: Path = Path("/proc")) -> str:
    """How a process on this host looks from outside: 'stopped (state T ...)', 'in
    uninterruptible I/O (state D ...)', its state letter, or 'gone (no such process)'."""
    try:
        status = (proc / str(pid) / "status").read_text()
    except OSError:
        return "gone (no such process)"
    state = re.search(r"^State:\s*(\S)\s*\(([^)]*)\)", status, re.M)
    letter, words = (state.group(1), state.group(2)) if state else ("?", "unknown")
    try:
        wchan = (proc / str(pid) / "wchan").read_text().strip()
    except OSError:
        wchan = ""
    wchan = f", in the kernel at {wchan}" if wchan and wchan != "0" else ""
    if letter in "Tt":
        return f"stopped (state {letter}, {words}: SIGSTOP or a debugger{wchan})"
    if letter == "D":
        return f"in uninterruptible I/O (state D{wchan}: a hung file system or device)"
    if letter in "ZX":
        return f"dead (state {letter}, {words})"
    return f"alive but silent (state {letter}, {words}{wchan})"


def not_waiting(summaries: dict[int, dict], peers: list[Peer]) -> list[Peer]:
    """The ranks that have not reached the collective the others wait in (no answer, seen
    from outside, or elsewhere): those a hang report names."""
    return [peer for peer in peers if not summaries.get(peer.rank, {}).get("waiting")]


def verdict_line(summaries: dict[int, dict], peers: list[Peer], waited: float, folder: Path) -> str:
    """The one line: the ranks that have not reached the collective the others wait in,
    their hosts and where each is; then where the stacks are. When every rank waits in the
    same collective no rank is behind: the line names none, and at start-up there is none
    ("") at all (a Gloo group's first collectives can be slow under load); in training the
    network or the backend stalls (a fabric fault inside the gradient all-reduce)."""
    waiting = {r: s for r, s in summaries.items() if s.get("waiting")}
    labels = sorted({s["waiting"] for s in waiting.values()}, key=lambda w: -sum(s["waiting"] == w for s in waiting.values()))
    behind = []
    for peer in not_waiting(summaries, peers):
        summary = summaries.get(peer.rank)
        if summary is None:
            behind.append(f"rank {peer.rank} on {peer.host}: no answer")
        elif summary.get("outside"):
            behind.append(f"rank {peer.rank} on {peer.host} is {summary['outside']}")
        else:
            busy = f" ({summary['busy']})" if summary.get("busy") else ""
            behind.append(f"rank {peer.rank} on {peer.host} is at {summary['where']}{busy}")
    step = min((s["step"] for s in summaries.values() if "step" in s), default=STARTING)
    ranks = ", ".join(str(r) for r in sorted(waiting)) or "none"
    if not behind and len(labels) == 1:  # (a slow collective, the network's or the backend's: no rank to name)
        if step == STARTING:
            return ""
        return (f"hang {when(step)}: every rank waits in {labels[0]} for {waited:.0f} s, none behind: the network or the "
                f"collective backend (NCCL, Gloo) stalls, not a rank; every rank's stacks: {folder}")
    if not behind:
        every = "; ".join(f"rank {r} in {s['waiting']} at {s['where']}" for r, s in sorted(waiting.items()))
        return (f"hang {when(step)}: every rank waits in a collective, not all in the same one? {every}; every "
                f"rank's stacks: {folder}")
    return (f"hang {when(step)}: {'; '.join(behind)}; rank(s) {ranks} wait for it in {' / '.join(labels)} "
            f"for {waited:.0f} s; every rank's stacks: {folder}")


class HangWatch:
    """This rank's watchdog: a thread that looks every TICK at what the main thread does."""

    def __init__(self, *, rank: int, peers: list[Peer], folder: Path, hang_after: float, roots: tuple[Path, ...],
                 stream=None, named: Callable[[list[Peer]], None] = lambda peers: None,
                 resolved: Callable[[], None] = lambda: None):
        """`named`: called with the ranks a verdict names as those the others wait for, by the
        rank that prints it (the job runner tells the job's supervisor); `resolved`: called
        by that rank once the run finished a step after it, the wait over (the supervisor must
        not pin a failure on a node for a hang that ended)."""
        self.rank, self.peers, self.hang_after, self.roots, self.named = rank, peers, hang_after, roots, named
        self.resolved = resolved
        self.named_after: int | None = None  # the steps finished when a verdict named ranks, until it resolves
        self.folder = folder.resolve()
        self.stream = stream or sys.stderr
        self.host = socket.gethostname()
        self.stacks = self.folder / f"rank-{rank}-{self.host}.txt"
        self.reported = None  # the wait already reported
        self.file = None
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.watch, name="hang-watch", daemon=True)

    def start(self) -> "HangWatch":
        self.arm_faulthandler()  # (from here: a lock held before the thread's first look is caught too)
        self.thread.start()
        return self

    def stop(self) -> None:
        """At the run's end: the thread ends; its stacks file goes if nothing was written to it,
        and the folders if they are empty then (the other ranks' files are theirs)."""
        self.stopped.set()
        if self.thread.is_alive():
            self.thread.join(timeout=5)
        with contextlib.suppress(Exception):
            faulthandler.cancel_dump_traceback_later()
        if self.file:
            self.file.close()
            with contextlib.suppress(OSError):
                if self.stacks.stat().st_size == 0:
                    self.stacks.unlink()
        for folder in (self.folder, self.folder.parent):
            with contextlib.suppress(OSError):
                folder.rmdir()  # (only when empty)

    def tidy_earlier_attempts(self) -> None:
        """Once the run's directory is held (another run of the same name may still use it
        before): the empty files and folders of earlier attempts, killed, go."""
        remove_empty(self.folder.parent, keep=self.folder)

    def forget_a_resolved_hang(self) -> None:
        """Once the run finished a step after the one a verdict named ranks at, the wait ended:
        the ranks it named are no longer those the others wait for. (Not when the wait merely
        ends: a lost peer's error ends it too, and then the verdict stands.)"""
        if self.named_after is not None and main_thread.step > self.named_after:
            self.named_after = None
            self.resolved()

    def watch(self) -> None:
        while not self.stopped.wait(TICK):
            try:
                self.arm_faulthandler()
                self.forget_a_resolved_hang()
                now = main_thread.doing
                if now is None:
                    continue
                what, since, kind = now
                if time.monotonic() - since < self.hang_after or self.reported is now:
                    continue
                if kind == OWN and not self.others_wait(since):  # (a long evaluation on every rank is no hang)
                    continue
                self.reported = now
                self.report(what, since, kind)
            except Exception as err:  # a report must never end the run
                print(f"hang report of rank {self.rank} failed: {err}", file=self.stream, flush=True)

    def arm_faulthandler(self) -> None:
        """Should this thread stop looking for --hang-after seconds and more (a C call holds the
        interpreter's lock, in a step or anywhere), faulthandler writes the stacks from C. While
        the thread looks, every TICK, it never comes to that."""
        if self.file is None:
            make_folder(self.folder)  # (every rank's watch)
            self.file = open(self.stacks, "a")
        faulthandler.dump_traceback_later(self.hang_after + 2 * TICK, repeat=False, file=self.file)

    def others_wait(self, since: float) -> bool:
        """Whether another rank reported a wait that began after `since` (monotonic) here."""
        return any(s.get("waiting") for r, s in self.read_summaries(since).items() if r != self.rank)

    def report(self, what: str, since: float, kind: str) -> None:
        """This rank's stacks and summary; then, if it waits, the verdict once the others had
        time to answer (the lowest waiting rank prints it)."""
        frames = main_thread_frames()
        where, runs = where_it_runs(frames, self.roots)
        running_other = runs == OTHER_CODE
        inside_torch = runs == TORCH_CODE and any(TORCH_WAITS.search(f.replace(os.sep, "/")) for f, _, _ in frames)
        waits = what if (kind == WAITS and not running_other) or (kind == STEP and inside_torch) else ""
        waited = time.monotonic() - since
        doing_now = (f"waits in {waits}" if waits else f"is busy {what}" if kind == OWN else
                     f"runs code outside the recipe, ddpkit and torch, before {what}" if running_other else
                     f"has not reached {what}")
        self.file.write(f"rank {self.rank} on {self.host} (pid {os.getpid()}), {when(main_thread.step)}: {doing_now} for "
                        f"{waited:.0f} s, at {where}\n")
        self.file.flush()
        faulthandler.dump_traceback(self.file, all_threads=True)
        self.file.write("\n")
        self.file.flush()
        replace_json(self.folder / f"rank-{self.rank}.json",
                   {"rank": self.rank, "host": self.host, "step": main_thread.step, "waiting": waits, "where": where,
                    "busy": what if kind == OWN else "", "time": time.time()})
        if not waits:
            return
        if self.stopped.wait(GRACE):  # (the run ended meanwhile)
            return
        self.arm_faulthandler()
        summaries = self.read_summaries(since)
        silent = [peer for peer in self.peers if peer.rank not in summaries and peer.host == self.host]
        alive = [peer for peer in silent if process_state(peer.pid).startswith("alive")]
        for _ in range(4):  # a live rank whose lock is held: its faulthandler writes a little later
            if all(self.stacks_of(peer) for peer in alive) or self.stopped.wait(TICK):
                break
            self.arm_faulthandler()
        for peer in silent:  # a rank of this host that wrote nothing: look at it from outside
            replace_json(self.folder / f"rank-{peer.rank}.json",
                       {"rank": peer.rank, "host": peer.host, "outside": self.outside_view(peer), "time": time.time()})
        if self.stopped.wait(TICK):
            return
        summaries = self.read_summaries(since)
        if min(r for r, s in summaries.items() if s.get("waiting")) == self.rank:
            line = verdict_line(summaries, self.peers, time.monotonic() - since, self.folder)
            if not line:
                return
            (self.folder / "verdict.txt").write_text(line + "\n")
            print(f"{line}; --dist-timeout ends the wait", file=self.stream, flush=True)
            if behind := not_waiting(summaries, self.peers):
                self.named(behind)
                self.named_after = main_thread.step

    def stacks_of(self, peer: Peer) -> str:
        """A peer's stacks as faulthandler wrote them, or ""."""
        with contextlib.suppress(OSError):
            text = (self.folder / f"rank-{peer.rank}-{peer.host}.txt").read_text()
            return text if "most recent call first" in text else ""
        return ""

    def outside_view(self, peer: Peer) -> str:
        seen = process_state(peer.pid)
        text = self.stacks_of(peer)
        if text:  # faulthandler wrote them: a C call held its interpreter
            seen += f", at {where_it_runs(faulthandler_frames(text), self.roots)[0]} (faulthandler's stacks)"
        return seen

    def read_summaries(self, since: float) -> dict[int, dict]:
        """The summaries written since this wait began (`since`, monotonic here): an earlier
        wait's, which resolved, are not this one's."""
        began = time.time() - (time.monotonic() - since) - SLACK
        summaries = {}
        for path in self.folder.glob("rank-*.json"):
            with contextlib.suppress(OSError, ValueError, KeyError):
                summary = json.loads(path.read_text())
                if summary["time"] >= began:
                    summaries[int(summary["rank"])] = summary
        return summaries


def remove_empty(hangs: Path, keep: Path) -> None:
    """Empty stack files and folders under RUN_DIR/hangs left by earlier attempts of the run,
    killed before they had anything to report (this attempt's folder, `keep`, is the ranks')."""
    if not hangs.is_dir():
        return
    for folder in hangs.iterdir():
        if folder == keep or not folder.is_dir():
            continue
        with contextlib.suppress(OSError):
            for path in folder.glob("rank-*.txt"):
                if path.stat().st_size == 0:
                    path.unlink()
            folder.rmdir()  # (only when empty)
