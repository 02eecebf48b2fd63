"""SQLite-only behaviour (the shared contract is in test_broker_conformance.py)."""
import os
import select
import sqlite3
import subprocess
import sys

import pytest

from supervisor.backends import open_broker
from supervisor.client import Client
from supervisor.errors import BrokerError, ConfigError
from supervisor.model import NewJob, TypeLimits

from .util import wait_for

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="inotify wake-ups are Linux-only")


def readable(fd, timeout=0.0):
    return bool(select.select([fd], [], [], timeout)[0])


def test_wakeup_fd_turns_readable_after_an_enqueue_elsewhere(tmp_path):
    url = f"sqlite:///{tmp_path}/broker.db"
    with open_broker(url) as supervisor_side, open_broker(url) as producer:
        fd = supervisor_side.wakeup_fd()
        assert fd is not None and supervisor_side.wakeup_fd() == fd
        supervisor_side.drain_wakeups()
        assert supervisor_side.claim(["default"], 1, 30, "w") == []  # an empty claim writes nothing...
        assert not readable(fd)  # ...so an idle supervisor does not wake itself
        producer.enqueue(NewJob("t", {}))
        assert readable(fd, 5.0)
        supervisor_side.drain_wakeups()
        assert not readable(fd)  # drained, and draining never blocks
        supervisor_side.drain_wakeups()


def test_a_database_whose_jobs_table_is_not_tangguhs_is_refused(tmp_path):
    path = tmp_path / "app.db"
    with sqlite3.connect(path) as app:
        app.execute("CREATE TABLE jobs (id INTEGER PRIMARY KEY, title TEXT)")
        app.execute("INSERT INTO jobs (title) VALUES ('the application''s own')")
    with pytest.raises(ConfigError, match="has a jobs table that is not Tangguh's"):
        open_broker(f"sqlite:///{path}")
    with sqlite3.connect(path) as app:
        assert app.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall() == [("jobs",)]
        assert app.execute("SELECT title FROM jobs").fetchall() == [("the application's own",)]


@pytest.mark.parametrize("table", ["supervisors", "paused_queues", "job_edges"])
def test_an_application_table_of_one_of_tangguhs_other_names_is_refused(tmp_path, table):
    """Only a foreign jobs table was refused: an application's own supervisors table was kept,
    the daemon started, and its every heartbeat (or, for paused_queues, every claim) failed."""
    path = tmp_path / "app.db"
    with sqlite3.connect(path) as app:
        app.execute(f"CREATE TABLE {table} (id INTEGER PRIMARY KEY, name TEXT)")
        app.execute(f"INSERT INTO {table} (name) VALUES ('the application''s own')")
    with pytest.raises(ConfigError, match=f"has a {table} table that is not Tangguh's"):
        open_broker(f"sqlite:///{path}")
    with sqlite3.connect(path) as app:
        assert app.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall() == [(table,)]
        assert app.execute(f"SELECT name FROM {table}").fetchall() == [("the application's own",)]


def test_a_full_database_is_a_broker_error_and_stores_nothing(tmp_path):
    with Client.from_url(f"sqlite:///{tmp_path}/full.db") as client:
        kept = client.enqueue("t", {})
        db = client.broker.db
        # SQLite's own "database or disk is full" (SQLITE_FULL), without filling a real disk.
        db.execute(f"PRAGMA max_page_count = {db.execute('PRAGMA page_count').fetchone()[0]}")
        with pytest.raises(BrokerError, match="full.db: database or disk is full"):
            client.enqueue_many([("t", {"blob": "x" * 100_000})] * 10)
        assert client.stats(["default"])["default"].ready == 1
        assert client.get(kept).state == "queued"
        db.execute("PRAGMA max_page_count = 1073741823")
        assert client.enqueue("t", {}) != kept  # the broker works on once there is room


def test_a_file_from_before_job_control_is_upgraded_in_place(tmp_path):
    # The jobs table as it was before expiry, progress and cancel requests (no such columns).
    from supervisor.backends.sqlite import schema

    old_schema = schema.SCHEMA.split("CREATE TABLE IF NOT EXISTS paused_queues")[0]
    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    db.executescript(old_schema)
    db.execute("INSERT INTO jobs (id, queue, type, payload, state, max_attempts, run_at, queued_at)"
               " VALUES ('job_old', 'default', 't', '{}', 'queued', 5, 0, 0)")
    db.commit()
    db.close()
    with open_broker(f"sqlite:///{path}") as b:
        assert b.get("job_old").expires_at is None and b.get("job_old").cancel_request is None
        fresh = b.enqueue(NewJob("t", {}, expires_in=60))
        assert b.get(fresh).expires_at is not None
        assert b.cancel(["job_old"], "ops", None) == {"job_old": "cancelled"}
        b.pause("default")
        assert b.claim(["default"], 5, 30, "w") == []


