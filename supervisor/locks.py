"""Locks for handlers: Redis locks with fencing tokens, PostgreSQL row and advisory locks.

Redis lock (``ctx.lock``)::

    with ctx.lock(f"invoice:{invoice_id}:export", ttl=30, wait=10) as lock:
        ...   # lock.fence: store it beside the write and compare (see below)

* Acquire is one script: ``SET key token NX PX ttl`` and, when it succeeds,
  ``INCR`` of the key's fence counter: every acquisition gets a **fencing
  token** strictly greater than all earlier ones for that key.
* Release and extend compare the owner token first (compare-and-delete,
  compare-and-pexpire): only the holder can release or extend.
* The child tells the master about each lock it holds (``{"op": "lock"}`` on
  its pipe). The master's heartbeat thread extends them with the job's lease,
  and when the child dies the master releases them at once, so the next
  attempt does not wait out the TTL. A lock acquired by a child killed before
  its message reached the master lives until its TTL.
* A lock can still expire under a holder that stalls (a long GC pause, a
  partitioned host). That is what the fence is for: the protected resource
  refuses a write whose fence is older than the last one it accepted::

      UPDATE ... SET data = %s, fence = %s WHERE id = %s AND fence < %s

  0 rows updated means a newer holder has written: raise ``LockLost``.
* Waiting polls with jittered backoff up to ``wait`` seconds, then raises
  ``LockBusy`` (a ``RetryLater``: the job is retried later). Counters:
  ``lock_acquired``, ``lock_failed``, ``lock_wait_seconds``.

PostgreSQL (inside ``ctx.transaction()``):

* ``row_lock(tx, table, key, nowait=, skip_locked=, timeout=)``:
  ``SELECT * ... FOR UPDATE`` of one row, returned as a dict (None when
  absent, or locked under ``skip_locked``). Held until commit or rollback.
* ``advisory_lock(tx, key, timeout=)``: ``pg_advisory_xact_lock`` on a 64-bit
  hash of ``key``, released by the commit or rollback.

On SQLite (the embedded mode) the transaction already holds the database's
write lock (``BEGIN IMMEDIATE``), so both only read.
"""
import hashlib
import logging
import random
import threading
import time
import uuid

from .retry import RetryLater

log = logging.getLogger("tangguh.locks")

