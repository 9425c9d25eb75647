"""Checkpoints and resume: saves (atomic: ddpkit/files.py), the run's Progress, rotation, setting aside the
checkpoints a run no longer continues, and choosing, checking and loading the one to resume from.

A checkpoint holds plain dicts: the options it was written with, the classes and the
images' shape it was trained on, the state_dict of each thing the recipe names ("model",
"optimizer", "average"), Progress, and each rank's own state (RNGs, the epoch's partial
loss sums). It is checkpoints/ckpt-<step, 8 digits>.pt: a file of another name there (a
copy a user made, ckpt-best.pt) is theirs, and --resume auto, rotation and setting aside
leave it alone."""

import dataclasses
import os
import re
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
import torch.nn as nn

from ddpkit.distributed import Runtime, broadcast_from_main, gather_to_all
from ddpkit.files import TEMPORARY_SUFFIX, FileNotSeen, read_written_elsewhere, save_atomic
from ddpkit.job.contract import CKPT_DIR, CKPT_NAME, run_name_setting, step_of_checkpoint
from ddpkit.launch import HeldUp, UsageError
from ddpkit.options import flag


def remove_stale_temporaries(run_dir: Path) -> list[Path]:
    """Delete the temporary files of saves that never finished (a SIGKILL, a lost node, a
    power cut mid-save) from the run directory and its checkpoints/; returns them. Only the
    process that holds the run directory may call this: another run's save in progress
    would look the same."""
    pattern = re.compile(rf"\..+{re.escape(TEMPORARY_SUFFIX)}\d+")
    stale = [path for folder in (run_dir, run_dir / CKPT_DIR) if folder.is_dir()
             for path in sorted(folder.iterdir()) if pattern.fullmatch(path.name) and path.is_file()]
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


CKPT_FORMAT = 1


@dataclass
class Progress:
    """Where training stands; a checkpoint records it and a resumed run starts from it."""
    epoch: int = 1              # the epoch in progress
    step_in_epoch: int = 0      # its batches already done
    # Optimiser steps done in all, the run's one count (logs, checkpoint names, rotation). A
    # resume that restarts its epoch (another global batch) counts on from where it began.
    step: int = 0
    last_record: dict = field(default_factory=dict)  # the last evaluation's metrics
    finished: bool = False      # the last epoch evaluated and model.pt written: nothing left to do


