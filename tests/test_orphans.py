"""A claim the supervisor gave up on leases jobs all the same: the supervisor finds them and hands them back.

A frozen Redis (SIGSTOP: it keeps its connections and answers nothing) runs the
commands left in its sockets when it thaws, the supervisor's claim among them:
the jobs it leases belong to a supervisor that never saw them. The supervisor
looks for such jobs once the server answers again and releases them
(``supervisor/master/orphans.py``), so they run at once and spend no attempt.
Left alone, they would wait out the lease (60 s here, longer than every wait
below) and run with an attempt spent, ``lease_expired`` in their history. The
same on a frozen PostgreSQL: ``test_outages.py``. And when a cut connection loses
a claim's answer after the server ran it, redis-py sends the claim again: the
first run's jobs are orphans too (a relay in the test cuts the answer).
"""
import collections
import os
import selectors
import signal
import sqlite3
import time
import types

import pytest
from prometheus_client.parser import text_string_to_metric_families

from supervisor.backends import open_broker
from supervisor.errors import BrokerError
from supervisor.health import request
from supervisor.heartbeat import Heartbeat
from supervisor.master.brokerlink import BrokerLink
from supervisor.master.orphans import Orphans, known_job_ids
from supervisor.master.outcomes import OutcomeWriter, Write
from supervisor.metrics import Metrics
from supervisor.model import ACK, Lease, NewJob

from .daemon import Daemon
from .test_lost_answers import reply_cut, script_sha  # noqa: F401 - a fixture
from .servers import private_redis  # noqa: F401 - a fixture
from .test_outages import (any_broker, daemon, outcomes, postgres_broker, ran, redis_broker,  # noqa: F401 - fixtures
                           stats, status_or_none)
from .servers import private_postgres  # noqa: F401 - a fixture
from .util import wait_for

@pytest.mark.services
def test_a_claim_a_frozen_redis_runs_at_its_thaw_leases_jobs_the_supervisor_releases(redis_broker, tmp_path):
    b = redis_broker
    db, gate = str(tmp_path / "effects.db"), str(tmp_path / "gate")
    # One child and two jobs prefetched behind its gated one: when the gate opens, the child takes a
    # prefetched job and the master claims one more on its live connection, to the frozen server.
    d = daemon(tmp_path, b, "&socket_timeout=1&socket_connect_timeout=1", supervisor={"workers": 1},
               broker={"prefetch": 2, "lease_seconds": 60.0, "heartbeat_seconds": 0.5})
    server = b.server.proc.pid
    try:
        d.start()
        gated = b.client.enqueue(NewJob("effect", {"db": db, "gate": gate}, priority=1))
        ids = [gated] + b.client.enqueue_many([NewJob("effect", {"db": db}) for _ in range(10)])
        wait_for(lambda: ran(db, gated) and d.status()["prefetched"] == 2, timeout=30,
                 message="the gated job to run and two more to wait behind it")
        os.kill(server, signal.SIGSTOP)
        try:
            open(gate, "w").close()
            wait_for(lambda: (s := status_or_none(d)) and s["broker_down"], timeout=30,
                     message="the claim to time out and the supervisor to report the broker down")
        finally:
            os.kill(server, signal.SIGCONT)
        wait_for(lambda: (s := stats(b.client)) and s.done == len(ids), timeout=45,
                 message=f"all {len(ids)} jobs done within the 60 s lease: the orphaned ones released, not expired")
        released = [r["job_id"] for r in d.records(event="orphan_released")]
        assert released and set(released) <= set(ids) and d.status()["orphans_released"] == len(released)
        assert d.status()["claims_unanswered"] >= 1
        assert all(ran(db, i) == 1 for i in ids)  # each job ran once
        assert [o for i in ids for o in outcomes(b.client.get(i))] == ["done"] * len(ids)  # no attempt spent
        d.signal(signal.SIGTERM)
        assert d.wait_exit() == 0
        d.assert_clean()
    finally:
        os.kill(server, signal.SIGCONT)
        d.stop()


def main_link_failures(d):
    """Failed broker calls of the daemon's main loop, read from its metrics over the socket."""
    text = request(d.socket, {"cmd": "metrics"}, timeout=5)["text"]
    return sum(s.value for f in text_string_to_metric_families(text) if f.name == "tangguh_broker_errors"
               for s in f.samples if s.name.endswith("_total") and s.labels.get("source") == "main")


