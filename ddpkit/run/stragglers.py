"""Stragglers: which rank is slow. In data-parallel training every rank's step takes as long
as the slowest one's, since the gradient all-reduce waits for it; so each rank times its own
part of a step, from the end of the previous step's backward pass to the end of this step's
forward pass (its data loading, its forward pass and the bookkeeping between steps), and
not the wait. Each rank's mean over a --log-every window travels in the per-step agreement
(recovery.py), with no collective of its own; rank 0 logs the slowest and the median, and
names a rank that stays more than SLOW_FACTOR times the other ranks' median.

Measured on the host: on a GPU the forward pass's kernels run after the host has queued
them, so there the figure is the host's part (data loading, launching); not run on a GPU here."""

import statistics
import time

import torch

SLOW_FACTOR = 1.5   # a rank this much slower than the other ranks' median ...
SLOW_WINDOWS = 3    # ... in this many --log-every windows in a row is named


class StepTimer:
    """This rank's own time per step over a window: started at each step's end (before its
    bookkeeping), stopped when the next forward pass ends (a forward hook on the model)."""

    def __init__(self, model: torch.nn.Module | None):
        self.began, self.own, self.steps = None, 0.0, 0
        self.hook = model.register_forward_hook(self.forward_done) if model is not None else None

    def forward_done(self, *_) -> None:
        if self.began is not None:
            self.own += time.perf_counter() - self.began
            self.steps += 1
            self.began = None

    def step_ended(self) -> None:
        self.began = time.perf_counter()

    def pause(self) -> None:
        """Until the next step_ended: not a step's time (a save, an evaluation's forward passes)."""
        self.began = None

    def window_ms(self) -> float | None:
        """This window's mean ms per step, and a new window begins; None if it timed no step."""
        if not self.steps:
            return None
        ms, self.own, self.steps = 1000 * self.own / self.steps, 0.0, 0
        return ms

    def remove(self) -> None:
        if self.hook:
            self.hook.remove()


class Stragglers:
    """Rank 0's judgement of each window's times: (slowest rank, its ms, the median ms), and
    once a rank stays slow, the line that names it (once, until it recovers)."""

    def __init__(self, hosts: list[str]):
        self.hosts, self.suspect, self.windows, self.named = hosts, None, 0, None

    def window(self, step_ms: tuple) -> tuple[int, float, float, str]:
        """(the slowest rank, its ms, the median rank's ms, the line naming a straggler or "").
        A rank is slow against the other ranks' median, which it cannot pull up itself."""
        median = statistics.median(step_ms)
        slowest = max(range(len(step_ms)), key=lambda r: step_ms[r])
        others = statistics.median(step_ms[:slowest] + step_ms[slowest + 1:])
        slow = step_ms[slowest] > SLOW_FACTOR * others
        self.windows = self.windows + 1 if slow and slowest == self.suspect else int(slow)
        self.suspect = slowest if slow else None
        line = ""
        if self.windows >= SLOW_WINDOWS and self.named != slowest:
            self.named = slowest
            host = self.hosts[slowest] if slowest < len(self.hosts) else "?"
            line = (f"straggler: rank {slowest} on {host} takes {step_ms[slowest]:.1f} ms of its own a step (data "
                    f"loading and forward pass), {step_ms[slowest] / max(others, 1e-9):.1f}x the other ranks' median "
                    f"of {others:.1f} ms, in {self.windows} windows of --log-every steps in a row; every rank waits for "
                    "it at each step (a busy node, its disk or its GPU?)")
        elif not slow:
            self.named = None  # (recovered: named again should it fall behind again)
        return slowest, step_ms[slowest], median, line
