"""``wait_replicas`` (``broker.redis_wait_replicas``): an acknowledged enqueue survives the failover.

A primary and a replica replicate through a relay the test cuts (a real
partition of the replication link); then the primary is killed and the replica
promoted. The same run shows both sides: without WAIT an enqueue the primary
acknowledged after the cut is gone from the promoted replica; with
``wait_replicas=1`` such an enqueue is refused (BrokerError: not confirmed),
and every enqueue that was confirmed is there after the failover.
"""
import uuid

import pytest

from supervisor.backends import open_broker
from supervisor.errors import BrokerError
from supervisor.model import NewJob

from .daemon import Daemon
from .failover_flow import only_the_new_lease_acks
from .ha_servers import ReplicatedRedis
from .util import wait_for

pytestmark = pytest.mark.services


@pytest.fixture
def pair(tmp_path):
    setup = ReplicatedRedis(tmp_path)
    yield setup
    setup.stop()


# The replica's link is a relay thread of this process: 2 s, not the 300 ms a quiet machine needs, so
# that a loaded one (the parallel suite on 2 cores) still confirms the writes made before the cut.
def test_an_enqueue_confirmed_by_a_replica_survives_the_failover_and_one_without_wait_may_not(pair):
    prefix = f"t{uuid.uuid4().hex[:8]}"
    url = f"{pair.primary.url}?prefix={prefix}"
    plain = open_broker(url)
    waiting = open_broker(f"{url}&wait_replicas=1&wait_timeout=2000")
    try:
        confirmed = waiting.enqueue(NewJob("t", {"n": "confirmed"}))
        pair.link.cut()
        unconfirmed = plain.enqueue(NewJob("t", {"n": "acknowledged, never replicated"}))
        with pytest.raises(BrokerError, match="reached 0 of 1 replica"):
            waiting.enqueue(NewJob("t", {"n": "refused"}))
        assert plain.get(unconfirmed) is not None and plain.stats(["default"])["default"].ready == 3
        pair.promote()
        after = open_broker(f"{pair.replica.url}?prefix={prefix}")
        try:
            assert after.get(confirmed) is not None  # what WAIT confirmed survived
            assert after.get(unconfirmed) is None  # acknowledged without WAIT, lost in the failover
            assert after.stats(["default"])["default"].ready == 1  # the refused one was never promised
        finally:
            after.close()
    finally:
        plain.close()
        waiting.close()


def test_outcome_writes_wait_for_the_replica_too(pair):
    url = f"{pair.primary.url}?prefix=t{uuid.uuid4().hex[:8]}&wait_replicas=1&wait_timeout=2000"
    broker = open_broker(url)
    try:
        broker.enqueue_many([NewJob("t", {}) for _ in range(2)])
        first, second = broker.claim(["default"], 2, 30, "w")
        broker.ack(first.lease)
        pair.link.cut()
        with pytest.raises(BrokerError, match="reached 0 of 1 replica"):
            broker.ack(second.lease)
    finally:
        broker.close()


def test_the_daemon_takes_redis_wait_replicas_from_its_config(pair, tmp_path):
    """``broker.redis_wait_replicas = 1`` in the config: the supervisor's ack waits for the replica, and
    an ack no replica confirmed is not counted as stored (kept and retried, the job stays running)."""
    url = f"{pair.primary.url}?prefix=t{uuid.uuid4().hex[:8]}"
    d = Daemon(tmp_path, broker_url=url, supervisor={"workers": 1}, broker={"redis_wait_replicas": 1})
    client = open_broker(url)
    d._broker = client
    try:
        d.start()
        assert d.wait_job(client.enqueue(NewJob("noop", {})), timeout=30).state == "done"  # confirmed
        pair.link.cut()
        job_id = client.enqueue(NewJob("noop", {}))
        wait_for(lambda: any("reached 0 of 1 replica" in r["msg"] for r in d.records(event="write_failed")),
                 timeout=30, message="the ack to wait for the replica and fail")
        assert client.get(job_id).state == "done"  # on the primary: the ack did land there, unconfirmed
        assert d.status()["pending_writes"] == 1  # but the supervisor did not count it as stored
    finally:
        d.kill_group()  # its shutdown would retry the unconfirmable write until its deadline
        d.stop()


def test_a_claim_lost_in_the_failover_gives_the_next_claim_another_token_so_the_old_ack_is_refused(pair):
    # The primary leases the job after the cut: the promoted replica has it queued under its previous
    # token. Its next claim must not hand out the token the lost claim did: the first owner's ack
    # (its run is still a run) would store its outcome over the second owner's live lease.
    prefix = f"t{uuid.uuid4().hex[:8]}"
    first = open_broker(f"{pair.primary.url}?prefix={prefix}")
    replica = open_broker(f"{pair.replica.url}?prefix={prefix}")
    try:
        job_id = first.enqueue(NewJob("t", {}))
        wait_for(lambda: replica.get(job_id) is not None, timeout=20, message="the job to reach the replica")
        pair.link.cut()
        [stale] = first.claim(["default"], 1, 60, "first")
        pair.promote()
    finally:
        first.close()
        replica.close()
    second = open_broker(f"{pair.replica.url}?prefix={prefix}")
    try:
        [live] = second.claim(["default"], 1, 60, "second")
        only_the_new_lease_acks(second, stale, live, job_id)
    finally:
        second.close()
