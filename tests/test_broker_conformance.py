"""The broker contract, checked on every backend unchanged.

A backend is conformant when this whole module passes with its URL fixture
(see ``conftest.broker_url``). Timing-sensitive cases use short leases and
wait for the broker's own clock to pass a point, never a bare sleep standing
in for a state.
"""
import copy
import multiprocessing
import time
import types

import pytest

from supervisor.backends import open_broker
from supervisor.errors import BadInput, BrokerError, LeaseLost, NotDead
from supervisor import ids, model
from supervisor.model import NewJob, TypeLimits, error_info

from .util import wait_for

Q = ["default"]


def new(type_="t", payload=None, **kw):
    return NewJob(type_, {"n": 1} if payload is None else payload, **kw)


def wait_past(broker, t):
    wait_for(lambda: broker.now() > t, timeout=10, interval=0.01, message="broker clock to pass a point")


def claim_one(broker, lease=30, queues=Q, owner="w1"):
    jobs = broker.claim(queues, 1, lease, owner)
    assert len(jobs) == 1, jobs
    return jobs[0]


# -- enqueue ---------------------------------------------------------------

def test_enqueue_and_get_round_trip(broker):
    job_id = broker.enqueue(new("email", {"to": "a@b", "n": [1, 2]}, resource_id="user:1",
                                idempotency_key="k1", max_attempts=3, timeout=9.5, trace_id="tr"))
    assert job_id.startswith("job_")
    job = broker.get(job_id)
    assert (job.type, job.queue, job.payload, job.state) == ("email", "default", {"to": "a@b", "n": [1, 2]}, "queued")
    assert (job.resource_id, job.idempotency_key, job.max_attempts, job.timeout, job.trace_id) == (
        "user:1", "k1", 3, 9.5, "tr")
    assert job.attempt == 0 and job.history == []
    assert abs(job.queued_at - broker.now()) < 5
    assert broker.get("job_nonexistent") is None


@pytest.mark.parametrize("payload", [[1, 2], "text", 3, None, {"x": float("nan")}, {"x": object()}])
def test_enqueue_rejects_non_json_objects_and_stores_nothing(broker, payload):
    with pytest.raises(BadInput):
        broker.enqueue(NewJob("t", payload))
    assert broker.stats(Q)["default"].ready == 0


def nested(depth):
    payload = {}
    for _ in range(depth - 1):
        payload = {"a": payload}
    return payload


def test_enqueue_takes_a_payload_nested_64_deep_and_refuses_one_deeper(broker):
    job_id = broker.enqueue(new(payload=nested(64)))
    assert broker.get(job_id).payload == nested(64)
    for depth in (65, 950, 100_000):
        with pytest.raises(BadInput, match="nested more than 64 levels"):
            broker.enqueue(new(payload=nested(depth)))
    assert broker.stats(Q)["default"].ready == 1


@pytest.mark.parametrize("field,value", [
    ("delay", -1), ("max_attempts", 0), ("timeout", -3), ("queue", ""),
    # Past what one of the brokers can store: refused by all of them, with BadInput.
    ("delay", 1e300), ("priority", 10**20), ("priority", 2**31), ("max_attempts", 2**31), ("timeout", 1e300),
    ("idempotency_key", "k" * 8192), ("resource_id", "r" * 256), ("trace_id", "t\x00"),
    ("idempotency_key", "\udc80"), ("type_", "t" * 256), ("type_", "t\x00"),
    ("queue", "a{b}"), ("queue", "q" * 65), ("queue", "two words"), ("queue", "tab\t"),
    # No database text takes NUL or a lone surrogate: PostgreSQL failed the whole batch with a
    # BrokerError (an outage to the producer, retried for ever) where SQLite stored it.
    ("payload", {"s": "a\x00b"}), ("payload", {"k\x00": 1}), ("payload", {"s": ["x", {"y": "\udc80"}]}),
    ("id", "job\x00"), ("id", 42), ("id", "j" * 256),
])
def test_enqueue_rejects_bad_fields(broker, field, value):
    with pytest.raises(BadInput):
        broker.enqueue(new(**{field: value}))
    assert broker.stats(Q)["default"].ready == 0


def test_a_payload_may_hold_what_looks_like_an_escape_and_any_character_a_database_stores(broker):
    payload = {"s": "a literal \\u0000 and \\ud800", "emoji": "\U0001F600", "nul-free": "\u2028\ufffd"}
    assert broker.get(broker.enqueue(new(payload=payload))).payload == payload


def test_enqueue_takes_the_largest_values_it_allows(broker):
    job_id = broker.enqueue(new(priority=2**31 - 1, max_attempts=2**31 - 1, delay=10 * 365 * 86400.0,
                                idempotency_key="k" * 255, resource_id="é" * 255, queue="a.b:c-d_9"))
    job = broker.get(job_id)
    assert (job.priority, job.max_attempts, job.idempotency_key, job.queue) == (2**31 - 1, 2**31 - 1, "k" * 255,
                                                                              "a.b:c-d_9")
    assert broker.enqueue(new(priority=-(2**31 - 1), queue="a.b:c-d_9")) != job_id


def test_enqueue_many_returns_ids_in_order(broker):
    ids = broker.enqueue_many([new(payload={"i": i}) for i in range(50)])
    assert len(set(ids)) == 50
    assert [broker.get(i).payload["i"] for i in ids] == list(range(50))
    assert broker.stats(Q)["default"].ready == 50


def test_an_id_the_caller_chose_names_one_job_a_resend_returns_it_another_queue_is_refused(broker):
    """A producer that resends a job it named (its reply was lost) gets the id back and one
    job is stored; the same id for a job of another queue is bad input, refused on every
    broker and by every way in (PostgreSQL once returned the id and stored nothing: the
    second job was lost; SQLite answered it as an outage)."""
    assert broker.enqueue(new("charge", {"n": 1}, id="job_order_42", queue="a")) == "job_order_42"
    assert broker.enqueue(new("charge", {"n": 1}, id="job_order_42", queue="a")) == "job_order_42"
    assert broker.enqueue_many([new("charge", {"n": 1}, id="job_order_42", queue="a"),
                                new("charge", {"n": 2}, id="job_order_43", queue="a")]) == ["job_order_42", "job_order_43"]
    for enqueue in (broker.enqueue, lambda job: broker.enqueue_many([new("other", queue="b"), job])):
        with pytest.raises(BadInput, match="job_order_42.*queue 'a'"):
            enqueue(new("mail", {"to": "x"}, id="job_order_42", queue="b"))
    with pytest.raises(BadInput, match="job_order_42.*queue 'a'"):
        broker.enqueue_once(new("mail", id="job_order_42", queue="b", idempotency_key="once:42"))
    assert broker.stats(["a", "b"])["a"].ready == 2 and broker.stats(["a", "b"])["b"].ready == 0
    assert (broker.get("job_order_42").queue, broker.get("job_order_42").type) == ("a", "charge")


def test_enqueue_dedups_on_idempotency_key_while_unfinished(broker):
    first = broker.enqueue(new(idempotency_key="charge:7"))
    assert broker.enqueue(new(idempotency_key="charge:7")) == first
    assert broker.enqueue_many([new(idempotency_key="charge:7"), new(idempotency_key="charge:8")])[0] == first
    job = claim_one(broker)
    assert broker.enqueue(new(idempotency_key="charge:7")) == first  # still unfinished while running
    broker.ack(job.lease)
    again = broker.enqueue(new(idempotency_key="charge:7"))
    assert again != first  # a finished job does not block a new one


