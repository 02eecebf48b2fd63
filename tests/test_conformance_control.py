"""Job control on every broker, unchanged: cancel, renew, pause, expiry, wait and supervisor records.

Like ``test_broker_conformance``: real brokers, concurrent claimers as real
processes, and waits on the broker's clock instead of sleeps.
"""
import importlib
import multiprocessing
import threading
import time

import pytest

from supervisor.backends import control, open_broker
from supervisor.errors import BadInput, LeaseLost
from supervisor.model import NewJob, TypeLimits

from .util import wait_for

Q = ["default"]


def new(type_="t", **kw):
    return NewJob(type_, {"n": 1}, **kw)


def wait_past(broker, t):
    wait_for(lambda: broker.now() > t, timeout=10, interval=0.01, message="broker clock to pass a point")


def claim_one(broker, lease=30, queues=Q, owner="w1"):
    jobs = broker.claim(queues, 1, lease, owner)
    assert len(jobs) == 1, jobs
    return jobs[0]


def started(job):
    return [entry for entry in job.history if "started_at" in entry]


# -- cancel ------------------------------------------------------------------------

def test_cancel_ends_queued_scheduled_and_retrying_jobs_for_good(broker):
    queued = broker.enqueue(new())
    scheduled = broker.enqueue(new(delay=3600))
    failing = broker.enqueue(new(priority=5))
    job = claim_one(broker)
    assert job.id == failing
    broker.retry(job.lease, broker.now(), {"reason": "exception", "class": "E", "message": "m", "traceback": ""})
    assert broker.get(failing).state == "retrying"

    answer = broker.cancel([queued, scheduled, failing], by="ops", reason="wrong customer")
    assert answer == {queued: "cancelled", scheduled: "cancelled", failing: "cancelled"}
    for job_id in (queued, scheduled, failing):
        job = broker.get(job_id)
        assert job.state == "cancelled" and job.finished_at is not None
        assert job.cancel_request["by"] == "ops" and job.cancel_request["reason"] == "wrong customer"
        assert job.history[-1]["outcome"] == "cancelled" and job.history[-1]["by"] == "ops"
    assert broker.get(failing).attempt == 1, "the failed attempt stays in the record"
    assert broker.claim(Q, 10, 30, "w1") == []
    s = broker.stats(Q)["default"]
    assert (s.ready, s.scheduled, s.cancelled) == (0, 0, 3)


def test_cancel_reports_each_id_and_cancelling_twice_is_harmless(broker):
    done = broker.enqueue(new())
    broker.ack(claim_one(broker).lease)
    queued = broker.enqueue(new())
    answer = broker.cancel([done, "job_unknown", queued], by=None, reason=None)
    assert answer == {done: "already_done", "job_unknown": "unknown", queued: "cancelled"}
    assert list(answer) == [done, "job_unknown", queued], "in the order given"
    first = broker.get(queued)
    assert broker.cancel([queued], "ops", "again") == {queued: "already_cancelled"}
    assert broker.get(queued).history == first.history, "a second cancel writes nothing"
    assert broker.get(done).state == "done"


def test_cancel_of_a_running_job_is_a_request_the_renewal_answers(broker):
    job_id = broker.enqueue(new())
    job = claim_one(broker)
    assert broker.cancel([job_id], "ops", "runaway") == {job_id: "requested"}
    assert broker.cancel([job_id], "someone", "twice") == {job_id: "requested"}
    stored = broker.get(job_id)
    assert stored.state == "running"
    assert stored.cancel_request["by"] == "ops", "the first request stands"
    renewal = broker.renew([job.lease], 30)
    assert renewal.lost == []
    assert renewal.cancel[job_id]["by"] == "ops" and renewal.cancel[job_id]["reason"] == "runaway"

    broker.cancelled(job.lease, {"pid": 7})
    ended = broker.get(job_id)
    assert ended.state == "cancelled" and ended.finished_at is not None and ended.lease_until is None
    assert ended.history[-1]["outcome"] == "cancelled"
    assert (ended.history[-1]["by"], ended.history[-1]["reason"], ended.history[-1]["pid"]) == ("ops", "runaway", 7)
    assert broker.renew([job.lease], 30).lost == [job.lease]


