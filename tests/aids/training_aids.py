"""Testing aids for runs of mnist_ddp.py, set by environment variables that users never see:

  AID_HANG=R:N[:gil]   rank R hangs as step N ends, in Python (with :gil, in a C call that
                       holds the interpreter's lock: no Python thread runs), until the test
                       or the launcher ends it
  AID_HANG_HOST=H:N    the ranks on the host named H hang as step N ends, or as the first step
                       of a start past N does: at every start (a sick node), in Python
  AID_STOP=R           rank R stops itself (SIGSTOP) at every start as it wraps its model in
                       DDP, before the broadcast of rank 0's weights (a node that hangs at start-up)
  AID_STOP_HOST=H      the same for every rank on the host named H
  AID_STOP_LOCKED=1    a process stops itself (SIGSTOP) as soon as it holds a data directory's
                       lock (staging.data_lock), before it writes into the directory
  AID_SLOW=R:S         rank R sleeps S seconds before each forward pass of its model (and
                       before each of the doctor's timed training steps, --check)
  AID_SLOW_HOST=H:S    every rank on the host named H (socket.gethostname()) sleeps S seconds
                       before each of the doctor's timed training steps: a slow node
  AID_SLOW_SAVE=R:N:S  rank R's checkpoint of step N takes S seconds more (a slow file system)
  AID_STEP_SECONDS=S   every rank's training step lasts at least S seconds: it sleeps the rest
                       after the step, so that a run has a known length whatever the load
  AID_NO_MODULE=M,N    the modules M and N cannot be imported, as if their packages were not
                       installed (read at start-up: for a fresh interpreter, not a forked run)
  AID_LOCKS_EXCLUDE_NOTHING=1|H  fcntl.lockf and fcntl.flock succeed at once and exclude
                       nobody, as between two nodes on an NFS mount with nolock or local_lock,
                       or Lustre with localflock (H: only in processes on the host named H)
  AID_ESTALE_OPENS=R:N[:P]  on rank R, the first N opens of a file whose name matches the
                       pattern P (fnmatch; ckpt-*.pt, the run's checkpoints, unless given)
                       raise OSError(ESTALE), as on NFS while another node's rename of the
                       file is news to this one; each says so on stderr (builtins.open, which
                       torch.load opens a path with, wrapped as ddpkit.run.checkpoints is imported)
  AID_EVENTS_FAIL_AFTER=N  after N writes to TensorBoard event files (events.out.tfevents.*),
                       each later one raises OSError(EIO), as on shared storage whose server
                       went away (TensorBoard's gfile, whose LocalFileSystem does each write of
                       its writer thread, wrapped as it is imported)
  AID_THREADS_AT_EXIT=1  a rank (RANK or SLURM_PROCID set) says on stderr, as its interpreter
                       begins to exit (atexit), which threads it still has, by their names in
                       /proc (read at start-up: for a fresh interpreter)

ddpkit holds no trace of them. A process gets them by importing this module before
ddpkit: sitecustomize.py beside it does so at start-up in every process whose PYTHONPATH
holds this folder (the tests' runs: forked, torchrun's workers, srun's tasks, Slurm jobs),
and the tests' forkserver imports it before it imports ddpkit. The module wraps
TrainingRun's methods as ddpkit.run.training_run is imported, the doctor's time_step as
ddpkit.run.doctor is, wrap_ddp as ddpkit.distributed is, data_lock as ddpkit.data.staging
is, builtins.open as ddpkit.run.checkpoints is and TensorBoard's LocalFileSystem as its gfile
is (or at once, if they already were). The
wrappers read the variables when they are called, so that a run forked from a process that
imported ddpkit before the run's environment was known reads its own; unset, they do nothing.

It runs in every Python process of a test, the Slurm supervisor's host python3 included:
standard library alone, nothing newer than Python 3.6, and nothing imported before it is used."""

import importlib.abc
import importlib.machinery
import os
import sys
import time

TRAINING_RUN = "ddpkit.run.training_run"
CHECKPOINTS = "ddpkit.run.checkpoints"
GFILE = "tensorboard.compat.tensorflow_stub.io.gfile"
DOCTOR = "ddpkit.run.doctor"
DISTRIBUTED = "ddpkit.distributed"
STAGING = "ddpkit.data.staging"


def fields(name):
    """The variable's fields (it split at ':'), or [] when it is unset."""
    value = os.environ.get(name, "")
    return value.split(":") if value else []


