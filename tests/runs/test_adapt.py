"""Adapting the template as README.md "Adapt it" and docs/adapt.md say: your own image
folder with only the command changed (through both data feeds, with 2 real Gloo ranks);
then, each in a copy of the project (mnist_ddp.py and ddpkit/) edited as the docs say and
trained by 2 ranks started as srun starts them: your own model (a name in MODELS, picked
with --model, and its branch in build_model), your own loss (the F.cross_entropy line of
train_step), and your own test metric (two lines in evaluate); CHECK=1's step failing on a
model made the default for 3-channel 32 x 32 images is the recipe's error (exit 1), and no
node is blamed for it; on a folder of such images, the same check times that model on their
shape and passes.

The image folder is made here, not stored: 3 classes of 3x32x32 PNG images, each class a
visible pattern (a bright row, column or diagonal) on noise.

    python -m pytest tests/runs/test_adapt.py
"""

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

from ddpkit.job.contract import EXIT_STOPPED
from helpers.images import CLASSES, load_params, make_image_folder, read_metrics
from helpers.processes import SCRIPT, assert_ok, run_as_srun, run_single


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("images"), {"train": 64, "test": 20})


def folder_args(folder: Path, *more: str) -> list[str]:
    return ["--dataset", "folder", "--data-dir", str(folder), "--epochs", "3", "--image-every", "1", *more]


@pytest.mark.slow
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


def copy_of_the_project(tmp_path: Path) -> Path:
    """What the README tells a user to copy: the recipe and the machinery beside it."""
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(SCRIPT, project / "mnist_ddp.py")
    shutil.copytree(SCRIPT.parent / "ddpkit", project / "ddpkit", ignore=shutil.ignore_patterns("__pycache__"))
    return project


def edit(path: Path, *changes: tuple[str, str]) -> None:
    """Each change replaces the one occurrence of its text, as a user's edit would."""
    text = path.read_text()
    for old, new in changes:
        assert text.count(old) == 1, f"the line docs/adapt.md points at is gone: {old!r}"
        text = text.replace(old, new)
    path.write_text(text)


def run_ranks(script: Path, args: list[str], cwd: Path) -> list:
    """`python SCRIPT ARGS` as 2 srun tasks: the copy's own ddpkit is the one beside it."""
    return run_as_srun(2, args, cwd=cwd, job_id="", command=[sys.executable, str(script)])


# docs/adapt.md: your own model is a name in MODELS (picked with --model) and its branch in
# build_model; your own loss is the F.cross_entropy line of train_step.
OWN_MODEL = (('MODELS = (', 'MODELS = ("tiny", '),
             ("    channels, height, width = shape\n",
              "    channels, height, width = shape\n"
              '    if recipe.model == "tiny":\n'
              "        return nn.Sequential(nn.Conv2d(channels, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4),\n"
              "                             nn.Flatten(), nn.Linear(8 * 4 * 4, classes))\n"))
OWN_LOSS = (("        loss = F.cross_entropy(model(x), y, label_smoothing=label_smoothing)\n",
             "        probabilities = model(x).softmax(1)\n"
             "        loss = F.mse_loss(probabilities, F.one_hot(y, probabilities.shape[1]).float())\n"),)


@pytest.mark.parametrize("changes,more", [(OWN_MODEL, ["--model", "tiny"]), (OWN_LOSS, [])], ids=["own-model", "own-loss"])
@pytest.mark.slow
def test_own_model_or_loss_edited_into_a_copy_trains_stops_and_resumes_on_2_ranks(changes, more, folder, tmp_path):
    """A model added to MODELS and build_model, or a loss written into train_step, in a copy
    of the project: 2 ranks train it on the folder, stop on SIGUSR1 in epoch 1, go on from
    the checkpoint and finish with everything else as it is (checkpoints, evaluation, logs).
    What trained is the edit: the tiny network's weights in model.pt (not the CNN's, nor a
    fall-through's), or the squared error's scale in train_loss (at most 2/3 for 3 classes,
    about 0.22 at the start, where the cross-entropy starts at about 1.1)."""
    project = copy_of_the_project(tmp_path)
    edit(project / "mnist_ddp.py", *changes)
    args = folder_args(folder, "--batch-size", "8", "--run-name", "r", *more)
    stopped = run_ranks(project / "mnist_ddp.py", [*args, "--interrupt-at", "5:USR1"], cwd=tmp_path)
    assert [r.returncode for r in stopped] == [EXIT_STOPPED] * 2, stopped[0].stderr[-2000:]
    for result in run_ranks(project / "mnist_ddp.py", args, cwd=tmp_path):
        assert_ok(result)
    run_dir = tmp_path / "runs" / "r"
    metrics = read_metrics(run_dir)
    assert [m["epoch"] for m in metrics] == [1, 2, 3] and metrics[-1]["test_images"] == 60
    assert metrics[-1]["test_accuracy"] > 0.6, metrics
    if more:
        assert json.loads((run_dir / "run.json").read_text())["config"]["model"] == "tiny"
        assert sorted(load_params(run_dir)) == ["0.bias", "0.weight", "4.bias", "4.weight"]
    else:
        assert metrics[0]["train_loss"] < 0.25, metrics