# -- claim -------------------------------------------------------------------

def test_claim_leases_with_fresh_token_and_history(broker):
    job_id = broker.enqueue(new())
    job = claim_one(broker, owner="host:1")
    assert (job.id, job.state, job.attempt, job.owner) == (job_id, "running", 1, "host:1")
    assert job.token >= 1
    assert job.lease_until > broker.now()
    assert [h["attempt"] for h in job.history] == [1] and job.history[0]["owner"] == "host:1"
    assert broker.claim(Q, 5, 30, "w2") == []  # leased jobs are not handed out twice
    stored = broker.get(job_id)  # what the broker keeps, not only what claim returned
    assert (stored.state, stored.token, stored.attempt, stored.owner) == ("running", job.token, 1, "host:1")
    assert stored.lease_until == pytest.approx(job.lease_until, abs=0.001) and stored.history == job.history


def test_claim_oldest_first_and_respects_n(broker):
    ids = [broker.enqueue(new(payload={"i": i})) for i in range(5)]
    got = broker.claim(Q, 3, 30, "w")
    assert [j.id for j in got] == ids[:3]
    got = broker.claim(Q, 10, 30, "w")
    assert [j.id for j in got] == ids[3:]


def test_claim_serves_queues_in_the_given_order(broker):
    low = [broker.enqueue(new(queue="low", payload={"i": i})) for i in range(3)]
    high = [broker.enqueue(new(queue="high", payload={"i": i})) for i in range(2)]
    got = broker.claim(["high", "low"], 4, 30, "w")
    assert [j.id for j in got] == high + low[:2]
    assert broker.claim(["other"], 4, 30, "w") == []


def test_claim_higher_priority_first_within_a_queue(broker):
    a = broker.enqueue(new(priority=0))
    b = broker.enqueue(new(priority=5))
    c = broker.enqueue(new(priority=0))
    assert [j.id for j in broker.claim(Q, 3, 30, "w")] == [b, a, c]


def test_a_claim_of_fewer_than_ready_takes_the_highest_priorities(broker):
    """The broker picks the jobs (not a re-sort of what it returned): 3 of 10 ready, mixed priorities."""
    priorities = [0, 3, -1, 7, 0, 3, 9, 1, 0, 7]
    ids = [broker.enqueue(new(priority=p, payload={"i": i})) for i, p in enumerate(priorities)]
    got = broker.claim(Q, 3, 30, "w")
    assert [j.id for j in got] == [ids[6], ids[3], ids[9]]  # 9, then the two 7s oldest first
    leased = {i for i in ids if broker.get(i).state == "running"}
    assert leased == {ids[6], ids[3], ids[9]}
    assert [j.id for j in broker.claim(Q, 2, 30, "w")] == [ids[1], ids[5]]


def test_delayed_job_is_not_claimed_before_due(broker):
    job_id = broker.enqueue(new(delay=0.5))
    job = broker.get(job_id)
    assert job.run_at >= job.queued_at + 0.5
    assert broker.claim(Q, 1, 30, "w") == []
    assert broker.stats(Q)["default"].scheduled == 1
    wait_past(broker, job.run_at)
    assert claim_one(broker).id == job_id


# -- leases and fencing ----------------------------------------------------------

def test_expired_lease_is_reclaimed_with_a_new_token(broker):
    job_id = broker.enqueue(new())
    first = claim_one(broker, lease=0.2, owner="slow")
    wait_past(broker, first.lease_until)
    second = claim_one(broker, owner="fast")
    assert second.id == job_id
    assert second.token > first.token and second.attempt == 2
    assert [h.get("outcome") for h in second.history] == ["lease_expired", None]
    assert second.history[0]["error"]["reason"] == "lease_expired"
    # Fencing: the slow worker's outcome is refused, whatever it tries.
    for call in (lambda: broker.ack(first.lease), lambda: broker.release(first.lease),
                 lambda: broker.retry(first.lease, broker.now(), error_info("exception")),
                 lambda: broker.dead(first.lease, "exception", error_info("exception"))):
        with pytest.raises(LeaseLost):
            call()
    assert broker.extend([first.lease], 30) == [first.lease]
    broker.ack(second.lease, {"ok": True})
    assert broker.get(job_id).state == "done"


def test_attempts_exhausted_by_expired_leases_go_dead(broker):
    job_id = broker.enqueue(new(max_attempts=2))
    for _ in range(2):
        job = claim_one(broker, lease=0.1)
        wait_past(broker, job.lease_until)
    assert broker.claim(Q, 1, 30, "w") == []
    dead = broker.get(job_id)
    assert (dead.state, dead.reason, dead.attempt) == ("dead", "lease_expired", 2)
    assert [h["outcome"] for h in dead.history] == ["lease_expired", "lease_expired"]
    assert [j.id for j in broker.dlq_list()] == [job_id]


@pytest.mark.parametrize("limited", [False, True], ids=["plain", "limited"])
def test_a_queue_behind_a_backlog_that_fills_every_claim_still_has_its_lost_and_late_jobs_ended(broker, limited):
    """Claims from [A, B] where A's backlog fills each one. On Redis, a claim is a script a
    queue and stopped at the first full one: B's job whose supervisor died on its last
    attempt stayed `running` (never dead-lettered, its waiters never told), and its job past
    its expiry stayed `queued`. The SQL brokers end both at every claim."""
    lost_id = broker.enqueue(new(queue="B", max_attempts=1))
    late_id = broker.enqueue(new(queue="B", expires_in=0.2))
    (lost,) = broker.claim(["B"], 1, 0.2, "crashed")
    broker.enqueue_many([new(payload={"n": n}, queue="A") for n in range(1000)])
    wait_past(broker, lost.lease_until)
    limits = {"t": TypeLimits(max_concurrency=1000)} if limited else None

    def ended():
        assert [job.queue for job in broker.claim(["A", "B"], 1, 30, "w", limits=limits)] == ["A"]
        return (broker.get(lost_id).state, broker.get(late_id).state) == ("dead", "expired")
    wait_for(ended, timeout=10, message="B's lost job dead-lettered and its late job expired")
    assert broker.get(lost_id).reason == "lease_expired"
    assert [job.id for job in broker.dlq_list()] == [lost_id]


def test_extend_keeps_a_lease_alive_and_reports_lost_ones(broker):
    a, b = broker.enqueue(new()), broker.enqueue(new())
    ja, jb = broker.claim(Q, 2, 0.4, "w")
    stale = type(ja.lease)(jb.id, jb.token + 7)
    assert broker.extend([ja.lease, jb.lease, stale], 30) == [stale]
    wait_past(broker, ja.lease_until + 0.1)
    assert broker.claim(Q, 2, 30, "other") == []  # extended: nothing to reclaim
    assert broker.get(a).lease_until > broker.now() + 20
    broker.ack(ja.lease)
    broker.ack(jb.lease)
    assert {broker.get(a).state, broker.get(b).state} == {"done"}


def stolen(broker, lease=0.2, **kw):
    """A job claimed by owner "slow", its lease expired and reclaimed by "fast": (slow's job, fast's job)."""
    job_id = broker.enqueue(new(**kw))
    first = claim_one(broker, lease=lease, owner="slow")
    wait_past(broker, first.lease_until)
    second = claim_one(broker, owner="fast")
    assert (second.id, second.owner) == (job_id, "fast") and second.token > first.token
    return first, second


