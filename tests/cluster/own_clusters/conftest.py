"""tests/cluster/own_clusters/: the clusters in network namespaces (two_nodes here, shared by
the group's files; two wider nodes and the sshd network in their files) and the single-node
clusters a test starts for itself (their own ports, prefixes and job ids). Run as one pytest
process, beside tests/cluster/one_node/ and tests/cluster/mostly_waiting/."""

import pytest

from helpers.cluster import Cluster
from helpers.processes import clean_env


@pytest.fixture(scope="session")
def two_nodes(tmp_path_factory):
    """Each node's own name resolves to 127.0.1.1 there, as on many real clusters: the batch
    file must still find an address the other node reaches, and Gloo an interface."""
    cluster = Cluster(tmp_path_factory.mktemp("slurm2"), 2,
                      clean_env(LOCAL_SLURM_PORT="16827", LOCAL_SLURM_PREFIX="mt", LOCAL_SLURM_SUBNET="10.231.9",
                                LOCAL_SLURM_SELF_LOOPBACK="1"))
    yield cluster
    cluster.stop()
