"""Lease renewal, seen from the broker: a healthy job that outlives its lease many times over.

Two real supervisors share one broker. The job that runs for 3x ``lease_seconds``
must keep its lease (the heartbeat pushes ``lease_until`` forward, read back
from the broker while it runs), so the other supervisor never reclaims it: it
runs exactly once, under one token.
"""
import os
import signal

import pytest

from supervisor.model import NewJob

from .daemon import Daemon, read_lines
from .util import wait_for

LEASE = 1.0


@pytest.fixture
def pair(tmp_path, broker_url):
    sups = [Daemon(tmp_path / name, broker_url=broker_url, broker={"lease_seconds": LEASE, "heartbeat_seconds": 0.2})
            for name in ("a", "b")]
    yield sups
    open(tmp_path / "release", "w").close()  # a failed test must not leave the job holding the stop
    for d in sups:
        d.stop()


def test_a_job_longer_than_its_lease_keeps_it_and_runs_once(pair, tmp_path):
    for d in pair:
        d.start()
    a = pair[0]
    marker, release = str(tmp_path / "m"), str(tmp_path / "release")
    job_id = a.enqueue("hold", {"marker": marker, "release": release, "max_wait": 60})
    wait_for(lambda: read_lines(marker), message="the job to start")
    first = a.job(job_id)
    assert first.state == "running"
    started = a.broker.now()
    seen = []

    def renewed_past_three_leases():
        job = a.job(job_id)
        assert (job.state, job.token, job.attempt, job.owner) == ("running", first.token, 1, first.owner), job
        if not seen or job.lease_until != seen[-1]:
            seen.append(job.lease_until)
        return a.broker.now() > started + 3 * LEASE

    wait_for(renewed_past_three_leases, timeout=30, interval=0.05, message="three lease lengths of running")
    # The stored expiry moved forward again and again, well past the one the claim set.
    assert seen == sorted(seen) and len(seen) >= 4, seen
    assert seen[-1] > first.lease_until + 2 * LEASE, (first.lease_until, seen)
    open(release, "w").close()
    job = a.wait_job(job_id)
    assert (job.state, job.attempt, job.token) == ("done", 1, first.token)
    assert [h["outcome"] for h in job.history] == ["done"]
    assert [line[0] for line in read_lines(marker)] == ["started", "finished"]  # one run
    for d in pair:
        assert d.status()["counters"]["lease_lost"] == 0
        d.signal(signal.SIGTERM)
        assert d.wait_exit() == 0
    pair[0].assert_clean()


def test_our_own_claim_of_a_job_whose_lease_ran_out_kills_the_attempt_still_running(tmp_path):
    """Our lease on a running job ran out (renewals that did not land: a master frozen longer
    than the lease, a heartbeat whose calls failed) and our own next claim takes the job again
    before a beat sees the loss. The old attempt is then as lost as if another supervisor had
    taken it: its child is killed, not left running beside the new attempt, and finishing it
    must not stop the renewal of the new attempt's lease."""
    import sqlite3

    # A long beat: the claim, not a renewal, is what meets the expired lease.
    d = Daemon(tmp_path, None, supervisor={"workers": 2}, broker={"lease_seconds": 30, "heartbeat_seconds": 10})
    d.start()
    marker, release = d.marker("m"), d.marker("release")
    try:
        job_id = d.enqueue("hold", {"marker": marker, "release": release, "max_wait": 60})
        wait_for(lambda: read_lines(marker), message="attempt 1 running")
        first_pid = int(read_lines(marker)[0][2])
        with sqlite3.connect(d.broker_url.removeprefix("sqlite:///"), timeout=10) as db:
            db.execute("UPDATE jobs SET lease_until = ? WHERE id = ?", (d.broker.now() - 1, job_id))
        d.enqueue("noop")  # a wake-up: the claim comes now, long before the next beat
        wait_for(lambda: [line[3] for line in read_lines(marker) if line[0] == "started"] == ["1", "2"],
                 message="attempt 2 started")
        wait_for(lambda: not _alive(first_pid), message="attempt 1's child killed")
        open(release, "w").close()
        job = d.wait_job(job_id)
        assert (job.state, job.attempt) == ("done", 2)
        assert [h["outcome"] for h in job.history] == ["lease_expired", "done"]
        assert [line[0] for line in read_lines(marker)] == ["started", "started", "finished"]  # attempt 2's
        assert d.status()["counters"]["lease_lost"] == 1
    finally:
        open(release, "w").close()
        d.stop()