def test_cancelled_is_fenced_by_the_lease_token(broker):
    job_id = broker.enqueue(new(max_attempts=3))
    stale = claim_one(broker, lease=0.2)
    wait_past(broker, stale.lease_until + 0.05)
    current = claim_one(broker)
    assert current.token > stale.token
    with pytest.raises(LeaseLost):
        broker.cancelled(stale.lease)
    assert broker.get(job_id).state == "running"
    broker.cancelled(current.lease)
    assert broker.get(job_id).state == "cancelled"
    with pytest.raises(LeaseLost):
        broker.cancelled(current.lease)


def test_a_dead_job_replayed_forgets_the_cancel_asked_of_its_last_attempt(broker):
    job_id = broker.enqueue(new(max_attempts=1))
    job = claim_one(broker)
    broker.cancel([job_id], "ops", None)
    broker.dead(job.lease, "permanent", {"reason": "permanent", "class": "E", "message": "", "traceback": ""})
    broker.dlq_replay([job_id])
    again = claim_one(broker)
    assert broker.renew([again.lease], 30).cancel == {}, "the replay is a fresh start"


@pytest.mark.parametrize("ending", ["retry", "release", "lease_expired"])
def test_a_job_asked_to_cancel_never_runs_again(broker, ending):
    job_id = broker.enqueue(new(max_attempts=5))
    job = claim_one(broker, lease=0.3 if ending == "lease_expired" else 30)
    broker.cancel([job_id], "ops", "stop it")
    if ending == "retry":
        broker.retry(job.lease, broker.now(), {"reason": "exception", "class": "E", "message": "", "traceback": ""})
    elif ending == "release":
        broker.release(job.lease)
    else:
        wait_past(broker, job.lease_until + 0.05)
    assert broker.claim(Q, 5, 30, "w2") == []
    ended = broker.get(job_id)
    assert ended.state == "cancelled" and ended.finished_at is not None
    assert len(started(ended)) <= 1


def test_renew_stores_progress_only_for_current_leases(broker):
    mine = broker.enqueue(new())
    other = broker.enqueue(new(max_attempts=3))
    job = claim_one(broker)
    stale = claim_one(broker, lease=0.2)
    assert stale.id == other
    wait_past(broker, stale.lease_until + 0.05)
    current = claim_one(broker)
    renewal = broker.renew([job.lease, stale.lease], 30, progress={mine: (0.25, "a quarter"), other: (0.9, "stale")})
    assert renewal.lost == [stale.lease] and renewal.cancel == {}
    assert (broker.get(mine).progress, broker.get(mine).progress_note) == (0.25, "a quarter")
    assert broker.get(other).progress is None, "a stale lease stores nothing"
    assert broker.get(mine).lease_until > job.lease_until
    # Odd values from a handler are made harmless, never refused; no progress keeps the last one.
    broker.renew([job.lease, current.lease], 30, progress={mine: (7, "x" * 1000), current.id: ("half", None)})
    assert broker.get(mine).progress == 1.0 and len(broker.get(mine).progress_note) == control.MAX_NOTE
    assert broker.get(other).progress is None
    broker.renew([job.lease], 30)
    assert broker.get(mine).progress == 1.0


def test_cancel_refuses_bad_input_and_changes_nothing(broker):
    job_id = broker.enqueue(new())
    for args in (([job_id], 5, "r"), ([job_id], "ops", ["r"]), ([7], "ops", "r")):
        with pytest.raises(BadInput):
            broker.cancel(*args)
    assert broker.get(job_id).state == "queued"


