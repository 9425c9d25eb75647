"""Experiment trackers beside TensorBoard (--tracker mlflow, --tracker wandb): one tracker run
for the whole run, across restarts, requeues, resubmissions and another world size, with
each step in it once. (Whether it can be used is checked with the options: options.tracker_problem.)

Rank 0 hands what it logs to a sender, a process of its own (`python -m ddpkit.run.trackers`),
which alone imports the tracker's package and talks to it: a tracker that is slow,
unreachable or failing never holds up a step, and never stops training. One line names it,
and what it missed is sent when it answers again, at a later epoch or a later start.

RUN_DIR/tracker.json (JobPaths.TRACKER) keeps, for each tracker (and MLflow server), its run
id, the last step it has, whether it has the hyperparameters and at which step the final
figures, and each start of the run (job, requeues, attempt, world size, step, changed options).
metrics.jsonl stays the record that counts: a start sends the epochs the tracker lacks from it,
and drops every point of a step the tracker has already (a resumed run trains those steps
again), unless the start goes back before them with changed options: that is a new timeline,
and a new tracker run. The per-step points (the batch loss, the ranks' step times) wait in the
sender: one that ends before the tracker answers loses those, never an epoch.

The sender holds tracker.json (entry_lock: a flock and a lease) for as long as it lives, so
that a start whose sender is still finishing (a rank killed, the run started again at once)
waits for it before it records itself. Standard library only, apart from the tracker's own package in the sender."""

import contextlib
import dataclasses
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

from ddpkit.files import NO_LOCKS, Lease, replace_json
from ddpkit.job.contract import EXIT_STOPPED, JobPaths

# How long the end of a start waits for the sender to hand the tracker what is left (a stop on
# a signal or at the time limit has a minute in all); what it has not sent by then, the next
# start sends (the epochs, from metrics.jsonl).
FLUSH_SECONDS = 15.0
# MLflow's own retries last minutes by default: one try an epoch is enough here, as the sender
# tries again at every epoch (each of these applies only where the user has not set it; the
# run prints its own line with the link).
MLFLOW_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
                   "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"}
# The most per-step points the sender keeps while the tracker does not answer (the oldest go
# first; an epoch's are all kept).
MAX_WAITING = 100_000
# The HTTP 4xx with which MLflow's server refuses a request that passes by itself: a time-out, a
# conflict (two requests at once), a request limit, and 499, the status of MLflow's CANCELLED (a
# request cancelled, by a proxy or the server).
PASSING_HTTP = (408, 409, 429, 499)
# The port of an http(s) address that names none.
DEFAULT_PORTS = {"http": 80, "https": 443}
# MLflow's log_batch takes 1000 metrics and 100 parameters at most.
BATCH, PARAMS_BATCH = 1000, 100
# How long a start waits for the sender of an earlier start to let go of tracker.json, and how
# long a holder of its lease may show no sign of life before it is judged gone (taken over).
LOCK_WAIT = 60.0
TRACKER_LEASE = ".tracker.lease"  # RUN_DIR/.tracker.lease: the lease on tracker.json, across nodes
# How long a start that spells its MLflow server anew waits for the names of the servers in
# tracker.json to resolve (find_entry): a name that has not resolved by then is another server.
RESOLVE_SECONDS = 3.0
ROOT = Path(__file__).resolve().parents[2]  # (the folder that holds ddpkit/, for the sender's import)

# The scalars of an epoch's record, by the tag TensorBoard shows them under (each of the
# evaluation's metrics is test_<name> in the record, test/<name> here).
EPOCH_SCALARS = (("train/loss", "train_loss"), ("train/lr", "lr"), ("speed/images_per_s", "images_per_s"),
                 ("speed/epoch_s", "epoch_s"), ("memory/peak_rss_mb", "peak_rss_mb"), ("gpu/memory_gb", "gpu_memory_gb"),
                 ("time/seconds_to_best", "seconds_to_best"), ("gpu/utilization_percent", "gpu_utilization"))


