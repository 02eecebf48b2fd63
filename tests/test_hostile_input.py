"""What producers, handlers and stored data may throw at the supervisor and the CLI.

Each case runs the real daemon or the real CLI against real brokers: the
supervisor stores what it can (replacing what it cannot), dead-letters what
it cannot run, and the CLI shows every job without letting its text drive the
terminal.
"""
import json
import time

import pytest

from supervisor import jsonvalues
from supervisor.backends import open_broker
from supervisor.client import Client
from supervisor.errors import BadInput
from supervisor.model import NewJob, error_info

from .daemon import Daemon, read_lines, tangguh
from .toolkit_fixtures import handlers_db  # noqa: F401 - a fixture
from .util import wait_for

ESCAPE = "\x1b]0;pwned\x07\x1b[31m"  # sets the terminal title, turns the text red
CLEAN = "nul \ufffd and a lone \ufffd surrogate"


@pytest.fixture
def daemon(tmp_path, broker_url):
    d = Daemon(tmp_path, broker_url=broker_url, handler_files=("testjobs.py", "hostile.py"),
               jobs={"backoff_base": 0.0})
    yield d
    d.stop()


@pytest.mark.parametrize("text", ['{"a":[1,2.5,null]}', ' {"a":1}', '{"a":1}\n', '{"a":1}{"b":2}', '{"a":1} x',
                                  '[1,2', '', ' ', 'NaN', '"\\ud800"', '{"a":', '"unterminated', '1e999', '-0',
                                  '[' * 100_000])
def test_the_decode_of_replies_and_payloads_returns_or_raises_what_json_loads_does(text):
    """A child's reply and a stored payload are read by the C scanner alone when they are one JSON
    value with nothing around it; any other text (a handler's stray write on the pipe, a payload
    stored by hand) must still come out as ``json.loads`` has it: the same value or the same error."""
    def outcome(decode):
        try:
            return "value", repr(decode(text))
        except (ValueError, RecursionError) as exc:
            return type(exc).__name__, str(exc)

    assert outcome(jsonvalues.decode) == outcome(json.loads)


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


# -- what a handler leaves in its child: numbers, endings, forks, signals, threads ---------------
# One child, so each job meets what the one before it left there (and the child's pid proves it).

def one_child(tmp_path, **supervisor):
    return Daemon(tmp_path, handler_files=("testjobs.py", "hostile.py"), supervisor=dict(workers=1, **supervisor))


def errors(job):
    return [(h["outcome"], h["error"]["class"]) for h in job.history]


def serves_on(d, pids):
    """The same child still serves: no crash, no replacement."""
    assert d.wait_job(d.enqueue("noop")).state == "done"
    assert d.worker_pids() == pids and not d.records(event="crash")
    d.assert_clean()


def test_counts_and_retry_delays_the_pipe_cannot_carry_are_dropped_in_the_child(tmp_path):
    d = one_child(tmp_path)
    try:
        d.start()
        pids = d.worker_pids()
        job = d.wait_job(d.enqueue("odd_counts"))
        assert (job.state, job.attempt, job.result, [h["outcome"] for h in job.history]) == (
            "done", 1, {"ok": True}, ["done"])
        wait_for(lambda: d.status()["counters"]["duplicates_suppressed"] == 2, message="the one sane count")
        # No float holds it, past int's 4,300-digit text limit, not a number: each gets the backoff.
        for after in ({"exp": 400}, {"exp": 5000}, "soon"):
            job = d.wait_job(d.enqueue("throttled", {"after": after}, max_attempts=2))
            assert (job.state, job.reason, job.attempt) == ("dead", "exception", 2), after
            assert errors(job) == [("retry", "Throttled"), ("dead", "Throttled")], after
        job = d.wait_job(d.enqueue("throttled", {"after": 3600}), states=("retrying",))
        assert job.run_at > time.time() + 3000  # a sane delay still crosses
        serves_on(d, pids)
    finally:
        d.stop()


