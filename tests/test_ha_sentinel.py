"""Redis Sentinel: the primary is killed under two running supervisors, the replica takes over.

A real setup of one primary, one replica and three Sentinels (``tests/ha_servers.py``);
the supervisors, their heartbeats, their wake-ups and the test's own client all reach
Redis through ``redis+sentinel://`` and follow the failover without a restart.
"""
import select
import uuid

import pytest

from supervisor.backends import open_broker
from supervisor.errors import BrokerError
from supervisor.model import NewJob
from supervisor.toolkit import open_redis
from supervisor.toolkit.cache import Cache
from supervisor.toolkit.locks import Locks

from .failover_flow import run_through_failover
from .ha_servers import SentinelSetup
from .util import wait_for

pytestmark = pytest.mark.services


@pytest.fixture
def sentinel(tmp_path):
    setup = SentinelSetup(tmp_path / "redis")
    yield setup
    setup.stop()


def test_jobs_flow_through_a_sentinel_failover_each_effect_once(sentinel, tmp_path):
    url = sentinel.url(f"t{uuid.uuid4().hex[:8]}")
    client = open_broker(url)
    try:
        got = run_through_failover(tmp_path, url, client, sentinel.kill_primary)
        print("sentinel failover:", got)  # duplicates: runs the lost acks caused, suppressed by the effect's key
        assert sentinel.master_port() == sentinel.replica.port
    finally:
        client.close()


def test_wakeups_and_the_toolkits_locks_and_cache_follow_the_failover(sentinel):
    """The same client objects, before and after: no restart, no new URL."""
    prefix = f"t{uuid.uuid4().hex[:8]}"
    client = open_broker(sentinel.url(prefix))
    redis_client, key_prefix = open_redis(sentinel.url(prefix + ":toolkit:"))
    locks, cache = Locks(redis_client, key_prefix), Cache(redis_client, key_prefix)
    try:
        client.enqueue(NewJob("t", {}))
        fd = client.wakeup_fd()
        with locks.acquire("a", ttl=30) as lock:
            first_fence = lock.fence
        assert cache.get_or_build("k", lambda: "v1", ttl=60) == "v1"
        sentinel.wait_replicated()
        sentinel.kill_primary()
        # The wake-up connection was the old primary's: draining says so once, then a new one is made.
        wait_for(lambda: select.select([fd], [], [], 0)[0], timeout=10, message="the old wake-up socket to close")
        with pytest.raises(BrokerError):
            client.drain_wakeups()
        wait_for(lambda: _answers(client), timeout=30, message="the client to reach the promoted replica")
        new_fd = client.wakeup_fd()
        client.enqueue(NewJob("t", {}))
        wait_for(lambda: select.select([new_fd], [], [], 0)[0], timeout=10,
                 message="a wake-up from the promoted replica")
        client.drain_wakeups()
        assert client.stats(["default"])["default"].ready == 2  # the job enqueued before the failover too
        with locks.acquire("a", ttl=30) as lock:  # the toolkit's client found the new primary by itself
            assert lock.fence > first_fence
        assert cache.get_or_build("k", lambda: "v2", ttl=60) == "v1"  # replicated before the failover
    finally:
        redis_client.close()
        client.close()


def _answers(client):
    try:
        client.stats(["default"])
        return True
    except BrokerError:
        return False
