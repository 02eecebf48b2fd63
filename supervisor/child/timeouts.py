"""Soft timeouts that never land inside a commit.

The child arms a timer when a job starts. When it fires, ``JobTimeout`` is
raised in the handler, unless a critical section is open (a database commit,
a broker call): then it is deferred and raised when the outermost section
closes. Raising it inside COMMIT could leave the database committed while the
job reports failure (Celery issue #10271). SIGTERM from the master (the grace
before a hard-timeout SIGKILL) takes the same path.
"""
import contextlib
import signal


class JobTimeout(Exception):
    """Raised inside a handler when its soft timeout passes.

    Never raised in the middle of a critical section (a commit, a broker call):
    see ``supervisor.critical``. Catch it to clean up; the attempt
    counts as failed with reason ``timeout``.
    """


_depth = 0
_pending = None


def _fire(reason):
    global _pending
    if _depth > 0:
        _pending = reason
        return
    raise JobTimeout(reason)


def _on_alarm(signum, frame):
    _fire("soft timeout")


def _on_term(signum, frame):
    _fire("terminated by the supervisor (hard timeout)")


def install():
    """Install the child's SIGALRM and SIGTERM handlers."""
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.signal(signal.SIGTERM, _on_term)


def arm(seconds):
    global _pending
    _pending = None
    if seconds and seconds > 0:
        signal.setitimer(signal.ITIMER_REAL, seconds)


def disarm():
    global _pending
    signal.setitimer(signal.ITIMER_REAL, 0)
    _pending = None


@contextlib.contextmanager
def critical():
    """Defer ``JobTimeout`` until the block is over. Nestable.

    Wrap commits and other all-or-nothing steps in it::

        with critical():
            conn.commit()
    """
    global _depth, _pending
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
    if _depth == 0 and _pending is not None:
        reason, _pending = _pending, None
        raise JobTimeout(reason)
