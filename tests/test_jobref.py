"""Enqueue through the handler: ``@supervisor.job`` objects and ``supervisor.JobRef``."""
import subprocess
import sys
import textwrap

import pytest

import supervisor
from supervisor import jobref, registry
from supervisor.backends import open_broker
from supervisor.client import Client
from supervisor.errors import BadInput, ConfigError


@supervisor.job("send_receipt", timeout=30)
def send_receipt(ctx, payload):
    return {"sent": payload["order_id"]}


@supervisor.job("bulk_mail", queue="bulk")
def bulk_mail(ctx, payload):
    return None


@pytest.fixture(autouse=True)
def no_default(monkeypatch):
    monkeypatch.delenv("TANGGUH_CONFIG", raising=False)
    monkeypatch.delenv("TANGGUH_BROKER_URL", raising=False)
    supervisor.configure()
    yield
    supervisor.configure()


def jobs_of(url, *ids):
    with open_broker(url) as broker:
        return [broker.get(i) for i in ids]


def test_the_decorated_handler_is_still_the_function():
    assert send_receipt(None, {"order_id": 7}) == {"sent": 7}
    assert send_receipt.__name__ == "send_receipt" and send_receipt.type == "send_receipt"


def test_the_loader_still_finds_decorated_handlers(tmp_path):
    (tmp_path / "h.py").write_text(textwrap.dedent("""
        import supervisor

        @supervisor.job("a", timeout=5)
        def a(ctx, payload):
            return 1

        @supervisor.job("b")
        async def b(ctx, payload):
            return 2
    """))
    handlers = registry.load_handlers(str(tmp_path))
    assert set(handlers) == {"a", "b"}
    assert handlers["a"].timeout == 5 and handlers["a"].fn(None, {}) == 1
    assert handlers["b"].is_async and not handlers["a"].is_async


def test_two_handlers_for_one_type_are_named_by_file_and_line(tmp_path):
    """Both in one file, the error said "h.py and h.py": the README promises the file and line."""
    (tmp_path / "h.py").write_text(textwrap.dedent("""
        import supervisor

        @supervisor.job("x")
        def first(ctx, payload):
            return 1


        @supervisor.job("x")
        def second(ctx, payload):
            return 2
    """))
    with pytest.raises(registry.HandlerLoadError) as caught:
        registry.load_handlers(str(tmp_path))
    path = tmp_path / "h.py"
    assert str(caught.value) == f"job type 'x' has two handlers: {path}:4 (first) and {path}:9 (second)"


def test_a_handler_file_may_hold_a_lazy_proxy_that_raises_on_any_attribute(tmp_path):
    """Django's ``settings`` without DJANGO_SETTINGS_MODULE, a werkzeug ``LocalProxy`` outside
    a request: looking for the handler mark on them raised, which ended the master on SIGHUP."""
    (tmp_path / "proxied.py").write_text(textwrap.dedent("""
        import supervisor

        class Proxy:
            def __getattr__(self, name):
                raise RuntimeError("Working outside of application context.")

        settings = Proxy()

        @supervisor.job("p")
        def p(ctx, payload):
            return 1
    """))
    assert set(registry.load_handlers(str(tmp_path))) == {"p"}


def test_enqueue_through_the_handler_with_a_configured_url(sqlite_url):
    supervisor.configure(url=sqlite_url)
    job_id = send_receipt.enqueue({"order_id": 7}, idempotency_key="receipt:7", resource_id="order:7")
    again = send_receipt.enqueue({"order_id": 7}, idempotency_key="receipt:7")
    ids = send_receipt.enqueue_many([{"order_id": 8}, {"order_id": 9}], priority=3)
    job, *many = jobs_of(sqlite_url, job_id, *ids)
    assert again == job_id
    assert (job.type, job.payload, job.resource_id, job.queue) == ("send_receipt", {"order_id": 7}, "order:7",
                                                                   "default")
    assert [(j.payload, j.priority) for j in many] == [({"order_id": 8}, 3), ({"order_id": 9}, 3)]


