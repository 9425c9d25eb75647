"""mnist_ddp.py's recipe functions in this process: every global batch holds the same
images with the same shifts on 1, 2, 3, 4 or 8 ranks (the epoch's shards), the order of a
seed is pinned, the shift augmentation moves each image by at most one pixel, evaluate's
confusion matrix has the true class in its rows, parameter groups keep their own lr and
weight decay through the schedule and a resume, and build_training makes the model, its
average and AdamW as the recipe says. Real training runs: tests/runs/test_training.py.

    python -m pytest tests/unit/test_recipe.py
"""

import dataclasses

import pytest
import torch

import mnist_ddp
from ddpkit.data import imagesets
from ddpkit.data.whitening import whiten_first_layer
from ddpkit.distributed import Runtime
from ddpkit.options import RunOptions
from ddpkit.run.checkpoints import load_optimizer


def global_batches(n: int, epoch: int, world_size: int, batch_size: int) -> list[list[tuple[int, int, int]]]:
    """Each step's images over all ranks, each with its (down, right, mirrored) move, as the ranks take them."""
    steps = -(-n // (world_size * batch_size))  # (the run's epoch: every image, the last global batch filled up)
    shards = [mnist_ddp.epoch_shard(n, epoch, 5, rank=rank, world_size=world_size, batch_size=batch_size, steps=steps)
              for rank in range(world_size)]
    assert len({len(shard) for shard in shards}) == 1  # every rank runs the same number of steps
    shifts = mnist_ddp.epoch_moves(n, epoch=epoch, seed=5, shift=0.5, mirror=True)
    return [sorted((i, *shifts[:, i].tolist()) for shard in shards for i in shard[k * batch_size: (k + 1) * batch_size].tolist())
            for k in range(len(shards[0]) // batch_size)]


@pytest.mark.parametrize("n", [4000, 1000, 1003, 24, 7])
def test_every_global_batch_holds_the_same_images_with_the_same_moves_on_1_2_3_4_or_8_ranks(n):
    """A global batch of 24 on 1, 2, 3, 4 or 8 ranks: step k trains the same images, each
    shifted and mirrored alike, so a run saved on N ranks goes on in mid-epoch on M. Every image comes
    once in an epoch, the last batch filled up with the epoch's first ones; each epoch's
    order differs."""
    for epoch in (1, 2):
        alone = global_batches(n, epoch, 1, 24)
        assert len(alone) == -(-n // 24) and all(len(batch) == 24 for batch in alone)
        for world_size in (2, 3, 4, 8):
            assert global_batches(n, epoch, world_size, 24 // world_size) == alone, world_size
        order = mnist_ddp.epoch_shard(n, epoch, 5, rank=0, world_size=1, batch_size=24, steps=-(-n // 24)).tolist()
        assert sorted(order[:n]) == list(range(n)) and order[n:] == order[:len(order) - n]
    assert global_batches(n, 1, 1, 24) != global_batches(n, 2, 1, 24)


def test_the_order_of_a_seed_stays_the_same_from_one_version_to_the_next():
    """A run resumed in the middle of an epoch goes on with that epoch's order: if the code
    that draws it changed between the save and the resume, some images would be trained
    twice in that epoch and others not at all. So the order of a seed is pinned here, and
    the moves of the augmentation with it (the shifts as they were before the mirroring came)."""
    assert [mnist_ddp.epoch_shard(10, 1, 0, rank=rank, world_size=2, batch_size=5, steps=1).tolist()
            for rank in (0, 1)] == [[5, 1, 0, 9, 7], [6, 2, 8, 3, 4]]
    assert mnist_ddp.epoch_shard(10, 2, 3, rank=0, world_size=1, batch_size=10, steps=1).tolist() == [
        0, 7, 1, 6, 3, 8, 9, 4, 2, 5]
    assert mnist_ddp.epoch_moves(12, epoch=3, seed=2, shift=0.5, mirror=True).tolist() == [
        [-1, -1, 0, 1, 0, -1, 1, 0, 1, 1, 0, 0], [1, -1, -1, 0, 0, -1, 1, -1, 0, 1, 0, 0],
        [0, 1, 0, 1, 1, 1, 0, 1, 1, 0, 1, 0]]


def test_shift_augmentation_moves_images_by_one_pixel():
    moves = mnist_ddp.epoch_moves(10_000, epoch=3, seed=0, shift=0.25, mirror=False)[:2]
    moved = moves.abs().sum(0) > 0
    assert moves.shape == (2, 10_000) and moves.abs().max() == 1
    assert 0.22 < moved.float().mean() < 0.28
    # The same moves whenever they are drawn (any rank, any resume), new ones each epoch and seed.
    assert torch.equal(moves, mnist_ddp.epoch_moves(10_000, epoch=3, seed=0, shift=0.25, mirror=False)[:2])
    assert not torch.equal(moves, mnist_ddp.epoch_moves(10_000, epoch=4, seed=0, shift=0.25, mirror=False)[:2])
    assert not torch.equal(moves, mnist_ddp.epoch_moves(10_000, epoch=3, seed=1, shift=0.25, mirror=False)[:2])
    assert mnist_ddp.epoch_moves(10, epoch=0, seed=0, shift=0.0, mirror=False) is None
    every = mnist_ddp.epoch_moves(1000, epoch=3, seed=0, shift=1.0, mirror=False)[:2]  # each moves, in one of 8 directions
    assert (every.abs().sum(0) > 0).all() and len(set(map(tuple, every.T.tolist()))) == 8
    images = torch.arange(1, 28 * 28 + 1, dtype=torch.int32).reshape(1, 28, 28).repeat(9, 1, 1).to(torch.uint8)
    grid = torch.tensor([[d // 3 - 1 for d in range(9)], [d % 3 - 1 for d in range(9)]])
    shifted = imagesets.shift_images(images.unsqueeze(1), grid).squeeze(1)
    for i, (down, right) in enumerate(grid.T.tolist()):
        expected = torch.roll(images[i], shifts=(down, right), dims=(0, 1))
        if down:
            expected[0 if down > 0 else -1, :] = 0
        if right:
            expected[:, 0 if right > 0 else -1] = 0
        assert torch.equal(shifted[i], expected), (down, right)


def test_mirroring_alternates_each_image_every_other_epoch_half_of_them_at_a_time():
    """With mirror, each image is mirrored in one of any two epochs in a row (alternating, not
    drawn), half of the images in each; the shifts are those drawn without it. Without mirror
    there is no third row, and no shift and no mirror is no move at all."""
    by_epoch = [mnist_ddp.epoch_moves(10_000, epoch=epoch, seed=4, shift=0.25, mirror=True) for epoch in (1, 2, 3, 4)]
    mirrored = torch.stack([moves[2] for moves in by_epoch])
    assert set(mirrored.unique().tolist()) == {0, 1}
    assert (mirrored[:-1] + mirrored[1:] == 1).all()  # each epoch the other way from the one before
    assert 0.47 < mirrored[0].float().mean() < 0.53
    for epoch, moves in zip((1, 2, 3, 4), by_epoch, strict=True):
        assert torch.equal(moves[:2], mnist_ddp.epoch_moves(10_000, epoch=epoch, seed=4, shift=0.25, mirror=False)[:2])
    assert len(mnist_ddp.epoch_moves(100, epoch=1, seed=4, shift=0.25, mirror=False)) == 2
    assert mnist_ddp.epoch_moves(100, epoch=1, seed=4, shift=0.0, mirror=True)[:2].eq(0).all()
    assert not torch.equal(mirrored[0], mnist_ddp.epoch_moves(10_000, epoch=1, seed=5, shift=0.25, mirror=True)[2])


def test_each_data_set_says_whether_its_images_may_be_mirrored_and_a_folder_takes_it_from_mirror():
    assert [mnist_ddp.Recipe(dataset=name).mirrored for name in ("mnist-sample", "mnist", "fashion-mnist")] == [
        False, False, True]
    assert not mnist_ddp.Recipe(dataset="folder").mirrored  # (--mirror-images is off by default)
    assert mnist_ddp.Recipe(dataset="folder", mirror_images=True).mirrored


class PredictsFromPixel(torch.nn.Module):
    """Predicts the class written in an image's first pixel (0, 128 or 255 for 0, 1, 2)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return -10 * (2 * x[:, :1, 0, 0] - torch.arange(3)) ** 2


def test_evaluate_counts_the_confusion_matrix_rows_as_the_true_class_and_columns_as_the_prediction():
    """7 test images in batches of 3, 3 of them wrong: the confusion matrix, the accuracy, the
    loss and the misclassified examples, each as the true and predicted classes say."""
    true = torch.tensor([0, 0, 1, 1, 1, 2, 2])
    predicted = torch.tensor([0, 1, 1, 1, 2, 0, 2])
    images = (predicted * 255 // 2 + (predicted == 1)).to(torch.uint8).view(7, 1, 1, 1).expand(7, 1, 2, 2).contiguous()
    split = imagesets.ImageSet(true, images, None, ("a", "b", "c"), (0.0,), (1.0,))
    rt = Runtime(0, 0, 1, torch.device("cpu"), "none", True)
    model = PredictsFromPixel()
    result = mnist_ddp.evaluate(model, split, RunOptions(), rt, batch_size=3)
    assert result.confusion.tolist() == [[1, 1, 0], [0, 2, 1], [1, 0, 1]]  # [true][predicted]
    assert result.count == 7 and list(result.metrics) == ["loss", "accuracy"]
    assert result.metrics["accuracy"] == 4 / 7
    logits = model(images.float() / 255)
    assert logits.argmax(1).tolist() == predicted.tolist()
    assert result.metrics["loss"] == pytest.approx(torch.nn.functional.cross_entropy(logits, true).item())
    pictures, shown_predicted, shown_true = result.examples["misclassified"]
    assert (shown_predicted.tolist(), shown_true.tolist()) == ([1, 2, 0], [0, 1, 2]) and torch.equal(pictures, images[[1, 4, 5]])
    assert result.examples["predictions"][1].tolist() == [0, 1, 1] and model.training  # the first batch


def test_parameter_groups_keep_their_own_lr_and_weight_decay_through_the_schedule_and_a_resume(tmp_path):
    """A group built with its own lr and weight decay (here the first layer at a tenth of
    --lr, without decay) follows the schedule at its own scale and keeps its decay; a resume
    keeps both, and a resume with another --lr (--allow-changes) scales both groups anew."""
    def build(lr: float):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
        optimizer = torch.optim.AdamW([{"params": model[0].parameters(), "lr": lr / 10, "weight_decay": 0.0},
                                       {"params": model[2].parameters()}], lr=lr, weight_decay=5e-4, fused=True)
        return model, optimizer

    def groups(optimizer) -> tuple[list, list]:
        return [g["lr"] for g in optimizer.param_groups], [g["weight_decay"] for g in optimizer.param_groups]

    x, y = torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])
    model, optimizer = build(1e-3)
    for lr in (1e-3, 5e-4):
        mnist_ddp.train_step(model, optimizer, lr, x, y)
        assert groups(optimizer) == (pytest.approx([lr / 10, lr]), [0.0, 5e-4])
    path = tmp_path / "optimizer.pt"
    torch.save(optimizer.state_dict(), path)
    for peak in (1e-3, 2e-3):  # resumed as it was, and with --lr 2e-3
        model, resumed = build(peak)
        load_optimizer(path, resumed, torch.load(path, weights_only=True))
        assert [resumed.state[p]["step"].item() for p in model.parameters()] == [2] * 4
        mnist_ddp.train_step(model, resumed, peak / 4, x, y)
        assert groups(resumed) == (pytest.approx([peak / 40, peak / 4]), [0.0, 5e-4])


def test_build_training_makes_the_model_its_average_and_adamw_as_the_recipe_says():
    """One process: the model of the seed (the same on every rank), its first filters the
    whitening of the training images (fixed: they take no gradient), unwrapped unless compiled,
    its weight average at --ema, AdamW at --lr and --weight-decay with beta2 0.99, and
    dropout's random numbers seeded by seed + rank after it."""
    recipe = mnist_ddp.Recipe(lr=2e-3, weight_decay=1e-4, ema=0.9, seed=3)
    pixels = torch.randint(0, 256, (3, 1, 12, 12), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    split = imagesets.ImageSet(torch.tensor([0, 1, 2]), pixels, None, ("a", "b", "c"), (0.5,), (0.25,))
    rt = Runtime(0, 0, 1, torch.device("cpu"), "none", True)
    training = mnist_ddp.build_training(recipe, RunOptions(), rt, split)
    wrapped, raw_model, optimizer, average = training.wrapped, training.model, training.optimizer, training.average
    after = torch.rand(3)
    torch.manual_seed(3)
    expected = mnist_ddp.build_model(recipe, (1, 12, 12), 3)
    whiten_first_layer(expected.features[0], split, 3)
    torch.manual_seed(3 + 0)
    assert torch.equal(after, torch.rand(3))
    assert wrapped is raw_model and training.scored is average.model and raw_model.state_dict().keys() == expected.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(raw_model.state_dict().values(), expected.state_dict().values(), strict=True))
    assert not any(p.requires_grad for p in raw_model.features[0].parameters())
    assert average.decay == 0.9 and average.model is not raw_model
    assert all(torch.equal(a, b) for a, b in zip(average.model.parameters(), raw_model.parameters(), strict=True))
    assert type(optimizer) is torch.optim.AdamW and optimizer.defaults["fused"]
    assert [(g["lr"], g["betas"], g["weight_decay"]) for g in optimizer.param_groups] == [(2e-3, (0.9, 0.99), 1e-4)]
    assert optimizer.param_groups[0]["params"] == list(raw_model.parameters())
    other = mnist_ddp.build_training(dataclasses.replace(recipe, ema=0.0), RunOptions(compile=True, channels_last=True), rt,
                                     split)
    compiled, raw = other.wrapped, other.model
    assert other.average is None and other.scored is raw and compiled is not raw and compiled._orig_mod is raw
    assert raw.features[2].weight.is_contiguous(memory_format=torch.channels_last)  # (64 x 32 x 3 x 3)
    assert not raw_model.features[2].weight.is_contiguous(memory_format=torch.channels_last)
