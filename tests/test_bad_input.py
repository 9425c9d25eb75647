"""Every invalid option value a user can type ends in one line on stderr that says what
to do, and exit code 2: never a traceback, never a hang.

    python -m pytest tests/test_bad_input.py
"""

import os
import subprocess
import sys
import tempfile

import pytest
import torch

import mnist_ddp
from conftest import ROOT, clean_env, run_single


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch):
    for name in list(os.environ):
        if name not in clean_env():
            monkeypatch.delenv(name)


@pytest.mark.parametrize("argv, words", [
    (["--epochs", "-1"], "--epochs must be at least 1"),
    (["--epochs", "0"], "--epochs must be at least 1"),
    (["--epochs", "two"], "invalid int value"),
    (["--batch-size", "0"], "--batch-size must be at least 1"),
    (["--lr", "0"], "--lr must be a positive number"),
    (["--lr", "nan"], "--lr must be a positive number"),
    (["--weight-decay", "-1"], "--weight-decay must be 0 or more"),
    (["--dropout", "1"], "--dropout must be in [0, 1)"),
    (["--max-steps", "-5"], "--max-steps must be 0"),
    (["--dist-timeout", "0"], "--dist-timeout must be a positive number"),
    (["--log-every", "0"], "--log-every must be at least 1"),
    (["--dataset", "cifar10"], "invalid choice: 'cifar10'"),
    (["--model", "vgg"], "invalid choice: 'vgg'"),
    (["--backend", "mpi"], "invalid choice: 'mpi'"),
    (["--device", "tpu"], "invalid choice: 'tpu'"),
    (["--data-mirror", "ftp://example.org/"], "--data-mirror must be an http://"),
    (["--backend", "nccl", "--device", "cpu"], "--backend nccl needs --device cuda"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_bad_option(argv, words, capsys):
    assert mnist_ddp.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mnist_ddp.py: error: ")
    assert words in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message for machines without a GPU")
@pytest.mark.parametrize("argv, words", [
    (["--backend", "nccl"], "--backend nccl needs a CUDA GPU"),
    (["--device", "cuda"], "--device cuda needs a CUDA GPU"),
])
def test_gpu_options_without_gpu(argv, words, capsys):
    assert mnist_ddp.main(argv) == 2
    assert words in capsys.readouterr().err


def test_data_dir_that_is_a_file(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert mnist_ddp.main(["--data-dir", str(tmp_path / "file")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_data_dir_that_cannot_be_created(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert mnist_ddp.main(["--data-dir", str(tmp_path / "file" / "data")]) == 2
    assert "cannot write to --data-dir" in capsys.readouterr().err


def test_unreadable_data_dir():
    # Root reads anything, so as root the check runs as the unprivileged user nobody.
    with tempfile.TemporaryDirectory() as top:
        os.chmod(top, 0o755)
        locked = os.path.join(top, "locked")
        os.mkdir(locked, 0o000)
        cmd = [sys.executable, "-c", "import sys, mnist_ddp; sys.exit(mnist_ddp.main(sys.argv[1:]))", "--data-dir", locked]
        if os.geteuid() == 0:
            cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *cmd]
        result = subprocess.run(cmd, cwd=top, env=clean_env(HOME=top),
                                capture_output=True, text=True, timeout=120)
        os.chmod(locked, 0o755)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == f"mnist_ddp.py: error: --data-dir {locked} is not readable; fix its permissions or pass another --data-dir"


def test_help_lists_defaults(capsys):
    with pytest.raises(SystemExit) as exit_:
        mnist_ddp.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--batch-size BATCH_SIZE" in out and "(default: 128)" in out and "--data-mirror" in out
    assert "(default: )" not in out  # empty defaults are left out
    assert "Exit codes" in out and "  75  stopped by SIGUSR1/SIGTERM" in out and "How to launch" in out


NVIDIA_SMI = """#!/bin/sh
echo '| NVIDIA-SMI 535.104.05             Driver Version: 535.104.05   CUDA Version: 12.2     |'
"""


def test_gpus_given_that_torch_cannot_use_stop_the_run(tmp_path):
    """A job given a GPU (CUDA_VISIBLE_DEVICES=0) on a machine where torch sees none, as
    with a CUDA build newer than the driver: exit 2 with the versions and the pip line,
    not a quiet CPU run. The node's nvidia-smi is played by a script printing its header."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvidia-smi").write_text(NVIDIA_SMI)
    (tmp_path / "bin" / "nvidia-smi").chmod(0o755)
    path = f"{tmp_path / 'bin'}:{os.environ['PATH']}"
    result = run_single(["--max-steps", "2"], cwd=tmp_path, CUDA_VISIBLE_DEVICES="0", PATH=path)
    assert result.returncode == 2, result.stdout[-2000:]
    line = result.stderr.strip()
    assert "\n" not in line and line.startswith("mnist_ddp.py: error: this job was given GPUs (CUDA_VISIBLE_DEVICES=0) ")
    assert f"torch {torch.__version__} is built for CUDA {torch.version.cuda}" in line
    assert "the node's driver 535.104.05 runs CUDA up to 12.2" in line
    assert "pip install torch torchvision --index-url https://download.pytorch.org/whl/cu121" in line
    forced = run_single(["--device", "cpu", "--epochs", "1", "--max-steps", "2"], cwd=tmp_path,
                        CUDA_VISIBLE_DEVICES="0", PATH=path)
    assert forced.returncode == 0, forced.stderr[-2000:]


def run_with_read_only(directory, args, cwd):
    """mnist_ddp.py with `directory` bind-mounted read-only over itself, in a mount
    namespace of its own (as root, permissions alone would not stop a write)."""
    script = (f'mount --bind {directory} {directory} && mount -o remount,bind,ro {directory} && '
              f'! touch {directory}/probe 2>/dev/null && exec "$@"')
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
                           sys.executable, str(ROOT / "mnist_ddp.py"), *args],
                          cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=300)


def test_read_only_data_dir_that_holds_the_data_is_used(tmp_path):
    """A data directory staged by someone else and mounted read-only is read, not refused
    because its lock file cannot be opened; an empty read-only one is refused in one line."""
    assert run_single(["--download-only"], cwd=tmp_path).returncode == 0
    result = run_with_read_only(tmp_path / "data", ["--epochs", "1", "--max-steps", "2"], tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "staged" not in result.stdout
    empty = tmp_path / "empty"
    empty.mkdir()
    refused = run_with_read_only(empty, ["--data-dir", str(empty)], tmp_path)
    assert refused.returncode == 2
    assert refused.stderr.strip().endswith("(Read-only file system) and it does not hold MNISTSample yet; "
                                           "pass a writable --data-dir, or stage the data into it elsewhere first")


def test_exit_code_through_the_command_line(tmp_path):
    result = run_single(["--batch-size", "0"], cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == "mnist_ddp.py: error: --batch-size must be at least 1, got 0"
    assert "Traceback" not in result.stderr + result.stdout
