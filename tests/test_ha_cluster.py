"""Redis Cluster: the broker conformance suite, unchanged, on three primaries and three replicas,
and a primary killed under two running supervisors.

The cluster is started once for this module (``tests/ha_servers.py``); each test
gets a key prefix of its own. The conformance tests are the very functions of
``tests/test_broker_conformance.py``, ``test_conformance_control.py``,
``test_conformance_workflows.py`` and ``test_conformance_search.py``, imported here with ``broker_url`` pointing at
the cluster, so they run once, in this module only.
"""
import select
import uuid

import pytest

from supervisor.backends import open_broker
from supervisor.errors import BrokerError
from supervisor.model import NewJob

from .failover_flow import run_through_failover
from .ha_servers import RedisClusterSetup
# The conformance suites, collected again here against the cluster (``broker_url`` below).
from .test_broker_conformance import *  # noqa: F401,F403
from .test_conformance_control import *  # noqa: F401,F403
from .test_conformance_search import *  # noqa: F401,F403
from .test_conformance_workflows import *  # noqa: F401,F403
from .util import wait_for

pytestmark = pytest.mark.services


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    setup = RedisClusterSetup(tmp_path_factory.mktemp("cluster"))
    yield setup
    setup.stop()


@pytest.fixture
def broker_url(cluster):
    """Overrides conftest's: the conformance suite's broker is a fresh prefix on the cluster."""
    return cluster.url(f"t{uuid.uuid4().hex[:8]}")


def test_queues_spread_over_the_primaries_and_one_claim_takes_from_all(cluster, broker):
    queues = [f"q{i}" for i in range(12)]
    owners = {cluster.primary_of(f"{broker.prefix}:{{{q}}}:ready").port for q in queues}
    assert len(owners) == 3  # the hash tags put the queues on every primary
    broker.enqueue_many([NewJob("t", {"i": i}, queue=q) for i, q in enumerate(queues)])
    jobs = broker.claim(queues, 12, 30, "w")
    assert sorted(j.queue for j in jobs) == sorted(queues)
    assert all(s.in_flight == 1 for s in broker.stats(queues).values())
    assert broker.ack_many([(j.lease, None, None) for j in jobs]) == []
    assert sum(s.done for s in broker.stats(queues).values()) == 12


def test_jobs_flow_through_a_cluster_failover_each_effect_once(cluster, tmp_path):
    prefix = f"t{uuid.uuid4().hex[:8]}"
    url = cluster.url(prefix)
    client = open_broker(url)
    try:
        queue_key = f"{prefix}:{{default}}:ready"  # the primary serving the queue the jobs flow through
        got = run_through_failover(tmp_path, url, client, lambda: cluster.kill_primary_of(queue_key))
        print("cluster failover:", got)
    finally:
        client.close()


def test_wakeups_follow_the_failover_of_the_node_they_listen_on(tmp_path):
    """A cluster of its own: the primary the wake-up subscription sits on is the one killed."""
    own = RedisClusterSetup(tmp_path / "own")
    client = open_broker(own.url(f"t{uuid.uuid4().hex[:8]}"))
    try:
        fd = client.wakeup_fd()
        port = client._pubsub.connection.port
        victim = next(n for n in own.nodes if n.port == port)
        if victim.client().info("replication")["role"] != "master":  # redis-py may subscribe on a replica
            pytest.skip("the subscription sits on a replica")
        own.kill_primary_of(client.keys.channel)
        wait_for(lambda: select.select([fd], [], [], 0)[0], timeout=10, message="the old subscription to close")
        with pytest.raises(BrokerError):
            client.drain_wakeups()
        new_fd = wait_for(lambda: _fd(client), timeout=30, message="a new subscription")
        client.enqueue(NewJob("t", {}))
        wait_for(lambda: select.select([new_fd], [], [], 0)[0], timeout=10, message="a wake-up after the failover")
        client.drain_wakeups()
    finally:
        client.close()
        own.stop()


def _fd(client):
    try:
        return client.wakeup_fd()
    except BrokerError:
        return None