def snapshot(broker, job_id):
    """What the broker stores about a job, read back from the broker."""
    j = broker.get(job_id)
    return (j.state, j.token, j.attempt, j.owner, j.lease_until, j.run_at, j.result, j.error, j.reason,
            j.finished_at, j.history)


@pytest.mark.parametrize("write", ["ack", "ack_many", "retry", "dead", "release"])
def test_a_live_stale_lease_is_refused_on_every_write(broker, write):
    """The slow owner's late outcome meets a job that runs again under a new token: it must change nothing."""
    first, second = stolen(broker)
    before = snapshot(broker, second.id)
    assert before[:4] == ("running", second.token, 2, "fast")
    if write == "ack_many":
        assert broker.ack_many([(first.lease, {"late": True}, {"pid": 1})]) == [first.lease]
    else:
        call = {"ack": lambda: broker.ack(first.lease, {"late": True}),
                "retry": lambda: broker.retry(first.lease, broker.now() + 60, error_info("exception")),
                "dead": lambda: broker.dead(first.lease, "permanent", error_info("permanent")),
                "release": lambda: broker.release(first.lease)}[write]
        with pytest.raises(LeaseLost):
            call()
    assert snapshot(broker, second.id) == before
    assert broker.extend([second.lease], 30) == []  # the new owner's lease is untouched and current
    assert broker.ack_many([(second.lease, {"on_time": True}, {"pid": 2})]) == []
    done = broker.get(second.id)
    assert (done.state, done.result, done.token) == ("done", {"on_time": True}, second.token)
    assert [h.get("outcome") for h in done.history] == ["lease_expired", "done"]
    assert [h["owner"] for h in done.history] == ["slow", "fast"] and done.history[-1]["pid"] == 2


def test_ack_many_with_live_stale_and_current_leases_stores_only_the_current(broker):
    stale = [stolen(broker, payload={"s": i}) for i in range(2)]
    ids = [broker.enqueue(new(payload={"c": i})) for i in range(2)]
    current = broker.claim(Q, 2, 30, "fast")
    assert sorted(j.id for j in current) == sorted(ids)
    before = {second.id: snapshot(broker, second.id) for _, second in stale}
    batch = [(stale[0][0].lease, {"late": 0}, None), (current[0].lease, {"r": 0}, {"pid": 10}),
             (stale[1][0].lease, {"late": 1}, None), (current[1].lease, {"r": 1}, {"pid": 11})]
    assert broker.ack_many(batch) == [stale[0][0].lease, stale[1][0].lease]
    for job_id, snap in before.items():
        assert snapshot(broker, job_id) == snap  # still running under the new owner, no late result
    for i, job in enumerate(current):
        stored = broker.get(job.id)
        assert (stored.state, stored.result, stored.history[-1]["pid"]) == ("done", {"r": i}, 10 + i)
    assert broker.stats(Q)["default"].done == 2 and broker.stats(Q)["default"].in_flight == 2


@pytest.mark.parametrize("delete", ["discard", "dlq_purge"])
@pytest.mark.parametrize("path", ["plain", "flow"])
@pytest.mark.parametrize("clock", ["fast", "behind"])
def test_a_reused_job_id_never_meets_a_lease_of_the_deleted_job(broker, delete, path, clock, monkeypatch):
    """A chosen id deleted and enqueued again is a new job: a lease still held on the
    old one (a frozen supervisor's) must not renew, ack or fail the new one's attempt.
    Its token used to restart at 0, so the first claim got the old lease's token again.
    Then it started from the enqueue's millisecond: a fast broker ran this whole story in
    one millisecond and the old lease's token came back (``fast``: the producer's clock
    moves 2 us a reading, a broker round trip's floor). And from the producer's clock
    alone: a producer whose clock is behind the first one's (``behind``: another host, 1 s
    behind) gave the new job tokens below the old lease's; the broker's clock is a floor."""
    start, reads, lag = time.time(), iter(range(1, 10**9)), [0.0]
    monkeypatch.setattr(ids, "time", types.SimpleNamespace(time=lambda: start + 2e-6 * next(reads) - lag[0]))
    after = {}
    if path == "flow":  # the workflow insert: a job with a parent (done, so the job is due at once)
        parent = broker.enqueue(new(payload={"parent": True}))
        broker.ack(claim_one(broker).lease)
        after = {"depends_on": [parent]}
    broker.enqueue(new(id="order-7", payload={"v": "old"}, **after))
    stale = claim_one(broker, owner="frozen").lease
    if delete == "discard":
        broker.release(stale)  # handed back (or reclaimed after the lease ran out): not running, discardable
        assert broker.discard(["order-7"]) == {"order-7": "discarded"}
    else:
        broker.dead(stale, "permanent", error_info("permanent"))
        assert broker.dlq_purge(["order-7"]) == 1
    assert broker.get("order-7") is None
    lag[0] = 1.0 if clock == "behind" else 0.0
    assert broker.enqueue(new(id="order-7", payload={"v": "new"}, **after)) == "order-7"
    fresh = claim_one(broker, owner="owner")
    assert (fresh.id, fresh.payload, fresh.attempt) == ("order-7", {"v": "new"}, 1)
    assert fresh.token > stale.token
    assert broker.extend([stale], 30) == [stale]
    with pytest.raises(LeaseLost):
        broker.ack(stale, {"by": "frozen"})
    assert broker.ack_many([(stale, {"by": "frozen"}, None)]) == [stale]
    broker.ack(fresh.lease, {"by": "owner"})
    done = broker.get("order-7")
    assert (done.state, done.result, done.token) == ("done", {"by": "owner"}, fresh.token)


@pytest.mark.parametrize("way", ["enqueue", "enqueue_many"])
def test_an_id_set_on_a_checked_job_is_the_callers_choice(broker, way):
    """A job whose id the caller set after a check had made one (``Client.new_job``, then
    ``job.id = ...``) names that id as any id the caller chose does: a job of another queue
    may not take it, a resend gets it back, and its tokens start from the clock, above the
    leases of a deleted job of that id. It was taken for an id Tangguh made: not checked
    (Redis stored a second job under it, SQLite answered as an outage) and its tokens started
    from 0. So was a made id whose job, once stored, was sent to another queue."""
    def named(job_id, queue):
        job = new("charge", queue=queue).validate()  # an id made here...
        job.id = job_id  # ...then the caller's
        return job

    store = broker.enqueue if way == "enqueue" else (lambda job: broker.enqueue_many([job])[0])
    assert store(named("order-9", "a")) == "order-9"
    assert broker.get("order-9").token > 0
    with pytest.raises(BadInput, match="order-9.*queue 'a'"):
        store(named("order-9", "b"))
    assert store(named("order-9", "a")) == "order-9"
    moved = new("charge", queue="a").validate()  # its id made here, for queue a...
    assert store(moved) == moved.id
    moved.queue = "b"  # ...then the same job sent to another queue: its id names a stored job
    with pytest.raises(BadInput, match=f"{moved.id}.*queue 'a'"):
        store(moved)
    stats = broker.stats(["a", "b"])
    assert (stats["a"].ready, stats["b"].ready) == (2, 0)


