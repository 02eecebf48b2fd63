"""Redis-specific behaviour of the Redis broker (the contract is in test_broker_conformance)."""
import dataclasses
import os
import select
import stat
import urllib.parse

import pytest

from supervisor.backends import open_broker
from supervisor.errors import BadInput, BrokerError
from supervisor.model import NewJob, TypeLimits, error_info

from .util import wait_for

redis = pytest.importorskip("redis")
from redis.crc import key_slot  # noqa: E402

pytestmark = pytest.mark.services


def new(**kw):
    return NewJob("t", {"n": 1}, **kw)


def prefix_of(url):
    return dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(url).query))["prefix"]


@pytest.fixture
def rb(redis_url):
    b = open_broker(redis_url)
    b.migrate()
    yield b
    b.close()


@pytest.fixture
def raw(redis_url):
    client = redis.Redis.from_url(redis_url.split("?")[0], decode_responses=True)
    yield client
    client.close()


def readable(fd):
    return bool(select.select([fd], [], [], 0)[0])


def test_wakeup_fd_turns_readable_after_an_enqueue_elsewhere(rb, redis_url):
    fd = rb.wakeup_fd()
    assert stat.S_ISSOCK(os.fstat(fd).st_mode)  # an open socket: the pub/sub connection
    wait_for(lambda: readable(fd), timeout=5, message="subscribe confirmation")
    rb.drain_wakeups()
    assert not readable(fd)
    with open_broker(redis_url) as producer:
        producer.enqueue(new())
    wait_for(lambda: readable(fd), timeout=5, message="wake-up after enqueue")
    rb.drain_wakeups()
    assert not readable(fd)
    assert rb.wakeup_fd() == fd  # one subscription, reused
    # A delayed job is not due: no wake-up; a release makes one due: wake-up.
    with open_broker(redis_url) as producer:
        producer.enqueue(new(delay=60))
        job = producer.claim(["default"], 1, 30, "w")[0]
        assert not readable(fd)
        producer.release(job.lease)
    wait_for(lambda: readable(fd), timeout=5, message="wake-up after release")
    rb.drain_wakeups()


def test_keys_carry_one_hash_tag_per_queue(rb, raw, redis_url):
    prefix = prefix_of(redis_url)
    job_id = rb.enqueue(new(idempotency_key="k"))
    rb.enqueue(new(delay=60))
    rb.enqueue(new(queue="mail"))
    leased = rb.claim(["default"], 1, 30, "w")[0]
    rb.enqueue(new())
    rb.ack(leased.lease)
    dead = rb.claim(["default"], 1, 30, "w")[0]
    rb.dead(dead.lease, "permanent", error_info("permanent"))
    rb.enqueue(new())
    rb.enqueue(new(idempotency_key="k2"))
    assert len(rb.claim(["default"], 1, 30, "w")) == 1
    keys = set(raw.scan_iter(match=f"{prefix}*"))
    tag = f"{prefix}:{{default}}:"
    assert {tag + k for k in ("ready", "delayed", "leased", "dead", "done", "idem")} <= keys
    assert f"{tag}j:{job_id}" in keys
    assert f"{prefix}:queues" in keys and raw.smembers(f"{prefix}:queues") == {"default", "mail"}
    default_keys = [k for k in keys if k.startswith(tag)]
    assert {key_slot(k.encode()) for k in default_keys} == {key_slot(b"default")}
    assert {key_slot(k.encode()) for k in keys if "{mail}" in k} == {key_slot(b"mail")}


def test_an_enqueue_sends_one_command_its_script_names_the_queue(rb, raw, redis_url):
    """An enqueue sent ``SADD P:queues`` before its script: one more command to pack, send and
    read back, about a tenth of a single enqueue's CPU. The script adds the queue itself, given
    ``P:queues`` as one more key: one command a call, and the queue is known from its first job."""
    prefix = prefix_of(redis_url)
    rb.enqueue(new())  # the scripts loaded: no NOSCRIPT round below
    rb.enqueue_once(new(idempotency_key="warm"))
    end = f"{prefix}-end"
    with raw.monitor() as monitor:
        rb.enqueue(new(queue="fresh"))
        rb.enqueue_many([new(queue="mail"), new(queue="fresh"), new(queue="other")])
        rb.enqueue_once(new(queue="once", idempotency_key="k"))
        raw.echo(end)
        sent = []
        for command in monitor.listen():
            if end in command["command"]:
                break
            if prefix in command["command"] and command.get("client_type") != "lua":
                sent.append(command["command"].split()[0])
    # 1, one per queue of the batch (3), and enqueue_once's 2 (its key's queue across queues, once.py).
    assert sent == ["EVALSHA"] * 6, sent
    assert raw.smembers(f"{prefix}:queues") == {"default", "fresh", "mail", "other", "once"}
    from supervisor.client import Client

    with Client.from_url(redis_url) as client:  # a workflow's jobs: enqueue_flow.lua
        parent, child = client.chain([("t", {"n": 1}, {"queue": "flow"}), ("t", {"n": 2}, {"queue": "flow"})])
    assert raw.smembers(f"{prefix}:queues") == {"default", "fresh", "mail", "other", "once", "flow"}
    with open_broker(redis_url) as other:  # no cache of ours: found through P:queues
        assert other.get(child).queue == "flow" and other.get(parent).queue == "flow"


