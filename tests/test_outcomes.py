"""The outcome writer against a real SQLite broker: what it stores, and what it drops."""
import time

import pytest

from supervisor.backends import open_broker
from supervisor.errors import BrokerError
from supervisor.master.brokerlink import BrokerLink
from supervisor.master.outcomes import OutcomeWriter
from supervisor.metrics import Metrics
from supervisor.model import ACK, Lease, NewJob, Outcome

from .util import wait_for


def writer_on(url):
    import selectors

    link = BrokerLink(url, True, selectors.DefaultSelector(), Metrics(), on_wakeup=lambda: None,
                      on_down=lambda t: None, pid=0)
    unheld, stored, lost = [], [], []
    writer = OutcomeWriter(link, unhold=unheld.append, on_stored=stored.append, on_lost=lost.append)
    return writer, link, unheld, stored, lost


def test_a_lease_found_lost_before_its_ack_is_counted_once_and_not_written(sqlite_url):
    writer, link, unheld, stored, lost = writer_on(sqlite_url)
    with open_broker(sqlite_url) as broker:
        broker.migrate()
        job_id = broker.enqueue(NewJob("t", {}))
        job = broker.claim(["default"], 1, 0.01, "a")[0]
        # Once the lease has expired, a second owner reclaims the job under a new token.
        again = wait_for(lambda: broker.claim(["default"], 1, 30, "b"), timeout=10, message="the reclaim")
    writer.add(job, Outcome(ACK, result=1), {})
    writer.forget(Lease(job.id, job.token))  # what the heartbeat's lost lease does
    writer.flush()
    assert len(writer) == 0 and stored == [] and lost == []  # nothing written, nothing counted again
    with open_broker(sqlite_url) as broker:
        current = broker.get(job_id)
    assert (current.state, current.token, current.owner) == ("running", again[0].token, "b")
    link.drop()


def test_other_outcomes_are_kept_when_one_lease_is_lost(sqlite_url):
    writer, link, unheld, stored, lost = writer_on(sqlite_url)
    with open_broker(sqlite_url) as broker:
        broker.migrate()
        ids = [broker.enqueue(NewJob("t", {"n": n})) for n in range(2)]
        jobs = broker.claim(["default"], 2, 30, "a")
    for job in jobs:
        writer.add(job, Outcome(ACK, result=job.payload["n"]), {})
    writer.forget(jobs[0].lease)
    wait_for(lambda: writer.flush() or not len(writer), timeout=10, message="the ack's linger to pass")
    with open_broker(sqlite_url) as broker:
        states = {i: broker.get(i).state for i in ids}
    assert states == {jobs[0].id: "running", jobs[1].id: "done"} and len(stored) == 1
    link.drop()


def down_until(link, seconds):
    """The link as an outage leaves it: marked down, its next try ``seconds`` ahead (the broker is
    back already; only the claimer's next try would find out)."""
    link.connect()
    link.down_since = time.monotonic()
    link.retry_at = time.monotonic() + seconds


def test_an_outcome_while_the_broker_is_marked_down_waits_untried_with_its_lease_renewed(sqlite_url, monkeypatch):
    # It was tried at once and refused without a try (the link's backoff): counted a failure, its
    # lease no longer renewed, backed off on its own as well; the lease expired meanwhile and
    # the job ran twice though the broker had been back for seconds.
    writer, link, unheld, stored, lost = writer_on(sqlite_url)
    with open_broker(sqlite_url) as broker:
        broker.migrate()
        job_id = broker.enqueue(NewJob("t", {}))
        job = broker.claim(["default"], 1, 30, "a")[0]
    from supervisor.master import outcomes

    monkeypatch.setattr(outcomes, "ACK_LINGER", 0.0)  # due at once
    down_until(link, 60)
    writer.add(job, Outcome(ACK, result=1), {})
    writer.flush()
    assert (unheld, stored, lost, len(writer), writer.due_at()) == ([], [], [], 1, None)
    link.retry_at = 0.0  # the claimer's next try is due, and finds the broker back
    link.call(lambda br: br.now(), "claim")
    writer.flush()
    assert (unheld, len(stored), lost, len(writer)) == ([job.lease], 1, [], 0)
    with open_broker(sqlite_url) as broker:
        assert broker.get(job_id).state == "done"
    link.drop()


