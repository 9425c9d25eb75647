"""Checkpoints end to end, with real runs: a copy a user put in checkpoints/ neither wins nor
is lost (the printed line resumes from the run's own), a newest checkpoint with a missing or
unknown field falls back to the one before, and a resume on images of another channel count
or size says so in one line. ddpkit/run/checkpoints.py at unit level: tests/unit/test_checkpoints.py.

    python -m pytest tests/runs/test_checkpoints_runs.py
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from ddpkit.job.contract import EXIT_STOPPED
from helpers.checkpoints import BROKEN, names
from helpers.images import make_image_folder
from helpers.processes import assert_ok, clean_env, run_single

# ----------------------------------------------------------------------------- end to end, with real runs

def printed_command(text: str, marker: str) -> list[str]:
    return shlex.split(text[text.index(marker) + len(marker):].splitlines()[0])


def run_as_pasted(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """A printed command as a user pastes it, in a shell whose PATH starts with this environment's bin/."""
    env = clean_env(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_copy_put_in_checkpoints_neither_wins_nor_is_lost(workdir):
    """A copy of step 10 as ckpt-best.pt and as ckpt-26.pt (beside the run's own step 26): the
    printed continue line resumes from step 26, sets nothing aside, says once that the copies
    are ignored, and leaves them; run again when finished, it trains nothing."""
    first = run_single(["--epochs", "2", "--ckpt-every", "10", "--run-name", "cb1", "--interrupt-at", "25:USR1"],
                       cwd=workdir)
    assert first.returncode == EXIT_STOPPED, first.stderr[-2000:]
    checkpoints = workdir / "runs" / "cb1" / "checkpoints"
    step_10 = (checkpoints / "ckpt-00000010.pt").read_bytes()
    for name in ("ckpt-best.pt", "ckpt-26.pt"):
        shutil.copy(checkpoints / "ckpt-00000010.pt", checkpoints / name)
    command = printed_command(first.stdout, "to continue: ")
    again = run_as_pasted(command, workdir)
    assert_ok(again)
    assert "resumed from runs/cb1/checkpoints/ckpt-00000026.pt: epoch 1, step 26 " in again.stdout
    assert not (checkpoints / "superseded").exists()
    assert [line for line in again.stderr.splitlines() if "ckpt-best.pt" in line] == [
        "note: --resume auto ignores ckpt-26.pt, ckpt-best.pt in runs/cb1/checkpoints, not named as the run's "
        "checkpoints are (ckpt-00000120.pt for step 120); to resume from one of them, pass --resume PATH"]
    own = [name for name in names(checkpoints) if re.fullmatch(r"ckpt-\d{8}\.pt", name)]
    assert len(own) == 3  # --keep-ckpts 3, the copies not counted
    assert [(checkpoints / name).read_bytes() == step_10 for name in ("ckpt-best.pt", "ckpt-26.pt")] == [True, True]
    model = (workdir / "runs" / "cb1" / "model.pt").read_bytes()
    done = run_as_pasted(command, workdir)
    assert_ok(done)
    assert "runs/cb1 is already complete (epoch 2, " in done.stdout
    assert (workdir / "runs" / "cb1" / "model.pt").read_bytes() == model


@pytest.mark.parametrize("case", ["its-format-alone", "a-progress-field-added-later"])
def test_a_newest_checkpoint_with_a_missing_or_unknown_field_falls_back_to_the_one_before(workdir, case):
    change, reason = BROKEN[case]
    args = ["--epochs", "1", "--ckpt-every", "10", "--run-name", "f"]
    assert run_single([*args, "--interrupt-at", "25:USR1"], cwd=workdir).returncode == EXIT_STOPPED
    newest = workdir / "runs" / "f" / "checkpoints" / "ckpt-00000026.pt"
    torch.save(change(torch.load(newest, weights_only=True)), newest)
    again = run_single(args, cwd=workdir)
    assert_ok(again)
    assert f"warning: skipping checkpoint runs/f/checkpoints/ckpt-00000026.pt: {reason}" in again.stderr.splitlines()
    assert "resumed from runs/f/checkpoints/ckpt-00000020.pt: epoch 1, step 20 " in again.stdout
    assert list((newest.parent / "superseded").glob("*/ckpt-00000026.pt"))  # set aside, not deleted


def grayscale_folder(root: Path, size: int) -> Path:
    folder = make_image_folder(root, {"train": 8, "test": 4}, size=size)
    for path in folder.rglob("*.png"):
        Image.open(path).convert("L").save(path)
    return folder


@pytest.mark.parametrize("change", ["one-colour-image-added", "images-of-another-size"])
def test_a_resume_on_images_of_another_shape_says_so_in_one_line(workdir, change):
    folder = grayscale_folder(workdir / "gray", 12)
    args = ["--dataset", "folder", "--epochs", "2", "--batch-size", "4", "--run-name", "img", "--image-every", "0"]
    first = run_single([*args, "--data-dir", str(folder), "--interrupt-at", "3:USR1"], cwd=workdir)
    assert first.returncode == EXIT_STOPPED, first.stderr[-2000:]
    [saved] = (workdir / "runs" / "img" / "checkpoints").glob("ckpt-*.pt")
    if change == "one-colour-image-added":  # imagesets reads the whole folder in colour then
        Image.new("RGB", (12, 12), (200, 30, 30)).save(folder / "train" / "row" / "red.png")
        says = ("3x12x12 (an image folder is read in colour when any one of its images is in colour): pass the data it "
                "was trained on (every image grayscale)")
    else:
        folder = grayscale_folder(workdir / "larger", 16)
        says = "1x16x16: pass the data it was trained on (its images 12x12 pixels)"
    again = run_single([*args, "--data-dir", str(folder)], cwd=workdir)
    assert again.returncode == 2, again.stderr[-2000:]
    assert again.stderr.strip().splitlines()[-1] == (
        f"mnist_ddp.py: error: checkpoint runs/img/checkpoints/{saved.name} was trained on images of 1x12x12 (channels x "
        f"height x width) and this data's are {says}, or another --run-name to start afresh")
    assert "Traceback" not in again.stderr
