"""Redis Cluster: the broker conformance suite, unchanged, on three primaries and three replicas,
and a primary killed under two running supervisors.

The cluster is started once for this module (``tests/ha_servers.py``); each test
gets a key prefix of its own. The conformance tests are the very functions of
``tests/test_broker_conformance.py``, ``test_conformance_control.py``,
``test_conformance_workflows.py`` and ``test_conformance_search.py``, imported here with ``broker_url`` pointing at
the cluster, so they run once, in this module only.
"""
import json
import select
import uuid

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from supervisor.backends import open_broker
from supervisor.backends.redis.fields import enqueue_args
from supervisor.errors import BrokerError
from supervisor.jobfilter import JobFilter
from supervisor.model import NewJob

from .failover_flow import run_through_failover
from .ha_servers import RedisClusterSetup
from .replycut import ReplyCut
# The conformance suites, collected again here against the cluster (``broker_url`` below).
from .test_broker_conformance import *  # noqa: F401,F403
from .test_conformance_control import *  # noqa: F401,F403
from .test_conformance_search import *  # noqa: F401,F403
from .test_conformance_workflows import *  # noqa: F401,F403
from .test_lost_answers import script_sha
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


def test_a_prune_on_a_cluster_puts_back_the_name_of_a_queue_an_enqueue_filled_meanwhile(cluster, broker,
                                                                                          monkeypatch):
    """On a cluster ``P:queues`` lies in another slot than a queue's keys, so prune takes an empty
    queue's name out after its script, then asks the queue again. A producer's job that lands
    in between (its own SADD came before, a no-op) puts the name back; so does a second look
    that fails."""
    srem = broker.r.srem

    def srem_then_enqueue(key, *names):
        done = srem(key, *names)
        monkeypatch.setattr(broker.r, "srem", srem)
        enqueued.append(broker._run_many([("enqueue", "q", [json.dumps([enqueue_args(NewJob("t", {}, queue="q"))])])],
                                         confirm=True)[0][0])
        return done

    enqueued = []
    # A name in P:queues with nothing in the queue (a resume takes an empty queue's name out itself,
    # as prune does: named by hand, as an enqueue whose jobs went since leaves it).
    broker.r.sadd(broker.keys.queues, "q")
    monkeypatch.setattr(broker.r, "srem", srem_then_enqueue)
    broker.prune(0)
    assert enqueued and "q" in broker.queues() and broker.get(enqueued[0]).queue == "q"
    broker.r.delete(broker._paused_key("q"))

    run = broker._run

    def unanswered(name, queue, args, **kw):
        if name == "queue_empty":
            raise RedisConnectionError("the node went away")
        return run(name, queue, args, **kw)

    broker.r.sadd(broker.keys.queues, "lost")
    monkeypatch.setattr(broker, "_run", unanswered)
    with pytest.raises(BrokerError):
        broker.prune(0)
    assert "lost" in broker.r.smembers(broker.keys.queues)


def test_an_enqueue_on_a_cluster_names_its_queue_again_after_its_script(cluster, broker, monkeypatch):
    """A prune may take a queue's name out between an enqueue's first SADD and its script (the
    queue was empty then): the SADD after the script names it again, also when a later call of
    the same enqueue fails after this one stored its jobs."""
    run_many = broker._run_many

    def pruned_first(calls, **kw):
        broker.r.srem(broker.keys.queues, *{queue for _, queue, _ in calls})  # what prune does to an empty queue
        return run_many(calls, **kw)

    monkeypatch.setattr(broker, "_run_many", pruned_first)
    job_id = broker.enqueue(NewJob("t", {}, queue="late"))
    assert "late" in broker.queues() and broker.get(job_id).queue == "late"

    run = broker._run

    def second_fails(name, queue, args, **kw):
        if queue == "b":
            raise RedisConnectionError("the node of b is failing over")
        return run(name, queue, args, **kw)

    monkeypatch.setattr(broker, "_run", second_fails)
    with pytest.raises(BrokerError):
        broker.enqueue_many([NewJob("t", {}, queue="a", id="job_kept_a"), NewJob("t", {}, queue="b")])
    monkeypatch.setattr(broker, "_run", run)
    assert "a" in broker.r.smembers(broker.keys.queues) and broker.get("job_kept_a").queue == "a"


