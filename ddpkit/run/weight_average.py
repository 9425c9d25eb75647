"""An exponential moving average of a model's weights, which evaluation and model.pt use.

It evaluates well while the learning rate is still high: on full Fashion-MNIST it was worth
more than a point after 2 epochs (docs/defaults.md). Its decay ramps up as (1 + step) /
(10 + step), so that the random initial weights soon fade out of it. The checkpoints hold its
weights (the recipe passes `average.model` to the run), so a resume goes on with the same
average, bit for bit.
"""

import copy

import torch
import torch.nn as nn


class WeightAverage:
    """`model`'s parameters averaged with `decay` at each update (buffers copied as they are)."""

    def __init__(self, model: nn.Module, decay: float):
        self.model, self.decay = copy.deepcopy(model).requires_grad_(False), decay
        # Loading a checkpoint copies into these tensors, so the lists stay valid.
        self.mine, self.theirs = list(self.model.parameters()), list(model.parameters())

    @torch.no_grad()
    def update(self, step: int) -> None:
        """Move the average towards the model's weights after optimiser step `step` (0, 1, ...)."""
        weight = 1 - min(self.decay, (1 + step) / (10 + step))
        torch._foreach_lerp_(self.mine, self.theirs, weight)

    @torch.no_grad()
    def copy_buffers(self, model: nn.Module) -> None:
        """Take the model's buffers (BatchNorm's statistics) as they are: they are not averaged."""
        for mine, theirs in zip(self.model.buffers(), model.buffers(), strict=True):
            mine.copy_(theirs)