def test_a_stop_gives_its_outcomes_their_tries_after_the_links_next_try(sqlite_url, monkeypatch):
    # A stopping master claims nothing: its writes try the broker themselves, once the link's
    # backoff allows. Its give-up countdown used to start at once, and ended before that try.
    from supervisor.master import outcomes

    monkeypatch.setattr(outcomes, "STOP_WRITES_SECONDS", 0.5)
    writer, link, unheld, stored, lost = writer_on(sqlite_url)
    with open_broker(sqlite_url) as broker:
        broker.migrate()
        job_id = broker.enqueue(NewJob("t", {}))
        job = broker.claim(["default"], 1, 30, "a")[0]
    down_until(link, 1.0)
    writer.add(job, Outcome(ACK, result=1), {})

    def settled():
        writer.flush(stopping=True)
        return writer.settled()
    wait_for(settled, timeout=10, message="the stopping writer to settle")
    assert (len(stored), lost, len(writer), link.down) == (1, [], 0, False)
    with open_broker(sqlite_url) as broker:
        assert broker.get(job_id).state == "done"
    link.drop()


def test_one_refused_write_per_turn_and_the_acks_wait_for_the_next(sqlite_url, monkeypatch):
    # A broker that stops answering costs each try a timeout (5 s on Redis): every due write
    # tried in one turn held the loop for all of them before the claimer's try marked it down.
    from supervisor.master import outcomes

    monkeypatch.setattr(outcomes, "ACK_LINGER", 0.0)
    writer, link, unheld, stored, lost = writer_on(sqlite_url)
    with open_broker(sqlite_url) as broker:
        broker.migrate()
        for n in range(4):
            broker.enqueue(NewJob("t", {"n": n}))
        jobs = broker.claim(["default"], 4, 30, "a")
    tried = []

    def refused(write, broker):
        tried.append(write.job.id)
        raise BrokerError("Timeout reading from socket")
    monkeypatch.setattr(outcomes.Write, "apply", refused)
    for job in jobs[:3]:
        writer.release(job)  # releases are single writes
    writer.add(jobs[3], Outcome(ACK, result=3), {})
    writer.flush()
    assert len(tried) == 1 and len(writer.acks) == 1 and len(writer) == 4
    link.drop()


def test_after_a_write_fails_the_writes_wait_for_the_claimers_try(sqlite_url, monkeypatch):
    # A write that timed out is not an outage yet (a write alone never marks one): the next turns'
    # writes each waited out the timeout in turn, and took the claim's place, so the outage was
    # never noticed (status showed the broker up for a minute while nothing was stored).
    from supervisor.master import outcomes

    writer, link, unheld, stored, lost = writer_on(sqlite_url)
    with open_broker(sqlite_url) as broker:
        broker.migrate()
        broker.enqueue_many([NewJob("t", {"n": n}) for n in range(2)])
        jobs = broker.claim(["default"], 2, 30, "a")
    tried = []

    def times_out(write, broker):
        tried.append(write.job.id)
        raise OSError("Timeout reading from socket")
    monkeypatch.setattr(outcomes.Write, "apply", times_out)
    for job in jobs:
        writer.release(job)
    writer.flush()
    assert len(tried) == 1 and not link.down and link.suspect
    wait_for(lambda: writer.flush() or all(w.next_at < time.monotonic() for w in writer.writes), timeout=30,
             message="both writes due")
    writer.flush()
    assert len(tried) == 1 and writer.due_at() is None  # waiting for the claimer, not retried
    link.call(lambda broker: broker.now(), "claim")  # the claimer's try: the broker answers
    assert not link.suspect
    writer.flush()
    assert len(tried) == 2
    link.drop()


def test_while_the_broker_is_down_no_call_tries_it_before_its_next_try(sqlite_url):
    # A schedule's tick (every second), a prune, the start's clock check: each would wait out a
    # silent broker's timeout. One try per backoff step, whoever makes it.
    writer, link, unheld, stored, lost = writer_on(sqlite_url)
    down_until(link, 60)
    calls = []
    with pytest.raises(BrokerError):
        link.call(lambda broker: calls.append("schedule"), "schedule")
    assert calls == [] and link.down
    link.retry_at = 0.0  # the next try is due
    link.call(lambda broker: calls.append("claim"), "claim")
    assert calls == ["claim"] and not link.down
    link.drop()
