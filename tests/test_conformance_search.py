"""Search, count and the bulk actions (requeue, discard): the same tests on every broker."""
import multiprocessing

import pytest

from supervisor.backends import open_broker, scan
from supervisor.errors import BadInput
from supervisor.jobfilter import JobFilter, encode_cursor
from supervisor.model import NewJob, error_info

from .util import wait_for

Q = ["default", "mail"]


def new(type_="t", payload=None, **kw):
    return NewJob(type_, {"n": 1} if payload is None else payload, **kw)


def all_pages(broker, f, limit=3, order="newest"):
    seen, cursor = [], None
    for _ in range(10_000):
        page = broker.search(f, cursor=cursor, limit=limit, order=order)
        assert len(page.jobs) <= limit
        seen += page.jobs
        cursor = page.next_cursor
        if cursor is None:
            return seen
    raise AssertionError("the pages never ended")


def ids(jobs):
    return [j.id for j in jobs]


@pytest.fixture
def zoo(broker):
    """Jobs in every state a broker reaches on its own, with varied fields; {name: id}."""
    made = {}

    def add(name, **kw):
        made[name] = broker.enqueue(new(**kw))

    add("plain", type_="email", payload={"order_id": 7, "customer": {"id": "c1", "vip": True}})
    add("other_queue", type_="email", queue="mail", payload={"order_id": 8, "customer": {"id": "c2"}})
    add("resource", type_="report", resource_id="user:1", payload={"order_id": "7"})
    add("keyed", type_="report", idempotency_key="k-1", payload={"customer": {"id": "c1", "vip": 1}})
    add("nulls", type_="sms", payload={"order_id": None, "deep": {"a": {"b": {"c": 3}}}})
    add("done", type_="sms", payload={"order_id": 7})
    add("dead", type_="sms", payload={"order_id": 9})
    add("retrying", type_="sms", payload={"order_id": 10})
    add("running", type_="sms", payload={"order_id": 11})
    by_id = {v: k for k, v in made.items()}
    for job in broker.claim(["default"], 20, 300, "w"):
        name = by_id[job.id]
        if name == "done":
            broker.ack(job.lease, {"ok": 1})
        elif name == "dead":
            broker.dead(job.lease, "exception", error_info("exception", "ValueError", "Card Declined for order"))
        elif name == "retrying":
            broker.retry(job.lease, broker.now() + 3600,
                         error_info("exception", "TimeoutError", "gateway slow"))
        elif name != "running":
            broker.release(job.lease)
    return made


def expected(broker, zoo, keep):
    jobs = [broker.get(i) for i in zoo.values()]
    return sorted((j.id for j in jobs if keep(j)), key=lambda i: (broker.get(i).queued_at, i), reverse=True)


FILTERS = [
    ({"state": ["dead"]}, lambda j: j.state == "dead"),
    ({"state": ["queued", "retrying"]}, lambda j: j.state in ("queued", "retrying")),
    ({"queue": "mail"}, lambda j: j.queue == "mail"),
    ({"type": "email"}, lambda j: j.type == "email"),
    ({"resource_id": "user:1"}, lambda j: j.resource_id == "user:1"),
    ({"idempotency_key": "k-1"}, lambda j: j.idempotency_key == "k-1"),
    ({"payload": {"order_id": 7}}, lambda j: j.payload.get("order_id") == 7),
    ({"payload": {"order_id": "7"}}, lambda j: j.payload.get("order_id") == "7"),
    ({"payload": {"order_id": 7.0}}, lambda j: j.payload.get("order_id") == 7),
    ({"payload": {"order_id": None}}, lambda j: "order_id" in j.payload and j.payload["order_id"] is None),
    ({"payload": {"customer.id": "c1"}}, lambda j: j.payload.get("customer", {}).get("id") == "c1"),
    ({"payload": {"customer.vip": True}}, lambda j: j.payload.get("customer", {}).get("vip") is True),
    ({"payload": {"customer.vip": 1}}, lambda j: j.payload.get("customer", {}).get("vip") == 1
     and j.payload["customer"]["vip"] is not True),
    ({"payload": {"deep.a.b.c": 3}}, lambda j: j.payload.get("deep") is not None),
    ({"payload": {"customer.id": "c1", "order_id": 7}}, lambda j: j.payload.get("order_id") == 7
     and j.payload.get("customer", {}).get("id") == "c1"),
    ({"error": "declined"}, lambda j: j.state == "dead"),
    ({"error": "timeouterror"}, lambda j: j.state == "retrying"),
    ({"error": "gateway", "state": ["dead"]}, lambda j: False),
    ({"type": "sms", "state": ["done"]}, lambda j: j.type == "sms" and j.state == "done"),
    ({"payload": {"order_id": 12345}}, lambda j: False),
]


