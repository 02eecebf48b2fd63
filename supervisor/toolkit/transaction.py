"""One database transaction for a handler, with after-commit steps.

``ctx.transaction()`` (see ``supervisor.toolkit.connections``) yields a ``Transaction`` on
the child's own connection to the handlers' database (PostgreSQL, or SQLite
for the embedded mode)::

    with ctx.transaction() as tx:
        tx.execute("UPDATE invoices SET total = %s WHERE id = %s", (total, invoice_id))
        tx.after_commit(lambda: print("durable"))

Leaving the block normally commits; an exception rolls back and propagates.
The commit and the after-commit steps run inside ``timeouts.critical()``: a
soft timeout that fires during COMMIT is raised after them, so the database and the job's outcome never
disagree (a committed effect reported as a failure would still be safe to
re-run thanks to idempotency keys, but it would be a lie in the job history).

After-commit steps (cache invalidation, notifications) run in the order they
were added, only once the commit succeeded, never on rollback. If one raises,
the job fails and is retried; the retry finds its idempotency record done and
runs the after-commit steps again, so they must be idempotent (deleting cache
keys is).
"""
import contextlib
import logging

from ..child import timeouts

log = logging.getLogger("tangguh.transaction")


class Transaction:
    """An open transaction: ``execute``, ``fetchone``/``fetchall`` helpers, ``after_commit``.

    SQL uses ``%s`` placeholders on both databases (they are rewritten to
    ``?`` for SQLite). ``tx.conn`` is the raw driver connection (psycopg 3 or
    sqlite3) for anything else. ``tx.kind`` is ``"postgres"`` or ``"sqlite"``.
    """

    def __init__(self, conn, kind, reconnect=None):
        self.conn = conn
        self.kind = kind
        self.state = "open"  # open, committed, rolled_back
        self._after_commit = []
        self._before_commit = []
        self._reconnect = reconnect  # reconnect(broken conn) -> a new one, for the first statement only

    def execute(self, sql, params=()):
        """Run one statement; return the driver's cursor."""
        if self.kind == "sqlite":
            sql = sql.replace("%s", "?")
            return self.conn.execute(sql, params)
        if self._reconnect is not None:
            return self._first(sql, params)
        return self.conn.execute(sql, params)

    def _first(self, sql, params):
        """The transaction's first statement, once more on a new connection if the server had
        closed this one while it sat idle between jobs (a restart, a failover, a terminated backend,
        ``idle_session_timeout``): otherwise every child failed its next job, an attempt spent.
        Nothing of this transaction was committed, so nothing of it happens twice. A connection
        lost after the first statement still fails the transaction (its earlier work is gone)."""
        import psycopg
        from psycopg.pq import TransactionStatus

        reconnect, self._reconnect = self._reconnect, None
        # Idle: no statement of this block ran yet, through ``tx.conn`` either (a handler may use it
        # directly); one that did would be lost by a silent reconnect, half the block committed.
        idle = self.conn.info.transaction_status == TransactionStatus.IDLE
        try:
            return self.conn.execute(sql, params)
        except psycopg.OperationalError as exc:
            if not (idle and self.conn.broken):
                raise
            log.info("the handlers' database closed an idle connection (%s): reconnecting", exc)
        self.conn = reconnect(self.conn)
        return self.conn.execute(sql, params)

    def fetchone(self, sql, params=()):
        """The first row as a dict, or None."""
        cur = self.execute(sql, params)
        row = cur.fetchone()
        if row is None:
            return None
        return dict(zip([d[0] for d in cur.description], row))

    def fetchall(self, sql, params=()):
        """Every row as a dict."""
        cur = self.execute(sql, params)
        names = [d[0] for d in cur.description]
        return [dict(zip(names, row)) for row in cur.fetchall()]

    def scalar(self, sql, params=()):
        """The first column of the first row (None when there is no row)."""
        row = self.execute(sql, params).fetchone()
        return None if row is None else row[0]

    @contextlib.contextmanager
    def lock_timeout(self, seconds):
        """PostgreSQL: wait at most ``seconds`` for locks inside the block (None: unchanged).

        A lock not granted in time raises ``psycopg.errors.LockNotAvailable``.
        The previous setting is restored afterwards unless the transaction
        failed (it must roll back anyway).
        """
        if seconds is None or self.kind != "postgres":
            yield
            return
        import psycopg

        previous = self.scalar("SELECT current_setting('lock_timeout')")
        self.execute("SELECT set_config('lock_timeout', %s, true)", (f"{max(1, int(seconds * 1000))}ms",))
        try:
            yield
        finally:
            if self.conn.info.transaction_status != psycopg.pq.TransactionStatus.INERROR:
                self.execute("SELECT set_config('lock_timeout', %s, true)", (previous,))

    def after_commit(self, fn):
        """Run ``fn()`` once this transaction has committed; dropped on rollback."""
        if self.state != "open":
            raise RuntimeError(f"transaction already {self.state.replace('_', ' ')}")
        self._after_commit.append(fn)

    def before_commit(self, fn):
        """Run ``fn()`` just before COMMIT (a check that may still abort the transaction)."""
        self._before_commit.append(fn)

    # -- used by run() ---------------------------------------------------------
    def _commit(self):
        for fn in self._before_commit:
            fn()
        if self.kind == "sqlite":
            self.conn.execute("COMMIT")
        else:
            import psycopg

            if self.conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR:
                # A statement failed and the handler caught its error: PostgreSQL answers COMMIT
                # with a rollback and psycopg raises nothing, so the job would be done with its
                # effect (and idempotency record) gone.
                raise psycopg.errors.InFailedSqlTransaction(
                    "a statement in this transaction failed (its error was caught inside the block):"
                    " nothing was committed")
            self.conn.commit()
        self.state = "committed"

    def _rollback(self):
        """Roll back; False if even that failed (the connection is then not to be reused)."""
        self.state = "rolled_back"
        self._after_commit.clear()
        try:
            if self.kind == "sqlite":
                if self.conn.in_transaction:
                    self.conn.execute("ROLLBACK")
            else:
                self.conn.rollback()
        except Exception as exc:  # noqa: BLE001 - the first error is the one that matters
            log.debug("rollback failed: %s: %s", type(exc).__name__, exc)
            return False
        return True

    def _run_after_commit(self):
        steps, self._after_commit = self._after_commit, []
        for fn in steps:
            fn()


