"""tests/cluster/one_node/: the tests that share one single-node Slurm in the host's network
namespace for the whole session (each start and stop costs seconds, and no test leaves the
cluster other than it found it: jobs end, rules are removed). Run as one pytest process,
beside tests/cluster/own_clusters/ and tests/cluster/mostly_waiting/."""

import pytest

from helpers.cluster import Cluster, on_host_network


@pytest.fixture(scope="session")
def one_node(tmp_path_factory):
    cluster = Cluster(tmp_path_factory.mktemp("slurm1"), 1, on_host_network("one_node", LOCAL_SLURM_PORT="16817"))
    yield cluster
    cluster.stop()



