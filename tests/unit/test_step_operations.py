"""What a training step costs besides training itself: the tensor operations the loop
dispatches around the training step (forward, backward, optimizer), counted with a
TorchDispatchMode on the CPU, stay at 6 (each one a kernel launch on a GPU). Start-up's
cost in real runs: tests/runs/test_overhead.py.

    python -m pytest tests/unit/test_step_operations.py
"""

import collections
import itertools

from torch.utils._python_dispatch import TorchDispatchMode

import mnist_ddp
from ddpkit.run import training_run

# The operations a step dispatches outside forward, backward and the optimizer, one process
# on the CPU: the batch (one indexing of the shifted windows), normalising (subtract, divide),
# the weight average (one fused lerp), the epoch's loss sum (one add) and the agreement's
# loss (one copy). Several ranks add the agreement's all-reduce. It was 36 before the
# batch, the loss sum and the agreement were made in place and once per epoch.
OPERATIONS_PER_STEP = 6


class OperationCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.operations, self.paused = [], False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.operations.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_training_step_dispatches_no_more_operations_than_it_did(tmp_path, monkeypatch):
    count, ends = OperationCount(), []
    train_step, step_done = mnist_ddp.train_step, training_run.TrainingRun.step_done

    def the_step_itself(*args, **kwargs):  # forward, backward, the optimizer: not counted
        count.paused = True
        try:
            return train_step(*args, **kwargs)
        finally:
            count.paused = False

    def mark_the_step_end(self, *args, **kwargs):
        step_done(self, *args, **kwargs)
        ends.append(len(count.operations))

    monkeypatch.setattr(mnist_ddp, "train_step", the_step_itself)
    monkeypatch.setattr(training_run.TrainingRun, "step_done", mark_the_step_end)
    with count:  # 20 steps of the defaults: none logs (every 50) or saves (every 500)
        code = mnist_ddp.main(["--max-steps", "20", "--data-dir", str(tmp_path / "data"), "--log-dir", str(tmp_path)])
    assert code == 0
    per_step = [b - a for a, b in itertools.pairwise(ends)]
    middle = collections.Counter(count.operations[ends[9]:ends[10]])
    assert len(per_step) == 19 and max(per_step) <= OPERATIONS_PER_STEP, (per_step, middle)
