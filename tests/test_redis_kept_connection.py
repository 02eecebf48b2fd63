"""The Redis broker's kept connection (``backends/redis/calls.py``): one connection stays
checked out of redis-py's pool for the scripts, and must behave as the pool's would:
reopened before a sending when the server dropped it, never shared by two threads or
by a parent and its forked child, and never kept where the URL bounds the pool."""
import os
import shutil
import threading
import uuid

import pytest

from supervisor.backends import open_broker
from supervisor.backends.redis import calls
from supervisor.backends.redis.connection import connect
from supervisor.model import NewJob

from .daemon import Daemon
from .ha_servers import missing, need_redis
from .servers import RedisServer

redis = pytest.importorskip("redis")

pytestmark = pytest.mark.services


def named(redis_url):
    """The URL with a client name of its own, so the server's CLIENT LIST shows its connections."""
    name = f"kept-{uuid.uuid4().hex[:10]}"
    return redis_url + f"&client_name={name}", name


def connections(raw, name):
    return [c for c in raw.client_list() if c.get("name") == name]


@pytest.fixture
def raw(redis_url):
    client = redis.Redis.from_url(redis_url.split("?")[0], decode_responses=True)
    yield client
    client.close()


def enqueue_mine(broker, tag, n):
    """Enqueue ``n`` jobs with chosen ids; the ids the broker answered with, in order."""
    return [broker.enqueue(NewJob("t", {"n": i}, id=f"{tag}-{i:04d}")) for i in range(n)]


def test_the_scripts_keep_one_connection_and_one_the_server_dropped_is_reopened_before_sending(redis_url, raw):
    url, name = named(redis_url)
    with open_broker(url) as b:
        b.migrate()
        for i in range(20):
            b.enqueue(NewJob("t", {"n": i}))
        (conn,) = connections(raw, name)
        assert b.claim(["default"], 5, 30.0, "me:1") and [c["id"] for c in connections(raw, name)] == [conn["id"]]
        raw.client_kill_filter(_id=conn["id"])  # an idle timeout, a restart, a proxy's cut
        got = b.claim(["default"], 5, 30.0, "me:1")
        # Found dead after sending, it would count as a lost answer (a resend), and make
        # the supervisor look for orphans after every idle timeout.
        assert len(got) == 5 and b.calls_resent == 0 and b.answers_lost == 0
        assert [c["id"] for c in connections(raw, name)] != [conn["id"]]


def test_a_kept_connection_redis_py_marked_for_reconnect_is_reopened_before_sending(redis_url, raw):
    """redis-py marks the connections in use when the server announces a move (a maintenance
    notice, ``protocol=3``) and reconnects them as they come back to the pool: the kept one never
    comes back, so the broker looks at the mark itself."""
    url, name = named(redis_url)
    with open_broker(url) as b:
        b.migrate()
        b.enqueue(NewJob("t", {}))
        (conn,) = connections(raw, name)
        if not hasattr(b._kept[1], "mark_for_reconnect"):
            pytest.skip("this redis-py has no maintenance notices")
        b._kept[1].mark_for_reconnect()  # as redis-py's handler of a MOVING notice does
        b.enqueue(NewJob("t", {}))
        assert [c["id"] for c in connections(raw, name)] != [conn["id"]] and b.calls_resent == 0
        assert not b._kept[1].should_reconnect()


def test_threads_sharing_one_broker_never_share_a_connection(redis_url):
    with open_broker(redis_url) as b:
        b.migrate()
        answers, errors = {}, []

        def run(tag):
            try:
                answers[tag] = enqueue_mine(b, tag, 150)
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(f"t{k}",)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors
        for tag, ids in answers.items():  # an answer read by the wrong thread names another's job
            assert ids == [f"{tag}-{i:04d}" for i in range(150)]
        assert b.stats(["default"])["default"].ready == 600


