"""The effect rows of the crash matrix, with a real ``tangguh run``, PostgreSQL and Redis.

The handlers' database is a fresh PostgreSQL schema and the locks and cache
live under a fresh Redis key prefix; the broker is a SQLite file (the effects
do not depend on it). Handlers are the real ``handlers/invoices.py`` and the
wrappers in ``tests/handlers/toolkit_jobs.py`` that SIGKILL a child at a
chosen instant. Each test ends with nothing leased, no lock left in Redis and
the daemon stopped cleanly.
"""
import json
import os
import shutil
import signal

import pytest

from supervisor import toolkit
from supervisor.toolkit.cache import Cache
from supervisor.toolkit.transaction import transaction

from .daemon import Daemon, read_lines, tangguh
from .toolkit_fixtures import INVOICES, handlers_db, invoices, new_invoice, query, toolkit_redis  # noqa: F401
from .util import wait_for


@pytest.fixture
def env(tmp_path, handlers_db, toolkit_redis):
    made = []

    def start(workers=2):
        d = Daemon(tmp_path, handler_files=("toolkit_jobs.py",), supervisor={"workers": workers},
                   toolkit={"database_url": handlers_db, "redis_url": toolkit_redis})
        shutil.copy(INVOICES, d.handlers)
        made.append(d)
        return d.start()

    client, prefix = toolkit.open_redis(toolkit_redis)
    yield start, handlers_db, client, prefix
    for d in made:
        d.stop()
    client.close()


def finish(d, client, prefix):
    """Stop the daemon and check it left nothing behind: no lease, no child, no Redis lock."""
    d.signal(signal.SIGTERM)
    assert d.wait_exit() == 0
    d.assert_clean()
    assert [k for k in client.scan_iter(match=f"{prefix}lock:*") if not k.endswith(b":fence")] == []


def summary_reader(db_url, client, prefix):
    """A reader outside the daemon (think: the web app) going through the same cache."""
    db = toolkit.Database(db_url)
    cache = Cache(client, prefix)
    return lambda invoice_id: invoices.invoice_summary(cache, lambda: transaction(db), invoice_id)


def test_child_killed_after_commit_before_ack_reruns_without_a_second_effect(env, tmp_path):
    start, db_url, client, prefix = env
    new_invoice(db_url, 1, [100, 250])
    read = summary_reader(db_url, client, prefix)
    assert read(1)["total"] == 0  # cached before the job
    d = start()
    marker, release = str(tmp_path / "m"), str(tmp_path / "release")
    job_id = d.enqueue("recalc_crash", {"invoice_id": 1, "version": 1, "crash": "after_commit",
                                        "marker": marker, "release": release})
    wait_for(lambda: any(line[0] == "started" and line[1] == "2" for line in read_lines(marker)),
             message="the re-run after the crash")
    # Between the crash and the re-run: the effect is durable, the job not acked.
    assert [line[0] for line in read_lines(marker)] == ["started", "done", "dying", "started"]
    assert query(db_url, "SELECT total, recalculations FROM invoices WHERE id = 1") == {
        "total": 350, "recalculations": 1}
    assert d.job(job_id).state != "done"
    # Plant a wrong entry under the tag: only the duplicate path's invalidation can remove it.
    Cache(client, prefix).get_or_build("invoice:1:summary", lambda: {"total": -1}, ttl=300, tags=["invoice:1"])
    assert read(1) == {"total": -1}
    open(release, "w").close()
    job = d.wait_job(job_id)
    assert (job.state, job.attempt) == ("done", 2)
    assert job.history[0]["error"]["reason"] == "crashed"
    assert job.result == {"invoice_id": 1, "version": 1, "total": 350}  # the stored result, not a re-run
    assert query(db_url, "SELECT total, recalculations FROM invoices WHERE id = 1") == {
        "total": 350, "recalculations": 1}
    assert d.status()["counters"]["duplicates_suppressed"] == 1
    assert read(1)["total"] == 350  # the re-run invalidated the cache tag after its (empty) commit
    finish(d, client, prefix)