def test_done_jobs_expire_after_done_ttl(redis_url, raw):
    """Prune deletes a done job at done_ttl; its hash's own TTL is the backstop, DONE_GRACE later
    (an hour, or done_ttl again when that is shorter: tests/test_redis_search.py)."""
    with open_broker(redis_url + "&done_ttl=120") as b:
        job_id = b.enqueue(new())
        b.ack(b.claim(["default"], 1, 30, "w")[0].lease)
        ttl = raw.ttl(f"{prefix_of(redis_url)}:{{default}}:j:{job_id}")
        assert 120 < ttl <= 240
        assert b.stats(["default"])["default"].done == 1
    with open_broker(redis_url) as b:  # default: a week, and an hour
        job_id = b.enqueue(new())
        b.ack(b.claim(["default"], 1, 30, "w")[0].lease)
        assert 7 * 86400 < raw.ttl(f"{prefix_of(redis_url)}:{{default}}:j:{job_id}") <= 7 * 86400 + 3600


@pytest.mark.parametrize("query", ["bogus=1", "done_ttl=0", "done_ttl=soon", "prefix={x}"])
def test_bad_url_options_are_broker_errors(redis_url, query):
    with pytest.raises(BrokerError) as err:
        open_broker(redis_url + "&" + query)
    assert "\n" not in str(err.value)


def test_redis_options_pass_through(redis_url):
    with open_broker(redis_url + "&socket_timeout=5&health_check_interval=10") as b:
        assert b.enqueue(new())


def test_connection_refused_is_a_broker_error():
    b = open_broker("redis://127.0.0.1:1/0?prefix=nowhere")
    for call in (b.migrate, b.now, lambda: b.enqueue(new()), lambda: b.claim(["default"], 1, 30, "w"),
                 lambda: b.stats(["default"]), b.wakeup_fd):
        with pytest.raises(BrokerError) as err:
            call()
        assert "127.0.0.1:1" in str(err.value)
    b.close()


def test_queue_names_with_braces_are_refused(rb):
    with pytest.raises(BadInput):
        rb.enqueue(new(queue="a{b}"))


def test_a_claim_naming_a_bad_queue_leases_nothing(rb):
    job_id = rb.enqueue(new())
    for limits in (None, {"t": TypeLimits(max_concurrency=5)}):
        with pytest.raises(BadInput, match="'a{b}' is not a valid queue name"):
            rb.claim(["default", "a{b}"], 5, 30, "w", limits)
        assert rb.get(job_id).state == "queued" and rb.get(job_id).attempt == 0


def test_priority_levels_and_oldest_ready_age(rb):
    old = rb.enqueue(new(priority=-3))
    wait_for(lambda: rb.stats(["default"])["default"].oldest_ready_age >= 0.2, timeout=10,
             message="the first job to age")
    ids = [rb.enqueue(new(priority=p)) for p in (7, 0, 7, 2)]
    stats = rb.stats(["default"])["default"]
    assert stats.ready == 5 and stats.oldest_ready_age >= 0.2  # found under the lowest priority
    got = [j.id for j in rb.claim(["default"], 5, 30, "w")]
    assert got == [ids[0], ids[2], ids[3], ids[1], old]


def test_lost_script_cache_is_reloaded(rb):
    for script in rb.scripts.values():
        script.sha = "0" * 40  # as if the server's script cache were flushed
    assert len(rb.enqueue_many([new(), new()])) == 2
    for script in rb.scripts.values():
        script.sha = "0" * 40
    job = rb.claim(["default"], 1, 30, "w")[0]
    rb.ack(job.lease)


def test_another_instance_finds_and_finishes_a_job(rb, redis_url):
    job_id = rb.enqueue(new(queue="mail"))
    job = rb.claim(["mail"], 1, 30, "w")[0]
    with open_broker(redis_url) as other:
        assert other.get(job_id).state == "running"
        assert other.extend([job.lease], 60) == []
        other.ack(job.lease, {"ok": 1})
        assert other.get(job_id).result == {"ok": 1}


def test_idempotency_keys_dedup_per_queue(rb):
    a = rb.enqueue(new(idempotency_key="k"))
    assert rb.enqueue(new(idempotency_key="k")) == a
    assert rb.enqueue(new(queue="other", idempotency_key="k")) != a


def test_replay_refuses_a_key_taken_meanwhile(rb):
    first = rb.enqueue(new(idempotency_key="k"))
    job = rb.claim(["default"], 1, 30, "w")[0]
    rb.dead(job.lease, "permanent", error_info("permanent"))
    second = rb.enqueue(new(idempotency_key="k"))
    assert second != first
    with pytest.raises(BadInput):
        rb.dlq_replay([first])
    assert rb.get(first).state == "dead"


def test_dlq_across_queues_newest_first(rb):
    ids = []
    for queue in ("a", "b", "a"):
        ids.append(rb.enqueue(new(queue=queue)))
        job = rb.claim([queue], 1, 30, "w")[0]
        rb.dead(job.lease, "permanent", error_info("permanent"))
    assert [j.id for j in rb.dlq_list()] == ids[::-1]
    assert [j.id for j in rb.dlq_list(limit=2)] == ids[:0:-1]
    assert rb.dlq_purge(ids) == 3 and rb.dlq_list() == []


def test_prune_works_in_batches(rb, monkeypatch):
    import supervisor.backends.redis.prune as module

    monkeypatch.setattr(module, "BATCH", 7)
    rb.enqueue_many([new() for _ in range(20)])
    for job in rb.claim(["default"], 20, 30, "w"):
        rb.ack(job.lease)
    assert rb.stats(["default"])["default"].done == 20
    assert rb.prune(0) == 20
    assert rb.stats(["default"])["default"].done == 0


