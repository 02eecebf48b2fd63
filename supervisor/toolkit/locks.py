"""Locks for handlers: Redis locks with fencing tokens, PostgreSQL row and advisory locks.

Redis lock (``ctx.lock``)::

    with ctx.lock(f"invoice:{invoice_id}:export", ttl=30, wait=10) as lock:
        ...   # lock.fence: store it beside the write and compare (see below)

* Acquire is one script: ``SET key token NX PX ttl`` and, when it succeeds,
  ``INCR`` of the key's fence counter, first raised to the server's clock in
  ms x 1024 if it lies below: every acquisition gets a **fencing token** (a
  64-bit integer) strictly greater than all earlier ones for that key, even
  after Redis lost or rewound the counter (a restart, a failover, an
  eviction). The counter's key is the lock's plus ``:fence``, so a lock name
  ending in ``:fence`` is refused; it expires ``FENCE_MARGIN`` (an hour) past
  the lock's TTL from its last acquire, so unused names leave nothing behind.
* Release and extend compare the owner token first (compare-and-delete,
  compare-and-pexpire): only the holder can release or extend.
* The child tells the master about each lock it holds (``{"op": "lock"}`` on
  its pipe). The master's heartbeat thread extends them with the job's lease
  (in a worker a lock's TTL is the lease, ``broker.lease_seconds``),
  and when the child dies the master releases them at once, so the next
  attempt does not wait out the TTL. A lock acquired by a child killed before
  its message reached the master lives until its TTL.
* An acquire whose answer is lost (a stall past the client's socket timeout,
  a cut connection: the server may have taken the lock) is asked once more
  with the same owner token, which the script takes as already acquired (it
  returns the fence that run got). The master is told of the token before
  that second try, so a lock the server took is freed with the job even when
  the second try fails too (the error is raised to the handler). A timeout
  once the acquire's ``wait`` is spent is not asked again: it is raised.
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
import time
import uuid

from .. import protocol
from ..child import timeouts
from ..jsonvalues import clip_start
from ..retry import RetryLater

log = logging.getLogger("tangguh.locks")

FENCE = ":fence"  # lock ``name``'s fence counter is its key plus this
MAX_TTL = 10 * 365 * 86400.0  # seconds: the longest lock TTL (a lock is for minutes, not decades)
# Seconds a fence counter outlives its lock's TTL: unused names' counters go, and only a clock
# stepped back by more than this could then hand out a fence below an earlier one.
FENCE_MARGIN = 3600
SHOWN = 200  # characters of a key in a log line

# The counter never lies below the server's clock in ms x 1024 (the broker's job tokens started
# so; model.first_token counts 2**-20 s now, a separate sequence): a counter lost (a restart without persistence, an eviction, its TTL) or
# rewound (a failover to a replica that missed the last INCRs) goes on above every fence handed
# out before, as long as one name got fewer than 1,024 fences per ms, which its lock rules out.
# Below 2**53 until the year 2248: exact in Lua's doubles. Formatted by hand: tostring keeps
# 14 digits.
#
# A key that already holds this acquire's token is this acquire's own earlier run, whose answer
# was lost (a stall past the socket timeout, a cut connection): taken, with the fence that run
# got (no acquire could INCR since: the key stood), the TTL pushed back as a fresh SET would.
ACQUIRE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  local fence = tonumber(redis.call('GET', KEYS[2]))
  if fence then
    redis.call('PEXPIRE', KEYS[2], ARGV[3])
    return fence
  end
elseif not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return false end
local now = redis.call('TIME')
local floor = (tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)) * 1024
if (tonumber(redis.call('GET', KEYS[2])) or 0) < floor then
  redis.call('SET', KEYS[2], string.format('%.0f', floor))
end
local fence = redis.call('INCR', KEYS[2])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return fence
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
        if ttl is not None:
            check_ttl(ttl)  # refused in a worker too, where the TTL is the job's lease whatever is asked
        ms = _ms(self.ttl if ttl is None else self.locks.floor or ttl)
        ok = bool(self.locks.client.eval(EXTEND, 1, self.key, self.token, ms))
        self.held = ok
        return ok

    def release(self):
        """Delete the lock if still ours; False if it had expired or changed hands."""
        if not self.held:
            return False
        self.held = False
        # One critical block, as at acquire: a soft timeout or a cancel raised in the middle of
        # the frame's write tore it (the master read garbage), or between the two lost the UNLOCK.
        with timeouts.critical():
            ok = bool(self.locks.client.eval(RELEASE, 1, self.key, self.token))
            # Deleted first: a child killed right here leaves the master a
            # compare-and-delete that finds nothing, never a lock held to its TTL.
            self.locks.notify({"op": protocol.UNLOCK, "key": self.key, "token": self.token})
        if not ok:
            log.warning("lock %s expired before its release: another holder may have run", shown(self.key))
        return ok

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            self.release()
        except Exception as error:  # noqa: BLE001 - narrowed below: redis is imported by the client already
            import redis as redis_py

            if not isinstance(error, (redis_py.ConnectionError, redis_py.TimeoutError, redis_py.ReadOnlyError)):
                raise
            # Not the job's failure: the body's own exception (a Permanent, say) must stand, and
            # a body that succeeded has done its work. The lock expires at its TTL, and the master,
            # told of it at acquire, frees it when the job ends (on a connection of its own: after
            # a failover, the new primary's; ReadOnlyError is the demoted one answering).
            log.warning("cannot release lock %s (the master frees it when the job ends, or it expires): %s",
                        shown(self.key), error)
        return False


def check_ttl(ttl, name="ttl"):
    """A lock's TTL in seconds: a finite number above 0 and at most ``MAX_TTL``, else ValueError
    (a TTL of 0 or below made a lock that protected nothing; NaN or inf failed deep in a call)."""
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 < ttl <= MAX_TTL:
        raise ValueError(f"lock {name} must be a number of seconds above 0 and at most {MAX_TTL:.0f}, got {ttl!r}")
    return float(ttl)


def unanswered(error):
    """A redis-py error after which the server may have run the call: its answer never came.
    Not a refusal at connect (a wrong password, no right to the command, too many clients, a
    server loading its data), which redis-py raises as a ``ConnectionError`` too: the server ran
    nothing, and asking again would only fail again."""
    import redis as redis_py  # imported by the client already

    refused = redis_py.exceptions
    if isinstance(error, (refused.AuthenticationError, refused.AuthorizationError, refused.MaxClientsReachedError,
                          refused.BusyLoadingError)):
        return False
    return isinstance(error, (redis_py.ConnectionError, redis_py.TimeoutError))


def shown(key):
    """``key`` for a log line: its first ``SHOWN`` characters and how many were cut (a 2 MB
    key made a 2 MB line, at every lock or cache call while Redis was away)."""
    return clip_start(key, SHOWN)


def check_name(what, name):
    """``name`` as plain text, the text Redis is sent: a non-empty ``str`` Redis can encode, else
    ValueError. Python names keys by f-string and the scripts by what Redis was sent; a bytes name
    (``"b'x'"`` against ``"x"``) or a str enum (``"Kind.A"`` against its value) differed, and the
    entry filled under one was never reached by invalidating the other."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"{what} must be a non-empty string, got {shown(repr(name))}")
    try:
        name.encode()
    except UnicodeEncodeError:
        raise ValueError(f"{what} holds a lone surrogate, which Redis cannot be sent: {shown(ascii(name))}") from None
    return str.__str__(name)


