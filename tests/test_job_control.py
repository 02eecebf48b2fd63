"""Job control with real supervisors: cancel a running job, progress in status, pause, supervisor records.

Each test runs ``tangguh run`` as a subprocess (tests/daemon.py) against a real
broker and drives it the way an operator would: through the broker's own
operations (what ``tangguh cancel``, ``queue pause`` and ``supervisors`` call),
the health socket and signals. Nothing is timed: the tests wait for states.
"""
import json
import os
import signal

import pytest

import supervisor
from supervisor import protocol, toolkit
from supervisor.child import timeouts
from supervisor.child.context import Context
from supervisor.model import NewJob

from .daemon import Daemon, tangguh
from .util import wait_for

HANDLERS = ("testjobs.py", "control.py")


@pytest.fixture(params=["sqlite", "postgres"])
def url(request):
    """SQLite (the embedded default) and one server broker: cancel and pause must work across processes."""
    return request.getfixturevalue(f"{request.param}_url")


def daemon(tmp_path, url, name="a", **sections):
    folder = tmp_path / name
    folder.mkdir()
    return Daemon(folder, broker_url=url, handler_files=HANDLERS, **sections)


def lines(path):
    return open(path).read().splitlines() if os.path.exists(path) else []


def started(d, job_id, marker):
    wait_for(lambda: any(line.startswith(f"started {job_id}") for line in lines(marker)), timeout=30,
             message=f"job {job_id} to start")
    return int(next(line for line in lines(marker) if line.startswith(f"started {job_id}")).split()[2])


def cancel_entry(job):
    entry = job.history[-1]
    assert entry["outcome"] == "cancelled", job.history
    return entry


@pytest.mark.parametrize("handler, evidence, killed", [
    ("cancel_cooperative", "saw ctx.cancelled()", False),  # asks ctx.cancelled() inside critical()
    ("cancel_ignored", "saw Cancelled", False),  # a pure-Python loop: Cancelled raised into it
    ("cancel_swallowed", "swallowed Cancelled", False),  # caught, and a result returned: cancelled all the same
    ("cancel_stuck", None, True),  # inside critical() past cancel_grace: killed
])
def test_a_running_cpu_bound_job_is_cancelled(tmp_path, url, handler, evidence, killed):
    # cancel_grace: long enough that a handler that stops by itself is never killed, short for the stuck one.
    grace = 1.0 if killed else 60.0
    d = daemon(tmp_path, url, supervisor={"workers": 1, "cancel_grace": grace})
    try:
        d.start()
        marker = d.marker("marker")
        job_id = d.enqueue(handler, {"marker": marker})
        pid = started(d, job_id, marker)
        out = tangguh("cancel", job_id, "--by", "ops@example", "--reason", "runaway", "-c", d.config_path)
        assert out.returncode == 0 and "requested" in out.stdout, out.stdout + out.stderr
        job = d.wait_job(job_id, states=("cancelled", "done", "dead"))
        assert job.state == "cancelled"
        entry = cancel_entry(job)
        assert (entry["by"], entry["reason"]) == ("ops@example", "runaway")
        assert job.attempt == 1  # never run again
        if evidence:
            assert evidence in lines(marker)
        kills = d.records(event="cancel_kill", job_id=job_id)
        assert bool(kills) == killed
        # The worker that ran it: still the same process unless it had to be killed.
        wait_for(lambda: d.status()["workers"] and d.status()["workers"][0]["state"] == "idle", timeout=30,
                 message="the worker idle again")
        assert (d.worker_pids() != [pid]) == killed
        status = d.status()
        assert status["counters"]["cancelled"] == 1
        metrics = tangguh("metrics", "-c", d.config_path).stdout
        assert f'tangguh_jobs_cancelled_total{{type="{handler}"}} 1.0' in metrics
        assert "tangguh_cancel_latency_seconds_count 1.0" in metrics
        d.signal(signal.SIGTERM)
        assert d.wait_exit() == 0
        d.assert_clean()
    finally:
        d.stop()


def test_a_result_that_crossed_the_cancel_stands_and_a_queued_job_never_starts(tmp_path, url):
    d = daemon(tmp_path, url, supervisor={"workers": 1})
    try:
        d.start()
        marker, release = d.marker("marker"), d.marker("release")
        running = d.enqueue("hold", {"marker": marker, "release": release})
        started(d, running, marker)
        queued = d.enqueue("noop", {"marker": marker})
        assert d.broker.cancel([queued], by="ops", reason="not needed") == {queued: "cancelled"}
        open(release, "w").close()
        assert d.wait_job(running).state == "done"
        assert d.job(queued).state == "cancelled"
        assert not any(line.startswith(queued) for line in lines(marker))  # never ran
        assert d.broker.cancel([running], by="ops", reason="late") == {running: "already_done"}
        d.signal(signal.SIGTERM)
        assert d.wait_exit() == 0
    finally:
        d.stop()