def _cancel_claimer(url, out, start, most=60):
    broker = open_broker(url)
    start.wait()
    seen = []
    idle = 0
    # At most ``most`` jobs each: four claimers leave most of the jobs to the
    # cancels, so the race has both sides however fast either side is.
    while idle < 5 and len(seen) < most:
        jobs = broker.claim(Q, 5, 300, f"proc-{multiprocessing.current_process().pid}")
        if not jobs:
            idle += 1
            time.sleep(0.02)
            continue
        idle = 0
        for job in jobs:
            seen.append((job.id, job.history[-1]["started_at"]))
            try:
                broker.ack(job.lease)
            except LeaseLost:  # only if a cancel ended a running job: the assertions below say so
                pass
    broker.close()
    out.put(seen)


def test_cancel_racing_four_claimers_never_lets_a_cancelled_job_start(broker, broker_url):
    total = 600
    ids = broker.enqueue_many([NewJob("t", {"i": i}) for i in range(total)])
    ctx = multiprocessing.get_context("fork")
    out, start = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_cancel_claimer, args=(broker_url, out, start)) for _ in range(4)]
    for p in procs:
        p.start()
    start.set()
    # The race needs both sides: cancel once the claimers are taking jobs (a loaded
    # machine can start them after a whole loop of cancels otherwise).
    wait_for(lambda: broker.stats(Q)["default"].ready < total, timeout=60, message="claimers to start")
    answers = {}
    # Every job, in small batches, oldest first: the same jobs the claimers are taking.
    for i in range(0, total, 10):
        answers.update(broker.cancel(ids[i:i + 10][::-1] if i % 20 else ids[i:i + 10], "ops", "race"))
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    starts = {}
    for seen in results:
        for job_id, at in seen:
            assert job_id not in starts, "no job claimed twice"
            starts[job_id] = at
    cancelled = [j for j in ids if answers[j] == "cancelled"]
    assert cancelled and starts, "the race had both sides"
    for job_id in ids:
        job = broker.get(job_id)
        if answers[job_id] == "cancelled":
            assert job_id not in starts and job.state == "cancelled" and not started(job)
        else:
            assert answers[job_id] in ("requested", "already_done") and job.state == "done"
            assert job_id in starts


def _acker(url, leases, start):
    broker = open_broker(url)
    start.wait()
    for lease in leases:
        try:
            broker.ack(lease)
        except LeaseLost:
            pass
    broker.close()


def test_cancel_racing_completion_ends_done_or_cancelled_never_both(broker, broker_url):
    ids = broker.enqueue_many([NewJob("t", {"i": i}) for i in range(120)])
    jobs = broker.claim(Q, 120, 300, "w1")
    assert len(jobs) == 120
    ctx = multiprocessing.get_context("fork")
    start = ctx.Event()
    acker = ctx.Process(target=_acker, args=(broker_url, [j.lease for j in jobs], start))
    acker.start()
    start.set()
    outcomes = {}
    for job in jobs:  # the master's side: a request, then its fenced write, racing the ack
        outcomes[job.id] = broker.cancel([job.id], "ops", "race")[job.id]
        try:
            broker.cancelled(job.lease)
            outcomes[job.id] = "cancelled"
        except LeaseLost:
            pass
    acker.join(60)
    assert acker.exitcode == 0
    states = {job_id: broker.get(job_id).state for job_id in ids}
    assert set(states.values()) <= {"done", "cancelled"}, "never stuck running"
    for job_id in ids:
        job = broker.get(job_id)
        if outcomes[job_id] == "cancelled":
            assert job.state == "cancelled" and job.result is None
        else:
            assert job.state == "done"
        assert [e["outcome"] for e in job.history].count("done") + \
            [e["outcome"] for e in job.history].count("cancelled") == 1, "one ending, never both"
    s = broker.stats(Q)["default"]
    assert s.done + s.cancelled == 120 and s.in_flight == 0


# -- pause -------------------------------------------------------------------------