ACQUIRE = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return redis.call('INCR', KEYS[2])
end
return false
"""
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
EXTEND = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""


class LockBusy(RetryLater):
    """The lock stayed taken for the whole wait: the job is retried after ``delay``."""


class LockLost(Exception):
    """The lock expired or was taken over; a fenced write was refused. Retried like any error."""


def count(metrics, name, value=1):
    metrics[name] = metrics.get(name, 0) + value


class Lock:
    """A held Redis lock: ``key``, ``token`` (owner), ``fence``, ``ttl``; ``extend()``, ``release()``."""

    def __init__(self, locks, key, token, fence, ttl):
        self.locks, self.key, self.token, self.fence, self.ttl = locks, key, token, fence, ttl
        self.held = True

    def extend(self, ttl=None):
        """Push the expiry to ``ttl`` (default: the lock's) from now; False if no longer ours."""
        ms = int((ttl or self.ttl) * 1000)
        ok = bool(self.locks.client.eval(EXTEND, 1, self.key, self.token, ms))
        self.held = ok
        return ok

    def release(self):
        """Delete the lock if still ours; False if it had expired or changed hands."""
        if not self.held:
            return False
        self.held = False
        ok = bool(self.locks.client.eval(RELEASE, 1, self.key, self.token))
        # Deleted first: a child killed right here leaves the master a
        # compare-and-delete that finds nothing, never a lock held to its TTL.
        self.locks.notify({"op": "unlock", "key": self.key, "token": self.token})
        if not ok:
            log.warning("lock %s expired before its release: another holder may have run", self.key)
        return ok

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()
        return False


class Locks:
    """Redis locks for one job. ``client``/``prefix`` from ``toolkit.redis()``.

    ``notify(msg)`` sends a message to the master (a no-op outside a child).
    """

    def __init__(self, client, prefix="", metrics=None, notify=None):
        self.client, self.prefix = client, prefix
        self.metrics = metrics if metrics is not None else {}
        self.notify = notify or (lambda msg: None)

    def key(self, name):
        return f"{self.prefix}lock:{name}"

    def acquire(self, name, ttl=30.0, wait=10.0, retry_delay=1.0):
        """Take lock ``name`` for ``ttl`` seconds, waiting up to ``wait``; a ``Lock`` or ``LockBusy``."""
        key, token = self.key(name), uuid.uuid4().hex
        ms = max(1, int(ttl * 1000))
        started = time.monotonic()
        pause = 0.005
        while True:
            fence = self.client.eval(ACQUIRE, 2, key, key + ":fence", token, ms)
            if fence is not None:
                count(self.metrics, "lock_acquired")
                count(self.metrics, "lock_wait_seconds", time.monotonic() - started)
                self.notify({"op": "lock", "key": key, "token": token, "ttl": ttl})
                return Lock(self, key, token, int(fence), ttl)
            left = started + wait - time.monotonic()
            if left <= 0:
                count(self.metrics, "lock_failed")
                count(self.metrics, "lock_wait_seconds", time.monotonic() - started)
                raise LockBusy(retry_delay, f"lock {name!r} is held by another job")
            # Jittered backoff: waiters that started together do not knock together.
            time.sleep(min(left, pause * random.uniform(0.5, 1.5)))
            pause = min(0.2, pause * 2)

    __call__ = acquire


# -- PostgreSQL --------------------------------------------------------------------------

def row_lock(tx, table, key, column="id", nowait=False, skip_locked=False, timeout=None, retry_delay=1.0):
    """``SELECT * FROM table WHERE column = key FOR UPDATE``: the locked row as a dict, or None.

    ``nowait``: fail at once if another transaction holds the row;
    ``skip_locked``: return None instead; ``timeout`` (seconds): wait at most
    that long (``lock_timeout``). A lock not obtained raises ``LockBusy`` (the
    transaction must then roll back: let it propagate).
    """
    if nowait and skip_locked:
        raise ValueError("row_lock: nowait and skip_locked exclude each other")
    if tx.kind == "sqlite":
        return tx.fetchone(f'SELECT * FROM "{_ident(table)}" WHERE "{_ident(column)}" = %s', (key,))
    import psycopg

    mode = " NOWAIT" if nowait else " SKIP LOCKED" if skip_locked else ""
    try:
        with tx.lock_timeout(timeout):
            return tx.fetchone(f'SELECT * FROM "{_ident(table)}" WHERE "{_ident(column)}" = %s FOR UPDATE{mode}',
                               (key,))
    except psycopg.errors.LockNotAvailable:
        raise LockBusy(retry_delay, f"row {table}.{column}={key!r} is locked by another transaction") from None


def advisory_lock(tx, key, timeout=None, retry_delay=1.0):
    """A transaction-scoped advisory lock on ``key`` (any string); ``LockBusy`` past ``timeout``.

    ``timeout=0`` tries once (``pg_try_advisory_xact_lock``); None waits
    for as long as it takes.
    """
    if tx.kind == "sqlite":
        return
    import psycopg

    number = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big", signed=True)
    if timeout == 0:
        if not tx.scalar("SELECT pg_try_advisory_xact_lock(%s)", (number,)):
            raise LockBusy(retry_delay, f"advisory lock {key!r} is held by another transaction")
        return
    try:
        with tx.lock_timeout(timeout):
            tx.execute("SELECT pg_advisory_xact_lock(%s)", (number,))
    except psycopg.errors.LockNotAvailable:
        raise LockBusy(retry_delay, f"advisory lock {key!r} is held by another transaction") from None


def _ident(name):
    if not name.replace("_", "").replace(".", "").isalnum():
        raise ValueError(f"not a plain SQL identifier: {name!r}")
    return name


# -- the master's side -------------------------------------------------------------------

class MasterLocks:
    """The master's record of the Redis locks its children hold.

    The main loop adds and removes entries as ``lock``/``unlock`` messages
    arrive and calls ``release_child`` when a child dies; the heartbeat thread
    calls ``extend_all`` once per beat. Each call opens a short-lived Redis
    connection and closes it before returning, so no socket of the master's
    is open across a fork (and only beats with locks held pay for one).
    """

    def __init__(self, redis_url):
        self.redis_url = redis_url
        self.held = {}  # pid -> {key: (token, ttl)}
        self.mutex = threading.Lock()
        self.released = 0  # locks released for dead children
        self.extended = 0

    def _client(self):
        from .toolkit import open_redis

        from redis.backoff import NoBackoff
        from redis.retry import Retry

        # One try, short timeouts: the main loop must not stall on a Redis outage (the TTL covers it).
        return open_redis(self.redis_url, socket_connect_timeout=1, socket_timeout=2, retry=Retry(NoBackoff(), 0))[0]

    def on_message(self, pid, msg):
        """A child's ``lock`` or ``unlock`` message (a malformed one is logged and ignored)."""
        try:
            key, token = str(msg["key"]), str(msg["token"])
            ttl = float(msg.get("ttl") or 0)
        except (KeyError, TypeError, ValueError):
            log.warning("ignoring a malformed %s message from child %d", msg.get("op"), pid)
            return
        with self.mutex:
            if msg["op"] == "lock":
                self.held.setdefault(pid, {})[key] = (token, ttl)
            else:
                mine = self.held.get(pid, {})
                if mine.get(key, (None,))[0] == token:
                    del mine[key]
                if not mine:
                    self.held.pop(pid, None)

    def release_child(self, pid):
        """Compare-and-delete every lock child ``pid`` held (it is dead). Main loop."""
        with self.mutex:
            mine = self.held.pop(pid, None)
        if not mine:
            return 0
        client = None
        try:
            client = self._client()
            pipe = client.pipeline(transaction=False)
            for key, (token, _) in mine.items():
                pipe.eval(RELEASE, 1, key, token)
            released = sum(1 for r in pipe.execute() if r)
        except Exception as exc:  # noqa: BLE001 - Redis away: the TTL frees them instead
            log.warning("could not release %d lock(s) of dead child %d (they expire by TTL): %s",
                        len(mine), pid, exc)
            return 0
        finally:
            if client is not None:
                client.close()
        self.released += released
        log.info("released %d lock(s) of dead child %d", released, pid, extra={"event": "locks_released"})
        return released

    def extend_all(self):
        """Extend every registered lock by its TTL in one pipelined round trip. Heartbeat thread."""
        with self.mutex:
            entries = [(key, token, ttl) for mine in self.held.values() for key, (token, ttl) in mine.items()]
        if not entries:
            return
        client = None
        try:
            client = self._client()
            pipe = client.pipeline(transaction=False)
            for key, token, ttl in entries:
                pipe.eval(EXTEND, 1, key, token, int(ttl * 1000))
            self.extended += sum(1 for r in pipe.execute() if r)
        except Exception as exc:  # noqa: BLE001 - a Redis error must not kill the heartbeat
            log.warning("lock extension failed: %s: %s", type(exc).__name__, exc)
        finally:
            if client is not None:
                client.close()
