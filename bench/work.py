"""The one job body every framework runs, and the evidence it leaves.

Each execution records itself in a Redis database of its own (``BENCH_EVIDENCE_URL``,
default db 12), the same way for every framework, so all of them are measured
by the same evidence rather than by their own bookkeeping:

* ``<key>:n``  INCR per finished execution;
* ``<key>:t``  RPUSH ``"start end t0 pid"`` per finished execution (``time.time()``);
* ``<key>:s``  RPUSH ``"start pid"`` when a ``crash``/``endless`` job starts;
* ``<key>:alive``  the last instant an ``endless`` job was still running.
"""
import os
import time

import redis

EVIDENCE_URL = os.environ.get("BENCH_EVIDENCE_URL", "redis://127.0.0.1:6379/12")

_client = None
_pid = None


def evidence():
    """This process's evidence connection (a fresh one after a fork)."""
    global _client, _pid
    if _client is None or _pid != os.getpid():
        _client = redis.Redis.from_url(EVIDENCE_URL)
        _pid = os.getpid()
    return _client


def spin(n):
    """Pure-Python CPU work: n iterations."""
    x = 0
    for i in range(n):
        x += i * i
    return x


def run(kind, key, t0=0.0, n=0):
    if kind == "empty":  # no body and no evidence: what the framework alone can do (bench/profile_master.py)
        return
    start = time.time()
    r = evidence()
    if kind == "cpu":
        spin(n)
    elif kind in ("crash", "endless"):
        runs = r.incr(f"{key}:runs")
        r.rpush(f"{key}:s", f"{start} {os.getpid()}")
        if runs == 1:  # only the first attempt misbehaves; a re-run finishes at once
            stop = start + 120.0
            while time.time() < stop:
                if kind == "endless":
                    r.set(f"{key}:alive", repr(time.time()))
                time.sleep(0.01)
    end = time.time()
    p = r.pipeline(transaction=False)
    p.incr(f"{key}:n")
    p.rpush(f"{key}:t", f"{start} {end} {t0} {os.getpid()}")
    p.execute()