def test_text_round_trips_exactly(rb):
    odd = 'é 😀 "q" \\ / \n\t\x00 ]}'
    name = odd.replace("\x00", "")  # no broker stores a NUL in a name or a payload (PostgreSQL cannot)
    job_id = rb.enqueue(NewJob(name, {name: [name, 1.5, 2**60, None, True]}, resource_id=name, idempotency_key=name,
                               trace_id=name))
    assert rb.enqueue(NewJob("t", {}, idempotency_key=name)) == job_id
    job = rb.claim(["default"], 1, 30, odd)[0]
    assert (job.type, job.payload, job.resource_id, job.idempotency_key, job.trace_id, job.owner) == (
        name, {name: [name, 1.5, 2**60, None, True]}, name, name, name, odd)
    assert job.history[0]["owner"] == odd
    stored = rb.get(job_id)  # what the broker keeps, not only what claim returned
    assert (stored.type, stored.payload, stored.resource_id, stored.idempotency_key, stored.trace_id, stored.owner,
            stored.history[0]["owner"]) == (name, {name: [name, 1.5, 2**60, None, True]}, name, name, name, odd, odd)
    rb.ack(job.lease, {odd: odd}, {odd: odd})
    done = rb.get(job_id)
    assert done.result == {odd: odd} and done.history[0][odd] == odd and done.history[0]["owner"] == odd


def test_a_fresh_instance_extends_leases_it_did_not_claim(rb, redis_url):
    rb.enqueue_many([new(), new(queue="mail")])
    jobs = rb.claim(["default", "mail"], 2, 30, "w")
    gone = type(jobs[0].lease)("job_unknown", 1)
    with open_broker(redis_url) as heartbeat:
        assert heartbeat.extend([jobs[0].lease, gone, jobs[1].lease], 60) == [gone]
        assert all(heartbeat.get(j.id).lease_until > heartbeat.now() + 50 for j in jobs)


def test_a_lost_wakeup_connection_is_reported_and_replaced(rb, redis_url, raw):
    fd = rb.wakeup_fd()
    wait_for(lambda: readable(fd), timeout=5, message="subscribe confirmation")
    rb.drain_wakeups()
    # Kill exactly our subscriber connection (found by its local address).
    here = "%s:%d" % rb._wakeup_sock.getsockname()[:2]
    (client_id,) = [c["id"] for c in raw.client_list(_type="pubsub") if c["addr"] == here]
    raw.client_kill_filter(_id=client_id)
    wait_for(lambda: readable(fd), timeout=5, message="EOF on the killed connection")
    with pytest.raises(BrokerError):
        rb.drain_wakeups()
    fd = rb.wakeup_fd()
    wait_for(lambda: readable(fd), timeout=5, message="subscribe confirmation")
    rb.drain_wakeups()
    with open_broker(redis_url) as producer:
        producer.enqueue(new())
    wait_for(lambda: readable(fd), timeout=5, message="wake-up on the new connection")


def test_waits_one_after_another_subscribe_on_one_connection_and_a_lost_one_is_replaced(rb, raw):
    job_id = rb.enqueue(new())
    assert rb.wait(job_id, 0.01) is None
    pid, kept = rb._kept_pubsub
    assert pid == os.getpid()
    assert rb.wait(job_id, 0.01) is None
    assert rb._kept_pubsub[1] is kept, "the second wait opened a connection of its own"
    here = "%s:%d" % kept.connection._sock.getsockname()[:2]
    (client_id,) = [c["id"] for c in raw.client_list() if c["addr"] == here]
    raw.client_kill_filter(_id=client_id)  # a restart, an idle timeout
    assert rb.wait(job_id, 0.01) is None
    assert all(c["addr"] != here for c in raw.client_list())


# -- claim's compact rows ----------------------------------------------------------------

def test_claim_rows_name_the_fields_the_decoder_expects_in_its_order():
    """claimed_row (_common.lua) and fields.from_claim share a field order: the Lua list is
    read here, so a field added to one side only fails this test, not a claim in production."""
    import re

    from supervisor.backends.redis import fields, scripts

    with open(os.path.join(scripts.LUA_DIR, "_common.lua"), encoding="utf-8") as f:
        listed = re.search(r"local ROW_FIELDS = \{(.*?)\}", f.read(), re.S).group(1)
    assert tuple(re.findall(r"'(\w+)'", listed)) == fields.ROW_FIELDS


def test_a_claimed_job_is_the_job_get_reads_with_every_field_set(rb):
    """Every field a claim can carry, through the compact row: a retried job with a key,
    a resource, a timeout, an expiry, a priority and an error, claimed again."""
    job_id = rb.enqueue(NewJob("t", {"n": 1, "s": "é/\"x\""}, resource_id="r:1", idempotency_key="k:1", timeout=2.5,
                               expires_in=600, priority=3, max_attempts=4, trace_id="0af7651916cd43dd8448eb211c80319c"))
    (first,) = rb.claim(["default"], 1, 30, "w1")
    rb.retry(first.lease, rb.now(), error_info("exception", "ValueError", "no", "tb"), {"host": "h", "pid": 7})
    (again,) = rb.claim(["default"], 1, 30, "w2")
    assert again.id == job_id and again.attempt == 2 and again.owner == "w2"
    assert again.error["class"] == "ValueError" and again.first_failure_at is not None
    assert [entry.get("outcome") for entry in again.history] == ["retry", None]  # the open attempt last
    assert again == rb.get(job_id)


