"""What a run costs besides training itself. Start-up: a default run on staged data imports
only what it needs (no torchvision), and says at its first step how long it took to get
there. Each step: the tensor operations the loop dispatches around the training step
(forward, backward, optimizer), counted with a TorchDispatchMode on the CPU, stay at 6
(each one a kernel launch on a GPU).

Run: .venv/bin/python -m pytest tests/test_overhead.py"""

import collections
import itertools
import re
import subprocess
import sys

from torch.utils._python_dispatch import TorchDispatchMode

import mnist_ddp
from conftest import SCRIPT, assert_ok, clean_env
from ddpkit import training_run

# What a default run must not load: seconds of imports it never uses. (torch.optim's AdamW
# imports torch._dynamo, and with it sympy and FSDP: about a second, in the `ready in`
# line's "the rest".)
NOT_NEEDED = ("torchvision",)


def fresh_python(code: str, cwd, *args: str) -> subprocess.CompletedProcess:
    """A new interpreter (not the tests' forkserver, which has torchvision loaded already)."""
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=clean_env(), capture_output=True,
                          text=True, timeout=300)


def test_default_run_on_staged_data_does_not_load_torchvision(tmp_path):
    common = ["--epochs", "1", "--max-steps", "3", "--data-dir", str(tmp_path / "data"), "--log-dir", str(tmp_path)]
    assert_ok(subprocess.run([sys.executable, str(SCRIPT), *common, "--download-only"], cwd=tmp_path, env=clean_env(),
                             capture_output=True, text=True, timeout=300))
    code = (f"import sys; sys.path.insert(0, '{SCRIPT.parent}'); import mnist_ddp; code = mnist_ddp.main(sys.argv[1:]); "
            f"print('LOADED', sorted(m for m in {NOT_NEEDED!r} if m in sys.modules)); sys.exit(code)")
    run = fresh_python(code, tmp_path, *common)
    assert_ok(run)
    assert "LOADED []" in run.stdout, run.stdout[-2000:]


def test_the_first_step_says_how_long_start_up_took(tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPT), "--max-steps", "2", "--data-dir", str(tmp_path / "data"),
                          "--log-dir", str(tmp_path)], cwd=tmp_path, env=clean_env(), capture_output=True, text=True,
                         timeout=300)
    assert_ok(run)
    ready = [line for line in run.stdout.splitlines() if line.startswith("ready in ")]
    assert len(ready) == 1, run.stdout
    match = re.fullmatch(r"ready in ([\d.]+) s \(imports ([\d.]+) s, process group ([\d.]+) s, data ([\d.]+) s, "
                         r"the rest ([\d.]+) s\)", ready[0])
    assert match, ready[0]
    total, *parts = map(float, match.groups())
    assert parts[0] > 0 and abs(sum(parts) - total) < 0.01 * len(parts)  # (each figure rounded to 0.01 s)
    lines = run.stdout.splitlines()
    assert lines.index(ready[0]) < next(i for i, line in enumerate(lines) if line.startswith("epoch "))


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