def test_pause_stops_every_claimer_sharing_the_broker(broker, broker_url):
    other = open_broker(broker_url)  # a second supervisor on the same broker
    try:
        broker.enqueue_many([new(queue="mail"), new(queue="mail"), new(queue="default")])
        broker.pause("mail", by="ops")
        broker.pause("mail", by="someone else")  # idempotent: the first pause stands
        for b in (broker, other):
            assert set(b.paused()) == {"mail"} and b.paused()["mail"]["by"] == "ops"
            assert b.paused()["mail"]["at"] > 0
            # Only the queues asked about (what a supervisor's heartbeat serves): the others are none of its business.
            assert b.paused(["mail", "default"]) == b.paused() and b.paused(["default", "nowhere"]) == {}
            assert b.paused([]) == {}
        assert other.claim(["mail"], 5, 30, "s2") == []
        assert [j.queue for j in other.claim(["mail", "default"], 5, 30, "s2")] == ["default"]
        stats = broker.stats(["mail", "default"])
        assert stats["mail"].paused and not stats["default"].paused and stats["mail"].ready == 2
        other.resume("mail")
        other.resume("mail")  # idempotent
        assert broker.paused() == {}
        assert len(broker.claim(["mail"], 5, 30, "s1")) == 2
    finally:
        other.close()


def test_pause_refuses_a_bad_queue_name_and_changes_nothing(broker):
    for name in ("", "has space", "x" * 65, None, "a/b"):
        with pytest.raises(BadInput):
            broker.pause(name)
        with pytest.raises(BadInput):
            broker.resume(name)
    assert broker.paused() == {}


def test_queues_lists_queues_with_jobs_paused_or_served(broker):
    broker.enqueue(new(queue="mail"))
    broker.pause("reports")
    broker.write_supervisor({"id": "s1", "queues": ["billing", "default"]}, ttl=30)
    assert broker.queues() == ["billing", "default", "mail", "reports"]


def test_a_queue_whose_jobs_were_all_pruned_leaves_the_list_unless_paused(broker):
    """Producers may name any number of queues over months (a queue per tenant, per run). On
    Redis every name ever used stayed listed, and every prune, dead-letter listing and search
    without a queue visited each one: the SQL brokers list the queues that have jobs."""
    for queue in ("gone", "running", "held"):
        broker.enqueue(new(queue=queue))
    broker.enqueue_once(new(queue="once", idempotency_key="cron:1"))
    leased = broker.claim(["gone", "running", "held", "once"], 4, 30, "w")
    for job in leased:
        if job.queue != "running":
            broker.ack(job.lease)
    broker.pause("held")
    wait_past(broker, max(broker.get(job.id).finished_at or 0 for job in leased) + 0.05)
    broker.prune(0)
    assert broker.queues() == ["held", "running"]
    assert broker.enqueue_once(new(queue="once", idempotency_key="cron:1")) is not None  # its record went too
    broker.enqueue(new(queue="gone"))
    assert broker.queues() == ["gone", "held", "once", "running"]
    assert list(broker.paused()) == ["held"]


def test_a_queue_paused_and_resumed_with_nothing_in_it_leaves_the_list_at_once(broker):
    """``queues()`` lists the queues with jobs, paused, or served. A pause names an empty queue; its
    resume left the name listed on Redis until the next prune (``tangguh queue list`` showed it,
    ``tangguh queue pause`` took it as known) where the SQL brokers dropped it at once."""
    broker.enqueue(new(queue="busy"))
    for queue in ("idle", "busy"):
        broker.pause(queue)
    assert broker.queues() == ["busy", "idle"]
    for queue in ("idle", "busy", "never"):
        broker.resume(queue)
    assert broker.queues() == ["busy"]
    assert broker.paused() == {}
    broker.pause("idle")  # named again by its next pause
    assert broker.queues() == ["busy", "idle"] and list(broker.paused()) == ["idle"]


# -- expiry ------------------------------------------------------------------------