def epoch_scalars(record: dict) -> dict[str, float]:
    """An epoch record's scalars by tag: what TensorBoard and the tracker get of it."""
    tests = {f"test/{key[5:]}": key for key in record if key.startswith("test_") and key != "test_images"}
    return {tag: float(record[key]) for tag, key in (*EPOCH_SCALARS[:1], *tests.items(), *EPOCH_SCALARS[1:])
            if key in record}


@dataclasses.dataclass(frozen=True)
class Start:
    """What the tracker records of each start of the run."""
    job: str          # the Slurm job's id, "" outside Slurm
    requeues: int     # how often Slurm requeued the job before this start
    attempt: str      # this start's attempt in the job, out of how many it may make
    world_size: int
    step: int         # the step it starts from
    at: str
    changed: str = ""  # the options it changed (--allow-changes), "" for none

    def text(self) -> str:
        job = f"job {self.job}{f' (requeued {self.requeues}x)' if self.requeues else ''}, " if self.job else ""
        changed = f", changed: {self.changed}" if self.changed else ""
        return f"{job}attempt {self.attempt}, world size {self.world_size}, from step {self.step}{changed}, at {self.at}"


def server_key(uri: str) -> str:
    """An MLflow server's address as one spelling: the scheme and host in lower case, no default
    port, no user or password, no trailing /."""
    uri = uri.strip()
    try:
        parts = urlsplit(uri)
        port = parts.port
    except ValueError:  # (a port out of range, a [ without its ]: MLflow names them itself)
        return uri.rstrip("/") or uri
    if parts.scheme.lower() not in ("http", "https"):
        return uri.rstrip("/") or uri
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    port = "" if port in (None, DEFAULT_PORTS[parts.scheme.lower()]) else f":{port}"
    query = f"?{parts.query}" if parts.query else ""
    return f"{parts.scheme.lower()}://{host}{port}{parts.path.rstrip('/')}{query}"


def entry_name(tracker: str) -> str:
    """The tracker's entry in tracker.json: a run on another MLflow server is another run."""
    return f"mlflow {server_key(os.environ.get('MLFLOW_TRACKING_URI', ''))}".strip() if tracker == "mlflow" else tracker


def server_parts(key: str) -> tuple[str, tuple[str, int, str]] | None:
    """The host of an http(s) server's entry, and (scheme, port, path), which another spelling of
    it shares; None for another store, or an address that does not parse (a port out of range,
    stored by a start that MLflow then refused)."""
    try:
        parts = urlsplit(key.removeprefix("mlflow "))
        if not key.startswith("mlflow ") or parts.scheme not in ("http", "https") or not parts.hostname:
            return None
        return parts.hostname, (parts.scheme, parts.port or DEFAULT_PORTS[parts.scheme], parts.path)
    except ValueError:
        return None


def resolve(hosts: set[str], port: int, seconds: float) -> dict[str, set[str]]:
    """The addresses each host name resolves to, looked up side by side and waited for `seconds`
    in all: a name that does not resolve by then has none (getaddrinfo has no time limit of its
    own, and a stale name would cost the resolver's time-outs before training)."""
    found: dict[str, set[str]] = {}

    def look_up(host: str) -> None:
        with contextlib.suppress(OSError, ValueError):  # (UnicodeError is a ValueError)
            found[host] = {info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}

    threads = [threading.Thread(target=look_up, args=(host,), daemon=True) for host in hosts]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + seconds
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return dict(found)  # (a copy: a lookup that has not ended may still add to it)