# -- claims over several queues, expiry index ---------------------------------------------

@pytest.mark.parametrize("limits", [None, {"t": TypeLimits(max_concurrency=50)}], ids=["plain", "limited"])
def test_a_claim_keeps_the_jobs_it_leased_when_a_later_queues_call_fails(rb, raw, redis_url, limits):
    """One script call per queue: a failure at the second queue (its Cluster node failing over;
    here an ACL that refuses that queue's keys) must not throw away the first queue's jobs,
    leased already. They would stay leased to nobody, an attempt spent: a job on its last
    attempt dead-lettered ``lease_expired`` without ever running."""
    ids = rb.enqueue_many([new(queue="healthy", max_attempts=1) for _ in range(4)])
    sick = rb.enqueue(new(queue="sick"))
    prefix = prefix_of(redis_url)
    user, password = f"{prefix}-claimer", f"pw-{prefix}"
    raw.execute_command("ACL", "SETUSER", user, "on", f">{password}", "+@all", "-@dangerous", "+script|load",
                        f"~{prefix}:{{healthy}}:*", f"~{prefix}:queues", "&*")
    parts = urllib.parse.urlsplit(redis_url)
    limited = parts._replace(netloc=f"{user}:{password}@{parts.hostname}:{parts.port or 6379}").geturl()
    try:
        with open_broker(limited) as claimer:
            jobs = claimer.claim(["healthy", "sick"], 10, 30, "w", limits)
            assert sorted(j.id for j in jobs) == sorted(ids)  # returned, not lost with the error
            assert claimer.ack_many([(j.lease, None, None) for j in jobs]) == []
            with pytest.raises(BrokerError):
                claimer.claim(["sick", "healthy"], 10, 30, "w", limits)  # nothing leased: the failure is raised
        assert [rb.get(i).state for i in ids] == ["done"] * 4
        assert (rb.get(sick).state, rb.get(sick).attempt) == ("queued", 0)
    finally:
        raw.execute_command("ACL", "DELUSER", user)


@pytest.mark.parametrize("limits", [None, {"t": TypeLimits(max_concurrency=50)}], ids=["plain", "limited"])
def test_a_started_job_leaves_the_expiry_index_until_a_retry_or_release_puts_it_back(rb, raw, redis_url, limits):
    """Only a job not started can expire. A claimed job's entry in the queue's expiry index would
    otherwise stay after the job finished, until its expires_at (up to ten years away) came
    round: one entry per finished job, growing for as long as the daemon runs."""
    index = f"{prefix_of(redis_url)}:{{default}}:expiring"
    rb.enqueue_many([new(expires_in=30 * 86400) for _ in range(4)])
    assert raw.zcard(index) == 4
    done, dead, released, retried = rb.claim(["default"], 4, 30, "w", limits)
    assert raw.zcard(index) == 0
    rb.ack_many([(done.lease, None, None)])
    rb.dead(dead.lease, "failed", error_info("exception", "E", "m", "tb"))
    rb.release(released.lease)
    rb.retry(retried.lease, rb.now() + 60, error_info("exception", "E", "m", "tb"))
    assert sorted(raw.zrange(index, 0, -1)) == sorted([released.id, retried.id])  # unfinished: may still expire
    rb.claim(["default"], 1, 30, "w", limits)  # the released one
    raw.zadd(index, {done.id: 2 ** 52})  # what a claim of a version before this fix left behind
    rb.prune(0)
    assert raw.zrange(index, 0, -1) == [retried.id]  # the pruned job's entry went with it


def test_an_id_the_caller_chose_may_not_name_a_job_of_another_queue(rb):
    """Each queue's keys stand apart: without a check, a second job under the same id in
    another queue is stored beside the first, and a lease of one could ack the other."""
    assert rb.enqueue(NewJob("t", {"n": 1}, id="job_order_42", queue="a")) == "job_order_42"
    for enqueue in (rb.enqueue, lambda job: rb.enqueue_many([job]),
                    lambda job: rb.enqueue_once(dataclasses.replace(job, idempotency_key="k"))):
        with pytest.raises(BadInput, match="job id 'job_order_42' is taken by a job of queue 'a'"):
            enqueue(NewJob("t", {"n": 2}, id="job_order_42", queue="b"))
    assert rb.stats(["b"])["b"].ready == 0
    assert rb.enqueue(NewJob("t", {"n": 1}, id="job_order_42", queue="a")) == "job_order_42"  # a resend: the same job
    (job,) = rb.claim(["a"], 5, 30, "w")
    assert (job.id, job.payload) == ("job_order_42", {"n": 1})


def test_a_heartbeat_asking_for_its_own_queues_reads_no_other_queue(rb, raw, redis_url):
    """Producers may name a queue per tenant. The heartbeat's ``paused()`` read every
    queue ever named, each beat: 50,000 names cost 0.6 s a beat, most of a core on an idle
    supervisor, and renewals fell behind. Asked for the queues it serves, it reads those."""
    prefix = prefix_of(redis_url)
    raw.sadd(f"{prefix}:queues", *[f"tenant{i}" for i in range(3000)])
    rb.pause("tenant7", by="ops")
    rb.pause("default", by="ops")
    end = f"{prefix}-end"
    with raw.monitor() as monitor:
        answer = rb.paused(["default"])
        raw.echo(end)
        seen = []
        for command in monitor.listen():
            if end in command["command"]:
                break
            if prefix in command["command"]:
                seen.append(command["command"])
    assert list(answer) == ["default"]
    assert len(seen) == 1 and seen[0].startswith("GET ") and "{default}" in seen[0], seen
    assert set(rb.paused()) == {"default", "tenant7"}  # asked for every queue: every queue


