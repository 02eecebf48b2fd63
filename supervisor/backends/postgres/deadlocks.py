"""Deadlocks PostgreSQL broke by aborting one side, which it rolls back whole: the broker's
transactions that run again (a single statement runs again in ``connection.execute``).

Every write the broker makes is fenced (id, token, state) or checks the state it changes, so
running it again stores what it would have.
"""
import collections.abc
import functools
import logging

from psycopg import errors as pgerrors

from ...errors import BrokerError

log = logging.getLogger("tangguh.broker")

# Runs of a deadlock's victim after the first: each waits for the other side to have gone
# (PostgreSQL's deadlock_timeout, 1 s by default), so a few are plenty.
DEADLOCK_RETRIES = 3


def deadlock_retried(method):
    """A broker method whose transaction runs again when PostgreSQL aborted it to break a
    deadlock (never one in a caller's transaction: ``conn=``)."""
    @functools.wraps(method)
    def retried(self, *args, **kwargs):
        # An iterator of ids would be empty on the second run.
        args = [list(a) if isinstance(a, collections.abc.Iterator) else a for a in args]
        for retries_left in range(DEADLOCK_RETRIES, -1, -1):
            try:
                return method(self, *args, **kwargs)
            except BrokerError as exc:
                if (not retries_left or kwargs.get("conn") is not None
                        or not isinstance(exc.__cause__, pgerrors.DeadlockDetected)):
                    raise
                log_retry(method.__name__, exc.__cause__)
    return retried


def deadlock_retried_step(what, step):
    """``step()``, one of a call's several transactions, run again alone when PostgreSQL aborted it
    to break a deadlock (the whole call again would find its earlier steps committed)."""
    for retries_left in range(DEADLOCK_RETRIES, -1, -1):
        try:
            return step()
        except pgerrors.DeadlockDetected as exc:
            if not retries_left:
                raise
            log_retry(what, exc)


def log_retry(what, exc):
    log.warning("postgres %s chosen to break a deadlock, running it again: %s", what,
                str(exc).splitlines()[0], extra={"event": "deadlock_retry"})