@pytest.mark.parametrize("spec,keep", FILTERS, ids=[str(f[0]) for f in FILTERS])
def test_every_filter_selects_what_it_names_newest_first(broker, zoo, spec, keep):
    f = JobFilter.from_dict(spec)
    want = expected(broker, zoo, keep)
    assert ids(all_pages(broker, f, limit=2)) == want
    assert ids(all_pages(broker, f, limit=50, order="oldest")) == want[::-1]
    count = broker.count(f)
    assert count.exact and count.n == len(want)


def test_the_empty_filter_pages_through_every_job_once_in_both_orders(broker, zoo):
    newest = ids(all_pages(broker, JobFilter(), limit=2))
    assert sorted(newest) == sorted(zoo.values()) and len(set(newest)) == len(zoo)
    assert ids(all_pages(broker, JobFilter(), limit=4, order="oldest")) == newest[::-1]
    keys = [(broker.get(i).queued_at, i) for i in newest]
    assert keys == sorted(keys, reverse=True)


def test_time_ranges_are_half_open(broker, zoo):
    jobs = sorted((broker.get(i) for i in zoo.values()), key=lambda j: (j.queued_at, j.id))
    mid = jobs[4].queued_at
    after = ids(all_pages(broker, JobFilter(queued_after=mid), order="oldest"))
    before = ids(all_pages(broker, JobFilter(queued_before=mid), order="oldest"))
    assert sorted(after + before) == sorted(zoo.values()) and not set(after) & set(before)
    assert all(broker.get(i).queued_at >= mid for i in after)
    finished = [broker.get(zoo["done"]), broker.get(zoo["dead"])]
    low = min(j.finished_at for j in finished)
    got = ids(all_pages(broker, JobFilter(finished_after=low)))
    assert sorted(got) == sorted([zoo["done"], zoo["dead"]])
    assert ids(all_pages(broker, JobFilter(finished_after=low, finished_before=low))) == []


@pytest.mark.parametrize("far", [1e10, 1e300])
def test_a_time_bound_past_the_year_2286_is_later_than_every_job(broker, zoo, far):
    """Redis keeps 16 digits of microseconds in its search index: a bound with more sorted below
    every member, so "queued after" it found every job and "queued before" it none."""
    assert ids(all_pages(broker, JobFilter(queued_after=far))) == []
    assert sorted(ids(all_pages(broker, JobFilter(queued_before=far)))) == sorted(zoo.values())
    assert broker.count(JobFilter(queued_before=far)).n == len(zoo)
    assert broker.count(JobFilter(queued_after=far)).n == 0


def test_a_page_holds_still_while_another_process_enqueues(broker, broker_url):
    broker.enqueue_many([new(payload={"i": i}) for i in range(60)])
    before = set(ids(all_pages(broker, JobFilter(), limit=50)))
    ctx = multiprocessing.get_context("fork")
    go, done = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_enqueuer, args=(broker_url, go, done))
    proc.start()
    try:
        assert go.wait(30)
        for order in ("newest", "oldest"):
            seen = ids(all_pages(broker, JobFilter(state=["queued"]), limit=7, order=order))
            assert len(seen) == len(set(seen)), "no job twice"
            assert before <= set(seen), "none of the jobs that existed at the first page skipped"
    finally:
        done.set()
        proc.join(30)
    assert proc.exitcode == 0


def _enqueuer(url, go, done):
    broker = open_broker(url)
    broker.enqueue(new(payload={"late": 0}))
    go.set()
    i = 0
    while not done.is_set() and i < 5000:
        broker.enqueue_many([new(payload={"late": i + k}) for k in range(5)])
        i += 5
    broker.close()


