"""mnist_ddp.py runs without the seconds of importing torch each time: a server process
imports torch, torchvision, TensorBoard and ddpkit once (multiprocessing's forkserver), and
every run is a process forked from it that runs mnist_ddp.py as __main__, with its own
arguments, environment, working directory and output files, and exits with the script's
code. The script, its signal handlers and its exit codes are the ones users get; only the
imports were done before the fork. helpers/processes.py's run_single and run_as_srun start runs
this way; runs that test start-up itself are started afresh with subprocess. The server starts
with the testing aids (tests/aids/training_aids.py) imported, as every process the tests start
does, so that a forked run has them too."""

import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "mnist_ddp.py"
AIDS = ROOT / "tests" / "aids"  # the testing aids, which reach runs from outside (sitecustomize.py)
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torchvision", "torch.utils.tensorboard", "ddpkit.jobs", "ddpkit.data.imagesets",
           "ddpkit.data.staging", "helpers.preloaded"]

_context = multiprocessing.get_context("forkserver")
_context.set_forkserver_preload(PRELOAD)


def start_server() -> None:
    """Start the server, once, with the testing aids on its PYTHONPATH, as the tests start every
    process (helpers.processes.clean_env): its sitecustomize.py imports them before the server
    imports ddpkit, and they wrap TrainingRun as ddpkit imports it. The wrappers read their
    variables when a run calls them, so that each forked run reads its own. (A forked run is
    no new interpreter: the sitecustomize of its own PYTHONPATH never runs in it.)"""
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (str(AIDS), before)))
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


def run_script(args: list[str], cwd: str, env: dict[str, str], out: str, err: str, script: str, code: str | None) -> None:
    """In the forked process: become `python SCRIPT ARGS` (or `python -c CODE ARGS`) run in
    `cwd` with `env`."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    # OpenMP read OMP_NUM_THREADS when torch loaded, in the server: apply this run's, or the
    # default of a process started afresh (the CPUs it may use), shared among the pytest-xdist
    # workers that run beside it: more threads than CPUs spin in OpenMP's waits, and the
    # runs of two workers took up to twice as long.
    import torch
    workers = int(env.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS") or max(1, len(os.sched_getaffinity(0)) // workers)))
    # A process the forkserver starts inherits its start method: give back the platform's
    # default, so that DataLoader workers start as in a process started afresh (not through
    # a forkserver of this run's own, which would import torch again, seconds per epoch).
    multiprocessing.set_start_method(None, force=True)
    sys.argv = ["-c" if code else script, *args]
    status = 0
    try:
        if code:
            exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
        else:
            runpy.run_path(script, run_name="__main__")
    except SystemExit as done:
        if isinstance(done.code, int) or done.code is None:
            status = done.code or 0
        else:
            print(done.code, file=sys.stderr)
            status = 1
    except BaseException:
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


class Run:
    """One started run: wait() gives a subprocess.CompletedProcess, as subprocess.run would."""

    def __init__(self, args: list[str], cwd: Path, env: dict[str, str], script: Path = SCRIPT, code: str | None = None):
        self.args = [sys.executable, *(["-c", code] if code else [str(script)]), *args]
        self.files = tempfile.TemporaryDirectory(prefix="mnist-ddp-run-")
        self.out, self.err = (os.path.join(self.files.name, name) for name in ("out", "err"))
        self.process = _context.Process(target=run_script, args=(args, str(cwd), env, self.out, self.err, str(script), code))
        start_server()
        self.process.start()

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join()

    def wait(self, timeout: float) -> subprocess.CompletedProcess:
        self.process.join(timeout)
        if self.process.exitcode is None:
            self.kill()
            self.files.cleanup()
            raise subprocess.TimeoutExpired(self.args, timeout)
        with self.files:
            out, err = (Path(path).read_text(errors="replace") for path in (self.out, self.err))
        return subprocess.CompletedProcess(self.args, self.process.exitcode, out, err)
