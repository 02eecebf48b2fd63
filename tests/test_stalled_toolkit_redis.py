"""The handlers' Redis (``toolkit.redis_url``: locks and cache) when it stalls or refuses a write,
with private ``redis-server`` processes the tests SIGSTOP; the broker's guarantees must not wait on it.
"""
import os
import shutil
import signal
import time

import pytest

from .daemon import Daemon, read_lines
from .servers import RedisServer
from .toolkit_fixtures import INVOICES
from .util import wait_for


@pytest.fixture
def toolkit_server(tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    made = []

    def start(*extra):
        workdir = tmp_path / f"redis{len(made)}"
        workdir.mkdir()
        made.append(RedisServer(workdir, extra=extra).start())
        return made[-1]

    yield start
    for server in made:
        if server.proc.poll() is None:
            os.kill(server.proc.pid, signal.SIGCONT)
        server.stop(signal.SIGKILL)


def test_a_stalled_lock_redis_does_not_hold_back_the_broker_lease_renewal(toolkit_server, tmp_path):
    """The heartbeat extended the handlers' locks before it renewed the broker's leases: each beat
    waited out the stalled lock Redis's timeouts (seconds) first, a 1 s lease lapsed and the job was
    claimed again while its first attempt still ran. The broker's lease is renewed first, and the
    extension is bounded by the beat."""
    server = toolkit_server()
    os.makedirs(tmp_path / "d")
    d = Daemon(tmp_path / "d", handler_files=("toolkit_jobs.py",),
               supervisor={"workers": 2, "graceful_timeout": 1.0},
               broker={"lease_seconds": 1.0, "heartbeat_seconds": 0.25},
               toolkit={"redis_url": server.url})
    shutil.copy(INVOICES, d.handlers)  # toolkit_jobs imports it
    try:
        d.start()
        marker = str(tmp_path / "m")
        job_id = d.enqueue("hold_lock", {"name": "export", "ttl": 1, "wait": 5, "marker": marker})
        wait_for(lambda: [line for line in read_lines(marker) if line[0] == "acquired"],
                 message="the first attempt to hold the lock")
        held = d.job(job_id)
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            stopped_at = time.time()
            wait_for(lambda: d.records(event="lock_extend_failed"), timeout=20,
                     message="a lock extension to fail on the stalled Redis")
            # Several leases' worth of beats under the stall: the lease was renewed each time or
            # lapsed and the job was claimed again.
            wait_for(lambda: (lambda job: job.token != held.token or job.lease_until > stopped_at + 5)(d.job(job_id)),
                     timeout=30, message="the lease to be renewed past the stall, or the job claimed again")
            job = d.job(job_id)
            assert (job.state, job.attempt, job.token) == ("running", 1, held.token), job
            assert [line[1] for line in read_lines(marker) if line[0] == "acquired"] == ["1"]
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
    finally:
        d.stop()


def test_a_value_redis_refuses_to_store_frees_the_fill_lease(toolkit_server):
    """A value over the server's ``proto-max-bulk-len``: Redis drops the connection mid-store, a
    ConnectionError taken for an outage, and the fill lease stayed until its TTL: every reader
    meanwhile waited ``wait`` and built without storing, on every refill. Redis answers: the lease goes."""
    from supervisor.toolkit.cache import Cache

    server = toolkit_server("--proto-max-bulk-len", "1mb")
    client = server.client()
    try:
        cache = Cache(client, "t:")
        big = "x" * (2 * 1024 * 1024)
        built = []

        def builder():
            built.append(1)
            return big

        assert cache.get_or_build("report", builder, ttl=60) == big
        assert built == [1]
        assert not client.exists("t:cache:report")  # refused: nothing stored
        assert not client.exists("t:cache-lease:report"), "the fill lease outlived the failed store"
        # The next reader takes the lease at once and builds (once), nothing left behind again.
        assert cache.get_or_build("report", builder, ttl=60) == big
        assert built == [1, 1] and not client.exists("t:cache-lease:report")
        assert cache.metrics == {"cache_miss": 2, "cache_rebuild": 2}
    finally:
        client.close()


def test_a_lock_acquire_on_a_stalled_redis_does_not_ask_again_once_its_wait_is_spent(toolkit_server, caplog):
    """``wait=0`` on a Redis that stopped answering: the lost answer was asked once more, a second
    socket timeout inside ``critical()`` where a soft timeout cannot land. With no wait left the
    acquire gives up after the first; the master still hears of the token (the server may hold it)."""
    import redis as redis_py

    from supervisor import protocol
    from supervisor.toolkit import open_redis
    from supervisor.toolkit.locks import Locks

    server = toolkit_server()
    client, _ = open_redis(server.url, socket_timeout=0.5)  # as a child's client, but a shorter timeout
    told = []
    locks = Locks(client, "t:", notify=told.append)
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        with caplog.at_level("WARNING", logger="tangguh.locks"), pytest.raises(redis_py.TimeoutError):
            locks.acquire("export", ttl=5, wait=0)
        assert "asked again" not in caplog.text
        assert [m["op"] for m in told] == [protocol.LOCK]  # freed with the job, should the server hold it
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
        client.close()


def test_a_fill_lease_on_a_stalled_redis_is_not_asked_again_once_no_wait_is_left(toolkit_server, caplog):
    """A fill lease whose answer timed out was always asked once more: a stalled Redis cost two socket
    timeouts inside ``critical()``, where a soft timeout cannot land. A stale key's rebuild (no wait)
    gives up after the first, as a lock's acquire; the master still hears of the token."""
    import redis as redis_py

    from supervisor import protocol
    from supervisor.toolkit import open_redis
    from supervisor.toolkit.cache import Cache

    server = toolkit_server()
    client, _ = open_redis(server.url, socket_timeout=0.5)  # as a child's client, but a shorter timeout
    told = []
    cache = Cache(client, "t:", notify=told.append)
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        with caplog.at_level("WARNING", logger="tangguh.cache"), pytest.raises(redis_py.TimeoutError):
            cache._claim("report", (), 60, 30, if_absent=False)  # a stale entry's rebuild: it waits for nobody
        assert "asked again" not in caplog.text
        assert [m["op"] for m in told] == [protocol.LOCK]  # freed with the job, should the server hold it
        caplog.clear()
        with caplog.at_level("WARNING", logger="tangguh.cache"), pytest.raises(redis_py.TimeoutError):
            cache.lease("report", ttl=60)  # by hand: no wait either
        assert "asked again" not in caplog.text
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
        client.close()


def test_a_stalled_lock_redis_does_not_hold_up_the_master_freeing_a_dead_childs_locks(toolkit_server, tmp_path):
    """A dead child's locks were released from the main loop with a 2 s answer timeout: four
    children dying with their locks on a stalled lock Redis left the master deaf to status (and
    claims, reaping, timeouts) about 8 s. The heartbeat thread frees them; once Redis answers they go."""
    server = toolkit_server()
    os.makedirs(tmp_path / "d")
    d = Daemon(tmp_path / "d", handler_files=("toolkit_jobs.py",), supervisor={"workers": 4},
               broker={"heartbeat_seconds": 1.0}, toolkit={"redis_url": server.url})
    shutil.copy(INVOICES, d.handlers)  # toolkit_jobs imports it
    client = server.client()
    try:
        d.start()
        marker, go = str(tmp_path / "m"), str(tmp_path / "go")
        jobs = [d.enqueue("lock_then_exit", {"name": f"export{i}", "marker": marker, "go": go}) for i in range(4)]
        acquired = wait_for(lambda: (lambda lines: len(lines) == 4 and lines)(
            [line for line in read_lines(marker) if line[0] == "acquired"]), message="four children holding a lock")
        keys = [line[-1] for line in acquired]
        assert client.exists(*keys) == 4
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            open(go, "w").close()  # the four die together, their locks held
            wait_for(lambda: not any(_alive(int(line[2])) for line in acquired), message="the four children dead")
            answered = sum(1 for _ in range(6) if d.status())  # each within the client's usual timeout
            assert answered == 6
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        wait_for(lambda: client.exists(*keys) == 0, timeout=20, message="the dead children's locks freed")
        for job_id in jobs:
            assert d.wait_job(job_id).state == "done"
    finally:
        client.close()
        d.stop()


def _alive(pid):
    """Running, not a zombie (a dead child the master has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