@pytest.mark.parametrize("call", [
    lambda b: b.search(JobFilter(), cursor="not-a-cursor"),
    lambda b: b.search(JobFilter(), cursor=encode_cursor("oldest", 1.0, "job_x")),  # made for the other order
    lambda b: b.search(JobFilter(), limit=0),
    lambda b: b.search(JobFilter(), limit=1001),
    lambda b: b.search(JobFilter(), limit="5"),
    lambda b: b.search(JobFilter(), order="random"),
    lambda b: b.search({"colour": "red"}),
    lambda b: b.search({"state": ["sleeping"]}),
    lambda b: b.count({"payload": {"a..b": 1}}),
    lambda b: b.count(JobFilter(), exact_up_to=-1),
    # What no job can hold: PostgreSQL answered a NUL as an outage (BrokerError), every broker a
    # lone surrogate with UnicodeEncodeError, and cursors not made by encode_cursor with
    # OverflowError (a time of inf on Redis, of 10**30 on SQLite).
    lambda b: b.search({"type": "a\x00"}),
    lambda b: b.search({"type": "a\ud800"}),
    lambda b: b.count({"payload": {"n": "a\x00"}}),
    lambda b: b.search(JobFilter(), cursor=encode_cursor("newest", 1.0, "job\x00x")),
    lambda b: b.search(JobFilter(), cursor=encode_cursor("newest", float("inf"), "job_x")),
    lambda b: b.search(JobFilter(), cursor=encode_cursor("newest", 10**30, "job_x")),
    lambda b: b.search(JobFilter(), cursor=encode_cursor("newest", True, "job_x")),
    lambda b: b.count({"payload": {f"k{i}": i for i in range(2000)}}),  # SQLite: "Expression tree is too large"
], ids=["cursor", "cursor-order", "limit-0", "limit-big", "limit-str", "order", "key", "state", "payload-key",
        "exact-up-to", "nul", "surrogate", "payload-nul", "cursor-nul", "cursor-inf", "cursor-huge", "cursor-bool",
        "payload-many"])
def test_bad_arguments_are_bad_input(broker, call):
    broker.enqueue(new())
    with pytest.raises(BadInput):
        call(broker)


def test_an_id_no_job_can_have_is_none_of_theirs(broker):
    """``get`` of an id with a NUL, or of no string: None, as for any id no job has (PostgreSQL
    refused the NUL with an error read as an outage, and 5 as a missing schema)."""
    broker.enqueue(new())
    assert (broker.get("a\x00b"), broker.get(5)) == (None, None)



def test_a_value_and_a_field_of_that_value_select_no_job(broker):
    """``customer`` equal to a value and ``customer.id`` to another: no payload has both.
    PostgreSQL merged the two into one containment document, the later key overwriting the
    value, and selected the jobs of customer 7 (a bulk cancel of that filter cancelled them)."""
    nested = broker.enqueue(new(payload={"customer": {"id": 7}}))
    plain = broker.enqueue(new(payload={"customer": 0}))
    for f in (JobFilter(payload={"customer": 0, "customer.id": 7}),
              JobFilter(payload={"customer.id": 7, "customer.id.x": 1})):
        assert ids(all_pages(broker, f)) == []
        assert broker.count(f).n == 0
    assert ids(all_pages(broker, JobFilter(payload={"customer.id": 7}))) == [nested]
    assert ids(all_pages(broker, JobFilter(payload={"customer": 0}))) == [plain]

def test_count_is_exact_up_to_the_threshold_then_an_estimate(broker):
    broker.enqueue_many([new("a", {"k": i % 2}) for i in range(30)] + [new("b") for _ in range(5)])
    assert broker.count(JobFilter(type="a"), exact_up_to=30) == broker.count(JobFilter(type="a"))
    assert broker.count(JobFilter(type="a"), exact_up_to=30).n == 30
    over = broker.count(JobFilter(type="a"), exact_up_to=10)
    assert not over.exact and over.n > 10
    assert broker.count(JobFilter(type="b"), exact_up_to=10).exact
    assert broker.count(JobFilter(payload={"k": 1}), exact_up_to=15).n == 15
    estimated = broker.count(JobFilter(payload={"k": 1}), exact_up_to=5)
    assert not estimated.exact and estimated.n > 5


