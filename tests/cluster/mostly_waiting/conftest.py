"""tests/cluster/mostly_waiting/: the Slurm tests whose time is mostly spent waiting (for the
time limit to come near, for slurmctld to declare a node down, for a hang to time out), so
that they cost the other two groups little CPU while they run beside them: the single-node
cluster timed_node, and three_nodes. Run as one pytest process, beside
tests/cluster/one_node/ and tests/cluster/own_clusters/."""

import pytest

from helpers.cluster import Cluster, on_host_network
from helpers.processes import clean_env


@pytest.fixture(scope="session")
def timed_node(tmp_path_factory):
    cluster = Cluster(tmp_path_factory.mktemp("slurm-timed"), 1, on_host_network("timed_node", LOCAL_SLURM_PORT="16887"))
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def three_nodes(tmp_path_factory):
    """Three nodes (ftn1, ftn2, ftn3); slurmctld declares a silent node down within about 10 s.
    One per file that uses it: test_recovery_across_nodes.py's tests take nodes down."""
    cluster = Cluster(tmp_path_factory.mktemp("slurm3"), 3,
                      clean_env(LOCAL_SLURM_PORT="16847", LOCAL_SLURM_PREFIX="ft", LOCAL_SLURM_SUBNET="10.231.11",
                                LOCAL_SLURM_SELF_LOOPBACK="1", LOCAL_SLURM_CONF="SlurmdTimeout=10\nMessageTimeout=6"))
    yield cluster
    cluster.stop()