@pytest.mark.parametrize("twice", ["two calls", "one batch", "a copy in one batch"])
def test_the_same_job_sent_again_is_a_resend_of_the_first(broker, twice):
    """A NewJob whose id Tangguh made, sent again (a producer retrying the same object, or a
    batch holding it twice): its id is returned for each and one job is stored. SQLite answered
    the second with UNIQUE failed, as an outage."""
    job = new(queue="a").validate()
    if twice == "two calls":
        ids = [broker.enqueue(job), broker.enqueue(job), broker.enqueue_many([job])[0]]
    else:
        ids = broker.enqueue_many([job, job if twice == "one batch" else copy.copy(job)])
    assert set(ids) == {job.id}
    assert broker.stats(["a"])["a"].ready == 1


@pytest.mark.parametrize("how", ["its id set", "a copy sent on"])
def test_one_id_for_two_queues_in_one_batch_is_refused_however_the_id_was_made(broker, how):
    """An id in one batch for jobs of two queues is bad input, refused before anything is
    stored, also when one of the two was made by ``validate`` (Redis stored both, one beside the
    other; PostgreSQL stored one and answered both with its id)."""
    first = new(payload={"v": "a"}, queue="a").validate()
    if how == "its id set":
        other = new(payload={"v": "b"}, queue="b")
        other.id = first.id
    else:
        other = copy.copy(first)
        other.queue = "b"
    for batch in ([first, other], [other, first]):
        with pytest.raises(BadInput, match=f"{first.id}.*taken by a job of queue"):
            broker.enqueue_many(batch)
    stats = broker.stats(["a", "b"])
    assert (stats["a"].ready, stats["b"].ready, broker.get(first.id)) == (0, 0, None)


def test_an_id_twice_in_one_batch_gets_one_answer_its_first_jobs(broker):
    """The same chosen id twice in a batch names one job: the later copy is a resend of the
    first and gets the first's answer, also when an unfinished job held the first one's key
    (SQLite answered each with the chosen id and stored nothing: an id that named no job;
    Redis stored the second copy). Nothing is stored under the id."""
    holder = broker.enqueue(new(idempotency_key="k"))
    assert broker.enqueue_many([new(id="c4", idempotency_key="k"), new(id="c4", idempotency_key="k")]) == [holder] * 2
    assert broker.enqueue_many([new(id="c5", idempotency_key="k"), new(payload={"second": 1}, id="c5")]) == [holder] * 2
    assert (broker.get("c4"), broker.get("c5"), broker.stats(Q)["default"].ready) == (None, None, 1)


def test_a_workflow_stores_the_payload_its_check_encoded(broker):
    """A job's payload is stored as ``validate`` checked and encoded it, even if the caller
    changes the dict in place afterwards: in a batch with parents too (PostgreSQL's workflow
    insert stored the dict as it was by then)."""
    parent = new("p").validate()
    child = new("c", {"amount": 10}, depends_on=[parent.id]).validate()
    child.payload["amount"] = 10_000
    child.payload["unstorable"] = {1, 2}
    assert broker.enqueue_many([parent, child]) == [parent.id, child.id]
    assert broker.get(child.id).payload == {"amount": 10}


def test_enqueue_once_refuses_a_taken_id_before_it_looks_at_the_key(broker):
    """An id the caller chose that names a job of another queue is bad input on every way in,
    looked up before anything else: also by an ``enqueue_once`` whose key is used already (the
    SQL brokers answered None)."""
    broker.enqueue(new(id="c6", queue="a"))
    assert broker.enqueue_once(new(queue="b", idempotency_key="once-k")) is not None
    with pytest.raises(BadInput, match="c6.*queue 'a'"):
        broker.enqueue_once(new(id="c6", queue="b", idempotency_key="once-k"))
    with pytest.raises(BadInput, match="c6.*queue 'a'"):
        broker.enqueue_once(new(id="c6", queue="b", idempotency_key="once-fresh"))
    assert broker.stats(["b"])["b"].ready == 1


def test_enqueue_once_with_parents_waits_for_them_and_a_refused_one_leaves_its_key_unused(broker):
    """``enqueue_once`` enqueues like ``enqueue``, parents included: the job waits for them, an
    unknown parent is bad input and leaves the key unused, a used key stores nothing (Redis stored
    such a job queued at once, its parents ignored, an unknown one too)."""
    parent = broker.enqueue(new("p", delay=1000))
    with pytest.raises(BadInput, match="no-such-job"):
        broker.enqueue_once(new("c", idempotency_key="once-1", depends_on=["no-such-job"]))
    child = broker.enqueue_once(new("c", idempotency_key="once-1", depends_on=[parent]))
    assert child is not None
    assert (broker.get(child).state, broker.get(child).pending) == ("waiting", 1)
    assert broker.enqueue_once(new("c", idempotency_key="once-1", depends_on=[parent])) is None
    stats = broker.stats(Q)["default"]
    assert (stats.waiting, stats.ready) == (1, 0)


def test_a_job_id_tangguh_made_starts_its_tokens_at_zero(broker):
    job_id = broker.enqueue(new())
    assert broker.get(job_id).token == 0 and claim_one(broker).token >= 1


def test_ack_stores_result_and_closes_history(broker):
    job_id = broker.enqueue(new())
    job = claim_one(broker)
    broker.ack(job.lease, {"total": 42}, {"pid": 1234, "host": "h"})
    done = broker.get(job_id)
    assert (done.state, done.result, done.lease_until) == ("done", {"total": 42}, None)
    entry = done.history[-1]
    assert (entry["outcome"], entry["pid"], entry["host"]) == ("done", 1234, "h")
    assert entry["ended_at"] >= entry["started_at"]
    with pytest.raises(LeaseLost):
        broker.ack(job.lease)  # a second ack of the same lease is refused
    assert broker.stats(Q)["default"].done == 1


@pytest.mark.parametrize("host", ["web-1.example", 'a "quoted" host\\name', "h\u00f6st\n"])
def test_an_attempts_info_as_the_master_writes_it_is_stored_whole_in_the_history(broker, host):
    # The master's attempt info (host, pid, slot, duration) is written without json.dumps
    # (jsonvalues.info_members): a host name needing escapes must still store as JSON.
    jobs = [broker.enqueue(new(payload={"n": i})) for i in range(3)] and broker.claim(Q, 3, 30, "w1")
    infos = [{"host": host, "pid": 4321, "slot": 1, "duration": 0.001234},
             {"host": host, "pid": 4321, "slot": 1, "duration": 1e-07},
             {"host": host, "pid": 4321, "slot": 0}]
    assert broker.ack_many([(job.lease, None, info) for job, info in zip(jobs, infos)]) == []
    for job, info in zip(jobs, infos):
        done = broker.get(job.id)
        entry = done.history[-1]
        assert (done.state, done.result) == ("done", None)
        assert {k: entry.get(k) for k in info} == info and entry["outcome"] == "done"


def test_ack_many_acks_current_leases_and_returns_stale_ones(broker):
    ids = [broker.enqueue(new(payload={"n": i})) for i in range(3)]
    jobs = broker.claim(Q, 3, 30, "w1")
    assert sorted(j.id for j in jobs) == sorted(ids)
    first = jobs[0]
    broker.ack(first.lease)  # acked already: its lease is stale in the batch below
    lost = broker.ack_many([(first.lease, None, None), (jobs[1].lease, {"r": 1}, {"pid": 7}),
                            (jobs[2].lease, None, {"pid": 8})])
    assert lost == [first.lease]
    done = broker.get(jobs[1].id)
    assert (done.state, done.result, done.lease_until) == ("done", {"r": 1}, None)
    assert (done.history[-1]["outcome"], done.history[-1]["pid"]) == ("done", 7)
    assert broker.get(jobs[2].id).state == "done"
    assert broker.ack_many([]) == []
    assert broker.stats(Q)["default"].done == 3