def test_a_handlers_failure_the_child_cannot_describe_is_still_its_failure(tmp_path):
    d = one_child(tmp_path)
    try:
        d.start()
        pids = d.worker_pids()
        for type_, cls in (("str_exits", "StrExits"), ("str_interrupts", "StrInterrupts")):
            job = d.wait_job(d.enqueue(type_, max_attempts=1))
            assert (job.state, job.reason, job.attempt) == ("dead", "exception", 1), job.error
            assert (job.error["class"], job.error["message"]) == (cls, f"<unprintable {cls}>")
            assert f"raise {cls}()" in job.error["traceback"]  # described, not the last-resort stand-in
        job = d.wait_job(d.enqueue("busy", max_attempts=2))  # a RetryLater without a delay: the backoff
        assert (job.state, job.reason, errors(job)) == ("dead", "exception", [("retry", "Busy"), ("dead", "Busy")])
        assert "raise Busy()" in job.error["traceback"]
        job = d.wait_job(d.enqueue("shifty_result", max_attempts=1))
        assert (job.state, job.reason, job.attempt, (job.error or {}).get("class")) == (
            "dead", "exception", 1, "UnencodableReply")
        assert "Exceeds the limit" in job.error["message"], job.error
        serves_on(d, pids)
    finally:
        d.stop()


def test_a_process_the_handler_forked_never_answers_for_its_job(tmp_path):
    d = one_child(tmp_path)
    try:
        d.start()
        pids = d.worker_pids()
        marker = d.marker("forked")
        # The forked process leaves as Python would have had it: its exit code reaches the handler.
        for end, code in (("exit", 0), ("exit", 3), ("return", 0), ("raise", 1)):
            job = d.wait_job(d.enqueue("fork_and_wait", {"marker": marker, "end": end, "code": code}))
            assert (job.state, job.attempt, job.result) == ("done", 1, {"exit_code": code}), (end, job.history)
            assert [h["outcome"] for h in job.history] == ["done"]
        assert len(read_lines(marker)) == 4  # each effect once
        serves_on(d, pids)
    finally:
        d.stop()


def test_signal_handlers_and_masks_a_job_changed_are_reset_before_the_next_job(tmp_path):
    d = one_child(tmp_path, cancel_grace=60.0)
    try:
        d.start()
        pids = d.worker_pids()
        marker = d.marker("naps")
        for culprit in ("block_signals", "own_signal_handlers"):
            assert d.wait_job(d.enqueue(culprit)).result == {"pid": pids[0]}
            job = d.wait_job(d.enqueue("sleeper", max_attempts=1))  # 5 s of sleep, 0.5 s soft timeout
            assert (job.state, job.reason, (job.error or {}).get("class")) == ("dead", "timeout", "JobTimeout"), culprit
            assert int(job.history[0]["pid"]) == pids[0]
            d.wait_job(d.enqueue(culprit))
            nap = d.enqueue("napper", {"marker": marker, "seconds": 20})
            wait_for(lambda: ["started", nap] in read_lines(marker), timeout=30, message="the nap to start")
            assert tangguh("cancel", nap, "-c", d.config_path).returncode == 0
            job = d.wait_job(nap, states=("cancelled", "done", "dead"))
            assert job.state == "cancelled" and read_lines(marker)[-1] == ["saw", "Cancelled"], culprit
        assert not d.records(event="cancel_kill")
        serves_on(d, pids)
    finally:
        d.stop()


def test_a_thread_a_job_left_in_critical_does_not_hold_back_the_next_jobs_timeout(tmp_path):
    d = one_child(tmp_path)
    try:
        d.start()
        pids = d.worker_pids()
        assert d.wait_job(d.enqueue("start_flusher")).result == {"pid": pids[0]}
        job = d.wait_job(d.enqueue("sleeper", max_attempts=1))
        assert (job.state, job.reason, job.attempt, (job.error or {}).get("class")) == (
            "dead", "timeout", 1, "JobTimeout")
        assert float(job.history[0]["duration"]) < 4  # cut at its soft timeout, not after its 5 s sleep
        serves_on(d, pids)
    finally:
        d.stop()


def test_an_alarm_a_job_left_running_is_no_soft_timeout_for_a_later_job(tmp_path):
    d = one_child(tmp_path)
    try:
        d.start()
        pids = d.worker_pids()
        marker = d.marker("naps")
        assert d.wait_job(d.enqueue("leave_alarm", {"seconds": 0.3})).result == {"pid": pids[0]}
        nap = d.wait_job(d.enqueue("napper", {"marker": marker, "seconds": 1.5}, max_attempts=1))
        assert (nap.state, nap.attempt, nap.error) == ("done", 1, None), nap.history  # it has no soft timeout
        assert int(nap.history[0]["pid"]) == pids[0]
        job = d.wait_job(d.enqueue("sleeper", max_attempts=1))  # a job with its own still gets it
        assert (job.state, job.reason, (job.error or {}).get("class")) == ("dead", "timeout", "JobTimeout")
        serves_on(d, pids)
    finally:
        d.stop()


