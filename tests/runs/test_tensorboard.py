"""TensorBoard as users see it: tensorboard.sh starts a real TensorBoard server on the
runs of short real trainings, and the tests read the runs, tags and points back through
TensorBoard's own HTTP data API, including a resumed run (no doubled steps). The server
listens on 127.0.0.1 only unless asked, moves to the next port when its port is taken,
prints the tunnel command, and stops on Ctrl-C. Images, text and hparams are read from
the event files with TensorBoard's reader. On shared storage: an event file whose end first
reads as zeros (NFS) stops TensorBoard's reading of it until a restart, whatever its loader;
a run whose event file's writes fail warns once and trains on.

    python -m pytest tests/runs/test_tensorboard.py
"""

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.tensorboard import SummaryWriter

from helpers.images import on_folder, read_metrics
from helpers.pages import assert_quoted_whole
from helpers.processes import ROOT, assert_ok, clean_env, free_port, run_single

# Every test here shares the module's four runs (logdir): the whole file is one long run.
pytestmark = pytest.mark.slow

TENSORBOARD_SH = ROOT / "tensorboard.sh"
SHORT = ["--epochs", "2", "--max-steps", "60", "--log-every", "10", "--ckpt-every", "0"]


@pytest.fixture(scope="module")
def logdir(tmp_path_factory) -> Path:
    """Three runs side by side: a, b, and c, which was stopped at step 25 and resumed. b is
    only read for its tags: 10 steps (one logged point, one evaluation) hold them all."""
    workdir = tmp_path_factory.mktemp("tb")
    for name, extra in (("a", []), ("b", ["--lr", "1e-3", "--max-steps", "10"]),
                        ("c", ["--ckpt-every", "5", "--interrupt-at", "25:USR1"])):
        result = run_single([*SHORT, *extra, "--run-dir", f"runs/{name}"], cwd=workdir)
        assert result.returncode == (75 if extra[-1:] == ["25:USR1"] else 0), result.stderr
    assert_ok(run_single([*SHORT, "--ckpt-every", "5", "--run-dir", "runs/c"], cwd=workdir))
    return workdir / "runs"


