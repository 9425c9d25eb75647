"""Options: RunOptions, the machinery's options (data directories, devices, output,
checkpoints), and the command line, built from them and from the recipe's own dataclass
(mnist_ddp.py's Recipe) in argparse groups.

Every field carries its help, and its "group" in --help, in its metadata; one marked
"hidden" is left out of --help. A recipe field marked "changeable" may differ from a
checkpoint's with --allow-changes; every other recipe field sets the course of training, so
a checkpoint resumes only a run with the same value. Options are spelt out in full: an
abbreviation (--ep 3) is an error, as it would read as another option once one is added."""

import argparse
import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from ddpkit.job.contract import RUN_NAME_RULE, default_run_name, is_run_name
from ddpkit.launch import PROG, UsageError

DATA_FEEDS = ("auto", "memory", "stream")
# --tracker NAME (trackers.py): the package to install for it.
TRACKER_PACKAGES = {"mlflow": "mlflow", "wandb": "wandb"}


def option(default, help: str, group: str, **metadata):
    return field(default=default, metadata={"help": help, "group": group, **metadata})


@dataclass(frozen=True)
class RunOptions:
    # data
    data_dir: str = option("data", "data directory, on shared storage for multi-node jobs; MNIST-like data sets go to "
                           "DATA_DIR/<Name>/raw, --dataset folder reads DATA_DIR/train/<class>/* and DATA_DIR/test/<class>/*",
                           "data")
    node_data_dir: str = option("", "node-local directory ($TMPDIR, /scratch/$USER, ...; $VARS expand on each node): the "
                                "first rank of each node copies the data there from --data-dir, and every rank reads it "
                                "from there", "data")
    data_mirror: str = option("", "base URL (http://, https:// or file://) that replaces torchvision's download mirrors",
                              "data")
    download_only: bool = option(False, "stage the data set into --data-dir and exit (run it once on a login node)", "data")
    data_feed: str = option("auto", "memory: hold each split in memory as one uint8 tensor (fastest); stream: read the "
                            "batches with a DataLoader; auto: memory when it fits", "data", choices=DATA_FEEDS)
    data_workers: int = option(2, "DataLoader worker processes per rank when the data is streamed", "data")
    # distributed
    backend: str = option("auto", "auto: nccl on CUDA, else gloo", "distributed", choices=("auto", "gloo", "nccl"))
    device: str = option("auto", "auto: cuda when available", "distributed", choices=("auto", "cpu", "cuda"))
    dist_timeout: float = option(300.0, "seconds a collective may wait for a missing rank (or the data directory's "
                                 "lock for a sign of life of its holder) before the job fails", "distributed")
    hang_after: float = option(0.0, "seconds a rank may wait on the others (in a training step or a collective) before "
                               "the ranks write their stacks to RUN_DIR/hangs and one line names the rank that holds "
                               "them up, where it is and on which host (0: a fifth of --dist-timeout, at least 10 s; "
                               "-1: never)", "distributed")
    check: bool = option(False, "check the job instead of training, in about a minute: every rank joins (within "
                         "--dist-timeout or 60 s, the shorter) and says its host, device, CPUs, GPUs, network interface "
                         "and versions; an all-reduce with a known answer; a timed 64 MB all-reduce; a timed training step "
                         "on every rank and a timed exchange between each pair of nodes, naming what is slow; for "
                         "--log-dir and --data-dir, each node's file system, how soon the others see a file written "
                         "there and whether a lock excludes across nodes. Exit 0 "
                         "(slow or not), 4 naming the ranks and hosts that never joined, 5 when a node's GPU fails the "
                         "step, 1 for another error", "distributed")
    # speed (for GPUs; they run on CPUs too, where they rarely help)
    amp: bool = option(False, "bfloat16 autocast for forward passes", "speed")
    channels_last: bool = option(False, "channels-last memory layout for convolutions", "speed")
    compile: bool = option(False, "torch.compile the model (slow first steps; needs a C++ compiler on CPUs)", "speed")
    deterministic: bool = option(False, "bit-identical GPU runs and resumes: deterministic cuDNN and cuBLAS kernels, "
                                 "torch.use_deterministic_algorithms (slower on GPUs; CPU runs at the same thread count "
                                 "are bit-identical without it)", "speed")
    profile: int = option(0, "profile N steps on every rank with torch.profiler, after a few steps of warm-up: a trace "
                          "per rank in RUN_DIR/profile/, and a table of the top operators and the share of the step "
                          "spent in communication (0: only when RUN_DIR/profile-now appears, for 10 steps)", "speed")
    # output
    log_dir: str = option("runs", "directory that holds one directory per run (shared storage)", "output")
    run_name: str = option("", "the run's name; its directory is LOG_DIR/NAME, and the same name continues that run from "
                           f"its newest checkpoint (default: {default_run_name('<SLURM_JOB_ID>')}, else a timestamp)", "output")
    run_dir: str = option("", "the run's directory as a path, instead of LOG_DIR/RUN_NAME", "output")
    log_every: int = option(50, "log the training loss to TensorBoard every N steps (and the slowest and median rank's "
                            "time a step; RUN_DIR/profile-now is looked for as often)", "output")
    progress_every: float = option(60.0, "when the output is not a terminal (batch jobs), print a progress line every N "
                                   "seconds (0: never)", "output")
    tracker: str = option("none", "also log the scalars and hyperparameters to an experiment tracker: mlflow (where "
                          "MLFLOW_TRACKING_URI points) or wandb (as its own settings say, WANDB_MODE=offline included); "
                          "one tracker run for the whole run, each step once, and a tracker that fails never stops "
                          "training (docs/trackers.md)", "output", choices=("none", *TRACKER_PACKAGES))
    image_every: int = option(1, "log test images with their predictions and a confusion matrix every N epochs (0: never)",
                              "output")
    # checkpoints and preemption
    resume: str = option("auto", "auto: continue from the newest valid checkpoint in RUN_DIR/checkpoints; never: start "
                         "afresh; or a checkpoint file", "checkpoints and preemption")
    ckpt_every: int = option(500, "checkpoint every N steps as well as at each epoch end (0: epoch ends only)",
                             "checkpoints and preemption")
    ckpt_minutes: float = option(10.0, "checkpoint as well when M minutes have passed since the last one, so a slow step "
                                 "cannot lose hours (0: never)", "checkpoints and preemption")
    stop_before: str = option("auto", "under Slurm, save, stop and requeue the job M minutes before its time limit, "
                              "whether or not a --signal comes (auto: one minute, plus twice the slowest checkpoint save "
                              "and step; 0: never)", "checkpoints and preemption")
    keep_ckpts: int = option(3, "how many of the newest checkpoints to keep", "checkpoints and preemption")
    allow_changes: bool = option(False, "resume even though {changeable} differ from the checkpoint's (to train longer, "
                                 "or on with a lower --lr); the change is logged", "checkpoints and preemption")
    # Not in --help: rehearses a preemption at a chosen step (docs/recovery.md). Rank 0 sends
    # itself a signal after step N, as N:USR1 or N:TERM (the run stops after step N+1, or at N
    # on a checkpoint step); TrainingRun.step_done.
    interrupt_at: str = option("", "", "checkpoints and preemption", hidden=True)


