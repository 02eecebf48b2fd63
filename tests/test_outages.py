"""The broker goes away under a running supervisor, or fails one write: nothing is lost or stuck.

Every test here runs real ``tangguh run`` processes against a private Redis
or PostgreSQL server (``tests/servers.py``) that the test stops, restarts or
breaks for real (ACL off, NOLOGIN, terminated sessions, a constraint that
refuses the ack). Effects are recorded by the ``effect`` handler
(``tests/handlers/effects.py``) in a SQLite file outside the broker, once per
job (keyed by job id), beside a row for every execution.
"""
import json
import signal
import sqlite3
import uuid

import pytest

from supervisor.backends import open_broker
from supervisor.errors import BrokerError
from supervisor.model import NewJob

from .daemon import Daemon
from .servers import private_postgres, private_redis  # noqa: F401 - fixtures
from .util import wait_for


class Broker:
    """One test's namespace on a private server: the supervisor's URL, an admin URL, and the server."""

    def __init__(self, kind, server, url, admin_url):
        self.kind, self.server, self.url, self.admin_url = kind, server, url, admin_url
        self.client = open_broker(admin_url)

    def restart(self):
        self.server.restart()

    def close(self):
        self.client.close()


@pytest.fixture
def redis_broker(private_redis):
    prefix = f"t{uuid.uuid4().hex[:10]}"
    url = f"{private_redis.url}?prefix={prefix}"
    b = Broker("redis", private_redis, url, url)
    yield b
    b.close()


@pytest.fixture
def postgres_broker(private_postgres):
    schema = f"t_{uuid.uuid4().hex[:10]}"
    url = f"{private_postgres.url()}?schema={schema}"
    b = Broker("postgres", private_postgres, url, url)
    b.schema = schema
    b.client.migrate()
    yield b
    b.close()


@pytest.fixture(params=["redis", "postgres"])
def any_broker(request):
    return request.getfixturevalue(f"{request.param}_broker")


def effects(db, table="effects"):
    try:
        with sqlite3.connect(db, timeout=30) as conn:
            return conn.execute(f"SELECT job_id FROM {table}").fetchall()
    except sqlite3.OperationalError:  # not created yet: no job ran
        return []


def count(db, table="effects"):
    return len(effects(db, table))


def executions(db, job_id):
    with sqlite3.connect(db, timeout=30) as conn:
        return conn.execute("SELECT attempt, pid FROM executions WHERE job_id = ? ORDER BY attempt",
                            (job_id,)).fetchall()


def events(d, name):
    """The JSON log lines of daemon ``d`` with ``event == name``."""
    out = []
    for line in d.logs().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") == name:
            out.append(record)
    return out


def stats(broker, queue="default"):
    """Queue stats through the test's own client, None while the server is not answering."""
    try:
        return broker.stats([queue])[queue]
    except BrokerError:
        return None


def daemon(tmp_path, b, **sections):
    d = Daemon(tmp_path, broker_url=b.url, handler_files=("effects.py",), **sections)
    d._broker = b.client  # the test's client, never cut off by the faults the test injects
    return d


# -- the broker restarts under a flowing queue -------------------------------------------------------------
N_FLOW = 2000


def test_broker_restart_while_jobs_flow_loses_nothing_and_keeps_the_children(any_broker, tmp_path):
    db = str(tmp_path / "effects.db")
    d = daemon(tmp_path, any_broker, supervisor={"workers": 2}, broker={"prefetch": 4}, log={"level": "info"})
    ids = any_broker.client.enqueue_many([NewJob("effect", {"db": db}) for _ in range(N_FLOW)])
    try:
        d.start()
        pids = sorted(d.worker_pids())
        wait_for(lambda: count(db) >= 200, timeout=60, message="200 jobs to run")
        any_broker.server.stop()
        wait_for(lambda: d.status()["broker_down"], timeout=30, message="the supervisor to see the broker gone")
        done_before = count(db)
        any_broker.server.start()
        wait_for(lambda: (s := stats(any_broker.client)) and s.done == N_FLOW, timeout=120,
                 message=f"all {N_FLOW} jobs to be done")
        assert done_before < N_FLOW, "the restart came too late to cut into the flow"
        s = stats(any_broker.client)
        assert (s.ready, s.scheduled, s.in_flight, s.dead) == (0, 0, 0, 0)
        got = effects(db)
        assert len(got) == N_FLOW and {row[0] for row in got} == set(ids)  # each effect once, none lost
        status = d.status()
        assert sorted(d.worker_pids()) == pids and status["restarts"] == 0  # the children lived on
        assert not status["broker_down"] and status["pending_writes"] == 0
        assert len(events(d, "broker_down")) == 1 and len(events(d, "broker_up")) == 1  # once per change
        d.signal(signal.SIGTERM)
        assert d.wait_exit() == 0
        d.assert_clean()
    finally:
        d.stop()