@pytest.mark.services
def test_claims_tried_while_the_server_refuses_connections_leave_nothing_to_look_for(any_broker, tmp_path):
    """A server that is down refuses every connection: the claims tried through the outage opened
    none, so none can have leased a job. Only the claim that met the outage on a live connection
    may have (it counts, once); before, every try of every backoff step counted as a claim given up
    on, and each started a search for orphans once the server was back."""
    b = any_broker
    d = daemon(tmp_path, b, broker={"heartbeat_seconds": 0.5})
    try:
        d.start()
        b.server.stop()
        wait_for(lambda: main_link_failures(d) >= 4, timeout=60, message="four failed tries of the main loop")
        assert d.status()["broker_down"] and d.status()["claims_unanswered"] <= 1
        b.server.start()
        wait_for(lambda: not d.status()["broker_down"], timeout=30, message="the supervisor to see the broker back")
        wait_for(lambda: stats(b.client) is not None, timeout=30, message="the test's own client to reconnect")
        job = b.client.enqueue(NewJob("effect", {"db": str(tmp_path / "effects.db")}))
        assert d.wait_job(job).state == "done"
        assert d.status()["claims_unanswered"] <= 1
        d.signal(signal.SIGTERM)
        assert d.wait_exit() == 0
    finally:
        d.stop()


def test_claims_that_found_the_sqlite_file_locked_leased_nothing_and_leave_nothing_to_look_for(tmp_path):
    """Another process holds SQLite's write lock past the busy timeout (a peer supervisor, a long
    batch enqueue): the claims meeting it rolled back. They are not claims given up on, and start
    no search for orphans."""
    db = tmp_path / "broker.db"
    d = Daemon(tmp_path, broker_url=f"sqlite:///{db}?busy_timeout=0.2", supervisor={"poll_interval": 0.05})
    lock = sqlite3.connect(db, timeout=10, isolation_level=None)
    try:
        d.start()
        lock.execute("BEGIN IMMEDIATE")
        wait_for(lambda: main_link_failures(d) >= 3, timeout=60, message="three failed tries of the main loop")
        assert d.status()["broker_down"] and d.status()["claims_unanswered"] == 0
        lock.execute("ROLLBACK")
        job = d.enqueue("noop", {})
        assert d.wait_job(job).state == "done"
        assert d.status()["claims_unanswered"] == 0 and not d.records(event="orphan_released")
        d.signal(signal.SIGTERM)
        assert d.wait_exit() == 0
    finally:
        lock.close()
        d.stop()


# -- a claim whose reply was lost and which redis-py sent again --------------------------------------------------
@pytest.mark.services
def test_a_claim_whose_reply_was_lost_leaves_no_orphan_behind(reply_cut, tmp_path):
    """A connection cut between a claim and its answer: redis-py sends the claim again, and the
    first run's jobs are leased to this supervisor, which never saw them. They are looked for and
    released as after a claim given up on: each runs once, at once, no attempt spent (the lease
    is 60 s: left alone they would wait it out)."""
    cut, through, client = reply_cut
    db = str(tmp_path / "effects.db")
    ids = client.enqueue_many([NewJob("effect", {"db": db}) for _ in range(20)])
    d = Daemon(tmp_path, broker_url=through, handler_files=("effects.py",), supervisor={"workers": 1},
               broker={"prefetch": 4, "lease_seconds": 60.0, "heartbeat_seconds": 0.5})
    d._broker = client
    try:
        cut.cut_next(script_sha("claim"))
        d.start()
        wait_for(cut.cut.is_set, timeout=30,
                 message=lambda: f"a claim's reply to be lost\n{cut.describe()}\n{d.logs()[-4000:]}")
        wait_for(lambda: (s := stats(client)) and s.done == len(ids), timeout=30,
                 message=f"all {len(ids)} jobs done within the 60 s lease: the first run's jobs released, not expired")
        released = [r["job_id"] for r in d.records(event="orphan_released")]
        assert released and set(released) <= set(ids) and d.status()["orphans_released"] == len(released)
        assert all(ran(db, i) == 1 for i in ids)
        assert [o for i in ids for o in outcomes(client.get(i))] == ["done"] * len(ids)  # no attempt spent
        d.signal(signal.SIGTERM)
        assert d.wait_exit() == 0
        d.assert_clean()
    finally:
        d.stop()


# -- the look itself, on a real broker and a real link -----------------------------------------------------------
class Counted(list):
    def __call__(self, event, *labels, job=None):
        self.append((event, job.id))


def orphans_on(url, known=frozenset()):
    link = BrokerLink(url, True, selectors.DefaultSelector(), Metrics(), on_wakeup=lambda queues: None,
                      on_down=lambda _: None, pid=os.getpid())
    return Orphans(link, "me:1", lambda: set(known), Counted())


BROKER = types.SimpleNamespace(queues=("default",), heartbeat_seconds=0.5, lease_seconds=5.0)


