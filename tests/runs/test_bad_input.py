"""Every invalid option value a user can type ends in one line on stderr that says what
to do, and exit code 2: never a traceback, never a hang (REFUSALS: one row each, the
option, the code and the line). So do a log or run directory
that is full, read-only or not a directory (made real with tmpfs and read-only mounts:
as root, permissions alone would stop nothing) and a checkpoint that no longer fits the
model; and a full disk loses nothing already saved. An image folder that training could not
read (a broken symlink, an unreadable or damaged image, fewer images than ranks) is refused
before anything trains, and `--download-only` checks it as training would; so are a global
batch larger than the training set and a model name that build_model has no branch for.

    python -m pytest tests/runs/test_bad_input.py
"""

import errno
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import mnist_ddp
from helpers.images import TINY, make_image_folder, on_folder
from helpers.processes import ROOT, SCRIPT, clean_env, run_as_srun, run_python, run_single


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch):
    for name in list(os.environ):
        if name not in clean_env():
            monkeypatch.delenv(name)


# ----------------------------------------------------------------------------- one option, one line

NO_GPU_HERE = pytest.mark.skipif(torch.cuda.is_available(), reason="the line for machines without a GPU")

# Each bad option as a user types it, the exit code and the one line on stderr after
# "mnist_ddp.py: error: " (a regex; FILE is a regular file in the run's directory).
REFUSALS = [
    pytest.param(["--epochs", "-1"], 2, r"--epochs must be at least 1, got -1", id="epochs-below-1"),
    pytest.param(["--epochs", "0"], 2, r"--epochs must be at least 1, got 0", id="epochs-0"),
    pytest.param(["--epochs", "two"], 2, r"argument --epochs: invalid int value: 'two' \(see --help\)", id="epochs-in-words"),
    pytest.param(["--global-batch", "0"], 2, r"--global-batch must be at least 1, got 0", id="global-batch-0"),
    pytest.param(["--batch-size", "-1"], 2, r"--batch-size must be 0 \(from --global-batch\) or more, got -1",
                 id="batch-size-below-0"),
    pytest.param(["--lr", "0"], 2, r"--lr must be a positive number, got 0\.0", id="lr-0"),
    pytest.param(["--lr", "nan"], 2, r"--lr must be a positive number, got nan", id="lr-nan"),
    pytest.param(["--warmup", "1.5"], 2, r"--warmup must be in \[0, 1\], got 1\.5", id="warmup-above-1"),
    pytest.param(["--mirror-images"], 2, r"--mirror-images is for --dataset folder; mnist-sample's entry in DATASETS "
                 r"\(mnist_ddp\.py\) says whether its images may be mirrored: drop --mirror-images", id="mirror-images-not-a-folder"),
    pytest.param(["--weight-decay", "-1"], 2, r"--weight-decay must be 0 or more, got -1\.0", id="weight-decay-below-0"),
    pytest.param(["--dropout", "1"], 2, r"--dropout must be in \[0, 1\), got 1\.0", id="dropout-1"),
    pytest.param(["--max-steps", "-5"], 2, r"--max-steps must be 0 \(no limit\) or more, got -5", id="max-steps-below-0"),
    pytest.param(["--dist-timeout", "0"], 2, r"--dist-timeout must be a positive number of seconds, got 0\.0",
                 id="dist-timeout-0"),
    pytest.param(["--log-every", "0"], 2, r"--log-every must be at least 1, got 0", id="log-every-0"),
    pytest.param(["--dataset", "cifar10"], 2, r"argument --dataset: invalid choice: 'cifar10' \(choose from .*\) \(see --help\)",
                 id="unknown-dataset"),
    pytest.param(["--model", "vgg"], 2, r"argument --model: invalid choice: 'vgg' \(choose from .*\) \(see --help\)",
                 id="unknown-model"),
    pytest.param(["--backend", "mpi"], 2, r"argument --backend: invalid choice: 'mpi' \(choose from .*\) \(see --help\)",
                 id="unknown-backend"),
    pytest.param(["--device", "tpu"], 2, r"argument --device: invalid choice: 'tpu' \(choose from .*\) \(see --help\)",
                 id="unknown-device"),
    pytest.param(["--data-mirror", "ftp://example.org/"], 2,
                 r"--data-mirror must be an http://, https:// or file:// URL, got 'ftp://example\.org/'", id="mirror-not-http"),
    pytest.param(["--backend", "nccl", "--device", "cpu"], 2, r"--backend nccl needs --device cuda \(or auto\); .*",
                 id="nccl-on-cpu"),
    pytest.param(["--no-such-flag"], 2, r"unrecognized arguments: --no-such-flag \(see --help\)", id="unknown-flag"),
    pytest.param(["--resume", "x" * 5000], 2, r"--resume x{5000}: no such checkpoint file; .*",  # too long a file name
                 id="resume-name-too-long"),
    pytest.param(["--stop-before", "-1"], 2, r"--stop-before must be auto or a number of minutes \(0: never\), got '-1'",
                 id="stop-before-below-0"),
    pytest.param(["--stop-before", "nan"], 2, r"--stop-before must be auto or a number of minutes \(0: never\), got 'nan'",
                 id="stop-before-nan"),
    pytest.param(["--backend", "nccl"], 2, r"--backend nccl needs a CUDA GPU but torch sees none .*", id="nccl-without-gpu",
                 marks=NO_GPU_HERE),
    pytest.param(["--device", "cuda"], 2, r"--device cuda needs a CUDA GPU but torch sees none .*", id="cuda-without-gpu",
                 marks=NO_GPU_HERE),
    pytest.param(["--data-dir", "FILE"], 2, r"--data-dir FILE is not a directory", id="data-dir-a-file"),
    pytest.param(["--data-dir", "FILE/data"], 2, r"cannot write to --data-dir FILE/data \(Not a directory\) .*",
                 id="data-dir-in-a-file"),
    # The seed goes into seed * 100_003 + epoch, a 64-bit generator seed (epoch_shard): too large a
    # --seed crashed at the first epoch.
    pytest.param(["--seed", "200000000000000", "--epochs", "1", "--max-steps", "2"], 2,
                 r"--seed must be from -10000000000000 to 10000000000000, got 200000000000000", id="seed-overflows"),
    pytest.param(["--log-dir", "FILE", "--epochs", "1", "--max-steps", "2"], 2,
                 r"FILE is not a directory; pass another --log-dir/--run-dir", id="log-dir-a-file"),
    pytest.param(["--run-dir", "/dev/null", "--epochs", "1", "--max-steps", "2"], 2,
                 r"/dev/null is not a directory; pass another --log-dir/--run-dir", id="run-dir-a-device"),
]


