"""The handler toolkit against real PostgreSQL and Redis: transactions, idempotency, locks, cache.

Each test has its own PostgreSQL schema and Redis key prefix. Concurrency is
real: other connections, threads, and (for the cache stampede) processes.
"""
import json
import os
import subprocess
import sys
import threading
import time

import psycopg
import pytest

from supervisor import toolkit
from supervisor.child import timeouts
from supervisor.child.timeouts import JobTimeout
from supervisor.config import ConfigError, from_dict
from supervisor.retry import RetryLater
from supervisor.toolkit.cache import Cache
from supervisor.toolkit.idempotency import Idempotency, IdempotencyError, prune
from supervisor.toolkit.locks import FENCE_MARGIN, LockBusy, LockLost, Locks, advisory_lock, row_lock
from supervisor.toolkit.transaction import transaction

from .daemon import tangguh
from .toolkit_fixtures import handlers_db, invoices, new_invoice, query, toolkit_redis  # noqa: F401
from .util import wait_for

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def db(handlers_db):
    d = toolkit.Database(handlers_db)
    yield d
    d.close()


@pytest.fixture
def rc(toolkit_redis):
    client, prefix = toolkit.open_redis(toolkit_redis)
    yield client, prefix
    client.close()


# -- transaction ----------------------------------------------------------------------

def test_after_commit_steps_run_after_the_commit_and_never_on_rollback(db, handlers_db):
    seen = []
    with transaction(db) as tx:
        tx.execute("INSERT INTO invoices (id) VALUES (1)")
        # Another connection sees the row only once it is committed.
        tx.after_commit(lambda: seen.append(query(handlers_db, "SELECT id FROM invoices WHERE id = 1")))
        assert seen == []
    assert seen == [{"id": 1}] and tx.state == "committed"

    with pytest.raises(ValueError):
        with transaction(db) as tx:
            tx.execute("INSERT INTO invoices (id) VALUES (2)")
            tx.after_commit(lambda: seen.append("must not run"))
            raise ValueError("boom")
    assert seen == [{"id": 1}] and tx.state == "rolled_back"
    assert query(handlers_db, "SELECT count(*) AS n FROM invoices WHERE id = 2")["n"] == 0
    # The connection is usable after a rollback.
    with transaction(db) as tx:
        assert tx.scalar("SELECT count(*) FROM invoices") == 1


def test_a_statement_error_caught_inside_the_block_fails_the_commit(db, handlers_db):
    """PostgreSQL answers COMMIT after a failed statement with a rollback, and psycopg raises
    nothing: the block reported ``committed``, ran its after-commit steps, and the job was done
    with its effect and idempotency record gone."""
    seen = []
    with pytest.raises(psycopg.errors.InFailedSqlTransaction, match="nothing was committed"):
        with transaction(db) as tx:
            tx.execute("INSERT INTO invoices (id) VALUES (3)")
            tx.after_commit(lambda: seen.append("must not run"))
            try:
                tx.execute("INSERT INTO invoices (id) VALUES (3)")
            except psycopg.errors.UniqueViolation:
                pass
    assert seen == [] and tx.state == "rolled_back"
    assert query(handlers_db, "SELECT count(*) AS n FROM invoices WHERE id = 3")["n"] == 0
    with transaction(db) as tx:  # the connection is usable again
        tx.execute("INSERT INTO invoices (id) VALUES (3)")
    assert query(handlers_db, "SELECT count(*) AS n FROM invoices WHERE id = 3")["n"] == 1


def test_soft_timeout_waits_until_commit_and_after_commit_steps_are_over(db, handlers_db):
    timeouts.install()
    try:
        with pytest.raises(JobTimeout):
            with transaction(db) as tx:
                tx.execute("INSERT INTO invoices (id) VALUES (7)")

                def step():  # the alarm fires here, while the commit's critical section is open
                    timeouts.arm(0.01)
                    wait_for(lambda: timeouts._pending is not None, timeout=5, message="the soft timeout")
                    tx.execute_after = True

                tx.after_commit(step)
        assert tx.state == "committed" and tx.execute_after
        assert query(handlers_db, "SELECT count(*) AS n FROM invoices WHERE id = 7")["n"] == 1
    finally:
        timeouts.disarm()


# -- idempotency -------------------------------------------------------------------------

def test_done_key_suppresses_the_effect_and_counts_it(db):
    metrics = {}
    idem = Idempotency(metrics=metrics)
    with transaction(db) as tx:
        rec = idem.begin(tx, "k1")
        assert not rec.done
        tx.execute("INSERT INTO invoices (id) VALUES (1)")
        rec.complete({"total": 5})
    with transaction(db) as tx:
        again = idem.begin(tx, "k1")
    assert again.done and again.result == {"total": 5}
    assert metrics == {"duplicates_suppressed": 1}
    with transaction(db) as tx:
        row = tx.fetchone("SELECT status, job_id, completed_at FROM idempotency_records WHERE key = 'k1'")
    assert row["status"] == "done" and row["completed_at"] > 0


@pytest.mark.parametrize("kind", ["postgres", "sqlite"])
def test_begin_twice_in_one_transaction_returns_the_same_record(kind, handlers_db, tmp_path):
    url = handlers_db if kind == "postgres" else f"sqlite:///{tmp_path}/handlers.db"
    toolkit.migrate(url)
    database = toolkit.Database(url)
    metrics = {}
    try:
        with transaction(database) as tx:
            rec = Idempotency(metrics=metrics).begin(tx, "k:1")
            assert Idempotency(metrics=metrics).begin(tx, "k:1") is rec  # a helper begins it too
            rec.complete({"n": 1})
        with transaction(database) as tx:
            done = Idempotency(metrics=metrics).begin(tx, "k:1")
            assert Idempotency(metrics=metrics).begin(tx, "k:1") is done
        assert done.done and done.result == {"n": 1} and metrics == {"duplicates_suppressed": 1}
    finally:
        database.close()


@pytest.mark.parametrize("kind", ["postgres", "sqlite"])
def test_a_long_idempotency_key_guards_its_effect_on_both_databases(kind, handlers_db, tmp_path):
    """A key derived from a big payload: PostgreSQL refused its index entry past 2704 bytes
    (ProgramLimitExceeded at every attempt, the job dead and its effect never done); SQLite took it."""
    import base64

    url = handlers_db if kind == "postgres" else f"sqlite:///{tmp_path}/handlers.db"
    toolkit.migrate(url)
    database = toolkit.Database(url)
    metrics = {}
    payload = base64.b64encode(os.urandom(6000)).decode()  # incompressible
    key, twin = f"report:{payload}", f"report:{payload[:-1]}x"  # same start, another key
    try:
        for k in (key, twin, key):
            with transaction(database) as tx:
                rec = Idempotency(metrics=metrics).begin(tx, k)
                if not rec.done:
                    rec.complete({"len": len(k)})
        assert rec.done and rec.result == {"len": len(key)} and metrics == {"duplicates_suppressed": 1}
        with transaction(database) as tx:
            assert tx.scalar("SELECT count(*) FROM idempotency_records") == 2
    finally:
        database.close()


