"""Data staging for real over HTTP, from a server on 127.0.0.1 that the tests start and
that serves the bundled sample's files under MNIST's names (the tests supply their
checksums): one rank downloads behind the barrier while the other waits, two jobs
sharing a data directory take turns, and a missing network or a corrupt file ends in
one actionable line on every rank, with nothing half-written left behind, and what a
SIGKILLed stager left is removed by the next; a stager stopped while it holds the data
lock is named by the next, which waits for it at most --dist-timeout. A node-local --data-dir is expanded on
the node. (The node-local copy of an image folder: tests/unit/test_node_local_copy.py.)

    python -m pytest tests/runs/test_staging.py
"""

import hashlib
import http.server
import re
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from helpers import preloaded
from helpers.images import SAMPLE, make_image_folder, read_metrics
from helpers.processes import SCRIPT, assert_ok, clean_env, free_port, run_as_srun, run_python, run_single

FILES = ["train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"]
# torchvision sends two GETs per file: one that follows redirects, one for the data.
ONE_DOWNLOAD = {name: 2 for name in FILES}


def python_with_checksums(checksums: dict[str, str]) -> list[str]:
    """Run mnist_ddp.main with torchvision's MNIST checksums replaced by those of the served files."""
    code = ("import sys; from torchvision.datasets import MNIST; import mnist_ddp; "
            f"MNIST.resources = {sorted(checksums.items())!r}; sys.exit(mnist_ddp.main(sys.argv[1:]))")
    return [sys.executable, "-c", code]


class Mirror:
    """A loopback HTTP server serving `files`, each response `delay` seconds late; counts requests."""

    def __init__(self, files: dict[str, bytes], delay: float = 0.0):
        self.requests: Counter[str] = Counter()
        mirror = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                name = self.path.lstrip("/")
                mirror.requests[name] += 1
                time.sleep(delay)
                if name not in files:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(files[name])))
                self.end_headers()
                self.wfile.write(files[name])

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def sample_files() -> dict[str, bytes]:
    return {name: (SAMPLE / name).read_bytes() for name in FILES}


@pytest.fixture
def checksums(sample_files) -> dict[str, str]:
    return {name: hashlib.md5(data).hexdigest() for name, data in sample_files.items()}


@pytest.mark.slow
def test_rank0_downloads_behind_the_barrier(workdir, sample_files, checksums):
    mirror = Mirror(sample_files, delay=0.5)  # slow enough that an early reader would find nothing
    try:
        results = run_as_srun(2, ["--dataset", "mnist", "--data-mirror", mirror.url, "--epochs", "1", "--max-steps", "2"],
                              cwd=workdir, job_id="77", command=python_with_checksums(checksums))
    finally:
        mirror.close()
    for result in results:
        assert_ok(result)
    assert mirror.requests == ONE_DOWNLOAD  # one rank downloaded, once
    assert "[rank 0] staged MNIST in data/MNIST/raw" in results[0].stdout
    assert "staged" not in results[1].stdout
    assert sorted(p.name for p in (workdir / "data" / "MNIST" / "raw").iterdir()) == sorted(n[:-3] for n in FILES)
    assert not list((workdir / "data").glob(".staging-*"))
    assert read_metrics(workdir / "runs" / "job-77")[0]["test_images"] == 1000


@pytest.mark.slow
@pytest.mark.parametrize("locks", [{}, {"AID_LOCKS_EXCLUDE_NOTHING": "1"}], ids=["locks", "locks-exclude-nothing"])
def test_two_jobs_share_one_data_dir(workdir, sample_files, checksums, locks):
    """Also where fcntl's locks exclude nothing (NFS mounted nolock, between nodes): the data lock's lease holds."""
    mirror = Mirror(sample_files, delay=0.3)
    try:
        args = ["--dataset", "mnist", "--data-mirror", mirror.url, "--download-only"]
        # Both started before either is waited on (forked with torch imported: preloaded.py).
        jobs = [preloaded.Run(args, workdir, clean_env(**locks), code=python_with_checksums(checksums)[2])
                for _ in range(2)]
        try:
            results = [job.wait(120) for job in jobs]
        finally:
            for job in jobs:
                job.kill()
    finally:
        mirror.close()
    assert [r.returncode for r in results] == [0, 0], [(r.stdout, r.stderr) for r in results]
    assert mirror.requests == ONE_DOWNLOAD  # the second job waited, then found them
    assert sum("staged MNIST" in r.stdout for r in results) == 1


