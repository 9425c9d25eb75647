"""Run logging: rank 0's stdout lines, RUN_DIR/metrics.jsonl, run.json and TensorBoard
events (scalars, pictures of test predictions and the confusion matrix, the HParams tab,
the options and environment as text), and the scalars to an experiment tracker when one is
asked for (trackers.py); a logger that does nothing on the other ranks."""

import contextlib
import dataclasses
import functools
import importlib.metadata
import json
import math
import os
import platform
import shlex
import socket
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image, ImageDraw

from ddpkit.distributed import Runtime, all_reduce
from ddpkit.files import make_folder, replace_json, replace_text
from ddpkit.launch import Launch
from ddpkit.run.trackers import NoTracker, Tracker, epoch_scalars


def peak_rss_mb(rt: Runtime) -> float:
    """The largest peak resident memory of any rank so far (Linux's VmHWM), in MB."""
    peak = 0.0
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                peak = int(line.split()[1]) / 1024
    figure = torch.tensor([peak], dtype=torch.float64, device=rt.device)
    return all_reduce(figure, "the all-reduce of the memory figures", dist.ReduceOp.MAX).item()


def gpu_figures(device: torch.device) -> dict:
    """This rank's peak GPU memory in the epoch and the GPU's utilisation (needs pynvml)."""
    if device.type != "cuda":
        return {}
    figures = {"gpu_memory_gb": torch.cuda.max_memory_allocated(device) / 1e9}
    try:
        figures["gpu_utilization"] = float(torch.cuda.utilization(device))
    except Exception:  # no NVML bindings installed: memory alone
        pass
    return figures


def view_command(log_dir: Path) -> str:
    """The command that shows these runs, to paste from where this run started: the project's
    tensorboard.sh (which prints the tunnel) when it sits beside ddpkit/, else TensorBoard
    itself. It names this run's interpreter, as the continue lines do, unless tensorboard.sh
    finds it by itself (the project's .venv): no environment need be active."""
    script = Path(__file__).resolve().parents[2] / "tensorboard.sh"
    if not script.exists():
        return f"{shlex.quote(sys.executable)} -m tensorboard.main --logdir {shlex.quote(str(log_dir))}"
    script = script.resolve()  # (the project's, where a job's copy of the code links to it)
    shown = os.path.relpath(script)
    shown = str(script) if shown.startswith("..") else os.path.join(".", shown)
    found = Path(sys.prefix).resolve() == (script.parent / ".venv").resolve()
    python = "" if found else f"PYTHON={shlex.quote(sys.executable)} "
    return f"{python}{shlex.quote(shown)} --logdir {shlex.quote(str(log_dir))}"


def usable_cpus() -> int:
    """CPUs this process may run on (Slurm's binding, cgroups, taskset), not the node's count."""
    return len(os.sched_getaffinity(0))


