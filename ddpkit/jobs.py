"""The job runner: one process's part of a training job from its first line to its exit
code. It reads the launch environment and the options, sets up and tears down the process
group, starts the run (its directory, the checkpoint to resume from, its log), and turns
every way a run ends into an exit code and one line: done, stopped (requeue, or the
command that continues), diverged, a lost peer, a problem the user fixes, a bug."""

import contextlib
import dataclasses
import functools
import os
import shlex
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from ddpkit import hangs
from ddpkit.data.imagesets import ImageSet, image_shape
from ddpkit.distributed import (
    Runtime,
    barrier,
    gather_to_all,
    init_distributed,
    leave_after_lost_peer,
    nondeterministic_operation,
    teardown_distributed,
)
from ddpkit.hangs import KIT, HangWatch, Peer, default_hang_after
from ddpkit.job.contract import (
    CKPT_DIR,
    EXIT_BUG,
    EXIT_DIVERGED,
    EXIT_LOST_PEER,
    EXIT_NODE_FAULT,
    EXIT_STOPPED,
    EXIT_USAGE,
    FIRST_START_ONLY,
    JobEnv,
    chains_left,
    hung_text,
    requeue_job,
    resubmit_start,
)
from ddpkit.job.sweeplines import RUN_DIR_OPTIONS
from ddpkit.launch import (
    INTERRUPTED,
    PROG,
    AlreadyComplete,
    Diverged,
    HeldUp,
    Launch,
    StartupClock,
    Stopped,
    StopSignals,
    UsageError,
    read_launch_env,
    record_exit,
    record_node_fault,
    remove_exit_file,
    unfixable_exit,
    write_exit_file,
)
from ddpkit.options import RunOptions, changeable, flag, option_args, parse_options
from ddpkit.run.checkpoints import (
    Progress,
    agree_on_checkpoint,
    checkpoint_path,
    remove_stale_temporaries,
    resume_from,
    run_is_done,
    set_aside_checkpoints,
)
from ddpkit.run.compile_cache import CompileCache, cache_key, cache_path
from ddpkit.run.doctor import StepParts, check_job, recipe_step
from ddpkit.run.recovery import is_lost_peer, lost_peer_message, node_fault, storage_problem
from ddpkit.run.rundir import RunClaim, agree_on_run_dir, claim_run_dir
from ddpkit.run.runlog import (
    HParams,
    LogPlan,
    NullLogger,
    RunLogger,
    describe_environment,
    final_figures,
    read_metrics_tolerantly,
    usable_cpus,
)
from ddpkit.run.time_limit import TimeLimit, read_job_times
from ddpkit.run.trackers import NoTracker, Start, Tracker
from ddpkit.run.training_run import (
    RunPlan,
    RunState,
    Surroundings,
    TrainingRun,
    check_batch_fits,
    plan_run,
    split_batch,
    world_sizes,
)

# What a command that continues a run leaves out: the options of its first start alone
# (contract.FIRST_START_ONLY: where it started from, the testing aid that would stop the run
# again at the same step), staging alone, a profile (it was taken); and, under
# run_training.sbatch, what the batch file passes itself (from LOG_DIR and RUN_NAME; it
# refuses these options after its name). The data directories stay: an option given after
# the batch file's name wins over DATA_DIR.
NOT_CONTINUED = tuple(name[2:].replace("-", "_") for name in FIRST_START_ONLY) + ("download_only", "profile")
SET_BY_BATCH_FILE = tuple(name[2:].replace("-", "_") for name in RUN_DIR_OPTIONS)


def continue_command(recipe, options: RunOptions, launch: Launch, run_dir: Path, **changes: str) -> str:
    """The one builder of every command printed to carry this run on from its newest
    checkpoint: "to continue", "to train it longer", the advice after divergence, and
    the line run_training.sbatch prints after END. It is built from the run's options
    (not from the words typed, which may abbreviate them), naming the run's directory,
    without the NOT_CONTINUED ones, and with `changes` ({"lr": "0.001", "allow_changes":
    ""}) at the end. Under run_training.sbatch it is the sbatch line that resubmits the
    job: the batch file passes its beginning (the directory, its variables, the job's
    request, itself) in JobEnv.RESUBMIT."""
    leave_out = NOT_CONTINUED + tuple(changes)
    resubmit = resubmit_start()
    if resubmit:
        args = option_args(recipe, options, leave_out=leave_out + SET_BY_BATCH_FILE)
        command = resubmit
    else:
        args = option_args(recipe, options, leave_out=leave_out)
        if not (options.run_name or options.run_dir):
            args += ["--run-name", run_dir.name] if run_dir.parent == Path(options.log_dir) else ["--run-dir", str(run_dir)]
        script = sys.argv[0] if sys.argv[0].endswith(".py") else PROG
        command = f"{launcher_words(launch)} {shlex.quote(script)}"
    for name, value in changes.items():
        args += [flag(name)] + ([value] if value != "" else [])
    return f"{command} {shlex.join(args)}".rstrip()


