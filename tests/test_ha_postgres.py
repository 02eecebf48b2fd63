"""PostgreSQL failover: the primary stops under two running supervisors, the streaming replica is
promoted (``pg_ctl promote``), and the supervisors, the producer and the LISTEN wake-ups carry on
with it through a libpq multi-host URL (``target_session_attrs=read-write``).
"""
import select
import uuid

import pytest

from supervisor.backends import open_broker
from supervisor.errors import BrokerError
from supervisor.model import NewJob

from .failover_flow import only_the_new_lease_acks, run_through_failover
from .ha_servers import PostgresPair
from .util import wait_for

pytestmark = pytest.mark.services


@pytest.fixture(scope="module")
def pair_factory():
    made = []

    def make():
        made.append(PostgresPair())
        return made[-1]

    yield make
    for pair in made:
        pair.destroy()


def _failover(pair, mode="immediate"):
    """Stop the primary (``immediate``: a crash, no shutdown checkpoint) and promote the replica."""
    pair.wait_replicated()  # the jobs' rows are on the replica; what is in flight now may not be
    pair.primary.stop(mode=mode)
    pair.promote()


def test_jobs_flow_through_a_postgres_failover_each_effect_once(pair_factory, tmp_path):
    pair = pair_factory()
    url = pair.url(schema=f"t_{uuid.uuid4().hex[:8]}")
    client = open_broker(url)
    try:
        client.migrate()
        got = run_through_failover(tmp_path, url, client, lambda: _failover(pair))
        print("postgres failover:", got)
    finally:
        client.close()


def test_the_producer_and_its_listen_connection_reconnect_to_the_promoted_replica(pair_factory):
    pair = pair_factory()
    client = open_broker(pair.url(schema=f"t_{uuid.uuid4().hex[:8]}"))
    try:
        client.migrate()
        client.enqueue(NewJob("t", {}))
        fd = client.wakeup_fd()
        _failover(pair)
        wait_for(lambda: select.select([fd], [], [], 0)[0], timeout=10, message="the old listener to close")
        with pytest.raises(BrokerError):
            client.drain_wakeups()
        wait_for(lambda: _enqueued(client), timeout=30, message="the producer to reach the promoted replica")
        new_fd = client.wakeup_fd()
        client.enqueue(NewJob("t", {}))
        wait_for(lambda: select.select([new_fd], [], [], 0)[0], timeout=10, message="a NOTIFY from the new primary")
        client.drain_wakeups()
        assert client.stats(["default"])["default"].ready == 3  # the one from before the failover too
    finally:
        client.close()


def _enqueued(client):
    try:
        return client.enqueue(NewJob("t", {}))
    except BrokerError:
        return None


def test_a_host_list_without_target_session_attrs_still_writes_to_the_primary(pair_factory):
    """The standby first in the list, no target_session_attrs: the broker adds read-write itself."""
    pair = pair_factory()
    url = (f"postgresql://postgres@127.0.0.1:{pair.replica.port},127.0.0.1:{pair.primary.port}/postgres"
           f"?schema=t_{uuid.uuid4().hex[:8]}")
    client = open_broker(url)
    try:
        client.migrate()
        job_id = client.enqueue(NewJob("t", {}))
        assert client.get(job_id).state == "queued"
    finally:
        client.close()


def test_a_claim_lost_in_the_failover_gives_the_next_claim_another_token_so_the_old_ack_is_refused(pair_factory):
    # The standby is down while the primary leases the job, then the primary crashes and the standby
    # is promoted without that WAL: the job is queued there under its previous token. Its next claim
    # must not hand out the lost claim's token: the first owner's ack would pass as the second's.
    pair = pair_factory()
    schema = f"t_{uuid.uuid4().hex[:8]}"
    first = open_broker(f"{pair.primary.url()}?schema={schema}")
    try:
        first.migrate()
        job_id = first.enqueue(NewJob("t", {}))
        pair.wait_replicated()
        pair.replica.stop()
        [stale] = first.claim(["default"], 1, 60, "first")
    finally:
        first.close()
    pair.primary.stop(mode="immediate")
    pair.replica.start()
    pair.promote()
    second = open_broker(f"{pair.replica.url()}?schema={schema}")
    try:
        [live] = second.claim(["default"], 1, 60, "second")
        only_the_new_lease_acks(second, stale, live, job_id)
    finally:
        second.close()