def test_child_killed_between_commit_and_invalidation_no_reader_sees_the_old_total(env, tmp_path):
    start, db_url, client, prefix = env
    new_invoice(db_url, 2, [40, 2])
    read = summary_reader(db_url, client, prefix)
    assert read(2)["total"] == 0
    d = start()
    marker, release = str(tmp_path / "m"), str(tmp_path / "release")
    job_id = d.enqueue("recalc_crash", {"invoice_id": 2, "version": 1, "crash": "before_invalidation",
                                        "marker": marker, "release": release})
    wait_for(lambda: any(line[0] == "started" and line[1] == "2" for line in read_lines(marker)),
             message="the re-run after the crash")
    # The crash hit the window: committed, cache not yet invalidated (this is what the re-run repairs).
    assert [line[0] for line in read_lines(marker)] == ["started", "dying", "started"]
    assert query(db_url, "SELECT total FROM invoices WHERE id = 2")["total"] == 42
    assert read(2)["total"] == 0
    open(release, "w").close()
    assert d.wait_job(job_id).state == "done"
    assert read(2)["total"] == 42  # the duplicate path ran the after-commit invalidation
    assert query(db_url, "SELECT recalculations FROM invoices WHERE id = 2")["recalculations"] == 1
    assert d.status()["counters"]["duplicates_suppressed"] == 1
    finish(d, client, prefix)


def hold_lock(d, marker, name, ttl):
    """Enqueue a ``hold_lock`` job and wait until its first attempt holds the lock: (job id, its marker line)."""
    job_id = d.enqueue("hold_lock", {"name": name, "ttl": ttl, "wait": 30, "marker": marker})
    return job_id, wait_for(lambda: [line for line in read_lines(marker) if line[0] == "acquired"],
                            message="the first attempt to hold the lock")[0]


def test_child_killed_holding_a_redis_lock_frees_it_long_before_its_ttl(env, tmp_path):
    start, db_url, client, prefix = env
    d = start()
    marker = str(tmp_path / "m")
    job_id, first = hold_lock(d, marker, "invoice:3:export", ttl=60)
    key = first[6]
    # The master knows the lock and keeps extending it: between two readings its PTTL goes
    # back up. (Against the first reading alone this races: taken a millisecond after the
    # acquire, it is as high as any extension leaves it.)
    readings = [client.pttl(key)]

    def went_up():
        readings.append(client.pttl(key))
        return readings[-1] > readings[-2]

    wait_for(went_up, timeout=5, message="the heartbeat to extend the lock")
    os.kill(int(first[2]), signal.SIGKILL)
    job = d.wait_job(job_id)
    second = [line for line in read_lines(marker) if line[0] == "acquired"][1]
    assert (job.state, job.attempt, second[1]) == ("done", 2, "2")
    assert int(second[4]) > int(first[4])  # a newer fencing token
    # Waited far less than the 60 s TTL: the master released the dead child's lock at once.
    assert float(second[5]) < 10
    assert not client.exists(key)
    finish(d, client, prefix)


def test_a_lock_with_a_ttl_shorter_than_a_heartbeat_stays_held_while_its_job_runs(env, tmp_path):
    """In a worker a lock's TTL is at least the job's lease (5 s here): the master extends each
    lock once a heartbeat (0.5 s here), by its TTL, and a lock of 0.2 s lapsed between two beats
    under a job still running, free for another job to take."""
    start, db_url, client, prefix = env
    d = start()
    marker = str(tmp_path / "m")
    job_id, first = hold_lock(d, marker, "invoice:4:export", ttl=0.2)
    key = first[6]
    readings = [client.pttl(key)]
    assert readings[0] > 1000, f"a TTL of {readings[0]} ms: the job's lease is no floor"

    def extended_twice():
        readings.append(client.pttl(key))
        return sum(1 for a, b in zip(readings, readings[1:]) if b > a) >= 2

    wait_for(extended_twice, timeout=10, message="two heartbeats to extend the lock")
    assert min(readings) > 0, "the lock lapsed between two heartbeats"
    os.kill(int(first[2]), signal.SIGKILL)
    assert d.wait_job(job_id).state == "done"
    finish(d, client, prefix)


def test_a_lock_whose_master_died_lapses_with_its_jobs_lease_not_at_its_ttl(env, tmp_path):
    """A master SIGKILLed (the OOM killer) takes its children with it: nobody holds the lock, and
    the job is claimed again once its lease (5 s here) has run out. The lock lived on to the TTL
    its handler asked for (600 s), so every retry met LockBusy until the job was dead-lettered.
    In a worker the master extends a lock each beat: its TTL is the job's lease, no more."""
    start, db_url, client, prefix = env
    d = start()
    marker = str(tmp_path / "m")
    job_id, first = hold_lock(d, marker, "invoice:5:export", ttl=600)
    key = first[6]
    d.signal(signal.SIGKILL)
    d.wait_exit()
    wait_for(lambda: not client.exists(key), timeout=20, message="the lock of a dead master's job to lapse")


