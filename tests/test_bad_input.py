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


def test_exit_code_through_the_command_line(tmp_path):
    result = run_single(["--batch-size", "0"], cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == "mnist_ddp.py: error: --batch-size must be at least 1, got 0"
    assert "Traceback" not in result.stderr + result.stdout
