"""Data for runs: image folders made on the spot (a visible pattern per class on noise), the
tiny folder's sizes, and what a run leaves to read back (metrics.jsonl, model.pt)."""

import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from helpers.processes import ROOT

SAMPLE = ROOT / "data" / "mnist-sample"

CLASSES = ("column", "diagonal", "row")


def make_image_folder(root: Path, per_class: dict[str, int], size: int = 32, seed: int = 0) -> Path:
    """root/train/<class>/*.png and root/test/<class>/*.png, 3 x size x size RGB, each class a
    visible pattern (a bright column, diagonal or row in its own colour) on noise."""
    rng = np.random.default_rng(seed)
    for part, count in per_class.items():
        for label, name in enumerate(CLASSES):
            folder = root / part / name
            folder.mkdir(parents=True)
            for i in range(count):
                image = rng.integers(0, 120, (size, size, 3), dtype=np.uint8)
                at = rng.integers(2, size - 2)
                if name == "row":
                    image[at - 1: at + 2, :, label] = 255
                elif name == "column":
                    image[:, at - 1: at + 2, label] = 255
                else:
                    image[np.arange(size), np.arange(size), label] = 255
                Image.fromarray(image).save(folder / f"{i:03d}.png")
    return root


# A tiny image folder (3 classes x 8 training and 4 test images of 12 x 12): 24 training
# images, so with --batch-size 8 an epoch is 3 steps, for tests of epochs, stops, resumes and printed lines that need
# neither learning nor the sample's figures.
TINY = {"train": 8, "test": 4}


def on_folder(folder: Path) -> list[str]:
    """The options that train on `folder` instead of the sample."""
    return ["--dataset", "folder", "--data-dir", str(folder)]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


MEASURED = ("images_per_s", "epoch_s", "peak_rss_mb", "seconds_to_best", "time")  # figures of the machine and the clock, not of the training


def read_results(run_dir: Path) -> list[dict]:
    """metrics.jsonl without the measured figures: what two identical runs must share."""
    return [{k: v for k, v in m.items() if k not in MEASURED} for m in read_metrics(run_dir)]


def load_params(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt", weights_only=True)