def test_jobs_flow_through_a_cluster_failover_each_effect_once(cluster, tmp_path):
    prefix = f"t{uuid.uuid4().hex[:8]}"
    url = cluster.url(prefix)
    client = open_broker(url)
    try:
        queue_key = f"{prefix}:{{default}}:ready"  # the primary serving the queue the jobs flow through
        # redis-py's cluster client waits out CLUSTERDOWN (0.25 s and a new slot map a try, three
        # retries): on a loaded machine that can span the whole failover, and no call fails. The
        # killed primary served the queue (kill_primary_of) while jobs ran (ran_before_failover).
        got = run_through_failover(tmp_path, url, client, lambda: cluster.kill_primary_of(queue_key),
                                   outage_seen=False)
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


@pytest.fixture
def through_relay(cluster):
    """(the relay, a broker whose connections to the ``default`` queue's primary pass through it, a
    direct client). redis-py's ``address_remap`` routes that node through the relay: the slot map
    names it by its real port, so a URL could not."""
    prefix = f"t{uuid.uuid4().hex[:8]}"
    url = cluster.url(prefix)
    primary = cluster.primary_of(f"{prefix}:{{default}}:ready")
    cut = ReplyCut("127.0.0.1", primary.port)
    client, b = open_broker(url), open_broker(url)
    b.r.nodes_manager.address_remap = lambda addr: ("127.0.0.1", cut.port) if addr[1] == primary.port else addr
    b.r.nodes_manager.initialize()
    yield cut, b, client
    b.close()
    client.close()
    cut.close()


def test_a_claim_redis_py_sent_again_on_a_cluster_is_counted_and_its_first_jobs_stay_leased(through_relay):
    """On one server the broker's own retry counts a resend (test_lost_answers.py); on a cluster
    redis-py resends inside its client, and the broker counts it all the same: the supervisor
    looks for the first sending's jobs (orphans.py) only when it is counted."""
    cut, b, client = through_relay
    client.enqueue_many([NewJob("t", {"n": n}) for n in range(8)])
    assert len(b.claim(["default"], 1, 30.0, "me:1")) == 1 and cut.accepted >= 1  # through the relay
    assert b.calls_resent == 0
    cut.cut_next(script_sha("claim"))
    got = b.claim(["default"], 3, 30.0, "me:1")
    assert cut.cut.is_set(), cut.describe()
    assert len(got) == 3 and b.calls_resent == 1
    mine = [j for j in client.search(JobFilter(state="running")).jobs if j.owner == "me:1"]
    assert len(mine) == 1 + 6 and {j.id for j in got} < {j.id for j in mine}  # 3 leased by the lost reply's run


def test_a_cluster_connection_closed_before_its_handshake_is_not_counted_as_sent_again(through_relay):
    """A connection the node closed before the handshake carried no command."""
    cut, b, client = through_relay
    client.enqueue_many([NewJob("t", {"n": n}) for n in range(5)])
    assert len(b.claim(["default"], 1, 30.0, "me:1")) == 1
    for node in b.r.get_nodes():  # the next call opens a new connection
        if node.redis_connection is not None:
            node.redis_connection.connection_pool.disconnect()
    cut.refuse_next()
    got = b.claim(["default"], 2, 30.0, "me:1")
    assert cut.refused == 1 and len(got) == 2 and b.calls_resent == 0


def test_enqueue_once_redis_py_sent_again_on_a_cluster_returns_the_job_it_stored(through_relay):
    """Not "the key was taken": the taker is this very call's first sending."""
    cut, b, client = through_relay
    assert b.enqueue_once(NewJob("t", {"n": 0}, idempotency_key="warm-up"))  # the script loaded, the path open
    cut.cut_next(script_sha("enqueue_once"))
    job_id = b.enqueue_once(NewJob("t", {"n": 1}, idempotency_key="report:2026-12-04"))
    assert cut.cut.is_set(), cut.describe()
    assert job_id is not None and client.get(job_id).payload == {"n": 1} and b.calls_resent == 1
    assert b.enqueue_once(NewJob("t", {"n": 2}, idempotency_key="report:2026-12-04")) is None  # once, still


def test_a_cluster_url_naming_a_server_that_is_no_cluster_node_is_a_config_error(redis_url):
    # Cluster mode off never turns on by itself: the URL was refused at once (BrokerUnusable, `run`
    # exits 2), not reported "unreachable" and waited for as an outage.
    from supervisor.errors import BrokerUnusable

    host = redis_url.partition("://")[2].partition("/")[0]
    with pytest.raises(BrokerUnusable, match="Cluster mode is not enabled"):
        open_broker(f"redis+cluster://{host}/?prefix=p")
