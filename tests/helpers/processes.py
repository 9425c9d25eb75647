"""Start mnist_ddp.py the way users do (plain, torchrun, as srun would) in processes of their
own, with a clean environment: os.environ without any launcher's variables, PYTHONPATH the
project and tests/aids (a `sitecustomize` there reaches runs from outside: STYLE.md rule 20).
Plain and srun-style runs are forked from a process that imported torch once (preloaded.py)."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from helpers import preloaded

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "mnist_ddp.py"
AIDS = preloaded.AIDS  # the testing aids (tests/aids/training_aids.py), which reach runs from outside

LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")


def clean_env(**extra: str) -> dict[str, str]:
    """os.environ without any launcher's variables (the tests may themselves run under one)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env["PYTHONUNBUFFERED"] = "1"
    # ROOT for commands that import mnist_ddp from another directory; tests/aids for the hooks
    # that tests reach runs with from outside
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(AIDS)])
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_single(args: list[str], cwd: Path, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    """`python mnist_ddp.py ARGS` in a process of its own (forked with torch imported: preloaded.py)."""
    return preloaded.Run(args, cwd, clean_env(**env)).wait(timeout)


def run_python(args: list[str], cwd: Path, code: str = "", script: Path | None = None, timeout: float = 300,
               **env: str) -> subprocess.CompletedProcess:
    """`python -c CODE ARGS` or `python SCRIPT ARGS` (a user's edit of mnist_ddp.py, a test's
    driver), forked with torch imported as run_single is."""
    return preloaded.Run(args, cwd, clean_env(**env), script=script or SCRIPT, code=code or None).wait(timeout)


def run_torchrun(nproc: int, args: list[str], cwd: Path, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(SCRIPT), *args]
    return subprocess.run(cmd, cwd=cwd, env=clean_env(OMP_NUM_THREADS="1", **env), capture_output=True, text=True,
                          timeout=timeout)


def run_as_srun(ntasks: int, args: list[str], cwd: Path, timeout: float = 300, job_id: str = "4242",
                command: list[str] | None = None, detach: bool = False, env: dict[str, str] | None = None,
                master_port: int = 0):
    """One process per task with the variables srun gives its tasks on one node (job_id ""
    leaves SLURM_JOB_ID out), and `env`; MASTER_PORT `master_port`, or a free one; SIGINT as
    srun's tasks have it, whatever this process's (see press_ctrl_c). Returns the finished
    results, or with detach the processes."""
    extra = env or {}
    host = socket.gethostname()
    port = str(master_port or free_port())
    procs = []
    for rank in range(ntasks):
        env = clean_env(**extra, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NTASKS=str(ntasks),
                        SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS=str(ntasks), SLURM_JOB_NODELIST=host,
                        SLURM_STEP_NODELIST=host, SLURM_CPUS_PER_TASK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        if job_id:
            env["SLURM_JOB_ID"] = job_id
        code = command[2] if command and command[:2] == [sys.executable, "-c"] else None
        if not detach and (code or not command):  # forked with torch imported (preloaded.py)
            procs.append(preloaded.Run(args, cwd, env, code=code))
            continue
        cmd = command or [sys.executable, str(SCRIPT)]
        procs.append(subprocess.Popen([*cmd, *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)))
    if detach:
        return procs
    if all(isinstance(run, preloaded.Run) for run in procs):
        try:
            return [run.wait(timeout) for run in procs]
        finally:
            for run in procs:
                run.kill()
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return results


def press_ctrl_c(command: list[str], cwd: Path, times: int = 1, **env: str) -> tuple[int, str]:
    """Start `command` as a terminal would start it, and once it logged its first epoch send
    SIGINT to its whole process group `times` times, 0.2 s apart, as Ctrl-C does. The
    preexec_fn matters: a non-interactive shell starts background jobs with SIGINT ignored,
    and Python then installs no KeyboardInterrupt handler. Returns (exit code, output)."""
    proc = subprocess.Popen(command, cwd=cwd, env=clean_env(**{"OMP_NUM_THREADS": "1", **env}), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("epoch   1 |"):
            for _ in range(times):
                os.killpg(proc.pid, signal.SIGINT)
                time.sleep(0.2)
            break
    rest, _ = proc.communicate(timeout=300)
    return proc.returncode, "".join(seen) + rest


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"