def find_entry(path: Path, name: str) -> str:
    """The entry of tracker.json for the tracker named `name` (entry_name): an MLflow server
    spelled with another host name or address that resolves to the same address, with the same
    scheme, port and path, is the same server, and keeps the entry of its first spelling. Only a
    new spelling looks names up, only those of the entries it could be, RESOLVE_SECONDS at most;
    an entry that cannot be matched is another server's."""
    try:
        every = json.loads(path.read_text())
    except (OSError, ValueError):
        return name
    mine = server_parts(name)
    if not isinstance(every, dict) or name in every or mine is None:
        return name
    host, where = mine
    stored = {key: parts[0] for key in every if (parts := server_parts(key)) and parts[1] == where}
    if not stored:
        return name
    found = resolve({host, *stored.values()}, where[1], RESOLVE_SECONDS)
    return next((key for key, other in stored.items() if found.get(host, set()) & found.get(other, set())), name)


# What each field of an entry holds (a field missing is one not written yet).
ENTRY_FIELDS = {"run_id": str, "name": str, "step": int, "final": int, "params_sent": bool, "starts_sent": int,
                "starts": list, "earlier": list}


def entry_problem(found) -> str:
    """What makes `found` no entry of tracker.json, or "" (a hand edit, or another version's)."""
    if not isinstance(found, dict):
        return f"a {type(found).__name__}, not an object"
    for field, kind in ENTRY_FIELDS.items():
        value = found.get(field, kind())
        if not isinstance(value, kind) or (kind is int and (isinstance(value, bool) or value < 0)):
            return f"{field} is {value!r}"
    for start in found.get("starts", []):
        fields = {f.name: f.type for f in dataclasses.fields(Start)}
        if not isinstance(start, dict) or set(start) - set(fields) or set(fields) - set(start) - {"changed"} or not all(
                isinstance(value, fields[key]) and not isinstance(value, bool) for key, value in start.items()):
            return f"a start is {start!r}"
    if not all(isinstance(run_id, str) for run_id in found.get("earlier", [])):
        return f"earlier is {found['earlier']!r}"
    if found.get("starts_sent", 0) > len(found.get("starts", [])):
        return f"starts_sent is {found['starts_sent']} of {len(found.get('starts', []))} starts"
    return ""


def read_entry(path: Path, entry: str) -> dict:
    """The entry, or {} where it is missing; one of the wrong shape is dropped with a line (the
    tracker then gets a new run, with every epoch of metrics.jsonl)."""
    try:
        every = json.loads(path.read_text())
    except (OSError, ValueError):
        every = {}
    found = every.get(entry, {}) if isinstance(every, dict) else {}
    problem = entry_problem(found)
    if problem:
        print(f"warning: dropping the entry {entry!r} of {path}, which is not a whole entry ({problem[:200]}); the "
              "tracker gets a new run, with every epoch of metrics.jsonl", file=sys.stderr, flush=True)
        return {}
    return found


@contextlib.contextmanager
def entry_lock(path: Path, wait: float, on_lost: Callable[[], object] | None = None):
    """Hold tracker.json (`path`) for its writer, waiting `wait` seconds at most: a flock on
    RUN_DIR/.tracker.lock (on one node) and the lease RUN_DIR/.tracker.lease (across nodes,
    ddpkit.files.Lease; a holder whose process ended on this host, or that has not beaten
    for LOCK_WAIT seconds, is taken over). A file system without locks, or a wait that runs
    out, goes on without them (said once). `on_lost`: what the holder does if its lease is
    taken from it, judged gone while it lived."""
    lock, lease, deadline = None, None, time.monotonic() + wait
    try:
        lock = open(path.with_name(".tracker.lock"), "a")
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError from None
                time.sleep(0.2)
            except OSError as err:
                if err.errno not in NO_LOCKS:
                    raise
                break  # (no locks on this file system: the lease alone)
        lease = Lease(path.with_name(TRACKER_LEASE), stale_after=LOCK_WAIT, on_lost=on_lost)
        while lease.attempt() is not None:
            if time.monotonic() > deadline:
                raise TimeoutError
            time.sleep(0.2)
    except TimeoutError:
        lease = None
        print(f"warning: the tracker's sender of an earlier start still holds {path}; this start goes on "
              "without waiting for it", file=sys.stderr, flush=True)
    except OSError:  # (a folder that refuses the lease: a lone start needs none)
        lease = None
    try:
        yield
    finally:
        if lease:
            lease.release()
        if lock:
            lock.close()


