"""The outcome writer against a real SQLite broker: what it stores, and what it drops."""
import selectors
import time
from types import SimpleNamespace

import pytest

from supervisor.backends import open_broker
from supervisor.errors import BrokerError
from supervisor.master import outcomes
from supervisor.master.brokerlink import BrokerLink
from supervisor.master.outcomes import OutcomeWriter
from supervisor.metrics import Metrics
from supervisor.model import ACK, DEAD, RELEASE, RETRY, Lease, NewJob, Outcome

from .util import wait_for


@pytest.fixture
def w(sqlite_url):
    """A writer and its link on a fresh SQLite broker, with what it reports: the leases it unheld,
    the writes it stored, the leases it lost."""
    link = BrokerLink(sqlite_url, True, selectors.DefaultSelector(), Metrics(), on_wakeup=lambda queues: None,
                      on_down=lambda t: None, pid=0)
    unheld, stored, lost = [], [], []
    writer = OutcomeWriter(link, unhold=unheld.append, on_stored=stored.append, on_lost=lost.append)
    with open_broker(sqlite_url) as broker:
        broker.migrate()
    yield SimpleNamespace(writer=writer, link=link, unheld=unheld, stored=stored, lost=lost, url=sqlite_url)
    link.drop()


def claimed(url, n, lease=30.0):
    """``n`` new jobs, claimed by owner "a": their payloads are {"n": 0}, {"n": 1}, ..."""
    with open_broker(url) as broker:
        broker.enqueue_many([NewJob("t", {"n": i}) for i in range(n)])
        return broker.claim(["default"], n, lease, "a")


def state_of(url, job_id):
    with open_broker(url) as broker:
        return broker.get(job_id)


def test_a_lease_found_lost_before_its_ack_is_counted_once_and_not_written(w):
    job = claimed(w.url, 1, lease=0.01)[0]
    with open_broker(w.url) as broker:
        # Once the lease has expired, a second owner reclaims the job under a new token.
        again = wait_for(lambda: broker.claim(["default"], 1, 30, "b"), timeout=10, message="the reclaim")
    w.writer.add(job, Outcome(ACK, result=1), {})
    w.writer.forget(Lease(job.id, job.token))  # what the heartbeat's lost lease does
    w.writer.flush()
    assert len(w.writer) == 0 and w.stored == [] and w.lost == []  # nothing written, nothing counted again
    current = state_of(w.url, job.id)
    assert (current.state, current.token, current.owner) == ("running", again[0].token, "b")


def test_other_outcomes_are_kept_when_one_lease_is_lost(w):
    jobs = claimed(w.url, 2)
    for job in jobs:
        w.writer.add(job, Outcome(ACK, result=job.payload["n"]), {})
    w.writer.forget(jobs[0].lease)
    wait_for(lambda: w.writer.flush() or not len(w.writer), timeout=10, message="the ack's linger to pass")
    states = {job.id: state_of(w.url, job.id).state for job in jobs}
    assert states == {jobs[0].id: "running", jobs[1].id: "done"} and len(w.stored) == 1


def down_until(link, seconds):
    """The link as an outage leaves it: marked down, its next try ``seconds`` ahead (the broker is
    back already; only the claimer's next try would find out)."""
    link.connect()
    link.down_since = time.monotonic()
    link.retry_at = time.monotonic() + seconds


def test_an_outcome_while_the_broker_is_marked_down_waits_untried_with_its_lease_renewed(w, monkeypatch):
    # It was tried at once and refused without a try (the link's backoff): counted a failure, its
    # lease no longer renewed, backed off on its own as well; the lease expired meanwhile and
    # the job ran twice though the broker had been back for seconds.
    job = claimed(w.url, 1)[0]
    monkeypatch.setattr(outcomes, "ACK_LINGER", 0.0)  # due at once
    down_until(w.link, 60)
    w.writer.add(job, Outcome(ACK, result=1), {})
    w.writer.flush()
    assert (w.unheld, w.stored, w.lost, len(w.writer), w.writer.due_at()) == ([], [], [], 1, None)
    w.link.retry_at = 0.0  # the claimer's next try is due, and finds the broker back
    w.link.call(lambda br: br.now(), "claim")
    w.writer.flush()
    assert (w.unheld, len(w.stored), w.lost, len(w.writer)) == ([job.lease], 1, [], 0)
    assert state_of(w.url, job.id).state == "done"


