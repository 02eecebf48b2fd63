"""Idempotency keys: a business effect happens once, however often its job runs.

Delivery is at-least-once: a child can die after its commit and before the
master acks, and the job then runs again. The guard is a row in the handlers'
own database, written in the same transaction as the effect::

    with ctx.transaction() as tx:
        rec = ctx.idempotency.begin(tx, f"invoice:{invoice_id}:recalc:{version}")
        if rec.done:
            return rec.result            # the effect is already durable: skip it
        ...                              # the effect, in tx
        rec.complete({"total": total})   # commit makes both durable together

``begin`` inserts the key as ``processing``. Three cases:

* the key is ``done`` (committed by an earlier run): ``rec.done`` is true and
  ``rec.result`` is what ``complete`` stored; ``duplicates_suppressed`` +1;
* a live twin holds the key in its open transaction: the insert waits on it
  for at most ``lock_timeout`` seconds, then sees ``done`` (the twin
  committed), gets the key (the twin rolled back), or raises ``RetryLater``;
* otherwise the key is ours; a rollback removes it with the effect.

``begin`` again with a key this transaction began already returns the same
``Record`` (a helper that begins the key its caller began is not a twin).

Committing after ``begin`` without ``complete`` is refused (the transaction
rolls back with ``IdempotencyError``): a ``processing`` row that outlives its
transaction would block the key for good.

Table ``idempotency_records(key, status, result_ref, job_id, created_at,
completed_at)`` (times: epoch seconds), created by ``tangguh db migrate``. A
key longer than ``MAX_KEY_BYTES`` is stored as its first 200 characters and
its SHA-256 (``stored_key``; ``Record.key`` is that form).
Done records older than ``toolkit.idempotency_retention`` seconds are pruned
by the children, at most every ``PRUNE_EVERY`` seconds each; after that a
very late duplicate would run again, so keep the retention longer than any
job can be retried. The prune runs after the job's transaction commits, as a
statement of its own: at most ``PRUNE_BATCH`` records, skipping any another
transaction has locked. Inside the job's transaction its row locks would last
as long as the job, and another child's prune, in its ``begin`` of an
unrelated key, would wait on them.

A job without a key uses none of this: ``begin(tx)`` with no key falls back
to the job's own ``idempotency_key``, and with none of either returns a record
that is not done and whose ``complete`` does nothing. A handler may derive a
key from its payload, as the invoice example does. The table is one namespace:
two job types enqueued with the same key share one record (the second finds
the first's effect done), as the SQL brokers already treat them as one job
while it is unfinished; give each effect a key of its own (``f"receipt:{order}"``).
"""
import hashlib
import json
import logging
import random
import time

from ..jsonvalues import is_storable
from ..retry import RetryLater

log = logging.getLogger("tangguh.idempotency")

PRUNE_EVERY = 600.0
PRUNE_BATCH = 1000
# The longest key stored as it is (UTF-8 bytes). PostgreSQL's btree refuses a primary-key entry past
# 2704 bytes, so a longer key (one derived from a big payload) failed every attempt there until the
# job was dead (the effect never happened) while SQLite took it. A longer key is stored as its
# first characters and the SHA-256 of all of it: one record per key, on both databases.
MAX_KEY_BYTES = 2600

_next_prune = 0.0


class IdempotencyError(Exception):
    """A transaction with a ``processing`` record tried to commit without ``complete``."""


class Record:
    """What ``begin`` returns: ``key``, ``done``, ``result``, ``complete(result_ref)``."""

    def __init__(self, tx, key, done, result=None):
        self.tx, self.key, self.done, self.result = tx, key, done, result
        self.completed = done or key is None

    def complete(self, result_ref=None):
        """Mark the key done with ``result_ref`` (JSON); durable when ``tx`` commits."""
        if self.done:
            raise IdempotencyError(f"key {self.key!r} was already done: skip the effect instead")
        if self.key is not None:
            try:
                ref = json.dumps(result_ref)
            except (TypeError, ValueError, RecursionError) as exc:
                raise TypeError(f"result_ref of idempotency key {self.key!r} is not JSON: {exc}") from None
            self.tx.execute("UPDATE idempotency_records SET status = 'done', result_ref = %s, completed_at = %s"
                            " WHERE key = %s", (ref, time.time(), self.key))
        self.result = result_ref
        self.completed = True

    def __repr__(self):
        return f"Record({self.key!r}, done={self.done})"