def write_entry(path: Path, entry: str, state: dict) -> None:
    """Replace the entry in tracker.json."""
    try:
        every = json.loads(path.read_text())
    except (OSError, ValueError):
        every = {}
    every = every if isinstance(every, dict) else {}
    every[entry] = state
    # (the sender of an earlier start may still write it when a new start clears the run's
    # directory of unfinished saves: its temporary is not one of theirs)
    replace_json(path, every, indent=1, suffix=".")


# ----------------------------------------------------------------------------- rank 0's side

class Tracker:
    """Rank 0's tracker for one start of the run: what RunLogger logs goes to it too, and from
    it to the sender, at each epoch and at the end of the start."""

    def __init__(self, tracker: str, run_dir: Path, *, start: Start | None, hparams: dict, identity: dict[str, str]):
        """`start`: this start, to record on the tracker's run (None: a finished run started again,
        which only sends what the tracker may still lack)."""
        self.kind, self.run_dir, self.hparams, self.identity = tracker, run_dir, hparams, identity
        self.path = Path(JobPaths(str(run_dir)).tracker)
        with entry_lock(self.path, LOCK_WAIT):
            self.entry = find_entry(self.path, entry_name(tracker))
            state = read_entry(self.path, self.entry)
            if start and start.changed and start.step < state.get("step", 0):
                state = self.new_timeline(state, start.step)
            state.setdefault("starts", [])
            if start:
                state["starts"].append(dataclasses.asdict(start))
            write_entry(self.path, self.entry, state)  # (a disk that refuses it stops the start, as metrics.jsonl would)
        self.has_up_to = state.get("step", 0)  # every point at or before it went to the tracker before this start
        self.final_sent = state.get("final", -1)  # the step of the final figures the tracker has (-1: none)
        self.points: list[list] = []  # [tag, value, step, milliseconds since 1970, whether an epoch's]
        self.finished, self.final_step, self.sender, self.sender_named = False, -1, None, False

    def new_timeline(self, state: dict, step: int) -> dict:
        """The entry of a new tracker run, for a start that goes back to `step` with changed
        options: the tracker's run keeps the steps after it as they were first trained, and the
        new one gets the epochs up to `step` from metrics.jsonl, then what this start trains."""
        name, earlier = f"{self.run_dir.name} from step {step}", [*state.get("earlier", []), state.get("run_id", "")]
        self.identity = {**self.identity, "earlier_run": f"{earlier[-1]} (its steps after {step}: other options)"}
        print(f"{TRACKERS[self.kind].name}: a new run, {name!r}, for the steps from {step} on with changed options; "
              f"the run {earlier[-1]} keeps its steps after {step} as they were first trained", flush=True)
        return {"name": name, "earlier": earlier, "starts": state.get("starts", [])}

    def begin(self, records: list[dict]) -> None:
        """Start the sender, with the epochs of metrics.jsonl (`records`) that the tracker lacks."""
        for record in records:
            self.add_epoch(record)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        try:
            self.sender = subprocess.Popen([sys.executable, "-m", "ddpkit.run.trackers", self.kind, str(self.run_dir), self.entry],
                                           stdin=subprocess.PIPE, text=True, env=env, start_new_session=True)
        except OSError as err:
            print(f"warning: cannot start the tracker's sender ({err.strerror}); training goes on, and the tracker gets "
                  "this start's epochs at the run's next start (from metrics.jsonl)", file=sys.stderr, flush=True)
            return
        self.hand_over({"hparams": self.hparams, "identity": self.identity})

    def point(self, key: str, value: float, step: int, *, at_ms: int = 0, epoch: bool = False) -> None:
        if step > self.has_up_to:
            self.points.append([key, float(value), step, at_ms or int(time.time() * 1000), epoch])

    def add_epoch(self, record: dict) -> None:
        """The record's scalars, stamped with its own time (so that a point sent twice is the same
        point: MLflow keeps one of each step, time and value)."""
        at_ms = int(record["time"] * 1000) if isinstance(record.get("time"), (int, float)) else 0
        for key, value in epoch_scalars(record).items():
            self.point(key, value, record["step"], at_ms=at_ms, epoch=True)

    def epoch(self, record: dict) -> None:
        self.add_epoch(record)
        self.hand_over({})

    def finish(self, final: dict, step: int) -> None:
        """The final figures at the last step, which the last epoch's share: sent unless the
        tracker has them already, whatever step it has."""
        if step != self.final_sent:
            at_ms = int(time.time() * 1000)
            self.points.extend([f"final/{name}", float(value), step, at_ms, True] for name, value in final.items())
        self.finished, self.final_step = True, step

    def hand_over(self, message: dict) -> None:
        """Pass the points gathered so far, with `message`, to the sender (a line on its stdin,
        which a thread of its own reads at once: this never waits on the tracker)."""
        if self.sender is None or self.sender.stdin.closed:
            return
        if self.sender.poll() is not None and not self.sender_named:
            self.sender_named = True
            print(f"warning: the tracker's sender ended (exit {self.sender.returncode}); training goes on, and the "
                  "tracker gets this start's epochs at the run's next start (from metrics.jsonl)", file=sys.stderr, flush=True)
        try:
            self.sender.stdin.write(json.dumps({**message, "points": self.points}) + "\n")
            self.sender.stdin.flush()
        except OSError:  # the sender has ended (it said why): the next start sends the epochs
            with contextlib.suppress(OSError):
                self.sender.stdin.close()
        self.points = []

    def close(self, code: int = 0) -> None:
        """The end of this start, which exits with `code`: wait up to FLUSH_SECONDS for the sender
        to hand the tracker what is left (once; a second call does nothing)."""
        if self.sender is None or self.sender.stdin.closed:
            return
        self.hand_over({"finished": self.finished, "final": self.final_step, "code": code})
        with contextlib.suppress(OSError):
            self.sender.stdin.close()
        try:
            self.sender.wait(FLUSH_SECONDS)
        except subprocess.TimeoutExpired:
            self.sender.kill()
            print(f"warning: the tracker {TRACKERS[self.kind].name} has not taken all of this start's points within "
                  f"{FLUSH_SECONDS:g} s; the epochs among them go to it at the run's next start (from metrics.jsonl)",
                  file=sys.stderr, flush=True)


