"""--check's look at the shared storage: for LOG_DIR and DATA_DIR, on every node, the file
system that holds the folder and its options that matter for locks (/proc/self/mountinfo),
how long a file that rank 0 writes there takes to be seen by each other node, and whether a
lock that rank 0 holds there excludes a rank of another node.

A lock that excludes nobody across nodes is what NFS mounted nolock or local_lock=..., and
Lustre mounted localflock, do: fcntl's locks succeed on every node and exclude only the
processes of one node. The check says so in one line, and passes all the same: the run's
claim and the data lock stand on a lease, a folder renamed into place, which holds on every shared file
system. A folder that cannot be written is refused where it is written (the supervisor for
LOG_DIR, staging for DATA_DIR): here it is only said."""

import errno
import fcntl
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from ddpkit.files import mount_of, parse_mountinfo, replace_text

VISIBLE_WAIT = 30.0  # seconds a node waits for rank 0's file, at most
POLL = 0.02  # seconds between two looks for it
PROBE = ".mnist-ddp-check-"  # the probe's name: PROBE + a nonce, removed once every node has looked
def existing(folder: Path) -> Path:
    """`folder`, or its nearest parent that exists (a DATA_DIR that the first run makes)."""
    folder = folder.absolute()
    while not os.path.exists(folder) and folder != folder.parent:  # (never raises: a parent without search rights)
        folder = folder.parent
    return folder


def mount_words(folder: Path) -> tuple[str, str]:
    """(words, short words) of the file system that holds `folder` here, as this node sees it."""
    try:
        with open("/proc/self/mountinfo") as fh:
            mount = mount_of(os.path.realpath(existing(folder)), parse_mountinfo(fh.read()))
    except OSError as err:
        return f"a file system this node cannot tell ({err.strerror})", "?"
    return (mount.words(), mount.short()) if mount else ("a file system of no mount here", "?")


# ----------------------------------------------------------------------------- the probes

