"""Answers lost after the server ran the request: what a cut connection does to each call.

A connection reset, a NAT table or a load balancer dropping a connection
between a request and its answer: the server has run the command and the
client never hears of it. redis-py then sends the command once more on a new
connection (its one retry), so the broker runs it twice; a write the master
retries after a timeout may have landed too. A relay in front of a real Redis
(``tests/replycut.py``) cuts exactly one answer. The claim's case (its first
run's jobs, leased and unseen, found and released by the supervisor) is in ``test_orphans.py``.
"""
import hashlib
import signal

import pytest

from supervisor.backends import open_broker
from supervisor.errors import NotDead
from supervisor.jobfilter import JobFilter
from supervisor.model import NewJob

from .daemon import Daemon
from .replycut import ReplyCut
from .test_outages import ran
from .util import wait_for


def script_sha(name):
    from supervisor.backends.redis import scripts

    return hashlib.sha1(scripts.sources()[name].encode()).hexdigest()


@pytest.fixture
def reply_cut(redis_url):
    """(the relay, the broker URL through it, a client straight to the server)."""
    from supervisor.backends.redis import scripts

    cut, through = ReplyCut.of(redis_url)
    client = open_broker(redis_url)
    for name in ("claim", "ack_many", "dead", "enqueue_once", "replay", "purge"):  # loaded: the cut request runs, not a NOSCRIPT answer
        client.r.script_load(scripts.sources()[name])
    yield cut, through, client
    client.close()
    cut.close()


@pytest.mark.services
def test_a_claim_sent_again_after_its_reply_was_lost_is_counted_and_its_first_jobs_stay_leased(reply_cut):
    """What the supervisor must look for: the broker ran the claim twice and returned the second's jobs."""
    cut, through, client = reply_cut
    client.enqueue_many([NewJob("t", {"n": n}) for n in range(8)])
    with open_broker(through) as b:
        assert b.calls_resent == 0
        cut.cut_next(script_sha("claim"))
        got = b.claim(["default"], 3, 30.0, "me:1")
        assert cut.cut.is_set() and len(got) == 3 and b.calls_resent == 1
        mine = [j for j in b.search(JobFilter(state="running")).jobs if j.owner == "me:1"]
        assert len(mine) == 6 and {j.id for j in got} < {j.id for j in mine}  # 3 leased by the lost reply's run


@pytest.mark.services
def test_a_claim_that_kept_one_queues_jobs_while_the_next_queues_answer_was_lost_is_counted(reply_cut):
    """Queue by queue: "a" answered; "b"'s claim ran but its answer never came (a timeout, which
    redis-py does not retry). The claim returns "a"'s jobs (not lost with the exception), and
    counts in ``calls_resent``: "b"'s jobs are leased to this owner too, and only a counted
    claim is followed by the supervisor's look for them (orphans.py)."""
    cut, through, client = reply_cut
    client.enqueue_many([NewJob("t", {"n": n}, queue=q) for q in ("a", "b") for n in range(3)])
    with open_broker(through + ("&" if "?" in through else "?") + "socket_timeout=0.5") as b:
        cut.cut_next(b.keys.for_scripts("b")[0][0], hold=True)  # a key only the claim of "b" names
        got = b.claim(["a", "b"], 6, 30.0, "me:1")
        assert cut.cut.is_set(), cut.describe()
        assert sorted(j.queue for j in got) == ["a"] * 3 and b.calls_resent == 1
        mine = [j for j in client.search(JobFilter(state="running")).jobs if j.owner == "me:1"]
        assert sorted(j.queue for j in mine) == ["a"] * 3 + ["b"] * 3  # "b"'s, leased by the unanswered run


@pytest.mark.services
def test_a_sending_whose_connection_never_opened_is_not_counted_as_sent_again(reply_cut):
    """A connection closed before its handshake (a server restarting, a full listen queue) carried
    no command: the sending after it is the first to reach the server. Counted as resent, it would
    start a search for orphans after every refused connection and make a retried write read its job.
    (redis-py's pool opens, and if need be reopens, a connection as it hands it out, before the
    sending that ``_exchange`` retries.)"""
    cut, through, client = reply_cut
    client.enqueue_many([NewJob("t", {"n": n}) for n in range(5)])
    with open_broker(through) as b:
        assert len(b.claim(["default"], 1, 30.0, "me:1")) == 1
        b.r.connection_pool.disconnect()  # the next call opens a new connection
        cut.refuse_next()
        got = b.claim(["default"], 2, 30.0, "me:1")
        assert cut.refused == 1 and len(got) == 2 and b.calls_resent == 0
        cut.cut_next(script_sha("claim"))  # still counted: a sending that reached the server, its answer lost
        assert len(b.claim(["default"], 1, 30.0, "me:1")) == 1 and cut.cut.is_set() and b.calls_resent == 1