# Every collective waits this long for the other ranks. Below 10 s, ranks that start a few
# seconds apart (srun across nodes, torch imported from shared storage) or wait for rank 0
# to stage the data or write a checkpoint count as dead (exit 4), and run_training.sbatch
# restarts them again and again. Above a week a hang is not worth waiting for (time limits
# end jobs sooner), and far larger values overflow timedelta and Gloo's clock.
DIST_TIMEOUT_RANGE = (10.0, 7 * 24 * 3600.0)
# A hang report takes a few seconds to gather (hangs.GRACE): waits shorter than this are not hangs.
HANG_AFTER_LOW = 5.0


def need(ok: bool, message: str) -> None:
    """The check of an option: a UsageError (one line, exit code 2) unless `ok`."""
    if not ok:
        raise UsageError(message)


def tracker_problem(tracker: str) -> str:
    """The one line that stops a run asking for a tracker it cannot use, or "": its package is
    not installed (looked for, not imported: MLflow takes seconds to import), or MLflow has no
    MLFLOW_TRACKING_URI (its default, a database in the working directory, would make each
    submission directory a tracker of its own) or points it at the file store it refuses (the
    tracker would get nothing)."""
    if tracker not in TRACKER_PACKAGES:
        return ""
    if importlib.util.find_spec(TRACKER_PACKAGES[tracker]) is None:
        return (f"--tracker {tracker} needs the {TRACKER_PACKAGES[tracker]} package, which {sys.executable} lacks: "
                f"pip install {TRACKER_PACKAGES[tracker]}")
    if tracker == "mlflow" and not os.environ.get("MLFLOW_TRACKING_URI"):
        return ("--tracker mlflow needs MLFLOW_TRACKING_URI: a server (http://host:5000) or a database every node "
                "reaches (sqlite:////project/mlflow.db); export it before the run or the job starts")
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    file_store = uri not in ("databricks", "databricks-uc", "uc") and urlsplit(uri).scheme in ("", "file")  # (as MLflow reads it)
    version = mlflow_version() if tracker == "mlflow" and file_store else ""
    if version and refuses_file_store(version):
        return (f"--tracker mlflow: MLFLOW_TRACKING_URI={uri} is MLflow's file store, which MLflow "
                f"{version} refuses: use a server (http://host:5000) or a database every "
                "node reaches (sqlite:////project/mlflow.db), or export MLFLOW_ALLOW_FILE_STORE=true to keep the file store")
    return ""