def test_the_heartbeats_instance_keeps_queue_entries_only_for_the_leases_it_holds(rb, redis_url, monkeypatch):
    """The heartbeat renews on a broker instance of its own, which never sees the acks. It
    kept the queue of every job it ever renewed (11 MiB at the bound), then emptied the
    whole cache at once, and each lease then held cost a probe of every queue ever named."""
    from supervisor.backends.redis import locate

    beat = open_broker(redis_url)  # the heartbeat's instance
    try:
        rb.enqueue_many([new() for _ in range(30)])
        leases = [job.lease for job in rb.claim(["default"], 30, 30, "w")]
        assert beat.renew(leases, 30).lost == []
        assert set(beat._locator.known) == {lease.job_id for lease in leases}
        for lease in leases[:20]:
            rb.ack(lease)
        assert beat.renew(leases[20:], 30).lost == []
        assert set(beat._locator.known) == {lease.job_id for lease in leases[20:]}
        monkeypatch.setattr(locate, "WHERE_MAX", 8)
        for i in range(20):
            beat._locator.remember(f"job_x{i}", "default")
        assert 6 <= len(beat._locator.known) <= 8 and "job_x19" in beat._locator.known  # trimmed, never emptied
    finally:
        beat.close()


def test_enqueue_once_stopped_between_its_two_slots_is_finished_by_the_next_caller(rb):
    """The key's record (its own slot) is written before the job (the queue's slot): a caller that
    stops in between leaves the queue recorded, and the next caller enqueues there, once."""
    key = "cron:report:2026-01-01T00:00:00Z"
    rb._once_queue(NewJob("t", {}, queue="default", idempotency_key=key).validate())  # then it stopped
    assert rb.enqueue_once(NewJob("t", {}, queue="b", idempotency_key=key)) is not None
    assert rb.enqueue_once(NewJob("t", {}, queue="default", idempotency_key=key)) is None
    stats = rb.stats(["default", "b"])
    assert (stats["default"].ready, stats["b"].ready) == (1, 0)


def test_enqueue_once_stopped_before_its_job_leaves_the_tick_to_its_scheduler(rb, monkeypatch):
    """A schedule's newest tick was recorded in the first step, before the job existed: a
    supervisor that stopped between the two left the tick recorded and never enqueued, and the
    scheduler, which looks back to the newest recorded tick only, never ran it."""
    from supervisor.scheduler import Schedule, Scheduler, tick_key

    t0 = 1_772_323_200.0  # 2026-03-01 00:00 UTC
    new_scheduler = lambda: Scheduler({"s": Schedule("s", "*/5 * * * *", "T", {}, queue="q")},  # noqa: E731
                                      lambda sc, key: NewJob("T", {}, queue="q", idempotency_key=key))
    first = new_scheduler()
    first.tick(rb, now=t0 + 1)
    assert [job_id is not None for _, _, job_id in first.tick(rb, now=t0 + 301)] == [True]  # 00:05
    def stopped(calls):
        raise SystemExit("the supervisor stopped after the key's step, before the job's")

    with monkeypatch.context() as m:
        m.setattr(rb, "_run_enqueues", stopped)
        with pytest.raises(SystemExit):
            first.tick(rb, now=t0 + 601)
    again = new_scheduler().tick(rb, now=t0 + 660)
    assert [(tick, job_id is not None) for _, tick, job_id in again] == [(t0 + 600, True)]  # 00:10 runs
    assert rb.stats(["q"])["q"].ready == 2
    assert rb.last_tick_key("s") == tick_key("s", t0 + 600)


def test_enqueue_once_sent_to_its_keys_queue_stores_the_payload_as_checked(rb):
    """The job moved to the queue its key was recorded for is a copy that keeps what ``validate``
    encoded: a payload the caller changed in place afterwards is not what is stored (a
    ``dataclasses.replace`` copy encoded the dict again, as it was by then)."""
    key = "cron:moved"
    rb._once_queue(NewJob("t", {}, queue="default", idempotency_key=key).validate())  # then it stopped
    job = NewJob("t", {"amount": 10}, queue="b", idempotency_key=key).validate()
    job.payload["amount"] = 10_000
    job_id = rb.enqueue_once(job)
    assert (rb.get(job_id).queue, rb.get(job_id).payload, job.queue) == ("default", {"amount": 10}, "b")


def test_a_failing_count_an_earlier_release_left_wrong_never_reopens_a_child_a_parent_still_fails(rb, raw, redis_url):
    """Supervisors of an earlier release sharing the broker in a rolling upgrade change a child's
    parent fields without its 'failing' count. A count that says "none failing" is checked
    against the parents before the child reopens: it ran with a dead on="success" parent."""
    a, b = rb.enqueue_many([NewJob("m", {"i": i}) for i in range(2)])
    child = rb.enqueue(NewJob("cb", {}, depends_on=[a, b]))
    key = f"{prefix_of(redis_url)}:{{default}}:j:{child}"
    jobs = {job.id: job for job in rb.claim(["default"], 2, 30, "w")}
    for member in (a, b):
        rb.dead(jobs[member].lease, "permanent", error_info("permanent"))
    raw.hset(key, "failing", 1)  # what an earlier release's end of b leaves: it counted a only
    rb.dlq_replay([a])
    assert (rb.get(child).state, raw.hget(key, "failing")) == ("cancelled", "1")  # b is still dead
    rb.ack(rb.claim(["default"], 1, 30, "w")[0].lease)
    assert rb.claim(["default"], 5, 30, "w") == []