def write_probe(folder: Path, name: str, nonce: str) -> tuple[Path | None, object | None, str]:
    """Rank 0: write the nonce into a probe file `name` in `folder` (or its nearest parent
    that exists), renamed into place whole, and hold a lock on it. Returns (the probe, its
    open file that holds the lock, or None, and what failed, or "")."""
    path = existing(folder) / name
    try:
        replace_text(path, nonce)
    except OSError as err:
        return None, None, f"rank 0 cannot write there ({err.strerror})"
    try:
        held = open(path, "r+")
    except OSError as err:
        return path, None, f"rank 0 cannot open its file there ({err.strerror})"
    try:
        fcntl.lockf(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        held.close()
        return path, None, f"rank 0 cannot take a lock there ({err.strerror})"
    return path, held, ""


def wait_to_see(paths: dict[str, Path], nonce: str, wait: float) -> dict[str, float | None]:
    """{label: seconds until the probe held the nonce here, or None if not within `wait`}, each
    file opened anew at every look (as a reader of another node's file does: NFS checks a file
    at each open)."""
    started = time.monotonic()
    seen: dict[str, float | None] = dict.fromkeys(paths)
    while True:
        for label, path in paths.items():
            if seen[label] is None:
                try:
                    with open(path) as fh:
                        if fh.read() == nonce:
                            seen[label] = time.monotonic() - started
                except OSError:
                    pass
        if all(s is not None for s in seen.values()) or time.monotonic() - started >= wait:
            return seen
        time.sleep(POLL)


def try_lock(path: Path) -> str:
    """"refused" (a lock held elsewhere excludes this process), "granted", or what failed."""
    try:
        with open(path, "r+") as fh:
            try:
                fcntl.lockf(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                return "refused" if err.errno in (errno.EACCES, errno.EAGAIN) else f"failed ({err.strerror})"
            fcntl.lockf(fh, fcntl.LOCK_UN)
            return "granted"
    except OSError as err:
        return f"failed ({err.strerror})"


def check_storage_all_ranks(folders: dict[str, Path], nodes: list[str], rank: int, wait: float = VISIBLE_WAIT) -> list[str]:
    """Rank 0's lines on each folder ({label: folder}) ([] on the other ranks): a collective,
    which every rank calls (without a process group, on one rank alone). The first rank of
    each node looks at its mounts; rank 0 writes a probe into each folder and holds a lock on
    it, the first ranks of the other nodes wait up to `wait` seconds to see it and then try
    its lock; rank 0 gathers what each saw, then removes the probes."""
    names = list(dict.fromkeys(nodes))
    first = nodes.index(nodes[rank]) == rank
    if len(names) == 1:
        return [one_node_line(label, folder, mount_words(folder)[0]) for label, folder in folders.items()] if rank == 0 else []
    probes: dict[str, tuple[Path | None, object | None, str]] = {}
    sent = [None]
    if rank == 0:
        nonce = secrets.token_hex(8)
        # (a name of each folder's own: two folders may be one, and closing one of two files
        # would release this process's lock on both)
        probes = {label: write_probe(folder, f"{PROBE}{nonce}-{label}", nonce) for label, folder in folders.items()}
        sent = [(nonce, {label: (str(path) if path else "", error) for label, (path, _, error) in probes.items()})]
    try:
        dist.broadcast_object_list(sent, src=0)
        nonce, written = sent[0]
        mine = None
        if first:
            mine = {"node": nodes[rank], "mounts": {label: mount_words(folder) for label, folder in folders.items()}}
            if rank:
                readable = {label: Path(path) for label, (path, _) in written.items() if path}
                seen = wait_to_see(readable, nonce, wait)
                mine["seen"] = seen
                mine["locks"] = {label: try_lock(readable[label]) for label, s in seen.items()
                                 if s is not None and not written[label][1]}
        every = [None] * len(nodes)
        dist.all_gather_object(every, mine)
    finally:
        for path, held, _ in probes.values():
            if held:
                held.close()  # (its lock goes with it)
            if path:
                path.unlink(missing_ok=True)
    if rank:
        return []
    rows = [row for row in every if row]
    lines = []
    for label, folder in folders.items():
        lines += storage_lines(storage_folder(label, folder, written[label][1]),
                               [NodeView(row["node"], *row["mounts"][label], row.get("seen", {}).get(label),
                                         row.get("locks", {}).get(label, "")) for row in rows], wait)
    return lines


# ----------------------------------------------------------------------------- the lines

@dataclass(frozen=True)
class StorageFolder:
    """A folder the check looks at: its label (LOG_DIR), its absolute path, the parent probed in
    its place where it does not exist yet ("its parent", or a path; else ""), and what kept rank
    0 from probing it (or "")."""
    label: str
    path: str
    probed_in: str = ""
    error: str = ""

    def words(self) -> str:
        return f"{self.label} {self.path}" + (f" (not there yet: probed in {self.probed_in})" if self.probed_in else "")


@dataclass(frozen=True)
class NodeView:
    """What the first rank of a node saw of a folder: its file system (words, short words),
    the seconds until rank 0's file was seen (None: not within the wait; rank 0's own node:
    None too) and what its try of rank 0's lock gave ("refused", "granted", "failed (...)",
    or "": not tried)."""
    node: str
    mount: str
    short: str
    seen: float | None = None
    lock: str = ""


def storage_folder(label: str, folder: Path, error: str = "") -> StorageFolder:
    where, folder = existing(folder), folder.absolute()
    probed_in = "" if where == folder else "its parent" if where == folder.parent else str(where)
    return StorageFolder(label, str(folder), probed_in, error)


def one_node_line(label: str, folder: Path, mount: str) -> str:
    return (f"check: {storage_folder(label, folder).words()}: {mount}; whether its locks exclude across nodes cannot be "
            "told with one node")


def lock_words(lock: str, holder: str) -> str:
    if lock == "refused":
        return f"a lock held on {holder} excludes a rank here"
    if lock == "granted":
        return f"a lock held on {holder} does not exclude a rank here"
    return f"a lock here {lock}"


def storage_lines(folder: StorageFolder, views: list[NodeView], wait: float = VISIBLE_WAIT) -> list[str]:
    """Rank 0's lines on `folder` from each node's view (rank 0's node first): one line when
    every node sees the same file system, saw rank 0's file and agrees on its lock; else one
    line a node. Then, where a lock did not exclude a node, one line that says so and what
    covers it."""
    holder, others = views[0].node, views[1:]
    lines = []
    agree = (len({view.mount for view in views}) == 1 and all(view.seen is not None for view in others)
             and len({view.lock for view in others}) == 1)
    if folder.error:
        if len({view.mount for view in views}) == 1:
            return [f"check: {folder.words()}: {views[0].mount} on all {len(views)} nodes; {folder.error}: not probed"]
        return [f"check: {folder.words()} on {holder}: {views[0].mount}; {folder.error}: not probed"] + [
            f"check: {folder.label} on {view.node}: {view.mount}" for view in others]
    if agree:
        lock = others[0].lock
        reach = {"refused": f"a lock held on {holder} excludes the other nodes' ranks",
                 "granted": f"a lock held on {holder} does not exclude the other nodes' ranks"}.get(
                     lock, f"a lock on the other nodes {lock}")
        lines.append(f"check: {folder.words()}: {views[0].mount} on all {len(views)} nodes; a file written on {holder} "
                     f"was seen on the others within {max(view.seen for view in others):.2f} s; {reach}")
    else:
        lines.append(f"check: {folder.words()} on {holder}: {views[0].mount}; rank 0 wrote a file here and holds a lock "
                     "on it")
        for view in others:
            seen = (f"the file written on {holder} was seen after {view.seen:.2f} s; {lock_words(view.lock, holder)}"
                    if view.seen is not None else f"the file written on {holder} was not seen after {wait:g} s")
            lines.append(f"check: {folder.label} on {view.node}: {view.mount}; {seen}")
    loose = [view.node for view in others if view.lock == "granted"]
    if loose:
        lines.append(f"check: locks on {folder.label} ({views[0].short}) do not exclude across nodes ({', '.join(loose)} "
                     f"took one that {holder} held): the run's claim and the data lock use a lease (a folder renamed into place), which does")
    return lines