def test_a_stop_gives_its_outcomes_their_tries_after_the_links_next_try(w, monkeypatch):
    # A stopping master claims nothing: its writes try the broker themselves, once the link's
    # backoff allows. Its give-up countdown used to start at once, and ended before that try.
    monkeypatch.setattr(outcomes, "STOP_WRITES_SECONDS", 0.5)
    job = claimed(w.url, 1)[0]
    down_until(w.link, 1.0)
    w.writer.add(job, Outcome(ACK, result=1), {})

    def settled():
        w.writer.flush(stopping=True)
        return w.writer.settled()
    wait_for(settled, timeout=10, message="the stopping writer to settle")
    assert (len(w.stored), w.lost, len(w.writer), w.link.down) == (1, [], 0, False)
    assert state_of(w.url, job.id).state == "done"


def test_one_refused_write_per_turn_and_the_acks_wait_for_the_next(w, monkeypatch):
    # A broker that stops answering costs each try a timeout (5 s on Redis): every due write
    # tried in one turn held the loop for all of them before the claimer's try marked it down.
    monkeypatch.setattr(outcomes, "ACK_LINGER", 0.0)
    jobs = claimed(w.url, 4)
    tried = []

    def refused(write, broker):
        tried.append(write.job.id)
        raise BrokerError("Timeout reading from socket")
    monkeypatch.setattr(outcomes.Write, "apply", refused)
    for job in jobs[:3]:
        w.writer.release(job)  # releases are single writes
    w.writer.add(jobs[3], Outcome(ACK, result=3), {})
    w.writer.flush()
    assert len(tried) == 1 and len(w.writer.acks) == 1 and len(w.writer) == 4


def test_after_a_write_fails_the_writes_wait_for_the_claimers_try(w, monkeypatch):
    # A write that timed out is not an outage yet (a write alone never marks one): the next turns'
    # writes each waited out the timeout in turn, and took the claim's place, so the outage was
    # never noticed (status showed the broker up for a minute while nothing was stored).
    jobs = claimed(w.url, 2)
    tried = []

    def times_out(write, broker):
        tried.append(write.job.id)
        raise OSError("Timeout reading from socket")
    monkeypatch.setattr(outcomes.Write, "apply", times_out)
    for job in jobs:
        w.writer.release(job)
    w.writer.flush()
    assert len(tried) == 1 and not w.link.down and w.link.suspect
    wait_for(lambda: w.writer.flush() or all(x.next_at < time.monotonic() for x in w.writer.writes), timeout=30,
             message="both writes due")
    w.writer.flush()
    assert len(tried) == 1 and w.writer.due_at() is None  # waiting for the claimer, not retried
    w.link.call(lambda broker: broker.now(), "claim")  # the claimer's try: the broker answers
    assert not w.link.suspect
    w.writer.flush()
    assert len(tried) == 2


def test_while_the_broker_is_down_no_call_tries_it_before_its_next_try(w):
    # A schedule's tick (every second), a prune, the start's clock check: each would wait out a
    # silent broker's timeout. One try per backoff step, whoever makes it.
    down_until(w.link, 60)
    calls = []
    with pytest.raises(BrokerError):
        w.link.call(lambda broker: calls.append("schedule"), "schedule")
    assert calls == [] and w.link.down
    w.link.retry_at = 0.0  # the next try is due
    w.link.call(lambda broker: calls.append("claim"), "claim")
    assert calls == ["claim"] and not w.link.down


