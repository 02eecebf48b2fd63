"""Jobs flowing through two real supervisors while the broker's primary fails over: the shared checks.

``run_through_failover`` starts two ``tangguh run`` daemons on ``url``,
enqueues ``n`` ``effect`` jobs (``tests/handlers/effects.py``: every execution
recorded, the effect once per job id, outside the broker), calls ``fail()``
once a quarter of them ran, and then requires: every job ends done or dead,
every effect happened exactly once (an execution beyond the first of a job is
a duplicate the effect's key suppressed: counted and returned), nothing is
left ready, scheduled or in flight, and both daemons kept serving.
"""
import os
import signal
import sqlite3

import pytest

from supervisor.errors import BrokerError, LeaseLost
from supervisor.model import NewJob

from .daemon import Daemon
from .util import wait_for

# Jobs per failover test: sized to keep each test under a minute on two shared cores.
# The size: 5,000 jobs through each failover (TANGGUH_TEST_HA_JOBS changes it).
N_JOBS = int(os.environ.get("TANGGUH_TEST_HA_JOBS", "5000"))


def _rows(db, sql):
    try:
        with sqlite3.connect(db, timeout=30) as conn:
            return conn.execute(sql).fetchall()
    except sqlite3.OperationalError:  # not created yet: no job ran
        return []


def finished(client, queue="default"):
    """done + dead of the queue, or None while the broker does not answer (mid-failover)."""
    try:
        s = client.stats([queue])[queue]
    except BrokerError:
        return None
    return s.done + s.dead


def run_through_failover(tmp_path, url, client, fail, n=N_JOBS, lease_seconds=3.0, outage_seen=True):
    db = str(tmp_path / "effects.db")
    sections = dict(supervisor={"workers": 2}, log={"level": "info"},
                    broker={"prefetch": 4, "lease_seconds": lease_seconds, "heartbeat_seconds": 0.5})
    daemons = [Daemon(tmp_path / name, broker_url=url, handler_files=("effects.py",), **sections)
               for name in ("a", "c")]
    try:
        for d in daemons:
            d._broker = client
            d.start(wait=False)
        for d in daemons:
            wait_for(d.ready, timeout=30, message="a supervisor to be ready")
        pids = [sorted(d.worker_pids()) for d in daemons]
        ids = client.enqueue_many([NewJob("effect", {"db": db}) for _ in range(n)])
        wait_for(lambda: len(_rows(db, "SELECT 1 FROM effects")) >= n // 4, timeout=60, interval=0.05,
                 message="a quarter of the jobs to run")
        fail()
        ran_before = len(_rows(db, "SELECT 1 FROM effects"))
        wait_for(lambda: finished(client) == n, timeout=90, interval=0.2, message=f"all {n} jobs to finish")
        assert ran_before < n, "the failover came after the queue had drained"
        s = client.stats(["default"])["default"]
        assert (s.ready, s.scheduled, s.in_flight) == (0, 0, 0), s  # nothing stuck
        jobs = [client.get(i) for i in ids]
        assert all(j is not None and j.state in ("done", "dead") for j in jobs)
        effects = _rows(db, "SELECT job_id FROM effects")
        assert len(effects) == n and {row[0] for row in effects} == set(ids)  # each effect once, none lost
        executions = len(_rows(db, "SELECT 1 FROM executions"))
        for d, before in zip(daemons, pids):
            wait_for(lambda d=d: not d.status()["broker_down"], timeout=30, message="the broker to be up again")
            # The children lived on, but for one whose job's lease ran out meanwhile (a failover longer
            # than the lease, as on a loaded machine): fencing kills it, and it alone is replaced.
            killed = {r["pid"] for r in d.records(event="lease_lost") if r.get("slot") is not None}
            assert d.status()["restarts"] == len(killed), d.records(event="spawn")
            assert killed or sorted(d.worker_pids()) == before
        outages = sum(len(d.records(event="broker_down")) for d in daemons)
        # Where the client may ride out a whole failover in its own retries (``outage_seen=False``),
        # the premise is the killed server's serving the queue while jobs were still flowing.
        assert outages >= 1 or not outage_seen, "the failover never reached the supervisors"
        for d in daemons:
            d.signal(signal.SIGTERM)
            assert d.wait_exit() == 0
        return {"jobs": n, "dead": s.dead, "duplicates": executions - n, "ran_before_failover": ran_before,
                "broker_down_events": outages}
    finally:
        for d in daemons:
            d.stop()


def only_the_new_lease_acks(broker, stale, live, job_id):
    """After a failover lost the claim ``stale``, the job claimed again as ``live``: another
    token, so the first owner's ack is refused and the second's stands."""
    assert live.id == stale.id == job_id
    assert live.lease.token != stale.lease.token
    with pytest.raises(LeaseLost):
        broker.ack(stale.lease, {"by": "first"})
    broker.ack(live.lease, {"by": "second"})
    assert broker.get(job_id).result == {"by": "second"}