def test_offline_error_names_the_path_and_the_flags(workdir, checksums):
    closed = f"http://127.0.0.1:{free_port()}/"
    results = run_as_srun(2, ["--dataset", "mnist", "--data-mirror", closed], cwd=workdir,
                          command=python_with_checksums(checksums), timeout=120)
    for result in results:
        assert result.returncode == 2, result.stderr
        assert "Traceback" not in result.stderr
    error = results[0].stderr.strip().splitlines()[-1]
    assert error.startswith("mnist_ddp.py [rank 0/2 on ") and "]: error: cannot download MNIST into data/MNIST/raw (" in error
    assert "Connection refused" in error
    assert "--download-only" in error and "--data-mirror URL" in error and "--data-dir DIR" in error
    assert "another rank could not stage the data set" in results[1].stderr
    assert not (workdir / "data" / "MNIST" / "raw").exists()
    assert not list((workdir / "data").glob(".staging-*"))


def test_corrupt_download_is_refused(workdir, sample_files, checksums):
    damaged = {**sample_files, FILES[1]: sample_files[FILES[1]][:-10]}
    mirror = Mirror(damaged)
    try:
        results = run_as_srun(1, ["--dataset", "mnist", "--data-mirror", mirror.url], cwd=workdir,
                              command=python_with_checksums(checksums), timeout=120)
    finally:
        mirror.close()
    assert results[0].returncode == 2
    assert "cannot download MNIST into data/MNIST/raw" in results[0].stderr
    assert not (workdir / "data" / "MNIST" / "raw").exists()


def test_node_local_data_dir_is_expanded_on_the_node(workdir):
    """--node-data-dir '$MY_SCRATCH/data' is expanded by the process itself (on the compute
    node, not at submission); the first rank of the node copies the staged data there from
    --data-dir and reads that copy. An unset variable is one line and exit code 2."""
    scratch = workdir / "scratch"
    args = ["--epochs", "1", "--max-steps", "2", "--node-data-dir", "$MY_SCRATCH/data", "--run-dir", "runs/local"]
    result = run_single(args, cwd=workdir, MY_SCRATCH=str(scratch))
    assert_ok(result)
    assert f"[rank 0] copied MNISTSample to {scratch}/data on " in result.stdout
    local_raw, shared_raw = scratch / "data" / "MNISTSample" / "raw", workdir / "data" / "MNISTSample" / "raw"
    assert sorted(p.name for p in local_raw.iterdir()) == sorted(p.name for p in shared_raw.iterdir())
    assert (local_raw / "t10k-labels-idx1-ubyte").read_bytes() == (shared_raw / "t10k-labels-idx1-ubyte").read_bytes()
    unset = run_single(args, cwd=workdir)
    assert unset.returncode == 2
    assert "--node-data-dir $MY_SCRATCH/data: $MY_SCRATCH/data names a variable that is not set on " in unset.stderr


KILLED_MID_STAGING = """
import os, signal, sys
from ddpkit.data import staging
import mnist_ddp

def killed_mid_copy(cls, raw):
    raw.mkdir(parents=True)
    (raw / "train-images-idx3-ubyte.gz").write_bytes(b"half a download")
    os.kill(os.getpid(), signal.SIGKILL)

staging.copy_from_file_mirror = killed_mid_copy
sys.exit(mnist_ddp.main(sys.argv[1:]))
"""