def test_job_ref_and_an_explicit_client(sqlite_url):
    with Client.from_url(sqlite_url) as client:
        job_id = supervisor.JobRef("send_receipt").enqueue({"order_id": 1}, client=client, delay=60)
        job = client.get(job_id)
    assert job.type == "send_receipt" and job.run_at > job.queued_at + 50


def test_the_default_client_from_the_environment(sqlite_url, tmp_path, monkeypatch):
    monkeypatch.setenv("TANGGUH_BROKER_URL", sqlite_url)
    first = send_receipt.enqueue({"order_id": 1})
    monkeypatch.delenv("TANGGUH_BROKER_URL")
    config = tmp_path / "t.toml"
    config.write_text('[broker]\nurl = "sqlite:///other.db"\nqueues = ["default", "bulk"]\n')
    monkeypatch.setenv("TANGGUH_CONFIG", str(config))
    second = bulk_mail.enqueue({})
    assert jobs_of(sqlite_url, first)[0].type == "send_receipt"
    (job,) = jobs_of(f"sqlite:///{tmp_path}/other.db", second)
    assert job.queue == "bulk"  # the decorator's queue


def test_the_config_queue_overrides_the_decorator(tmp_path):
    config = tmp_path / "t.toml"
    config.write_text('[broker]\nurl = "sqlite:///b.db"\nqueues = ["default", "bulk", "slow"]\n'
                      '[jobs.types.bulk_mail]\nqueue = "slow"\n')
    supervisor.configure(config=str(config))
    job_id = bulk_mail.enqueue({})
    explicit = bulk_mail.enqueue({}, queue="default")
    assert [j.queue for j in jobs_of(f"sqlite:///{tmp_path}/b.db", job_id, explicit)] == ["slow", "default"]


def test_no_default_client_says_how_to_configure_one():
    with pytest.raises(ConfigError) as err:
        send_receipt.enqueue({"order_id": 1})
    assert "supervisor.configure(url=...)" in str(err.value) and "TANGGUH_BROKER_URL" in str(err.value)


def test_bad_input_stores_nothing(sqlite_url):
    supervisor.configure(url=sqlite_url)
    with pytest.raises(BadInput, match="job 1: payload must be a JSON object"):
        send_receipt.enqueue_many([{"order_id": 1}, [1]])
    with Client.from_url(sqlite_url) as client:
        assert client.stats(["default"])["default"].ready == 0


def test_configure_takes_one_source(sqlite_url):
    with pytest.raises(ValueError):
        supervisor.configure(url=sqlite_url, config="x.toml")
    assert jobref.NO_CLIENT.startswith("no default client")