def test_enqueue_many_stores_every_field_exactly_whatever_it_holds_nulls_beside_values(broker):
    # A batch goes to PostgreSQL as one array a column (binary), to Redis as one JSON argument:
    # text that an array's text form would quote or escape ("NULL", braces, commas, quotes),
    # missing values beside set ones, and the largest numbers must all land in their own job.
    odd = ["NULL", "", "a,b", "{x}", "quote\"back\\slash", "é\u2603", "tab\tnew\nline", "plain"]
    jobs = [new(payload={"text": text, "i": i}, resource_id=text if i % 2 else None,
                idempotency_key=f"key {text}" if i % 3 == 0 else None, max_attempts=model.MAX_INT - i,
                priority=-model.MAX_INT + i if i % 2 else model.MAX_INT - i,
                timeout=0.25 * (i + 1) if i % 2 == 0 else None, expires_in=3600.0 + i if i % 4 == 1 else None)
            for i, text in enumerate(odd)]
    ids = broker.enqueue_many(jobs)
    assert ids == [job.id for job in jobs]
    for i, (job_id, text) in enumerate(zip(ids, odd)):
        stored = broker.get(job_id)
        assert stored.payload == {"text": text, "i": i}
        assert (stored.resource_id, stored.idempotency_key) == (
            text if i % 2 else None, f"key {text}" if i % 3 == 0 else None)
        assert (stored.max_attempts, stored.priority) == (
            model.MAX_INT - i, -model.MAX_INT + i if i % 2 else model.MAX_INT - i)
        assert stored.timeout == (0.25 * (i + 1) if i % 2 == 0 else None)
        assert (stored.expires_at is not None) == (i % 4 == 1)


def test_ack_many_stores_every_result_and_info_exactly_whatever_they_hold(broker):
    # Redis packs a batch into one argument, its values ended by NUL bytes: whatever an id, a
    # result or an info holds (control characters, escapes, non-ASCII text) must not shift the
    # fields of the jobs after it. (None holds a NUL: ids and results are refused with one.)
    odd = ["a b", "é\u2603", "tab\tnew\nline", "\x01\x1f", "quote\"back\\slash", "{\"k\":1}"]
    ids = [broker.enqueue(new(id=f"{text}-{i}", payload={"i": i})) for i, text in enumerate(odd)]
    jobs = sorted(broker.claim(Q, len(ids), 30, "w1"), key=lambda j: j.payload["i"])
    assert [j.id for j in jobs] == ids
    results = [{"text": text, "n": 2 ** 62 + i, "f": 0.1 * i} for i, text in enumerate(odd)]
    infos = [{"pid": i, "note": text} if i % 2 else None for i, text in enumerate(odd)]
    assert broker.ack_many([(job.lease, result, info) for job, result, info in zip(jobs, results, infos)]) == []
    for job_id, result, info in zip(ids, results, infos):
        stored = broker.get(job_id)
        assert (stored.state, stored.result, stored.history[-1]["outcome"]) == ("done", result, "done")
        assert info is None or (stored.history[-1]["pid"], stored.history[-1]["note"]) == (info["pid"], info["note"])


def test_retry_waits_for_run_at_and_keeps_the_error(broker):
    job_id = broker.enqueue(new())
    job = claim_one(broker)
    run_at = broker.now() + 0.4
    broker.retry(job.lease, run_at, error_info("exception", "ValueError", "boom", "Traceback..."))
    stored = broker.get(job_id)
    assert stored.state == "retrying" and stored.error["message"] == "boom"
    assert stored.first_failure_at == stored.last_failure_at
    assert broker.claim(Q, 1, 30, "w") == []
    assert broker.stats(Q)["default"].scheduled == 1
    wait_past(broker, run_at)
    again = claim_one(broker)
    assert (again.id, again.attempt) == (job_id, 2)
    assert again.history[0]["outcome"] == "retry" and again.history[0]["error"]["class"] == "ValueError"


def test_release_gives_the_attempt_back(broker):
    job_id = broker.enqueue(new())
    job = claim_one(broker)
    broker.release(job.lease)
    stored = broker.get(job_id)
    assert (stored.state, stored.attempt, stored.history) == ("queued", 0, [])
    again = claim_one(broker)
    assert again.attempt == 1 and again.token > job.token


# -- dead letters -----------------------------------------------------------

def test_dead_letter_list_show_replay_purge(broker):
    ids = [broker.enqueue(new("a" if i < 2 else "b", {"i": i}, idempotency_key=f"k{i}")) for i in range(3)]
    for job in broker.claim(Q, 3, 30, "w"):
        broker.dead(job.lease, "permanent", error_info("permanent", "Permanent", "nope", "tb"))
    dead = broker.dlq_get(ids[0])
    assert (dead.state, dead.reason, dead.error["message"], dead.attempt) == ("dead", "permanent", "nope", 1)
    assert dead.first_failure_at and dead.last_failure_at and dead.history[-1]["outcome"] == "dead"
    assert {j.id for j in broker.dlq_list()} == set(ids)
    assert {j.id for j in broker.dlq_list(type="a")} == set(ids[:2])
    assert len(broker.dlq_list(limit=1)) == 1
    assert broker.stats(Q)["default"].dead == 3

    broker.dlq_replay([ids[0]])
    replayed = broker.get(ids[0])
    assert (replayed.state, replayed.attempt, len(replayed.history)) == ("queued", 0, 1)
    assert broker.dlq_get(ids[0]) is None
    with pytest.raises(NotDead):
        broker.dlq_replay([ids[0]])
    with pytest.raises(NotDead):
        broker.dlq_purge([ids[0], ids[1]])
    assert broker.get(ids[1]).state == "dead"  # a refused purge removes nothing

    assert broker.dlq_purge([ids[1]]) == 1
    assert broker.get(ids[1]) is None
    assert [j.id for j in broker.dlq_list()] == [ids[2]]
    assert claim_one(broker).id == ids[0]


# -- stats and pruning -------------------------------------------------------

def test_a_limit_an_age_or_a_queue_name_no_call_can_use_is_refused_alike(broker):
    """The same bad argument, the same answer on every broker. ``dlq_list(limit=-1)``: SQLite
    listed every dead job, Redis all but the last, PostgreSQL failed as an outage. ``prune(nan)``:
    0 on the SQL brokers (a cutoff no row passes), ValueError on Redis. ``stats`` of a name no
    queue can have: zeros on the SQL brokers, BadInput on Redis."""
    for _ in range(2):
        broker.enqueue(new(max_attempts=1))
        broker.dead(claim_one(broker).lease, "permanent", error_info("permanent", "Permanent", "no"))
    for bad in (-1, True, 2.5, "3"):
        with pytest.raises(BadInput, match="limit must be"):
            broker.dlq_list(limit=bad)
    # A type no job can have (``dlq list --type`` with a byte that is no UTF-8): Redis listed
    # nothing, SQLite raised UnicodeEncodeError, PostgreSQL failed as an outage on a NUL.
    for bad in ("a\x00", "a\udcff", 7, "x" * 256):
        with pytest.raises(BadInput, match="type filter must be"):
            broker.dlq_list(type=bad)
    assert len(broker.dlq_list(type="")) == 2  # no filter, as None (Redis listed the jobs of type "": none)
    assert len(broker.dlq_list(limit=0)) == 0 and len(broker.dlq_list(limit=None)) == 2
    for bad in (float("nan"), float("inf"), float("-inf"), None, "60", True):
        with pytest.raises(BadInput, match="done_older_than"):
            broker.prune(bad)
    with pytest.raises(BadInput, match="not a valid queue name"):
        broker.stats(["default", "bad q"])
    assert broker.stats(["default"])["default"].dead == 2


