"""Handlers for the outage and many-supervisor tests.

``effect`` records every execution and, once per job, its business effect in a
SQLite file named by the payload (``db``): a store outside the broker, so it
survives broker restarts and both supervisors of a test share it. The effect is
an ``INSERT OR IGNORE`` keyed by job id, the way a real handler guards its
effect with an idempotency key; the executions table shows every run.

With ``faults`` in the payload (``{"<attempt>": "<fault>"}``), the handler
breaks the broker (for real) just before it returns on that attempt, so the
master's ack / retry / dead-letter write meets the fault:

* ``redis_acl_off``: disable the Redis ACL user ``payload["user"]`` and kill
  its connections: the master can neither talk nor reconnect until the test
  turns the user back on;
* ``pg_nologin``: ``ALTER ROLE ... NOLOGIN`` the supervisor's PostgreSQL role
  and terminate its sessions (found by ``application_name``);
* ``pg_refuse_done``: add a CHECK constraint that refuses this job's move to
  ``done``: the ack fails while every other call (claim, lease renewal) works —
  the shape of solid_queue #748. ``pg_allow_done`` drops it again.

With ``wait_running`` (job ids), it first waits until those jobs are leased
(read through ``admin_broker_url``), so they sit prefetched in the master.
With ``gate`` (a path), it waits after recording its effect until that file
exists (bounded), so the job is in flight until the test opens the gate.

``outcome`` chooses what the handler then does: ``ok`` (default), ``retry``
(raises, so the job is retried) or ``dead`` (raises ``Permanent``).
"""
import os
import sqlite3
import time

import supervisor

SCHEMA = """
CREATE TABLE IF NOT EXISTS executions (job_id TEXT NOT NULL, attempt INTEGER, pid INTEGER, at REAL);
CREATE TABLE IF NOT EXISTS effects (job_id TEXT PRIMARY KEY, pid INTEGER, at REAL);
"""

_dbs = {}


def open_db(path):
    db = _dbs.get(path)
    if db is None:
        db = sqlite3.connect(path, timeout=30, isolation_level=None)
        # Two children opening a new file at once: the switch to WAL fails "database is locked" without
        # waiting on the busy timeout (seen: a gated job retried). Tried again until it holds, bounded.
        deadline = time.monotonic() + 30
        while True:
            try:
                db.execute("PRAGMA journal_mode=WAL")
                break
            except sqlite3.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
        db.execute("PRAGMA synchronous=NORMAL")
        db.executescript(SCHEMA)
        _dbs[path] = db
    return db


def record(path, job_id, attempt):
    db = open_db(path)
    now, pid = time.time(), os.getpid()
    db.execute("BEGIN IMMEDIATE")
    try:
        db.execute("INSERT INTO executions VALUES (?, ?, ?, ?)", (job_id, attempt, pid, now))
        db.execute("INSERT OR IGNORE INTO effects VALUES (?, ?, ?)", (job_id, pid, now))
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise


def wait_running(payload):
    """Wait (bounded) until the jobs in ``payload["wait_running"]`` are leased: claimed by our master."""
    ids = payload.get("wait_running")
    if not ids:
        return
    from supervisor.backends import open_broker

    with open_broker(payload["admin_broker_url"]) as broker:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if all((job := broker.get(i)) is not None and job.state == "running" for i in ids):
                return
            time.sleep(0.01)
    raise RuntimeError(f"jobs {ids} were never claimed")


def wait_gate(payload):
    gate = payload.get("gate")
    deadline = time.monotonic() + 120
    while gate and not os.path.exists(gate):
        if time.monotonic() > deadline:
            raise RuntimeError(f"gate {gate} never opened")
        time.sleep(0.01)


def inject(ctx, payload, fault):
    if fault == "redis_acl_off":
        import redis

        with redis.Redis.from_url(payload["admin_url"]) as r:
            r.acl_setuser(payload["user"], enabled=False, reset_passwords=False)
            r.execute_command("CLIENT", "KILL", "USER", payload["user"])
    elif fault in ("pg_nologin", "pg_refuse_done", "pg_allow_done"):
        import psycopg

        with psycopg.connect(payload["admin_url"], autocommit=True) as db:
            if fault == "pg_nologin":
                db.execute(f'ALTER ROLE "{payload["role"]}" NOLOGIN')
                db.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s",
                           (payload["application_name"],))
            elif fault == "pg_refuse_done":
                literal = ctx.job.id.replace("'", "''")
                db.execute(f'ALTER TABLE "{payload["schema"]}".jobs ADD CONSTRAINT tangguh_test_refuse_done'
                           f" CHECK (state <> 'done' OR id <> '{literal}') NOT VALID")
            else:
                db.execute(f'ALTER TABLE "{payload["schema"]}".jobs'
                           " DROP CONSTRAINT IF EXISTS tangguh_test_refuse_done")
    else:
        raise supervisor.Permanent(f"unknown fault {fault!r}")


@supervisor.job("effect")
def effect(ctx, payload):
    record(payload["db"], ctx.job.id, ctx.job.attempt)
    wait_gate(payload)
    faults = payload.get("faults", {})  # attempt number (as text) -> fault name
    fault = faults.get(str(ctx.job.attempt))
    if fault:
        wait_running(payload)
        inject(ctx, payload, fault)
    outcome = payload.get("outcome", "ok")
    if outcome == "retry" and ctx.job.attempt == 1:
        raise RuntimeError("fails once, on purpose")
    if outcome == "dead":
        raise supervisor.Permanent("dead on purpose")
    return {"attempt": ctx.job.attempt}
