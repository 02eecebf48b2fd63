"""Handlers for the chaos soak (``tests/chaos``, ``bench/chaos.py``).

Every run of every job leaves evidence in the handlers' database (the
toolkit's ``[toolkit] database_url``: a SQLite file, or a PostgreSQL schema on
a server the soak never restarts), outside the broker:

* ``starts``: one row per run that began (its own short transaction, before
  any work): the at-least-once side, including runs later killed;
* ``executions``: one row per run that reached its commit, written in the same
  transaction as the effect, with ``suppressed`` true when the toolkit's
  idempotency record for the job's key was already done (a re-run of a job
  whose effect is committed: ``ctx.idempotency`` skips the effect);
* ``effects`` and ``accounts``: the business effect is a non-idempotent
  ``balance = balance + amount`` plus an ``effects`` row, guarded only by
  ``ctx.idempotency`` (``effects`` has no unique constraint of its own: the
  checker counts its rows per key, and an unguarded second run would show as
  a wrong balance too).

Types: ``chaos.quick``, ``chaos.cpu`` (a hash chain), ``chaos.slow`` (sleeps),
``chaos.flaky`` (raises before its effect on the first ``fails`` attempts),
``chaos.after`` (commits, then raises on attempt 1: a duplicate by design),
``chaos.locked`` (the effect under ``ctx.lock`` on the account, its write fenced
by the lock's token: a holder whose lock expired under it, its supervisor
stopped, has its write refused) and ``chaos.poison`` (always raises;
``Permanent`` when ``permanent`` is set).
"""
import hashlib
import os
import time

import supervisor

# Created by the soak next to the toolkit's idempotency_records (same SQL on both databases).
TABLES = (
    "CREATE TABLE IF NOT EXISTS starts (key TEXT NOT NULL, job_id TEXT NOT NULL, attempt INTEGER, pid INTEGER,"
    " at DOUBLE PRECISION)",
    "CREATE TABLE IF NOT EXISTS executions (key TEXT NOT NULL, job_id TEXT NOT NULL, attempt INTEGER,"
    " pid INTEGER, suppressed BOOLEAN NOT NULL, at DOUBLE PRECISION)",
    "CREATE TABLE IF NOT EXISTS effects (key TEXT NOT NULL, job_id TEXT NOT NULL, amount INTEGER NOT NULL,"
    " pid INTEGER)",
    "CREATE TABLE IF NOT EXISTS accounts (id INTEGER PRIMARY KEY, balance BIGINT NOT NULL,"
    " fence BIGINT NOT NULL DEFAULT 0)",
    "CREATE TABLE IF NOT EXISTS fenced (key TEXT NOT NULL, job_id TEXT NOT NULL, attempt INTEGER, fence BIGINT)",
)
ACCOUNTS = 16


class _Refused(Exception):
    """The fenced write matched no row: a newer lock holder has written."""


def _run(ctx, payload, work=None, fail_before=False, fail_after=False, fence=None):
    job, pid = ctx.job, os.getpid()
    with ctx.transaction() as tx:
        tx.execute("INSERT INTO starts VALUES (%s, %s, %s, %s, %s)",
                   (job.idempotency_key, job.id, job.attempt, pid, time.time()))
    if work is not None:
        work()
    if fail_before:
        raise RuntimeError(f"transient failure on attempt {job.attempt}")
    try:
        with ctx.transaction() as tx:
            rec = ctx.idempotency.begin(tx)  # the job's idempotency key
            if not rec.done:
                tx.execute("INSERT INTO effects VALUES (%s, %s, %s, %s)",
                           (job.idempotency_key, job.id, payload["amount"], pid))
                if fence is None:
                    tx.execute("UPDATE accounts SET balance = balance + %s WHERE id = %s",
                               (payload["amount"], payload["acct"]))
                elif tx.execute("UPDATE accounts SET balance = balance + %s, fence = %s WHERE id = %s AND fence < %s",
                                (payload["amount"], fence, payload["acct"], fence)).rowcount != 1:
                    raise _Refused()
                rec.complete({"pid": pid})
            tx.execute("INSERT INTO executions VALUES (%s, %s, %s, %s, %s, %s)",
                       (job.idempotency_key, job.id, job.attempt, pid, rec.done, time.time()))
    except _Refused:
        with ctx.transaction() as tx:  # evidence of the refused write (the effect's transaction rolled back)
            tx.execute("INSERT INTO fenced VALUES (%s, %s, %s, %s)", (job.idempotency_key, job.id, job.attempt, fence))
        raise supervisor.LockLost(f"a newer holder of the lock wrote with a fence above {fence}") from None
    if fail_after:
        raise RuntimeError("failed after the commit: the retry must be suppressed")
    return {"fresh": not rec.done}


@supervisor.job("chaos.quick")
def quick(ctx, payload):
    return _run(ctx, payload)


@supervisor.job("chaos.cpu")
def cpu(ctx, payload):
    def work():
        h = b"tangguh"
        for _ in range(payload.get("rounds", 20000)):
            h = hashlib.sha256(h).digest()

    return _run(ctx, payload, work)


@supervisor.job("chaos.slow")
def slow(ctx, payload):
    return _run(ctx, payload, lambda: time.sleep(payload.get("secs", 0.2)))


@supervisor.job("chaos.flaky")
def flaky(ctx, payload):
    return _run(ctx, payload, fail_before=ctx.job.attempt <= payload.get("fails", 1))


@supervisor.job("chaos.after")
def after(ctx, payload):
    return _run(ctx, payload, fail_after=ctx.job.attempt == 1)


@supervisor.job("chaos.locked")
def locked(ctx, payload):
    with ctx.lock(f"acct:{payload['acct']}", ttl=payload.get("ttl", 5.0), wait=5.0) as lock:
        secs = payload.get("secs")  # a few hold the lock a while: a supervisor stopped meanwhile lets it expire
        return _run(ctx, payload, (lambda: time.sleep(secs)) if secs else None, fence=lock.fence)


@supervisor.job("chaos.poison")
def poison(ctx, payload):
    with ctx.transaction() as tx:
        tx.execute("INSERT INTO starts VALUES (%s, %s, %s, %s, %s)",
                   (ctx.job.idempotency_key, ctx.job.id, ctx.job.attempt, os.getpid(), time.time()))
    if payload.get("permanent"):
        raise supervisor.Permanent("poison: refuses every payload")
    raise ValueError(f"poison attempt {ctx.job.attempt}")