def test_a_job_due_past_its_expiry_ends_expired_without_an_attempt(broker):
    short = broker.enqueue(new("notify", expires_in=0.2))
    late = broker.enqueue(new("notify", delay=0.3, expires_in=0.2))  # due only after it expired
    keep = broker.enqueue(new("notify", expires_in=3600))
    assert broker.get(short).expires_at == pytest.approx(broker.get(short).queued_at + 0.2, abs=0.01)
    wait_past(broker, broker.get(late).run_at + 0.05)
    claimed = broker.claim(Q, 10, 30, "w1")
    assert [j.id for j in claimed] == [keep]
    for job_id in (short, late):
        job = broker.get(job_id)
        assert job.state == "expired" and job.attempt == 0 and not started(job) and job.finished_at
        assert job.history[-1]["outcome"] == "expired"
    assert sorted(broker.take_expired()) == sorted([(short, "notify"), (late, "notify")])
    assert broker.take_expired() == []
    assert broker.stats(Q)["default"].expired == 2
    assert broker.cancel([short], "ops", None) == {short: "already_expired"}


@pytest.mark.parametrize("limited", [False, True], ids=["plain", "limited"])
def test_a_backlog_of_expired_jobs_is_never_leased_past_its_expiry(broker, limited):
    # More jobs past their expiry than one claim ends at its start (1,000 on every
    # broker): the claim that leases must still end the rest expired, or leave them to the
    # next claims, and never lease one. The stale jobs go first in claim order (priority).
    limits = {"t": TypeLimits(max_concurrency=10)} if limited else None
    stale = broker.enqueue_many([new(expires_in=0.3, priority=5) for _ in range(1001)])
    keep = broker.enqueue_many([new(expires_in=3600) for _ in range(3)])
    wait_past(broker, broker.get(stale[-1]).expires_at + 0.05)
    leased = []
    for _ in range(3):  # PostgreSQL ends what is left over in the next claim
        before = broker.now()
        got = broker.claim(Q, 5, 30, "w1", limits=limits)
        assert [j.id for j in got if j.expires_at <= before] == [], "leased past its expiry"
        leased += [j.id for j in got]
    assert sorted(leased) == sorted(keep)
    assert sorted(broker.take_expired()) == sorted((job_id, "t") for job_id in stale)
    for job_id in stale:
        job = broker.get(job_id)
        assert (job.state, job.attempt, started(job)) == ("expired", 0, []), job
        assert [e["outcome"] for e in job.history] == ["expired"]
    s = broker.stats(Q)["default"]
    assert (s.ready, s.in_flight, s.expired) == (0, 3, 1001)


def test_expiry_applies_to_a_retrying_job_and_not_to_a_running_one(broker):
    job_id = broker.enqueue(new(expires_in=0.3, max_attempts=3))
    job = claim_one(broker)
    wait_past(broker, broker.get(job_id).expires_at + 0.05)
    assert broker.renew([job.lease], 30).lost == [], "a started job runs to its end"
    broker.retry(job.lease, broker.now(), {"reason": "exception", "class": "E", "message": "", "traceback": ""})
    assert broker.claim(Q, 1, 30, "w1") == []
    assert broker.get(job_id).state == "expired" and len(started(broker.get(job_id))) == 1


def test_a_dead_job_replayed_after_its_expiry_runs_again(broker):
    # Replay is an operator's "run it again now", like requeue: a deadline that passed
    # while the job lay dead must not end the replayed job expired at its first claim.
    job_id = broker.enqueue(new(expires_in=0.3, max_attempts=1))
    job = claim_one(broker)
    broker.dead(job.lease, "permanent", {"reason": "permanent", "class": "E", "message": "", "traceback": ""})
    wait_past(broker, broker.get(job_id).expires_at + 0.05)
    assert broker.dlq_replay([job_id]) == [job_id]
    assert broker.get(job_id).expires_at is None
    assert [j.id for j in broker.claim(Q, 5, 30, "w")] == [job_id]
    assert broker.take_expired() == []