def test_a_forked_child_opens_its_own_connection_and_leaves_the_parents_alone(redis_url, raw):
    url, name = named(redis_url)
    with open_broker(url) as b:
        b.migrate()
        for i in range(3):  # ids of the broker's choosing: the scripts' connection is the only one
            b.enqueue(NewJob("t", {"n": i}))
        (parents,) = connections(raw, name)
        done_r, done_w = os.pipe()
        exit_r, exit_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: enqueue while the parent waits, then stay until the parent has looked
            code = 1
            try:
                os.close(done_r), os.close(exit_w)
                code = 0 if len({b.enqueue(NewJob("t", {"n": i})) for i in range(50)}) == 50 else 3
                os.write(done_w, b"x")
                os.read(exit_r, 1)
            finally:
                os._exit(code)
        os.close(done_w), os.close(exit_r)
        try:
            assert os.read(done_r, 1) == b"x", "the child failed before its enqueues were done"
            # Sent on the parent's socket, the child's requests would show under the parent's
            # connection: two processes reading one socket's answers take each other's.
            assert len(connections(raw, name)) == 2
        finally:
            os.close(exit_w)
            _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        # The child's exit closed its copy of the parent's socket, never the parent's connection.
        assert b.enqueue(NewJob("t", {})) and b.calls_resent == 0
        assert [c["id"] for c in connections(raw, name)] == [parents["id"]]
        assert b.stats(["default"])["default"].ready == 54


def test_a_url_bounding_the_pool_keeps_no_connection_checked_out(redis_url):
    """``max_connections=1``: the one connection goes back after each call, so the broker's
    other commands (plain redis-py calls through the same pool) still get it."""
    with open_broker(redis_url + "&max_connections=1") as b:
        b.migrate()
        assert b.enqueue(NewJob("t", {}))
        assert b.r.ping()
        assert b.claim(["default"], 1, 30.0, "me:1") and b.r.ping()


@pytest.mark.parametrize("url", ["redis+sentinel://127.0.0.1:1/mymaster/0", "rediss+sentinel://127.0.0.1:1/mymaster/0",
                                 "redis://127.0.0.1:1/0?max_connections=4"])
def test_sentinel_and_a_bounded_pool_keep_none(url):
    """A Sentinel pool drops the connections to a demoted primary as they come back; a bounded
    pool needs its connections back. There every call takes its connection from the pool and
    returns it."""
    assert connect(url).keep is False
    assert connect("redis://127.0.0.1:1/0").keep is True and connect("rediss://127.0.0.1:1/0").keep is True


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    """A redis-server of this module's own that speaks TLS only (the shared one speaks none)."""
    need_redis()
    if shutil.which("openssl") is None:
        missing("openssl is not installed (it makes the TLS Redis's certificate)")
    server = RedisServer(tmp_path_factory.mktemp("tls-redis"), tls=True).start()
    yield server
    server.stop()


@pytest.mark.parametrize("pool_check", ["redis_py", "by_hand"])
def test_on_tls_the_kept_connection_is_checked_through_the_tls_layer(tls_redis, pool_check, monkeypatch):
    """On TLS the check before a sending is a read through the TLS layer, not a look at the
    socket: a socket holding only the TLS layer's own records is not a dropped connection,
    and one the server closed is still reopened before the sending. redis-py before 8.2 has no
    ``ensure_connection``: the broker then makes the same read itself."""
    if pool_check == "by_hand":
        monkeypatch.setattr(calls, "POOL_CHECKS", False)
    name = f"kept-{uuid.uuid4().hex[:10]}"
    raw = tls_redis.client(decode_responses=True)
    try:
        with open_broker(f"{tls_redis.url}&client_name={name}&prefix={name}") as b:
            b.migrate()
            for i in range(20):
                b.enqueue(NewJob("t", {"n": i}))
            (conn,) = connections(raw, name)
            for _ in range(3):
                assert len(b.claim(["default"], 2, 30.0, "me:1")) == 2
            assert [c["id"] for c in connections(raw, name)] == [conn["id"]]  # kept, and never reopened
            raw.client_kill_filter(_id=conn["id"])
            got = b.claim(["default"], 5, 30.0, "me:1")
            assert len(got) == 5 and b.calls_resent == 0 and b.answers_lost == 0
            assert [c["id"] for c in connections(raw, name)] != [conn["id"]]
            assert b.stats(["default"])["default"].in_flight == 11
    finally:
        raw.close()


def test_the_daemon_runs_jobs_over_tls(tls_redis, tmp_path):
    d = Daemon(tmp_path, broker_url=f"{tls_redis.url}&prefix=kept-{uuid.uuid4().hex[:10]}")
    try:
        d.start()
        ids = [d.enqueue("noop", {"n": i}) for i in range(40)]
        for job_id in ids:
            assert d.wait_job(job_id).state == "done"
        d.assert_clean()
    finally:
        d.stop()