def test_a_workflow_child_stored_before_its_failing_count_is_counted_at_its_first_reopen(rb, raw, redis_url):
    """A child's 'failing' count (its on="success" parents that failed) lets a reopen skip
    reading its other parents. A child stored by an older version has none: the parents'
    ends must not count from nothing, and its first reopen counts them from its parents."""
    members = rb.enqueue_many([NewJob("m", {"i": i}) for i in range(3)])
    callback = rb.enqueue(NewJob("cb", {}, depends_on=members))
    key = f"{prefix_of(redis_url)}:{{default}}:j:{callback}"
    assert raw.hdel(key, "failing") == 1
    jobs = {job.id: job for job in rb.claim(["default"], 3, 30, "w")}
    for member in members[:2]:
        rb.dead(jobs[member].lease, "permanent", error_info("permanent"))
    assert (rb.get(callback).state, raw.hget(key, "failing")) == ("cancelled", None)
    rb.dlq_replay(members[:1])
    assert (rb.get(callback).state, raw.hget(key, "failing")) == ("cancelled", "1")  # the other dead member
    rb.dlq_replay(members[1:2])
    assert (rb.get(callback).state, rb.get(callback).pending, raw.hget(key, "failing")) == ("waiting", 3, "0")
    again = rb.claim(["default"], 3, 30, "w")
    rb.ack_many([(job.lease, None, None) for job in again + [jobs[members[2]]]])
    assert [job.id for job in rb.claim(["default"], 3, 30, "w")] == [callback]


def test_a_job_id_holding_nul_from_an_older_release_is_acked_in_a_batch_without_shifting_the_others(
        rb, monkeypatch):
    # ack_many sends its batch as one argument of NUL-ended values: such an id, stored by a
    # producer from before ids were checked for NUL, cut the batch in the wrong places, and the
    # jobs after it were reported lost (run again) while it never could be acked.
    import re

    from supervisor import model

    with monkeypatch.context() as older:
        older.setattr(model, "UNSTORABLE", re.compile("(?!)"))  # the older release's check: none
        ids = [rb.enqueue(NewJob("t", {"i": i}, id=x)) for i, x in enumerate(["first", "legacy\0id", "third"])]
    jobs = sorted(rb.claim(["default"], 3, 30, "w"), key=lambda j: j.payload["i"])
    assert [j.id for j in jobs] == ids
    assert rb.ack_many([(j.lease, {"i": j.payload["i"]}, {"pid": 7}) for j in jobs]) == []
    for i, job_id in enumerate(ids):
        stored = rb.get(job_id)
        assert (stored.state, stored.result, stored.history[-1]["pid"]) == ("done", {"i": i}, 7)


def test_ack_many_splits_a_batch_of_large_results_into_calls_below_the_argument_limit(rb, monkeypatch):
    # One argument per call: results of up to 64 MiB each could add up past Redis's 512 MB per
    # argument (the call failed as if the broker were unreachable, every ack of the batch kept).
    from supervisor.backends import redis as redis_backend

    monkeypatch.setattr(redis_backend, "ACK_ARGUMENT_BYTES", 2000)
    ids = [rb.enqueue(NewJob("t", {"i": i})) for i in range(5)]
    jobs = sorted(rb.claim(["default"], 5, 30, "w"), key=lambda j: j.payload["i"])
    sent = []
    run_many = rb._run_many
    monkeypatch.setattr(rb, "_run_many", lambda calls, **kw: sent.extend(calls) or run_many(calls, **kw))
    assert rb.ack_many([(j.lease, "x" * 900 + str(j.payload["i"]), None) for j in jobs]) == []
    # A call closes at the first job past the limit: 3 + 2 jobs of ~960 characters.
    assert len(sent) == 2 and all(len(args[1]) < 2000 + 1000 for _, _, args in sent)
    assert [rb.get(i).result for i in ids] == ["x" * 900 + str(i) for i in range(5)]


def test_every_script_defines_every_prelude_name_it_uses():
    # A script carries only the prelude statements it uses (each costs the server time on every
    # call): a name dropped wrongly would fail only when its path runs ("attempt to access
    # nonexistent global"). Checked here for every script and name, by a reading of its own.
    import re

    from supervisor.backends.redis import scripts

    def defined(text):
        names = set(re.findall(r"^local function (\w+)", text, re.M))
        for group in re.findall(r"^local ([\w, ]+?)\s*(?:=|$)", text, re.M):
            names |= {n.strip() for n in group.split(",")}
        return names

    everything = ""
    for prelude in scripts.PRELUDE:
        with open(os.path.join(scripts.LUA_DIR, prelude), encoding="utf-8") as f:
            everything += f.read()
    shared = defined(everything)
    assert {"NOW", "secs", "settle", "reopen", "EXPIRING", "index_job"} <= shared
    assigned = set(re.findall(r"^(\w+) = function", everything, re.M))  # declared first, defined later
    assert assigned == {"settle", "reopen"}
    for name, source in scripts.sources().items():
        used = set(re.findall(r"[A-Za-z_]\w*", source)) & shared
        assert used <= defined(source), (name, sorted(used - defined(source)))
        assert all(f"\n{n} = function" in source for n in used & assigned), name
        assert len(source) < len(everything) + 30000  # no prelude twice
    assert len(scripts.sources()["enqueue"]) < len(everything) / 2  # and a lean enqueue