def installed_version(package: str) -> str:
    """The package's installed version, without importing it (torchvision takes seconds to import)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def describe_environment(rt: Runtime, launch: Launch, hosts: list[str]) -> dict:
    env = {
        "python": platform.python_version(), "torch": torch.__version__, "torchvision": installed_version("torchvision"),
        "launcher": launch.source, "world_size": rt.world_size, "backend": rt.backend, "device": str(rt.device),
        "hosts": sorted(set(hosts)), "master": f"{launch.master_addr}:{launch.master_port}" if rt.world_size > 1 else "",
        "slurm_job_id": launch.job_id, "cpu_threads_per_rank": torch.get_num_threads(), "cpus_rank_0": usable_cpus(),
        "gloo_socket_ifname": os.environ.get("GLOO_SOCKET_IFNAME", ""), "gpus_granted": launch.gpus_granted,
        "attempt": launch.attempt, "slurm_requeues": launch.requeues,
        "inductor_cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR", ""),  # (--compile's; "": torch's default)
    }
    if rt.device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(rt.device)
    return env


def as_picture(image: torch.Tensor) -> Image.Image:
    """uint8 [C, H, W] (C 1 or 3) as a PIL image."""
    return Image.fromarray(image[0].numpy() if image.shape[0] == 1 else image.permute(1, 2, 0).numpy())


def labelled_grid(images: torch.Tensor, pred: torch.Tensor, true: torch.Tensor, per_row: int = 8) -> np.ndarray:
    """Test images (uint8 [k, C, H, W]), each 56 pixels wide and captioned 'prediction/truth'
    as class indices (green if right, red if wrong; the TEXT tab's "classes" names them)."""
    cell, caption = 56, 14
    rows = max(1, math.ceil(len(images) / per_row))
    sheet = Image.new("RGB", (per_row * cell, rows * (cell + caption)), "white")
    draw = ImageDraw.Draw(sheet)
    for i, (image, p, t) in enumerate(zip(images, pred.tolist(), true.tolist(), strict=True)):
        x, y = (i % per_row) * cell, (i // per_row) * (cell + caption)
        sheet.paste(as_picture(image).resize((cell, cell)), (x, y))
        draw.text((x + 4, y + cell + 1), f"{p}/{t}", fill=(0, 140, 0) if p == t else (220, 0, 0))
    return np.asarray(sheet)


def confusion_picture(confusion: torch.Tensor, classes: tuple[str, ...]) -> np.ndarray:
    """The confusion matrix as a heat map with counts: rows true class (named), columns
    prediction (numbered). Cells shrink for many classes; counts show while they fit."""
    n = len(classes)
    cell = 40 if n <= 12 else max(8, 480 // n)
    names = [name[:16] for name in classes]
    left, top = 12 + 6 * max(len(f"{i} {name}") for i, name in enumerate(names)), 36
    sheet = Image.new("RGB", (left + n * cell + 4, top + n * cell + 4), "white")
    draw = ImageDraw.Draw(sheet)
    draw.text((2, 2), "rows: true class, columns: prediction", fill="black")
    share = confusion.double() / confusion.sum(1, keepdim=True).clamp(min=1)
    for t in range(n):
        draw.text((4, top + t * cell + (cell - 10) // 2), f"{t} {names[t]}", fill="black")
        if cell >= 20:
            draw.text((left + t * cell + cell // 2 - 3 * len(str(t)), top - 14), str(t), fill="black")
        for p in range(n):
            shade = int(255 * (1 - share[t, p].item()))
            box = (left + p * cell, top + t * cell, left + (p + 1) * cell - 1, top + (t + 1) * cell - 1)
            draw.rectangle(box, fill=(shade, shade, 255) if t == p else (255, shade, shade))
            if cell >= 28:
                draw.text((box[0] + 6, box[1] + cell // 2 - 6), str(int(confusion[t, p])),
                          fill="white" if shade < 128 else "black")
    return np.asarray(sheet)


# The HParams tab: the options that shape training, and the metrics to compare runs by,
# with their scalar tags (so a run still going shows its latest values). TensorBoard takes
# the first experiment it finds in a log directory; every run declares one.
HPARAM_METRICS = {"test/accuracy": "test accuracy", "test/loss": "test loss", "train/loss": "train loss",
                  "time/seconds_to_best": "seconds to the best epoch"}


# The HParams tab lists these first (a sweep lists what it varies first instead).
SHOWN_FIRST = ("lr", "global_batch", "batch_size", "weight_decay", "epochs")


@dataclasses.dataclass(frozen=True)
class HParams:
    """What the HParams tab shows of a run."""
    values: dict                        # name -> int, float, str or bool
    first: tuple[str, ...] = ()         # marked as differing: the tab shows them first (a sweep: what it varies)
    choices: dict = dataclasses.field(default_factory=dict)   # name -> the values a str may take

    @classmethod
    def of_run(cls, recipe: object, *, batch_size: int, world_size: int, amp: bool,
               first: tuple[str, ...] = SHOWN_FIRST) -> "HParams":
        """A run's: the recipe's options (a dataclass), each rank's and the global batch, the
        world size and --amp; a str option's choices as the recipe's field declares them."""
        values = {**dataclasses.asdict(recipe), "batch_size": batch_size, "global_batch": batch_size * world_size,
                  "world_size": world_size, "amp": amp}
        choices = {f.name: f.metadata["choices"] for f in dataclasses.fields(recipe) if "choices" in f.metadata}
        return cls(values, first, choices)


class Examples:
    """The few test images an evaluation shows in TensorBoard (rank 0's, `keep` of each kind):
    the first ones with their predictions, and the first misclassified ones. Another rank
    keeps none (keep=0)."""

    def __init__(self, keep: int):
        self.keep, self.first, self.wrong = keep, [], []  # (indices, predictions) pairs

    def add(self, indices: torch.Tensor, predictions: torch.Tensor, labels: torch.Tensor) -> None:
        if self.keep and not self.first:
            self.first.append((indices[:self.keep], predictions[:self.keep]))
        if sum(len(i) for i, _ in self.wrong) < self.keep:
            miss = predictions != labels
            self.wrong.append((indices[miss], predictions[miss]))

    def shown(self, test_set) -> dict:
        """{name: (uint8 images, predictions, true classes)}, as RunLogger.evaluation draws them."""
        examples = {}
        for name, kept in (("predictions", self.first), ("misclassified", self.wrong)):
            if kept:
                chosen = torch.cat([i for i, _ in kept])[:self.keep].cpu()
                predicted = torch.cat([p for _, p in kept])[:self.keep].cpu()
                examples[name] = (test_set.pictures(chosen), predicted, test_set.labels[chosen].cpu())
        return examples


@functools.cache
def tensorboard_api() -> SimpleNamespace:
    """TensorBoard's writer and protocol buffers, imported on first use: only the rank that
    logs pays for them, and not before it writes."""
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2
    from torch.utils.tensorboard import SummaryWriter
    return SimpleNamespace(Summary=Summary, SummaryMetadata=SummaryMetadata, api_pb2=api_pb2, metadata=metadata,
                           plugin_data_pb2=plugin_data_pb2, SummaryWriter=SummaryWriter)


def hparams_summary(tag: str, **content) -> object:
    tb = tensorboard_api()
    Summary, SummaryMetadata, metadata = tb.Summary, tb.SummaryMetadata, tb.metadata
    data = tb.plugin_data_pb2.HParamsPluginData(version=metadata.PLUGIN_DATA_VERSION, **content)
    plugin = SummaryMetadata.PluginData(plugin_name=metadata.PLUGIN_NAME, content=data.SerializeToString())
    return Summary(value=[Summary.Value(tag=tag, metadata=SummaryMetadata(plugin_data=plugin))])


def declare_hparams(log_dir: Path, hparams: HParams) -> None:
    """Write the experiment (which options and metrics the tab shows) once per log directory."""
    tb = tensorboard_api()
    api_pb2, metadata = tb.api_pb2, tb.metadata
    types = {float: api_pb2.DATA_TYPE_FLOAT64, int: api_pb2.DATA_TYPE_FLOAT64, str: api_pb2.DATA_TYPE_STRING,
             bool: api_pb2.DATA_TYPE_BOOL}
    infos = [api_pb2.HParamInfo(name=name, type=types[type(value)], differs=name in hparams.first)
             for name, value in hparams.values.items()]
    for info in infos:
        info.domain_discrete.extend(hparams.choices.get(info.name, ()))
    metrics = [api_pb2.MetricInfo(name=api_pb2.MetricName(tag=tag), display_name=name) for tag, name in HPARAM_METRICS.items()]
    try:
        make_folder(log_dir)  # (the runs of a sweep, on several nodes at once)
        os.close(os.open(log_dir / ".hparams-declared", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        quiet_writer_threads()
        with tb.SummaryWriter(str(log_dir), filename_suffix=".hparams") as writer:
            writer.file_writer.add_summary(hparams_summary(metadata.EXPERIMENT_TAG, experiment=api_pb2.Experiment(
                hparam_infos=infos, metric_infos=metrics)))
            writer.flush()  # (raises what failed in its writer thread, which closing would not)
    except FileExistsError:
        return  # another run of this directory (an array task) did it
    except OSError as err:
        # The parent of a --run-dir may be a directory this user cannot write (a project's
        # shared folder), or its event file's writes fail (shared storage): a run directory
        # that can be written still trains, and without the declaration TensorBoard infers
        # the tab's columns from the runs it finds.
        print(f"warning: cannot declare the HParams experiment in {log_dir} ({err.strerror}); training goes on, "
              "and TensorBoard's HParams tab infers its columns from the runs", file=sys.stderr, flush=True)


@functools.cache
def quiet_writer_threads() -> None:
    """TensorBoard's writer thread re-raises the error that ends it, which threading prints as
    a traceback; the writer raises it again at its next call (EventFile's, which says it in
    one line). Keep the thread's traceback off stderr."""
    from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread
    previous = threading.excepthook

    def excepthook(args) -> None:
        if not (isinstance(args.thread, _AsyncWriterThread) and issubclass(args.exc_type, OSError)):
            previous(args)
    threading.excepthook = excepthook


class EventFile:
    """Rank 0's TensorBoard writer in the run directory, which never ends the run. TensorBoard
    writes each event in a thread of its own, which a failed write (EIO, ESTALE, a full disk:
    shared storage) ends; the writer raises that error at its next call (torch 2.14,
    tensorboard 2.21), and would end the run. Here the first one is one warning that names
    the file and what still holds the run's record, and the writer is left alone from then on."""

    CALLS = frozenset(("add_scalar", "add_text", "add_image", "flush"))  # SummaryWriter's, as RunLogger calls them

    def __init__(self, run_dir: Path, purge_step: int):
        quiet_writer_threads()
        self.run_dir, self.writer = run_dir, None
        try:
            self.writer = tensorboard_api().SummaryWriter(str(run_dir), purge_step=purge_step)
        except OSError as err:
            self.give_up(err)

    def __getattr__(self, name: str):
        if name not in self.CALLS:
            raise AttributeError(name)
        return functools.partial(self.call, name)

    def add_summary(self, summary: object) -> None:
        self.call("add_summary", summary)

    def call(self, name: str, *args, **kwargs) -> None:
        if self.writer is None:
            return
        try:
            getattr(self.writer.file_writer if name == "add_summary" else self.writer, name)(*args, **kwargs)
        except OSError as err:
            self.writer = None  # (its thread is gone: closing it would write nothing)
            self.give_up(err)

    def give_up(self, err: OSError) -> None:
        print(f"warning: cannot write the TensorBoard event file {self.event_file(err)} ({err.strerror}): TensorBoard "
              f"shows no more of this run; {self.run_dir / 'metrics.jsonl'} and the checkpoints in "
              f"{self.run_dir / 'checkpoints'} still hold its record, and training goes on", file=sys.stderr, flush=True)

    def event_file(self, err: OSError) -> str:
        """The file that failed: the error's, else this process's newest event file in the run directory."""
        if err.filename:
            return os.fsdecode(err.filename)
        with contextlib.suppress(OSError):
            ours = sorted(self.run_dir.glob(f"events.out.tfevents.*.{socket.gethostname()}.{os.getpid()}.*"))
            if ours:
                return str(ours[-1])
        return f"in {self.run_dir}"

    def close(self) -> None:
        self.flush()  # (raises what failed in its writer thread, which closing would not)
        if self.writer is not None:
            self.writer.close()


# What a resume reads of each record: its step, and the epoch's seconds and accuracy (the
# training time so far, the best epoch). A line without them is not one of the run's records.
RECORD_FIELDS = {"step": int, "epoch_s": (int, float), "test_accuracy": (int, float)}


def is_record(record: object) -> bool:
    return isinstance(record, dict) and all(isinstance(record.get(name), kind) for name, kind in RECORD_FIELDS.items())


def read_metrics_tolerantly(path: Path) -> list[dict]:
    """metrics.jsonl's records, without a line that a crash cut short while it was being
    appended (and any other line that is not a record: hand-edited, another tool's), each
    dropped with a warning."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return []
    records = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if is_record(record):
            records.append(record)
        else:
            print(f"warning: dropping line {number} of {path}, which is not a whole record: {line[:80]!r}",
                  file=sys.stderr, flush=True)
    return records


def final_figures(record: dict) -> dict:
    """The run's final figures (final/* in TensorBoard and the tracker): its last epoch's (those
    a hand-edited metrics.jsonl line still holds)."""
    return {name: record[name] for name in ("test_accuracy", "test_loss", "train_loss") if name in record}


def markdown_table(d: dict) -> str:
    return "| key | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in d.items())


@dataclasses.dataclass(frozen=True)
class LogPlan:
    """What rank 0's log records of this start of the run, and how often it speaks."""
    options: dict            # the recipe's and the run's options: run.json, the config line and text
    hparams: HParams
    environment: dict        # describe_environment's: run.json, the environment line and text
    classes: tuple[str, ...]  # the data's classes, by index: the TEXT tab and the confusion matrix name them
    resumed_step: int        # the step this start goes on from (0: from the start); what came after it is dropped
    log_every: int           # --log-every: the batch loss every N steps
    progress_every: float    # --progress-every: a progress line every N seconds when stdout is not a terminal
    note: str = ""           # a line printed and kept in the TEXT tab's "log" (what --allow-changes let differ)


class RunLogger:
    """Rank 0's output: stdout lines, RUN_DIR/metrics.jsonl and TensorBoard events."""

    def __init__(self, run_dir: Path, plan: LogPlan, *, tracker: Tracker | NoTracker):
        options, hparams, environment, classes = plan.options, plan.hparams, plan.environment, plan.classes
        resumed_step, note = plan.resumed_step, plan.note
        # For sweep.py summary and anyone reading the directory: what this attempt runs with;
        # replaced whole, so that a reader never meets it empty or half written.
        replace_json(run_dir / "run.json", {"config": options, "environment": environment})
        self.log_every, self.progress_every, self.classes = plan.log_every, plan.progress_every, classes
        self.last_progress = time.monotonic()
        # The run goes on from resumed_step (0: from the start) and repeats what came after
        # it: drop those lines, and have TensorBoard hide those steps, so nothing is doubled
        # or rewound.
        metrics_path = run_dir / "metrics.jsonl"
        records = [r for r in read_metrics_tolerantly(metrics_path) if r["step"] <= resumed_step]
        replace_text(metrics_path, "".join(json.dumps(r) + "\n" for r in records))  # a kill loses no line
        # Training time so far and when the best epoch came, over every attempt of the run.
        self.elapsed, self.best, self.to_best = 0.0, -1.0, 0.0
        for record in records:
            self.add_epoch_time(record)
        declare_hparams(run_dir.parent, hparams)
        tb = tensorboard_api()
        self.writer = EventFile(run_dir, purge_step=resumed_step + 1)
        start = tb.plugin_data_pb2.SessionStartInfo(start_time_secs=time.time())
        for name, value in hparams.values.items():
            kind = "bool_value" if isinstance(value, bool) else "string_value" if isinstance(value, str) else "number_value"
            setattr(start.hparams[name], kind, value)
        self.writer.add_summary(hparams_summary(tb.metadata.SESSION_START_INFO_TAG, session_start_info=start))
        self.metrics = open(metrics_path, "a")
        self.tracker = tracker
        self.tracker.begin(records)  # (the epochs it lacks among them)
        self.show_progress = sys.stdout.isatty()
        # At the step it starts from: a resumed run's attempts each keep their own entry.
        self.writer.add_text("config", markdown_table(options), resumed_step)
        self.writer.add_text("environment", markdown_table(environment), resumed_step)
        self.writer.add_text("classes", markdown_table(dict(enumerate(classes))), resumed_step)
        if note:
            self.writer.add_text("log", note, resumed_step)
            print(note, flush=True)
        self.writer.flush()
        print(f"config: {json.dumps(options)}")
        print(f"environment: {json.dumps(environment)}")
        print(f"TensorBoard logs: {run_dir}  (view: {view_command(run_dir.parent)})", flush=True)

    def step(self, step: int, loss: torch.Tensor, epoch: int, step_in_epoch: int, steps_per_epoch: int) -> None:
        """Called every step; reads the loss (a device sync) only when something is due."""
        if step % self.log_every == 0:
            self.writer.add_scalar("train/batch_loss", loss.item(), step)
            self.tracker.point("train/batch_loss", loss.item(), step)
            if self.show_progress:
                print(f"\repoch {epoch} step {step_in_epoch}/{steps_per_epoch} loss {loss.item():.4f}", end="", flush=True)
        if not self.show_progress and self.progress_every and time.monotonic() - self.last_progress >= self.progress_every:
            # In a batch job's output file, so that a long epoch does not look like a hang.
            self.last_progress = time.monotonic()
            print(f"epoch {epoch} step {step_in_epoch}/{steps_per_epoch} (step {step} in all) batch loss {loss.item():.4f}",
                  flush=True)

    def add_epoch_time(self, record: dict) -> None:
        self.elapsed += record["epoch_s"]
        if record["test_accuracy"] > self.best:
            self.best, self.to_best = record["test_accuracy"], self.elapsed
        record["seconds_to_best"] = self.to_best

    def epoch(self, record: dict, evaluation, pictures: bool) -> None:
        """The epoch's line, record and scalars (each of the evaluation's metrics as
        test/<name>); with `pictures`, the evaluation's examples ({name: (uint8 images
        [k, C, H, W], predictions, true classes)}) and its confusion matrix."""
        self.add_epoch_time(record)
        if self.show_progress:
            print("\r\033[K", end="")
        added = "".join(f"| test {name} {record[f'test_{name}']:.4f} " for name in evaluation.metrics
                        if name not in ("loss", "accuracy"))
        line = (f"epoch {record['epoch']:3d} | train loss {record['train_loss']:.4f} | test loss {record['test_loss']:.4f} "
                f"| test acc {100 * record['test_accuracy']:6.2f}% {added}| lr {record['lr']:.2e} "
                f"| {record['images_per_s']:8.0f} img/s | {record['epoch_s']:6.2f} s")
        print(line, flush=True)
        record["time"] = round(time.time(), 3)  # (when it was logged: the tracker's time of its points)
        self.metrics.write(json.dumps(record) + "\n")
        self.metrics.flush()
        step = record["step"]
        for tag, value in epoch_scalars(record).items():
            self.writer.add_scalar(tag, value, step)
        self.tracker.epoch(record)
        self.writer.add_text("log", f"`{line}`", step)
        if pictures:
            for name, (images, pred, true) in evaluation.examples.items():
                if len(images):
                    self.writer.add_image(f"test/{name}", labelled_grid(images, pred, true), step, dataformats="HWC")
            self.writer.add_image("test/confusion_matrix", confusion_picture(evaluation.confusion, self.classes), step,
                                  dataformats="HWC")
        self.writer.flush()  # per epoch, not per step: cheap and TensorBoard stays current

    def speed(self, step: int, slowest_ms: float, median_ms: float) -> None:
        """Every --log-every steps on several ranks: the slowest and the median rank's own time a
        step in the window (stragglers.py)."""
        self.writer.add_scalar("speed/slowest_rank_ms", slowest_ms, step)
        self.writer.add_scalar("speed/median_rank_ms", median_ms, step)
        self.tracker.point("speed/slowest_rank_ms", slowest_ms, step)
        self.tracker.point("speed/median_rank_ms", median_ms, step)

    def note(self, line: str, step: int) -> None:
        """A line for stdout and the TEXT tab's log."""
        print(line, flush=True)
        self.writer.add_text("log", line, step)
        self.writer.flush()

    def finish(self, final: dict, step: int) -> None:
        for name, value in final.items():
            self.writer.add_scalar(f"final/{name}", value, step)
        self.tracker.finish(final, step)
        tb = tensorboard_api()
        self.writer.add_summary(hparams_summary(tb.metadata.SESSION_END_INFO_TAG, session_end_info=(
            tb.plugin_data_pb2.SessionEndInfo(status=tb.api_pb2.STATUS_SUCCESS, end_time_secs=time.time()))))

    def close(self, code: int = 0) -> None:
        """The end of this start, which exits with `code`; with a --tracker, waits up to
        trackers.FLUSH_SECONDS for its sender (a second call closes nothing more)."""
        self.writer.close()
        self.metrics.close()
        self.tracker.close(code)


class NullLogger:
    """What ranks other than 0 log: nothing, so call sites never branch on rank."""

    def step(self, *args) -> None: ...
    def epoch(self, record: dict, evaluation, pictures: bool) -> None: ...
    def speed(self, step: int, slowest_ms: float, median_ms: float) -> None: ...
    def note(self, line: str, step: int) -> None: ...
    def finish(self, final: dict, step: int) -> None: ...
    def close(self, code: int = 0) -> None: ...
