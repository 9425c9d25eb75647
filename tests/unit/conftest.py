"""tests/unit/: unit tests of one module each (ddpkit/, mnist_ddp.py's functions, sweep.py's
summary, benchmarks/figures.py and the pages' claims). They start no process of training;
some start a helper process of their own (a forked holder of a lock, two Gloo ranks, a mount
namespace)."""

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items):
    for item in items:  # (every item of the session: mark this folder's)
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.unit)