def test_prune_deletes_old_cancelled_and_expired_jobs_like_done_ones(broker):
    cancelled = broker.enqueue(new())
    broker.cancel([cancelled], "ops", None)
    dead = broker.enqueue(new(max_attempts=1))
    job = claim_one(broker)
    broker.dead(job.lease, "permanent", {"reason": "permanent", "class": "E", "message": "", "traceback": ""})
    expired = broker.enqueue(new(expires_in=0.1))
    wait_past(broker, broker.get(expired).expires_at + 0.05)
    assert broker.claim(Q, 5, 30, "w") == [] and broker.get(expired).state == "expired"
    assert broker.prune(3600) == 0
    wait_past(broker, broker.get(expired).finished_at + 0.05)
    assert broker.prune(0) == 2
    assert broker.get(cancelled) is None and broker.get(expired) is None and broker.get(dead).state == "dead"
    s = broker.stats(Q)["default"]
    assert (s.cancelled, s.expired, s.dead) == (0, 0, 1)


def test_a_requeued_or_discarded_cancelled_job_leaves_the_cancelled_and_expired_counts(broker):
    cancelled = broker.enqueue(new())
    broker.cancel([cancelled], "ops", None)
    expired = broker.enqueue(new(expires_in=0.1))
    wait_past(broker, broker.get(expired).expires_at + 0.05)
    assert broker.claim(Q, 5, 30, "w") == []
    assert broker.requeue([cancelled, expired]) == {cancelled: "queued", expired: "queued"}
    s = broker.stats(Q)["default"]
    assert (s.ready, s.cancelled, s.expired) == (2, 0, 0)
    wait_past(broker, broker.now() + 0.05)
    broker.prune(0)  # a requeued job is not pruned as an old cancelled one
    assert broker.get(cancelled).state == "queued" and broker.get(expired).state == "queued"
    assert {j.id for j in broker.claim(Q, 5, 30, "w")} == {cancelled, expired}
    again = broker.enqueue(new())
    broker.cancel([again], "ops", None)
    assert broker.discard([again]) == {again: "discarded"}
    assert broker.stats(Q)["default"].cancelled == 0


def test_an_id_named_twice_in_one_call_is_acted_on_once_and_a_bad_id_is_bad_input(broker):
    """requeue, discard and the dead letters' calls take each id once, as cancel does: a requeue
    of [a, a] answered "not_finished" for a job it had just requeued, a discard of [d, d]
    "unknown" for one it had just deleted (SQLite), a purge of [x, x] counted 2. An id that no
    job can have (not a string, empty, with a NUL) is bad input, as for cancel, not "unknown"."""
    def dead():
        job_id = broker.enqueue(new(max_attempts=1))
        broker.dead(claim_one(broker).lease, "permanent", {"class": "E", "message": "no"})
        return job_id

    a, x, y = dead(), dead(), dead()
    assert broker.requeue([a, a]) == {a: "queued"}
    d = broker.enqueue(new(delay=3600))
    assert broker.discard([d, d]) == {d: "discarded"}
    assert broker.dlq_purge([x, x]) == 1
    assert broker.dlq_replay([y, y]) == [y]
    assert (broker.get(x), broker.get(y).state) == (None, "queued")
    for call in (broker.requeue, broker.discard, broker.dlq_replay, broker.dlq_purge):
        for bad in ([None], [""], ["a\x00b"], [5]):
            with pytest.raises(BadInput, match="job id"):
                call(bad)
    assert broker.stats(Q)["default"].ready == 2