def test_rollback_removes_the_record_with_the_effect(db):
    idem = Idempotency()
    with pytest.raises(RuntimeError):
        with transaction(db) as tx:
            idem.begin(tx, "k2")
            tx.execute("INSERT INTO invoices (id) VALUES (2)")
            raise RuntimeError("the effect failed")
    with transaction(db) as tx:
        assert tx.scalar("SELECT count(*) FROM idempotency_records") == 0
        rec = idem.begin(tx, "k2")  # free to take again
        assert not rec.done
        rec.complete(None)


def test_commit_without_complete_is_refused(db):
    with pytest.raises(IdempotencyError):
        with transaction(db) as tx:
            Idempotency().begin(tx, "k3")
            tx.execute("INSERT INTO invoices (id) VALUES (3)")
    with transaction(db) as tx:
        assert tx.scalar("SELECT count(*) FROM invoices") == 0
        assert tx.scalar("SELECT count(*) FROM idempotency_records") == 0


def test_an_idempotency_key_or_result_no_table_can_hold_is_refused_naming_it(db):
    """An int key passed begin and failed at complete (text = smallint); a NUL or a lone surrogate
    failed in the driver; a result_ref JSON cannot hold raised a TypeError naming no key."""
    from decimal import Decimal

    for bad in (7, "", "a\x00b", "\ud800", b"k"):
        with pytest.raises(ValueError, match="idempotency key must be"):
            with transaction(db) as tx:
                Idempotency().begin(tx, bad)
    with pytest.raises(TypeError, match="result_ref of idempotency key 'order:7' is not JSON"):
        with transaction(db) as tx:
            Idempotency().begin(tx, "order:7").complete(Decimal(1))
    with transaction(db) as tx:  # nothing was kept: the key is free
        assert not Idempotency().begin(tx, "order:7").done
        tx.execute("SELECT 1")
        Idempotency().begin(tx, "order:7").complete(1)


def test_no_key_uses_no_record(db):
    with transaction(db) as tx:
        rec = Idempotency().begin(tx)
        rec.complete({"x": 1})
        assert not rec.done
    with transaction(db) as tx:
        assert tx.scalar("SELECT count(*) FROM idempotency_records") == 0


def _blocked_on_lock(handlers_db, pid):
    return query(handlers_db, "SELECT count(*) AS n FROM pg_locks WHERE NOT granted AND pid = %s", (pid,))["n"] > 0


def test_live_twin_gets_retry_later_then_the_done_result(db, handlers_db):
    twin = toolkit.Database(handlers_db)
    try:
        with transaction(db) as tx:
            rec = Idempotency().begin(tx, "twin")
            # The twin's insert waits on ours, for its lock_timeout only.
            with pytest.raises(RetryLater):
                with transaction(twin) as tx2:
                    Idempotency(lock_timeout=0.2).begin(tx2, "twin")
            # A twin that waits while we commit sees "done".
            out = {}

            def run_twin():
                with transaction(twin) as tx3:
                    out["rec"] = Idempotency(metrics=out, lock_timeout=10).begin(tx3, "twin")

            thread = threading.Thread(target=run_twin)
            thread.start()
            pid = twin.connection()[0].info.backend_pid
            wait_for(lambda: _blocked_on_lock(handlers_db, pid), timeout=10, message="the twin to wait on our key")
            rec.complete("first")
        thread.join(10)
        assert out["rec"].done and out["rec"].result == "first" and out["duplicates_suppressed"] == 1
    finally:
        twin.close()


def test_prune_deletes_old_done_records_only(db):
    with transaction(db) as tx:
        for key, age in (("old", 1000), ("new", 10)):
            tx.execute("INSERT INTO idempotency_records (key, status, created_at, completed_at)"
                       " VALUES (%s, 'done', %s, %s)", (key, time.time() - age, time.time() - age))
        assert prune(tx, 100) == 1
        assert [r["key"] for r in tx.fetchall("SELECT key FROM idempotency_records")] == ["new"]


def _old_done_records(tx, keys):
    for key in keys:
        tx.execute("INSERT INTO idempotency_records (key, status, created_at, completed_at) VALUES (%s, 'done', 0, 0)",
                   (key,))


def test_pruning_waits_for_the_commit_and_never_blocks_another_childs_begin(db, handlers_db, monkeypatch):
    from supervisor.toolkit import idempotency

    with transaction(db) as tx:
        _old_done_records(tx, [f"old:{i}" for i in range(5)])
    other = toolkit.Database(handlers_db)
    out, thread = {}, None

    def other_child():  # its prune is due too (a fresh child's first begin)
        monkeypatch.setattr(idempotency, "_next_prune", 0.0)
        with transaction(other) as tx2:
            out["rec"] = Idempotency(retention=60).begin(tx2, "email:42:welcome")
            out["rec"].complete(None)

    try:
        with transaction(db) as tx:
            monkeypatch.setattr(idempotency, "_next_prune", 0.0)
            rec = Idempotency(retention=60).begin(tx, "invoice:1:recalc:1")
            # The job's transaction stays open (a slow effect) while another child begins another key.
            thread = threading.Thread(target=other_child)
            thread.start()
            wait_for(lambda: not thread.is_alive(), timeout=10, message="the other child's begin of another key")
            assert not out["rec"].done
            # That child pruned after its own commit, not held up by this open transaction either
            # (seen from a third connection: nothing is left for this job's transaction to hold).
            assert query(handlers_db, "SELECT count(*) AS n FROM idempotency_records"
                                      " WHERE key LIKE 'old:%%'")["n"] == 0
            rec.complete(None)
        assert query(handlers_db, "SELECT count(*) AS n FROM idempotency_records WHERE key LIKE 'old:%%'")["n"] == 0
        assert query(handlers_db, "SELECT count(*) AS n FROM idempotency_records")["n"] == 2
    finally:
        if thread is not None:
            thread.join(10)
        other.close()


