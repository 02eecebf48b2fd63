"""supervisor.testing and its pytest fixtures: run_jobs in-process against a real supervisor."""
import asyncio
import datetime
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

import supervisor
from supervisor import protocol, testing
from supervisor.errors import ConfigError
from supervisor.model import MAX_DELAY, NewJob

from .handlers import outcomes
from .util import wait_for

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def tangguh_handlers(tmp_path):
    folder = tmp_path / "handlers"
    folder.mkdir()
    shutil.copy(os.path.join(HERE, "handlers", "outcomes.py"), folder)
    return str(folder)


def enqueue_the_four(client, broker):
    """Success, retry-then-success, permanent failure, and bad payloads stored behind the producer's back
    (one of the wrong type, one the schema's own __post_init__ refuses)."""
    return {
        "success": outcomes.greet.enqueue({"name": "ada", "times": 2}),
        "retry_then_success": client.enqueue("flaky", {"succeed_on": 2}),
        "permanent": client.enqueue("broken", {}),
        "bad_payload": broker.enqueue(NewJob("greet", {"name": 7})),
        "refused_by_schema": broker.enqueue(NewJob("greet", {"name": "ada", "times": 0})),
    }


def summary(job):
    return job.state, job.reason, job.attempt, job.result


EXPECTED = {
    "success": ("done", None, 1, {"hello": "adaada"}),
    "retry_then_success": ("done", None, 2, {"attempt": 2}),
    "permanent": ("dead", "permanent", 1, None),
    "bad_payload": ("dead", "bad_payload", 1, None),
    "refused_by_schema": ("dead", "bad_payload", 1, None),
}


def test_in_process_and_under_a_real_supervisor_the_outcomes_are_the_same(tmp_path, tangguh_client, tangguh_broker,
                                                                          tangguh_config):
    ids = enqueue_the_four(tangguh_client, tangguh_broker)
    ran = testing.run_jobs(tangguh_client)
    in_process = {name: summary(tangguh_client.get(job_id)) for name, job_id in ids.items()}
    assert in_process == EXPECTED
    assert [(r.type, r.outcome, r.reason) for r in ran if r.job_id == ids["retry_then_success"]] == [
        ("flaky", "retry", "exception"), ("flaky", "done", None)]

    # The same jobs on a second broker, run by a real supervisor with the same handlers and config.
    real_dir = tmp_path / "real"
    real_dir.mkdir()
    config = testing.write_config(str(real_dir), os.path.dirname(outcomes_file(tangguh_config)))
    supervisor_ = testing.Supervisor(config).start()
    try:
        with supervisor.Client.from_config(config) as client:
            supervisor.configure(client=client)
            real_ids = enqueue_the_four(client, client.broker)
            real = {name: summary(supervisor_.wait_job(job_id)) for name, job_id in real_ids.items()}
    finally:
        supervisor.configure(client=tangguh_client)
        supervisor_.stop()
    assert real == in_process


def outcomes_file(config_path):
    return os.path.join(supervisor.config.load(config_path).supervisor.handlers, "outcomes.py")


def test_the_backoff_passes_at_once(tangguh_config, tangguh_client):
    long_backoff = testing.write_config(os.path.dirname(tangguh_config),
                                        os.path.dirname(outcomes_file(tangguh_config)),
                                        jobs={"backoff_base": 3600.0, "backoff_cap": 7200.0})
    with supervisor.Client.from_config(long_backoff) as client:
        job_id = client.enqueue("flaky", {"succeed_on": 3})
        ran = testing.run_jobs(client)
        assert client.get(job_id).state == "done"
    assert [(r.attempt, r.outcome, r.delay) for r in ran] == [(1, "retry", 3600.0), (2, "retry", 7200.0),
                                                              (3, "done", None)]