@pytest.mark.parametrize("args, code, line", REFUSALS)
def test_a_bad_option_exits_with_one_line(tmp_path, args, code, line):
    """The script as users run it: the exit code, one line on stderr, and no traceback."""
    file = tmp_path / "a-file"
    file.write_text("x")
    result = run_single([arg.replace("FILE", str(file)) for arg in args], cwd=tmp_path)
    assert result.returncode == code, result.stderr[-3000:]
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stdout, result.stderr[-3000:]
    assert re.fullmatch(r"mnist_ddp\.py: error: " + line.replace("FILE", re.escape(str(file))), result.stderr.strip()), \
        result.stderr


# ----------------------------------------------------------------------------- refusals a row cannot set up

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


@pytest.mark.slow
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


# ----------------------------------------------------------------------------- numbers that overflow later

def test_the_largest_seed_allowed_trains(tmp_path):
    """The bound of --seed (a larger one is refused: REFUSALS' seed-overflows) still trains."""
    largest = run_single(["--seed", "10000000000000", "--epochs", "1", "--max-steps", "2"], cwd=tmp_path)
    assert largest.returncode == 0, largest.stderr[-2000:]


@pytest.mark.parametrize("timeout, shown", [("1e16", "1e+16"), ("1e-9", "1e-09")])
def test_dist_timeout_out_of_range_is_refused_on_every_rank(tmp_path, timeout, shown):
    """Under 2 ranks, 1e16 s overflowed timedelta (a traceback, exit 1) and 1e-9 s made the
    ranks take each other for dead (exit 4, which run_training.sbatch restarts forever)."""
    for rank, result in enumerate(run_as_srun(2, ["--dist-timeout", timeout, "--epochs", "1", "--max-steps", "2"],
                                              cwd=tmp_path)):
        assert result.returncode == 2, result.stderr[-2000:]
        line = result.stderr.strip()
        assert "\n" not in line and line.startswith(f"mnist_ddp.py [rank {rank}/2 on ")
        assert line.endswith(f"]: error: --dist-timeout must be from 10 to 604800 seconds (a week), got {shown}")


