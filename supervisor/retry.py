"""Retry policy and the exceptions handler authors raise to steer it.

A handler that raises anything else is retried with exponential backoff and
jitter until the job's ``max_attempts``, then dead-lettered (reason
``exception``).
"""
import random

from .timeouts import JobTimeout  # noqa: F401 - where handlers have imported it from


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


MAX_EXPONENT = 62  # 2**62 is far past every cap; a larger exponent would only overflow the float


def backoff(exponent, base, cap, jitter=0.5, rng=random.random):
    """``base * 2**exponent`` seconds, capped at ``cap``, then reduced by up to ``jitter`` (0..1) at random.

    The one backoff of the daemon (retries, empty polls, reconnects, outcome
    writes). The exponent is clamped, so a counter that keeps growing through a
    months-long idle spell or outage can never overflow the float.
    """
    exponent = min(max(0, int(exponent)), MAX_EXPONENT)
    return min(float(cap), float(base) * 2.0 ** exponent) * (1.0 - float(jitter) * rng())


def next_delay(attempt, base=1.0, cap=300.0, jitter=0.5, rng=random.random):
    """Seconds to wait before retrying after failed attempt number ``attempt``.

    Exponential (``base * 2**(attempt-1)``, capped at ``cap``) and then reduced
    by up to ``jitter`` (a fraction, 0..1) at random, so that jobs which failed
    together (a database went away) do not all come back in the same instant.
    """
    return backoff(max(1, int(attempt)) - 1, base, cap, jitter, rng)