class NoTracker:
    """What RunLogger logs to when no --tracker is asked for."""

    def begin(self, records: list[dict]) -> None: ...
    def point(self, key: str, value: float, step: int) -> None: ...
    def epoch(self, record: dict) -> None: ...
    def finish(self, final: dict, step: int) -> None: ...
    def close(self, code: int = 0) -> None: ...


# ----------------------------------------------------------------------------- the trackers

class MLflow:
    """A run in MLflow, where MLFLOW_TRACKING_URI points (a server or a database; a file store
    only with MLFLOW_ALLOW_FILE_STORE=true: options.tracker_problem), in the experiment
    MLFLOW_EXPERIMENT_ID or MLFLOW_EXPERIMENT_NAME names (created if missing), else MLflow's
    Default."""
    name = "MLflow"

    @staticmethod
    def lasting(err: Exception) -> bool:
        """Whether MLflow refused the request (HTTP 4xx, or MLflow's own check: a store it
        refuses, a password, a missing experiment), which trying again does not mend; the
        connection errors, time-outs and 5xx of an outage pass."""
        from mlflow.exceptions import MlflowException
        return isinstance(err, MlflowException) and 400 <= err.get_http_status_code() < 500 and \
            err.get_http_status_code() not in PASSING_HTTP

    def __init__(self, run_dir: Path):
        for variable, value in MLFLOW_DEFAULTS.items():
            os.environ.setdefault(variable, value)
        import mlflow
        from mlflow.entities import Metric, Param, RunTag
        from mlflow.tracking import MlflowClient
        self.Metric, self.Param, self.RunTag = Metric, Param, RunTag
        self.where = mlflow.get_tracking_uri()
        self.client = MlflowClient(self.where)
        self.experiment = ""

    def experiment_id(self) -> str:
        if os.environ.get("MLFLOW_EXPERIMENT_ID"):
            return os.environ["MLFLOW_EXPERIMENT_ID"]
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "")
        if not name:
            return "0"  # (MLflow's Default)
        found = self.client.get_experiment_by_name(name)
        if found:
            return found.experiment_id
        try:
            return self.client.create_experiment(name)
        except Exception:  # another run (an array task) created it first
            return self.client.get_experiment_by_name(name).experiment_id

    def open(self, run_id: str, run_name: str, tags: dict[str, str]) -> str:
        if run_id:
            self.experiment = self.client.get_run(run_id).info.experiment_id
            self.client.update_run(run_id, status="RUNNING")
            return run_id
        self.experiment = self.experiment_id()
        return self.client.create_run(self.experiment, run_name=run_name, tags=tags).info.run_id

    def link(self, run_id: str) -> str:
        if self.where.startswith(("http://", "https://")):
            return f"{self.where.rstrip('/')}/#/experiments/{self.experiment}/runs/{run_id}"
        return f"run {run_id} in {self.where}"

    def send(self, run_id: str, points: list[list], params: dict, tags: dict[str, str]) -> None:
        params = [self.Param(k, str(v)) for k, v in params.items()]
        for first in range(0, max(len(params), 1), PARAMS_BATCH):
            self.client.log_batch(run_id, params=params[first:first + PARAMS_BATCH])
        self.client.log_batch(run_id, metrics=[self.Metric(key, value, at_ms, step) for key, value, step, at_ms, _ in points],
                              tags=[self.RunTag(k, v) for k, v in tags.items()])

    def end(self, run_id: str, finished: bool, code: int) -> None:
        """The start's end on the run: FINISHED, SCHEDULED (stopped, to be continued) or FAILED."""
        self.client.set_terminated(run_id, "FINISHED" if finished else "SCHEDULED" if code == EXIT_STOPPED else "FAILED")

    def close(self) -> None: ...