@pytest.mark.services
@pytest.mark.parametrize("script, outcome, state", [("ack_many", "ok", "done"), ("dead", "dead", "dead")])
def test_an_outcome_write_sent_again_after_its_answer_was_lost_is_stored_not_a_lost_lease(
        reply_cut, tmp_path, script, outcome, state):
    """The first sending stored the outcome; the second finds the job finished and is refused as
    stale. That is this write's own outcome, not a lease someone took over: no ``lease_lost``, no
    "the job will run again" (it will not)."""
    cut, through, client = reply_cut
    db = str(tmp_path / "effects.db")
    d = Daemon(tmp_path, broker_url=through, handler_files=("effects.py",), supervisor={"workers": 1})
    d._broker = client
    try:
        d.start()
        cut.cut_next(script_sha(script))
        ids = client.enqueue_many([NewJob("effect", {"db": db, "outcome": outcome}) for _ in range(3)])
        wait_for(cut.cut.is_set, timeout=30, message=f"the answer of a {script} call to be lost")
        wait_for(lambda: all(client.get(i).state == state for i in ids), timeout=30, message=f"every job {state}")
        wait_for(lambda: d.records(event="outcome_confirmed") or d.records(event="lease_lost"), timeout=10,
                 message="the second sending's answer handled")
        assert d.status()["counters"]["lease_lost"] == 0 and not d.records(event="lease_lost")
        confirmed = {r["job_id"] for r in d.records(event="outcome_confirmed")}
        assert confirmed and confirmed <= set(ids)
        assert all(ran(db, i) == 1 for i in ids)
        d.signal(signal.SIGTERM)
        assert d.wait_exit() == 0
    finally:
        d.stop()


@pytest.mark.services
def test_enqueue_once_sent_again_after_its_answer_was_lost_returns_the_job_it_stored(reply_cut):
    """The first sending stored the job and recorded its key; the second finds the key taken. The
    caller gets its own job's id, not None ("enqueued before"), and one job is stored."""
    cut, through, client = reply_cut
    with open_broker(through) as b:
        cut.cut_next(script_sha("enqueue_once"))
        job_id = b.enqueue_once(NewJob("t", {"n": 1}, idempotency_key="report:2026-12-03"))
        assert cut.cut.is_set() and b.calls_resent == 1
        assert job_id is not None and client.get(job_id).idempotency_key == "report:2026-12-03"
        assert b.enqueue_once(NewJob("t", {"n": 2}, idempotency_key="report:2026-12-03")) is None  # once, still
        assert len(client.search(JobFilter(type="t")).jobs) == 1


@pytest.mark.services
def test_enqueue_once_of_a_chosen_id_sent_again_tells_its_own_job_from_an_earlier_calls(reply_cut):
    """A caller that chooses the id: the job an earlier call stored under the same id and key is
    not this call's (None, as without a cut); the one this call's first sending stored is."""
    cut, through, client = reply_cut
    with open_broker(through) as b:
        assert b.enqueue_once(NewJob("t", {}, id="fixed-1", idempotency_key="K1")) == "fixed-1"
        cut.cut_next(script_sha("enqueue_once"))
        assert b.enqueue_once(NewJob("t", {}, id="fixed-1", idempotency_key="K1")) is None
        assert cut.cut.is_set() and b.calls_resent == 1
        cut.cut_next(script_sha("enqueue_once"))
        assert b.enqueue_once(NewJob("t", {}, id="fixed-2", idempotency_key="K2")) == "fixed-2"
        assert b.calls_resent == 2


@pytest.mark.services
@pytest.mark.parametrize("script", ["replay", "purge"])
def test_a_dead_letter_replay_or_purge_sent_again_after_its_answer_was_lost_succeeds(reply_cut, script):
    """The first sending replayed (purged) every job; the second finds them no longer dead. The
    operator is told it worked (before: "job ... is queued, not dead", exit 1), and a real
    ``NotDead`` (a job another operator replayed first, still dead ones left) is still raised."""
    cut, through, client = reply_cut
    ids = client.enqueue_many([NewJob("t", {"n": n}) for n in range(3)])
    for job in client.claim(["default"], 3, 30.0, "me:1"):
        client.dead(job.lease, "permanent", {"reason": "permanent"})
    with open_broker(through) as b:
        cut.cut_next(script_sha(script))
        got = b.dlq_replay(ids) if script == "replay" else b.dlq_purge(ids)
        assert cut.cut.is_set() and b.calls_resent == 1
        if script == "replay":
            assert got == ids and [client.get(i).state for i in ids] == ["queued"] * 3
        else:
            assert got == 3 and [client.get(i) for i in ids] == [None] * 3
        with pytest.raises(NotDead):  # the same answer, not resent: it stands
            b._run_dead(script, "default", ids)


@pytest.mark.services
@pytest.mark.parametrize("script, other", [("replay", "replay one"), ("purge", "purge one"), ("replay", "purge all")])
def test_a_dead_letter_call_sent_again_that_did_nothing_still_reports_not_dead(reply_cut, script, other):
    """Another operator acted between this call's check and its script: the first sending changed
    nothing (all or nothing) and its answer was lost. The second's "not dead" stands, unless every
    job is now as this call asked (replayed: there, not dead; purged: gone); jobs purged by someone
    else were not replayed."""
    cut, through, client = reply_cut
    ids = client.enqueue_many([NewJob("t", {"n": n}) for n in range(2)])
    for job in client.claim(["default"], 2, 30.0, "me:1"):
        client.dead(job.lease, "permanent", {"reason": "permanent"})
    action, which = other.split()
    (client.dlq_replay if action == "replay" else client.dlq_purge)(ids[:1] if which == "one" else ids)
    with open_broker(through) as b:
        cut.cut_next(script_sha(script))
        with pytest.raises(NotDead):
            b._run_dead(script, "default", ids)
        assert cut.cut.is_set() and b.calls_resent == 1
