"""tests/runs/: real processes of the project's commands, started as users start them:
mnist_ddp.py plain, under torchrun or as srun starts its tasks (helpers.processes), sweep.py,
the benchmark, tensorboard.sh, torchrun_commands.sh."""

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items):
    for item in items:  # (every item of the session: mark this folder's)
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.runs)