class WandB:
    """A run in Weights & Biases, as its own settings say (WANDB_PROJECT, WANDB_ENTITY,
    WANDB_MODE=offline, ...), its local files in RUN_DIR/wandb."""
    name = "W&B"
    where = ""

    @staticmethod
    def lasting(err: Exception) -> bool:
        """Whether W&B refused the run (an API key, a project or entity it refuses): its outages
        are CommErrors."""
        from wandb.errors import AuthenticationError, UsageError
        return isinstance(err, (AuthenticationError, UsageError))

    def __init__(self, run_dir: Path):
        import wandb
        from wandb.sdk.lib import runid
        self.wandb, self.runid, self.dir, self.run, self.code = wandb, runid, run_dir, None, None

    def open(self, run_id: str, run_name: str, tags: dict[str, str]) -> str:
        run_id = run_id or self.runid.generate_id()
        (self.dir / "wandb").mkdir(parents=True, exist_ok=True)
        self.run = self.wandb.init(id=run_id, resume="allow", name=run_name, dir=str(self.dir),
                                   config={f"run/{k}": v for k, v in tags.items()},
                                   settings=self.wandb.Settings(console="off", silent=True, x_disable_stats=True))
        return run_id

    def link(self, run_id: str) -> str:
        if self.run.offline:
            return f"run {run_id}, offline in {self.dir / 'wandb'} (to upload: wandb sync {self.dir / 'wandb'}/offline-run-*)"
        return self.run.url or f"run {run_id}"

    def send(self, run_id: str, points: list[list], params: dict, tags: dict[str, str]) -> None:
        if params or tags:  # (the world size changes when the run goes on on another number of ranks)
            self.run.config.update({**params, **tags}, allow_val_change=True)
        by_step: dict[int, dict] = {}
        for key, value, step, _, _ in points:
            by_step.setdefault(step, {})[key] = value
        for step in sorted(by_step):  # (W&B drops a step lower than one it has)
            self.run.log(by_step[step], step=step)

    def end(self, run_id: str, finished: bool, code: int) -> None:
        if not finished and code == EXIT_STOPPED:
            self.run.mark_preempting()  # (W&B shows it as preempted, to be resumed)
        self.code = 0 if finished or code == EXIT_STOPPED else code

    def close(self) -> None:
        if self.run is not None:
            self.run.finish(exit_code=self.code)
            self.run = None