def test_stats_counts_every_state(broker):
    broker.enqueue_many([new() for _ in range(3)])
    broker.enqueue(new(delay=60))
    broker.enqueue(new(queue="other"))
    running = claim_one(broker)
    dead = claim_one(broker)
    broker.dead(dead.lease, "permanent", error_info("permanent"))
    first = broker.get(broker.claim(Q, 1, 30, "w")[0].id)
    broker.ack(first.lease)
    s = broker.stats(["default", "other", "empty"])
    d = s["default"]
    assert (d.ready, d.scheduled, d.in_flight, d.dead, d.done) == (0, 1, 1, 1, 1)
    assert s["other"].ready == 1 and s["empty"].ready == 0
    assert running.state == "running"
    ready_at = broker.get(broker.enqueue(new(queue="ready"))).run_at
    wait_past(broker, ready_at + 0.3)
    age = broker.stats(["ready"])["ready"].oldest_ready_age
    assert 0.3 <= age < broker.now() - ready_at + 0.01
    assert broker.stats(["empty"])["empty"].oldest_ready_age == 0


def test_stats_within_a_bound_counts_the_same_and_past_it_is_a_broker_error(broker):
    """The heartbeat's queue sample bounds its counts (they read every job of each state, dead
    letters included, kept until purged): past the bound the broker gives up, its connection
    still good. Redis counts with ZCARD, bounded already."""
    broker.enqueue_many([new() for _ in range(30_000)])
    broker.enqueue(new(delay=60))
    full = broker.stats(["default"])["default"]
    bounded = broker.stats(["default"], within=60)["default"]
    assert (bounded.ready, bounded.scheduled) == (full.ready, full.scheduled) == (30_000, 1)
    if type(broker).__name__ != "RedisBroker":
        with pytest.raises(BrokerError):
            broker.stats(["default"], within=0.0005)
    assert broker.stats(["default"])["default"].ready == 30_000  # and the broker goes on


def test_an_interrupt_with_nothing_running_leaves_the_next_calls_alone(broker):
    # The heartbeat interrupts its queue sample when the master must fork; one that comes after
    # the sample ended must not abort the next statement.
    broker.interrupt()
    job_id = broker.enqueue(new())
    assert broker.stats(["default"])["default"].ready == 1 and broker.get(job_id).state == "queued"


def test_prune_deletes_only_old_done_jobs(broker):
    keep = broker.enqueue(new())
    done = broker.enqueue(new())
    job = broker.claim(Q, 2, 30, "w")
    by_id = {j.id: j for j in job}
    broker.ack(by_id[done].lease)
    assert broker.prune(3600) == 0
    wait_past(broker, broker.get(done).finished_at + 0.05)
    assert broker.prune(0) == 1
    assert broker.get(done) is None and broker.get(keep) is not None


def test_prune_with_a_budget_stops_once_it_is_spent_and_the_rest_goes_on_later_calls(broker, monkeypatch):
    """The master prunes one budget per loop turn (``periodic.PRUNE_BUDGET``): a backlog of
    millions deleted in one call left the health socket unanswered for seconds."""
    import supervisor.backends.redis.prune as redis_prune
    import supervisor.backends.sqlite as sqlite_broker

    monkeypatch.setattr(sqlite_broker, "PRUNE_BATCH", 2)
    monkeypatch.setattr(redis_prune, "BATCH", 2)
    broker.prune_batch = 2  # PostgreSQL's
    ids = broker.enqueue_many([new() for _ in range(9)])
    for job in broker.claim(Q, 9, 30, "w"):
        broker.ack(job.lease)
    wait_past(broker, max(broker.get(i).finished_at for i in ids) + 0.05)
    rounds = []
    while not rounds or rounds[-1] >= 3:
        rounds.append(broker.prune(0, budget=3))
        assert len(rounds) <= 9
    assert sum(rounds) == 9 and all(3 <= n <= 4 for n in rounds[:-1]), rounds
    assert all(broker.get(i) is None for i in ids)


# -- concurrency ---------------------------------------------------------------

def _claimer(url, out, start):
    broker = open_broker(url)
    start.wait()
    seen = []
    idle = 0
    while idle < 3:
        jobs = broker.claim(Q, 10, 300, f"proc-{multiprocessing.current_process().pid}")
        if not jobs:
            idle += 1
            time.sleep(0.05)
            continue
        idle = 0
        for job in jobs:
            seen.append(job.id)
            broker.ack(job.lease)
        time.sleep(0.002)  # the "work" between batches, which lets other claimers in
    broker.close()
    out.put(seen)


