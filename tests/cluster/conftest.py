"""tests/cluster/: every test that starts a local Slurm (local-slurm.sh), network namespaces or
sshd; all marked `slurm` (tests/conftest.py). They need root. Three groups, each run by a pytest process of its
own, at the same time (`make test`; docs/tests.md): one_node/ shares one single-node cluster,
own_clusters/ holds the clusters in network namespaces and those a test starts for itself,
mostly_waiting/ the tests that mostly wait (the time limit, nodes lost and left out).
Each cluster fixture lives in its group's conftest.py, so no cluster is started by both; the
clusters in the host's network namespace number their jobs from blocks of their own, so no two
jobs share a rendezvous port (helpers/cluster.py). No test's verdict depends on the machine's
speed: the one that needs a run of a known length makes its steps last a known time
(AID_STEP_SECONDS, tests/aids/training_aids.py)."""

import os
from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Two pytest-xdist workers of one group would each start the same cluster, on the same port."""
    if HERE in item.path.parents and int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        pytest.fail("the Slurm tests of a group share clusters on fixed ports: run each group in one process "
                    "(without -n), as `make test` does", pytrace=False)