def launcher_words(launch: Launch) -> str:
    """How this process was started, as a command that starts the same ranks again. It names
    the interpreter that runs now: `python` on the PATH may be another one (no torch), or
    none at all, when no environment is active (`make run` runs .venv/bin/python); torchrun
    as that interpreter's module, for the same reason."""
    python = shlex.quote(sys.executable)
    if launch.source == "torchrun":
        if launch.nodes == 1:
            return f"{python} -m torch.distributed.run --standalone --nproc-per-node={launch.local_world_size}"
        return f"{python} -m torch.distributed.run [the torchrun options you gave, on each of the {launch.nodes} nodes]"
    if launch.source == "slurm":
        return f"srun --nodes={launch.nodes} --ntasks={launch.world_size} {python}"
    return python


def record_continue_command(launch: Launch, command: str) -> None:
    """Under run_training.sbatch, leave the command that continues this run where the batch
    file prints it after its END line, even when every rank was killed."""
    if resubmit_start():
        write_exit_file(launch, launch.paths.continue_command, command + "\n")


# The recipe's options that the kit reads by name: the batch (global, or per rank), how long
# the run lasts, and the lr (the step --check times).
RECIPE_FIELDS = ("global_batch", "batch_size", "epochs", "max_steps", "lr")


def default_image_shape(recipe: object, options: RunOptions) -> tuple[tuple[int, int, int], int]:
    """The shape and class count of --dataset's images, for --check (imagesets.image_shape)."""
    return image_shape(getattr(recipe, "dataset", ""), Path(options.data_dir))


