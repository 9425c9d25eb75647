#!/usr/bin/env python3
"""How the recipe's defaults were chosen: variants of mnist_ddp.py's recipe on Fashion-MNIST,
scored on 10,000 images held out of the training set, never on the test set.

    python benchmarks/recipe_search.py                         # the defaults, held-out score
    python benchmarks/recipe_search.py --first-layer trained --first-channels 16 --warmup 0.1 --no-mirror
                                                               # the previous defaults
    python benchmarks/recipe_search.py --test                  # train on all 60,000, score on the test set
    python benchmarks/recipe_search.py --speed                 # images/s of a training step, by first layer

It trains in one process with the recipe's own pieces (mnist_ddp.py's epoch_shard,
epoch_moves, lr_at, train_step and evaluate; the kit's whitening, weight average and
batches), the held-out images being the last 10,000 of a fixed shuffle of the 60,000
training images, and prints the held-out accuracy after each epoch. A variant is options:
--first-layer (whitened and fixed, the default; whitened and trained; or trained from a
random start), --first-channels, --warmup, --lr, --no-mirror, --seed, --epochs
(--train-images N trains on N of the images only, a quick check). docs/defaults.md gives
the table it made. --speed times the training step (forward, backward, fused AdamW) of the
model with each first layer on one batch in memory, alternately (5 rounds of 40 steps:
--rounds, --steps), and prints the median images/s of each against the previous model's.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import DEBIAN_FASHION, stage_fashion  # noqa: E402 (this script's own directory comes first on sys.path)

import mnist_ddp  # noqa: E402
from ddpkit.data.imagesets import ImageSet, load_mnist_like, normalize  # noqa: E402
from ddpkit.data.staging import MNIST_LIKE  # noqa: E402
from ddpkit.data.whitening import whiten_first_layer  # noqa: E402
from ddpkit.distributed import Runtime  # noqa: E402
from ddpkit.options import RunOptions  # noqa: E402
from ddpkit.run.weight_average import WeightAverage  # noqa: E402

HELD_OUT = 10_000
SPLIT_SEED = 12_345  # the held-out images are the same for every variant and seed
FIRST_LAYERS = ("whitened-fixed", "whitened-trained", "trained")


def image_sets(fashion: Path, data_dir: Path, test: bool, train_images: int = 0) -> tuple[ImageSet, ImageSet]:
    """(train, scored): the 50,000 / 10,000 held-out split of the training images, or with
    `test` all 60,000 and the test set; with `train_images`, the first that many of the
    training part. Staged into data_dir as bench.py stages them, and read as mnist_ddp.py
    reads them (its IDX reader and Fashion-MNIST's pixel statistics)."""
    stage_fashion(fashion, data_dir)
    train, test_set = load_mnist_like(MNIST_LIKE["fashion-mnist"], data_dir, "memory", torch.device("cpu"))

    def part(indices) -> ImageSet:
        return ImageSet(train.labels[indices], train.images[indices], None, train.classes, train.mean, train.std)
    if test:
        return part(slice(train_images or None)), test_set
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(SPLIT_SEED))
    return part(order[:-HELD_OUT][:train_images or None]), part(order[-HELD_OUT:])


def build(first_layer: str, channels: int, train_set: ImageSet | None, seed: int) -> nn.Module:
    """mnist_ddp.py's SmallCNN with a first convolution of `channels` filters, as `first_layer` says."""
    torch.manual_seed(seed)
    model = mnist_ddp.SmallCNN(1, 28, 28, 10, 0.0)
    model.features[0] = nn.Conv2d(1, channels, 5, stride=2, padding=2)
    model.features[2] = nn.Conv2d(channels, 64, 3, stride=2, padding=1)
    if first_layer != "trained" and train_set is not None:
        whiten_first_layer(model.features[0], train_set, seed)
    model.features[0].requires_grad_(first_layer != "whitened-fixed")
    return model


