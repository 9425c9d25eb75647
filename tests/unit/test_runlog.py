"""ddpkit/run/runlog.py's pieces that need no run: the pictures TensorBoard shows (the confusion
matrix for 1, 3 and 40 classes, captioned grids of 1- and 3-channel test images),
metrics.jsonl read past a line that a crash cut short, and the HParams experiment, declared
once per log directory and, when that directory is read-only (a real read-only bind mount
in a mount namespace of its own), reported in one warning.

    python -m pytest tests/unit/test_runlog.py
"""

import contextlib
import ctypes
import json
import os
import subprocess
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from tensorboard.plugins.hparams import metadata, plugin_data_pb2

from ddpkit.run.runlog import HParams, confusion_picture, declare_hparams, labelled_grid, read_metrics_tolerantly

HPARAMS = HParams({"lr": 0.003, "batch_size": 128, "model": "cnn", "amp": False}, first=("lr",),
                  choices={"model": ("cnn", "mlp", "resnet18")})


def is_rgb_picture(picture: np.ndarray) -> bool:
    return picture.dtype == np.uint8 and picture.ndim == 3 and picture.shape[2] == 3


def has_colour(picture: np.ndarray, rgb: tuple[int, int, int]) -> bool:
    return bool((picture == rgb).all(-1).any())


# ----------------------------------------------------------------------------- pictures

def test_confusion_picture_of_3_classes():
    right = confusion_picture(torch.diag(torch.tensor([5, 7, 9])), ("zero", "one", "two"))
    assert is_rgb_picture(right)
    assert 100 < right.shape[0] < 300 and 100 < right.shape[1] < 400, right.shape
    assert has_colour(right, (0, 0, 255)) and not has_colour(right, (255, 0, 0))  # all right: blue diagonal
    wrong = confusion_picture(torch.tensor([[0, 4, 0], [0, 0, 4], [4, 0, 0]]), ("zero", "one", "two"))
    assert has_colour(wrong, (255, 0, 0)) and not has_colour(wrong, (0, 0, 255))  # all wrong: red


def test_confusion_picture_grows_with_the_classes_within_reason():
    names = tuple(f"class number {i}" for i in range(40))
    small = confusion_picture(torch.eye(3, dtype=torch.int64), ("a", "b", "c"))
    large = confusion_picture(torch.randint(0, 50, (40, 40)), names)
    assert is_rgb_picture(large)
    assert large.shape[0] > small.shape[0] and large.shape[1] > small.shape[1]
    assert large.shape[0] < 1000 and large.shape[1] < 1000, large.shape  # cells shrink for many classes


@pytest.mark.parametrize("confusion", [torch.tensor([[12]]), torch.tensor([[0]])])
def test_confusion_picture_of_one_class(confusion):
    assert is_rgb_picture(confusion_picture(confusion, ("only one",)))


def test_labelled_grid_of_grey_images():
    images = torch.zeros(3, 1, 28, 28, dtype=torch.uint8)  # black
    grid = labelled_grid(images, torch.tensor([1, 2, 3]), torch.tensor([1, 2, 0]))
    assert is_rgb_picture(grid)
    assert grid.shape == (56 + 14, 8 * 56, 3)  # one row: 56-pixel cells over a caption
    assert (grid[:56, :56] == 0).all()  # the first image, black, scaled to its cell
    caption = grid[56:, 2 * 56: 3 * 56].astype(int)  # the wrong one's, drawn red (smoothed at the edges)
    assert ((caption[..., 0] > 150) & (caption[..., 1] < 80)).any()
    ten = labelled_grid(torch.zeros(10, 1, 28, 28, dtype=torch.uint8), torch.zeros(10, dtype=torch.int64),
                        torch.zeros(10, dtype=torch.int64))
    assert ten.shape == (2 * (56 + 14), 8 * 56, 3)


def test_labelled_grid_of_colour_images():
    images = torch.zeros(2, 3, 32, 32, dtype=torch.uint8)
    images[:, 0] = 255  # red
    grid = labelled_grid(images, torch.tensor([4, 5]), torch.tensor([4, 5]))
    assert is_rgb_picture(grid) and grid.shape == (70, 448, 3)
    assert (grid[:56, :56] == (255, 0, 0)).all()


# ----------------------------------------------------------------------------- metrics.jsonl