TRACKERS = {"mlflow": MLflow, "wandb": WandB}


# ----------------------------------------------------------------------------- the sender

class Sender:
    """The sender's part: what rank 0 hands over waits here until the tracker takes it."""

    def __init__(self, kind: str, run_dir: Path, entry: str):
        """`entry`: the tracker's entry in tracker.json, as rank 0 found it (find_entry)."""
        self.kind, self.run_dir = kind, run_dir
        self.path, self.entry = Path(JobPaths(str(run_dir)).tracker), entry
        self.state = read_entry(self.path, self.entry)
        self.waiting: list[list] = []
        self.hparams: dict = {}
        self.identity: dict[str, str] = {}
        self.lock, self.wake = threading.Lock(), threading.Event()
        self.closing = self.finished = self.failing = False
        self.named: set[bool] = set()  # (whether each kind of failure, passing or lasting, was named)
        self.code, self.final = 0, -1
        self.backend = None
        self.opened = ""

    def take(self, lines) -> None:
        """(its own thread) Read rank 0's lines as they come, until rank 0 closes them or dies
        (a line cut short by its death is left out)."""
        try:
            for line in lines:
                try:
                    message = json.loads(line)
                except ValueError:
                    continue
                with self.lock:
                    self.waiting.extend(message.get("points", []))
                    self.hparams = message.get("hparams", self.hparams)
                    self.identity = message.get("identity", self.identity)
                    self.finished = message.get("finished", self.finished)
                    self.final = message.get("final", self.final)
                    self.code = message.get("code", self.code)
                self.wake.set()
        finally:
            self.closing = True
            self.wake.set()

    def serve(self) -> None:
        while True:
            self.wake.wait()
            self.wake.clear()
            closing = self.closing
            self.send_waiting(closing)
            if closing:
                if self.backend is not None:
                    self.backend.close()
                return

    def send_waiting(self, closing: bool) -> None:
        state = self.state
        try:
            if self.backend is None:
                self.backend = TRACKERS[self.kind](self.run_dir)
            if not self.opened:
                self.opened = self.backend.open(state.get("run_id", ""), state.get("name", self.run_dir.name),
                                                self.identity)
                if state.get("run_id") != self.opened:
                    state["run_id"] = self.opened
                    write_entry(self.path, self.entry, state)
                print(f"{self.backend.name}: {self.backend.link(self.opened)}", flush=True)
            params = {} if state.get("params_sent") else self.hparams  # ({} for a finished run's catch-up)
            sent = state.get("starts_sent", 0)
            tags = {f"start.{sent + i + 1}": Start(**s).text() for i, s in enumerate(state["starts"][sent:])}
            if tags:
                tags["world_size"] = str(state["starts"][-1]["world_size"])
            with self.lock:  # (take() only appends: the points copied stay first until sent)
                self.waiting = keep_waiting(self.waiting)
                waiting, final = list(self.waiting), self.final  # (the final figures come with `final`)
            for first in range(0, max(len(waiting), 1), BATCH):
                chunk, rest = waiting[first:first + BATCH], waiting[first + BATCH:]
                self.backend.send(self.opened, chunk, params, tags)
                state["params_sent"] = state.get("params_sent", False) or bool(params)
                state["starts_sent"], params, tags = len(state["starts"]), {}, {}
                with self.lock:
                    del self.waiting[:len(chunk)]
                if chunk:  # the tracker has every point up to here (the rest of a step may be in the next chunk)
                    state["step"] = max(state.get("step", 0), min(chunk[-1][2], rest[0][2] - 1 if rest else chunk[-1][2]))
                write_entry(self.path, self.entry, state)
            if final >= 0 and state.get("final") != final:
                state["final"] = final
                write_entry(self.path, self.entry, state)
            if closing:
                self.backend.end(self.opened, self.finished, self.code)
            if self.failing:
                print(f"{self.label()} answers again: it has every point up to step {state.get('step', 0)}", flush=True)
            self.failing = False
        except Exception as err:
            self.failing = True
            lasting = isinstance(err, ImportError) or TRACKERS[self.kind].lasting(err)
            if lasting not in self.named:
                self.named.add(lasting)
                print(failure_line(self.label(), err, lasting), file=sys.stderr, flush=True)

    def label(self) -> str:
        where = getattr(self.backend, "where", "")
        return f"the tracker {TRACKERS[self.kind].name}" + (f" at {where}" if where else "")