@pytest.mark.parametrize("key, value, message", [
    ("timeout", "30", "timeout: expected a positive number of seconds up to 31536000 (a year), got '30'"),
    ("timeout", 0, "timeout: expected a positive number of seconds up to 31536000 (a year), got 0"),
    ("soft_timeout", -1, "soft_timeout: expected a number of seconds >= 0 and up to 31536000 (a year), got -1"),
    # Its timer overflowed (setitimer): every job of the type failed as an OverflowError, unrun.
    ("soft_timeout", 1e300,
     "soft_timeout: expected a number of seconds >= 0 and up to 31536000 (a year), got 1e+300"),
    ("timeout", 1e300, "timeout: expected a positive number of seconds up to 31536000 (a year), got 1e+300"),
    ("max_attempts", 0, "max_attempts: expected a positive integer up to 2147483647, got 0"),
    ("max_attempts", 2.5, "max_attempts: expected a positive integer up to 2147483647, got 2.5"),
    ("queue", "e-mails!", "queue: expected a queue name (1 to 64 letters, digits or _ . : -), got 'e-mails!'"),
    ("exclusive", "no", "exclusive: expected true or false, got 'no'"),
])
def test_a_decorator_setting_of_the_wrong_kind_is_refused_where_it_is_written(tmp_path, key, value, message):
    """@supervisor.job("x", timeout="30") was taken as it was: `tangguh config check` said ok,
    run_jobs ran the job, and the daemon's master died (exit 1, "unsupported operand type(s)
    for +: 'float' and 'str'") at the first job of the type, leaving it leased. A queue no
    producer can name passed the check and the start too, then refused every enqueue and tick;
    exclusive="no" was bool("no"): exclusive."""
    with pytest.raises(ValueError) as err:
        supervisor.job("x", **{key: value})
    assert str(err.value) == f"job 'x': {message}"
    (tmp_path / "handlers").mkdir()
    (tmp_path / "handlers" / "slow.py").write_text(textwrap.dedent(f"""
        import supervisor

        @supervisor.job("slow", {key}={value!r})
        def slow(ctx, payload):
            return None
    """))
    config = tmp_path / "tangguh.toml"
    config.write_text(f'[supervisor]\nhandlers = "{tmp_path / "handlers"}"\n'
                      f'[broker]\nurl = "sqlite:///{tmp_path / "broker.db"}"\n')
    done = subprocess.run([sys.executable, "-m", "supervisor.cli", "config", "check", "-c", str(config)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"slow.py:4: ValueError: job 'slow': {key}: " in done.stderr


def test_a_decorator_above_the_job_decorator_is_not_skipped(tmp_path, sqlite_url):
    """@functools.wraps copies the handler's mark onto a decorator put above @supervisor.job; the
    loader then took the function under `__wrapped__`, the Handler, and ran it without the outer
    decorator (its retry wrapper, its connection cleanup) in the daemon and in run_jobs alike."""
    (tmp_path / "wrapped.py").write_text(textwrap.dedent("""
        import functools
        import supervisor

        def outermost(fn):
            @functools.wraps(fn)
            def run(ctx, payload):
                return {"outer": fn(ctx, payload)}
            return run

        @outermost
        @supervisor.job("wrapped")
        def wrapped(ctx, payload):
            return "inner"
    """))
    spec = registry.load_handlers(str(tmp_path))["wrapped"]
    assert spec.fn(None, {}) == {"outer": "inner"}
    from supervisor import testing

    module = sys.modules[spec.fn.__module__]
    with Client.from_url(sqlite_url) as client:
        client.enqueue("wrapped", {})
        client.enqueue("wrapped", {})
        assert [r.result for r in testing.run_jobs(client, handlers=str(tmp_path), until=1)] == [{"outer": "inner"}]
        assert [r.result for r in testing.run_jobs(client, handlers=[module.wrapped])] == [{"outer": "inner"}]


def test_a_job_ref_with_a_schema_that_is_not_one_is_refused_where_it_is_made():
    """JobRef("t", payload=int) was made, and every enqueue then raised a ValueError, which a
    producer catching BadInput (the FastAPI recipe's 422) let through as a 500."""
    with pytest.raises(ValueError, match="^job 'refund': payload schema must be a dataclass, a TypedDict"):
        supervisor.JobRef("refund", payload=int)


def test_one_idempotency_key_for_many_payloads_is_refused_not_collapsed(sqlite_url):
    """enqueue_many applies its options to each job: one idempotency_key made every job of the
    batch the first one (three receipts asked for, one stored, its id returned three times)."""
    with Client.from_url(sqlite_url) as client:
        with pytest.raises(BadInput, match="idempotency_key= would make the 2 jobs one"):
            send_receipt.enqueue_many([{"order_id": 1}, {"order_id": 2}], client=client, idempotency_key="batch:42")
        assert client.stats("default")["default"].ready == 0
        (only,) = send_receipt.enqueue_many([{"order_id": 1}], client=client, idempotency_key="receipt:1")
        assert client.get(only).idempotency_key == "receipt:1"