def test_a_replay_across_queues_refused_for_a_held_key_replays_none(broker):
    """A replay is all or nothing across queues too: one job whose idempotency key an
    unfinished job holds refuses the call before any job is replayed. Redis runs a script a
    queue, each all or nothing in its queue only: the queues before the conflict were replayed."""
    def dead(queue, **kw):
        job_id = broker.enqueue(new(queue=queue, max_attempts=1, **kw))
        broker.dead(claim_one(broker, queues=[queue]).lease, "permanent", {"class": "E", "message": "no"})
        return job_id

    a, b = dead("qa"), dead("qb", idempotency_key="k")
    holder = broker.enqueue(new(queue="qb", idempotency_key="k", delay=3600))
    for ids in ([a, b], [b, a]):
        with pytest.raises(BadInput, match=f"cannot replay {b}: its idempotency key"):  # PostgreSQL named none
            broker.dlq_replay(ids)
    assert (broker.get(a).state, broker.get(b).state, broker.get(holder).state) == ("dead", "dead", "queued")


def test_two_dead_jobs_with_one_idempotency_key_replay_one_at_a_time(broker):
    """Replayed in one call, both would hold the key: the second is refused, and with it the call
    (a replay is all or nothing); a requeue takes the first and answers ``conflict`` for the
    second. Redis replayed both, two unfinished holders of one key."""
    ids = []
    for _ in range(2):
        ids.append(broker.enqueue(new(max_attempts=1, idempotency_key="twin")))
        broker.dead(claim_one(broker).lease, "permanent", {"class": "E", "message": "no"})
    with pytest.raises(BadInput, match=f"cannot replay {ids[1]}: its idempotency key"):
        broker.dlq_replay(ids)
    assert [broker.get(i).state for i in ids] == ["dead", "dead"]
    assert broker.dlq_replay(ids[:1]) == ids[:1]
    assert broker.enqueue(new(idempotency_key="twin")) == ids[0]


def test_negative_or_zero_expires_in_is_refused_and_nothing_stored(broker):
    for bad in (-1, 0, float("nan"), "5", True):
        with pytest.raises(BadInput, match="expires_in"):
            broker.enqueue(new(expires_in=bad))
    assert broker.stats(Q)["default"].ready == 0


# -- wait --------------------------------------------------------------------------

def test_wait_returns_the_job_another_thread_finishes(broker, broker_url):
    job_id = broker.enqueue(new())
    job = claim_one(broker)
    result = {}

    def waiter():
        with open_broker(broker_url) as b:
            result["job"] = b.wait(job_id, 30)

    t = threading.Thread(target=waiter)
    t.start()
    broker.renew([job.lease], 30)  # a write that does not finish it: the waiter keeps waiting
    assert t.is_alive()
    broker.ack(job.lease, {"ok": 1})
    t.join(30)
    assert result["job"].state == "done" and result["job"].result == {"ok": 1}


@pytest.mark.parametrize("earlier_waits", [0, 2])
def test_wait_is_woken_by_the_broker_notification_not_its_fallback_poll(broker, broker_url, monkeypatch,
                                                                         earlier_waits):
    # With the fallback re-read an hour away, only the broker's notification can end the wait in time.
    # After earlier waits the broker listens on the connection they kept (what their unsubscribe left
    # unread must not be taken for this subscription's confirmation).
    monkeypatch.setattr(importlib.import_module(type(broker).__module__ + ".control"), "WAIT_FALLBACK", 3600.0)
    job_id = broker.enqueue(new())
    job = claim_one(broker)
    result, listening = {}, threading.Event()
    waiter = open_broker(broker_url)
    for _ in range(earlier_waits):
        assert waiter.wait(job_id, 0.01) is None
    waiter.get = lambda job_id, get=waiter.get: (listening.set(), get(job_id))[1]  # the first read is after listening

    def wait():
        result["job"] = waiter.wait(job_id, 3600)

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    assert listening.wait(30)
    broker.ack(job.lease, "ok")
    t.join(30)
    assert not t.is_alive(), "wait was not woken by the job finishing"
    assert result["job"].state == "done"
    waiter.close()