def test_a_prefetched_job_cancelled_before_it_started_never_runs(tmp_path, sqlite_url):
    d = daemon(tmp_path, sqlite_url, supervisor={"workers": 1}, broker={"prefetch": 2})
    try:
        d.start()
        marker, release = d.marker("marker"), d.marker("release")
        running = d.enqueue("hold", {"marker": marker, "release": release})
        started(d, running, marker)
        waiting = d.enqueue("noop", {"marker": marker})
        wait_for(lambda: d.status()["prefetched"] == 1, timeout=30, message="the noop job prefetched")
        # Claimed by the supervisor, so the broker answers "requested": the renewal carries it.
        assert d.broker.cancel([waiting], by="ops", reason="stale") == {waiting: "requested"}
        job = d.wait_job(waiting, states=("cancelled", "done"))
        assert job.state == "cancelled" and cancel_entry(job)["by"] == "ops"
        assert d.status()["prefetched"] == 0
        open(release, "w").close()
        assert d.wait_job(running).state == "done"
        assert not any(line.startswith(waiting) for line in lines(marker))  # never ran
        d.signal(signal.SIGTERM)
        assert d.wait_exit() == 0
        d.assert_clean()
    finally:
        d.stop()


def test_progress_shows_in_status_and_on_the_job(tmp_path, url):
    d = daemon(tmp_path, url, supervisor={"workers": 1})
    try:
        d.start()
        release = d.marker("release")
        job_id = d.enqueue("progressing", {"release": release})

        def shown():
            out = tangguh("status", "--json", "-c", d.config_path)
            workers = json.loads(out.stdout)["workers"]
            return any(w["job_id"] == job_id and w["progress"] == 0.5 and w["progress_note"] == "halfway"
                       for w in workers)

        wait_for(shown, timeout=30, message="progress 0.5 'halfway' in status --json")
        # The heartbeat carried it to the broker with the lease renewal.
        wait_for(lambda: (j := d.job(job_id)).progress == 0.5 and j.progress_note == "halfway", timeout=30,
                 message="progress stored on the job")
        open(release, "w").close()
        assert d.wait_job(job_id).state == "done"
        d.signal(signal.SIGTERM)
        assert d.wait_exit() == 0
    finally:
        d.stop()


def test_pause_is_seen_by_two_supervisors_sharing_a_broker(tmp_path, url):
    # Prefetch: each supervisor claims beyond its idle children, so a pause has buffered jobs to release.
    # Each serves a queue of its own (where its child gets busy) and the shared "default".
    a = daemon(tmp_path, url, "a", supervisor={"workers": 1}, broker={"queues": ["only_a", "default"], "prefetch": 4})
    b = daemon(tmp_path, url, "b", supervisor={"workers": 1}, broker={"queues": ["only_b", "default"], "prefetch": 4})
    try:
        a.start()
        b.start()
        marker, release = a.marker("marker"), a.marker("release")
        # Both children busy, then both prefetch buffers filled with "default" jobs.
        holds = [a.enqueue("hold", {"marker": marker, "release": release}, queue=q) for q in ("only_a", "only_b")]
        for job_id in holds:
            started(a, job_id, marker)
        waiting = [a.enqueue("noop", {"marker": marker}) for _ in range(6)]
        wait_for(lambda: a.status()["prefetched"] + b.status()["prefetched"] == 6, timeout=30,
                 message="the default jobs prefetched")
        # only_b first: a beat of a that sees "default" paused then sees "only_b" paused too, if
        # it asks for it (in the other order, a beat between the two commands passed the check).
        assert tangguh("queue", "pause", "only_b", "-c", a.config_path).returncode == 0
        assert tangguh("queue", "pause", "default", "-c", a.config_path).returncode == 0
        # Each sees the pauses of the queues it serves, and asks the broker for no others.
        for d, mine in ((a, ["default"]), (b, ["default", "only_b"])):
            wait_for(lambda d=d, mine=mine: d.status()["paused_queues"] == mine and d.status()["prefetched"] == 0,
                     timeout=30, message="the pause seen and the prefetched jobs released")
        open(release, "w").close()
        for job_id in holds:
            assert a.wait_job(job_id).state == "done"  # running jobs finish
        # Both supervisors idle, the queue paused: none of its jobs starts, on either.
        wait_for(lambda: all(w["state"] == "idle" for d in (a, b) for w in d.status()["workers"]), timeout=30,
                 message="both supervisors idle")
        assert [a.job(j).state for j in waiting] == ["queued"] * 6, [(a.job(j).history, a.job(j).queue) for j in waiting]
        assert not any(line.split()[0] in waiting for line in lines(marker))
        metrics = tangguh("metrics", "-c", b.config_path).stdout
        assert 'tangguh_queue_paused{queue="default"} 1.0' in metrics
        assert tangguh("queue", "resume", "default", "-c", b.config_path).returncode == 0
        assert tangguh("queue", "resume", "only_b", "-c", b.config_path).returncode == 0
        for job_id in waiting:
            assert a.wait_job(job_id).state == "done"
        for d in (a, b):
            d.signal(signal.SIGTERM)
            assert d.wait_exit() == 0
        a.assert_clean(queues=("only_a", "only_b", "default"))
    finally:
        a.stop()
        b.stop()


