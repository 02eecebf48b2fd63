"""What producers, handlers and stored data may throw at the supervisor and the CLI.

Each case runs the real daemon or the real CLI against real brokers: the
supervisor stores what it can (replacing what it cannot), dead-letters what
it cannot run, and the CLI shows every job without letting its text drive the
terminal.
"""
import json

import pytest

from supervisor.backends import open_broker
from supervisor.client import Client
from supervisor.errors import BadInput
from supervisor.model import NewJob, error_info

from .daemon import Daemon, tangguh
from .util import wait_for

ESCAPE = "\x1b]0;pwned\x07\x1b[31m"  # sets the terminal title, turns the text red
CLEAN = "nul \ufffd and a lone \ufffd surrogate"


@pytest.fixture
def daemon(tmp_path, broker_url):
    d = Daemon(tmp_path, broker_url=broker_url, handler_files=("testjobs.py", "hostile.py"),
               jobs={"backoff_base": 0.0})
    yield d
    d.stop()


def cli(d, *args):
    result = tangguh(*args, "-c", d.config_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    return result.stdout


def test_unstorable_error_text_is_stored_replaced_and_every_listing_shows_it(daemon):
    daemon.start()
    failing = daemon.enqueue("unstorable_error", max_attempts=2)
    unknown = daemon.enqueue("evil" + ESCAPE)
    job = daemon.wait_job(failing, timeout=60)
    assert (job.state, job.reason, job.attempt) == ("dead", "exception", 2)  # both attempts stored, none expired
    assert job.error["message"] == CLEAN + " on attempt 2"
    assert [h["outcome"] for h in job.history] == ["retry", "dead"]
    assert [h["error"]["message"] for h in job.history] == [CLEAN + " on attempt 1", CLEAN + " on attempt 2"]
    assert "\x00" not in job.error["traceback"] and "\udc80" not in job.error["traceback"]
    assert daemon.wait_job(unknown).reason == "unknown_type"

    listing = cli(daemon, "dlq", "list")
    assert failing in listing and unknown in listing and "evil\\x1b]0;pwned\\x07\\x1b[31m" in listing
    for args in (("job", failing), ("dlq", "show", failing), ("job", unknown), ("dlq", "show", unknown)):
        out = cli(daemon, *args)
        assert "\x1b" not in out and "\x07" not in out
    assert CLEAN in cli(daemon, "dlq", "show", failing)
    assert {j["id"] for j in json.loads(cli(daemon, "dlq", "list", "--json"))} == {failing, unknown}
    assert daemon.status()["workers"]
    daemon.assert_clean()


def test_a_result_nested_past_the_limit_fails_its_attempt_and_the_master_serves_on(tmp_path):
    d = Daemon(tmp_path, handler_files=("hostile.py",))
    try:
        d.start()
        deep = d.enqueue("deep_result", {"depth": 65}, max_attempts=1)
        fits = d.enqueue("deep_result", {"depth": 64})
        failed = d.wait_job(deep)
        assert (failed.state, failed.error["message"]) == ("dead", "handler result is nested more than 64 levels deep")
        assert d.wait_job(fits).state == "done"
        d.assert_clean()
    finally:
        d.stop()


# -- the CLI over jobs stored before these checks existed (or behind the API's back) -------

def test_cli_shows_a_lone_surrogate_and_a_far_future_run_at_without_crashing(tmp_path):
    d = Daemon(tmp_path)  # its config and SQLite broker; the daemon itself is not needed
    with open_broker(d.broker_url) as broker:
        far = broker.enqueue(NewJob("t", {}))
        broker.db.execute("UPDATE jobs SET run_at = 1e300 WHERE id = ?", (far,))
        dead = broker.enqueue(NewJob("t", {}))
        job = broker.claim(["default"], 1, 30, "w")[0]
        assert job.id == dead
        raw = {"reason": "exception", "class": "E", "message": "lone \udc80 " + ESCAPE, "traceback": ""}
        broker.dead(job.lease, "exception", raw)
        assert broker.get(dead).error["message"] == raw["message"]
    out = cli(d, "job", far)
    assert "1e+300 (epoch seconds)" in out
    for args in (("dlq", "list"), ("dlq", "show", dead), ("job", dead)):
        out = cli(d, *args)
        assert "lone \\udc80 \\x1b]0;pwned\\x07" in out and "\x1b" not in out, out
    assert json.loads(cli(d, "job", dead, "--json"))["error"]["message"] == raw["message"]


def test_job_json_prints_a_result_stored_900_deep(tmp_path):
    d = Daemon(tmp_path)
    result = {}
    for _ in range(899):
        result = {"a": result}
    with open_broker(d.broker_url) as broker:
        job_id = broker.enqueue(NewJob("t", {}))
        broker.ack(broker.claim(["default"], 1, 30, "w")[0].lease, result)
    assert json.loads(cli(d, "job", job_id, "--json"))["result"] == result
    assert job_id in cli(d, "job", job_id)


@pytest.mark.parametrize("queue", ["a{b}", "{default}", "two words", "q" * 65, "new\nline"])
def test_client_refuses_a_queue_name_no_broker_can_serve(broker_url, queue):
    with Client.from_url(broker_url) as client:  # no config: any queue name the rule allows is taken
        client.broker.migrate()
        with pytest.raises(BadInput, match="is not a valid queue name"):
            client.enqueue("t", {}, queue=queue)
        client.enqueue("t", {}, queue="bulk.eu-1:low")
        assert client.stats(["bulk.eu-1:low"])["bulk.eu-1:low"].ready == 1


def test_a_stored_payload_the_master_cannot_hand_out_is_dead_lettered_and_the_rest_run(daemon):
    from .test_broker_conformance import store_payload_raw

    daemon.broker.migrate()  # the jobs go in before the supervisor starts
    bad = daemon.enqueue("noop")
    good = daemon.enqueue("noop")
    store_payload_raw(daemon.broker, bad, "[" * 2000 + "]" * 2000)
    daemon.start()
    assert daemon.wait_job(good).state == "done"
    job = daemon.wait_job(bad)
    assert (job.state, job.reason, job.attempt) == ("dead", "bad_payload", 1)
    later = daemon.enqueue("noop")
    assert daemon.wait_job(later).state == "done"  # claims go on
    assert "broker_down" not in daemon.logs()
    daemon.assert_clean()