# A model of one's own for 3-channel 32 x 32 images (CIFAR's), made the default: it cannot take
# the bundled sample's 1-channel 28 x 28 images, which the check times it on by default.
OWN_DEFAULT_MODEL = (('MODELS = (', 'MODELS = ("cifar", '), ('model: str = kit.option("cnn",', 'model: str = kit.option("cifar",'),
                     ("    channels, height, width = shape\n",
                      "    channels, height, width = shape\n"
                      '    if recipe.model == "cifar":\n'
                      "        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),\n"
                      "                             nn.Linear(8 * 16 * 16, classes))\n"))


def test_check_of_a_model_that_cannot_take_its_step_is_the_recipes_error_and_blames_no_node(tmp_path):
    """Every rank cannot run the check's step: exit 1 (the recipe's error, which another node
    would not fix), one line that says so, and no `--exclude` of any node."""
    project = copy_of_the_project(tmp_path)
    edit(project / "mnist_ddp.py", *OWN_DEFAULT_MODEL)
    results = run_ranks(project / "mnist_ddp.py", ["--check"], cwd=tmp_path)
    assert [r.returncode for r in results] == [1, 1], results[0].stdout[-3000:] + results[0].stderr[-3000:]
    out = results[0].stdout
    assert re.search(r"^check: rank 0 on \S+ cannot run a training step on cpu: .*3 channels", out, re.M), out
    assert re.search(r"^check failed: ranks 0, 1 \(on \S+\) cannot run a training step \(the line above from each says "
                     r"why\): an error of the recipe's step \(its build_model, build_optimizer or train_step\) or of "
                     r"the environment, which another node would not fix; fix it, and run the check again$", out, re.M), out
    assert "--exclude" not in out + results[1].stdout


def test_check_times_the_changed_model_on_the_image_folders_shape_and_passes(folder, tmp_path):
    """The same model, on a folder of 3-channel 32 x 32 images: the check's step is the recipe's
    own (its build_model, build_optimizer and train_step) on the folder's shape and class
    count, so the model it cannot take on MNIST's shape is timed as it will train, and the
    check passes (exit 0)."""
    project = copy_of_the_project(tmp_path)
    edit(project / "mnist_ddp.py", *OWN_DEFAULT_MODEL)
    results = run_ranks(project / "mnist_ddp.py", ["--check", "--dataset", "folder", "--data-dir", str(folder)], cwd=tmp_path)
    assert [r.returncode for r in results] == [0, 0], results[0].stdout[-3000:] + results[0].stderr[-3000:]
    out = results[0].stdout
    assert re.search(r"^check: a training step of the recipe's model \(cifar, 128 images of 3 x 32 x 32\) takes [\d.]+ ms ",
                     out, re.M), out
    assert re.search(r"^check passed", out, re.M), out


@pytest.mark.slow
def test_own_test_metric_is_two_lines_in_evaluate_and_reaches_the_line_the_jsonl_and_tensorboard(folder, tmp_path):
    """README: a test metric of your own is two lines in evaluate, its name beside "loss" and
    "accuracy" and the line that adds to it. Top-2 accuracy, added so to a copy of the
    recipe and trained on 2 ranks, is in each epoch's line, in metrics.jsonl as
    test_top2_accuracy and in TensorBoard as test/top2_accuracy; counted over every test
    image of both ranks (at least the plain accuracy, at most 1), with the plain figures
    under their names as before."""
    project = copy_of_the_project(tmp_path)
    adds = '        sums["accuracy"] += (pred == y).sum()\n'
    edit(project / "mnist_ddp.py", ('for name in ("loss", "accuracy")}', 'for name in ("loss", "accuracy", "top2_accuracy")}'),
         (adds, adds + '        sums["top2_accuracy"] += (logits.topk(2, 1).indices == y[:, None]).any(1).sum()\n'))
    run_dir = tmp_path / "runs" / "top2"
    results = run_ranks(project / "mnist_ddp.py", folder_args(folder, "--batch-size", "8", "--run-dir", str(run_dir)),
                        cwd=tmp_path)
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


def test_the_docs_top3_metric_example_works_on_the_docs_two_class_folder(tmp_path):
    """docs/adapt.md's example metric, copied from the page into evaluate as it says, on a
    folder laid out as its example (my-images/ with cat/ and dog/: fewer classes than 3)."""
    import re

    from PIL import Image

    from helpers.processes import run_python

    page = (SCRIPT.parent / "docs" / "adapt.md").read_text()
    [example] = re.findall(r'`(sums\["top3_accuracy"\] \+= [^`]*)`', page)
    project = copy_of_the_project(tmp_path)
    adds = '        sums["accuracy"] += (pred == y).sum()\n'
    edit(project / "mnist_ddp.py", ('for name in ("loss", "accuracy")}', 'for name in ("loss", "accuracy", "top3_accuracy")}'),
         (adds, f"{adds}        {' '.join(example.split())}\n"))
    for part, count in (("train", 64), ("test", 4)):
        for shade, name in ((40, "cat"), (200, "dog")):
            (tmp_path / "my-images" / part / name).mkdir(parents=True)
            for i in range(count):
                Image.new("L", (8, 8), shade + i % 8).save(tmp_path / "my-images" / part / name / f"{i:03d}.png")
    result = run_python(["--dataset", "folder", "--data-dir", "my-images", "--epochs", "1", "--run-name", "r"], tmp_path,
                        script=project / "mnist_ddp.py")
    assert_ok(result)
    [metrics] = read_metrics(tmp_path / "runs" / "r")
    assert metrics["test_images"] == 8 and metrics["test_top3_accuracy"] == 1.0