@dataclasses.dataclass
class Job:
    """This process's part of the job: the options, where it stands in the job, the process
    group; once start_run has run, the run's directory, its claim, its log and the run."""
    recipe: object
    options: RunOptions
    launch: Launch
    rt: Runtime
    stop: StopSignals
    who: str = ""
    run_dir: Path | None = None
    claim: RunClaim | None = None
    logger: object = dataclasses.field(default_factory=NullLogger)
    run: TrainingRun | None = None
    progress: Progress = dataclasses.field(default_factory=Progress)  # the run's, once resumed (a lost peer names its step)
    on_divergence: Mapping[str, str] = dataclasses.field(default_factory=dict)
    startup: StartupClock = dataclasses.field(default_factory=StartupClock)  # rank 0 prints `ready in` at the first step
    hang_watch: HangWatch | None = None  # this rank's watchdog (several ranks), once the ranks have exchanged hosts
    peers: list[Peer] = dataclasses.field(default_factory=list)  # every rank, once they have met
    new_run_dir: bool = False  # the run's directory is this start's: removed at the end if it stays empty

    def continue_command(self, **changes: str) -> str:
        return continue_command(self.recipe, self.options, self.launch, self.run_dir, **changes)

    def start_run(self, state: Mapping[str, object], train_set: ImageSet, on_divergence: Mapping[str, str]) -> TrainingRun:
        """Claim the run's directory, resume from its newest checkpoint (into `state`: the
        recipe's model, optimizer, ... by name) and start its log. The run trains `train_set`
        (its size, classes and image shape, which the checkpoints record and a resume
        compares) as the recipe's --global-batch (or --batch-size a rank), --epochs and
        --max-steps say; `on_divergence` holds the options that the advice after a divergence
        changes (e.g. {"lr": "0.001"}). Raises AlreadyComplete when the run has nothing left to do."""
        recipe, rt = self.recipe, self.rt
        images, classes, shape = len(train_set), train_set.classes, train_set.shape
        epochs, max_steps = recipe.epochs, recipe.max_steps
        check_batch_fits(recipe.global_batch, recipe.batch_size, images, rt.world_size)  # (before any step, whichever feed)
        batch_size = split_batch(recipe.global_batch, rt.world_size, recipe.batch_size)
        hparams = HParams.of_run(recipe, batch_size=batch_size, world_size=rt.world_size, amp=self.options.amp)
        self.on_divergence = on_divergence
        self.claim_run_dir()
        if self.hang_watch and self.claim:  # (before, another run of this name may have used them)
            self.hang_watch.tidy_earlier_attempts()
        ckpt_path, changed, loss_sums = self.resume(state, global_batch=batch_size * rt.world_size, epochs=epochs,
                                                    max_steps=max_steps, classes=classes, shape=shape)
        progress = self.progress
        plan = plan_run(progress, images=images, world_size=rt.world_size, batch_size=batch_size, epochs=epochs,
                        max_steps=max_steps, classes=classes, shape=shape)
        peers = self.peers
        hosts = [peer.host for peer in peers]
        # Going on from an earlier point than the newest checkpoints (see set_aside_checkpoints),
        # or from a file elsewhere: first save where the run stands, as checkpoints/ckpt-<step>.
        here = checkpoint_path(self.run_dir, progress.step)
        save_here = bool(ckpt_path) and Path(ckpt_path).resolve() != here.resolve()
        saved_options = {**dataclasses.asdict(self.recipe), **dataclasses.asdict(self.options)}
        if rt.is_main:
            self.start_log(saved_options, hparams, hosts, classes, ckpt_path, changed)
            # (for the job's supervisor, which goes on with fewer ranks after it lost nodes, and
            # pins a rank's failure on its node)
            sizes = world_sizes(recipe.global_batch, recipe.batch_size, rt.world_size)
            write_exit_file(self.launch, self.launch.paths.world_sizes, " ".join(map(str, sizes)) + "\n")
            write_exit_file(self.launch, self.launch.paths.nodes, "".join(f"{peer.node}\n" for peer in peers))
        self.describe_run(plan, ckpt_path)
        around = Surroundings(run_dir=self.run_dir, stop=self.stop, logger=self.logger,
                              startup=self.startup if rt.is_main else None,
                              time_limit=self.watch_time_limit() if rt.is_main else None, hosts=tuple(hosts),
                              compile_cache=self.start_compile_cache(plan) if self.options.compile else None)
        self.run = TrainingRun(plan, rt=rt, options=self.options, state=RunState(state, progress, loss_sums, saved_options),
                               around=around)
        if save_here:
            self.run.checkpoint()
            if rt.is_main:  # the file resumed from, when it was a later one in checkpoints/ (another global batch)
                set_aside_checkpoints(self.run_dir, progress.step + 1)
        self.stop.begin_training()  # from now on Ctrl-C saves first
        return self.run

    def start_compile_cache(self, plan: RunPlan) -> CompileCache:
        """(--compile, every rank, before the first step compiles) The run's compile cache for
        what this start compiles, loaded when an earlier start saved it (compile_cache.py)."""
        kept = {name: value for name, value in dataclasses.asdict(self.recipe).items()
                if name not in changeable(type(self.recipe))}
        key = cache_key(rt=self.rt, batch_size=plan.batch_size, shape=plan.shape, classes=len(plan.classes),
                        recipe=kept, options=dataclasses.asdict(self.options))
        return CompileCache.start(cache_path(self.run_dir, key), self.rt)

    def claim_run_dir(self) -> None:
        """The run's directory, held by this run (see rundir.py), cleared of unfinished saves."""
        self.claim = claim_run_dir(self.options, self.launch, self.rt, self.run_dir)
        if self.claim:  # holding the directory: no other run's save can be under way in it
            for path in remove_stale_temporaries(self.run_dir):
                print(f"removed {path}, left by a save that never finished", file=sys.stderr, flush=True)

    def resume(self, state: Mapping[str, object], *, global_batch: int, epochs: int, max_steps: int,
               classes: tuple[str, ...], shape: tuple[int, int, int] | None) -> tuple[str, str, torch.Tensor]:
        """Load the checkpoint every rank agreed on into `state` and self.progress: (its path or
        "", the options --allow-changes let differ, this rank's loss sums). Raises
        AlreadyComplete when it finished the run."""
        recipe, options, rt, launch = self.recipe, self.options, self.rt, self.launch
        continuing = f"attempt {launch.attempt}, requeued {launch.requeues}x" if launch.continues_job else ""
        ckpt_path, changed, size = agree_on_checkpoint(options.resume, options.allow_changes,
                                                       dataclasses.asdict(recipe), changeable(type(recipe)), rt,
                                                       self.run_dir, continuing)
        progress, loss_sums = Progress(), torch.zeros(2, dtype=torch.float64, device=rt.device)
        if ckpt_path:
            progress, loss_sums = resume_from(Path(ckpt_path), state, rt, global_batch=global_batch, epochs=epochs,
                                              max_steps=max_steps, classes=classes, shape=shape, size=size)
        self.progress = progress
        if progress.finished and run_is_done(progress, epochs, max_steps):
            longer = {"epochs": str(epochs + 4)} if progress.epoch > epochs else {}
            if max_steps and progress.step >= max_steps:
                longer["max_steps"] = "0"  # the cap ended it: lift the cap
            raise AlreadyComplete(
                f"run {self.run_dir} is already complete (epoch {progress.last_record.get('epoch', progress.epoch - 1)}, "
                f"step {progress.step}); to train it longer: {self.continue_command(**longer, allow_changes='')}")
        progress.finished = False
        return ckpt_path, changed, loss_sums

    def meet_the_other_ranks(self) -> None:
        """Right after the process group is made, two collectives: the run's directory (rank 0's
        choice) and every rank's host, process id and Slurm node, in rank order. Then, with
        several ranks, the hang watch, which needs both (its folder, the peers it names): from
        there on a rank that never answers at start-up (in a barrier, the staging lock, the
        first broadcast of the weights) is named as in training; one that hangs in those two
        collectives is bounded by --dist-timeout alone. The job's attempt becomes the highest
        any rank counts (torchrun's agents count their restarts each on their own)."""
        self.run_dir, self.new_run_dir = agree_on_run_dir(self.options, self.launch, self.rt)
        starts = gather_to_all((socket.gethostname(), self.launch.attempt, os.getpid(), time.strftime("%Y%m%d-%H%M%S"),
                                self.launch.node), "sharing the host names")
        self.launch = dataclasses.replace(self.launch, attempt=max((start[1] for start in starts),
                                                                   key=lambda a: int(a.split("/")[0])))
        self.peers = [Peer(rank, host, pid, node) for rank, (host, _, pid, _, node) in enumerate(starts)]
        self.watch_for_hangs(self.peers, attempt_started=starts[0][3])
        # Until the first step, each rank's own work (the data, the model) answers for it when
        # another rank waits; the collectives in between are labelled as themselves.
        hangs.doing("starting up (the data, the model, the checkpoint)", hangs.OWN)

    def watch_for_hangs(self, peers: list[Peer], attempt_started: str) -> None:
        """With several ranks, this rank's watchdog: a wait on the others longer than --hang-after
        leaves every rank's stacks in RUN_DIR/hangs/<attempt_started> and one line (hangs.py);
        the ranks that line names are left for the job's supervisor, which pins a failure on
        their nodes."""
        options = self.options
        hang_after = default_hang_after(options.dist_timeout) if options.hang_after == 0 else options.hang_after
        if self.rt.world_size > 1 and hang_after > 0:
            roots = (Path(sys.argv[0]).resolve().parent, KIT)  # (the recipe's folder, ddpkit/)

            def named(behind: list[Peer]) -> None:
                write_exit_file(self.launch, self.launch.paths.hung, hung_text([(peer.rank, peer.node) for peer in behind]))

            def resolved() -> None:
                remove_exit_file(self.launch, self.launch.paths.hung)

            self.hang_watch = HangWatch(rank=self.rt.rank, peers=peers, folder=self.run_dir / "hangs" / attempt_started,
                                        hang_after=hang_after, roots=roots, named=named, resolved=resolved).start()

    def start_log(self, saved_options: dict, hparams: HParams, hosts: list[str], classes: tuple[str, ...],
                  ckpt_path: str, changed: str) -> None:
        """(rank 0) Set aside the checkpoints this run no longer continues, start the run's log
        and record the command that continues it."""
        run_dir, step = self.run_dir, self.progress.step
        # Every rank has read its checkpoint by now: each met the others (a collective) after it.
        later = set_aside_checkpoints(run_dir, step, keep=ckpt_path)
        if later:
            print(f"warning: set aside {len(later)} checkpoint(s) numbered from step {step} on, which this run "
                  f"no longer continues, in {run_dir / CKPT_DIR / 'superseded'}", file=sys.stderr, flush=True)
        note = f"resumed with changed options (--allow-changes): {changed}" if changed else ""
        options = self.options
        plan = LogPlan(options=saved_options, hparams=hparams, environment=describe_environment(self.rt, self.launch, hosts),
                       classes=classes, resumed_step=step, log_every=options.log_every,
                       progress_every=options.progress_every, note=note)
        tracker = self.tracker(hparams.values, changed=changed) if options.tracker != "none" else NoTracker()
        self.logger = RunLogger(run_dir, plan, tracker=tracker)
        record_continue_command(self.launch, self.continue_command())

    def tracker(self, hparams: dict, recorded: bool = True, changed: str = "") -> Tracker:
        """(rank 0) The run's experiment tracker for this start, which records the start itself
        (`recorded`; not a finished run's start, which only sends what the tracker lacks) and the
        options it `changed`."""
        launch = self.launch
        start = Start(job=launch.job_id, requeues=launch.requeues, attempt=launch.attempt, world_size=self.rt.world_size,
                      step=self.progress.step, at=time.strftime("%Y-%m-%d %H:%M:%S %z"), changed=changed)
        return Tracker(self.options.tracker, self.run_dir, start=start if recorded else None, hparams=hparams,
                       identity={"run_dir": str(self.run_dir.resolve()), "launcher": launch.source})

    def catch_up_tracker(self) -> None:
        """(rank 0) A finished run started again with a --tracker: the tracker gets what it may
        still lack (it did not answer at the run's end): the epochs, the final figures (the last
        epoch's), and that the run finished."""
        if self.options.tracker == "none":
            return
        records = read_metrics_tolerantly(self.run_dir / "metrics.jsonl")
        if records:
            tracker = self.tracker({}, recorded=False)
            tracker.begin(records)
            tracker.finish(final_figures(records[-1]), records[-1]["step"])
            tracker.close(0)

    def describe_run(self, plan: RunPlan, ckpt_path: str) -> None:
        """Each rank's line (host, device, its share, threads), and rank 0's: the global batch,
        the steps, the checkpoint resumed from."""
        rt, launch, progress = self.rt, self.launch, self.progress
        cpus, threads = usable_cpus(), torch.get_num_threads()
        print(f"[rank {rt.rank}/{rt.world_size}] {socket.gethostname()} {rt.device} {rt.backend}: "
              f"{plan.batch_size} images a step, {plan.steps_per_epoch} steps per epoch, {threads} threads on {cpus} CPUs",
              flush=True)
        if threads > cpus:
            print(f"warning{self.who}: {threads} threads share {cpus} CPUs, which slows every step; under Slurm export "
                  "SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK (run_training.sbatch does), or set OMP_NUM_THREADS", flush=True)
        if rt.is_main:
            print(f"global batch {plan.global_batch} ({rt.world_size} x {plan.batch_size}), "
                  f"{plan.last_step} steps in all", flush=True)
            if ckpt_path:
                print(f"resumed from {ckpt_path}: epoch {progress.epoch}, step {progress.step} (attempt {launch.attempt}, "
                      f"requeued {launch.requeues}x)", flush=True)

    def watch_time_limit(self) -> TimeLimit:
        """(rank 0) The watch on the job's time limit: rank 0 alone watches the clock, and the
        per-step agreement tells the others."""
        time_limit = self.stop.time_limit = TimeLimit(read_job_times(os.environ, self.launch.job_id),
                                                      self.options.stop_before)
        if line := time_limit.start_line():
            print(line, flush=True)
        return time_limit

    def stop_here(self, path: Path) -> int:
        """A stop was agreed on and `path` saved: requeue the Slurm job, or say how to continue."""
        rt, stop = self.rt, self.stop
        if rt.is_main:
            why = (signal.Signals(stop.received).name if stop.received else
                   f"the time limit ({stop.time_limit.left():.0f} s left)" if stop.time_up else "another rank's signal")
            print(f"stopping on {why} at step {self.run.progress.step}: saved {path}", flush=True)
        barrier("the barrier before stopping")  # the checkpoint is complete before anyone can be killed
        # Ctrl-C asks to stop, not to be queued again. When the requeue succeeds, Slurm
        # ends every process here. Under run_training.sbatch the job's supervisor requeues
        # the job once the step has ended, on the host: in a container, scontrol may be missing.
        requeue_signal = os.environ.get(JobEnv.REQUEUE_SIGNAL)  # (the supervisor's SIGNAL)
        chains = False  # the supervisor requeues the job or, where Slurm does not, chains the one that continues it
        if rt.is_main and requeue_signal:
            # Its SIGNAL (USR1 by default) and the time limit ask for a requeue; another
            # signal (scancel's SIGTERM) only stops.
            why = signal.Signals(stop.received).name if stop.received else "the time limit came near" if stop.time_up else ""
            if why in ("SIG" + requeue_signal, "the time limit came near"):
                left = chains_left(os.environ)
                with contextlib.suppress(OSError):  # (else the supervisor prints the continue line)
                    write_exit_file(self.launch, self.launch.paths.requeue, f"{why}\n")
                    chains = left > 0
                then = f"it chains the job that continues the run (CHAIN={left})" if chains else \
                    "the line below continues the run"
                print(f"run_training.sbatch requeues the job when this step has ended; where it cannot, {then}",
                      flush=True)
        requeue_here = rt.is_main and not requeue_signal and stop.received != signal.SIGINT
        if requeue_here and self.launch.job_id:
            self.logger.close(EXIT_STOPPED)  # (a requeue that succeeds ends every process here: the tracker first)
        requeued = requeue_here and requeue_job(self.launch.job_id)  # (the supervisor's requeue too)
        if rt.is_main and not requeued and not chains:  # (run again, a line would queue a second job for the run)
            print(f"to continue: {self.continue_command()}", flush=True)
        barrier("the barrier before stopping")
        return EXIT_STOPPED

    def divergence_advice(self, err: Diverged) -> str:
        lower = self.continue_command(**self.on_divergence, allow_changes="")
        if self.rt.is_main:
            record_continue_command(self.launch, lower)
        return (f"{err}; nothing from this step on was saved. Resume from the last checkpoint with a lower learning "
                f"rate: {lower}")