def aid(module):
    """Wrap the TrainingRun of `module` (ddpkit.run.training_run, just imported) with the aids, once."""
    run = module.TrainingRun
    if getattr(run, "aided", False):
        return
    run.aided = True
    plain_init, plain_epoch_begins, plain_step_done, plain_checkpoint = (
        run.__init__, run.epoch_begins, run.step_done, run.checkpoint)

    def __init__(self, *args, **kwargs):
        plain_init(self, *args, **kwargs)
        slow = fields("AID_SLOW")
        if slow and int(slow[0]) == self.rt.rank:
            seconds = float(slow[1])
            self.state["model"].register_forward_pre_hook(lambda *_: time.sleep(seconds))
        self.aid_step_began = time.perf_counter()

    def epoch_begins(self):
        epoch = plain_epoch_begins(self)
        self.aid_step_began = time.perf_counter()
        return epoch

    def step_done(self, loss, images):
        hang = fields("AID_HANG")
        if hang and (int(hang[0]), int(hang[1])) == (self.rt.rank, self.progress.step + 1):
            if hang[2:] == ["gil"]:
                import ctypes
                ctypes.PyDLL(None).sleep(3600)
            time.sleep(3600)
        sick = fields("AID_HANG_HOST")
        if sick:
            import socket
            if sick[0] == socket.gethostname() and self.progress.step + 1 >= int(sick[1]):
                time.sleep(3600)
        rest = self.aid_step_began + float(os.environ.get("AID_STEP_SECONDS") or 0) - time.perf_counter()
        if rest > 0:
            time.sleep(rest)
        plain_step_done(self, loss, images)
        self.aid_step_began = time.perf_counter()

    def checkpoint(self):
        slow = fields("AID_SLOW_SAVE")
        if slow and (int(slow[0]), int(slow[1])) == (self.rt.rank, self.progress.step):
            module.hangs.doing("saving a checkpoint", module.hangs.OWN)  # (what the hang report says it does)
            time.sleep(float(slow[2]))
        path = plain_checkpoint(self)
        self.aid_step_began = time.perf_counter()
        return path

    run.__init__, run.epoch_begins, run.step_done, run.checkpoint = __init__, epoch_begins, step_done, checkpoint


def doctor_delay():
    """The seconds that AID_SLOW_HOST or AID_SLOW adds to this rank's timed steps in the doctor."""
    import socket
    host = fields("AID_SLOW_HOST")
    if host and host[0] == socket.gethostname():
        return float(host[1])
    slow = fields("AID_SLOW")  # (the doctor times its step once the process group is up)
    if slow and int(slow[0]) == sys.modules["torch.distributed"].get_rank():
        return float(slow[1])
    return 0.0


def aid_doctor(module):
    """Wrap the time_step of `module` (ddpkit.run.doctor, just imported) with the aids, once: the
    step it times sleeps first."""
    plain_time_step = module.time_step
    if getattr(plain_time_step, "aided", False):
        return

    def time_step(step, device):
        seconds = doctor_delay()
        if not seconds:
            return plain_time_step(step, device)

        def slow_step():
            time.sleep(seconds)
            return step()
        return plain_time_step(slow_step, device)

    time_step.aided = True
    module.time_step = time_step


def stops_at_start_up(rank):
    """Whether AID_STOP or AID_STOP_HOST stops this rank as it wraps its model in DDP."""
    import socket
    stop, host = fields("AID_STOP"), fields("AID_STOP_HOST")
    return bool(stop and int(stop[0]) == rank or host and host[0] == socket.gethostname())


def aid_distributed(module):
    """Wrap the wrap_ddp of `module` (ddpkit.distributed, just imported), once: with AID_STOP
    or AID_STOP_HOST, the rank stops itself before DDP's broadcast of rank 0's weights, the
    first collective of a start once the ranks have met (a fixed point: no timing)."""
    plain_wrap = module.wrap_ddp
    if getattr(plain_wrap, "aided", False):
        return

    def wrap_ddp(model, rt):
        if stops_at_start_up(rt.rank):
            import signal
            os.kill(os.getpid(), signal.SIGSTOP)
        return plain_wrap(model, rt)

    wrap_ddp.aided = True
    module.wrap_ddp = wrap_ddp


def aid_staging(module):
    """Wrap the data_lock of `module` (ddpkit.data.staging, just imported), once: with
    AID_STOP_LOCKED=1, the process stops itself as soon as it holds the lock."""
    plain_lock = module.data_lock
    if getattr(plain_lock, "aided", False):
        return
    import contextlib

    @contextlib.contextmanager
    def data_lock(*args, **kwargs):
        with plain_lock(*args, **kwargs):
            if os.environ.get("AID_STOP_LOCKED") == "1":
                import signal
                os.kill(os.getpid(), signal.SIGSTOP)
            yield

    data_lock.aided = True
    module.data_lock = data_lock