def test_every_supervisor_sharing_a_broker_is_visible_and_a_killed_one_shows_gone(tmp_path, url):
    # A short lease: the killed supervisor's record (ttl: three beats or the lease) goes stale soon.
    broker = {"lease_seconds": 1.5, "heartbeat_seconds": 0.3}
    a = daemon(tmp_path, url, "a", broker=broker)
    b = daemon(tmp_path, url, "b", broker=broker, supervisor={"workers": 1})  # another "machine": its own socket
    try:
        a.start()
        b.start()

        def records():
            out = tangguh("supervisors", "--json", "-c", a.config_path)
            assert out.returncode == 0, out.stderr
            return {r["pid"]: r for r in json.loads(out.stdout)}

        wait_for(lambda: {a.proc.pid, b.proc.pid} <= set(records()), timeout=30, message="both records")
        rec = records()[b.proc.pid]
        assert not rec["gone"] and rec["queues"] == ["default"] and rec["paused_queues"] == []
        assert [w["slot"] for w in rec["workers"]] == [0] and rec["counters"]["succeeded"] == 0
        assert rec["config"] == b.config_path and rec["started"] > 0 and rec["host"] and rec["version"]
        b.signal(signal.SIGKILL)
        wait_for(lambda: records()[b.proc.pid]["gone"], timeout=30, message="the killed supervisor gone")
        assert not records()[a.proc.pid]["gone"]
        text = tangguh("supervisors", "-c", a.config_path).stdout
        assert f" {b.proc.pid} " in text and " gone " in text and " live " in text
        a.signal(signal.SIGTERM)
        assert a.wait_exit() == 0
        assert a.proc.pid not in records()  # a clean stop removes its record
    finally:
        a.stop()
        b.stop()


def test_a_job_not_started_before_it_expires_never_runs_and_is_counted(tmp_path, sqlite_url):
    d = daemon(tmp_path, sqlite_url, supervisor={"workers": 1})
    try:
        d.start()
        marker = d.marker("marker")
        # Due in 0.5 s, expired after 0.2 s: the claim that finds it due ends it expired.
        late = d.enqueue("noop", {"marker": marker}, delay=0.5, expires_in=0.2)
        fresh = d.enqueue("noop", {"marker": marker}, expires_in=600)
        assert d.wait_job(late, states=("expired", "done")).state == "expired"
        assert d.wait_job(fresh).state == "done"
        assert [line.split()[0] for line in lines(marker)] == [fresh]
        wait_for(lambda: 'tangguh_jobs_expired_total{type="noop"} 1.0' in tangguh("metrics", "-c", d.config_path).stdout,
                 timeout=10, message="the expiry counted")
        assert d.status()["counters"]["expired"] == 1
        d.signal(signal.SIGTERM)
        assert d.wait_exit() == 0
    finally:
        d.stop()


# -- the child's side, in this process ---------------------------------------------------------