def test_a_rolled_back_transaction_leaves_the_prune_to_the_next_begin(db, handlers_db, monkeypatch):
    from supervisor.toolkit import idempotency

    with transaction(db) as tx:
        _old_done_records(tx, [f"old:{i}" for i in range(3)])
    monkeypatch.setattr(idempotency, "_next_prune", 0.0)  # a fresh child: its first begin prunes
    with pytest.raises(RuntimeError):
        with transaction(db) as tx:
            Idempotency(retention=60).begin(tx, "invoice:1:recalc:1")
            raise RuntimeError("the effect failed: the transaction rolls back, its prune with it")
    assert query(handlers_db, "SELECT count(*) AS n FROM idempotency_records")["n"] == 3
    with transaction(db) as tx:  # the next job's begin: the prune is still due, not 5 to 15 minutes away
        Idempotency(retention=60).begin(tx, "invoice:1:recalc:2").complete(None)
        Idempotency(retention=60).begin(tx, "invoice:1:recalc:3").complete(None)
    assert query(handlers_db, "SELECT count(*) AS n FROM idempotency_records")["n"] == 2
    assert idempotency._next_prune > time.monotonic() + idempotency.PRUNE_EVERY * 0.4


def test_prune_skips_records_another_transaction_holds_and_is_bounded(db, handlers_db):
    with transaction(db) as tx:
        _old_done_records(tx, ["held"] + [f"old:{i}" for i in range(5)])
    other = toolkit.Database(handlers_db)
    try:
        with transaction(other) as holder:
            row_lock(holder, "idempotency_records", "held", column="key")
            with transaction(db) as tx:
                with tx.lock_timeout(5):  # a prune that waited would fail here, not hang
                    assert prune(tx, 60) == 5
        with transaction(db) as tx:
            assert [r["key"] for r in tx.fetchall("SELECT key FROM idempotency_records")] == ["held"]
            _old_done_records(tx, [f"more:{i}" for i in range(4)])
            assert prune(tx, 60, limit=3) == 3 and prune(tx, 60, limit=3) == 2
    finally:
        other.close()


def test_missing_table_names_the_fix(postgres_url):
    db = toolkit.Database(postgres_url)  # a schema nobody migrated
    with pytest.raises(IdempotencyError, match="run `tangguh db migrate`"):
        with transaction(db) as tx:
            Idempotency().begin(tx, "k")
    db.close()


def test_idempotency_on_sqlite(tmp_path):
    url = f"sqlite:///{tmp_path}/handlers.db"
    toolkit.migrate(url)
    db = toolkit.Database(url)
    metrics = {}
    for _ in range(2):
        with transaction(db) as tx:
            rec = Idempotency(metrics=metrics).begin(tx, "s1")
            if not rec.done:
                rec.complete({"n": 1})
    assert rec.done and rec.result == {"n": 1} and metrics["duplicates_suppressed"] == 1
    db.close()


# -- PostgreSQL locks --------------------------------------------------------------------

def test_row_lock_waits_nowait_skip_locked_and_timeout(db, handlers_db):
    new_invoice(handlers_db, 1, [100])
    other = toolkit.Database(handlers_db)
    try:
        with transaction(db) as tx:
            assert row_lock(tx, "invoices", 1)["id"] == 1
            with pytest.raises(LockBusy):
                with transaction(other) as tx2:
                    row_lock(tx2, "invoices", 1, nowait=True)
            with transaction(other) as tx2:
                assert row_lock(tx2, "invoices", 1, skip_locked=True) is None
            with pytest.raises(LockBusy):
                with transaction(other) as tx2:
                    row_lock(tx2, "invoices", 1, timeout=0.1)
            with transaction(other) as tx2:  # lock_timeout was restored, not left at 0.1 s
                assert tx2.scalar("SHOW lock_timeout") == "0"
        with transaction(other) as tx2:  # released by the commit
            assert row_lock(tx2, "invoices", 1, nowait=True)["id"] == 1
    finally:
        other.close()


def test_row_lock_takes_a_schema_qualified_table(db, handlers_db):
    new_invoice(handlers_db, 3, [100])
    schema = handlers_db.split("schema=")[1]
    other = toolkit.Database(handlers_db)
    try:
        with transaction(db) as tx:
            assert row_lock(tx, f"{schema}.invoices", 3, nowait=True)["id"] == 3
            with pytest.raises(LockBusy):  # the very row the unqualified name locks
                with transaction(other) as tx2:
                    row_lock(tx2, "invoices", 3, nowait=True)
    finally:
        other.close()
    for bad in ("invoices;drop", "a..b", ".invoices"):
        with pytest.raises(ValueError, match="not a plain SQL identifier"):
            with transaction(db) as tx:
                row_lock(tx, bad, 3)


def test_advisory_lock_is_transaction_scoped(db, handlers_db):
    other = toolkit.Database(handlers_db)
    try:
        with transaction(db) as tx:
            advisory_lock(tx, "invoice:1:export")
            with pytest.raises(LockBusy):
                with transaction(other) as tx2:
                    advisory_lock(tx2, "invoice:1:export", timeout=0)
            with pytest.raises(LockBusy):
                with transaction(other) as tx2:
                    advisory_lock(tx2, "invoice:1:export", timeout=0.1)
            with transaction(other) as tx2:
                advisory_lock(tx2, "invoice:2:export", timeout=0)  # another key is free
        with transaction(other) as tx2:
            advisory_lock(tx2, "invoice:1:export", timeout=0)
    finally:
        other.close()


# -- Redis locks ---------------------------------------------------------------------------

def test_redis_lock_owner_only_release_fence_increases_and_busy_after_wait(rc):
    client, prefix = rc
    metrics = {}
    locks = Locks(client, prefix, metrics)
    first = locks.acquire("res", ttl=30, wait=0)
    assert client.get(first.key).decode() == first.token and client.pttl(first.key) > 25000
    with pytest.raises(LockBusy):
        locks.acquire("res", ttl=30, wait=0.2)
    assert metrics["lock_acquired"] == 1 and metrics["lock_failed"] == 1
    assert metrics["lock_wait_seconds"] >= 0.2
    # Someone else's token cannot release it.
    assert not client.eval("if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end"
                           " return 0", 1, first.key, "not-the-owner")
    assert first.release()
    second = locks.acquire("res", ttl=30, wait=0)
    assert second.fence > first.fence
    second.release()
    assert not client.exists(first.key)


def test_a_lock_name_that_is_another_locks_fence_counter_is_refused(rc):
    client, prefix = rc
    locks = Locks(client, prefix)
    locks.acquire("garden", ttl=30, wait=0).release()
    with pytest.raises(ValueError, match=r"lock name 'garden:fence' ends in ':fence', the fence counter of lock"
                                         r" 'garden': choose another name"):
        locks.acquire("garden:fence", ttl=30, wait=0)
    with pytest.raises(ValueError, match="fence counter"):
        locks.acquire("yard:fence", ttl=30, wait=0)
    assert not client.exists(prefix + "lock:yard:fence")
    yard = locks.acquire("yard", ttl=30, wait=0)  # its counter is its own
    assert int(client.get(prefix + "lock:yard:fence")) == yard.fence
    assert not client.exists(prefix + "lock:yard:fence:fence")
    yard.release()


