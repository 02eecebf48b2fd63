"""Lease renewal, seen from the broker: a healthy job that outlives its lease many times over.

Two real supervisors share one broker. The job that runs for 3x ``lease_seconds``
must keep its lease (the heartbeat pushes ``lease_until`` forward, read back
from the broker while it runs), so the other supervisor never reclaims it: it
runs exactly once, under one token.
"""
import signal

import pytest

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