def test_a_builder_killed_holding_the_fill_lease_frees_it_so_the_next_read_builds_and_stores(env, tmp_path):
    """The fill lease of a builder whose child died lived its whole TTL: every reader meanwhile
    waited, then built for itself without storing (a stampede on the database the cache is
    there to spare). The master frees it with the child's locks; the retry builds and stores."""
    start, db_url, client, prefix = env
    d = start()
    marker = str(tmp_path / "m")
    job_id = d.enqueue("fill_cache", {"key": "report:9", "marker": marker})
    first = wait_for(lambda: read_lines(marker), message="the first build to start")[0]
    assert client.exists(f"{prefix}cache-lease:report:9")
    os.kill(int(first[2]), signal.SIGKILL)
    job = d.wait_job(job_id)
    assert (job.state, job.attempt, job.result) == ("done", 2, {"built_by": 2})
    assert [line[:2] for line in read_lines(marker)] == [["building", "1"], ["building", "2"]]
    stored = client.get(f"{prefix}cache:report:9")
    assert stored is not None and json.loads(stored)["v"] == {"built_by": 2}  # built under the lease: stored
    finish(d, client, prefix)


def test_export_under_a_redis_lock_stores_its_fence_and_an_older_fence_is_refused(env):
    start, db_url, client, prefix = env
    new_invoice(db_url, 6, [500])
    d = start()
    first = d.wait_job(d.enqueue("export_invoice", {"invoice_id": 6}))
    second = d.wait_job(d.enqueue("export_invoice", {"invoice_id": 6}))
    assert first.state == second.state == "done" and second.result["fence"] > first.result["fence"]
    assert query(db_url, "SELECT export_fence FROM invoices WHERE id = 6")["export_fence"] == second.result["fence"]
    # The first holder, late: its fence is older than the one stored.
    db = toolkit.Database(db_url)
    with pytest.raises(invoices.LockLost):
        with transaction(db) as tx:
            invoices.record_export(tx, 6, 1, first.result["fence"])
    db.close()
    finish(d, client, prefix)


def test_a_lock_the_job_left_behind_is_released_with_its_result(env):
    start, db_url, client, prefix = env
    d = start()
    job = d.wait_job(d.enqueue("leak_lock", {"name": "leaked"}))
    assert job.state == "done" and job.result["key"] == prefix + "lock:leaked"
    wait_for(lambda: not client.exists(job.result["key"]), timeout=5, message="the master to release the lock")
    finish(d, client, prefix)


def test_reload_refuses_a_new_toolkit_redis_url(env):
    start, db_url, client, prefix = env
    d = start()
    d.config["toolkit"]["redis_url"] = "redis://127.0.0.1:6379/1"
    d.write_config()
    d.signal(signal.SIGHUP)
    status = wait_for(lambda: (s := d.status())["reload_error"] and s, message="the reload to be refused")
    assert "toolkit.redis_url: changing it needs a restart" in status["reload_error"]
    assert status["generation"] == 1
    finish(d, client, prefix)


def test_50_recalculations_of_one_invoice_from_4_children_lose_no_update(env):
    start, db_url, client, prefix = env
    amounts = list(range(1, 31))
    new_invoice(db_url, 4, amounts)
    d = start(workers=4)
    # 25 versions, each enqueued twice: 25 effects and 25 duplicates, all at once.
    ids = [d.enqueue("recalculate_invoice", {"invoice_id": 4, "version": v}) for v in range(1, 26) for _ in (0, 1)]
    for job_id in ids:
        assert d.wait_job(job_id, timeout=60).state == "done"
    row = query(db_url, "SELECT total, version, recalculations FROM invoices WHERE id = 4")
    assert row == {"total": sum(amounts), "version": 25, "recalculations": 25}
    assert query(db_url, "SELECT count(*) AS n FROM idempotency_records WHERE status = 'done'")["n"] == 25
    assert d.status()["counters"]["duplicates_suppressed"] == 25
    assert len({w["pid"] for w in d.status()["workers"]}) == 4
    finish(d, client, prefix)


def test_demo_invoices_runs_the_example_end_to_end(handlers_db, toolkit_redis):
    done = tangguh("demo", "invoices", "--database-url", handlers_db, "--redis-url", toolkit_redis, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "'total': 7249, 'version': 2, 'recalculations': 2}; duplicates suppressed: 1" in done.stdout
    assert "(cache invalidated after the commit, rebuilt): {'id': 1001, 'total': 6549" in done.stdout
