"""The backoff: exponential, capped, and spread by jitter (unit tests of ``next_delay``)."""
import random

import pytest

from supervisor.retry import next_delay


def full(attempt, base, cap):
    return min(cap, base * 2 ** (attempt - 1))


def test_without_jitter_the_delay_doubles_up_to_the_cap():
    assert [next_delay(a, 0.1, 1.0, 0.0) for a in range(1, 7)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    assert next_delay(0, 2.0, 60.0, 0.0) == next_delay(-5, 2.0, 60.0, 0.0) == 2.0  # counted from attempt 1


@pytest.mark.parametrize("attempt", [1, 2, 3, 5, 8, 12, 20])
def test_jitter_stays_within_its_bounds(attempt):
    rng = random.Random(attempt)
    top = full(attempt, 0.5, 120.0)
    for _ in range(500):
        d = next_delay(attempt, 0.5, 120.0, 0.3, rng.random)
        assert top * 0.7 <= d <= top
    # The two ends of the random draw: no reduction, and (almost) the whole jitter fraction.
    assert next_delay(attempt, 0.5, 120.0, 0.3, lambda: 0.0) == top
    assert next_delay(attempt, 0.5, 120.0, 0.3, lambda: 0.999999) == pytest.approx(top * 0.7, rel=1e-5)


@pytest.mark.parametrize("attempt", [64, 10_000, 10**6, 10**18])
def test_the_cap_holds_for_huge_attempt_numbers(attempt):
    for jitter in (0.0, 0.5, 1.0):
        d = next_delay(attempt, 1.0, 300.0, jitter, lambda: 0.5)
        assert d == pytest.approx(300.0 * (1 - jitter * 0.5))
    assert next_delay(attempt, 1.0, 300.0, 0.0) == 300.0


def test_jittered_delays_at_the_cap_are_spread_not_constant():
    """Jobs that failed together must not all come back in the same instant."""
    cap, jitter = 300.0, 0.5
    samples = [next_delay(10_000, 1.0, cap, jitter) for _ in range(1000)]
    assert all(cap * (1 - jitter) <= d <= cap for d in samples)
    assert len({round(d, 3) for d in samples}) >= 100
    middle = cap * (1 - jitter / 2)
    assert min(samples) < middle < max(samples)  # both halves of the range are used