def failure_line(label: str, err: Exception, lasting: bool) -> str:
    """The line that names a failing tracker: an outage, which passes by itself, or an error that
    will not (a store or a credential refused), which the user mends."""
    reason = (str(err).strip().splitlines() or [""])[0]
    # (MLflow ends its messages with the way out: the end is kept with the start)
    reason = reason if len(reason) <= 400 else f"{reason[:200]} ... {reason[-200:]}"
    if lasting:
        return (f"warning: {label} refused this run ({type(err).__name__}: {reason}), which does not pass by itself: "
                "training goes on without it; mend this and start the run again, and the tracker gets every epoch it "
                "missed (from metrics.jsonl)")
    return (f"warning: {label} failed ({type(err).__name__}: {reason}); training goes on, and it gets what it missed "
            "when it answers again")


def keep_waiting(points: list[list]) -> list[list]:
    """The points to keep waiting: every epoch's, and the newest MAX_WAITING per-step ones."""
    per_step = sum(1 for point in points if not point[4])
    if per_step <= MAX_WAITING:
        return points
    drop = per_step - MAX_WAITING
    kept = []
    for point in points:
        if drop and not point[4]:
            drop -= 1
        else:
            kept.append(point)
    return kept


def main(kind: str, run_dir: str, entry: str) -> None:
    """The sender: reads rank 0's lines on stdin, sends them, and ends once stdin closes and
    what it holds is sent (or it failed). The job's signals are rank 0's to act on: a stop
    signal reaches every process of a Slurm step, and this one must outlive rank 0's save."""
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    path = Path(JobPaths(run_dir).tracker)

    def lost() -> None:  # (two senders would send the same points twice)
        print(f"warning: a later start took over {path.with_name(TRACKER_LEASE)}, judging this tracker's sender "
              "gone; it ends, and that start sends what the tracker lacks (from metrics.jsonl)", file=sys.stderr, flush=True)
        os._exit(1)

    # (an earlier start's sender first: it ends once it has sent)
    with entry_lock(path, wait=24 * 3600.0, on_lost=lost):
        sender = Sender(kind, Path(run_dir), entry)
        threading.Thread(target=sender.take, args=(sys.stdin,), daemon=True).start()
        sender.serve()


if __name__ == "__main__":
    main(*sys.argv[1:])