@pytest.fixture
def child_signals():
    """The child's signal handlers, installed here for one test and put back after it."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGALRM, signal.SIGTERM, protocol.CANCEL_SIGNAL)}
    timeouts.install()
    yield
    timeouts.disarm()
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def ring():
    os.kill(os.getpid(), protocol.CANCEL_SIGNAL)


def test_cancelled_waits_for_critical_is_raised_once_and_a_stale_bell_is_ignored(child_signals):
    timeouts.disarm()
    ring()  # between jobs: stale, nothing happens
    assert not timeouts.cancel_requested()
    timeouts.arm(None)
    reached = False
    with pytest.raises(supervisor.Cancelled):
        with supervisor.critical():
            ring()
            wait_for(timeouts.cancel_requested, timeout=5, message="the bell")
            reached = True  # inside critical(): not raised yet
    assert reached and timeouts.cancel_requested()
    ring()  # a second bell for the same job: raised once only
    wait_for(lambda: True)
    timeouts.disarm()
    assert timeouts.cancel_requested()  # still readable for the reply
    timeouts.arm(None)
    assert not timeouts.cancel_requested()  # the next job starts clean


def test_progress_is_checked_and_coalesced():
    sent = []
    toolkit.attach_master(sent.append)
    try:
        ctx = Context({"id": "job_1", "type": "t", "queue": "default", "attempt": 1, "max_attempts": 1,
                       "token": 1})
        for bad in (-0.1, 1.5, float("nan"), True, "half"):
            with pytest.raises(ValueError, match="progress fraction must be a number from 0 to 1"):
                ctx.progress(bad)
        with pytest.raises(ValueError, match="progress note must be a string"):
            ctx.progress(0.5, note=7)
        for i in range(100):
            ctx.progress(i / 200, "x" * 500)
        ctx.progress(1.0)  # the last one always leaves
        assert [m["fraction"] for m in sent] == [0.0, 1.0]
        assert sent[0] == {"op": "progress", "job_id": "job_1", "fraction": 0.0, "note": "x" * protocol.MAX_NOTE}
    finally:
        toolkit.attach_master(None)


@pytest.mark.parametrize("queues", [["default"], ["other", "default"]])
def test_a_dead_supervisors_job_in_a_paused_queue_has_its_lease_taken_back(tmp_path, broker_url, queues):
    """A paused queue was left out of the claim: on Redis, whose claim looks only at the queues
    it names, a dead supervisor's job there stayed running, its lease long expired, for the
    whole pause (never dead-lettered, its waiters never told); with every queue of a supervisor
    paused it made no claim at all, on any broker (a supervisor restarted after a crash left its
    own last jobs running). The claim names paused queues too now: it leases none of their jobs."""
    d = Daemon(tmp_path, broker_url, broker={"queues": queues})
    try:
        d.broker.migrate()
        lost = d.broker.enqueue(NewJob("noop", {}, max_attempts=1))
        waiting = d.broker.enqueue(NewJob("noop", {}))
        assert [job.id for job in d.broker.claim(["default"], 1, 2.0, "ghost:1:0")] == [lost]  # then it died
        d.broker.pause("default")
        d.start()
        wait_for(lambda: d.status()["paused_queues"] == ["default"], message="the pause seen")
        job = d.wait_job(lost, states=("dead",), timeout=30)
        assert job.history[-1]["outcome"] == "lease_expired"
        assert d.job(waiting).state == "queued"  # paused: named in the claim, never leased
        d.broker.resume("default")
        assert d.wait_job(waiting).state == "done"
        d.assert_clean()
    finally:
        d.stop()


def test_a_job_shows_the_attempts_its_type_allows_not_the_producers_default(tmp_path, url):
    """`tangguh enqueue stuck` stores the config's 3 (the producer does not know the type); the
    supervisor runs it under the decorator's max_attempts=1 and dead-letters it after one attempt,
    yet `tangguh job` said "attempt 1 of 3"."""
    d = Daemon(tmp_path, broker_url=url, handler_files=("outcomes.py",))
    try:
        d.start()
        done = tangguh("enqueue", "stuck", "-c", d.config_path)
        assert done.returncode == 0, done.stderr
        job_id = done.stdout.strip()
        job = d.wait_job(job_id)
        assert (job.state, job.attempt, job.max_attempts) == ("dead", 1, 3)  # what the broker stores stays
        assert job.attempts_allowed == 1 and job.history[-1]["max_attempts"] == 1
        for args in (["job", job_id], ["dlq", "show", job_id]):
            shown = tangguh(*args, "-c", d.config_path)
            assert shown.returncode == 0 and "1 of 1" in shown.stdout and "1 of 3" not in shown.stdout, args
        listed = tangguh("jobs", "--state", "dead", "-c", d.config_path).stdout
        assert "1/1" in listed and "1/3" not in listed
        shown = json.loads(tangguh("job", job_id, "--json", "-c", d.config_path).stdout)
        assert (shown["max_attempts"], shown["attempts_allowed"]) == (3, 1)
        from supervisor.web.redact import Redactor  # what the console's pages and API show

        assert Redactor(()).job_dict(job)["attempts_allowed"] == 1
        d.signal(signal.SIGTERM)
        assert d.wait_exit() == 0
        d.assert_clean()
    finally:
        d.stop()


def test_the_attempts_allowed_come_from_the_last_entry_a_supervisor_closed():
    from supervisor.model import allowed_attempts

    assert allowed_attempts([], 5) == 5  # no attempt ended yet: what was stored
    closed = {"ended_at": 1.0, "outcome": "retry", "max_attempts": 2}
    expired = {"ended_at": 2.0, "outcome": "lease_expired"}  # closed by the broker's claim: no limit in it
    assert allowed_attempts([closed, expired, {"started_at": 3.0}], 5) == 2
    assert allowed_attempts([{"ended_at": 1.0, "max_attempts": True}, {"max_attempts": "9"}], 5) == 5
