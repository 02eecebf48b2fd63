"""What becomes of a job when its attempt ends: the crash matrix as one pure function.

Every row of the crash matrix (docs/design.md, "Failure semantics") that is
about one job is decided here and nowhere else; tests/test_verdict.py has one
case per row. ``judge`` reads how the attempt ended and the rules the job was
claimed under, and returns an ``Outcome`` for the outcome writer. It does no
I/O, keeps no state and reads no clock: the retry policy comes in as
``backoff(failures) -> seconds``.
"""
import typing

from ..model import ACK, CANCELLED, DEAD, DROP, MAX_DELAY, REASONS, RELEASE, RETRY, Outcome  # noqa: F401 - the ops
from ..protocol import (BAD_PAYLOAD, CRASHED, EXCEPTION, KILLED_BAD_FRAME, KILLED_LEASE_LOST, KILLED_SHUTDOWN,
                        KILLED_TIMEOUT, PERMANENT, RESULT_TOO_LARGE, RETRY_LATER, TIMEOUT, UNKNOWN_TYPE, finite)

# Failures that no retry can mend: dead-lettered on the first attempt.
DEAD_AT_ONCE = (PERMANENT, BAD_PAYLOAD, UNKNOWN_TYPE, RESULT_TOO_LARGE)


class Ending(typing.NamedTuple):
    """How an attempt ended, as the master saw it (a tuple, like ``Outcome``: one a job).

    ``reply``: the child's result message, when one came. ``exit_how``: how
    the child died without one ("signal SIGKILL", "exit code 1").
    ``kill_reason``: why the master was killing the child, if it was.
    ``term_sent``: the master had sent the hard-timeout SIGTERM.
    ``bad_frame``: what was wrong with a message the child sent (it was
    killed for it); ``too_large``: that message was over the size limit.
    ``cancel_sent``: the master had told the child its job was cancelled.
    """

    reply: dict | None = None
    exit_how: str = ""
    kill_reason: str | None = None
    term_sent: bool = False
    bad_frame: str = ""
    too_large: bool = False
    cancel_sent: bool = False


def judge(attempt, max_attempts, ending, backoff):
    """The outcome of attempt number ``attempt`` of a job allowed ``max_attempts``."""
    if ending.kill_reason == KILLED_LEASE_LOST:
        return Outcome(DROP)  # someone else holds the job now: whatever happened is not ours to store
    reply = ending.reply
    if ending.cancel_sent and not (reply is not None and reply.get("ok") and not reply.get("cancelled")):
        # Cancelled while it ran: however it stopped (Cancelled raised, a return after the
        # cancel reached it, killed past cancel_grace, a crash, a shutdown), it is not run
        # again. Only a result that crossed the cancel (done before it landed) stands.
        return Outcome(CANCELLED)
    if reply is not None:
        if reply.get("ok"):
            return Outcome(ACK, result=reply.get("result"))
        if ending.term_sent:
            # It answered our SIGTERM in its grace period: still a hard timeout.
            return failure(attempt, max_attempts, TIMEOUT, "HardTimeout",
                           "job exceeded its timeout; child stopped by SIGTERM", backoff, reply.get("traceback", ""))
        kind = reply.get("kind")
        if kind not in REASONS and kind != RETRY_LATER:
            kind = EXCEPTION  # the reason becomes a metric label: only known values
        return failure(attempt, max_attempts, kind, reply.get("error_class", ""),
                       reply.get("message", ""), backoff, reply.get("traceback", ""), reply.get("delay"))
    if ending.kill_reason == KILLED_BAD_FRAME:
        if ending.too_large:
            return failure(attempt, max_attempts, RESULT_TOO_LARGE, "ResultTooLarge", f"result: {ending.bad_frame}",
                           backoff)
        return failure(attempt, max_attempts, CRASHED, "BadMessage",
                       f"child sent a bad message: {ending.bad_frame}", backoff)
    if ending.kill_reason == KILLED_SHUTDOWN:
        return Outcome(RELEASE)  # stopped by us, not by the job: it runs again elsewhere, no attempt burnt
    if ending.kill_reason == KILLED_TIMEOUT:
        return failure(attempt, max_attempts, TIMEOUT, "HardTimeout",
                       f"job exceeded its timeout; child killed ({ending.exit_how})", backoff)
    return failure(attempt, max_attempts, CRASHED, "WorkerCrashed", f"child died mid-job ({ending.exit_how})", backoff)


def failure(attempt, max_attempts, kind, error_class, message, backoff, traceback="", delay=None):
    """A failed attempt: dead-letter it, or retry it after ``delay`` (default: the backoff)."""
    reason = EXCEPTION if kind == RETRY_LATER else kind
    fields = dict(reason=reason, error_class=error_class, message=message, traceback=traceback, kind=kind)
    if kind in DEAD_AT_ONCE or attempt >= max_attempts:
        return Outcome(DEAD, **fields)
    delay = _seconds(delay)
    if delay is None:
        # A child that died under a job's first attempt was most likely killed from
        # outside (OOM killer, an operator, a deploy): run the job again at once. A
        # job that keeps killing its child backs off like any other failure.
        failures = attempt - 1 if kind == CRASHED else attempt
        delay = backoff(failures) if failures > 0 else 0.0
    return Outcome(RETRY, delay=delay, **fields)


def _seconds(delay):
    """A handler's ``RetryLater`` delay when it is one (a finite number >= 0, at most ten
    years, like an enqueue's delay), else None: the backoff."""
    delay = finite(delay)
    return None if delay is None or delay < 0 else min(float(delay), MAX_DELAY)
