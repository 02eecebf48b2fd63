"""The producer's path (issue 17): each job checked and encoded once, ids as before, the Redis round trip."""
import os
import re
import uuid

import pytest

from supervisor import ids, model
from supervisor.backends import open_broker
from supervisor.client import Client
from supervisor.errors import BadInput
from supervisor.model import NewJob


def reference_id(now, noise):
    """The id encoding as it was first written: 26 Crockford digits of (ms << 80 | noise), low digit first."""
    n = (int(now * 1000) << 80) | int.from_bytes(noise, "big")
    chars = []
    for _ in range(26):
        chars.append("0123456789ABCDEFGHJKMNPQRSTVWXYZ"[n & 31])
        n >>= 5
    return "job_" + "".join(reversed(chars))


def test_job_ids_keep_their_encoding():
    cases = [(0, bytes(10)), (0, b"\xff" * 10), (2**48 / 1000 - 0.001, b"\xff" * 10), (1764581234.567, bytes(10))]
    cases += [(1e9 + i * 7919.123, os.urandom(10)) for i in range(2000)]
    for now, noise in cases:
        assert ids.job_id_from(now, noise) == reference_id(now, noise)
    assert re.fullmatch(r"job_[0-9A-HJKMNP-TV-Z]{26}", model.new_job_id())


def test_trace_ids_are_uuid4_hex():
    for _ in range(1000):
        noise = os.urandom(16)
        assert ids.trace_id_from(noise) == uuid.UUID(bytes=noise, version=4).hex
    job = NewJob("t", {}).validate()
    assert uuid.UUID(hex=job.trace_id).version == 4 and job.trace_id == uuid.UUID(hex=job.trace_id).hex


def test_a_job_is_checked_once_and_again_after_a_change(monkeypatch):
    checks = []
    real = model.check_json
    monkeypatch.setattr(model, "check_json", lambda value, what: checks.append(what) or real(value, what))
    job = NewJob("t", {"n": 1}).validate()
    first = (job.id, job.trace_id)
    assert job.validate() is job and (job.id, job.trace_id) == first
    assert checks == ["payload"]
    job.queue = "no spaces"
    with pytest.raises(BadInput, match="queue"):
        job.validate()
    job.queue = "default"
    job.payload = ["not", "an", "object"]
    with pytest.raises(BadInput, match="payload"):
        job.validate()
    job.payload = {"n": 2}
    assert job.validate().payload_json == '{"n":2}'
    job.depends_on.append(5)  # changed in place: normalised again
    with pytest.raises(BadInput, match="depends_on"):
        job.validate()


def test_the_client_checks_each_job_once(sqlite_url, monkeypatch):
    checks = []
    real = model.check_json
    monkeypatch.setattr(model, "check_json", lambda value, what: checks.append(what) or real(value, what))
    with Client.from_url(sqlite_url) as client:
        client.enqueue("t", {"n": 1})
        client.enqueue_many([("t", {"n": i}) for i in range(3)])
        assert len(checks) == 4
        with pytest.raises(BadInput, match="job 1: payload must be JSON-serialisable"):
            client.enqueue_many([("t", {"n": 1}), ("t", {"n": float("nan")})])


def test_the_stored_payload_is_the_one_checked(broker):
    payload = {"n": 1}
    job = NewJob("t", payload).validate()
    payload["late"] = float("nan")  # changed in place after the check: not what is stored
    job_id = broker.enqueue(job)
    assert broker.get(job_id).payload == {"n": 1}


def test_an_enqueue_without_an_sdk_keeps_an_incoming_trace():
    trace = pytest.importorskip("opentelemetry.trace")
    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        pytest.skip("an SDK is set in this process")
    from supervisor import tracing

    with tracing.enqueue_span(["t"]) as span:
        assert span.traceparent is None  # nothing to carry
    incoming = trace.SpanContext(trace_id=0x0AF7651916CD43DD8448EB211C80319C, span_id=0xB7AD6B7169203331,
                                 is_remote=True, trace_flags=trace.TraceFlags(1))
    with trace.use_span(trace.NonRecordingSpan(incoming)):
        with tracing.enqueue_span(["t"]) as span:
            assert span.traceparent == "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


