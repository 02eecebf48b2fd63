"""Retry policy and the exceptions handler authors raise to steer it.

A handler that raises anything else is retried with exponential backoff and
jitter until the job's ``max_attempts``, then dead-lettered (reason
``exception``).
"""
import random


class Permanent(Exception):
    """The job can never succeed (bad data, business rule): dead-letter it now."""


class BadPayload(Permanent):
    """The payload does not fit the handler: dead-lettered with reason ``bad_payload``."""


class Transient(Exception):
    """A temporary failure: retry with the usual backoff (the default anyway)."""


class RetryLater(Exception):
    """Retry after ``delay`` seconds instead of the computed backoff."""

    def __init__(self, delay, message=""):
        super().__init__(message or f"retry in {delay}s")
        self.delay = float(delay)


class JobTimeout(Exception):
    """Raised inside a handler when its soft timeout passes.

    Never raised in the middle of a critical section (a commit, a broker call):
    see ``supervisor.timeouts.critical``. Catch it to clean up; the attempt
    counts as failed with reason ``timeout``.
    """


def next_delay(attempt, base=1.0, cap=300.0, jitter=0.5, rng=random.random):
    """Seconds to wait before retrying after failed attempt number ``attempt``.

    Exponential (``base * 2**(attempt-1)``, capped at ``cap``) and then reduced
    by up to ``jitter`` (a fraction, 0..1) at random, so that jobs which failed
    together (a database went away) do not all come back in the same instant.
    """
    attempt = max(1, int(attempt))
    delay = min(float(cap), float(base) * (2.0 ** min(attempt - 1, 62)))
    return delay * (1.0 - float(jitter) * rng())