def mlflow_version() -> str:
    """The version of the MLflow installed, from its distribution's metadata (importing it takes
    seconds): mlflow, or mlflow-skinny, which installs the same package alone; "" for neither."""
    for distribution in ("mlflow", "mlflow-skinny"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(distribution)
    return ""


def refuses_file_store(version: str) -> bool:
    """Whether MLflow `version` refuses its file store (from 3.13 on, unless
    MLFLOW_ALLOW_FILE_STORE is true)."""
    if os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() in ("true", "1"):
        return False
    try:
        major, minor = (int(part) for part in re.findall(r"\d+", version)[:2])
    except ValueError:  # (a version that does not read as one: MLflow refuses its store or not itself)
        return False
    return (major, minor) >= (3, 13)


def check_run_options(c: RunOptions) -> None:
    need(math.isfinite(c.dist_timeout) and c.dist_timeout > 0, f"--dist-timeout must be a positive number of seconds, got {c.dist_timeout}")
    low, high = DIST_TIMEOUT_RANGE
    need(low <= c.dist_timeout <= high,
         f"--dist-timeout must be from {low:g} to {high:g} seconds (a week), got {c.dist_timeout:g}")
    need(c.hang_after in (0, -1) or (math.isfinite(c.hang_after) and HANG_AFTER_LOW <= c.hang_after < c.dist_timeout),
         f"--hang-after must be 0 (a fifth of --dist-timeout), -1 (never) or from {HANG_AFTER_LOW:g} s to below "
         f"--dist-timeout ({c.dist_timeout:g} s), got {c.hang_after:g}")
    need(c.profile >= 0, f"--profile must be 0 (on request only) or a number of steps, got {c.profile}")
    need(c.data_workers >= 0, f"--data-workers must be 0 (read in the training process) or more, got {c.data_workers}")
    need(c.log_every >= 1, f"--log-every must be at least 1, got {c.log_every}")
    need(math.isfinite(c.progress_every) and c.progress_every >= 0,
         f"--progress-every must be 0 (never) or a number of seconds, got {c.progress_every}")
    need(not c.run_name or is_run_name(c.run_name), f"--run-name must be {RUN_NAME_RULE}, got {c.run_name!r}")
    need(not (c.run_name and c.run_dir), "pass --run-name or --run-dir, not both")
    need(c.image_every >= 0, f"--image-every must be 0 (never) or more, got {c.image_every}")
    need(c.ckpt_every >= 0, f"--ckpt-every must be 0 (epoch ends only) or more, got {c.ckpt_every}")
    need(math.isfinite(c.ckpt_minutes) and c.ckpt_minutes >= 0,
         f"--ckpt-minutes must be 0 (never) or a number of minutes, got {c.ckpt_minutes}")
    need(c.stop_before == "auto" or re.fullmatch(r"\d+(\.\d*)?|\.\d+", c.stop_before) is not None,
         f"--stop-before must be auto or a number of minutes (0: never), got {c.stop_before!r}")
    need(c.keep_ckpts >= 1, f"--keep-ckpts must be at least 1, got {c.keep_ckpts}")
    need(c.resume in ("auto", "never") or os.path.isfile(c.resume),  # (False, not an error, for a name too long)
         f"--resume {c.resume}: no such checkpoint file; pass auto, never or an existing file")
    need(not c.interrupt_at or re.fullmatch(r"[1-9]\d*:(USR1|TERM)", c.interrupt_at) is not None,
         f"--interrupt-at must look like 120:USR1 or 120:TERM, got {c.interrupt_at!r}")
    need(not c.data_mirror or re.match(r"^(https?|file)://", c.data_mirror) is not None,
         f"--data-mirror must be an http://, https:// or file:// URL, got {c.data_mirror!r}")
    problem = tracker_problem(c.tracker)
    need(not problem, problem)
    need(c.backend != "nccl" or c.device != "cpu", "--backend nccl needs --device cuda (or auto); use --backend gloo for CPUs")
    data_dir = Path(c.data_dir)
    need(not data_dir.exists() or data_dir.is_dir(), f"--data-dir {data_dir} is not a directory")
    need(not data_dir.exists() or os.access(data_dir, os.R_OK | os.X_OK),
         f"--data-dir {data_dir} is not readable; fix its permissions or pass another --data-dir")


class OneLineErrorParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UsageError(f"{message} (see --help)")


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The whole docstring as written (launch commands, exit codes), and defaults unless empty."""

    def _get_help_string(self, action):
        return action.help if action.default in ("", None) else super()._get_help_string(action)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def changeable(recipe_class: type) -> tuple[str, ...]:
    """The recipe's options that --allow-changes lets differ from a checkpoint's."""
    return tuple(f.name for f in dataclasses.fields(recipe_class) if f.metadata.get("changeable"))


def build_parser(recipe_class: type, manual: str = "") -> argparse.ArgumentParser:
    """The CLI of the recipe's options and RunOptions: one kebab-case flag per field, in the
    groups their metadata names, the default shown in --help."""
    parser = OneLineErrorParser(prog=PROG, description=manual, formatter_class=HelpFormatter, allow_abbrev=False)
    groups: dict[str, argparse._ArgumentGroup] = {}
    recipe_fields, run_fields = dataclasses.fields(recipe_class), dataclasses.fields(RunOptions)
    clash = {f.name for f in recipe_fields} & {f.name for f in run_fields}
    if clash:
        raise TypeError(f"recipe options that RunOptions has too: {clash}")
    allowed = ", ".join(flag(name) for name in changeable(recipe_class)) or "(none)"
    for f in (*recipe_fields, *run_fields):
        group_name = f.metadata.get("group", "options")
        group = groups.get(group_name) or groups.setdefault(group_name, parser.add_argument_group(group_name))
        help = argparse.SUPPRESS if f.metadata.get("hidden") else f.metadata["help"].replace("{changeable}", allowed)
        if f.type in (bool, "bool"):
            group.add_argument(flag(f.name), action=argparse.BooleanOptionalAction, default=f.default, help=help)
        else:
            kind = {"int": int, "float": float, "str": str}.get(f.type, f.type)
            group.add_argument(flag(f.name), type=kind, default=f.default, choices=f.metadata.get("choices"), help=help,
                               metavar=f.name.upper() if "choices" not in f.metadata else None)
    return parser


def parse_options(recipe_class: type, argv: list[str], manual: str = ""):
    """(recipe options, RunOptions) from the command line, each checked: the recipe's by its
    own check() method."""
    given = vars(build_parser(recipe_class, manual).parse_args(argv))
    names = {f.name for f in dataclasses.fields(recipe_class)}
    recipe = recipe_class(**{k: v for k, v in given.items() if k in names})
    run = RunOptions(**{k: v for k, v in given.items() if k not in names})
    if hasattr(recipe, "check"):
        recipe.check()
    check_run_options(run)
    return recipe, run


def option_args(*options, leave_out: tuple[str, ...] = ()) -> list[str]:
    """The options (dataclass instances) that differ from their defaults, as command-line
    arguments, in the order --help lists them (its groups: data first, as the recipe's
    dataset and the data directories)."""
    fields = [(instance, f) for instance in options for f in dataclasses.fields(instance)]
    groups = list(dict.fromkeys(f.metadata.get("group", "options") for _, f in fields))
    args = []
    for instance, f in sorted(fields, key=lambda pair: groups.index(pair[1].metadata.get("group", "options"))):
        value = getattr(instance, f.name)
        if f.name in leave_out or value == f.default:
            continue
        if isinstance(value, bool):
            args.append(flag(f.name) if value else "--no-" + flag(f.name)[2:])
        else:
            text = repr(value) if isinstance(value, float) else str(value)
            # A value that starts with a dash would read as an option of its own.
            args += [f"{flag(f.name)}={text}"] if text.startswith("-") else [flag(f.name), text]
    return args