def test_a_torn_last_line_is_dropped_with_one_warning(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    records = [{"epoch": epoch, "step": 3 * epoch, "test_accuracy": 0.5, "epoch_s": 1.5} for epoch in (1, 2)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"epoch": 3, "step": 9')  # a crash mid-append
    assert read_metrics_tolerantly(path) == records
    assert capsys.readouterr().err == (f"warning: dropping line 3 of {path}, which is not a whole record: "
                                       "'{\"epoch\": 3, \"step\": 9'\n")


def test_a_line_with_a_step_but_without_the_epoch_figures_is_dropped_with_the_same_warning(tmp_path, capsys):
    """A resume adds up the epochs' seconds and looks for the best accuracy: a line without
    them (hand-edited, another tool's) is not one of the run's records."""
    whole = {"epoch": 1, "step": 3, "test_accuracy": 0.5, "epoch_s": 1.5}
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(whole) + '\n{"step": 4}\n{"step": 5, "epoch_s": "1.5", "test_accuracy": 0.5}\n')
    assert read_metrics_tolerantly(path) == [whole]
    assert capsys.readouterr().err.splitlines() == [
        f"warning: dropping line 2 of {path}, which is not a whole record: '{{\"step\": 4}}'",
        f"warning: dropping line 3 of {path}, which is not a whole record: "
        "'{\"step\": 5, \"epoch_s\": \"1.5\", \"test_accuracy\": 0.5}'"]


def test_no_metrics_file_is_no_records(tmp_path, capsys):
    assert read_metrics_tolerantly(tmp_path / "metrics.jsonl") == []
    assert capsys.readouterr().err == ""


# ----------------------------------------------------------------------------- the HParams experiment

def declared_experiment(log_dir: Path):
    [events] = log_dir.glob("*.hparams")
    for event in EventFileLoader(str(events)).Load():
        for value in event.summary.value:
            if value.tag == metadata.EXPERIMENT_TAG:
                return plugin_data_pb2.HParamsPluginData.FromString(value.metadata.plugin_data.content).experiment
    raise AssertionError(f"no experiment in {events}")


def test_the_experiment_is_declared_once_per_directory(tmp_path):
    log_dir = tmp_path / "runs"
    declare_hparams(log_dir, HPARAMS)
    written = sorted(p.name for p in log_dir.iterdir())
    assert ".hparams-declared" in written and len(written) == 2  # the marker and one event file
    experiment = declared_experiment(log_dir)
    assert [(h.name, h.differs) for h in experiment.hparam_infos] == [("lr", True), ("batch_size", False),
                                                                     ("model", False), ("amp", False)]
    assert list(experiment.hparam_infos[2].domain_discrete.values) and "test/accuracy" in str(experiment.metric_infos)
    declare_hparams(log_dir, HPARAMS)  # another run of the same directory
    assert sorted(p.name for p in log_dir.iterdir()) == written


CLONE_NEWNS = 0x00020000  # <sched.h>: a mount namespace of its own


def declare_under_read_only_bind_mount(log_dir: Path, stderr: Path) -> int:
    """declare_hparams(log_dir) in a forked process that has a mount namespace of its own,
    in which log_dir is bind-mounted read-only over itself (as root, permissions alone would
    not stop a write); returns its exit code (77: no namespace or mount here)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            mounts = [["mount", "--make-rprivate", "/"], ["mount", "--bind", str(log_dir), str(log_dir)],
                      ["mount", "-o", "remount,bind,ro", str(log_dir)]]
            if libc.unshare(CLONE_NEWNS) != 0 or any(subprocess.run(m, capture_output=True).returncode for m in mounts):
                code = 77
            else:
                with open(stderr, "w") as err, contextlib.redirect_stderr(err):
                    declare_hparams(log_dir, HPARAMS)
                code = 0
        except BaseException:
            stderr.write_text(traceback.format_exc())
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_a_read_only_log_dir_gets_one_warning(tmp_path):
    log_dir = tmp_path / "shared"
    log_dir.mkdir()
    stderr = tmp_path / "stderr"
    code = declare_under_read_only_bind_mount(log_dir, stderr)
    if code == 77:
        pytest.skip("no mount namespace or bind mount here (needs root)")
    assert code == 0, stderr.read_text()
    assert stderr.read_text() == (f"warning: cannot declare the HParams experiment in {log_dir} (Read-only file system); "
                                  "training goes on, and TensorBoard's HParams tab infers its columns from the runs\n")
    assert list(log_dir.iterdir()) == []
