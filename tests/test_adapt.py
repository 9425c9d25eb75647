"""Adapting the template as README.md "Adapt it" says: your own image folder with only the
command changed (through both data feeds, with 2 real Gloo ranks), your own model by
replacing build_model, your own loss by replacing train_step, your own test metric by two
lines added to a copy of evaluate.

The image folder is made here, not stored: 3 classes of 3x32x32 PNG images, each class a
visible pattern (a bright row, column or diagonal) on noise.

    python -m pytest tests/test_adapt.py
"""

import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import (
    CLASSES,
    SCRIPT,
    assert_ok,
    load_params,
    make_image_folder,
    read_metrics,
    run_as_srun,
    run_python,
    run_single,
)
from ddpkit.launch import EXIT_STOPPED


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("images"), {"train": 64, "test": 20})


def folder_args(folder: Path, *more: str) -> list[str]:
    return ["--dataset", "folder", "--data-dir", str(folder), "--epochs", "3", "--image-every", "1", *more]


def test_own_image_folder_trains_through_both_feeds_alike(folder, tmp_path):
    """Only the command changes. 1 process at batch 16 holding the images in memory, and 2
    ranks at batch 8 streaming them through DataLoader workers, train the same weights
    (with --shift moving the same images); both evaluate all 60 test images exactly once,
    far above chance (1/3)."""
    one = tmp_path / "runs" / "one"
    result = run_single(folder_args(folder, "--batch-size", "16", "--data-feed", "memory", "--run-dir", str(one)),
                        cwd=tmp_path, OMP_NUM_THREADS="1")
    assert_ok(result)
    assert "[rank 0] data: held in memory (--data-feed memory)" in result.stdout
    two = tmp_path / "runs" / "two"
    for rank_result in run_as_srun(2, folder_args(folder, "--batch-size", "8", "--data-feed", "stream",
                                                  "--run-dir", str(two)), cwd=tmp_path, job_id=""):
        assert_ok(rank_result)
    assert (folder / ".mnist-ddp-stats.json").is_file()  # computed once, beside the data
    a, b = load_params(one), load_params(two)
    for name in a:  # (36 AdamW steps apart from rounding: the sums run in another order; other images differ by 1e-2)
        torch.testing.assert_close(a[name], b[name], rtol=1e-3, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}")
    for run_dir in (one, two):
        metrics = read_metrics(run_dir)
        assert [m["test_images"] for m in metrics] == [60, 60, 60]
        assert metrics[-1]["test_accuracy"] > 0.9, metrics
    run = json.loads((two / "run.json").read_text())
    assert run["config"]["dataset"] == "folder" and run["environment"]["world_size"] == 2
    confusion = tensorboard_text(two, "classes")
    assert all(f"| {i} | {name} |" in confusion for i, name in enumerate(CLASSES)), confusion


def test_own_image_folder_resumes_bit_exactly_in_mid_epoch_while_streamed(folder, tmp_path):
    """2 streaming ranks stopped by SIGUSR1 in the middle of epoch 2 and continued end with
    the very weights of a run that was never stopped (dropout on: its random numbers too
    must go on where they stopped, whatever the DataLoader draws). 12 steps an epoch: step
    14 is in epoch 2, the last."""
    args = folder_args(folder, "--batch-size", "8", "--data-feed", "stream", "--data-workers", "1", "--dropout", "0.2",
                       "--epochs", "2", "--image-every", "0")
    whole = tmp_path / "runs" / "whole"
    for result in run_as_srun(2, [*args, "--run-dir", str(whole)], cwd=tmp_path, job_id=""):
        assert_ok(result)
    stopped = tmp_path / "runs" / "stopped"
    results = run_as_srun(2, [*args, "--run-dir", str(stopped), "--interrupt-at", "14:USR1"], cwd=tmp_path, job_id="")
    assert [r.returncode for r in results] == [EXIT_STOPPED, EXIT_STOPPED], results[0].stderr[-2000:]
    for result in run_as_srun(2, [*args, "--run-dir", str(stopped)], cwd=tmp_path, job_id=""):
        assert_ok(result)
    a, b = load_params(whole), load_params(stopped)
    assert all(torch.equal(a[k], b[k]) for k in a)


def tensorboard_text(run_dir: Path, tag: str) -> str:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(run_dir), size_guidance={"tensors": 0}).Reload()
    return events.Tensors(f"{tag}/text_summary")[0].tensor_proto.string_val[0].decode()