def fail(err: Exception | str, code: int = EXIT_USAGE, who: str = "") -> int:
    print(f"{PROG}{who}: error: {err}", file=sys.stderr, flush=True)
    return code


def run_job(body: Callable[[Job], None], recipe_class: type, argv: list[str] | None = None, *, manual: str = "",
            stop: StopSignals | None = None, step_parts: StepParts | None = None) -> int:
    """Run `body` (the recipe's part: data, model, loop) as this process's part of the job
    and return the exit code; every ending is one line and a code (see the manual). With
    --check, the doctor runs instead, and times a step made of `step_parts` on every rank. After a
    lost peer (4) in a process group, the process ends here with that code instead
    (distributed.leave_after_lost_peer)."""
    startup = StartupClock()  # first: its "imports" are the time since the process started
    argv = sys.argv[1:] if argv is None else list(argv)
    stop, who = stop or StopSignals(), ""  # signal handlers first: one during start-up is kept, not fatal
    stop.loading = False  # (a Ctrl-C from here on ends below, after the teardown)
    code, launch, options, job = EXIT_BUG, None, None, None
    try:
        launch = read_launch_env(os.environ, alone_ok=True)
        who = f" [rank {launch.rank}/{launch.world_size} on {socket.gethostname()}]" if launch.world_size > 1 else ""
        recipe, options = parse_options(recipe_class, argv, manual)
        lacking = [name for name in RECIPE_FIELDS if not hasattr(recipe, name)]
        if lacking:  # (a copier's recipe: say so in one line, not as an AttributeError in mid-start)
            raise UsageError(f"the recipe's options ({recipe_class.__name__}) lack {', '.join(lacking)}, which the kit "
                             f"reads by name (ddpkit/api.py): keep {', '.join(RECIPE_FIELDS)} among them")
        if not options.download_only:
            launch = read_launch_env(os.environ)  # (a bare python in an salloc shell would train alone: refused)
        if options.check:
            stop.restore()  # nothing to save: a signal ends the check at once
            step = None
            if step_parts:
                images = functools.partial(step_parts.image_shape or default_image_shape, recipe, options)
                step = recipe_step(step_parts, recipe, images)
            code = check_job(options, launch, step)
            return code
        earlier = unfixable_earlier_exit(launch, who)
        if earlier:
            code = earlier
            return code
        with startup.phase("process group"):
            rt = init_distributed(options, launch)
        job = Job(recipe, options, launch, rt, stop, who, startup=startup)
        if not options.download_only:  # (staging alone starts no run)
            job.meet_the_other_ranks()
        code = run_body(body, job)
    except UsageError as err:
        code = fail(err, who=who)
    except Diverged as err:
        code = fail(err, EXIT_DIVERGED, who)
    except HeldUp as err:
        code = fail(err, EXIT_LOST_PEER, who)
    except KeyboardInterrupt:  # Ctrl-C before training started: nothing to save
        code = fail(INTERRUPTED, 128 + signal.SIGINT, who)
    except Exception as err:
        code = fail(*failure(err, job, options), who=who)
        if code == EXIT_NODE_FAULT:
            record_node_fault(node_fault(err), launch)
    finally:
        end_job(code, launch, job)
        stop.restore()
    return code