def test_a_stager_stopped_while_it_holds_the_data_lock_is_named_by_the_next_within_dist_timeout(tmp_path):
    """A --download-only stager stops itself (SIGSTOP) as soon as it holds the data directory's
    lock (a test-only hook), for good. A run on the same data directory waits for the lock at
    most --dist-timeout (10 s), saying after 5 s who holds it, then ends with exit 4 (a restart
    may find the lock free) and one line that names the holder: its pid and host, and that it
    is stopped."""
    holder = subprocess.Popen([sys.executable, str(SCRIPT), "--download-only"], cwd=tmp_path,
                              env=clean_env(AID_STOP_LOCKED="1"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while "State:\tT" not in Path(f"/proc/{holder.pid}/status").read_text():  # (it stops holding the lock)
            assert time.monotonic() < deadline and holder.poll() is None, "the stager never took the lock"
            time.sleep(0.2)
        result = run_single(["--epochs", "1", "--dist-timeout", "10", "--run-name", "waits"], cwd=tmp_path, timeout=120)
    finally:
        holder.kill()
        holder.wait()
    assert result.returncode == 4, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 2 and "Traceback" not in result.stderr, result.stderr
    print("\n".join(lines))
    held_by = (rf"data/\.mnist_ddp\.lock, held by rank 0 \(pid {holder.pid} on {re.escape(socket.gethostname())}, since "
               r"[\d: -]+, stopped \(state T, [^)]*\)\)")
    assert re.fullmatch(rf"mnist_ddp\.py: waiting for the lock {held_by}, as long as it shows it is alive \(every 2 s\), "
                        r"and at most 10 s \(--dist-timeout\) after its last sign of life", lines[0]), lines[0]
    assert re.fullmatch(rf"mnist_ddp\.py: error: waited for the lock {held_by}, which showed no sign of life for 10 s "
                        r"\(--dist-timeout\): that process stopped or hangs\. Nothing saved is lost: .*", lines[1]), lines[1]
    assert not (tmp_path / "runs" / "waits").exists()


HOLDS_THE_LOCK = """
import sys
from pathlib import Path
from ddpkit.data.staging import data_lock
with data_lock(Path("data")):
    print("held", flush=True)
    sys.stdin.readline()  # (until the test says)
"""


def test_a_holder_that_works_longer_than_dist_timeout_keeps_the_next_waiting_until_it_is_done(tmp_path):
    """A process holds the data directory's lock, alive, for longer than a run's --dist-timeout
    (10 s) lasts (as a download of a large data set into a shared data directory does): the
    run waits for it, says after 5 s who holds it and that it waits as long as the holder shows
    it is alive, and stages the data once the holder lets go."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDS_THE_LOCK], cwd=tmp_path, env=clean_env(), text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    waiter = None
    try:
        assert holder.stdout.readline() == "held\n", "the holder never took the lock"
        waiter = preloaded.Run(["--download-only", "--dist-timeout", "10"], tmp_path, clean_env())
        said, deadline = Path(waiter.err), time.monotonic() + 120
        while not said.is_file() or "waiting for the lock" not in said.read_text():  # (5 s into its wait)
            assert time.monotonic() < deadline and waiter.process.is_alive(), "the run never waited for the lock"
            time.sleep(0.2)
        time.sleep(11)  # (past its --dist-timeout of waiting, 5 s already behind it)
        assert waiter.process.is_alive(), said.read_text()
        holder.communicate("\n", timeout=60)
        result = waiter.wait(120)
    finally:
        holder.kill()
        holder.wait()
        if waiter is not None:
            waiter.kill()
    assert result.returncode == 0, result.stderr[-3000:]
    held_by = rf"data/\.mnist_ddp\.lock, held by \(pid {holder.pid} on {re.escape(socket.gethostname())}, since [\d: -]+, alive"
    assert re.search(rf"mnist_ddp\.py: waiting for the lock {held_by}[^\n]*, as long as it shows it is alive \(every 2 s\), "
                     r"and at most 10 s \(--dist-timeout\) after its last sign of life\n", result.stderr), result.stderr
    assert "staged MNISTSample" in result.stdout, result.stdout[-3000:]


def test_staging_folder_left_by_a_kill_is_removed_at_the_next_staging(tmp_path):
    """A stager killed mid-copy (SIGKILL: no cleanup runs) leaves its .staging-* folder; the
    next one, holding the lock that every stager holds while its folder exists, removes it.
    The same holds for a node-local copy of an image folder."""
    (tmp_path / "killed.py").write_text(KILLED_MID_STAGING)
    killed = run_python(["--download-only"], tmp_path, script=tmp_path / "killed.py")
    assert killed.returncode == -9, killed.stderr[-3000:]
    [leftover] = (tmp_path / "data").glob(".staging-*")
    result = run_single(["--download-only"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not list((tmp_path / "data").glob(".staging-*"))
    assert f"removed {leftover.relative_to(tmp_path)}, left by a staging that never finished" in result.stderr

    from ddpkit.data.staging import copy_folder
    shared, local = make_image_folder(tmp_path / "shared", {"train": 1, "test": 1}, size=8), tmp_path / "node"
    (local / ".staging-x1y2z3" / "train" / "row").mkdir(parents=True)  # as a copy killed midway leaves it
    assert copy_folder(shared, local) is True
    assert sorted(p.name for p in local.iterdir()) == [".copied-from", ".mnist_ddp.lock", "test", "train"]