@pytest.mark.parametrize("line", ["redis.replicate_commands()", "if FLAG then", "  indented_before_any()"])
def test_a_prelude_line_that_defines_nothing_is_refused_not_dropped(line):
    # A call at the top of a prelude, run for its effect, names nothing a script could use:
    # the reader would keep it only with the statement before it, or drop it.
    from supervisor.backends.redis import scripts

    text = f"{line}\nlocal function f()\n  return 1\nend\n" if line.startswith(" ") else \
        f"local A = 1\n{line}\nlocal function f()\n  return A\nend\n"
    with pytest.raises(ValueError, match="no statement this reader knows"):
        scripts.statements(text)
    ok = scripts.statements("-- a comment\nlocal A = {\n  1,\n}\n\nlocal function f()\n  return A\nend\n")
    assert [names for names, _ in ok] == [{"A"}, {"f"}]
    assert scripts.used(ok, "return f()").count("local A") == 1


def test_a_renewal_looks_for_its_jobs_in_the_served_queues_before_every_queue_ever_named(redis_url, monkeypatch):
    """The heartbeat renews on a broker of its own, which never claimed the jobs: it looks their
    queues up. P:queues keeps every queue name producers ever used, and the lookup was a command
    per lease and name: with 20,000 names one renewal took a minute (longer than a lease) and
    the master's memory grew by the pipeline's gigabyte. The served queues go first now."""
    from supervisor.backends.redis.locate import Locator

    with open_broker(redis_url) as b:
        b.enqueue_many([new() for _ in range(20)])
        b.enqueue(new(queue="elsewhere"))
        leases = [j.lease for j in b.claim(["default", "elsewhere"], 21, 30, "w")]
        b.r.sadd(b.keys.queues, *[f"named-{i}" for i in range(2000)])  # by producers, over months
    probed = []
    real = Locator._probe

    def counted(self, job_ids, queues, fetch):
        probed.append(len(job_ids) * len(queues))
        return real(self, job_ids, queues, fetch)

    monkeypatch.setattr(Locator, "_probe", counted)
    with open_broker(redis_url) as heartbeats:  # no cache of ours
        renewal = heartbeats.renew(leases, 30, queues=["default"])
    assert renewal.lost == []
    # 21 in the served queue; the one of another queue, not found there, in every other queue.
    assert probed == [21, 1 * (2000 + 1)]


def test_the_key_names_kept_per_queue_are_bounded(redis_url):
    """Prune walks every queue ever named (P:queues), and each name's key names were kept for good."""
    from supervisor.backends.redis.keys import KEPT_QUEUES

    with open_broker(redis_url) as b:
        b.r.sadd(b.keys.queues, *[f"named-{i}" for i in range(KEPT_QUEUES * 2 + 10)])
        b.prune(3600)
        assert 0 < len(b.keys._scripts) <= KEPT_QUEUES
        assert b.keys.for_scripts("default")[1][0].endswith(":{default}:j:")


def test_prune_drops_the_resource_fields_of_exclusive_jobs_no_longer_running(rb, raw, monkeypatch):
    """An exclusive type's hash gains a field per resource id leased, for as long as the daemon
    runs; prune drops the fields whose job is not running any more, a batch a call, and keeps
    the one a running job holds, which still holds its resource back."""
    from supervisor.backends.redis import prune

    monkeypatch.setattr(prune, "BATCH", 100)
    limits = {"x": TypeLimits(exclusive=True)}
    n = 700  # more than a small hash's 128 to 512 fields: HSCAN then steps through it
    rb.enqueue_many([NewJob("x", {"i": i}, resource_id=f"r{i}") for i in range(n)])
    leased = rb.claim(["default"], n, 30, "w", limits=limits)
    assert len(leased) == n
    running = leased[::2]  # half of them, spread over the hash: the sweep must go on past them
    for job in leased[1::2]:
        rb.ack(job.lease)
    base = rb.keys.for_scripts("default")[1][0][:-len("j:")]
    excl = base + "excl:x"
    assert raw.hlen(excl) == n and raw.smembers(base + "excls") == {"x"}
    sizes = []
    for _ in range(20):
        rb.prune(3600)  # nothing old enough to delete: the sweep alone
        sizes.append(raw.hlen(excl))
    assert n - 150 < sizes[0] < n, sizes  # about a batch looked at a call, not the whole hash
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] == len(running), sizes
    assert raw.hgetall(excl) == {job.resource_id: job.id for job in running}
    waiting = rb.enqueue(NewJob("x", {}, resource_id=running[0].resource_id))
    assert rb.claim(["default"], 5, 30, "w", limits=limits) == []  # the resource is still held
    assert rb.ack_many([(job.lease, None, None) for job in running]) == []
    for _ in range(20):
        rb.prune(3600)
    assert not raw.exists(excl) and raw.smembers(base + "excls") == set()
    assert [job.id for job in rb.claim(["default"], 5, 30, "w", limits=limits)] == [waiting]