def _ms(seconds):
    return max(1, int(seconds * 1000))


class Locks:
    """Redis locks for one job. ``client``/``prefix`` from ``toolkit.redis()``.

    ``notify(msg)`` sends a message to the master (a no-op outside a child). ``floor``: in a worker,
    the job's lease, the TTL every lock gets there whatever it asks: the master extends each lock once
    a heartbeat, so a shorter one lapsed between two beats under a job still running, and a longer one
    outlived a master killed with its children, every retry of the job LockBusy until the TTL ran out.
    """

    def __init__(self, client, prefix="", metrics=None, notify=None, floor=0.0):
        self.client, self.prefix = client, prefix
        self.metrics = metrics if metrics is not None else {}
        self.notify = notify or (lambda msg: None)
        self.floor = min(floor, MAX_TTL)  # past it the master would not track (nor release) the lock

    def key(self, name):
        return f"{self.prefix}lock:{name}"

    def acquire(self, name, ttl=30.0, wait=10.0, retry_delay=1.0):
        """Take lock ``name`` for ``ttl`` seconds, waiting up to ``wait``; a ``Lock`` or ``LockBusy``.

        A name ending in ``:fence`` is refused (``ValueError``): its key is the fence counter of another lock.
        """
        name = check_name("lock name", name)
        if name.endswith(FENCE):
            # The counters stay where they are: moving them would restart the fences of locks in use.
            raise ValueError(f"lock name {name!r} ends in {FENCE!r}, the fence counter of lock"
                             f" {name[:-len(FENCE)]!r}: choose another name")
        ttl = check_ttl(ttl)  # refused in a worker too, where the TTL is the job's lease whatever is asked
        ttl = self.floor or ttl
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait < float("inf"):
            raise ValueError(f"lock wait must be a finite number of seconds, 0 or more, got {wait!r}")
        key, token = self.key(name), uuid.uuid4().hex
        ms = _ms(ttl)
        started = time.monotonic()
        pause = 0.005
        told = []  # the master has heard of this token already (an answer was lost)
        while True:
            # The master hears of every lock taken: a soft timeout or a cancel raised between the
            # script and the message left a lock nobody would release, held to its TTL (the job's
            # retry waited it out). Raised after the block, the master frees the lock with the job.
            with timeouts.critical():
                fence = self._take(key, token, ms, ttl, told, started + wait)
                if fence is not None and not told:
                    self.notify({"op": protocol.LOCK, "key": key, "token": token, "ttl": ttl})
            if fence is not None:
                count(self.metrics, "lock_acquired")
                count(self.metrics, "lock_wait_seconds", time.monotonic() - started)
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

    def _take(self, key, token, ms, ttl, told, deadline=None):
        """One run of the acquire script: its fence, or None (taken by another). An answer lost
        (``ConnectionError``, ``TimeoutError``: the server may have run it) is asked once more with
        the same token, which the script takes as ours. The master hears of the token first: if
        the second try fails too, the lock the server may hold goes with the job, not at its TTL
        (the master's release and extension compare the token: a lock not ours is left alone).
        A timeout past ``deadline`` (the acquire's wait spent) is not asked again: a stalled Redis
        cost a second socket timeout inside ``critical()``, holding back the soft timeout."""
        args = (ACQUIRE, 2, key, key + FENCE, token, ms, ms + FENCE_MARGIN * 1000)
        try:
            return self.client.eval(*args)
        except Exception as error:  # noqa: BLE001 - narrowed below
            if not unanswered(error):
                raise
            import redis as redis_py  # imported by the client already

            spent = deadline is not None and time.monotonic() >= deadline
            if spent and isinstance(error, redis_py.TimeoutError):
                log.warning("lock %s: no answer to its acquire, its wait spent (%s)", shown(key), error)
                self.notify({"op": protocol.LOCK, "key": key, "token": token, "ttl": ttl})
                told.append(token)
                raise
            log.warning("lock %s: no answer to its acquire, asked again (%s)", shown(key), error)
        self.notify({"op": protocol.LOCK, "key": key, "token": token, "ttl": ttl})
        told.append(token)
        return self.client.eval(*args)


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
        return tx.fetchone(f"SELECT * FROM {_ident(table)} WHERE {_ident(column)} = %s", (key,))
    import psycopg

    mode = " NOWAIT" if nowait else " SKIP LOCKED" if skip_locked else ""
    try:
        with tx.lock_timeout(timeout):
            return tx.fetchone(f"SELECT * FROM {_ident(table)} WHERE {_ident(column)} = %s FOR UPDATE{mode}",
                               (key,))
    except psycopg.errors.LockNotAvailable:
        raise LockBusy(retry_delay, f"row {table}.{column}={key!r} is locked by another transaction") from None


def advisory_lock(tx, key, timeout=None, retry_delay=1.0):
    """A transaction-scoped advisory lock on ``key`` (any string); ``LockBusy`` past ``timeout``.

    ``timeout=0`` tries once (``pg_try_advisory_xact_lock``); None waits
    for as long as it takes.
    """
    key = check_name("advisory lock key", key)  # on SQLite too: a handler tried there must not break on PostgreSQL
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
    """``name`` quoted for SQL, each part of a dotted ``schema.table`` on its own."""
    parts = name.split(".")
    if not all(part.replace("_", "").isalnum() for part in parts):
        raise ValueError(f"not a plain SQL identifier: {name!r}")
    return ".".join(f'"{part}"' for part in parts)
