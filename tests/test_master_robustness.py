"""The master survives idle time and hostile input: idle polling, the health
socket, oversize results, unbounded label sets, a socket path that is a file.

Process tests run the real ``tangguh run`` (tests/daemon.py) and end with the
daemon still serving: a job runs after the hostile part.
"""
import os
import signal
import socket
import stat

import pytest

from supervisor.retry import backoff, next_delay

from .daemon import Daemon, tangguh
from .util import wait_for


@pytest.fixture
def daemon(tmp_path):
    d = Daemon(tmp_path)
    yield d
    d.stop()


def serves_a_job(d):
    job_id = d.enqueue("noop", {})
    assert d.wait_job(job_id).state == "done"


# -- backoff ---------------------------------------------------------------------------

@pytest.mark.parametrize("tries", [1_000, 1_025, 10_000, 10**6, 10**18])
def test_backoff_after_a_very_long_streak_is_the_cap(tries):
    assert backoff(tries, 0.005, 0.5) == 0.5
    assert backoff(tries, 0.2, 10.0, jitter=0.5, rng=lambda: 1.0) == 5.0
    assert next_delay(tries, 1.0, 300.0, 0.0) == 300.0


def test_backoff_doubles_from_base():
    assert [backoff(n, 0.1, 100.0) for n in (0, 1, 2, 3, 4)] == [0.1, 0.1, 0.2, 0.4, 0.8]


def test_idle_supervisor_survives_thousands_of_empty_polls_then_serves(tmp_path):
    # The old backoff overflowed a float after ~1,024 empty claims in a row.
    d = Daemon(tmp_path, supervisor={"poll_interval": 0.001})
    try:
        d.start()
        wait_for(lambda: d.status()["empty_polls"] >= 3000, timeout=120, message="3,000 empty polls")
        assert d.proc.poll() is None
        serves_a_job(d)
        d.signal(signal.SIGTERM)
        assert d.wait_exit() == 0
        d.assert_clean()
    finally:
        d.stop()