def test_a_row_by_row_filter_stops_at_the_scan_bound_and_its_cursor_continues(broker, monkeypatch):
    # Error text is checked row by row on every broker (no index serves a substring).
    monkeypatch.setattr(scan, "SCAN_BOUND", 20)
    monkeypatch.setattr(scan, "_BATCH", 8)
    wanted = broker.enqueue_many([new("x", {"hit": True})])
    broker.enqueue_many([new("x", {"hit": False}) for _ in range(50)])
    wanted += broker.enqueue_many([new("x", {"hit": True})])
    for job in broker.claim(["default"], 100, 300, "w"):
        message = "needle" if job.payload["hit"] else "hay"
        broker.dead(job.lease, "exception", error_info("exception", "E", message))
    f = JobFilter(error="needle")
    first = broker.search(f, limit=5)
    assert ids(first.jobs) == [wanted[1]] and first.next_cursor, "short page, with a cursor to continue"
    assert ids(all_pages(broker, f, limit=5)) == wanted[::-1]
    count = broker.count(f)
    assert not count.exact and count.n >= 1


def test_requeue_puts_finished_jobs_back_with_attempt_zero_and_history(broker, zoo):
    gone = broker.enqueue(new())
    broker.discard([gone])
    got = broker.requeue([zoo["dead"], zoo["done"], zoo["plain"], zoo["running"], gone])
    assert got == {zoo["dead"]: "queued", zoo["done"]: "done", zoo["plain"]: "not_finished",
                   zoo["running"]: "not_finished", gone: "unknown"}
    job = broker.get(zoo["dead"])
    assert (job.state, job.attempt, job.finished_at, job.reason) == ("queued", 0, None, None)
    assert len(job.history) == 1 and job.history[0]["outcome"] == "dead"
    assert zoo["dead"] in ids(broker.claim(["default"], 20, 300, "w2"))
    assert broker.requeue([zoo["dead"]]) == {zoo["dead"]: "not_finished"}


def test_requeue_refuses_a_job_whose_key_an_unfinished_job_holds(broker):
    first = broker.enqueue(new(idempotency_key="same"))
    job = broker.claim(["default"], 1, 300, "w")[0]
    broker.dead(job.lease, "exception", error_info("exception", "E", "boom"))
    second = broker.enqueue(new(idempotency_key="same"))
    assert second != first
    assert broker.requeue([first]) == {first: "conflict"}
    assert broker.get(first).state == "dead"


def test_discard_deletes_anything_not_running(broker, zoo):
    targets = [zoo["plain"], zoo["done"], zoo["dead"], zoo["retrying"], zoo["running"], "job_unknown"]
    got = broker.discard(targets)
    assert got == {zoo["plain"]: "discarded", zoo["done"]: "discarded", zoo["dead"]: "discarded",
                   zoo["retrying"]: "discarded", zoo["running"]: "running", "job_unknown": "unknown"}
    for name in ("plain", "done", "dead", "retrying"):
        assert broker.get(zoo[name]) is None
    assert broker.get(zoo["running"]).state == "running"
    left = ids(all_pages(broker, JobFilter()))
    assert sorted(left) == sorted(set(zoo.values()) - {zoo[n] for n in ("plain", "done", "dead", "retrying")})
    assert broker.count(JobFilter()).n == len(left)
    # a discarded queued job is never claimed; a discarded key is free again
    claimed = ids(broker.claim(Q, 50, 300, "w3"))
    assert zoo["plain"] not in claimed
    assert broker.enqueue(new(idempotency_key="k-1")) == zoo["keyed"]


def test_searching_never_changes_a_job(broker, zoo):
    before = {i: broker.get(i).to_dict() for i in zoo.values()}
    all_pages(broker, JobFilter(payload={"order_id": 7}))
    broker.count(JobFilter(error="x"))
    assert {i: broker.get(i).to_dict() for i in zoo.values()} == before


def test_a_prune_takes_pruned_jobs_out_of_the_search(broker):
    job_id = broker.enqueue(new())
    job = broker.claim(["default"], 1, 300, "w")[0]
    broker.ack(job.lease)
    finished = broker.get(job_id).finished_at
    wait_for(lambda: broker.now() > finished + 0.01, message="the broker clock to move")
    assert broker.prune(0) == 1
    assert broker.search(JobFilter()).jobs == [] and broker.count(JobFilter()).n == 0