class Idempotency:
    """``ctx.idempotency``: ``begin(tx, key)``; see the module docstring.

    ``metrics`` is the job's counter dict (``ctx.metrics``); ``lock_timeout``
    bounds the wait on a live twin; ``retry_delay`` is the ``RetryLater``
    delay when that wait runs out.
    """

    def __init__(self, job=None, metrics=None, retention=None, lock_timeout=2.0, retry_delay=1.0):
        self.job = job
        self.metrics = metrics if metrics is not None else {}
        self.retention = retention
        self.lock_timeout = lock_timeout
        self.retry_delay = retry_delay

    def begin(self, tx, key=None):
        """Claim ``key`` inside ``tx``; a ``Record`` whose ``done`` says to skip the effect."""
        if key is None and self.job is not None:
            key = self.job.idempotency_key
        if key is None:
            return Record(tx, None, False)
        if not isinstance(key, str) or not key or not is_storable(key):
            # An int failed at complete() (text = smallint), a NUL or a lone surrogate in the driver.
            raise ValueError(f"idempotency key must be a non-empty string without NUL or lone surrogates,"
                             f" got {key!r}")
        key = stored_key(key)
        # On the transaction, not on self: ctx.idempotency makes a new Idempotency per use.
        held = tx.__dict__.setdefault("_idempotency_records", {})
        if key in held:
            return held[key]  # begun already in this transaction: our own row is no twin
        held[key] = record = self._claim(tx, key)
        return record

    def _claim(self, tx, key):
        self._maybe_prune(tx)
        job_id = self.job.id if self.job is not None else None
        inserted = self._insert(tx, key, job_id)
        if not inserted:
            row = tx.fetchone("SELECT status, result_ref FROM idempotency_records WHERE key = %s", (key,))
            if row is None:  # the twin rolled back between our insert and this read: take the key
                if not self._insert(tx, key, job_id):
                    raise RetryLater(self.retry_delay, f"idempotency key {key!r} is contended")
            elif row["status"] == "done":
                self.metrics["duplicates_suppressed"] = self.metrics.get("duplicates_suppressed", 0) + 1
                result = json.loads(row["result_ref"]) if row["result_ref"] is not None else None
                return Record(tx, key, True, result)
            else:
                raise RetryLater(self.retry_delay, f"idempotency key {key!r} is being processed")
        record = Record(tx, key, False)
        tx.before_commit(lambda: self._check_completed(record))
        return record

    def _insert(self, tx, key, job_id):
        sql = ("INSERT INTO idempotency_records (key, status, job_id, created_at) VALUES (%s, 'processing', %s, %s)"
               " ON CONFLICT (key) DO NOTHING")
        if tx.kind == "sqlite":  # BEGIN IMMEDIATE already serialises writers: no twin can be mid-insert
            return tx.execute(sql, (key, job_id, time.time())).rowcount == 1
        import psycopg

        try:
            with tx.lock_timeout(self.lock_timeout):
                tx.execute("SAVEPOINT tangguh_idempotency")
                inserted = tx.execute(sql, (key, job_id, time.time())).rowcount == 1
                tx.execute("RELEASE SAVEPOINT tangguh_idempotency")
        except psycopg.errors.LockNotAvailable:
            # A twin holds the key in a transaction still open after lock_timeout.
            tx.execute("ROLLBACK TO SAVEPOINT tangguh_idempotency")
            raise RetryLater(self.retry_delay, f"idempotency key {key!r} is held by a running twin") from None
        except psycopg.errors.UndefinedTable:
            raise IdempotencyError("table idempotency_records is missing: run `tangguh db migrate`"
                                   " with toolkit.database_url set") from None
        return inserted

    def _check_completed(self, record):
        if not record.completed:
            raise IdempotencyError(f"idempotency key {record.key!r} began but was never completed:"
                                   " call rec.complete(...) before the transaction ends")

    def _maybe_prune(self, tx):
        if not self.retention or time.monotonic() < _next_prune or tx.__dict__.get("_idempotency_prune"):
            return
        # The next prune is timed when this one runs: a transaction that rolls back prunes nothing,
        # and the child's next begin tries again.
        tx._idempotency_prune = True
        tx.after_commit(lambda: _prune_alone(tx.conn, tx.kind, self.retention))


def stored_key(key):
    """``key`` as ``idempotency_records`` holds it: itself, or past ``MAX_KEY_BYTES`` its start and digest."""
    raw = key.encode()
    if len(raw) <= MAX_KEY_BYTES:
        return key
    return f"{key[:200]}...sha256:{hashlib.sha256(raw).hexdigest()}"


def prune(tx, retention, limit=PRUNE_BATCH):
    """Delete up to ``limit`` done records completed more than ``retention`` seconds ago; the number deleted.

    Records another transaction holds locked are skipped, never waited on (PostgreSQL).
    """
    pick = "SELECT key FROM idempotency_records WHERE status = 'done' AND completed_at < %s LIMIT %s"
    if tx.kind == "postgres":
        pick += " FOR UPDATE SKIP LOCKED"
    return tx.execute(f"DELETE FROM idempotency_records WHERE key IN ({pick})",
                      (time.time() - retention, limit)).rowcount


def _prune_alone(conn, kind, retention):
    """``prune`` in a transaction of its own on ``conn``, just after the job's committed.

    An after-commit step: a failure here is logged, never the job's.
    """
    global _next_prune
    from .transaction import Transaction

    # Jittered, so that children started together do not prune together.
    _next_prune = time.monotonic() + PRUNE_EVERY * random.uniform(0.5, 1.5)
    tx = Transaction(conn, kind)  # SQLite's connection is in autocommit: the DELETE is its own transaction
    try:
        deleted = prune(tx, retention)
        if kind == "postgres":
            conn.commit()
    except Exception as exc:  # noqa: BLE001 - the next round prunes what this one left
        tx._rollback()
        log.warning("pruning idempotency records failed: %s: %s", type(exc).__name__, exc)
        return
    if deleted >= PRUNE_BATCH:
        _next_prune = 0.0  # a backlog: the next begin prunes the next batch


def create_table(conn, kind):
    """The ``idempotency_records`` table (idempotent DDL) on a raw connection."""
    conn.execute("CREATE TABLE IF NOT EXISTS idempotency_records ("
                 " key text PRIMARY KEY,"
                 " status text NOT NULL CHECK (status IN ('processing', 'done')),"
                 " result_ref text,"
                 " job_id text,"
                 " created_at double precision NOT NULL,"
                 " completed_at double precision)")
    conn.execute("CREATE INDEX IF NOT EXISTS idempotency_records_completed ON idempotency_records (completed_at)"
                 " WHERE status = 'done'")