def start(args: list[str], cwd: Path, **env: str) -> subprocess.Popen:
    """tensorboard.sh as a terminal starts it: with SIGINT as Ctrl-C has it, even where the
    tests themselves run as a background job of a non-interactive shell, which starts with
    SIGINT ignored (and so would TensorBoard, which then never stops on it)."""
    env = clean_env(PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", **env)
    return subprocess.Popen([str(TENSORBOARD_SH), *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def get_json(port: int, path: str):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
        return json.load(response)


def wait_for_runs(port: int, runs: set[str], server: subprocess.Popen, seconds: float = 90) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert server.poll() is None, f"tensorboard.sh exited: {server.communicate()}"
        try:
            if set(get_json(port, "/data/runs")) >= runs:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"TensorBoard did not show {runs} on port {port} within {seconds} s")


def listening_addresses(port: int) -> set[str]:
    lines = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True, check=True).stdout
    return {line.split()[3].rsplit(":", 1)[0] for line in lines.splitlines()}


def stop(server: subprocess.Popen) -> tuple[str, str]:
    os.killpg(server.pid, signal.SIGINT)  # what Ctrl-C in the terminal sends
    out, err = server.communicate(timeout=30)
    return out, err


def test_server_shows_the_runs_scalars_and_points(logdir):
    port = free_port()
    server = start(["--logdir", str(logdir), "--port", str(port)], cwd=logdir.parent)
    try:
        wait_for_runs(port, {"a", "b", "c"}, server)
        assert listening_addresses(port) == {"127.0.0.1"}
        tags = get_json(port, "/data/plugin/scalars/tags")
        expected = {"train/loss", "train/batch_loss", "test/loss", "test/accuracy", "train/lr",
                    "speed/images_per_s", "speed/epoch_s", "final/test_accuracy"}
        for run in ("a", "b", "c"):
            assert expected <= set(tags[run])
        def points(run, tag):
            return get_json(port, f"/data/plugin/scalars/scalars?run={run}&tag={urllib.request.quote(tag, safe='')}")
        assert [p[1] for p in points("a", "test/accuracy")] == [32, 60]
        assert [p[1] for p in points("a", "train/batch_loss")] == [10, 20, 30, 40, 50, 60]
        # c was stopped at step 25 (a checkpoint step reads its own agreement) and resumed from
        # its checkpoint there: every step once.
        assert [p[1] for p in points("c", "train/batch_loss")] == [10, 20, 30, 40, 50, 60]
        assert [p[1] for p in points("c", "test/accuracy")] == [32, 60]
        assert get_json(port, "/data/plugin/scalars/scalars?run=a&tag=test%2Faccuracy")[-1][2] > 0.5
    finally:
        out, err = stop(server)
    assert server.returncode == 0, err
    assert f"ssh -N -L {port}:localhost:{port} " in out
    assert f"then browse to http://localhost:{port}/" in out


def test_busy_port_moves_to_the_next(logdir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with socket.socket() as probe:  # make sure the next port is free for the test
            if probe.connect_ex(("127.0.0.1", port + 1)) == 0:
                pytest.fail(f"port {port + 1} is in use; cannot test the move")
        server = start(["--logdir", str(logdir), "--port", str(port)], cwd=logdir.parent)
        try:
            wait_for_runs(port + 1, {"a"}, server)
        finally:
            out, _ = stop(server)
    assert f"tensorboard.sh: port {port} is taken; using {port + 1}" in out


def test_bind_all_is_explicit_and_warns(logdir):
    port = free_port()
    server = start(["--logdir", str(logdir), "--port", str(port), "--bind-all"], cwd=logdir.parent)
    try:
        wait_for_runs(port, {"a"}, server)
        assert listening_addresses(port) & {"0.0.0.0", "*", "[::]"}
    finally:
        _, err = stop(server)
    assert "warning: --bind-all: every user who can reach" in err


def test_missing_tensorboard_is_explained(tmp_path):
    (tmp_path / "runs").mkdir()
    result = subprocess.run([str(TENSORBOARD_SH)], cwd=tmp_path, env=clean_env(PATH="/usr/bin:/bin", VENV=str(tmp_path / "nope")),
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert "tensorboard is not installed here: activate the virtual environment" in result.stderr


def test_missing_log_dir_is_explained(tmp_path):
    result = subprocess.run([str(TENSORBOARD_SH), "--logdir", "nowhere"], cwd=tmp_path, env=clean_env(),
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "log directory 'nowhere' does not exist" in result.stderr


def test_images_text_and_hparams_in_the_event_files(logdir):
    events = EventAccumulator(str(logdir / "a"), size_guidance={"images": 0, "tensors": 0})
    events.Reload()
    images = set(events.Tags()["images"])
    assert {"test/predictions", "test/misclassified", "test/confusion_matrix"} <= images
    assert [e.step for e in events.Images("test/confusion_matrix")] == [32, 60]
    grid = events.Images("test/predictions")[0]
    assert (grid.width, grid.height) == (8 * 56, 4 * (56 + 14))  # 32 captioned images, 8 a row
    tensors = set(events.Tags()["tensors"])
    assert {"config/text_summary", "environment/text_summary", "log/text_summary"} <= tensors
    lines = [e.tensor_proto.string_val[0].decode() for e in events.Tensors("log/text_summary")]
    assert len(lines) == 3 and lines[0].startswith("`epoch   1 | train loss ") and lines[2].startswith("`epoch   2 |")
    assert re.fullmatch(r"about \d+ s to finish at this speed", lines[1])  # after the first epoch (no Slurm: no limit)
    hparams = events.PluginTagToContent("hparams")
    assert "_hparams_/session_start_info" in hparams
    assert b"batch_size" in hparams["_hparams_/session_start_info"]


def scalar_records(folder: Path, steps: range) -> tuple[Path, bytes]:
    """An event file in `folder` that holds the scalar x at `steps`, and its records after the
    first (the file's version: records are self-contained, so another file's can follow it)."""
    with SummaryWriter(str(folder)) as writer:
        for step in steps:
            writer.add_scalar("x", step, step)
    path = next(folder.glob("events.out.tfevents.*"))
    data = path.read_bytes()
    return path, data[8 + 4 + struct.unpack("<Q", data[:8])[0] + 4:]


def wait_for_points(port: int, server: subprocess.Popen, want: int, seconds: float = 60) -> list[int]:
    deadline = time.monotonic() + seconds
    while True:
        assert server.poll() is None, f"tensorboard.sh exited: {server.communicate()}"
        with contextlib.suppress(OSError, ValueError):
            steps = [p[1] for p in get_json(port, "/data/plugin/scalars/scalars?run=r&tag=x")]
            if len(steps) >= want or time.monotonic() > deadline:
                return steps
        time.sleep(0.5)


# TensorBoard's Python loader, with the two flags whose help speaks of files that change.
LEGACY_LOADER = ["--", "--load_fast=false", "--reload_multifile", "true", "--detect_file_replacement", "true"]


def test_an_event_file_whose_end_first_reads_as_zeros_stops_tensorboard_until_it_restarts(tmp_path):
    """What docs/tensorboard.md says of NFS: pages that arrive after the file's new length
    (zeros first) stop TensorBoard's reading of the file for good, its fast loader and
    LEGACY_LOADER alike; a restart reads it whole."""
    event_file, _ = scalar_records(tmp_path / "logs" / "r", range(3))
    _, later = scalar_records(tmp_path / "later", range(3, 6))
    legacy = tmp_path / "legacy"
    legacy_file = Path(shutil.copytree(tmp_path / "logs", legacy / "logs")) / "r" / event_file.name
    ports, servers = [free_port(), free_port()], []
    try:
        for port, logs, extra in zip(ports, (tmp_path / "logs", legacy / "logs"), ([], LEGACY_LOADER),
                                     strict=True):
            servers.append(start(["--logdir", str(logs), "--port", str(port), *extra], cwd=tmp_path))
        assert [wait_for_points(port, server, 3) for port, server in zip(ports, servers, strict=True)] == [[0, 1, 2]] * 2
        for path in (event_file, legacy_file):
            with open(path, "ab") as grown:
                grown.write(bytes(len(later)))  # the new length, its pages not there yet
        time.sleep(3)  # (3 reloads: --reload_interval 1)
        for path in (event_file, legacy_file):
            with open(path, "r+b") as arrived:
                arrived.seek(-len(later), os.SEEK_END)
                arrived.write(later)
        assert [wait_for_points(port, server, 6, seconds=4) for port, server in zip(ports, servers, strict=True)] == [[0, 1, 2]] * 2
    finally:
        outputs = [stop(server) for server in servers]
    assert "rustboard_core::run] Read error in " in outputs[0][1]
    assert "Read error" not in outputs[1][0] + outputs[1][1]
    again = start(["--logdir", str(tmp_path / "logs"), "--port", str(ports[0])], cwd=tmp_path)
    try:
        assert wait_for_points(ports[0], again, 6) == list(range(6))
    finally:
        stop(again)


def test_an_event_file_whose_writes_fail_mid_run_warns_once_and_the_run_goes_on(tiny_folder, workdir):
    # The event file's writes fail (EIO) from its 12th on, in the first epoch: shared storage lost.
    result = run_single([*on_folder(tiny_folder), "--epochs", "3", "--batch-size", "8", "--log-every", "1",
                         "--run-dir", "runs/r"], cwd=workdir, AID_EVENTS_FAIL_AFTER="12")
    assert_ok(result)
    assert [m["epoch"] for m in read_metrics(workdir / "runs" / "r")] == [1, 2, 3]
    event_file = next((workdir / "runs" / "r").glob("events.out.tfevents.*"))
    warnings = [line for line in result.stderr.splitlines() if "event file" in line or "Traceback" in line]
    assert warnings == [f"warning: cannot write the TensorBoard event file {event_file.relative_to(workdir)} (Input/output "
                        "error): TensorBoard shows no more of this run; runs/r/metrics.jsonl and the checkpoints in "
                        "runs/r/checkpoints still hold its record, and training goes on"], result.stderr
    assert_quoted_whole("docs/tensorboard.md", warnings[0])