def rank_state(loss_sum: torch.Tensor, device: torch.device) -> dict:
    """What each rank alone holds that the run depends on: RNG states (dropout) and the
    partial sums of the epoch in progress."""
    return {"cpu_rng": torch.get_rng_state(), "loss_sum": loss_sum.cpu(),
            "cuda_rng": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def weights_are_finite(state: Mapping[str, object]) -> bool:
    """A finite loss can still be followed by an update that overflows the weights. The
    weights are the same on every rank, so every rank reaches the same verdict."""
    return all(bool(torch.isfinite(p).all()) for thing in state.values() if isinstance(thing, nn.Module)
               for p in thing.parameters())


@dataclass
class RunState:
    """What the run trains and where it stands: what every checkpoint saves and a resume loads."""
    state: Mapping[str, object]  # the recipe's model, optimizer, ... by name
    progress: Progress
    loss_sums: torch.Tensor      # this rank's [loss x images, images] in the epoch so far (training_run.EpochLoss)
    config: dict                 # the recipe's and the run's options, as every checkpoint records them


class RecordedPlan(Protocol):
    """What every checkpoint records of the run's plan (training_run.RunPlan), which a resume
    compares: the data's classes, the images' (C, H, W), a step's images over all ranks (what
    Progress.step_in_epoch counts in)."""
    classes: tuple[str, ...]
    shape: tuple[int, int, int] | None
    global_batch: int


# The checkpoint's own keys; the recipe's state goes beside them, each under its name.
RESERVED = frozenset(("format", "config", "classes", "shape", "world_size", "global_batch", "progress",
                      "rank_states"))


def save_checkpoint(run_dir: Path, plan: RecordedPlan, run: RunState, rt: Runtime, *, keep: int) -> Path:
    """Every rank calls this (it gathers each rank's state); rank 0 writes the file and keeps
    the newest `keep` up to this step. Each of run.state (the recipe's model, optimizer, ...)
    is saved as its state_dict under its name, beside what the file records of the `plan`."""
    state, progress = run.state, run.progress
    taken = RESERVED.intersection(state)
    if taken:
        raise ValueError(f"a checkpoint keeps its own {', '.join(sorted(taken))} under that name: give the recipe's "
                         "state another name")
    states = gather_to_all(rank_state(run.loss_sums, rt.device), "the gather of each rank's state")
    path = checkpoint_path(run_dir, progress.step)
    if rt.is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_atomic({"format": CKPT_FORMAT, "config": run.config, "classes": list(plan.classes),
                     **({} if plan.shape is None else {"shape": list(plan.shape)}), "world_size": rt.world_size,
                     "global_batch": plan.global_batch,
                     **{name: None if thing is None else thing.state_dict() for name, thing in state.items()},
                     "progress": dataclasses.asdict(progress), "rank_states": states}, path)
        # The newest `keep` up to this step; a later one is the file a rewound run resumed
        # from, which set_aside_checkpoints moves away once this one is safe.
        ours = [p for p in run_checkpoints(run_dir) if checkpoint_step(p) <= progress.step]
        for old in ours[:-keep]:
            old.unlink(missing_ok=True)
    return path


def set_aside_checkpoints(run_dir: Path, step: int, keep: str = "") -> list[Path]:
    """Move the checkpoints numbered `step` or later, but the file `keep`, into a folder of
    their own under checkpoints/superseded/, and return them. A run that goes on from an
    earlier point (a rollback with --resume PATH, another global batch restarting its epoch,
    newer files that would not load) writes a new path from there, which --resume auto and
    rotation must not mistake for the old one. Nothing is deleted or overwritten: a
    rollback made by mistake can still be undone by hand."""
    checkpoints = run_dir / CKPT_DIR
    kept = Path(keep).resolve() if keep else None
    later = [p for p in run_checkpoints(run_dir) if checkpoint_step(p) >= step and p.resolve() != kept]
    if later:
        aside = checkpoints / "superseded" / f"{time.strftime('%Y%m%d-%H%M%S')}-going-on-from-step-{step}"
        aside.mkdir(parents=True, exist_ok=True)
        for path in later:
            os.replace(path, aside / path.name)
    return later


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return run_dir / CKPT_DIR / CKPT_NAME.format(step)


def checkpoint_step(path: Path) -> int:
    """The step in a checkpoint's name, -1 for a user's file (contract.step_of_checkpoint: the
    job's supervisor reads the names too)."""
    return step_of_checkpoint(path.name)


def run_checkpoints(run_dir: Path) -> list[Path]:
    """The run's checkpoints, by step (oldest first), not by name."""
    folder = run_dir / CKPT_DIR
    found = [path for path in folder.iterdir() if checkpoint_step(path) >= 0] if folder.is_dir() else []
    return sorted(found, key=checkpoint_step)


def other_files(run_dir: Path) -> list[Path]:
    """The files a user put in checkpoints/ (not named as the run's checkpoints; not the hidden
    temporaries of saves, nor superseded/)."""
    folder = run_dir / CKPT_DIR
    return sorted(path for path in folder.iterdir() if checkpoint_step(path) < 0 and not path.name.startswith(".")
                  and not path.is_dir()) if folder.is_dir() else []


def read_checkpoint(path: Path, device: torch.device | str) -> dict:
    """The checkpoint in `path`, checked whole (check_checkpoint): ValueError if it is not one."""
    # weights_only: a file planted in a shared directory can hold tensors and plain
    # containers, nothing that runs code when unpickled.
    ckpt = torch.load(path, map_location=device, weights_only=True)
    check_checkpoint(ckpt)
    return ckpt


# Progress's fields that a format-1 checkpoint may lack (it was written before they existed).
PROGRESS_ADDED = ("finished",)
RANK_STATE_KEYS = frozenset(("cpu_rng", "loss_sum", "cuda_rng"))


def check_checkpoint(ckpt: object) -> None:
    """Every field a resume reads, checked before any is used: a file that fails (a
    damaged or hand-made one, or one a later version wrote with fields this one does not
    know) raises ValueError naming the field, so that --resume auto skips it for the next
    newest and --resume PATH refuses it in one line, instead of a traceback at every start."""
    if not isinstance(ckpt, dict) or ckpt.get("format") != CKPT_FORMAT:
        raise ValueError(f"not a mnist_ddp.py checkpoint of format {CKPT_FORMAT}")
    missing = [key for key in ("config", "world_size", "progress", "rank_states") if key not in ckpt]
    if missing:
        raise ValueError(f"it has no {', '.join(missing)}")
    if not (isinstance(ckpt["config"], dict) and all(isinstance(k, str) for k in ckpt["config"])):
        raise ValueError("its config is not a dict of options")
    classes = ckpt.get("classes")  # (none in checkpoints from before classes were saved)
    if classes is not None and not (isinstance(classes, list) and all(isinstance(c, str) for c in classes)):
        raise ValueError("its classes are not a list of names")
    shape = ckpt.get("shape")  # (none in checkpoints from before the images' shape was saved)
    if shape is not None and not (isinstance(shape, list) and len(shape) == 3 and all(is_count(n, 1) for n in shape)):
        raise ValueError("its shape is not the images' [channels, height, width]")
    if not is_count(ckpt["world_size"], 1):
        raise ValueError(f"its world_size is {ckpt['world_size']!r}, not a count of ranks")
    if "global_batch" in ckpt and not is_count(ckpt["global_batch"], 1):  # (none before it was saved)
        raise ValueError(f"its global_batch is {ckpt['global_batch']!r}, not a count of images")
    check_progress(ckpt["progress"])
    states = ckpt["rank_states"]
    if not (isinstance(states, list) and len(states) == ckpt["world_size"]):
        raise ValueError(f"its rank_states are not a list of its {ckpt['world_size']} ranks' states")
    for rank, state in enumerate(states):
        if not (isinstance(state, dict) and state.keys() == RANK_STATE_KEYS and is_byte_tensor(state["cpu_rng"])
                and (state["cuda_rng"] is None or is_byte_tensor(state["cuda_rng"]))
                and isinstance(state["loss_sum"], torch.Tensor) and state["loss_sum"].shape == (2,)
                and state["loss_sum"].dtype == torch.float64):
            raise ValueError(f"its rank_states[{rank}] is not a rank's {', '.join(sorted(RANK_STATE_KEYS))}")
    for name, saved in ckpt.items():  # the recipe's state, each a state_dict (None: the recipe had none)
        if name not in RESERVED and not (saved is None or isinstance(saved, dict)):
            raise ValueError(f"its {name} is a {type(saved).__name__}, not a state_dict")


def is_count(value: object, least: int) -> bool:
    return type(value) is int and value >= least  # (True is an int to isinstance)


def is_byte_tensor(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 1


def check_progress(saved: object) -> None:
    """Progress's fields, exactly, each of its type (a format-1 checkpoint may lack PROGRESS_ADDED)."""
    if not isinstance(saved, dict):
        raise ValueError("its progress is not a dict")
    fields = {f.name: f.type for f in dataclasses.fields(Progress)}
    unknown = [k for k in saved if k not in fields]
    missing = [k for k in fields if k not in saved and k not in PROGRESS_ADDED]
    if unknown or missing:
        raise ValueError("its progress has " + " and ".join(
            ([f"field(s) this version does not know: {', '.join(map(str, unknown))}"] if unknown else [])
            + ([f"no {', '.join(missing)}"] if missing else [])))
    least = {"epoch": 1, "step_in_epoch": 0, "step": 0}
    for name, value in saved.items():
        kind = fields[name]  # int, bool or dict
        if kind is int and not is_count(value, least[name]):
            raise ValueError(f"its progress.{name} is {value!r:.80}, not a whole number from {least[name]} up")
        if kind is not int and not (type(value) is kind and (kind is not dict or all(isinstance(k, str) for k in value))):
            raise ValueError(f"its progress.{name} is {value!r:.80}, not a {kind.__name__}"
                             + (" of metrics by name" if kind is dict else ""))


def checkpoint_differences(ckpt: dict, recipe: dict) -> dict[str, str]:
    """The recipe's options (they set the course of training) that differ, each as 'there, here'.
    An option the checkpoint does not know (added to the recipe since it was saved, like
    --global-batch) is not compared: what it knew says what to pass to go on."""
    saved = ckpt["config"]
    return {k: f"{flag(k)} {saved[k]} there, {value} here" for k, value in recipe.items() if k in saved and saved[k] != value}


def refuse_if_unfitting(path: Path, saved: Mapping[str, torch.Tensor], model: nn.Module) -> None:
    """A checkpoint whose weights do not fit this model (its code was edited since: a wider
    layer, a renamed one) is refused in one line that names the first tensor that differs,
    instead of load_state_dict's page-long error."""
    mine, difference = model.state_dict(), ""
    for name, tensor in mine.items():
        if name not in saved:
            difference = f"{name} is not in the checkpoint"
        elif saved[name].shape != tensor.shape:
            difference = f"{name} has shape {list(saved[name].shape)} there, {list(tensor.shape)} here"
        if difference:
            break
    else:
        extra = [name for name in saved if name not in mine]
        difference = f"{extra[0]} is in the checkpoint but not in this model" if extra else ""
    if difference:
        raise UsageError(f"checkpoint {path} does not fit this model ({difference}): the model's code changed since it "
                         f"was saved. Pass another {run_name_setting()} to train the changed model afresh, or undo the change to "
                         "resume this run")


def find_checkpoint(resume: str, allow_changes: bool, recipe: dict, changeable: tuple[str, ...],
                    run_dir: Path, continuing: str = "") -> tuple[Path | None, str]:
    """Rank 0 picks the checkpoint to resume from: the newest one that loads, falling back
    past damaged or refused files with a warning that names them. Also returns what
    --allow-changes let differ ("" if nothing). `continuing` says how this start continues
    the job ("attempt 2/4, requeued 0x"; "" for its first start)."""
    found = run_checkpoints(run_dir)[::-1]  # the newest first
    if continuing and found and resume != "auto":
        # --resume belongs to the job's first start (contract.FIRST_START_ONLY): a restart or a
        # requeue goes on from the run's own newest checkpoint, not back to FILE (nor refuses, with never).
        print(f"this start continues the job ({continuing}): it resumes from the run's newest checkpoint, not "
              f"--resume {resume}", flush=True)
        resume = "auto"
    if resume == "never":
        if found:
            raise UsageError(f"{run_dir / CKPT_DIR} holds checkpoints and --resume is never; "
                             f"pass another {run_name_setting()} to start afresh, or --resume auto to continue")
        warn_if_starting_over(run_dir, [])
        return None, ""
    candidates = found if resume == "auto" else [Path(resume)]
    theirs = other_files(run_dir) if resume == "auto" else []
    if theirs:
        names = ", ".join(path.name for path in theirs[:4]) + (f" and {len(theirs) - 4} more" if len(theirs) > 4 else "")
        print(f"note: --resume auto ignores {names} in {run_dir / CKPT_DIR}, not named as the run's checkpoints "
              f"are ({CKPT_NAME.format(120)} for step 120); to resume from one of them, pass --resume PATH",
              file=sys.stderr, flush=True)
    for path in candidates:
        try:
            ckpt = read_checkpoint(path, "cpu")
        except Exception as err:  # truncated, garbage, or refused by weights_only
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            if resume != "auto":
                raise UsageError(f"cannot resume from {path}: {reason}") from None
            print(f"warning: skipping checkpoint {path}: {reason[:200]}", file=sys.stderr, flush=True)
            continue
        differences = checkpoint_differences(ckpt, recipe)
        fixed = [text for k, text in differences.items() if k not in changeable]
        if fixed or (differences and not allow_changes):
            allowed = ", ".join(flag(k) for k in changeable)
            raise UsageError(f"checkpoint {path} is from a different configuration ({'; '.join(differences.values())}); "
                             f"resume with the same options, or pass another {run_name_setting()} to start afresh"
                             + ("" if fixed else f", or add --allow-changes to carry on with new {allowed}"))
        return path, "; ".join(differences.values())
    warn_if_starting_over(run_dir, found)
    return None, ""


def warn_if_starting_over(run_dir: Path, unreadable: list[Path]) -> None:
    """A run directory that holds logs but no checkpoint that loads starts over from step 0:
    say so, since its logged epochs are replaced rather than continued."""
    metrics = run_dir / "metrics.jsonl"
    if unreadable or (metrics.is_file() and metrics.stat().st_size > 0):
        kept = " (the checkpoints that did not load go to checkpoints/superseded/)" if unreadable else ""
        print(f"warning: {run_dir} holds an earlier attempt's logs but no checkpoint that loads: starting the run over "
              f"from step 0, replacing its logged epochs{kept}", file=sys.stderr, flush=True)


def run_is_done(progress: Progress, epochs: int, max_steps: int) -> bool:
    """Whether training has nothing left to do: every epoch done, or the --max-steps cap reached."""
    return progress.epoch > epochs or (max_steps > 0 and progress.step >= max_steps)


def resume_from(path: Path, state: Mapping[str, object], rt: Runtime, *, global_batch: int, epochs: int,
                max_steps: int, classes: tuple[str, ...] | None = None,
                shape: tuple[int, int, int] | None = None, size: int | None = None) -> tuple[Progress, torch.Tensor]:
    """Load a checkpoint rank 0 chose (`size` bytes, as rank 0 saw it) into `state` (the recipe's
    model, optimizer, ...); returns where to go on and this rank's loss sums of the epoch in
    progress. Every rank reads the file itself, as torch.distributed.checkpoint's loads do:
    rank 0 sending the state over the process group would hold it twice in memory, and on
    the GPU under NCCL. On another node than rank 0's, NFS may not show the file whole for
    a while (read_written_elsewhere retries it, REREAD_SECONDS); past that, HeldUp (exit 4,
    which a restart may fix) in one line that names the file and its file system. A checkpoint
    of other `classes` (another image folder) or of images of another `shape` is refused.
    At another world size with the same `global_batch`, the run goes on at the saved step:
    each global batch holds the same images at any world size (mnist_ddp.epoch_shard)."""
    # Read onto the CPU: load_state_dict places each tensor beside its parameter (the fused
    # AdamW's step counts too, which its kernel reads on the parameters' device).
    try:  # (torch.load of a file cut short raises RuntimeError or EOFError)
        ckpt = read_written_elsewhere(path, lambda p: read_checkpoint(p, "cpu"), size=size,
                                      short_read=(RuntimeError, EOFError))
    except FileNotSeen as err:
        raise HeldUp(str(err)) from None
    refuse_other_data(path, ckpt, classes, shape)
    for name, thing in state.items():
        if thing is None:
            continue
        if name not in ckpt or ckpt[name] is None:
            raise UsageError(f"checkpoint {path} holds no {name}: the recipe's code changed since it was saved. Pass "
                             f"another {run_name_setting()} to train afresh, or undo the change to resume this run")
        if isinstance(thing, nn.Module):
            refuse_if_unfitting(path, ckpt[name], thing)
            thing.load_state_dict(ckpt[name])
        elif isinstance(thing, torch.optim.Optimizer):
            load_optimizer(path, thing, ckpt[name])
        else:
            thing.load_state_dict(ckpt[name])
    progress = Progress(**ckpt["progress"])
    loss_sum = torch.zeros(2, dtype=torch.float64, device=rt.device)
    states, saved_ranks = ckpt["rank_states"], ckpt["world_size"]
    if saved_ranks == rt.world_size:
        set_rng_state(states[rt.rank], rt.device)
        loss_sum.copy_(states[rt.rank]["loss_sum"])
    elif progress.finished and run_is_done(progress, epochs, max_steps):
        pass  # nothing left to train
    elif ckpt.get("global_batch") == global_batch:
        # The same batches: rank 0 carries every saved rank's loss sums of the epoch on (the
        # epoch's loss adds them all up), each rank a saved rank's random state (dropout then
        # draws other masks than the run that kept its world size would); a rank the saved
        # run had not goes on from a seed drawn from it and its own rank, so that no two ranks
        # draw the same masks.
        set_rng_state(states[rt.rank % saved_ranks], rt.device)
        if rt.rank >= saved_ranks:
            torch.manual_seed(int(torch.randint(2**62, ())) + rt.rank)
        if rt.is_main:
            loss_sum.copy_(sum(s["loss_sum"] for s in states))
            print(f"{path} was written by {saved_ranks} ranks, this run has {rt.world_size}: the same global batch of "
                  f"{global_batch}, so the run goes on at step {progress.step} (epoch {progress.epoch}, step "
                  f"{progress.step_in_epoch} of it)", flush=True)
    else:
        # Other batches (--batch-size, or a checkpoint from before the global batch was saved):
        # restart the interrupted epoch with the saved weights, its steps counted on from where
        # it began (past every step logged before it).
        start = progress.step - progress.step_in_epoch
        record = progress.last_record if progress.last_record.get("step", 0) <= start else {}  # not evaluated here
        progress = Progress(progress.epoch, 0, start, record)
        if rt.is_main:
            if "global_batch" in ckpt:
                why = f"its global batch was {ckpt['global_batch']}, this run's is {global_batch} (--batch-size per rank)"
            else:
                why = "the data order changed"
            print(f"warning: {path} was written by {saved_ranks} ranks, this run has {rt.world_size}: {why}; "
                  f"continuing from the start of epoch {progress.epoch}", file=sys.stderr)
    return progress, loss_sum


def set_rng_state(state: dict, device: torch.device) -> None:
    """A rank's random state (dropout's draws) as a checkpoint saved it."""
    torch.set_rng_state(state["cpu_rng"].cpu())
    if state["cuda_rng"] is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda_rng"].cpu(), device)


def refuse_other_data(path: Path, ckpt: dict, classes: tuple[str, ...] | None,
                      shape: tuple[int, int, int] | None) -> None:
    """Data other than the checkpoint was trained on is refused in one line that says what
    differs: other classes would silently relabel it, another image size or channel count
    would read as a change to the model's code. (A checkpoint from before the classes or the
    shape were saved is not compared on them.)"""
    saved_classes = ckpt.get("classes")
    if classes is not None and saved_classes is not None and list(saved_classes) != list(classes):
        shown = lambda names: ", ".join(names[:12]) + (f", ... ({len(names)} in all)" if len(names) > 12 else "")
        raise UsageError(f"checkpoint {path} was trained on other classes ({shown(saved_classes)}) than this data has "
                         f"({shown(list(classes))}): pass the data it was trained on, or another {run_name_setting()} to start "
                         "afresh")
    saved_shape = ckpt.get("shape")
    if shape is None or saved_shape is None or list(saved_shape) == list(shape):
        return
    (c0, h0, w0), (c, h, w) = saved_shape, shape
    # Image folders (imagesets.check_headers) are read in colour when any one image is.
    why, what = "", ""
    if (c0, c) == (1, 3):
        why, what = " (an image folder is read in colour when any one of its images is in colour)", " (every image grayscale)"
    elif (c0, c) == (3, 1):
        why = " (an image folder is read in grayscale when every one of its images is)"
    if (h0, w0) != (h, w):
        what = f" (its images {w0}x{h0} pixels)"
    raise UsageError(f"checkpoint {path} was trained on images of {c0}x{h0}x{w0} (channels x height x width) and this "
                     f"data's are {c}x{h}x{w}{why}: pass the data it was trained on{what}, or another {run_name_setting()} to "
                     "start afresh")


def load_optimizer(path: Path, optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """The optimizer's state from the checkpoint, and each parameter group's hyperparameters
    as the optimizer is built now (--allow-changes decided whether they may differ: weight
    decay, betas, the peak learning rate that the schedule scales, "initial_lr"), except the
    learning rate itself, which stays where the schedule had taken it (the next step sets it)."""
    given = [{**{k: v for k, v in group.items() if k not in ("params", "lr")}, "initial_lr": group.get("initial_lr", group["lr"])}
             for group in optimizer.param_groups]
    try:
        optimizer.load_state_dict(saved)
    except ValueError as err:  # its parameter groups differ: the optimizer's code changed
        raise UsageError(f"checkpoint {path} does not fit this optimizer ({err}); pass another {run_name_setting()} to train "
                         "afresh, or undo the change to resume this run") from None
    for group, hyperparameters in zip(optimizer.param_groups, given, strict=True):
        group.update(hyperparameters)


def agree_on_checkpoint(resume: str, allow_changes: bool, recipe: dict, changeable: tuple[str, ...], rt: Runtime,
                        run_dir: Path, continuing: str = "") -> tuple[str, str, int | None]:
    """Rank 0 picks the checkpoint (or the error) and tells every rank: (path or "", what
    --allow-changes let differ, the file's size as rank 0 sees it: resume_from's `size`)."""
    choice = ["", "", "", None]
    if rt.is_main:
        try:
            path, changed = find_checkpoint(resume, allow_changes, recipe, changeable, run_dir, continuing)
            choice = [str(path or ""), changed, "", path.stat().st_size if path else None]
        except UsageError as err:
            choice = ["", "", str(err), None]
    path, changed, error, size = broadcast_from_main(choice, "choosing the checkpoint to resume from")
    if error:
        raise UsageError(error if rt.is_main else "rank 0 cannot resume; see its error")
    return path, changed, size