# -- Redis: the scripts' round trip without redis-py's pipeline object ------------------------

@pytest.fixture
def rb(redis_url):
    pytest.importorskip("redis")
    b = open_broker(redis_url)
    b.migrate()
    yield b
    b.close()


@pytest.mark.services
def test_every_reply_is_read_with_errors_in_place(rb):
    from redis.exceptions import ResponseError

    key = rb.keys.prefix + ":probe"
    ok, error, value = rb._exchange([("SET", key, "v"), ("INCR", key), ("GET", key)])
    assert (ok, value) == ("OK", "v") and isinstance(error, ResponseError)
    assert rb._exchange([("PING",)]) == ["PONG"]  # the connection is still in step


@pytest.mark.services
def test_a_connection_the_server_closed_is_replaced(rb, redis_url):
    redis = pytest.importorskip("redis")
    first = rb.enqueue(NewJob("t", {"n": 1}))
    (ours,) = rb._exchange([("CLIENT", "ID")])
    with redis.Redis.from_url(redis_url.split("?")[0]) as raw:
        assert raw.client_kill_filter(_id=ours) == 1
    second = rb.enqueue(NewJob("t", {"n": 2}))
    assert rb._exchange([("CLIENT", "ID")]) != [ours]
    assert {rb.get(first).payload["n"], rb.get(second).payload["n"]} == {1, 2}
    assert rb.stats(["default"])["default"].ready == 2


@pytest.mark.services
def test_a_round_trip_cut_by_the_server_is_sent_again_on_a_new_connection(rb):
    (ours,) = rb._exchange([("CLIENT", "ID")])
    # The server answers the kill, then closes the connection before the PING's reply: the
    # exchange reconnects and sends both again (the kill now finds no client: 0 killed).
    killed, pong = rb._exchange([("CLIENT", "KILL", "ID", ours, "SKIPME", "no"), ("PING",)])
    assert (killed, pong) == (0, "PONG")
    assert rb._exchange([("CLIENT", "ID")]) != [ours]


@pytest.mark.services
def test_a_script_call_is_packed_as_redis_py_packs_it(rb):
    """The arguments before a script's own are packed once per script and queue: the bytes
    sent are still redis-py's, for every call (a second queue, extra keys, a large argument)."""
    conn = rb.r.connection_pool.get_connection()
    try:
        for name, queue, more_keys, args in [("enqueue", "default", (rb.keys.queues,), ["[1]"]),
                                             ("enqueue", "other", (rb.keys.queues,), ["[2]"]),
                                             ("claim", "default", (), [32, 30_000_000, "w", '"w"']),
                                             ("claim", "default", (), [1, 5, "é", b"\x00\xff"]),
                                             ("ack_many", "default", (), ["x" * 70_000])]:
            for _ in range(2):  # packed anew, then from what was kept
                keys, head = rb.keys.for_scripts(queue)
                expected = b"".join(conn.pack_command("EVALSHA", rb.scripts[name].sha, len(keys) + len(more_keys),
                                                      *keys, *more_keys, *head, *args))
                got = rb._packed(name, queue, more_keys, args)
                assert (got if type(got) is bytes else b"".join(conn.pack_command(*got))) == expected
    finally:
        rb.r.connection_pool.release(conn)
    job = NewJob("t", {"big": "y" * 70_000})  # past the packer's cutoff: sent as redis-py sends it
    assert rb.get(rb.enqueue(job)).payload == {"big": "y" * 70_000}
    assert rb._exchange([rb._packed("queue_empty", "default", (), []), ("PING",)])[1] == "PONG"