def unfixable_earlier_exit(launch: Launch, who: str) -> int:
    """The exit code of an earlier attempt of this job that a restart does not fix (said in
    one line), or 0."""
    earlier, rank_file = unfixable_exit(launch)
    if earlier:
        print(f"{PROG}{who}: not training again: an earlier attempt ended with exit code {earlier} ({rank_file}), "
              "which a restart does not fix; see its error above", file=sys.stderr, flush=True)
    return earlier


def run_body(body: Callable[[Job], None], job: Job) -> int:
    """`body` on `job`: 0 when it is done (or was done already), the stop's exit code when it
    stopped. A divergence comes back with the advice that resumes it."""
    try:
        body(job)
    except AlreadyComplete as done:
        if job.rt.is_main:
            print(done, flush=True)
            job.catch_up_tracker()
    except Stopped as stopped:  # (inside: a peer lost while stopping is a lost peer)
        return job.stop_here(Path(str(stopped)))
    except Diverged as err:  # (inside: a full disk while recording the advice is a storage problem)
        raise Diverged(job.divergence_advice(err)) from None
    return 0


def failure(err: Exception, job: Job | None, options: RunOptions | None) -> tuple[str, int]:
    """(the line, the exit code) of an exception no one expected by its type: a fault of this
    rank's node, a lost peer, a storage problem, an operation --deterministic refused, or a
    bug (its traceback printed)."""
    if fault := node_fault(err):  # (before a lost peer: NCCL's errors are c10d's too)
        first = str(err).strip().splitlines()[0][:200]
        return (f"{fault}: a fault of this rank's node, not of the run ({first}). Nothing saved is lost: "
                "run_training.sbatch restarts from the newest checkpoint, and leaves the node out once a second failure "
                "is pinned on it; elsewhere run the same command again, on other nodes"), EXIT_NODE_FAULT
    if is_lost_peer(err):
        return lost_peer_message(err, job.progress if job else Progress()), EXIT_LOST_PEER
    if problem := storage_problem(err, options):
        return problem, EXIT_USAGE
    if operation := nondeterministic_operation(err):
        device = job.rt.device if job else "this device"
        return (f"--deterministic: {operation} has no deterministic implementation on {device}, so this run cannot be "
                "bit-identical; leave out --deterministic, or change the model or step that uses it"), EXIT_USAGE
    traceback.print_exc()
    return f"unexpected {type(err).__name__} (the traceback above): not restarted, as it would happen again", EXIT_BUG


def end_job(code: int, launch: Launch | None, job: Job | None) -> None:
    """Record the exit code, close the log, release the run's directory, tear down the process group."""
    # A rank's 0 says that all it wrote is on disk: run_training.sbatch then counts the
    # run as done even if a rank dies of a signal in the teardown below. Any other code
    # first: after a failure, srun may end this process any moment now.
    if code != 0:
        record_exit(code, launch)
    if job:
        if job.hang_watch:
            job.hang_watch.stop()
        with contextlib.suppress(OSError):  # a full disk: the one line above says so already
            job.logger.close(code)
        if job.claim:
            job.claim.release(code)
        elif job.new_run_dir:  # (every rank tries: the last one to leave it finds it empty)
            with contextlib.suppress(OSError):
                job.run_dir.rmdir()
    if code == 0:
        record_exit(code, launch)
    teardown_distributed(together=code in (0, EXIT_STOPPED))
    if code == EXIT_LOST_PEER and job:
        leave_after_lost_peer(code)