def test_a_thread_a_job_left_sending_progress_never_tears_a_later_jobs_reply(tmp_path):
    d = one_child(tmp_path)
    try:
        d.start()
        pids = d.worker_pids()
        assert d.wait_job(d.enqueue("start_reporter", {"seconds": 8})).result == {"pid": pids[0]}
        # Replies larger than the socket's buffer go out in several writes: the thread's frames
        # would land between them.
        for _ in range(6):
            job = d.wait_job(d.enqueue("big_result", {"size": 3 * 2 ** 20}, max_attempts=1))
            assert (job.state, job.attempt, len((job.result or {}).get("blob", ""))) == ("done", 1, 3 * 2 ** 20), job.history
        assert not d.records(event="bad_frame")
        serves_on(d, pids)
    finally:
        d.stop()


def test_an_async_handler_sees_its_soft_timeout_and_its_cancel_at_the_await_where_it_waits(tmp_path):
    d = one_child(tmp_path, cancel_grace=60.0)
    try:
        d.start()
        pids = d.worker_pids()
        marker = d.marker("naps")
        job = d.wait_job(d.enqueue("async_sleeper", {"marker": marker, "seconds": 20}, max_attempts=1))
        assert (job.state, job.reason, (job.error or {}).get("class")) == ("dead", "timeout", "JobTimeout")
        assert read_lines(marker)[-1] == ["saw", "JobTimeout"]  # its except clause ran: it could clean up
        nap = d.enqueue("async_napper", {"marker": marker, "seconds": 20})
        wait_for(lambda: ["started", nap] in read_lines(marker), timeout=30, message="the nap to start")
        assert tangguh("cancel", nap, "-c", d.config_path).returncode == 0
        assert d.wait_job(nap, states=("cancelled", "done", "dead")).state == "cancelled"
        assert read_lines(marker)[-1] == ["saw", "Cancelled"]
        assert not d.records(event="cancel_kill")
        serves_on(d, pids)
    finally:
        d.stop()


def test_a_task_an_async_handler_leaves_running_does_not_fail_its_finished_job(tmp_path):
    d = one_child(tmp_path)
    try:
        d.start()
        pids = d.worker_pids()
        job = d.wait_job(d.enqueue("async_stubborn", max_attempts=1))
        assert (job.state, job.attempt, job.result) == ("done", 1, {"pid": pids[0]}), job.history
        assert not d.records(event="timeout_kill")
        serves_on(d, pids)
    finally:
        d.stop()


def test_an_async_handler_under_a_sync_decorator_runs_and_its_result_is_stored(tmp_path):
    d = one_child(tmp_path)
    try:
        d.start()
        pids = d.worker_pids()
        marker = d.marker("runs")
        job = d.wait_job(d.enqueue("async_decorated", {"marker": marker}, max_attempts=1))
        assert (job.state, job.attempt, job.result) == ("done", 1, {"pid": pids[0]}), job.history
        assert read_lines(marker) == [["ran", job.id]]
        serves_on(d, pids)
    finally:
        d.stop()


@pytest.mark.parametrize("db", ["sqlite", "postgres"])
def test_a_transaction_cut_as_its_block_ends_is_rolled_back_and_the_next_jobs_run_theirs(tmp_path, db, request):
    url = f"sqlite:///{tmp_path}/handlers.db" if db == "sqlite" else request.getfixturevalue("handlers_db")
    d = Daemon(tmp_path, handler_files=("testjobs.py", "hostile.py"), supervisor={"workers": 1},
               toolkit={"database_url": url})
    try:
        d.start()
        pids = d.worker_pids()
        job = d.wait_job(d.enqueue("tx_cut_as_it_ends", max_attempts=1))
        assert (job.state, job.reason, (job.error or {}).get("class")) == ("dead", "timeout", "JobTimeout")
        for _ in range(2):  # on the same child: its transactions run, and hold none of the cut job's writes
            after = d.wait_job(d.enqueue("tx_effects", max_attempts=1))
            assert (after.state, after.result) == ("done", {"jobs": [], "pid": pids[0]}), after.error
        assert len(d.records(event="transaction_left_open")) == 1  # the cut job's, once
        serves_on(d, pids)
    finally:
        d.stop()
