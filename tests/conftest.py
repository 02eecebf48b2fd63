"""Shared fixtures: one broker URL per backend, each isolated per test.

Redis and PostgreSQL come from ``TANGGUH_TEST_REDIS_URL`` and
``TANGGUH_TEST_POSTGRES_URL`` (defaults: the local servers). A test run gets a
fresh key prefix (Redis) or schema (PostgreSQL) per test. When a server is
unreachable its tests are skipped with the reason, unless
``TANGGUH_REQUIRE_SERVICES=1`` (CI), where the skip becomes a failure.
"""
import importlib.util
import os
import signal
import uuid

import pytest

REDIS_URL = os.environ.get("TANGGUH_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
POSTGRES_URL = os.environ.get("TANGGUH_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
REQUIRE_SERVICES = os.environ.get("TANGGUH_REQUIRE_SERVICES") == "1"

# A backend joins the parametrisation as soon as its module exists.
BACKENDS = [
    name
    for name, module in (("sqlite", "sqlite"), ("redis", "redis"), ("postgres", "postgres"))
    if importlib.util.find_spec(f"supervisor.backends.{module}") is not None
]


def _unavailable(what, exc):
    message = f"{what} not reachable ({exc}); set TANGGUH_TEST_{what.upper()}_URL"
    if REQUIRE_SERVICES:
        pytest.fail(f"TANGGUH_REQUIRE_SERVICES=1 but {message}")
    pytest.skip(message)


def _with_query(url, **params):
    sep = "&" if "?" in url else "?"
    return url + sep + "&".join(f"{k}={v}" for k, v in params.items())


@pytest.fixture
def redis_url():
    """A Redis broker URL with a key prefix of its own; keys are deleted after the test."""
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except Exception as exc:  # noqa: BLE001 - any connection failure means "not available"
        _unavailable("redis", exc)
    prefix = f"tangguh-test-{uuid.uuid4().hex[:10]}"
    yield _with_query(REDIS_URL, prefix=prefix)
    for key in client.scan_iter(match=f"{prefix}*", count=1000):
        client.delete(key)
    client.close()


@pytest.fixture
def postgres_url():
    """A PostgreSQL broker URL with a schema of its own, dropped after the test."""
    import psycopg

    try:
        conn = psycopg.connect(POSTGRES_URL, autocommit=True, connect_timeout=5)
    except Exception as exc:  # noqa: BLE001
        _unavailable("postgres", exc)
    schema = f"tangguh_test_{uuid.uuid4().hex[:10]}"
    yield _with_query(POSTGRES_URL, schema=schema)
    conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    conn.close()


@pytest.fixture
def sqlite_url(tmp_path):
    return f"sqlite:///{tmp_path}/broker.db"


@pytest.fixture(params=BACKENDS)
def broker_url(request):
    """The URL of a fresh, empty broker of each available backend."""
    return request.getfixturevalue(f"{request.param}_url")


@pytest.fixture
def broker(broker_url):
    from supervisor.backends import open_broker

    b = open_broker(broker_url)
    b.migrate()
    yield b
    b.close()


@pytest.fixture(autouse=True)
def _child_timeouts_left_as_found():
    """A test that installs a child's signal handlers in the test process (``timeouts.install()``)
    left them, and its note of SIGINT's handler, to every later test of the process: each job
    run_jobs ran put that note back, and a Ctrl-C in a later test went unnoticed. Undone here."""
    from supervisor.child import timeouts

    watched = (signal.SIGALRM, signal.SIGTERM, timeouts.CANCEL_SIGNAL, *timeouts._KEPT)
    before = {sig: signal.getsignal(sig) for sig in watched}
    yield
    if timeouts._installed_on is None:
        return
    for sig, handler in before.items():
        if handler is not None:
            signal.signal(sig, handler)
    for _, copy in timeouts._std:
        os.close(copy)
    timeouts._installed_on, timeouts._kept, timeouts._std = None, (), ()