def test_after_a_skipped_backoff_the_producer_stamps_on_the_clock_the_jobs_saw(tangguh_config, tangguh_client):
    """run_jobs skipped an hour's backoff by moving its clock; the producer stamped later jobs
    with the real time: a job given 10 minutes to start ended expired at once, and a delayed
    job ran without the clock.advance the docs ask for."""
    long_backoff = testing.write_config(os.path.dirname(tangguh_config),
                                        os.path.dirname(outcomes_file(tangguh_config)),
                                        jobs={"backoff_base": 3600.0, "backoff_cap": 7200.0})
    with supervisor.Client.from_config(long_backoff) as client:
        client.enqueue("flaky", {"succeed_on": 2})
        assert [r.outcome for r in testing.run_jobs(client)] == ["retry", "done"]
        soon = client.enqueue("greet", {"name": "ada"}, expires_in=600)
        later = client.enqueue("greet", {"name": "bob"}, delay=60)
        assert [r.job_id for r in testing.run_jobs(client)] == [soon]
        assert client.get(soon).state == "done"
        testing.clock.advance(60)
        assert [r.job_id for r in testing.run_jobs(client)] == [later]


def test_each_test_of_an_application_starts_on_real_time(tmp_path):
    """The clock run_jobs moves is the process's: only the tangguh_client fixture put it back, so
    after one test skipped an hour's backoff, a later test on tangguh_config (its own client) ran
    a job delayed by a minute at once, without the clock.advance that production needs."""
    (tmp_path / "handlers").mkdir()
    shutil.copy(os.path.join(HERE, "handlers", "outcomes.py"), tmp_path / "handlers")
    (tmp_path / "pytest.ini").write_text("[pytest]\ntangguh_handlers = handlers\n")
    (tmp_path / "test_app.py").write_text(textwrap.dedent("""
        import supervisor
        from supervisor import testing

        def test_one_skips_an_hour(tangguh_config):
            with supervisor.Client.from_config(tangguh_config) as client:
                client.enqueue("flaky", {"succeed_on": 2})
                testing.run_jobs(client)
            testing.clock.advance(3600)

        def test_two_delays_a_minute(tangguh_config):
            with supervisor.Client.from_config(tangguh_config) as client:
                client.enqueue("greet", {"name": "ada"}, delay=60)
                assert testing.run_jobs(client) == []
    """))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "-p", "no:randomly", "test_app.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_handler_decorated_with_its_own_queue_is_enqueued_and_run_in_a_test(tangguh_client, tangguh_config):
    """The test config served `default` only: `notify.enqueue` was refused ("queue 'emails' is
    not one of the configured broker.queues"), where a daemon serving that queue runs it."""
    assert supervisor.config.load(tangguh_config).broker.queues == ["default", "emails"]
    job_id = outcomes.notify.enqueue({})
    assert [(r.job_id, r.result) for r in testing.run_jobs(tangguh_client)] == [(job_id, {"queue": "emails"})]


def test_run_jobs_given_one_queue_as_a_string_runs_that_queue(tangguh_client):
    """queues="emails" was taken letter by letter: run_jobs claimed from "e", "m"... and ran nothing."""
    outcomes.greet.enqueue({"name": "ada"})
    job_id = outcomes.notify.enqueue({})
    assert [r.job_id for r in testing.run_jobs(tangguh_client, queues="emails")] == [job_id]


def test_a_soft_timeout_in_process(tangguh_client):
    job_id = tangguh_client.enqueue("slow", {})
    (ran,) = testing.run_jobs(tangguh_client)
    assert (ran.outcome, ran.reason, ran.error) == ("dead", "timeout", "JobTimeout: soft timeout")
    assert tangguh_client.get(job_id).state == "dead"


def test_a_soft_timeout_in_process_leaves_the_tests_own_alarm_set(tangguh_client):
    """The soft timeout's timer is the process's one ITIMER_REAL: pytest-timeout's (signal method)
    was replaced by the job's and then cleared, so a test that hung after run_jobs was never
    stopped. The test's own timer now runs on, less the time the job took."""
    tangguh_client.enqueue("slow", {})
    previous = signal.signal(signal.SIGALRM, lambda *_: None)
    signal.setitimer(signal.ITIMER_REAL, 3600)  # as pytest-timeout arms it
    try:
        (ran,) = testing.run_jobs(tangguh_client)
        left, _ = signal.getitimer(signal.ITIMER_REAL)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert ran.reason == "timeout" and 0 < left <= 3600