# ----------------------------------------------------------------------------- where the run writes

def run_with_mounts(setup: str, args, cwd):
    """mnist_ddp.py after the shell commands `setup` (mounts) ran in a mount namespace of
    its own, so that nothing of them outlives the command."""
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", f'{setup} && exec "$@"', "sh",
                           sys.executable, str(ROOT / "mnist_ddp.py"), *args],
                          cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=300)


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MB file system: the run directory, run.json and the event file fit in it, one
    checkpoint of the default CNN (6.6 MB: the weights, their average and AdamW's state)
    does not."""
    disk = tmp_path / "small-disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], check=True)
    yield disk
    subprocess.run(["umount", str(disk)], check=True)


def test_full_disk_during_a_checkpoint_save_is_one_line_and_leaves_no_temporary_file(tmp_path, small_disk):
    """The first checkpoint does not fit: one line that names it and says what to do, exit
    2, and its partial temporary file removed, or the disk stays full for every later
    attempt. The same command again meets the same clear line."""
    args = ["--epochs", "1", "--max-steps", "3", "--log-dir", str(small_disk), "--run-name", "full"]
    expected = (f"mnist_ddp.py: error: cannot write {small_disk}/full/checkpoints/ckpt-00000003.pt (No space left on "
                "device); free space there or pass another --log-dir/--run-dir")
    for attempt in (1, 2):
        result = run_single(args, cwd=tmp_path)
        assert result.returncode == 2, result.stderr[-3000:]
        assert "Traceback" not in result.stderr
        if attempt == 1:
            assert result.stderr.strip() == expected
        else:  # (a warning about the earlier attempt's logs may come first)
            assert result.stderr.strip().splitlines()[-1] == expected
        assert [p.name for p in small_disk.rglob("*tmp*")] == []
        exit_code = small_disk / "full" / "exit-code"
        assert not exit_code.exists() or exit_code.read_text() == "2\n"


def test_checkpoints_saved_before_the_disk_filled_are_kept_and_resumed(tmp_path, small_disk):
    """Room for one checkpoint, not two: the second save fails in one line, the first
    checkpoint stays whole, and once there is space the same command resumes from it."""
    subprocess.run(["mount", "-o", "remount,size=10m", str(small_disk)], check=True)
    args = ["--epochs", "1", "--max-steps", "3", "--ckpt-every", "1", "--log-dir", str(small_disk), "--run-name", "r"]
    result = run_single(args, cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip() == (f"mnist_ddp.py: error: cannot write {small_disk}/r/checkpoints/ckpt-00000002.pt (No "
                                     "space left on device); free space there or pass another --log-dir/--run-dir")
    assert sorted(p.name for p in (small_disk / "r" / "checkpoints").iterdir()) == ["ckpt-00000001.pt"]
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    again = run_single(args, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {small_disk}/r/checkpoints/ckpt-00000001.pt: epoch 1, step 1" in again.stdout


def test_full_log_dir_is_refused_in_one_line(tmp_path, small_disk):
    """A log directory on a file system with no byte left: one line, exit 2."""
    fd = os.open(small_disk / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, bytes(1 << 16))
    except OSError as err:
        assert err.errno == errno.ENOSPC
    finally:
        os.close(fd)
    result = run_single(["--epochs", "1", "--max-steps", "2", "--log-dir", str(small_disk), "--run-name", "r"],
                        cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    line = result.stderr.strip()
    assert "\n" not in line and line.startswith("mnist_ddp.py: error: cannot write ") and str(small_disk) in line
    assert line.endswith("(No space left on device); free space there or pass another --log-dir/--run-dir")


@pytest.mark.slow
def test_read_only_log_dir_is_refused_in_one_line(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    result = run_with_read_only(logs, ["--log-dir", str(logs), "--run-name", "r", "--epochs", "1", "--max-steps", "2"],
                                tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip() == (f"mnist_ddp.py: error: cannot write {logs / 'r'} (Read-only file system); pass a "
                                     "--log-dir/--run-dir on a writable file system")


@pytest.mark.slow
def test_run_dir_in_a_read_only_parent_trains_without_the_hparams_declaration(tmp_path):
    """A --run-dir that can be written, in a parent that cannot (a project's shared folder):
    TensorBoard's HParams experiment, declared once per parent, is skipped with a warning,
    and the run trains."""
    shared = tmp_path / "shared"
    shared.mkdir()
    setup = (f"mount -t tmpfs tmpfs {shared} && mkdir {shared}/mine && mount -o remount,ro {shared} && "
             f"mount -t tmpfs tmpfs {shared}/mine && ! touch {shared}/probe 2>/dev/null")
    result = run_with_mounts(setup, ["--run-dir", str(shared / "mine"), "--epochs", "1", "--max-steps", "2"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (f"warning: cannot declare the HParams experiment in {shared} (Read-only file system); training goes on, "
            "and TensorBoard's HParams tab infers its columns from the runs") in result.stderr.splitlines()
    assert f"saved {shared / 'mine' / 'model.pt'}" in result.stdout


# A user's edit of the model: a hidden layer of 256 instead of 128.
WIDER_MODEL = """
import sys
import torch.nn as nn
import mnist_ddp

def wider(recipe, shape, classes):
    model = mnist_ddp.SmallCNN(*shape, classes, recipe.dropout)
    model.classifier[1] = nn.Linear(64 * 7 * 7, 256)
    model.classifier[4] = nn.Linear(256, 10)
    return model

mnist_ddp.build_model = wider
sys.exit(mnist_ddp.main(sys.argv[1:]))
"""


def test_checkpoint_that_does_not_fit_an_edited_model_is_refused(tmp_path):
    """A run trained, then the model's code edited and the run continued: one line that
    names the first tensor that differs and what to do, and the checkpoint left as it was."""
    assert run_single(["--epochs", "1", "--max-steps", "3", "--run-name", "r"], cwd=tmp_path).returncode == 0
    ckpt = Path("runs", "r", "checkpoints", "ckpt-00000003.pt")
    saved = (tmp_path / ckpt).read_bytes()
    (tmp_path / "wider.py").write_text(WIDER_MODEL)
    result = run_python(["--epochs", "1", "--max-steps", "6", "--allow-changes", "--run-name", "r"], tmp_path,
                        script=tmp_path / "wider.py")
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip() == (
        f"mnist_ddp.py: error: checkpoint {ckpt} does not fit this model (classifier.1.weight has shape [128, 3136] "
        "there, [256, 3136] here): the model's code changed since it was saved. Pass another --run-name to train the "
        "changed model afresh, or undo the change to resume this run")
    assert (tmp_path / ckpt).read_bytes() == saved


# Killed in the middle of a save, as by SIGKILL or a lost node: half a file is written.
KILLED_MID_SAVE = """
import os, signal, sys
import torch
import mnist_ddp

def killed_mid_save(obj, fh):
    fh.write(b"PK half a checkpoint")
    fh.flush()
    os.kill(os.getpid(), signal.SIGKILL)

torch.save = killed_mid_save
sys.exit(mnist_ddp.main(sys.argv[1:]))
"""


def test_temporary_file_of_a_save_killed_midway_is_removed_when_the_run_starts_again(tmp_path):
    """Each kill during a save leaves a .ckpt-*.tmp-PID file that nothing else removes: the
    run's next start sweeps them away."""
    args = ["--epochs", "1", "--max-steps", "3", "--run-name", "r"]
    (tmp_path / "killed.py").write_text(KILLED_MID_SAVE)
    killed = run_python(args, tmp_path, script=tmp_path / "killed.py")
    assert killed.returncode == -9, killed.stderr[-3000:]
    checkpoints = tmp_path / "runs" / "r" / "checkpoints"
    assert [p.name.split(".tmp-")[0] for p in checkpoints.iterdir()] == [".ckpt-00000003.pt"]
    result = run_single(args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["ckpt-00000003.pt"]


def test_script_copied_without_its_package_says_to_keep_it_beside(tmp_path):
    """mnist_ddp.py copied alone, without ddpkit/: one line that says what to do, exit 2."""
    lonely = tmp_path / "mnist_ddp.py"
    lonely.write_bytes(SCRIPT.read_bytes())
    env = clean_env()
    env.pop("PYTHONPATH", None)
    result = subprocess.run([sys.executable, str(lonely), "--epochs", "1"], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == ("mnist_ddp.py: error: cannot import ddpkit, the package this script runs on; keep "
                                     "the ddpkit/ folder beside mnist_ddp.py (copy both)")


def test_stop_signals_are_caught_before_torch_loads():
    """ddpkit.launch, which mnist_ddp.py imports first to catch SIGUSR1/SIGTERM, needs only
    the standard library: torch (seconds to import from shared storage) is not loaded yet."""
    probe = ("import sys; import ddpkit.launch; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'torchvision', 'PIL')))")
    result = subprocess.run([sys.executable, "-c", probe], env=clean_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# ----------------------------------------------------------------------------- image folders

def image_folder(root: Path, train: int = 2, test: int = 1) -> Path:
    return make_image_folder(root, {"train": train, "test": test}, size=8)


def one_error_line(result: subprocess.CompletedProcess) -> str:
    """The one line of a refusal (exit 2, no traceback), without the program's name."""
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr + result.stdout
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0].partition(": error: ")[2]


def test_image_folder_with_a_broken_symlink_is_one_line_with_or_without_node_data_dir(tmp_path):
    """Read in place, or first copied to node-local storage: the link is named, exit 2."""
    images = image_folder(tmp_path / "images")
    (images / "train" / "row" / "002.png").symlink_to(tmp_path / "deleted.png")
    said = (f"{images / 'train' / 'row' / '002.png'} is a broken symlink (to {tmp_path / 'deleted.png'}, which does not "
            "exist): remove it, or restore what it points to")
    args = ["--dataset", "folder", "--data-dir", str(images), "--epochs", "1"]
    assert one_error_line(run_single(args, cwd=tmp_path)) == said
    assert one_error_line(run_single([*args, "--node-data-dir", str(tmp_path / "node")], cwd=tmp_path)) == said
    assert not list((tmp_path / "node").glob("*/")), "nothing half-copied is left on the node"


@pytest.mark.parametrize("split, copied", [("test", False), ("train", True)], ids=["read-in-place", "copied-to-the-node"])
def test_unreadable_image_is_refused_by_name(split, copied):
    """As the unprivileged user nobody (root reads anything): a file it cannot read is named,
    by the check of --download-only, or by the node-local copy, which reads it first (the
    file is named, not the copy)."""
    with tempfile.TemporaryDirectory() as top:
        os.chmod(top, 0o755)
        images = image_folder(Path(top) / "images")
        secret = images / split / "row" / "000.png"
        secret.chmod(0o000)
        writable = Path(top) / "work"
        writable.mkdir(mode=0o777)
        writable.chmod(0o777)
        where = (["--epochs", "1", "--node-data-dir", str(writable / "node"), "--log-dir", str(writable / "runs")]
                 if copied else ["--download-only"])
        cmd = [sys.executable, str(SCRIPT), "--dataset", "folder", "--data-dir", str(images), *where]
        if os.geteuid() == 0:
            cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *cmd]
        result = subprocess.run(cmd, cwd=writable, env=clean_env(HOME=str(writable)), capture_output=True, text=True,
                                timeout=120)
    assert one_error_line(result) == f"cannot read {secret} (permission denied): make it readable (chmod a+r), or remove it"


def test_fewer_training_images_than_ranks_is_one_line_naming_the_counts(tmp_path):
    """1 training image and 2 ranks: each rank would get 0 images and 0 steps."""
    images = image_folder(tmp_path / "images", train=1)
    for name in ("diagonal", "row"):
        for part in ("train", "test"):
            for path in (images / part / name).iterdir():
                path.unlink()
            (images / part / name).rmdir()
    said = (f"1 training image(s) in {images} cannot be shared among 2 ranks: every rank needs at least one; add "
            "training images, or run 1 rank(s) at most")
    for result in run_as_srun(2, ["--dataset", "folder", "--data-dir", str(images), "--epochs", "1"], cwd=tmp_path):
        assert one_error_line(result) == said


@pytest.mark.parametrize("layout, said", [
    ("missing", "--data-dir {d} does not exist: --dataset folder reads {d}/train/<class>/*.png|jpg and {d}/test/<class>/*"),
    ("no test", "--data-dir {d} has no test/ folder: --dataset folder reads {d}/train/<class>/*.png|jpg and "
                "{d}/test/<class>/*"),
    ("no images", "{d}/train/column holds no PNG or JPEG images: add some, or remove the folder to drop the class"),
])
def test_download_only_of_an_image_folder_checks_it_as_training_reads_it(tmp_path, layout, said):
    """--download-only on a login node is where a wrong --data-dir should show, not after the
    job's queue wait: the folder is listed and its images read as training would."""
    images = tmp_path / "images"
    if layout != "missing":
        image_folder(images)
    if layout == "no test":
        subprocess.run(["rm", "-r", str(images / "test")], check=True)
    if layout == "no images":
        for path in (images / "train").rglob("*.png"):
            path.rename(path.with_suffix(".txt"))
    result = run_single(["--dataset", "folder", "--data-dir", str(images), "--download-only"], cwd=tmp_path)
    assert one_error_line(result).endswith(said.format(d=images))


def test_download_only_of_a_good_image_folder_measures_it_once(tmp_path):
    images = image_folder(tmp_path / "images")
    result = run_single(["--dataset", "folder", "--data-dir", str(images), "--download-only"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"[rank 0] folder is ready in {images}" in result.stdout
    assert (images / ".mnist-ddp-stats.json").is_file()  # the jobs that follow need not measure it


def test_streamed_folder_with_a_damaged_test_image_stops_before_training(tmp_path):
    """--data-feed stream decodes a test image only at the first evaluation: a truncated one
    is found when the data is read, before any step, in one line that names it."""
    images = image_folder(tmp_path / "images")
    damaged = images / "test" / "diagonal" / "000.png"
    whole = damaged.read_bytes()
    damaged.write_bytes(whole[: len(whole) // 2])
    result = run_single(["--dataset", "folder", "--data-dir", str(images), "--data-feed", "stream", "--epochs", "1",
                         "--run-name", "r"], cwd=tmp_path)
    assert one_error_line(result).startswith(f"cannot read {damaged} as an image (")
    assert "step" not in result.stdout and not (tmp_path / "runs" / "r" / "metrics.jsonl").exists()


# ----------------------------------------------------------------------------- batches and models

TINY_IMAGES = 3 * TINY["train"]  # the tiny folder's training images


@pytest.mark.parametrize("args, ranks, said", [
    (["--global-batch", "100000000"], 1,
     "--global-batch 100000000 is more than the 4000 training images, so each step would train some of them more than "
     "once; pass --global-batch 4000 or less"),
    (["--global-batch", str(TINY_IMAGES + 1), "--data-feed", "stream"], 1,
     f"--global-batch {TINY_IMAGES + 1} is more than the {TINY_IMAGES} training images, so each step would train some "
     f"of them more than once; pass --global-batch {TINY_IMAGES} or less"),
    (["--batch-size", str(TINY_IMAGES // 2 + 1)], 2,
     f"--batch-size {TINY_IMAGES // 2 + 1} on 2 ranks is a global batch of {TINY_IMAGES + 2}, more than the "
     f"{TINY_IMAGES} training images, so each step would train some of them more than once; pass --batch-size "
     f"{TINY_IMAGES // 2} or less"),
], ids=["sample-in-memory", "folder-streamed", "batch-size-on-2-ranks"])
def test_a_global_batch_larger_than_the_training_set_is_refused_before_training(tmp_path, tiny_folder, args, ranks, said):
    data = [] if args[1] == "100000000" else on_folder(tiny_folder)
    args = [*data, *args, "--epochs", "1", "--run-name", "big"]
    results = run_as_srun(ranks, args, cwd=tmp_path, job_id="") if ranks > 1 else [run_single(args, cwd=tmp_path)]
    for result in results:
        assert one_error_line(result) == said
        assert "step" not in result.stdout
    assert not (tmp_path / "runs" / "big").exists()


def test_a_model_name_without_its_branch_in_build_model_is_one_line(tmp_path, tiny_folder):
    """A name added to MODELS, as docs/adapt.md says, but no branch for it in build_model yet:
    one line that says so, instead of training another network under that name."""
    edited = SCRIPT.read_text().replace('MODELS = ("cnn", "mlp", "resnet18")', 'MODELS = ("cnn", "mlp", "resnet18", "vgg")')
    assert edited != SCRIPT.read_text()
    (tmp_path / "mine.py").write_text(edited)
    args = [*on_folder(tiny_folder), "--model", "vgg", "--batch-size", "8", "--epochs", "1", "--run-name", "vgg"]
    result = run_python(args, tmp_path, script=tmp_path / "mine.py")
    assert one_error_line(result) == ("--model vgg is in MODELS, but build_model has no branch that builds it: add one "
                                      "that returns its nn.Module (docs/adapt.md)")
    assert not (tmp_path / "runs" / "vgg").exists()