def _a_millisecond_later(client):
    """Wait for the server's clock to pass the millisecond it is in (fences rise with it)."""
    def ms():
        seconds, micros = client.time()
        return seconds * 1000 + micros // 1000

    now = ms()
    wait_for(lambda: ms() > now, timeout=5, interval=0.001, message="the server's clock to move on")


def test_fences_keep_rising_when_redis_loses_or_rewinds_the_counter(rc):
    """A restart that lost the counter (no persistence, eviction) or a failover to a replica that
    missed its last INCRs: fences from 1 again would be refused by every fenced resource."""
    client, prefix = rc
    locks = Locks(client, prefix)
    first = locks.acquire("invoice:7:export", ttl=30, wait=0)
    first.release()
    counter = first.key + ":fence"
    _a_millisecond_later(client)  # a restart takes that long at the very least
    client.delete(counter)  # lost
    second = locks.acquire("invoice:7:export", ttl=30, wait=0)
    second.release()
    assert second.fence > first.fence
    _a_millisecond_later(client)
    client.set(counter, first.fence)  # behind: the replica saw the first acquire only
    third = locks.acquire("invoice:7:export", ttl=30, wait=0)
    third.release()
    assert third.fence > second.fence
    # Exact integers, as stored (a float's 14 digits would repeat or skip fences).
    assert int(client.get(counter)) == third.fence and isinstance(third.fence, int) and third.fence < 2 ** 53


def test_a_lock_ttl_wait_or_name_that_protects_nothing_is_refused(rc):
    """A TTL of 0 or below made a lock that lived a millisecond (``held`` all the same), NaN and
    inf failed deep inside the call; ``extend(0)`` silently took the default."""
    client, prefix = rc
    locks = Locks(client, prefix)
    for bad in (0, -5, float("nan"), float("inf"), 1e300, True, "30"):
        with pytest.raises(ValueError, match="lock ttl must be"):
            locks.acquire("report", ttl=bad)
    for bad in (float("nan"), -1, float("inf"), "1"):
        with pytest.raises(ValueError, match="lock wait must be"):
            locks.acquire("report", wait=bad)
    for bad in (5, None, ""):
        with pytest.raises(ValueError, match="lock name must be"):
            locks.acquire(bad)
    with locks.acquire("report", ttl=30) as lock:
        with pytest.raises(ValueError, match="lock ttl must be"):
            lock.extend(0)
        assert lock.extend(60) and 59_000 < client.pttl(lock.key) <= 60_000
    floored = Locks(client, prefix, floor=5.0)  # a worker's: its job's lease
    with floored.acquire("report", ttl=0.2) as lock:
        assert lock.ttl == 5.0 and 4_000 < client.pttl(lock.key) <= 5_000


def test_a_fence_counter_expires_once_its_lock_name_is_unused(rc):
    """Every distinct lock name used to leave its counter behind for good."""
    client, prefix = rc
    locks = Locks(client, prefix)
    for i in range(20):
        locks.acquire(f"invoice:{i}:export", ttl=30, wait=0).release()
    counters = list(client.scan_iter(match=f"{prefix}lock:*:fence"))
    assert len(counters) == 20
    assert all(30_000 < client.pttl(k) <= 30_000 + FENCE_MARGIN * 1000 for k in counters)
    # Each acquire pushes it back: a name in use keeps its counter.
    counter = prefix + "lock:invoice:0:export:fence"
    client.pexpire(counter, 50)
    locks.acquire("invoice:0:export", ttl=600, wait=0).release()
    assert client.pttl(counter) > 600_000


def test_expired_holder_cannot_release_the_new_lock_and_its_fenced_write_is_rejected(rc, db, handlers_db):
    client, prefix = rc
    new_invoice(handlers_db, 5, [100])
    locks = Locks(client, prefix)
    stale = locks.acquire("invoice:5:export", ttl=0.1, wait=0)
    wait_for(lambda: not client.exists(stale.key), timeout=5, message="the first lock to expire")
    fresh = locks.acquire("invoice:5:export", ttl=30, wait=0)
    assert fresh.fence > stale.fence
    with transaction(db) as tx:
        invoices.record_export(tx, 5, 100, fresh.fence)
    # The stale holder wakes up and writes: refused by the fence, and its release leaves the new lock alone.
    with pytest.raises(LockLost):
        with transaction(db) as tx:
            invoices.record_export(tx, 5, 999, stale.fence)
    assert not stale.release()
    assert client.get(fresh.key).decode() == fresh.token
    assert query(handlers_db, "SELECT exported_total, export_fence FROM invoices WHERE id = 5") == {
        "exported_total": 100, "export_fence": fresh.fence}
    fresh.release()


# -- cache -----------------------------------------------------------------------------------

def _ringing_client(client, script):
    """``client``'s pool, with the job's soft timeout (a real SIGALRM) ringing just as the reply
    to ``script`` arrives: between the script that took a lock and the message to the master."""
    import redis

    class Ringing(redis.Redis):
        def eval(self, body, *args):
            result = super().eval(body, *args)
            if body == script:
                timeouts.arm(0.001)
                wait_for(lambda: timeouts._pending is not None, timeout=5, message="the soft timeout")
            return result

    return Ringing(connection_pool=client.connection_pool)


def test_a_soft_timeout_as_a_lock_or_fill_lease_is_taken_never_hides_it_from_the_master(rc):
    """Raised between the script and the message, the timeout left a lock (or a fill lease) the
    master never heard of: nobody freed it, the retry (every reader of the key) waited out its TTL."""
    from supervisor.toolkit.cache import TAKE_LEASE
    from supervisor.toolkit.locks import ACQUIRE

    client, prefix = rc
    told = []
    timeouts.install()
    try:
        locks = Locks(_ringing_client(client, ACQUIRE), prefix, notify=told.append)
        with pytest.raises(JobTimeout):
            locks.acquire("export", ttl=30, wait=0)
        token = client.get(f"{prefix}lock:export").decode()
        assert told == [{"op": "lock", "key": f"{prefix}lock:export", "token": token, "ttl": 30.0}]
        cache = Cache(_ringing_client(client, TAKE_LEASE), prefix, notify=told.append)
        with pytest.raises(JobTimeout):
            cache.get_or_build("summary", lambda: "built", ttl=60)
        token = client.get(f"{prefix}cache-lease:summary").decode()
        assert told[1:] == [{"op": "lock", "key": f"{prefix}cache-lease:summary", "token": token, "ttl": 10.0}]
    finally:
        timeouts.disarm()