def test_a_look_releases_only_the_jobs_leased_to_this_owner_that_it_knows_nothing_of(tmp_path):
    url = f"sqlite:///{tmp_path}/b.db"
    with open_broker(url) as b:
        b.migrate()
        ids = b.enqueue_many([NewJob("t", {"n": n}) for n in range(4)])
        mine = b.claim(["default"], 3, 30.0, "me:1")  # as the late claim would have
        theirs = b.claim(["default"], 1, 30.0, "other:2")
        known = {mine[0].id}  # held here (under this lease, or under an older one: the id decides)
        o = orphans_on(url, known)
        o.run(BROKER)
        assert o.released == 0 and o.count == []  # no claim went unanswered: no look
        o.claim_unanswered([])  # every queue paused: the claim asked for none, so it leased none
        assert o.unanswered == 0 and o.due_at() is None
        o.claim_unanswered(["default"])
        o.run(BROKER)
        assert sorted(j for _, j in o.count) == sorted(j.id for j in mine[1:]) and o.released == 2
        for job in mine[1:]:
            back = b.get(job.id)
            assert (back.state, back.attempt, back.owner, back.history) == ("queued", 0, None, [])  # no attempt spent
        assert b.get(mine[0].id).state == "running" and b.get(theirs[0].id).owner == "other:2"
        assert set(ids) == {j.id for j in mine + theirs}
        o.link.drop()


def test_while_the_broker_is_down_a_look_waits_for_the_links_next_try():
    """A look due while the link waits out its backoff would make the loop's select() return at once, a spin."""
    o = orphans_on("redis://127.0.0.1:1/0?socket_connect_timeout=0.5")  # nothing listens on port 1
    o.claim_unanswered(["default"])
    with pytest.raises(BrokerError):
        o.link.call(lambda br: br.now())
    assert o.link.down and o.due_at() >= o.link.retry_at > time.monotonic()
    o.run(BROKER)  # deferred: no try before the link's
    assert o.due_at() >= o.link.retry_at and o.released == 0


@pytest.mark.parametrize("url", ["redis://127.0.0.1:1/0?socket_connect_timeout=0.5",
                                 "postgresql://postgres@127.0.0.1:1/test?connect_timeout=1"], ids=["redis", "postgres"])
def test_a_claim_tried_while_the_server_refuses_connections_is_not_a_claim_given_up_on(url):
    """Nothing listens on port 1: every try fails before a connection opens, so no claim can have
    leased a job, however many backoff steps the outage lasts. The daemon's test of the same
    (``refuses_connections``) depends on which call of the loop takes each step's try."""
    from supervisor import config
    from supervisor.master.dispatch import Dispatcher
    from supervisor.master.prefetch import Prefetch

    cfg = config.from_dict({"supervisor": {"workers": 1}, "broker": {"url": url}})
    link = BrokerLink(url, True, selectors.DefaultSelector(), Metrics(), on_wakeup=lambda queues: None,
                      on_down=lambda _: None, pid=os.getpid())
    pool = types.SimpleNamespace(target=1, free=lambda: ["an idle child"])
    d = Dispatcher(cfg, {}, "me:1", link, pool, Prefetch("auto", 1), hold=None, settings_for=None, on_claimed=None,
                   on_unknown=None, on_expired=None, give_back=None, on_started=None)
    unanswered = []
    d.on_unanswered = unanswered.append
    for _ in range(3):
        link.retry_at = d.next_claim_at = 0.0  # the next try is due now
        d.claim()
        assert link.down
    assert link.failures == 3 and unanswered == []


def test_every_job_this_master_knows_of_is_known_whatever_holds_it():
    """Held, just found lost, running or queued in a child, prefetched, or its outcome not stored yet:
    each a job a look must never release (a job run twice, an outcome lost)."""
    jobs = {name: types.SimpleNamespace(id=name, lease=Lease(name, 7))
            for name in ("held", "lost", "running", "queued", "prefetched", "write", "ack")}
    heartbeat = Heartbeat("sqlite:///unused.db", 5.0, 1.0, None)
    heartbeat.hold(jobs["held"].lease)
    heartbeat.lost.append(jobs["lost"].lease)
    writer = OutcomeWriter(link=None, unhold=lambda lease: None, on_stored=None, on_lost=None)
    writer.release(jobs["write"])
    writer.acks.append(Write(jobs["ack"], ACK))
    child = types.SimpleNamespace(job=jobs["running"], queued=collections.deque([(jobs["queued"], None)]))
    idle = types.SimpleNamespace(job=None, queued=collections.deque())
    pool = types.SimpleNamespace(children={1: child, 2: idle})
    dispatcher = types.SimpleNamespace(prefetched=collections.deque([(jobs["prefetched"], None)]))
    assert known_job_ids(heartbeat, writer, dispatcher, pool) == set(jobs)