def test_a_new_lease_on_a_held_job_reports_the_old_one_lost_and_only_its_own_drop_ends_it():
    from supervisor.heartbeat import Heartbeat
    from supervisor.model import Lease

    beat = Heartbeat("sqlite:///unused.db", lease_seconds=30, interval=10, wake_fd=None)
    old, new = Lease("job_1", 1), Lease("job_1", 2)
    beat.hold(old)
    beat.hold(old)  # the same lease again: nothing lost
    assert list(beat.lost) == []
    beat.hold(new)
    assert list(beat.lost) == [old] and beat.holding() == [new]
    beat.drop(old)  # the old attempt's outcome, stored or dropped: the new lease is still renewed
    assert beat.holding() == [new]
    beat.drop(new)
    assert beat.holding() == []


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[-1][0] != "Z"  # a zombie is dead: its parent reaps it soon


def test_leases_are_renewed_while_children_are_forked_faster_than_the_heartbeat(tmp_path):
    """The master stops the heartbeat thread around every fork. A restarted thread used to wait
    a whole interval before its first beat, so children forked more often than that (a child
    recycled after each job, a type that kills its child) renewed no lease at all: every
    running job lost its lease and ran again. The beat keeps its schedule across restarts."""
    d = Daemon(tmp_path, broker={"lease_seconds": LEASE, "heartbeat_seconds": 0.2},
               supervisor={"workers": 2, "max_jobs_per_child": 1})
    d.start()
    marker, release = str(tmp_path / "m"), str(tmp_path / "release")
    try:
        job_id = d.enqueue("hold", {"marker": marker, "release": release, "max_wait": 60})
        wait_for(lambda: read_lines(marker), message="the job to start")
        first = d.job(job_id)
        started, noops = d.broker.now(), str(tmp_path / "noops")

        def three_leases_of_forks():
            d.broker.enqueue_many([NewJob("noop", {"marker": noops}) for _ in range(10)])  # each recycles its child
            job = d.job(job_id)
            assert (job.state, job.token, job.attempt) == ("running", first.token, 1), job
            return d.broker.now() > started + 3 * LEASE

        wait_for(three_leases_of_forks, timeout=60, interval=0.05, message="three lease lengths of forks")
        children = {line[1] for line in read_lines(noops)}  # one child per noop: each forked
        assert len(children) >= 3 * LEASE / 0.2, len(children)  # forks more often than the heartbeat beats
        open(release, "w").close()
        job = d.wait_job(job_id)
        assert (job.state, job.attempt, job.token) == ("done", 1, first.token)
        assert [line[0] for line in read_lines(marker)] == ["started", "finished"]  # one run
        assert d.status()["counters"]["lease_lost"] == 0
    finally:
        open(release, "w").close()
        d.stop()


def test_a_job_whose_lease_ran_out_on_its_last_attempt_is_not_run_past_its_types_max_attempts(tmp_path, broker_url):
    """The claim that takes back an expired lease dead-letters a job only at the max_attempts
    stored with it (5: `tangguh enqueue` and Client.enqueue know no decorator). A job whose type
    allows one attempt ([jobs.types.<t>] or @job) and that takes its master down (a handler that
    kills it, a host OOM) was run again by the next supervisor, up to five times, each run
    taking that supervisor down too. Past its type's attempts it is now dead-lettered unrun."""
    rules = dict(broker={"lease_seconds": 1.0, "heartbeat_seconds": 0.2},
                 jobs={"types": {"hold": {"max_attempts": 1}}})
    first = Daemon(tmp_path / "a", broker_url=broker_url, **rules)
    second = Daemon(tmp_path / "b", broker_url=broker_url, **rules)
    marker, release = str(tmp_path / "m"), str(tmp_path / "release")
    try:
        first.start()
        job_id = first.enqueue("hold", {"marker": marker, "release": release, "max_wait": 60}, max_attempts=5)
        wait_for(lambda: read_lines(marker), message="attempt 1 running")
        first.signal(signal.SIGKILL)  # what a handler that kills its master does
        first.wait_exit()
        open(release, "w").close()  # a second run would end at once, done
        second.start()
        job = second.wait_job(job_id)
        assert (job.state, job.reason) == ("dead", "lease_expired"), job
        assert [line[0] for line in read_lines(marker)] == ["started"]  # run once
        assert job.error["message"] == ("attempt 2 is past the 1 attempt(s) its type allows; the lease of attempt 1"
                                        " expired")
        second.assert_clean()
    finally:
        open(release, "w").close()
        first.stop()
        second.stop()