def test_concurrent_claimers_never_share_a_job(broker, broker_url):
    total = 5000
    for start in range(0, total, 500):
        broker.enqueue_many([new(payload={"i": i}) for i in range(start, start + 500)])
    ctx = multiprocessing.get_context("fork")
    out, start = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_claimer, args=(broker_url, out, start)) for _ in range(4)]
    for p in procs:
        p.start()
    start.set()
    results = [out.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(30)
    claimed = [job_id for seen in results for job_id in seen]
    assert len(claimed) == total, "every job claimed once"
    assert len(set(claimed)) == total, "no job claimed twice"
    assert sum(1 for seen in results if seen) >= 2, "work was actually shared"
    s = broker.stats(Q)["default"]
    assert (s.ready, s.in_flight, s.done) == (0, 0, total)


# -- scheduling controls: priorities across queues, per-type limits, enqueue_once ------

def test_high_priority_flood_does_not_starve_a_queue_listed_earlier(broker):
    first = broker.enqueue(new(queue="first", priority=-5))
    broker.enqueue_many([new(queue="second", priority=100, payload={"i": i}) for i in range(50)])
    got = broker.claim(["first", "second"], 3, 30, "w")
    assert [j.queue for j in got] == ["first", "second", "second"] and got[0].id == first


def held_back(broker, job_id):
    """A job a limit held back is untouched: queued, no attempt, no token, no history."""
    job = broker.get(job_id)
    return (job.state, job.attempt, job.token, job.history) == ("queued", 0, 0, [])


def test_max_concurrency_leases_at_most_n_and_holds_the_rest_untouched(broker):
    limits = {"a": TypeLimits(max_concurrency=2)}
    a = [broker.enqueue(new("a", priority=1, payload={"i": i})) for i in range(5)]
    b = [broker.enqueue(new("b", payload={"i": i})) for i in range(2)]
    got = broker.claim(Q, 10, 30, "w", limits=limits)
    assert [j.id for j in got] == a[:2] + b  # the held-back a's do not stop the b's behind them
    assert all(held_back(broker, job_id) for job_id in a[2:])
    assert broker.claim(Q, 10, 30, "w2", limits=limits) == []  # counted across claimers
    broker.ack(got[0].lease)
    assert [j.id for j in broker.claim(Q, 10, 30, "w", limits=limits)] == [a[2]]
    assert [j.id for j in broker.claim(Q, 10, 30, "w")] == a[3:]  # no limits: the plain claim


def test_max_concurrency_counts_every_queue_and_frees_on_retry_dead_release(broker):
    limits = {"a": TypeLimits(max_concurrency=1)}
    ids = [broker.enqueue(new("a", payload={"i": i})) for i in range(4)]
    for finish in (lambda j: broker.retry(j.lease, broker.now() + 60, error_info("exception")),
                   lambda j: broker.dead(j.lease, "permanent", error_info("permanent")),
                   lambda j: broker.release(j.lease)):
        got = broker.claim(Q, 5, 30, "w", limits=limits)
        assert len(got) == 1
        assert broker.claim(Q, 5, 30, "w", limits=limits) == []
        finish(got[0])
    assert len(broker.claim(Q, 5, 30, "w", limits=limits)) == 1
    assert sum(broker.get(i).state == "running" for i in ids) == 1


def test_expired_lease_frees_its_concurrency_slot(broker):
    limits = {"a": TypeLimits(max_concurrency=1)}
    first = broker.enqueue(new("a"))
    second = broker.enqueue(new("a"))
    [job] = broker.claim(Q, 5, 0.2, "w", limits=limits)
    assert job.id == first and broker.claim(Q, 5, 30, "w", limits=limits) == []
    wait_past(broker, job.lease_until)
    got = broker.claim(Q, 5, 30, "w", limits=limits)
    # The reclaimed job is due from the reclaim on, so the older second job goes first.
    assert [j.id for j in got] == [second] and broker.get(first).state == "retrying"


def test_exclusive_never_leases_two_jobs_of_one_resource(broker):
    limits = {"x": TypeLimits(exclusive=True)}
    r1 = broker.enqueue(new("x", resource_id="acct:1"))
    r1b = broker.enqueue(new("x", resource_id="acct:1"))
    r2 = broker.enqueue(new("x", resource_id="acct:2"))
    free = [broker.enqueue(new("x")) for _ in range(2)]  # no resource: never held back
    other = broker.enqueue(new("y", resource_id="acct:1"))  # another type on the same resource
    got = broker.claim(Q, 10, 30, "w", limits=limits)
    assert [j.id for j in got] == [r1, r2, *free, other]
    assert held_back(broker, r1b)
    assert broker.claim(Q, 10, 30, "w2", limits=limits) == []
    broker.ack(got[0].lease)
    assert [j.id for j in broker.claim(Q, 10, 30, "w", limits=limits)] == [r1b]


@pytest.mark.parametrize("limit, error", [
    (TypeLimits(rate=(10**400, 1.0)), "rate must be"),  # passed the check, then every SQL claim raised OverflowError
    (TypeLimits(rate=(10**9 + 1, 1.0)), "rate must be"),
    (TypeLimits(rate=(1, 1.0, 2)), "rate must be"),  # ValueError
    (TypeLimits(rate=(1, float("nan"))), "rate must be"),
    (TypeLimits(max_concurrency=-1), "max_concurrency must be"),
    (TypeLimits(exclusive="no"), "exclusive must be"),  # TypeError
    ({"max_concurrency": 1}, "must be a TypeLimits"),  # AttributeError
])
def test_a_limit_no_claim_can_keep_is_refused_before_anything_is_leased(broker, limit, error):
    broker.enqueue(new("r"))
    with pytest.raises(BadInput, match=error):
        broker.claim(Q, 1, 30, "w", limits={"r": limit})
    assert broker.stats(Q)["default"].ready == 1
    assert len(broker.claim(Q, 1, 30, "w", limits={"r": TypeLimits(rate=(10**9, 1.0))})) == 1


def test_rate_limit_is_a_token_bucket_shared_by_claimers(broker):
    limits = {"r": TypeLimits(rate=(3, 1.0))}  # 3 at once, then one every 1/3 s
    ids = [broker.enqueue(new("r", payload={"i": i})) for i in range(6)]
    other = broker.enqueue(new("s"))
    got = broker.claim(Q, 10, 30, "w", limits=limits)
    start = broker.now()
    assert [j.id for j in got] == ids[:3] + [other]
    assert all(held_back(broker, job_id) for job_id in ids[3:])
    second = open_broker(broker.url)  # another claimer sees the same bucket
    try:
        later = second.claim(Q, 10, 30, "w2", limits=limits)
        assert later == [] or broker.now() - start > 0.3
        wait_past(broker, start + 0.4)
        later += second.claim(Q, 10, 30, "w2", limits=limits)
    finally:
        second.close()
    assert [j.id for j in later] == [ids[3]]


def test_a_released_lease_gives_its_rate_token_back(broker):
    """``release`` spends no attempt (a surplus of the prefetch handed back, a pause, a stop), so
    it spends no rate either: the tokens of the jobs that never ran are there for the next claim.
    Without it, claiming 5 of a 5-a-minute type and handing 4 back left 1 run in that minute."""
    limits = {"r": TypeLimits(rate=(5, 3600.0))}  # no refill to speak of within the test
    ids = [broker.enqueue(new("r", payload={"i": i})) for i in range(8)]
    got = broker.claim(Q, 5, 30, "w", limits=limits)
    assert len(got) == 5 and broker.claim(Q, 10, 30, "w", limits=limits) == []  # the five tokens spent
    for job in got[1:]:
        broker.release(job.lease)
    again = broker.claim(Q, 10, 30, "w", limits=limits)
    assert len(again) == 4 and {j.id for j in again} <= set(ids) - {got[0].id}  # the four tokens back
    broker.release(again[0].lease)
    with pytest.raises(LeaseLost):
        broker.release(again[0].lease)  # a second release of the same lease is refused: no second token
    assert len(broker.claim(Q, 10, 30, "w", limits=limits)) == 1


def test_enqueue_once_enqueues_a_key_only_once_even_after_the_job_is_done(broker):
    first = broker.enqueue_once(new(idempotency_key="cron:report:2026-01-01T00:00:00Z"))
    assert first is not None and broker.get(first).state == "queued"
    assert broker.enqueue_once(new(idempotency_key="cron:report:2026-01-01T00:00:00Z")) is None
    broker.ack(claim_one(broker).lease)
    assert broker.enqueue_once(new(idempotency_key="cron:report:2026-01-01T00:00:00Z")) is None
    assert broker.stats(Q)["default"].done == 1 and broker.stats(Q)["default"].ready == 0
    assert broker.enqueue_once(new(idempotency_key="cron:report:2026-01-01T00:01:00Z")) is not None
    with pytest.raises(BadInput):
        broker.enqueue_once(new())  # without a key there is nothing to remember


def test_enqueue_once_stores_a_key_once_across_queues(broker):
    """Redis kept the record per queue: a schedule's type moved to another queue (a reload, a
    rolling deploy) enqueued the same tick again there."""
    key = "cron:report:2026-01-01T00:00:00Z"
    first = broker.enqueue_once(new(idempotency_key=key, queue="default"))
    assert first is not None
    assert broker.enqueue_once(new(idempotency_key=key, queue="b")) is None
    stats = broker.stats(["default", "b"])
    assert (stats["default"].ready, stats["b"].ready) == (1, 0)
    broker.prune(0)  # the records go with the horizon: the key may be used again
    assert broker.enqueue_once(new(idempotency_key=key, queue="b")) is not None


def test_enqueue_once_records_a_schedules_newest_tick_by_exact_name_and_prune_keeps_it(broker):
    """The scheduler's look-back read the newest once-record under ``cron:<name>:``: gone once
    prune passed it (a monthly schedule looked new), another schedule's (``report:eu`` under
    ``report``'s prefix), or a key that is no tick (``cron:report:manual``)."""
    assert broker.last_tick_key("report") is None
    older, newer = "cron:report:2026-01-01T00:00:00Z", "cron:report:2026-03-01T00:00:00Z"
    assert broker.enqueue_once(new(idempotency_key=newer, queue="b"), schedule="report") is not None
    assert broker.enqueue_once(new(idempotency_key=older), schedule="report") is not None
    assert broker.last_tick_key("report") == newer  # only forward
    assert broker.enqueue_once(new(idempotency_key="cron:report:eu:2027-01-01T00:00:00Z"), schedule="report:eu")
    assert broker.enqueue_once(new(idempotency_key="cron:report:manual")) is not None  # no schedule: no record
    assert (broker.last_tick_key("report"), broker.last_tick_key("report:eu")) == \
        (newer, "cron:report:eu:2027-01-01T00:00:00Z")
    assert broker.last_tick_key("repo") is None and broker.last_tick_key("report:") is None
    # A key enqueued already (by a supervisor before this record existed) still moves it forward.
    latest = "cron:report:2026-04-01T00:00:00Z"
    assert broker.enqueue_once(new(idempotency_key=latest)) is not None
    assert broker.enqueue_once(new(idempotency_key=latest), schedule="report") is None
    assert broker.last_tick_key("report") == latest
    broker.prune(-1)  # every once-record goes; the schedules' records stay
    assert broker.enqueue_once(new(idempotency_key=older)) is not None
    assert (broker.last_tick_key("report"), broker.last_tick_key("report:eu")) == \
        (latest, "cron:report:eu:2027-01-01T00:00:00Z")


LIMITS = {"c": TypeLimits(max_concurrency=3), "e": TypeLimits(exclusive=True), "r": TypeLimits(rate=(10, 1.0))}


def _limited_claimer(url, stop, start):
    broker = open_broker(url)
    start.wait(10)
    while not stop.is_set():
        jobs = broker.claim(Q, 4, 30, f"p{multiprocessing.current_process().pid}", limits=LIMITS)
        time.sleep(0.01)  # the "work": leases overlap across processes while it runs
        for job in jobs:
            broker.ack(job.lease)
    broker.close()


def max_overlap(intervals):
    """The most intervals open at one instant (an end at t comes before a start at t)."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals], key=lambda x: (x[0], x[1]))
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def test_limits_hold_across_four_concurrent_claimers(broker, broker_url):
    """The broker's own lease history (started_at .. ended_at of each attempt) is the evidence."""
    jobs = [new("c", payload={"i": i}) for i in range(30)]
    jobs += [new("e", resource_id=f"acct:{i % 3}", payload={"i": i}) for i in range(30)]
    jobs += [new("r", payload={"i": i}) for i in range(25)]
    jobs += [new("free", payload={"i": i}) for i in range(20)]
    ids = broker.enqueue_many(jobs)
    ctx = multiprocessing.get_context("fork")
    stop, start = ctx.Event(), ctx.Event()
    procs = [ctx.Process(target=_limited_claimer, args=(broker_url, stop, start)) for _ in range(4)]
    for p in procs:
        p.start()
    start.set()
    try:
        wait_for(lambda: broker.stats(Q)["default"].done == len(ids), timeout=60, message="every job done")
    finally:
        stop.set()
        for p in procs:
            p.join(30)
    done = [broker.get(i) for i in ids]
    assert all(j.state == "done" and j.attempt == 1 and len(j.history) == 1 for j in done)
    assert len({h["owner"] for j in done for h in j.history}) >= 2, "work was actually shared"
    spans = {}
    for j in done:
        spans.setdefault(j.type, []).append((j.history[0]["started_at"], j.history[0]["ended_at"]))
    assert max_overlap(spans["c"]) <= 3
    assert max_overlap(spans["c"]) >= 2, "the limit was actually under pressure"
    for r in range(3):
        on_r = [(j.history[0]["started_at"], j.history[0]["ended_at"]) for j in done
                if j.type == "e" and j.resource_id == f"acct:{r}"]
        assert max_overlap(on_r) == 1
    # Rate 10/s from a full bucket: at most 10 + 10 * t leases in the first t seconds, and at
    # most 10 (burst) + 10 (refill) in any 1 s window. Tolerance: 1 lease, for clock rounding.
    starts = sorted(s for s, _ in spans["r"])
    for i, t0 in enumerate(starts):
        in_window = sum(1 for t in starts[i:] if t < t0 + 1.0)
        assert in_window <= 20 + 1
        assert i + 1 <= 10 + 10 * (t0 - starts[0]) + 1
    assert starts[-1] - starts[0] >= 1.0, "25 jobs at 10/s cannot all start within a second"


# -- a stored job that cannot be handed to a worker ----------------------------

def store_payload_raw(broker, job_id, text):
    """Overwrite a job's stored payload behind the producer API's back."""
    kind = type(broker).__name__
    if kind == "SQLiteBroker":
        broker.db.execute("UPDATE jobs SET payload = ? WHERE id = ?", (text, job_id))
    elif kind == "RedisBroker":
        assert broker.r.hset(f"{broker.prefix}:{{default}}:j:{job_id}", "payload", text) == 0
    else:
        assert broker._execute(f"UPDATE {broker._jobs} SET payload = %s::json WHERE id = %s",
                               (text, job_id)).rowcount == 1


@pytest.mark.parametrize("depth", [2000, 100])
def test_a_stored_payload_too_deep_to_decode_is_dead_lettered_at_claim(broker, depth):
    first = broker.enqueue(new(payload={"n": 1}))
    bad = broker.enqueue(new(payload={"n": 2}))
    last = broker.enqueue(new(payload={"n": 3}))
    store_payload_raw(broker, bad, '{"a":' * depth + "1" + "}" * depth)
    claimed = broker.claim(Q, 3, 30, "w1")
    assert sorted(j.id for j in claimed) == sorted([first, last])
    dead = broker.get(bad)
    assert (dead.state, dead.reason, dead.error["reason"]) == ("dead", "bad_payload", "bad_payload")
    assert dead.history[-1]["outcome"] == "dead"
    assert [j.id for j in broker.dlq_list()] == [bad]
    assert broker.claim(Q, 3, 30, "w1") == []


def test_error_text_no_database_can_store_is_replaced_not_refused(broker):
    raw = "bad \x00 byte and a lone \udc80 surrogate"
    clean = "bad \ufffd byte and a lone \ufffd surrogate"
    job_id = broker.enqueue(new(max_attempts=2))
    broker.retry(claim_one(broker).lease, 0, error_info("exception", "Boom\x00", raw, "Traceback\n" + raw))
    job = broker.get(job_id)
    assert job.state == "retrying"
    assert (job.error["class"], job.error["message"], job.error["traceback"]) == ("Boom\ufffd", clean,
                                                                                "Traceback\n" + clean)
    wait_past(broker, job.run_at)
    broker.dead(claim_one(broker).lease, "exception", error_info("exception", "Boom", raw))
    dead = broker.dlq_list()
    assert [j.id for j in dead] == [job_id] and dead[0].error["message"] == clean
    assert [h["error"]["message"] for h in broker.get(job_id).history] == [clean, clean]