@supervisor.job("interrupted", max_attempts=3)
def interrupted(ctx, payload):
    if payload.get("ctrl_c"):
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C on the terminal, while the handler runs
        time.sleep(5)
    raise KeyboardInterrupt  # a handler's own: a failed attempt, as in the daemon


def test_ctrl_c_while_run_jobs_runs_a_handler_stops_the_test(tangguh_client):
    """Ctrl-C while a handler ran in run_jobs was the handler's KeyboardInterrupt: a failed attempt,
    the job run again, and pytest went on with the next test as if nothing had been pressed. It is
    raised from run_jobs now; a KeyboardInterrupt the handler raises itself stays a failed attempt."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in an interactive pytest
    try:
        tangguh_client.enqueue("interrupted", {})
        (ran,) = testing.run_jobs(tangguh_client, handlers=[interrupted], until=1)
        assert (ran.outcome, ran.error) == ("retry", "KeyboardInterrupt: ")
        job_id = tangguh_client.enqueue("interrupted", {"ctrl_c": True}, priority=5)
        with pytest.raises(KeyboardInterrupt):
            testing.run_jobs(tangguh_client, handlers=[interrupted], until=1)
        assert tangguh_client.get(job_id).attempt == 1  # not run again
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)


@supervisor.job("later")
def later(ctx, payload):
    delays = {"timedelta": datetime.timedelta(minutes=2), "text": "soon", "none": None, "huge": 2 ** 1100}
    raise supervisor.RetryLater(delays[payload["as"]])


def test_retry_later_takes_a_timedelta_and_a_delay_that_is_no_number_gets_the_backoff(tangguh_client):
    """RetryLater(timedelta(minutes=2)) raised TypeError in its own constructor: the job failed as a
    TypeError with the backoff, not as the handler's RetryLater; so did RetryLater("soon"), for which
    the README promises the usual backoff. An int no float holds (RetryLater(2 ** attempts) past
    attempt 1023) failed as an OverflowError; it is the longest delay, ten years, as 1e300 is."""
    kinds = ("timedelta", "text", "none", "huge")
    ids = {kind: tangguh_client.enqueue("later", {"as": kind}) for kind in kinds}
    ran = {r.job_id: r for r in testing.run_jobs(tangguh_client, handlers=[later], until=len(kinds))}
    assert (ran[ids["timedelta"]].outcome, ran[ids["timedelta"]].delay) == ("retry", 120.0)
    assert ran[ids["timedelta"]].error == "RetryLater: retry in 120s"
    assert (ran[ids["huge"]].outcome, ran[ids["huge"]].delay) == ("retry", MAX_DELAY)
    for kind in ("text", "none"):
        assert (ran[ids[kind]].outcome, ran[ids[kind]].error) == ("retry", "RetryLater: retry later")
        assert ran[ids[kind]].delay is not None and ran[ids[kind]].delay != 120.0  # the backoff


def test_until_a_number_of_attempts_and_unknown_types(tangguh_client):
    tangguh_client.enqueue("flaky", {"succeed_on": 2})
    tangguh_client.enqueue("no_such_type", {})
    assert [r.outcome for r in testing.run_jobs(tangguh_client, until=1)] == ["retry"]
    rest = testing.run_jobs(tangguh_client)
    assert sorted((r.type, r.outcome, r.reason) for r in rest) == [("flaky", "done", None),
                                                                   ("no_such_type", "dead", "unknown_type")]


def test_handlers_given_as_functions(tangguh_client):
    outcomes.greet.enqueue({"name": "x"})
    (ran,) = testing.run_jobs(tangguh_client, handlers=[outcomes.greet])
    assert ran.result == {"hello": "x"}


def test_handlers_given_as_one_handler_or_module_and_a_plain_function_refused(tangguh_client):
    """handlers=greet (one handler, or one module) failed with "'Handler' object is not iterable";
    a plain function in the list was dropped without a word, its jobs dead as unknown_type."""
    first = outcomes.greet.enqueue({"name": "x"})
    assert [r.job_id for r in testing.run_jobs(tangguh_client, handlers=outcomes.greet)] == [first]
    second = outcomes.greet.enqueue({"name": "y"})
    assert [r.job_id for r in testing.run_jobs(tangguh_client, handlers=outcomes)] == [second]

    def undecorated(ctx, payload):
        return None

    with pytest.raises(ValueError, match=r"run_jobs\(handlers=...\): .*undecorated.* is not a handler made by"):
        testing.run_jobs(tangguh_client, handlers=[outcomes.greet, undecorated])


@supervisor.job("fetch_async", max_attempts=2)
async def fetch_async(ctx, payload):
    await asyncio.sleep(0)
    return {"fetched": payload["url"]}


def test_run_jobs_from_an_async_test_runs_async_handlers_as_the_daemon_does(tangguh_client):
    """Called from a coroutine (an async test: pytest-asyncio, anyio, a FastAPI app's tests), every
    async handler failed "Cannot run the event loop while another loop is running", retried to
    dead, where the daemon's child runs it on a loop of its own."""
    job_id = tangguh_client.enqueue("fetch_async", {"url": "/a"})

    async def test_body():
        return testing.run_jobs(tangguh_client, handlers=[fetch_async])

    (ran,) = asyncio.run(test_body())
    assert (ran.job_id, ran.outcome, ran.result) == (job_id, "done", {"fetched": "/a"})


@supervisor.job("texted", rate_limit="1/m")
def texted(ctx, payload):
    return {"to": payload["to"]}


def test_jobs_held_back_by_a_rate_limit_run_as_the_daemon_runs_them(tangguh_client):
    """Past the bucket's first token run_jobs stopped, the rest of a rate-limited type left
    queued, where the daemon runs them as tokens come back: the clock now jumps to the next
    token as it jumps over a backoff."""
    ids = [tangguh_client.enqueue("texted", {"to": n}) for n in range(3)]
    ran = testing.run_jobs(tangguh_client, handlers=[texted])
    assert [(r.job_id, r.outcome) for r in ran] == [(i, "done") for i in ids]
    starts = [tangguh_client.get(i).history[0]["started_at"] for i in ids]
    assert starts[1] - starts[0] >= 60 and starts[2] - starts[1] >= 60  # one a minute, on the test's clock


@supervisor.job("big_result", max_attempts=3)
def big_result(ctx, payload):
    return {"blob": "x" * protocol.MAX_MESSAGE}


@supervisor.job("int_key_result", max_attempts=2)
def int_key_result(ctx, payload):
    return {1: "a"}


def test_a_result_the_daemon_cannot_store_fails_in_process_too(tangguh_client):
    big = tangguh_client.enqueue("big_result", {})
    keyed = tangguh_client.enqueue("int_key_result", {})
    ran = testing.run_jobs(tangguh_client, handlers=[big_result, int_key_result])
    assert [(r.type, r.outcome, r.reason) for r in ran if r.job_id == big] == [
        ("big_result", "dead", "result_too_large")]  # dead at once, as the child's reply makes it
    assert [(r.type, r.outcome, r.reason) for r in ran if r.job_id == keyed] == [
        ("int_key_result", "retry", "exception"), ("int_key_result", "dead", "exception")]
    job = tangguh_client.get(big)
    assert (job.state, job.reason, job.attempt, job.result) == ("dead", "result_too_large", 1, None)
    assert job.error["message"].startswith("result: message of ")
    assert tangguh_client.get(keyed).error["message"] == (
        "handler result: the key 1 is int, not a string (JSON object keys are strings)")


BILLING = """
import supervisor

CALLS = []


def charge_card(amount):
    return f"REAL CHARGE of {amount}"  # the production side effect


@supervisor.job("charge")
def charge(ctx, payload):
    CALLS.append(payload["amount"])
    return charge_card(payload["amount"])
"""


def test_run_jobs_runs_the_handler_module_the_test_imported_and_patched(tangguh_handlers, tangguh_client,
                                                                           monkeypatch):
    with open(os.path.join(tangguh_handlers, "billing.py"), "w") as f:
        f.write(BILLING)
    monkeypatch.syspath_prepend(tangguh_handlers)
    try:
        import billing

        monkeypatch.setattr(billing, "charge_card", lambda amount: f"fake charge of {amount}")
        billing.charge.enqueue({"amount": 5})
        (ran,) = testing.run_jobs(tangguh_client)  # the config's handlers folder
        billing.charge.enqueue({"amount": 6})
        (again,) = testing.run_jobs(tangguh_client)
        assert (ran.result, again.result) == ("fake charge of 5", "fake charge of 6")
        assert billing.CALLS == [5, 6]
    finally:
        sys.modules.pop("billing", None)  # a module of this test's folder only


def test_assertions_on_enqueued_jobs(tangguh_client):
    outcomes.greet.enqueue({"name": "ada"}, resource_id="user:1")
    outcomes.greet.enqueue({"name": "bob"})
    testing.assert_enqueued("greet", where={"name": "ada", "resource_id": "user:1"})
    testing.assert_enqueued("greet", count=2)
    testing.assert_not_enqueued("greet", where={"name": "eve"})
    testing.assert_not_enqueued("broken")
    with pytest.raises(AssertionError, match=r"expected 1 enqueued 'greet' job\(s\) matching \{'name': 'eve'\}, found 0"):
        testing.assert_enqueued("greet", where={"name": "eve"})
    with pytest.raises(AssertionError):
        testing.assert_not_enqueued("greet", where={"name": "bob"})
    testing.run_jobs(tangguh_client)
    assert [j.payload["name"] for j in testing.jobs_in_state("done", "greet")] == ["ada", "bob"]
    testing.assert_not_enqueued("greet")


def test_assertions_take_the_handler_as_the_job_type(tangguh_client):
    """assert_enqueued(send_receipt) (the handler the test enqueued through) failed with
    "'Handler' object is not iterable"; jobs_in_state(type=greet) too."""
    outcomes.greet.enqueue({"name": "ada"})
    testing.assert_enqueued(outcomes.greet, where={"name": "ada"})
    testing.assert_not_enqueued(supervisor.JobRef("broken"))
    testing.run_jobs(tangguh_client)
    assert [j.type for j in testing.jobs_in_state("done", outcomes.greet)] == ["greet"]


def test_assertions_see_jobs_waiting_on_parents_and_retrying(tangguh_client):
    charge, email = tangguh_client.chain([("flaky", {"succeed_on": 2}), ("greet", {"name": "ada"})])
    assert tangguh_client.get(email).state == "waiting"
    testing.assert_enqueued("greet", where={"name": "ada"})
    with pytest.raises(AssertionError, match=r"\('waiting', \{'name': 'ada'\}\)"):
        testing.assert_not_enqueued("greet")
    assert [r.outcome for r in testing.run_jobs(tangguh_client, until=1)] == ["retry"]
    assert tangguh_client.get(charge).state == "retrying"
    testing.assert_enqueued("flaky")
    testing.run_jobs(tangguh_client)
    testing.assert_not_enqueued("flaky")
    testing.assert_not_enqueued("greet")


def test_wait_job_returns_a_cancelled_job_and_a_timeout_names_the_state(tangguh_config, tangguh_client):
    sup = testing.Supervisor(tangguh_config)  # not started: wait_job only reads the broker
    cancelled = tangguh_client.enqueue("greet", {"name": "ada"})
    tangguh_client.cancel(cancelled)
    assert sup.wait_job(cancelled, timeout=5).state == "cancelled"
    queued = tangguh_client.enqueue("greet", {"name": "bob"})
    with pytest.raises(AssertionError, match=f"job {queued} .*: it is still queued"):
        sup.wait_job(queued, timeout=0)


def test_a_hard_timeout_with_a_real_supervisor(tangguh_client, tangguh_supervisor):
    job = tangguh_supervisor.wait_job(outcomes.stuck.enqueue({}))
    assert (job.state, job.reason, job.error["class"]) == ("dead", "timeout", "HardTimeout")


def test_a_supervisor_that_does_not_start_in_time_is_not_left_running(tangguh_config):
    """start() timed out with an AssertionError and left `tangguh run` going: in a session of its
    own, the test run's end did not reach it, and the fixture never got to stop it."""

    def running():
        return [p for p in psutil.process_iter(["cmdline"]) if tangguh_config in (p.info["cmdline"] or [])]

    sup = testing.Supervisor(tangguh_config)
    with pytest.raises(AssertionError, match="timed out after 0s waiting for the supervisor to start"):
        sup.start(timeout=0)
    try:
        assert sup.proc is None
        wait_for(lambda: not running(), message="the supervisor that did not start to be gone")
    finally:
        for p in running():
            p.kill()


def test_run_jobs_without_a_client_says_how_to_configure_one(monkeypatch):
    monkeypatch.delenv("TANGGUH_CONFIG", raising=False)
    monkeypatch.delenv("TANGGUH_BROKER_URL", raising=False)
    before = supervisor.jobref.save()
    supervisor.configure()
    try:
        with pytest.raises(ConfigError, match="supervisor.configure"):
            testing.run_jobs()
    finally:
        supervisor.jobref.restore(before)


@supervisor.job("hand_on")
def hand_on(ctx, payload):
    return {"next": outcomes.greet.enqueue({"name": payload["name"]})}


def test_a_follow_up_enqueue_goes_to_the_client_run_jobs_was_given(tangguh_config, monkeypatch):
    """With no default client set, a handler's follow-up `.enqueue()` failed in run_jobs with
    "no default client" (retried, then dead), where in a daemon's child it goes to the broker
    the job came from: run_jobs lends it the client it runs jobs from, and only while it runs."""
    monkeypatch.delenv("TANGGUH_CONFIG", raising=False)
    monkeypatch.delenv("TANGGUH_BROKER_URL", raising=False)
    before = supervisor.jobref.save()
    supervisor.configure()
    try:
        with supervisor.Client.from_config(tangguh_config) as client:
            client.enqueue("hand_on", {"name": "ada"})
            ran = testing.run_jobs(client, handlers=[hand_on, outcomes.greet])
            assert [(r.type, r.outcome) for r in ran] == [("hand_on", "done"), ("greet", "done")]
            assert ran[0].result == {"next": ran[1].job_id}
        assert supervisor.jobref.save() is None
    finally:
        supervisor.jobref.restore(before)


def test_run_jobs_needs_a_sqlite_broker(redis_url):
    with supervisor.Client.from_url(redis_url) as client, pytest.raises(ValueError, match="SQLite broker"):
        testing.run_jobs(client)


def test_stop_fails_when_a_process_a_job_started_outlives_the_supervisor(tmp_path):
    """Children lead sessions of their own, out of the master's process group: Supervisor.stop()
    looked only at that group, so it passed whatever outlived it. A job that detaches a helper
    (start_new_session=True: the child's kill does not reach it) must fail the stop."""
    handlers = tmp_path / "handlers"
    handlers.mkdir()
    pid_file = tmp_path / "helper.pid"
    (handlers / "detach.py").write_text(textwrap.dedent(f"""
        import subprocess
        from supervisor import job

        @job("detach")
        def detach(ctx, payload):
            p = subprocess.Popen(["sleep", "1000"], start_new_session=True)
            open({str(pid_file)!r}, "w").write(str(p.pid))
    """))
    config = testing.write_config(str(tmp_path), str(handlers))
    sup = testing.Supervisor(config).start()
    helper = None
    try:
        with supervisor.Client.from_config(config) as client:
            assert sup.wait_job(client.enqueue("detach", {})).state == "done"
        helper = psutil.Process(int(pid_file.read_text()))
        with pytest.raises(AssertionError, match="outlived it"):
            sup.stop()
    finally:
        if helper is not None:
            helper.kill()
        sup.stop()
