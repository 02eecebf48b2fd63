"""Redis Sentinel: the primary is killed under two running supervisors, the replica takes over.

A real setup of one primary, one replica and three Sentinels (``tests/ha_servers.py``);
the supervisors, their heartbeats, their wake-ups and the test's own client all reach
Redis through ``redis+sentinel://`` and follow the failover without a restart.
"""
import os
import re
import select
import signal
import uuid

import pytest

from supervisor import cli
from supervisor.backends import open_broker
from supervisor.errors import BrokerError, BrokerUnusable
from supervisor.health import request
from supervisor.model import NewJob
from supervisor.toolkit import open_redis
from supervisor.toolkit.cache import Cache
from supervisor.toolkit.locks import Locks

from .daemon import Daemon
from .failover_flow import run_through_failover
from .ha_servers import SERVICE, SentinelSetup
from .util import wait_for

pytestmark = pytest.mark.services


@pytest.fixture
def sentinel(tmp_path):
    setup = SentinelSetup(tmp_path / "redis")
    yield setup
    setup.stop()


def test_jobs_flow_through_a_sentinel_failover_each_effect_once(sentinel, tmp_path):
    url = sentinel.url(f"t{uuid.uuid4().hex[:8]}")
    client = open_broker(url)
    try:
        got = run_through_failover(tmp_path, url, client, sentinel.kill_primary)
        print("sentinel failover:", got)  # duplicates: runs the lost acks caused, suppressed by the effect's key
        assert sentinel.master_port() == sentinel.replica.port
    finally:
        client.close()


def test_wakeups_and_the_toolkits_locks_and_cache_follow_the_failover(sentinel):
    """The same client objects, before and after: no restart, no new URL."""
    prefix = f"t{uuid.uuid4().hex[:8]}"
    client = open_broker(sentinel.url(prefix))
    redis_client, key_prefix = open_redis(sentinel.url(prefix + ":toolkit:"))
    locks, cache = Locks(redis_client, key_prefix), Cache(redis_client, key_prefix)
    try:
        client.enqueue(NewJob("t", {}))
        fd = client.wakeup_fd()
        with locks.acquire("a", ttl=30) as lock:
            first_fence = lock.fence
        assert cache.get_or_build("k", lambda: "v1", ttl=60) == "v1"
        sentinel.wait_replicated()
        sentinel.kill_primary()
        # The wake-up connection was the old primary's: draining says so once, then a new one is made.
        wait_for(lambda: select.select([fd], [], [], 0)[0], timeout=10, message="the old wake-up socket to close")
        with pytest.raises(BrokerError):
            client.drain_wakeups()
        wait_for(lambda: _answers(client), timeout=30, message="the client to reach the promoted replica")
        new_fd = client.wakeup_fd()
        client.enqueue(NewJob("t", {}))
        wait_for(lambda: select.select([new_fd], [], [], 0)[0], timeout=10,
                 message="a wake-up from the promoted replica")
        client.drain_wakeups()
        assert client.stats(["default"])["default"].ready == 2  # the job enqueued before the failover too
        with locks.acquire("a", ttl=30) as lock:  # the toolkit's client found the new primary by itself
            assert lock.fence > first_fence
        assert cache.get_or_build("k", lambda: "v2", ttl=60) == "v1"  # replicated before the failover
    finally:
        redis_client.close()
        client.close()


def _answers(client):
    try:
        client.stats(["default"])
        return True
    except BrokerError:
        return False


def _config_check(tmp_path, url, capsys):
    (tmp_path / "handlers").mkdir(exist_ok=True)
    path = tmp_path / "tangguh.toml"
    path.write_text(f'[broker]\nurl = "{url}"\n')
    code = cli.main(["config", "check", "-c", str(path)])
    return code, capsys.readouterr().err


def test_a_sentinel_url_naming_an_unknown_service_or_no_sentinel_is_a_config_error(sentinel, tmp_path, capsys):
    # A typo in the service name (or a Redis server listed as a Sentinel) never starts working: it
    # failed `config check` and `run` with an error at once, not a warning and an outage waited out.
    hosts = ",".join(f"127.0.0.1:{s.port}" for s in sentinel.sentinels)
    code, err = _config_check(tmp_path, f"redis+sentinel://{hosts}/no-such-service/0", capsys)
    assert code == 2 and "no Sentinel monitors a service named 'no-such-service'" in err, err
    assert err.count("\n") == 1
    code, err = _config_check(tmp_path, f"redis+sentinel://127.0.0.1:{sentinel.primary.port}/{SERVICE}/0", capsys)
    assert code == 2 and f"127.0.0.1:{sentinel.primary.port} is not a Sentinel" in err, err
    code, err = _config_check(tmp_path, f"redis://127.0.0.1:{sentinel.sentinels[0].port}/0", capsys)
    assert code == 2 and "unknown command" in err, err
    code, err = _config_check(tmp_path, sentinel.url("p"), capsys)
    assert (code, err) == (0, "")


def test_a_primary_the_sentinels_hold_down_is_an_outage_in_one_short_line(sentinel):
    # Mid-failover the Sentinels know the service but name no primary: waited out, not refused,
    # and said without redis-py's repr of every Sentinel's client.
    for node in sentinel.sentinels[1:]:
        node.stop(signal.SIGKILL)  # one Sentinel of three: no quorum, no failover, the primary stays down
    broker = open_broker(sentinel.url("p"))
    try:
        sentinel.primary.stop(signal.SIGKILL)
        wait_for(lambda: sentinel.sentinels[0].client(decode_responses=True).sentinel_master(SERVICE)["is_sdown"],
                 timeout=20, message="the sentinel to hold the primary down")
        with pytest.raises(BrokerError) as info:
            broker.now()
        assert not isinstance(info.value, BrokerUnusable)
        assert f"no primary for service '{SERVICE}' now" in str(info.value) and "<redis" not in str(info.value)
    finally:
        broker.close()


def test_status_answers_while_every_sentinel_and_the_primary_are_silent(sentinel, tmp_path):
    """Sentinels that stop answering (a partition, a frozen host) each held a reconnect for a whole
    socket_timeout, and redis-py's immediate retry asked them all again: 3 Sentinels, 30 s a try of the
    main loop, and `tangguh status` (15 s) went unanswered. Each Sentinel now gets its share of the
    timeout, and the retry does not ask them again."""
    d = Daemon(tmp_path, broker_url=sentinel.url(f"t{uuid.uuid4().hex[:8]}"), supervisor={"workers": 1})
    frozen = [node.proc.pid for node in [sentinel.primary, *sentinel.sentinels]]
    try:
        d.start()
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        try:
            # Asked over and over through more reconnect tries: each request answered within 10 s, under
            # the CLI's 15 (request raises TimeoutError otherwise). A try now takes one socket_timeout
            # (5 s) for all three Sentinels; with the whole timeout each it took 15 s, with the retry 30.
            wait_for(lambda: request(d.socket, {"cmd": "status"}, timeout=10)["broker_down"]
                     and _main_broker_errors(d) >= 3, timeout=120, message="two more reconnect tries")
        finally:
            for pid in frozen:
                os.kill(pid, signal.SIGCONT)
        wait_for(lambda: not d.status()["broker_down"], timeout=60, message="the broker seen back")
        d.signal(signal.SIGTERM)
        assert d.wait_exit() == 0
    finally:
        d.stop()


def _main_broker_errors(d):
    text = request(d.socket, {"cmd": "metrics"}, timeout=15)["text"]
    return float(re.search(r'^tangguh_broker_errors_total\{source="main"\} (\S+)$', text, re.M).group(1))
