"""Retry policy and the exceptions handler authors raise to steer it.

A handler that raises anything else is retried with exponential backoff and
jitter until the job's ``max_attempts``, then dead-lettered (reason
``exception``).
"""
import datetime
import random

from .child.timeouts import JobTimeout  # noqa: F401 - where handlers have imported it from
from .model import MAX_DELAY


class Permanent(Exception):
    """The job can never succeed (bad data, business rule): dead-letter it now."""


class BadPayload(Permanent):
    """The payload does not fit the handler: dead-lettered with reason ``bad_payload``."""


class Transient(Exception):
    """A temporary failure: retry with the usual backoff (the default anyway)."""


class RetryLater(Exception):
    """Retry after ``delay`` seconds (a number, or a ``timedelta``) instead of the computed backoff;
    without one (or one that is no number of seconds), the usual backoff."""

    def __init__(self, delay=None, message=""):
        if isinstance(delay, datetime.timedelta):
            delay = delay.total_seconds()
        try:
            delay = float(delay)
        except OverflowError:
            # An int no float holds (RetryLater(2 ** 1100) failed as an OverflowError of the
            # constructor): the longest delay, as for 1e300.
            delay = MAX_DELAY
        except (TypeError, ValueError):
            # Raised here it replaced the RetryLater (RetryLater(timedelta(minutes=5)) failed as a
            # TypeError of the constructor); the child gives a delay that is no number the backoff.
            delay = None
        super().__init__(message or (f"retry in {delay:g}s" if delay is not None else "retry later"))
        self.delay = delay


# 2.0 ** 1024 overflows a float: every exponent stops here, long after any cap is reached.
MAX_EXPONENT = 62


def backoff(tries, base, cap, jitter=0.0, rng=random.random):
    """Seconds to wait after ``tries`` failures (or empty polls) in a row.

    ``base * 2**(tries-1)``, capped at ``cap``, then reduced by up to ``jitter``
    (a fraction, 0..1) at random. The one exponential backoff of the package:
    the exponent is clamped, so a streak that runs for months (an idle queue, a
    long outage) gives ``cap``, never an OverflowError.
    """
    tries = max(1, int(tries))
    delay = min(float(cap), float(base) * (2.0 ** min(tries - 1, MAX_EXPONENT)))
    return delay * (1.0 - float(jitter) * rng())


def next_delay(attempt, base=1.0, cap=300.0, jitter=0.5, rng=random.random):
    """Seconds to wait before retrying after failed attempt number ``attempt``.

    Exponential (``base * 2**(attempt-1)``, capped at ``cap``) and then reduced
    by up to ``jitter`` (a fraction, 0..1) at random, so that jobs which failed
    together (a database went away) do not all come back in the same instant.
    """
    return backoff(attempt, base, cap, jitter, rng)
