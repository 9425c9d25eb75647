"""The suite's tiers are its folders (docs/tests.md): tests/unit/ (one module each, no process
of training started), tests/runs/ (real processes: mnist_ddp.py, torchrun, sweep.py, the
benchmark, tensorboard.sh) and tests/cluster/ (a local Slurm, network namespaces or sshd):
the hook below marks each test by its folder. `slow`, the longer end-to-end runs, is marked on
each such test where it stands. What the tests share lives in tests/helpers/; here: the
import path, the tiers' markers and the generic fixtures."""

import shutil
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
# The project (mnist_ddp, ddpkit, sweep) and tests/ (helpers.processes, helpers.images, ...).
for path in (ROOT, TESTS):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from helpers.images import TINY, make_image_folder  # noqa: E402 (after the path above)


def pytest_configure(config):
    config.addinivalue_line("markers", "unit: a unit test of one module (tests/unit/)")
    config.addinivalue_line("markers", "runs: starts real processes of the project's commands (tests/runs/)")
    config.addinivalue_line("markers", "slurm: starts a local Slurm cluster, network namespaces or sshd (tests/cluster/)")
    config.addinivalue_line("markers", "slow: a longer end-to-end run, marked where it stands; not in `make test-fast`")


# Each tier's marker, by the folder its tests stand in (as pytest names them: not resolved).
TIERS = {Path(__file__).parent / folder: marker
         for folder, marker in (("unit", pytest.mark.unit), ("runs", pytest.mark.runs), ("cluster", pytest.mark.slurm))}


def pytest_collection_modifyitems(items):
    for item in items:
        for folder, marker in TIERS.items():
            if folder in item.path.parents:
                item.add_marker(marker)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """An empty working directory: runs stage their data into its data/ and log into its runs/."""
    return tmp_path


@pytest.fixture(scope="session")
def tiny_images(tmp_path_factory) -> Path:
    """A tiny image folder (helpers.images.TINY), made once per session."""
    return make_image_folder(tmp_path_factory.mktemp("tiny"), TINY, size=12)


@pytest.fixture
def tiny_folder(tiny_images: Path, tmp_path: Path) -> Path:
    """The tiny folder, a copy of the test's own (a run caches the pixel statistics in it)."""
    return Path(shutil.copytree(tiny_images, tmp_path / "tiny"))