def test_requeue_and_discard_take_cancelled_and_expired_jobs(broker):
    cancelled = broker.enqueue(new())
    assert broker.cancel([cancelled], "ops", "wrong customer") == {cancelled: "cancelled"}
    expired = broker.enqueue(new(expires_in=0.05))
    deadline = broker.get(expired).expires_at
    wait_for(lambda: broker.now() > deadline + 0.01, message="the job's expiry to pass")
    assert broker.claim(["default"], 5, 300, "w") == []
    assert broker.get(expired).state == "expired"
    assert sorted(ids(broker.search(JobFilter(state=["cancelled", "expired"])).jobs)) == sorted([cancelled, expired])
    assert broker.requeue([cancelled, expired]) == {cancelled: "queued", expired: "queued"}
    for job_id in (cancelled, expired):
        job = broker.get(job_id)
        assert (job.state, job.attempt, job.cancel_request, job.expires_at) == ("queued", 0, None, None)
        assert job.history, "history kept"
    claimed = broker.claim(["default"], 5, 300, "w")
    assert sorted(ids(claimed)) == sorted([cancelled, expired])
    for job in claimed:
        broker.ack(job.lease)
    again = broker.enqueue(new())
    broker.cancel([again], "ops", "")
    assert broker.discard([again]) == {again: "discarded"}
    assert broker.get(again) is None and broker.count(JobFilter(state=["cancelled"])).n == 0


def test_scheduled_selects_the_queued_and_retrying_jobs_due_later_as_stats_counts_them(broker):
    """`tangguh status`/`queues` show a scheduled count (queued or retrying, run_at ahead of the
    broker's clock), and `jobs --state scheduled` was "unknown state". It selects those jobs on
    every broker, beside the states (a union) and under the other filters."""
    made = {name: broker.enqueue(new(type_="sms" if name == "dead" else "t"))
            for name in ("backoff", "retry_due", "dead")}
    by_id = {v: k for k, v in made.items()}
    for job in broker.claim(["default"], 10, 300, "w"):
        name = by_id[job.id]
        if name == "dead":
            broker.dead(job.lease, "exception", error_info("exception", "ValueError", "slow"))
        else:
            run_at = broker.now() + (3600 if name == "backoff" else -1)
            broker.retry(job.lease, run_at, error_info("exception", "TimeoutError", "gateway slow"))
    made["due"] = broker.enqueue(new())
    made["later"] = broker.enqueue(new(delay=3600))
    made["later_mail"] = broker.enqueue(new(type_="x", queue="mail", delay=3600))
    assert broker.get(made["retry_due"]).state == "retrying" and broker.get(made["backoff"]).state == "retrying"

    def selected(**spec):
        f = JobFilter(**spec)
        got = ids(all_pages(broker, f, limit=1))
        assert ids(all_pages(broker, f, limit=50, order="oldest")) == got[::-1]
        count = broker.count(f)
        assert count.exact and count.n == len(got)
        return sorted(by_name[i] for i in got)

    by_name = {v: k for k, v in made.items()}
    stats = broker.stats(Q)
    assert (stats["default"].scheduled, stats["mail"].scheduled) == (2, 1)
    assert selected(state="scheduled") == ["backoff", "later", "later_mail"]
    assert selected(state="scheduled", queue="default") == ["backoff", "later"]
    assert selected(state="scheduled", type="x") == ["later_mail"]
    assert selected(state=["scheduled", "dead"]) == ["backoff", "dead", "later", "later_mail"]
    assert selected(state=["queued", "scheduled"]) == ["backoff", "due", "later", "later_mail"]
    assert selected(state="scheduled", error="gateway") == ["backoff"]
    assert selected(state=["scheduled", "dead"], error="slow") == ["backoff", "dead"]
    # Beside both states it is part of, it selects nothing more, and adds no OR to the query.
    assert JobFilter(state=["queued", "scheduled", "retrying"]).state == ("queued", "retrying")
    assert selected(state=["queued", "retrying", "scheduled"]) == ["backoff", "due", "later", "later_mail", "retry_due"]
