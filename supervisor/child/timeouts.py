"""Soft timeouts that never land inside a commit.

The child arms a timer when a job starts. When it fires, ``JobTimeout`` is
raised in the handler, unless a critical section is open (a database commit,
a broker call): then it is deferred and raised when the outermost section
closes. Raising it inside COMMIT could leave the database committed while the
job reports failure (Celery issue #10271). SIGTERM from the master (the grace
before a hard-timeout SIGKILL) takes the same path, and so does a cancel: the
master rings ``protocol.CANCEL_SIGNAL`` and ``Cancelled`` is raised at the next
safe point (``tangguh cancel``; docs/design.md, "One job's way").
"""
import _signal  # the signal module's wrappers turn every answer into an enum: ~2 us a job more
import contextlib
import os
import signal
import threading

from ..protocol import CANCEL_SIGNAL


class JobTimeout(Exception):
    """Raised inside a handler when its soft timeout passes.

    Never raised in the middle of a critical section (a commit, a broker call):
    see ``supervisor.critical``. Catch it to clean up; the attempt
    counts as failed with reason ``timeout``.
    """


class Cancelled(Exception):
    """Raised inside a handler when its job was cancelled while it ran (``tangguh cancel``).

    Like ``JobTimeout``, never in the middle of a ``critical()`` block: then on
    leaving it. Catch it to clean up; the job ends ``cancelled`` whether the
    handler raises, returns or is killed after ``cancel_grace``. A long loop can
    also ask ``ctx.cancelled()``.
    """


_depth = 0
_pending = None  # the exception a critical section deferred
_running = False  # a job is running (a cancel bell between jobs is stale: ignored)
_cancelled = False  # the running job was cancelled
_armed = False  # the soft-timeout timer is set
_terminated = False  # the master sent SIGTERM: this child ends after its reply
# The thread install() ran on (a child's main thread), else None: run_jobs in a test process never
# installs, and may run its jobs on a thread that cannot set handlers.
_installed_on = None
_deliver = None  # while an async handler runs: takes the exception to its coroutine (child/aio.py)


def _fire(exc):
    global _pending
    if _depth > 0:
        _pending = _pending or exc  # the first one wins; the master judges the attempt anyway
        return
    if _deliver is not None and _deliver(exc):
        return  # thrown into the async handler's coroutine at the await where it waits
    raise exc


def deliver_with(fn):
    """``fn(exc)`` is offered each JobTimeout or Cancelled not deferred by ``critical()``; True: it took it."""
    global _deliver
    _deliver = fn


def _on_alarm(signum, frame):
    # Only the running job's own soft timeout counts. Between jobs an alarm is stale (one a job kept
    # blocked rings as arm() unblocks it); so is one a handler set (signal.alarm) and left running
    # into a later job that has no soft timeout (a job that has one replaced it in arm()).
    if _running and _armed:
        _fire(JobTimeout("soft timeout"))


def _on_term(signum, frame):
    global _terminated
    _terminated = True
    _fire(JobTimeout("terminated by the supervisor (hard timeout)"))


def _on_cancel(signum, frame):
    global _cancelled
    if not _running or _cancelled:
        return  # it crossed the job's end, or it rang twice: raised once per job
    _cancelled = True
    _fire(Cancelled("the job was cancelled"))


_HANDLERS = ((signal.SIGALRM, _on_alarm), (signal.SIGTERM, _on_term), (CANCEL_SIGNAL, _on_cancel))
_SIGNALS = tuple(sig for sig, _ in _HANDLERS)
# Dispositions a job may change that the next job on this child would run under: SIGPIPE set to
# the default (a command-line idiom) kills the child at the next job's write to a closed socket;
# SIGCHLD ignored makes every subprocess's return code 0; a SIGHUP or SIGINT handler of a job's
# own takes the master's signals to the group. Taken as the child starts, put back before each job.
_KEPT = (signal.SIGPIPE, signal.SIGCHLD, signal.SIGHUP, signal.SIGINT)
_kept = ()
# stdin, stdout and stderr as the child started, each beside a copy of it: a job that closed one
# (a daemonising idiom) left the next jobs on this child failing every print() (EBADF), their log
# lines lost, and the next file they opened taking fd 1 or 2 and the child's log lines with it.
_std = ()


def install():
    """Install the child's SIGALRM, SIGTERM and cancel handlers; note the dispositions of ``_KEPT``
    and keep a copy of fds 0-2."""
    global _installed_on, _kept, _std
    for sig, handler in _HANDLERS:
        signal.signal(sig, handler)
    _kept = tuple((sig, _signal.getsignal(sig)) for sig in _KEPT)
    _std = tuple((fd, copy) for fd, copy in ((fd, _copy(fd)) for fd in (0, 1, 2)) if copy is not None)
    _installed_on = threading.get_ident()


def _copy(fd):
    try:
        return os.dup(fd)  # close-on-exec: a program a job starts does not inherit it
    except OSError:
        return None  # the master runs without it: nothing to put back


def _put_back_std():
    """Reopen fds 0-2 a job closed; one it opened again itself (a file of its own) stays."""
    for fd, copy in _std:
        try:
            os.fstat(fd)
        except OSError:
            try:
                os.dup2(copy, fd)
            except OSError:
                pass  # the job closed the copy too: the job runs as it left them


def _restore():
    """Undo what the last job did to our signals: a handler of its own, or a mask it never lifted,
    would leave every later job on this child without its soft timeout and its cancel."""
    for sig, handler in _HANDLERS:
        if _signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)
    for sig, handler in _kept:
        if _signal.getsignal(sig) != handler:
            signal.signal(sig, handler)
    _put_back_std()
    # What rang while blocked is handled here: stale alarms and bells are ignored (no job is
    # running), a SIGTERM raises JobTimeout into the job about to start.
    _signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)


def arm(seconds):
    """A job starts: its soft timeout, and the signals it needs as install() left them."""
    global _pending, _running, _cancelled, _armed
    if _installed_on == threading.get_ident():
        _restore()
    _pending, _running, _cancelled = None, True, False
    if seconds and seconds > 0:
        signal.setitimer(signal.ITIMER_REAL, seconds)
        _armed = True


def disarm():
    """The handler is over: no more timeouts or cancels for it (``cancel_requested`` stays readable)."""
    global _pending, _running, _armed
    _running = False
    if _armed:  # most jobs have no soft timeout: no syscall for them
        signal.setitimer(signal.ITIMER_REAL, 0)
        _armed = False
    _pending = None


def terminated():
    """True once the master sent SIGTERM (a hard timeout): the child starts no other job."""
    return _terminated


def cancel_requested():
    """True once the running (or just finished) job was cancelled."""
    return _cancelled


@contextlib.contextmanager
def critical():
    """Defer ``JobTimeout`` and ``Cancelled`` until the block is over. Nestable.

    Only the main thread's blocks defer: they are raised there, never in another thread.

    Wrap commits and other all-or-nothing steps in it::

        with critical():
            conn.commit()
    """
    global _depth, _pending
    if threading.get_ident() != threading.main_thread().ident:
        # Python runs signal handlers on the main thread only: no other thread's block can be torn,
        # and a thread a job left behind must not hold back (and catch) a later job's JobTimeout.
        yield
        return
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
    if _depth == 0 and _pending is not None:
        exc, _pending = _pending, None
        raise exc