def test_wait_returns_at_once_for_a_finished_job_and_none_on_timeout(broker):
    done = broker.enqueue(new())
    broker.ack(claim_one(broker).lease)
    assert broker.wait(done, 5).state == "done"
    queued = broker.enqueue(new())
    assert broker.wait(queued, 0.2) is None
    assert broker.wait(queued, 0) is None
    broker.cancel([queued], "ops", None)
    assert broker.wait(queued, 5).state == "cancelled"


def test_wait_refuses_an_unknown_id_or_a_bad_timeout(broker):
    with pytest.raises(BadInput, match="unknown job"):
        broker.wait("job_nope", 1)
    job_id = broker.enqueue(new())
    for bad in (-1, float("inf"), "1"):
        with pytest.raises(BadInput, match="timeout"):
            broker.wait(job_id, bad)


def test_wait_and_remove_supervisor_refuse_an_id_nothing_can_have(broker):
    """Called on a broker directly (not through ``Client``), ``wait`` and ``remove_supervisor``
    with an id no job or supervisor can have (a NUL, a lone surrogate, not text) raised
    UnicodeEncodeError (SQLite, and Redis's ``remove_supervisor``), an outage (PostgreSQL), or
    was read as an unknown id. Now the same BadInput as every other call, before anything is read
    or written."""
    broker.write_supervisor({"id": "s1"}, ttl=30)
    for bad in ("a\x00b", "\ud800", "", 5, None, "x" * 1000):
        with pytest.raises(BadInput, match="job id"):
            broker.wait(bad, 0.1)
        with pytest.raises(BadInput, match="supervisor id"):
            broker.remove_supervisor(bad)
        with pytest.raises(BadInput, match="supervisor id"):
            broker.write_supervisor({"id": bad}, ttl=30)
    assert [r["id"] for r in broker.supervisors()] == ["s1"]


# -- supervisor records -----------------------------------------------------------

def test_supervisor_records_show_gone_after_ttl_and_are_removed_later(broker, monkeypatch):
    monkeypatch.setattr(control, "GONE_FOR", 0.5)
    broker.write_supervisor({"id": "s1", "host": "a", "pid": 1, "queues": ["default"], "workers": []}, ttl=0.3)
    broker.write_supervisor({"id": "s2", "host": "b", "pid": 2, "queues": []}, ttl=60)
    records = {r["id"]: r for r in broker.supervisors()}
    assert set(records) == {"s1", "s2"}
    assert records["s1"]["host"] == "a" and records["s1"]["gone"] is False
    assert records["s1"]["last_heartbeat"] == pytest.approx(broker.now(), abs=5)
    wait_past(broker, records["s1"]["last_heartbeat"] + 0.35)
    records = {r["id"]: r for r in broker.supervisors()}
    assert records["s1"]["gone"] is True and records["s2"]["gone"] is False
    wait_past(broker, records["s1"]["last_heartbeat"] + 0.9)
    broker.write_supervisor({"id": "s2", "host": "b", "pid": 2, "queues": []}, ttl=60)
    assert [r["id"] for r in broker.supervisors()] == ["s2"]
    broker.remove_supervisor("s2")
    broker.remove_supervisor("s2")
    assert broker.supervisors() == []


def test_a_supervisor_record_is_replaced_on_each_write(broker):
    broker.write_supervisor({"id": "s1", "workers": [{"slot": 0}]}, ttl=30)
    broker.write_supervisor({"id": "s1", "workers": []}, ttl=30)
    [record] = broker.supervisors()
    assert record["workers"] == []


@pytest.mark.parametrize("record, ttl", [({"host": "a"}, 30), ({"id": ""}, 30), ("s1", 30), ({"id": "s1"}, 0),
                                         ({"id": "s1", "x": float("nan")}, 30), ({"id": "s1"}, float("inf"))])
def test_a_bad_supervisor_record_is_refused(broker, record, ttl):
    with pytest.raises(BadInput):
        broker.write_supervisor(record, ttl)
    assert broker.supervisors() == []