def test_queues_probes_the_queue_index_instead_of_reading_every_job(tmp_path):
    from supervisor.backends.sqlite import control

    with open_broker(f"sqlite:///{tmp_path}/q.db") as b:
        b.enqueue_many([NewJob("t", {}, queue=q) for q in ("b", "a", "b", "c")])
        assert b.queues() == ["a", "b", "c"]
        plan = " | ".join(row[3] for row in b.db.execute("EXPLAIN QUERY PLAN " + control.DISTINCT_QUEUES))
        # either index led by queue serves the probes (jobs_stats, issue 16, is the narrower)
        assert "SCAN jobs" not in plan and "SEARCH j USING COVERING INDEX jobs_s" in plan, plan
        assert "jobs_search_queue (queue>?)" in plan or "jobs_stats (queue>?)" in plan, plan


@pytest.mark.parametrize("write", ["extend", "renew"])
def test_a_lease_extended_after_a_wait_for_the_write_lock_runs_from_the_end_of_the_wait(tmp_path, write):
    """Another process holds the write lock while a renewal waits for it (up to the busy
    timeout, 30 s by default): the new lease must run ``lease_seconds`` from when the
    renewal could write, not from when it began to wait, or a long wait eats it."""
    import threading
    import time

    url = f"sqlite:///{tmp_path}/broker.db"
    with open_broker(url) as broker:
        broker.enqueue(NewJob("t", {}))
        (job,) = broker.claim(["default"], 1, 30, "w")
        began = threading.Event()
        broker.db.set_trace_callback(lambda sql: began.set() if sql.startswith("BEGIN IMMEDIATE") else None)
        holder = sqlite3.connect(tmp_path / "broker.db", isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        done = {}
        call = {"extend": lambda: broker.extend([job.lease], 30),
                "renew": lambda: broker.renew([job.lease], 30).lost}[write]
        thread = threading.Thread(target=lambda: done.update(lost=call()))
        thread.start()
        assert began.wait(10), "the renewal never asked for the write lock"
        time.sleep(1.0)  # the lock held a while: the wait this test is about
        released = time.time()
        holder.execute("COMMIT")
        thread.join(30)
        broker.db.set_trace_callback(None)
        holder.close()
        assert done == {"lost": []}
        assert broker.get(job.id).lease_until >= released + 30 - 0.05


def test_prune_deletes_a_backlog_in_short_write_transactions(tmp_path, monkeypatch):
    """A backlog of finished jobs goes in batches, each its own write transaction: one
    transaction for millions of rows held SQLite's write lock past every other process's
    busy timeout, and their claims read as "broker down"."""
    from supervisor.backends import sqlite as sqlite_broker

    monkeypatch.setattr(sqlite_broker, "PRUNE_BATCH", 4)
    b = open_broker(f"sqlite:///{tmp_path}/b.db")
    try:
        ids = b.enqueue_many([NewJob("t", {"i": i}) for i in range(11)])
        for job in b.claim(["default"], 11, 30, "w"):
            b.ack(job.lease)
        b.cancel(b.enqueue_many([NewJob("t", {}) for _ in range(5)]), by="ops", reason="test")
        kept = b.enqueue(NewJob("t", {}))
        writes = []
        real = b._write
        monkeypatch.setattr(b, "_write", lambda: writes.append(1) or real())
        wait_for(lambda: b.now() > b.get(kept).queued_at, message="the broker clock past the last cancel")
        assert b.prune(0.0) == 16
        assert len(writes) == 3 + 2 + 1  # done 4+4+3, cancelled 4+1, once keys: no transaction past a batch
        assert [b.get(i) for i in ids] == [None] * 11 and b.get(kept).state == "queued"
    finally:
        b.close()


def claim_steps(broker, n=8, limits=None):
    """(SQLite's steps in hundreds, the payloads' "n") of one claim: the work counted by its progress
    handler, not timed."""
    steps = [0]

    def tick():
        steps[0] += 1
        return 0
    broker.db.set_progress_handler(tick, 100)
    try:
        jobs = broker.claim(["default"], n, 30, "me", limits)
    finally:
        broker.db.set_progress_handler(None, 100)
    return steps[0], [job.payload["n"] for job in jobs]


@pytest.mark.parametrize("limits", [None, {"t": TypeLimits(max_concurrency=100, exclusive=True)}],
                         ids=["plain", "under-type-limits"])
def test_a_claim_reads_none_of_the_jobs_scheduled_for_later(tmp_path, limits):
    """A job scheduled for later sorts in the ready index behind its priority's due jobs but
    in front of every lower priority's: one ordered scan walked them all (300,000 jobs due
    tomorrow made each claim, idle polls too, take 40 ms; the claim under per-type limits
    too). The work is counted in SQLite's own steps (its progress handler), not in time."""
    broker = open_broker(f"sqlite:///{tmp_path}/b.db")
    broker.migrate()

    def claim(n=8):
        return claim_steps(broker, n, limits)

    broker.enqueue_many([NewJob("t", {"n": -1}, delay=86400, priority=5) for _ in range(100)])
    few, claimed = claim()
    assert claimed == []
    broker.enqueue_many([NewJob("t", {"n": -1}, delay=86400, priority=5) for _ in range(20_000)])
    many, claimed = claim()
    assert claimed == [] and many <= few + 2, (few, many)
    # Due jobs behind them, at lower priorities, in claim order.
    priorities = [0, 1, 0, 1, 3]
    broker.enqueue_many([NewJob("t", {"n": i}, priority=p) for i, p in enumerate(priorities)])
    steps, claimed = claim()
    assert [priorities[n] for n in claimed] == [3, 1, 1, 0, 0] and steps < 60, (steps, claimed)  # walking: 1,000+
    # Past the probes, more priorities than PRIORITY_PROBES: the rest in one ordered scan, still in order.
    broker.enqueue_many([NewJob("t", {"n": i}, priority=-i) for i in range(40)])
    assert claim(40)[1] == list(range(40))
    broker.close()


def test_a_claim_reads_none_of_the_running_jobs_whose_leases_hold(tmp_path):
    """Each claim first reclaims the expired leases. Planned through the state index, that read
    every running job's row (20,000 running: 6 ms a claim, idle polls too); through jobs_leased it
    is a range of the expired ones. Counted in SQLite's steps (its progress handler), not in time."""
    broker = open_broker(f"sqlite:///{tmp_path}/b.db")
    broker.migrate()

    def empty_claim_steps():
        steps, claimed = claim_steps(broker)
        assert claimed == []
        return steps

    broker.enqueue_many([NewJob("t", {"n": i}) for i in range(100)])
    assert len(broker.claim(["default"], 100, 3600, "me")) == 100
    few = empty_claim_steps()
    broker.enqueue_many([NewJob("t", {"n": i}) for i in range(20_000)])
    assert len(broker.claim(["default"], 20_000, 3600, "me")) == 20_000
    many = empty_claim_steps()
    assert many <= few + 2, (few, many)
    # An expired lease is still found and its job leased again.
    short = broker.enqueue(NewJob("t", {"n": -1}))
    assert [job.id for job in broker.claim(["default"], 1, 0.05, "me")] == [short]
    wait_for(lambda: broker.now() > broker.get(short).lease_until, timeout=10, interval=0.01,
             message="the broker's clock past the short lease")
    assert [job.id for job in broker.claim(["default"], 1, 30, "me")] == [short]
    broker.close()


@pytest.mark.parametrize("waited", [False, True], ids=["used", "used-and-waited"])
def test_a_client_used_before_a_fork_keeps_every_job_the_child_enqueues(tmp_path, waited):
    """A Client opened and used before os.fork() (gunicorn --preload, a daemonizing app),
    used on in the child while the parent closes its own: SQLite forbids a connection
    crossing a fork. The parent's close, finding no other process's lock on the file,
    checkpointed and deleted the WAL the child went on committing to: those jobs were lost.
    A wait before the fork leaves a wait broker the client keeps: the child lets go of it too."""
    url = f"sqlite:///{tmp_path}/broker.db"
    client = Client.from_url(url)
    client.enqueue_many([{"type": "parent", "payload": {"i": i}} for i in range(3)])
    if waited:
        assert client.wait(client.enqueue("waited", {}), 0.01) is None
        assert len(client._waits.idle) == 1
    to_child, to_parent = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            for i in range(10):
                client.enqueue("before_close", {"i": i})
            os.write(to_parent[1], b"x")
            os.read(to_child[0], 1)  # the parent has closed its client
            for i in range(10):
                client.enqueue("after_close", {"i": i})
            code = 0  # leaves without closing, as a worker process does
        finally:
            os._exit(code)
    assert os.read(to_parent[0], 1) == b"x"
    client.close()
    os.write(to_child[1], b"x")
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    for fd in (*to_child, *to_parent):
        os.close(fd)
    fresh = subprocess.run(
        [sys.executable, "-c", "import sys; from supervisor.client import Client; c = Client.from_url(sys.argv[1]);"
         " print(*(c.count(type=t).n for t in ('parent', 'before_close', 'after_close')))", url],
        capture_output=True, text=True, timeout=60)
    assert fresh.returncode == 0, fresh.stderr
    assert fresh.stdout.split() == ["3", "10", "10"]


@pytest.mark.parametrize("limited", [False, True], ids=["plain", "limited"])
def test_a_claim_ends_a_bounded_number_of_expired_jobs_and_leases_none_of_the_rest(tmp_path, monkeypatch, limited):
    """A backlog of jobs past their expiry: one claim ended all of them under the write lock
    (unbounded, unlike Redis and PostgreSQL). Each claim ends at most EXPIRE_BATCH now and
    leases none of those it left for the next claims."""
    from supervisor.backends.sqlite import control as sqlite_control

    monkeypatch.setattr(sqlite_control, "EXPIRE_BATCH", 4)
    limits = {"t": TypeLimits(max_concurrency=10)} if limited else None
    b = open_broker(f"sqlite:///{tmp_path}/b.db")
    try:
        stale = b.enqueue_many([NewJob("t", {}, expires_in=0.2, priority=5) for _ in range(10)])
        keep = b.enqueue_many([NewJob("t", {}, expires_in=3600) for _ in range(2)])
        wait_for(lambda: b.now() > b.get(stale[-1]).expires_at, message="the broker clock past the expiry")
        ended = []
        for want in (4, 8, 10, 10):
            assert sorted(j.id for j in b.claim(["default"], 5, 30, "w", limits=limits)) == (sorted(keep) if want == 4 else [])
            assert b.stats(["default"])["default"].expired == want
            ended += b.take_expired()
        assert sorted(ended) == sorted((job_id, "t") for job_id in stale)
        assert {b.get(job_id).state for job_id in stale} == {"expired"}
    finally:
        b.close()


def test_the_wal_file_shrinks_back_to_its_limit_after_a_burst(tmp_path, monkeypatch):
    """The WAL grew with every burst and never shrank (hundreds of MiB kept for good): SQLite
    cuts it back to journal_size_limit once checkpointed, and prune empties it."""
    from supervisor.backends.sqlite import database

    limit = 64 * 1024
    monkeypatch.setattr(database, "JOURNAL_SIZE_LIMIT", limit)
    wal = tmp_path / "b.db-wal"
    b = open_broker(f"sqlite:///{tmp_path}/b.db")
    try:
        b.enqueue_many([NewJob("t", {"pad": "x" * 1000}) for _ in range(500)])
        assert wal.stat().st_size > limit
        with sqlite3.connect(tmp_path / "b.db") as other:  # what a commit past 1,000 pages does
            assert other.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()[0] == 0
        other.close()
        b.enqueue(NewJob("t", {}))  # the first write after a whole checkpoint starts the WAL over
        # Cut to the limit as it starts over; this write's own frames (a page each: the table's,
        # each index's, more where an index page splits) may pass it: 16 of them did once.
        frame = b.db.execute("PRAGMA page_size").fetchone()[0] + 24
        assert wal.stat().st_size <= limit + 16 * frame
        b.enqueue_many([NewJob("t", {"pad": "x" * 1000}) for _ in range(500)])
        assert wal.stat().st_size > limit
        assert b.prune(3600) == 0
        assert wal.stat().st_size <= limit
        assert b.stats(["default"])["default"].ready == 1001
    finally:
        b.close()