class transaction:  # noqa: N801 - used as a context manager, reads like a function
    """``with transaction(db) as tx:`` on a ``toolkit.Database`` (commit, or rollback on error).

    Handlers use ``ctx.transaction()``, which passes the child's database.
    """

    def __init__(self, db):
        self.db = db
        self.tx = None

    def __enter__(self):
        if getattr(self.db, "busy", False):
            # One connection per process: an inner COMMIT would commit the outer block too.
            raise RuntimeError("ctx.transaction() is already open in this process: do not nest them")
        conn, kind = self.db.connection()
        self.db.busy = True
        try:
            if kind == "sqlite":
                conn.execute("BEGIN IMMEDIATE")  # take the write lock now: no upgrade deadlocks later
            self.tx = Transaction(conn, kind, self.db.reconnect if kind == "postgres" else None)
        except BaseException:
            # __exit__ will not run: a BEGIN that failed ("database is locked" after
            # the busy timeout, a JobTimeout while waiting) must not leave this
            # process's only connection marked busy, or open, for good.
            self.db.busy = False
            if kind == "sqlite" and conn.in_transaction and not Transaction(conn, kind)._rollback():
                self.db.discard(conn)
            raise
        return self.tx

    def __exit__(self, exc_type, exc, tb):
        self.db.busy = False
        tx = self.tx
        if exc_type is None:
            # A soft timeout waits until the commit and the after-commit steps
            # are both over: it must not split them.
            with timeouts.critical():
                try:
                    tx._commit()
                except BaseException:
                    if not tx._rollback():
                        self.db.discard(tx.conn)
                    self.db.check(tx.conn)
                    raise
                tx._run_after_commit()
            return False
        if not tx._rollback():
            self.db.discard(tx.conn)  # e.g. a JobTimeout landed inside a driver call
        self.db.check(tx.conn)
        return False