def train(args) -> list[float]:
    train_set, scored_set = image_sets(Path(args.fashion_dir), Path(args.data_dir), args.test, args.train_images)
    recipe = mnist_ddp.Recipe(dataset="fashion-mnist", lr=args.lr, warmup=args.warmup, seed=args.seed, epochs=args.epochs)
    model = build(args.first_layer, args.first_channels, train_set, args.seed)
    average = WeightAverage(model, recipe.ema)
    optimizer = mnist_ddp.build_optimizer(recipe, model)
    rt = Runtime(0, 0, 1, torch.device("cpu"), "none", True)
    steps = -(-len(train_set) // recipe.global_batch)
    step, accuracy = 0, []
    for epoch in range(1, recipe.epochs + 1):
        shard = mnist_ddp.epoch_shard(len(train_set), epoch, recipe.seed, rank=0, world_size=1,
                                      batch_size=recipe.global_batch, steps=steps)
        moves = mnist_ddp.epoch_moves(len(train_set), epoch, recipe.seed, recipe.shift, args.mirror)
        for images, y in train_set.batches(list(shard.split(recipe.global_batch)), rt.device, moves=moves):
            x = normalize(images, train_set.mean, train_set.std)
            lr = mnist_ddp.lr_at(step, recipe.epochs * steps, recipe.lr, recipe.warmup)
            mnist_ddp.train_step(model, optimizer, lr, x, y, label_smoothing=recipe.label_smoothing)
            average.update(step)
            step += 1
        result = mnist_ddp.evaluate(average.model, scored_set, RunOptions(), rt, args.mirror)
        accuracy.append(round(100 * result.metrics["accuracy"], 2))
        print(f"epoch {epoch}: {accuracy[-1]:.2f} % ({'test set' if args.test else 'held out'})", flush=True)
    return accuracy


def speed(rounds: int, steps: int) -> None:
    """Median images/s of a training step by first layer (32 filters), against the previous model (16, trained)."""
    variants = {"previous: 16 filters, trained": ("trained", 16), "32, whitened and fixed (the default)": ("whitened-fixed", 32),
                "32, whitened and trained": ("whitened-trained", 32), "32, trained from a random start": ("trained", 32)}
    models = {name: build(layer, channels, None, 0) for name, (layer, channels) in variants.items()}
    optimizers = {name: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], fused=True) for name, m in models.items()}
    x, y = torch.randn(128, 1, 28, 28), torch.randint(0, 10, (128,))
    rates = {name: [] for name in models}
    for _ in range(rounds):
        for name, model in models.items():
            start = time.perf_counter()
            for _ in range(steps):
                loss = F.cross_entropy(model(x), y)
                optimizers[name].zero_grad()
                loss.backward()
                optimizers[name].step()
            rates[name].append(steps * 128 / (time.perf_counter() - start))
    base = statistics.median(next(iter(rates.values())))
    for name, values in rates.items():
        print(f"{name}: {statistics.median(values):.0f} images/s, {statistics.median(values) / base:.2f}x", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--fashion-dir", default=str(DEBIAN_FASHION), help="Fashion-MNIST's .gz or IDX files (default: %(default)s)")
    parser.add_argument("--data-dir", default="bench-out/data", help="where they are unpacked, as bench.py does (default: "
                        "%(default)s)")
    parser.add_argument("--first-layer", choices=FIRST_LAYERS, default="whitened-fixed", help="default: %(default)s")
    parser.add_argument("--first-channels", type=int, default=32, help="default: %(default)s")
    parser.add_argument("--warmup", type=float, default=mnist_ddp.Recipe.warmup, help="default: %(default)s")
    parser.add_argument("--lr", type=float, default=mnist_ddp.Recipe.lr, help="default: %(default)s")
    parser.add_argument("--mirror", action=argparse.BooleanOptionalAction, default=True,
                        help="alternating mirrored images in training, both views in evaluation (default: on)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=mnist_ddp.Recipe.epochs, help="default: %(default)s")
    parser.add_argument("--test", action="store_true", help="train on all 60,000 images and score on the test set")
    parser.add_argument("--speed", action="store_true", help="images/s of a training step, by first layer")
    parser.add_argument("--rounds", type=int, default=5, help="--speed: rounds of each model (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=40, help="--speed: steps a round (default: %(default)s)")
    parser.add_argument("--train-images", type=int, default=0,
                        help="train on the first N images of the training part only, for a quick check (0: all)")
    parser.add_argument("--json", help="append the run's variant and accuracies to this file")
    args = parser.parse_args()
    if args.speed:
        return speed(args.rounds, args.steps)
    accuracy = train(args)
    if args.json:
        with open(args.json, "a") as out:
            kept = {k: v for k, v in vars(args).items() if k not in ("json", "speed", "rounds", "steps")}
            out.write(json.dumps({**kept, "accuracy": accuracy}) + "\n")


if __name__ == "__main__":
    main()