def this_rank():
    """The rank of this process: the process group's once it is made, else the launcher's."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def aid_checkpoints(module):
    """Wrap builtins.open, once, as `module` (ddpkit.run.checkpoints) is imported: with
    AID_ESTALE_OPENS, the rank's first opens of the files it names raise ESTALE."""
    import builtins
    import errno
    import fnmatch

    plain_open = builtins.open
    if getattr(plain_open, "aided", False):
        return
    raised = []  # (this process's ESTALEs so far; a forked run starts with the forkserver's none)

    def estale_open(file, *args, **kwargs):
        stale = os.environ.get("AID_ESTALE_OPENS", "").split(":", 2)
        if len(stale) >= 2 and isinstance(file, (str, os.PathLike)) and len(raised) < int(stale[1]):
            name = os.path.basename(os.fspath(file))
            if fnmatch.fnmatch(name, stale[2] if len(stale) > 2 else "ckpt-*.pt") and this_rank() == int(stale[0]):
                raised.append(name)
                os.write(2, f"aid: rank {stale[0]} open {len(raised)} of {name}: ESTALE\n".encode())
                raise OSError(errno.ESTALE, os.strerror(errno.ESTALE), os.fspath(file))
        return plain_open(file, *args, **kwargs)

    estale_open.aided = True
    builtins.open = estale_open


def aid_gfile(module):
    """Wrap the write and append of `module`'s LocalFileSystem (TensorBoard's gfile, just
    imported), once: with AID_EVENTS_FAIL_AFTER=N, the writes to event files past the N-th raise EIO."""
    local = module.LocalFileSystem
    if getattr(local, "aided", False):
        return
    local.aided = True
    import errno
    written = []  # (this process's writes to event files so far)

    def failing(plain):
        def write(self, filename, *args, **kwargs):
            after = os.environ.get("AID_EVENTS_FAIL_AFTER", "")
            if after and os.path.basename(str(filename)).startswith("events.out.tfevents."):
                written.append(filename)
                if len(written) > int(after):
                    raise OSError(errno.EIO, os.strerror(errno.EIO))  # (as a write's error: it names no file)
            return plain(self, filename, *args, **kwargs)
        return write

    local.write, local.append = failing(local.write), failing(local.append)


AIDED = {TRAINING_RUN: aid, DOCTOR: aid_doctor, DISTRIBUTED: aid_distributed, STAGING: aid_staging,
         CHECKPOINTS: aid_checkpoints, GFILE: aid_gfile}  # module: what wraps it once it has run


class AidOnImport(importlib.abc.MetaPathFinder):
    """Finds the modules of AIDED as Python would, and has their aid wrap each once it has run."""

    def find_spec(self, name, path, target=None):
        if name not in AIDED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        plain_exec_module = spec.loader.exec_module

        def exec_module(module):
            plain_exec_module(module)
            AIDED[name](module)

        spec.loader.exec_module = exec_module
        return spec


def say_threads():
    """AID_THREADS_AT_EXIT: the names of this process's threads, on one line of stderr."""
    names = []
    for task in sorted(os.listdir("/proc/self/task")):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                names.append(comm.read().strip())
        except OSError:  # (a thread that ended meanwhile)
            pass
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID"))
    sys.stderr.flush()
    os.write(2, f"aid: rank {rank} threads at exit: {' '.join(names)}\n".encode())  # (one write: ranks share stderr)


def locks_exclude_nothing():
    """AID_LOCKS_EXCLUDE_NOTHING: wrap fcntl's two locks so that, while the variable asks for
    it when they are called, they lock nothing."""
    import fcntl

    def excludes_nothing():
        wanted = os.environ.get("AID_LOCKS_EXCLUDE_NOTHING", "")
        if wanted in ("", "1"):
            return wanted == "1"
        import socket
        return wanted == socket.gethostname()

    def wrapped(plain):
        def lock(fd, operation, *rest):
            return None if excludes_nothing() else plain(fd, operation, *rest)
        lock.aided = True
        return lock

    if not getattr(fcntl.lockf, "aided", False):
        fcntl.lockf, fcntl.flock = wrapped(fcntl.lockf), wrapped(fcntl.flock)


locks_exclude_nothing()
if os.environ.get("AID_THREADS_AT_EXIT") == "1" and (os.environ.get("RANK") or os.environ.get("SLURM_PROCID")):
    import atexit
    atexit.register(say_threads)
for hidden in filter(None, os.environ.get("AID_NO_MODULE", "").split(",")):
    sys.modules[hidden] = None  # (import raises ModuleNotFoundError, and find_spec finds nothing)
for imported in [name for name in AIDED if name in sys.modules]:
    AIDED[imported](sys.modules[imported])
if any(name not in sys.modules for name in AIDED) and not any(isinstance(f, AidOnImport) for f in sys.meta_path):
    sys.meta_path.insert(0, AidOnImport())