# -- a write the broker refuses because an earlier sending of it landed ------------------------------------------
@pytest.mark.parametrize("op", [ACK, RETRY, DEAD, RELEASE])
def test_a_refused_write_that_an_earlier_sending_stored_counts_as_stored_and_a_taken_over_one_as_lost(
        broker_url, op):
    """The broker refuses all three as stale. ``landed`` holds this very write's outcome (its
    answer was lost, the write sent again): stored, even though the job, due again after a retry
    or a release, was claimed anew before the second answer (by this master, or by another).
    ``taken`` was taken over by owner "b" after its lease expired, and b stored the same outcome;
    ``retaken`` by this same owner under a new attempt, which stored it too: both are lost. Every
    broker's history names each attempt's number and owner, which tell them apart."""
    link = BrokerLink(broker_url, True, selectors.DefaultSelector(), Metrics(), on_wakeup=lambda queues: None,
                      on_down=lambda t: None, pid=0)
    stored, lost = [], []
    writer = OutcomeWriter(link, unhold=lambda lease: None, on_stored=stored.append, on_lost=lost.append)
    outcome = Outcome(op, result=7) if op in (ACK, RELEASE) else Outcome(op, reason="exception", error_class="E",
                                                                          delay=60.0)

    def store(broker, job, delay=60.0):
        outcomes.Write(job, op, result=outcome.result, info={"pid": 1}, reason=outcome.reason,
                       error={"reason": "exception"}, delay=delay).apply(broker)

    def expired_and_reclaimed(broker, owner):
        broker.enqueue(NewJob("t", {}))  # one at a time: each claim below can take only the job meant
        job = broker.claim(["default"], 1, 0.05, "a")[0]
        again = wait_for(lambda: broker.claim(["default"], 1, 30.0, owner), timeout=10, message="the lease retaken")
        assert again[0].id == job.id and again[0].attempt == job.attempt + 1
        return job, again[0]

    try:
        with open_broker(broker_url) as broker:
            broker.migrate()
            broker.enqueue(NewJob("t", {}))
            landed = broker.claim(["default"], 1, 30.0, "a")[0]
            store(broker, landed, delay=0.0)  # what the first sending stored, its answer lost
            if op in (RETRY, RELEASE):  # due again at once: claimed anew before the second sending's answer
                anew = broker.claim(["default"], 1, 30.0, "a" if op == RETRY else "b")
                assert [j.id for j in anew] == [landed.id]
            (taken, by_b), (retaken, by_a) = expired_and_reclaimed(broker, "b"), expired_and_reclaimed(broker, "a")
            for job in (by_b, by_a):  # each new attempt stores the same outcome as ours
                store(broker, job)
        for job in (landed, taken, retaken):
            writer.add(job, outcome, {"pid": 1})
        for write in [*writer.acks, *writer.writes]:  # each tried once before (a timeout): that try may have landed
            (writer.acks if write in writer.acks else writer.writes).remove(write)
            writer.failed(write, BrokerError("timed out"), time.monotonic() - 60)
        wait_for(lambda: writer.flush() or not len(writer), timeout=10, message="the writes answered")
        assert [w.job.id for w in stored] == [landed.id] and [job.id for job in lost] == [taken.id, retaken.id]
    finally:
        link.drop()


def test_a_refused_write_sent_only_once_is_lost_without_a_look(w):
    """Sent once and refused: it cannot have landed before. No read of the job (after an outage
    that expired many leases, one each would hold the loop for nothing)."""
    job = claimed(w.url, 1, lease=0.01)[0]
    with open_broker(w.url) as broker:
        wait_for(lambda: broker.claim(["default"], 1, 30, "b"), timeout=10, message="the reclaim")
    calls = []
    real = w.link.call
    w.link.call = lambda fn, what: calls.append(what) or real(fn, what)
    w.writer.add(job, Outcome(ACK, result=1), {})
    wait_for(lambda: w.writer.flush() or not len(w.writer), timeout=10, message="the ack answered")
    assert [j.id for j in w.lost] == [job.id] and w.stored == [] and calls == [ACK]