def _ringing_pipe():
    """(a notify writing each frame to a real socket pair in two writes, an UNLOCK's with the job's
    soft timeout (a real SIGALRM) ringing between them; a function returning the messages the
    master's end reads whole). Outside ``critical()`` the timeout is raised mid-frame: torn."""
    import socket

    from supervisor import protocol

    child, master = socket.socketpair()

    def notify(msg):
        frame = protocol.encode(msg)
        child.sendall(frame[:len(frame) // 2])
        if msg["op"] == protocol.UNLOCK:
            timeouts.arm(0.001)
            wait_for(lambda: timeouts._pending is not None, timeout=5, message="the soft timeout")
        child.sendall(frame[len(frame) // 2:])

    def read():
        child.close()
        messages = []
        try:
            while (msg := protocol.recv(master)) is not None:
                messages.append(msg)
        except ValueError:  # the header of the frame after a torn one, read as its body
            messages.append("a torn frame")
        master.close()
        return messages

    return notify, read


def test_a_soft_timeout_as_a_lock_or_fill_lease_is_freed_never_tears_the_unlock_frame(rc):
    """The UNLOCK frame was sent outside ``critical()``: a soft timeout or a cancel raised in the
    middle of its write left half a frame on the pipe (the master read garbage) and no UNLOCK."""
    client, prefix = rc
    timeouts.install()
    try:
        notify, read = _ringing_pipe()
        lock = Locks(client, prefix, notify=notify).acquire("export", ttl=30, wait=0)
        with pytest.raises(JobTimeout):
            lock.release()
        assert not client.exists(lock.key)
        cache = Cache(client, prefix, notify=notify)
        with pytest.raises(JobTimeout):
            cache.get_or_build("summary", lambda: "built", ttl=60)
        assert cache.get_or_build("summary", lambda: "rebuilt", ttl=60) == "built"
        lease = f"{prefix}cache-lease:summary"
        assert [m if isinstance(m, str) else (m["op"], m["key"]) for m in read()] == [
            ("lock", lock.key), ("unlock", lock.key), ("lock", lease), ("unlock", lease)]
    finally:
        timeouts.disarm()


def test_cold_key_with_200_concurrent_readers_is_built_once(toolkit_redis, tmp_path, rc):
    client, prefix = rc
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "cache_readers.py"), toolkit_redis, str(go),
                               "50", "200"], stdout=subprocess.PIPE, text=True) for _ in range(4)]
    wait_for(lambda: int(client.get(prefix + "test:ready") or 0) == 200, timeout=30,
             message="200 reader threads to be ready")
    go.touch()
    outs = [json.loads(p.communicate(timeout=60)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    values = [v for o in outs for v in o["values"]]
    assert len(values) == 200 and set(values) == {"built once"}
    assert int(client.get(prefix + "test:builds")) == 1
    totals = {k: sum(o["metrics"].get(k, 0) for o in outs) for k in ("cache_rebuild", "cache_hit", "cache_miss")}
    assert totals["cache_rebuild"] == 1 and totals["cache_hit"] + totals["cache_miss"] == 200


def test_fill_lease_race_reader_cannot_store_a_row_read_before_the_writers_commit(rc, db, handlers_db):
    client, prefix = rc
    new_invoice(handlers_db, 9, [100])
    reader = Cache(client, prefix)
    writer_cache = Cache(client, prefix)
    writer = toolkit.Database(handlers_db)

    def build_then_writer_commits():
        summary = query(handlers_db, "SELECT total FROM invoices WHERE id = 9")  # the old row
        with transaction(writer) as tx:
            tx.execute("UPDATE invoices SET total = 250 WHERE id = 9")
            writer_cache.invalidate_after_commit(tx, "invoice:9")
        return summary

    try:
        got = reader.get_or_build("invoice:9:summary", build_then_writer_commits, ttl=300, tags=["invoice:9"])
        assert got == {"total": 0}  # this caller gets what it read...
        assert not client.exists(prefix + "cache:invoice:9:summary")  # ...but its store was refused
        fresh = reader.get_or_build("invoice:9:summary", lambda: query(handlers_db, "SELECT total FROM invoices"
                                                                       " WHERE id = 9"), ttl=300, tags=["invoice:9"])
        assert fresh == {"total": 250}
        # The two-step form: a lease taken before the invalidation cannot store after it.
        token = reader.lease("k", ttl=300, tags=["invoice:9"])
        reader.invalidate("invoice:9")
        assert reader.store("k", "old", 300, token) is False and not client.exists(prefix + "cache:k")
    finally:
        writer.close()


def test_an_entry_never_outlives_its_tag_set(rc):
    """The tag's TTL was set when the lease was taken, the entry's when it was stored: a build the
    master kept leased for long stored an entry that outlived its tag, and invalidating the tag
    then missed it (the old value served after the write)."""
    client, prefix = rc
    cache = Cache(client, prefix, jitter=0, lease_ttl=2)
    tag = prefix + "cache-tag:invoice:1"

    def long_build():  # its lease extended by the master until now: the tag has 1 s left
        client.pexpire(tag, 1000)
        return "old"

    assert cache.get_or_build("invoice:1:summary", long_build, ttl=300, tags=["invoice:1"]) == "old"
    entry_ms = client.pttl(prefix + "cache:invoice:1:summary")
    assert entry_ms > 290_000 and client.pttl(tag) >= entry_ms + 1000
    cache.invalidate("invoice:1")
    assert not client.exists(prefix + "cache:invoice:1:summary")

    # A build longer than the tag's whole TTL: the tag went, so an invalidation meanwhile could
    # not have cancelled the lease. The value is the caller's, never stored.
    def longer_build():
        client.delete(prefix + "cache-tag:invoice:2")
        return "maybe old"

    assert cache.get_or_build("invoice:2:summary", longer_build, ttl=300, tags=["invoice:2"]) == "maybe old"
    assert not client.exists(prefix + "cache:invoice:2:summary")
    assert not client.exists(prefix + "cache-lease:invoice:2:summary")  # the next reader builds at once
    # The two-step form names its tags to the store as to the lease.
    token = cache.lease("invoice:3:summary", ttl=300, tags=["invoice:3"])
    client.pexpire(prefix + "cache-tag:invoice:3", 1000)
    assert cache.store("invoice:3:summary", "v", 300, token, tags=["invoice:3"])
    assert client.pttl(prefix + "cache-tag:invoice:3") > 290_000


def test_a_tag_keeps_only_members_that_may_still_be_read(rc):
    """Every fill added its key to the tag and only an invalidation removed it: a tag refilled but
    never invalidated grew without bound (and made its invalidation one long script)."""
    client, prefix = rc
    # The in-flight build's lease must outlive the test on a loaded machine (10 s by default: a
    # slow run let it expire, and its member was trimmed, as it should be then).
    cache = Cache(client, prefix, lease_ttl=300)
    tag = prefix + "cache-tag:catalog"
    for q in range(300):
        cache.get_or_build(f"catalog:search:{q}", lambda: [q], ttl=300, tags=["catalog"])
    inflight = cache.lease("catalog:inflight", ttl=300, tags=["catalog"])  # a build running: no entry yet
    for q in range(300):  # the first round's entries expire (evicted here: no waiting)
        client.delete(f"{prefix}cache:catalog:search:{q}")
    for q in range(300, 600):
        cache.get_or_build(f"catalog:search:{q}", lambda: [q], ttl=300, tags=["catalog"])
    members = {m.decode() for m in client.smembers(tag)}
    assert len(members) < 330  # 601 before: the dead ones go as fills come (about 301 now)
    assert {f"catalog:search:{q}" for q in range(300, 600)} | {"catalog:inflight"} <= members
    cache.invalidate("catalog")
    assert not any(client.exists(f"{prefix}cache:catalog:search:{q}") for q in range(300, 600))
    assert cache.store("catalog:inflight", "old", 300, inflight, tags=["catalog"]) is False


def test_a_big_tag_is_invalidated_in_short_scripts_and_no_entry_of_it_survives(rc, monkeypatch):
    """One script over every member of a big tag blocked Redis (the broker's too, maybe) for as long.
    In batches, fills that took their lease before the invalidation store between two batches: each
    is deleted or refused, none readable once invalidate() returns."""
    from supervisor.toolkit import cache as cache_module

    client, prefix = rc
    cache = Cache(client, prefix)
    cache.invalidate_batch = 10
    inflight = []
    for q in range(55):
        cache.get_or_build(f"big:{q}", lambda: "old", ttl=300, tags=["big"])
        if q % 3 == 0:
            inflight.append((f"big:late:{q}", cache.lease(f"big:late:{q}", ttl=300, tags=["big"])))
    batches, stored = [], []
    real_eval = client.eval

    def eval_(script, numkeys, *args):
        out = real_eval(script, numkeys, *args)
        if script == cache_module.DROP_MEMBERS:
            batches.append(len(args) - 2)
            if len(batches) == 1:  # the builders that read the old rows store now
                stored.extend(cache.store(key, "old", 300, token, tags=["big"]) for key, token in inflight)
        return out

    monkeypatch.setattr(client, "eval", eval_)
    cache.invalidate("big")
    assert len(batches) >= 7 and max(batches) <= 10
    assert any(stored)  # stored mid-invalidation: the old rows were readable for a moment
    assert [k for k in client.scan_iter(match=f"{prefix}cache:big:*")] == []
    assert not client.exists(prefix + "cache-tag:big")
    assert cache.get_or_build("big:3", lambda: "new", ttl=300, tags=["big"]) == "new"


def test_invalidate_after_commit_never_before_and_never_on_rollback(rc, db):
    client, prefix = rc
    cache = Cache(client, prefix)
    cache.get_or_build("invoice:1:summary", lambda: "v1", ttl=300, tags=["invoice:1"])
    cache.get_or_build("invoice:1:lines:p1", lambda: "p1", ttl=300, tags=["invoice:1"])
    key = prefix + "cache:invoice:1:summary"
    with pytest.raises(RuntimeError):
        with transaction(db) as tx:
            cache.invalidate_after_commit(tx, "invoice:1")
            raise RuntimeError("rolled back")
    assert client.exists(key)
    with transaction(db) as tx:
        cache.invalidate_after_commit(tx, "invoice:1")
        assert client.exists(key)  # not before the commit
    assert not client.exists(key) and not client.exists(prefix + "cache:invoice:1:lines:p1")


def test_hits_misses_ttl_jitter_and_plain_keys(rc):
    client, prefix = rc
    metrics = {}
    cache = Cache(client, prefix, metrics)
    for i in range(20):
        cache.get_or_build(f"k{i}", lambda: i, ttl=100)
    assert cache.get_or_build("k3", lambda: "rebuilt", ttl=100) == 3
    assert metrics == {"cache_miss": 20, "cache_rebuild": 20, "cache_hit": 1}
    ttls = {client.pttl(f"{prefix}cache:k{i}") for i in range(20)}
    assert all(89000 < t <= 100000 for t in ttls) and len(ttls) > 10  # spread, not one expiry instant
    cache.invalidate("k3")  # a plain key, no tag
    assert cache.get_or_build("k3", lambda: "rebuilt", ttl=100) == "rebuilt"


def test_stale_while_revalidate_only_for_tolerant_keys(rc):
    client, prefix = rc
    metrics = {}
    cache = Cache(client, prefix, metrics, jitter=0)
    cache.get_or_build("tolerant", lambda: "old", ttl=0.05, stale_ttl=60)
    cache.get_or_build("strict", lambda: "old", ttl=0.05)
    wait_for(lambda: client.pttl(prefix + "cache:tolerant") <= 60_000 and not client.exists(prefix + "cache:strict"),
             timeout=5, message="both entries to go stale (by Redis's clock)")
    # Another process is revalidating (holds the fill lease): serve stale at once.
    token = cache.lease("tolerant", ttl=60)
    assert cache.get_or_build("tolerant", lambda: "new", ttl=60, stale_ttl=60) == "old"
    assert metrics["cache_stale_served"] == 1
    assert cache.store("tolerant", "new", 60, token)
    assert cache.get_or_build("tolerant", lambda: "newer", ttl=60, stale_ttl=60) == "new"
    # Nobody revalidating: this reader rebuilds.
    assert cache.get_or_build("strict", lambda: "new", ttl=60) == "new"
    # An invalidation removes stale values too.
    cache.invalidate("tolerant")
    assert not client.exists(prefix + "cache:tolerant")


def test_cache_unreachable_reads_the_source_and_invalidation_fails_loudly():
    import redis

    metrics = {}
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    cache = Cache(redis.Redis(port=1, socket_connect_timeout=1, retry=Retry(NoBackoff(), 0)), "p:", metrics)
    assert cache.get_or_build("k", lambda: "from the database", ttl=10) == "from the database"
    assert metrics == {"cache_miss": 1, "cache_rebuild": 1}
    with pytest.raises(redis.ConnectionError):
        cache.invalidate("k")


def test_a_long_cache_key_or_lock_name_is_cut_in_the_log(rc, caplog):
    """A 2 MB key made a 2 MB log line ("building ... directly", each time the cache was away)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    client, prefix = rc
    huge = "k" * 2_000_000
    away = Cache(redis.Redis(port=1, socket_connect_timeout=1, retry=Retry(NoBackoff(), 0)), "p:")
    with caplog.at_level("WARNING", logger="tangguh"):
        assert away.get_or_build(huge, lambda: "from the database", ttl=10) == "from the database"
        lock = Locks(client, prefix).acquire(huge, ttl=0.1, wait=0)
        wait_for(lambda: not client.exists(lock.key), timeout=5, message="the lock to expire")
        assert not lock.release()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all(len(line) < 1000 for line in lines), [line[:300] for line in lines]
    assert lines[0].startswith("cache unavailable, building " + "k" * 200 + "… (1999800 characters cut)")
    key = f"{prefix}lock:{huge}"
    assert lines[1].startswith(f"lock {key[:200]}… ({len(key) - 200} characters cut) expired before its release")


def test_a_value_json_cannot_hold_fails_naming_the_key_and_frees_the_fill_lease(rc):
    from decimal import Decimal

    client, prefix = rc
    cache = Cache(client, prefix)
    with pytest.raises(TypeError, match="cache value for key 'invoice:1:summary' is not JSON"):
        cache.get_or_build("invoice:1:summary", lambda: {"total": Decimal("12.50")}, ttl=300)
    assert not client.exists(prefix + "cache-lease:invoice:1:summary")
    # The next reader is the builder at once: with the lease left behind it would build without storing.
    assert cache.get_or_build("invoice:1:summary", lambda: {"total": "12.50"}, ttl=300, wait=0) == {"total": "12.50"}
    assert client.exists(prefix + "cache:invoice:1:summary")


def test_a_cache_ttl_no_entry_can_keep_or_a_value_nested_too_deep_is_refused_and_frees_the_lease(rc):
    """NaN and inf failed deep in the call; a TTL past Redis's range failed after the builder ran,
    its fill lease held to the end (every other reader waited, then built unstored); 0 or below
    stored entries never fresh; a value nested too deep raised RecursionError, not the TypeError
    that names the key."""
    client, prefix = rc
    cache = Cache(client, prefix)
    built = []
    for bad in (float("nan"), float("inf"), 1e17, 0, -5, True, "300"):
        with pytest.raises(ValueError, match="cache ttl must be"):
            cache.get_or_build("report", lambda: built.append(1), ttl=bad)
    for bad in (float("nan"), -1, 1e17):
        with pytest.raises(ValueError, match="cache stale_ttl must be"):
            cache.get_or_build("report", lambda: built.append(1), ttl=60, stale_ttl=bad)
    for bad in (float("nan"), float("inf"), -1, "2"):  # NaN never ended a wait on another builder
        with pytest.raises(ValueError, match="cache wait must be"):
            cache.get_or_build("report", lambda: built.append(1), ttl=60, wait=bad)
    assert built == [] and not client.exists(prefix + "cache-lease:report")
    for bad in (float("nan"), 0, 1e17):  # by hand too: a lease no store() could fill
        with pytest.raises(ValueError, match="cache ttl must be"):
            cache.lease("report", bad)
    deep = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(TypeError, match="cache value for key 'report' is not JSON"):
        cache.get_or_build("report", lambda: deep, ttl=60)
    assert not client.exists(prefix + "cache-lease:report")
    assert cache.get_or_build("report", lambda: "ok", ttl=60, wait=0) == "ok"


def test_a_fill_lease_in_a_worker_lives_at_least_the_jobs_lease(rc):
    """The master extends a fill lease once a heartbeat by its TTL, 10 s: a heartbeat of 10 s or
    more (lease 60, heartbeat 15) let it lapse under a build still running, and two built."""
    from supervisor.child.context import Context

    client, prefix = rc
    before = toolkit.settings()
    toolkit.configure(toolkit.Settings(redis_url=f"redis://127.0.0.1:6379/0?prefix={prefix}"), lock_floor=60.0)
    try:
        assert Context({"id": "j", "type": "t"}).cache.lease_ttl == 60.0
        toolkit.configure(toolkit.Settings(redis_url=f"redis://127.0.0.1:6379/0?prefix={prefix}"), lock_floor=5.0)
        assert Context({"id": "j", "type": "t"}).cache.lease_ttl == 10.0
    finally:
        toolkit.configure(before)


def test_a_miss_returns_what_a_hit_returns(rc):
    client, prefix = rc
    cache = Cache(client, prefix)
    built = {"ids": (1, 2), 3: "x"}
    as_json = {"ids": [1, 2], "3": "x"}
    assert cache.get_or_build("k", lambda: built, ttl=300) == as_json  # the builder's miss
    assert cache.get_or_build("k", lambda: "not called", ttl=300) == as_json  # the hit
    cache.lease("busy", ttl=300)  # another process is filling it: this caller builds for itself
    assert cache.get_or_build("busy", lambda: built, ttl=300, wait=0) == as_json


def test_redis_failing_after_the_build_returns_the_value_built_once(tmp_path):
    import signal

    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from .servers import RedisServer

    server = RedisServer(tmp_path).start()
    client = server.client(socket_connect_timeout=1, retry=Retry(NoBackoff(), 0))
    calls = []

    def build():  # the lease is taken; Redis dies while the database is read
        calls.append(1)
        server.stop(signal.SIGKILL)
        return "from the database"

    try:
        assert Cache(client, "p:").get_or_build("k", build, ttl=10) == "from the database"
        assert len(calls) == 1
        with pytest.raises(redis.ConnectionError):  # it is gone, for real
            client.ping()
    finally:
        client.close()
        server.stop()


def test_a_redis_out_of_memory_reads_the_source_and_never_loses_a_value_built(tmp_path):
    """maxmemory with noeviction (a broker's Redis): the fill lease's script was refused, and the
    read failed instead of going to the database; refused at the store, the value built was thrown
    away (the job failed, its retry built it again) and the lease held until its TTL."""
    from .servers import RedisServer

    server = RedisServer(tmp_path).start()
    client = server.client()
    calls = []

    def fill():
        client.set("ballast", "x" * 1_000_000)
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", client.info("memory")["used_memory"] + 1000)

    def build_and_fill():
        calls.append(1)
        fill()  # the lease is taken; Redis fills up while the database is read
        return "from the database"

    try:
        metrics = {}
        cache = Cache(client, "p:", metrics)
        assert cache.get_or_build("k", build_and_fill, ttl=10) == "from the database"
        assert len(calls) == 1 and not client.exists("p:cache:k")
        assert not client.exists("p:cache-lease:k")  # the next reader need not wait it out
        assert cache.get_or_build("k2", lambda: "read directly", ttl=10) == "read directly"
        assert metrics["cache_rebuild"] == 2
        client.config_set("maxmemory", 0)
        assert cache.get_or_build("k", lambda: "stored", ttl=10) == "stored"
        assert client.exists("p:cache:k")
    finally:
        client.close()
        server.stop()


def test_a_miss_whose_fill_lease_redis_refused_is_counted_once(tmp_path):
    """The read answered (a miss, counted) and the lease's script was refused (out of memory): the
    fall-back to the source counted the same miss a second time."""
    from .servers import RedisServer

    server = RedisServer(tmp_path).start()
    client = server.client()
    try:
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", 1)  # every write refused, reads answered
        metrics = {}
        assert Cache(client, "p:", metrics).get_or_build("k", lambda: "read directly", ttl=10) == "read directly"
        assert metrics == {"cache_miss": 1, "cache_rebuild": 1}
    finally:
        client.close()
        server.stop()


def test_a_lock_release_redis_cannot_answer_leaves_the_bodys_outcome_alone(tmp_path):
    """Redis gone before the ``with`` block's release: its ConnectionError replaced the body's own
    exception (a Permanent was retried instead of dead-lettered) and failed a body that had done
    its work. The lock expires, and the master frees it when the job ends."""
    from supervisor.retry import Permanent

    from .servers import RedisServer

    server = RedisServer(tmp_path).start()
    client = server.client(socket_timeout=2, socket_connect_timeout=2)
    try:
        locks = Locks(client, "p:")
        with pytest.raises(Permanent, match="bad invoice"):
            with locks.acquire("invoice:1", ttl=30):
                server.stop()
                raise Permanent("bad invoice")
        server.start()
        with locks.acquire("invoice:2", ttl=30) as lock:
            server.stop()
            done = True
        assert done and not lock.held
    finally:
        client.close()
        server.stop()


def _terminate(db_url, pid):
    with toolkit.Database(db_url).connect() as admin:
        admin.autocommit = True
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        wait_for(lambda: not admin.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone(),
                 timeout=10, message=f"backend {pid} to end")


def test_a_connection_the_server_closed_while_idle_costs_no_job(db, handlers_db):
    """A PostgreSQL restart, failover or terminated backend closed the child's idle connection:
    the next job's transaction failed at its first statement (an attempt spent, in every child)."""
    with transaction(db) as tx:
        first = tx.scalar("SELECT pg_backend_pid()")
    _terminate(handlers_db, first)
    with transaction(db) as tx:
        rec = Idempotency().begin(tx, "after-restart")
        tx.execute("INSERT INTO invoices (id) VALUES (7)")
        rec.complete("ok")
        second = tx.scalar("SELECT pg_backend_pid()")
    assert second != first
    assert query(handlers_db, "SELECT status FROM idempotency_records WHERE key = 'after-restart'") == {"status": "done"}
    # Lost after the first statement, the transaction fails: its first statement's work is gone.
    with pytest.raises(psycopg.OperationalError):
        with transaction(db) as tx:
            tx.execute("INSERT INTO invoices (id) VALUES (8)")
            _terminate(handlers_db, second)
            tx.execute("INSERT INTO invoices (id) VALUES (9)")
    assert query(handlers_db, "SELECT count(*) AS n FROM invoices WHERE id IN (8, 9)") == {"n": 0}
    # The same when the first statement went through tx.conn itself: no silent reconnect either.
    with transaction(db) as tx:
        third = tx.scalar("SELECT pg_backend_pid()")
    with pytest.raises(psycopg.OperationalError):
        with transaction(db) as tx:
            tx.conn.execute("INSERT INTO invoices (id) VALUES (10)")
            _terminate(handlers_db, third)
            tx.execute("INSERT INTO invoices (id) VALUES (11)")
    assert query(handlers_db, "SELECT count(*) AS n FROM invoices WHERE id IN (10, 11)") == {"n": 0}
    with transaction(db) as tx:
        assert tx.scalar("SELECT count(*) FROM invoices") == 1


def test_transactions_do_not_nest(db):
    with transaction(db) as tx:
        with pytest.raises(RuntimeError, match="do not nest"):
            with transaction(db):
                pass
        tx.execute("INSERT INTO invoices (id) VALUES (1)")
    with transaction(db) as tx:  # the outer one committed and the connection is free again
        assert tx.scalar("SELECT count(*) FROM invoices") == 1


def test_a_begin_that_fails_on_sqlite_leaves_the_transaction_usable(tmp_path):
    # A sibling child holds the write lock past the busy timeout: BEGIN IMMEDIATE
    # fails, and the next transaction in this process must not be refused as nested.
    import sqlite3

    path = tmp_path / "handlers.db"
    db = toolkit.Database(f"sqlite:///{path}")
    conn, _ = db.connection()
    conn.execute("PRAGMA busy_timeout=50")  # fail fast instead of after 5 s
    conn.execute("CREATE TABLE t (x integer)")
    sibling = sqlite3.connect(path, isolation_level=None)
    try:
        sibling.execute("BEGIN IMMEDIATE")
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            with transaction(db) as tx:
                tx.execute("INSERT INTO t VALUES (1)")
        sibling.execute("COMMIT")
        with transaction(db) as tx:
            tx.execute("INSERT INTO t VALUES (2)")
        assert sibling.execute("SELECT x FROM t").fetchall() == [(2,)]
    finally:
        sibling.close()
        db.close()


# -- config and migrate ------------------------------------------------------------------------

def test_toolkit_config_validates_urls_and_resolves_sqlite_paths(tmp_path):
    cfg = from_dict({"toolkit": {"database_url": "sqlite:///app.db", "redis_url": "redis://h:6379/0?prefix=a:"}},
                    str(tmp_path))
    assert cfg.toolkit.database_url == f"sqlite:///{tmp_path}/app.db"
    assert cfg.toolkit.idempotency_retention == 7 * 86400.0
    with pytest.raises(ConfigError, match="toolkit.database_url: expected"):
        from_dict({"toolkit": {"database_url": "mysql://x"}})
    with pytest.raises(ConfigError, match="toolkit.redis_url: expected"):
        from_dict({"toolkit": {"redis_url": 5}})
    with pytest.raises(ConfigError, match="toolkit.idempotency_retention: expected a positive number"):
        from_dict({"toolkit": {"idempotency_retention": 0}})


def test_db_migrate_creates_the_idempotency_table_in_the_handlers_database(tmp_path, postgres_url):
    config = tmp_path / "tangguh.toml"
    config.write_text(f'[broker]\nurl = "sqlite:///broker.db"\n[toolkit]\ndatabase_url = "{postgres_url}"\n')
    for _ in range(2):  # idempotent
        done = tangguh("db", "migrate", "-c", str(config))
        assert done.returncode == 0, done.stderr
    assert "idempotency_records is up to date" in done.stdout
    schema = postgres_url.split("schema=")[1]
    with psycopg.connect(postgres_url.split("?")[0]) as conn:
        assert conn.execute("SELECT count(*) FROM information_schema.tables WHERE table_schema = %s"
                            " AND table_name = 'idempotency_records'", (schema,)).fetchone()[0] == 1