def test_prune_goes_a_chunk_of_queues_a_round_trip_and_shares_its_budget_among_them(rb, monkeypatch):
    """``P:queues`` keeps every queue name ever used, and prune runs in the master's loop: one
    round trip a name made a prune over 20,000 names take 3 s. The calls go ``CHUNK`` queues a
    round trip, and a budget still bounds what one prune deletes."""
    from supervisor.backends.redis import prune

    queues = [f"q{i:03d}" for i in range(150)]
    # A done, a cancelled and an expired job in each queue: one prune call reads the three
    # together up to its share (each of the three up to it made a call delete 3 shares).
    done = rb.enqueue_many([NewJob("t", {}, queue=q) for q in queues])
    cancelled = rb.enqueue_many([NewJob("t", {}, queue=q, delay=3600) for q in queues])
    assert set(rb.cancel(cancelled, "test", "no longer wanted").values()) == {"cancelled"}
    expiring = rb.enqueue_many([NewJob("t", {}, queue=q, expires_in=0.01) for q in queues])
    wait_for(lambda: rb.now() > rb.get(expiring[-1]).expires_at, message="the jobs' expiry")
    acked = 0
    while acked < 150:
        got = rb.claim(queues, 100, 30, "w")
        assert got and rb.ack_many([(job.lease, None, None) for job in got]) == []
        acked += len(got)
    assert {job.state for job in map(rb.get, done + expiring)} == {"done", "expired"}
    last_ack = rb.now()
    wait_for(lambda: rb.now() > last_ack, message="the broker's clock to pass the last ack")
    trips = []
    exchange = rb._exchange
    monkeypatch.setattr(rb, "_exchange", lambda commands: trips.append(len(commands)) or exchange(commands))
    first = rb.prune(0, budget=100)
    assert 100 <= first <= 100 + prune.CHUNK
    assert first + rb.prune(0) == 450
    assert len(trips) <= 8 and max(trips) <= prune.CHUNK, trips  # 2 + 3 round trips, not 150 + 150
    assert all(stats.done == 0 for stats in rb.stats(queues).values())


def test_prune_keeps_the_name_of_a_queue_that_holds_only_enqueue_once_records(rb, raw):
    """A queue whose jobs are gone leaves ``P:queues`` at prune (test_conformance_control); one
    that still holds an ``enqueue_once`` record younger than the horizon stays, or no prune would
    visit it again and its key would stay taken for good."""
    job_id = rb.enqueue_once(NewJob("t", {}, queue="once", idempotency_key="cron:1"))
    assert rb.discard([job_id]) == {job_id: "discarded"}
    rb.prune(3600)
    assert "once" in raw.smembers(rb.keys.queues)
    rb.prune(0)  # the record is past the horizon: it goes, and the name with it
    assert "once" not in raw.smembers(rb.keys.queues)
    assert rb.enqueue_once(NewJob("t", {}, queue="once", idempotency_key="cron:1")) is not None


def test_prune_does_not_go_again_on_a_batch_of_kept_jobs_alone(rb, monkeypatch):
    """Children cancelled under a dead parent are kept while a replay of it could run them. A
    call whose whole batch was such children went again at once, and with a share of 1 (a small
    budget among many queues) or an age of 0 it read the same ones again for ever: 20,000 of
    them held the master's loop 47 s."""
    from supervisor.backends.redis import prune

    monkeypatch.setattr(prune, "BATCH", 2)
    parent = rb.enqueue(new())
    kids = rb.enqueue_many([NewJob("t", {"i": i}, depends_on=[parent]) for i in range(5)])
    [job] = rb.claim(["default"], 5, 30, "w")
    rb.dead(job.lease, "permanent", error_info("permanent", "Permanent", "no"))
    assert {rb.get(kid).state for kid in kids} == {"cancelled"}
    wait_for(lambda: rb.now() > max(rb.get(kid).finished_at for kid in kids), message="the clock to move on")
    trips = []
    exchange = rb._exchange

    def counting(commands):
        trips.append(len(commands))
        assert len(trips) <= 20, "prune went again and again"
        return exchange(commands)

    monkeypatch.setattr(rb, "_exchange", counting)
    assert rb.prune(0, budget=1) == 0 and rb.prune(0) == 0
    assert len(trips) <= 2, trips
    assert {rb.get(kid).state for kid in kids} == {"cancelled"}


def test_a_pause_lands_before_its_queue_is_named_so_a_prune_between_keeps_the_name(rb, monkeypatch):
    """Prune takes an empty queue's name out of ``P:queues`` unless it is paused: a pause that
    named the queue first and paused it second lost the name to a prune in between."""
    ran = []

    def then_prune(real):
        def call(*args, **kwargs):
            out = real(*args, **kwargs)
            if not ran:
                ran.append(rb.prune(0))
            return out
        return call

    monkeypatch.setattr(rb.r, "set", then_prune(rb.r.set))
    monkeypatch.setattr(rb.r, "sadd", then_prune(rb.r.sadd))
    rb.pause("p")
    assert ran and "p" in rb.queues() and list(rb.paused()) == ["p"]


def test_a_queue_left_with_nothing_takes_its_sweep_cursor_along(rb, raw, monkeypatch):
    """A sweep whose last batch was whole keeps a cursor for the next call; when that batch
    emptied the queue, the queue leaves ``P:queues`` and no prune comes back for the cursor."""
    from supervisor.backends.redis import prune

    monkeypatch.setattr(prune, "BATCH", 2)
    search = rb._search_key("c")
    raw.zadd(search, {"0000000000000001job_gone_a": 0, "0000000000000002job_gone_b": 0})  # hashes long gone
    raw.sadd(rb.keys.queues, "c")
    rb.prune(3600)
    assert "c" not in raw.smembers(rb.keys.queues)
    assert raw.keys(search.replace(":search", ":*")) == []