# Your own model: build_model replaced, nothing else.
OWN_MODEL = """
import sys
import torch.nn as nn
import mnist_ddp

def build_model(recipe, shape, classes):
    channels, height, width = shape
    return nn.Sequential(nn.Conv2d(channels, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(),
                         nn.Linear(8 * 4 * 4, classes))

mnist_ddp.build_model = build_model
sys.exit(mnist_ddp.main(sys.argv[1:]))
"""

# Your own loss: train_step with a squared error on the probabilities, nothing else.
OWN_LOSS = """
import sys
import torch
import torch.nn.functional as F
import mnist_ddp

def train_step(model, optimizer, lr, x, y, amp=False, label_smoothing=0.0):
    for group in optimizer.param_groups:
        group["lr"] = lr
    probabilities = model(x).softmax(1)
    loss = F.mse_loss(probabilities, F.one_hot(y, probabilities.shape[1]).float())
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.detach()

mnist_ddp.train_step = train_step
sys.exit(mnist_ddp.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("driver", [OWN_MODEL, OWN_LOSS], ids=["own-model", "own-loss"])
def test_own_model_or_loss_is_one_function(driver, folder, tmp_path):
    """A replaced build_model or train_step trains on the folder, stops, resumes and finishes
    with everything else as it is: checkpoints, evaluation, logs."""
    script = tmp_path / "adapted.py"
    script.write_text(driver)
    args = folder_args(folder, "--batch-size", "16", "--run-name", "r")
    stopped = run_python([*args, "--interrupt-at", "5:USR1"], tmp_path, script=script)
    assert stopped.returncode == EXIT_STOPPED, stopped.stderr[-2000:]
    finished = run_python(args, tmp_path, script=script)
    assert_ok(finished)
    metrics = read_metrics(tmp_path / "runs" / "r")
    assert [m["epoch"] for m in metrics] == [1, 2, 3] and metrics[-1]["test_images"] == 60
    assert metrics[-1]["test_accuracy"] > 0.6, metrics


def test_own_test_metric_is_two_lines_in_evaluate_and_reaches_the_line_the_jsonl_and_tensorboard(folder, tmp_path):
    """README: a test metric of your own is two lines in evaluate, its name beside "loss" and
    "accuracy" and the line that adds to it. Top-2 accuracy, added so to a copy of the
    recipe and trained on 2 ranks, is in each epoch's line, in metrics.jsonl as
    test_top2_accuracy and in TensorBoard as test/top2_accuracy; counted over every test
    image of both ranks (at least the plain accuracy, at most 1), with the plain figures
    under their names as before."""
    source = SCRIPT.read_text()
    names, adds = 'for name in ("loss", "accuracy")}', '        sums["accuracy"] += (pred == y).sum()\n'
    assert source.count(names) == 1 and source.count(adds) == 1, "the lines README.md points at are gone"
    script = tmp_path / "mnist_ddp.py"
    script.write_text(source.replace(names, 'for name in ("loss", "accuracy", "top2_accuracy")}').replace(
        adds, adds + '        sums["top2_accuracy"] += (logits.topk(2, 1).indices == y[:, None]).any(1).sum()\n'))
    run_dir = tmp_path / "runs" / "top2"
    results = run_as_srun(2, folder_args(folder, "--batch-size", "8", "--run-dir", str(run_dir)), cwd=tmp_path, job_id="",
                          command=[sys.executable, str(script)])
    for result in results:
        assert_ok(result)
    metrics = read_metrics(run_dir)
    assert [m["test_images"] for m in metrics] == [60, 60, 60]
    for m in metrics:
        assert {"test_loss", "test_accuracy", "test_top2_accuracy"} <= set(m)
        assert m["test_accuracy"] <= m["test_top2_accuracy"] <= 1 and m["test_top2_accuracy"] * 60 == round(
            m["test_top2_accuracy"] * 60)
        assert (f"| test acc {100 * m['test_accuracy']:6.2f}% | test top2_accuracy {m['test_top2_accuracy']:.4f} | lr "
                in results[0].stdout), results[0].stdout
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0}).Reload()
    logged = [(e.step, e.value) for e in events.Scalars("test/top2_accuracy")]
    assert logged == [(m["step"], pytest.approx(m["test_top2_accuracy"])) for m in metrics]
    assert len(events.Scalars("test/accuracy")) == len(events.Scalars("test/loss")) == 3
