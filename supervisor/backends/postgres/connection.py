"""The PostgreSQL broker's connections: the URL, the sessions, the server's clock, errors.

URL: ``postgresql://user@host:5432/dbname?schema=tangguh`` (``postgres://``
works too). Tangguh's own options, stripped before connecting: ``schema``
(default ``tangguh``) names the PostgreSQL schema that holds the broker's
tables; ``socket_timeout`` (seconds, default 10) is how long a call waits with
no byte from the server. Every other query parameter must be a libpq
connection parameter (``sslmode``, ``connect_timeout``, ``application_name``...)
and is passed through; anything else is a ``BrokerError``. Unless the URL says
otherwise, connections use ``connect_timeout=10``, TCP keepalives (30 s idle,
10 s x 3) and ``fallback_application_name=tangguh``.

A frozen server (SIGSTOP, a paused VM, a storage stall) keeps its connections
open and its kernel acks what we send: keepalives and ``tcp_user_timeout`` never
fire, and neither libpq nor psycopg bounds the wait for a reply, so a call (and
the supervisor) waited as long as the freeze lasted. Now a call fails once the
server has sent nothing for ``socket_timeout`` seconds (``ServerSilent``, a
``BrokerError`` to the caller: "broker down"; its connection is closed), and
connecting is bounded by ``connect_timeout``. A migration waits as long as the
server takes (an index built on a big table), ``stats(within=)`` waits
``within`` more (the server cancels the counts first). A statement silent
longer for a good reason (a lock someone holds long) fails the same way.

High availability: a URL may list several hosts (``postgresql://h1,h2:5433/db``,
libpq's multi-host form); unless it says otherwise it gets
``target_session_attrs=read-write``, so each connection goes to the one host
taking writes. A failover breaks the sessions; the next call reconnects, and
libpq finds the promoted standby.

Deadlocks: PostgreSQL breaks one by aborting a side, which it rolls back whole. A
statement of ours it aborted runs again (``execute``), and so does a transaction of
several (``deadlocks.deadlock_retried``): every write the broker makes is fenced (id, token,
state) or checks the state it changes, so running it again stores what it would have.

Connections are autocommit. Every psycopg error surfaces as ``BrokerError``
(the daemon reads it as "broker down"), or ``BrokerUnusable`` when the
settings can never work; the next call reconnects. After a ``fork()`` the
child opens its own connections and never touches (nor closes) the parent's.

``now()`` returns the server's time from an offset measured when connecting
(re-measured every minute), so every supervisor measures leases against the
same clock.
"""
import contextlib
import logging
import os
import re
import select
import time
import urllib.parse

import psycopg
from psycopg import errors as pgerrors
from psycopg.conninfo import make_conninfo
from psycopg.pq import TransactionStatus
from psycopg.rows import tuple_row
from psycopg.types.json import set_json_loads

from ...errors import BrokerError, BrokerUnusable
from ...model import load_json
from ...urls import redact
from .deadlocks import DEADLOCK_RETRIES, log_retry

log = logging.getLogger("tangguh.broker")

DEFAULT_SCHEMA = "tangguh"
DEFAULT_SOCKET_TIMEOUT = 10.0  # like connect_timeout's default: a server silent that long is down
OWN_OPTIONS = ("schema", "socket_timeout")
_SCHEMA_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
_LIBPQ_PARAMS = frozenset(o.keyword.decode() for o in psycopg.pq.Conninfo.get_defaults())
_CLOCK_RESYNC = 60.0


def _local_clock():
    """What the server's clock is measured against: the monotonic clock, not the wall clock. A
    wall clock stepped forward after a read (it was behind: a VM restored from a snapshot) took
    now() that far past the server's until the next read, and the schedules enqueued ticks early."""
    return time.monotonic()


# libpq's and the server's words for a connection that can never work as configured.
# (A server starting up, full or shutting down is an outage, and so is a host
# that does not answer: those are waited out.)
_UNUSABLE = re.compile(r'invalid port number|invalid connection option|invalid (\w+ )?value'
                       r'|missing "=" after|database "[^"]*" does not exist|role "[^"]*" does not exist'
                       r'|password authentication failed|no pg_hba\.conf entry|no password supplied')


def quote(name):
    """``name`` as an SQL identifier."""
    return '"' + name.replace('"', '""') + '"'


def libpq_conninfo(url, own=(), **defaults):
    """``(conninfo, {key: value})`` for a ``postgresql://`` URL whose query keys in ``own`` are Tangguh's.

    Those keys are taken out (libpq would refuse them) and returned; ``defaults``
    apply where the query does not set a key. psycopg builds the conninfo from the
    URL, so every libpq form works: no host (``postgresql:///db``, the Unix socket),
    host lists, ``?host=/socket/dir``, percent-encoded user and password. Raises
    ``psycopg.ProgrammingError`` for what libpq cannot read.
    """
    base, _, query = url.partition("?")
    params = dict(defaults)
    mine = {}
    for key, value in urllib.parse.parse_qsl(query, keep_blank_values=True):
        (mine if key in own else params)[key] = value
    return make_conninfo(base, **params), mine


def read_url(url):
    """``(conninfo, schema, socket_timeout)`` of a broker URL, or BrokerUnusable naming what is wrong with it."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme.lower() not in ("postgresql", "postgres"):
        raise BrokerUnusable(f"postgres url {redact(url)}: expected postgresql://...")
    options = urllib.parse.parse_qsl(url.partition("?")[2], keep_blank_values=True)
    schema = dict(options).get("schema", DEFAULT_SCHEMA)
    names = {key for key, _ in options if key not in OWN_OPTIONS}
    unknown = names - _LIBPQ_PARAMS
    if unknown:
        raise BrokerUnusable(f"postgres url {redact(url)}: unknown option(s) {', '.join(sorted(set(unknown)))}"
                             " (tangguh knows schema= and socket_timeout=; the rest must be libpq connection"
                             " parameters)")
    if not _SCHEMA_NAME.match(schema):
        raise BrokerUnusable(f"postgres url {redact(url)}: schema {schema!r} must be a plain identifier"
                             " (letters, digits, underscore; at most 63 characters)")
    try:
        socket_timeout = float(dict(options).get("socket_timeout", DEFAULT_SOCKET_TIMEOUT))
    except ValueError:
        socket_timeout = 0.0
    if not 0 < socket_timeout < float("inf"):
        raise BrokerUnusable(f"postgres url {redact(url)}: socket_timeout must be a positive number of seconds")
    defaults = {"connect_timeout": "10", "fallback_application_name": "tangguh"}
    if _several_hosts(parts.netloc, options):
        # A host list is a primary and its standbys: only the primary takes writes. Without this libpq
        # would settle on the first host that answers, a standby, and every write would fail there.
        defaults["target_session_attrs"] = "read-write"
    if not names & {"keepalives", "keepalives_idle", "keepalives_interval", "keepalives_count"}:
        # Notice a silently dropped TCP connection (the idle LISTEN one above all) within ~a minute.
        defaults.update(keepalives_idle="30", keepalives_interval="10", keepalives_count="3")
    try:
        conninfo, _ = libpq_conninfo(url, OWN_OPTIONS, **defaults)
    except psycopg.Error:
        raise BrokerUnusable(f"postgres url {redact(url)}: not a connection URL libpq can read") from None
    return conninfo, schema, socket_timeout


class ServerSilent(psycopg.OperationalError):
    """The server sent nothing for ``socket_timeout`` seconds in the middle of a call."""


class BoundedConnection(psycopg.Connection):
    """A psycopg connection whose every call fails once the server has been silent ``socket_timeout``
    seconds (the module's docstring says why); its session is closed then, since a reply may still come."""

    socket_timeout = None  # seconds; None: wait as long as the server takes

    def wait(self, gen, *args, **kwargs):
        # Every round trip (execute, fetch, commit, a transaction's BEGIN, notifies) comes through here.
        if self.socket_timeout is None:
            return super().wait(gen, *args, **kwargs)
        try:
            return super().wait(_until_silent(gen, self.socket_timeout), *args, **kwargs)
        except ServerSilent:
            self.close()
            raise


def _until_silent(gen, seconds):
    """psycopg's wait generator ``gen``, failing with ServerSilent once its socket was quiet ``seconds``.

    psycopg's wait functions resume the generator with ``Ready.NONE`` every 0.1 s while the socket
    stays quiet (psycopg 3.2 on), so the silence is measured on those wake-ups; any readiness
    (a byte to read, room to write) starts it again, so a long answer that keeps coming is not cut.
    """
    quiet_since = time.monotonic()
    try:
        state = next(gen)
        while True:
            ready = yield state
            if ready:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= seconds:
                raise ServerSilent(f"no answer from the server in {seconds:g} s (socket_timeout): connection closed")
            state = gen.send(ready)
    except StopIteration as stop:
        return stop.value


def _several_hosts(netloc, options):
    hosts = netloc.rpartition("@")[2]
    return "," in hosts or any(key in ("host", "hostaddr") and "," in value for key, value in options)


class Connections:
    """One broker's sessions: the main one, and the LISTENing one once ``listen`` is called.

    Each is opened on first use and again after it broke (or when it belongs to
    the process this one was forked from).
    """

    def __init__(self, url, conninfo, schema, socket_timeout=DEFAULT_SOCKET_TIMEOUT):
        self.url, self.conninfo, self.schema = url, conninfo, schema
        self.socket_timeout = socket_timeout
        self.db = None
        self.listener = None
        self.waiter = None  # the connection the last wait LISTENed on, kept for the next
        self._pid = os.getpid()
        self._offset = time.time() - _local_clock()  # the local wall clock until the server's is read
        self._synced = float("-inf")

    def _connect(self):
        conn = BoundedConnection.connect(self.conninfo, autocommit=True)  # connect_timeout bounds this
        conn.socket_timeout = self.socket_timeout
        set_json_loads(load_json, conn)  # a value that does not decode must not fail the whole fetch
        return conn

    def main(self):
        """The main connection, reconnecting when the previous one broke (or belongs to our parent)."""
        if self._pid != os.getpid():
            self._forget_inherited()
        db = self.db
        if db is None or db.closed:
            self.db = db = self._connect()
            self._sync_clock(db)
        return db

    @contextlib.contextmanager
    def patient(self, seconds=None):
        """The main connection, its calls in the block waiting ``seconds`` of silence (None: as long
        as the server takes) instead of ``socket_timeout``."""
        db = self.main()
        db.socket_timeout = seconds
        try:
            yield db
        finally:
            db.socket_timeout = self.socket_timeout

    def _forget_inherited(self):
        # After a fork the sockets are the parent's sessions: never talk on them, never close
        # them (closing sends the server a Terminate that would end the parent's session).
        # psycopg skips that goodbye when a connection is garbage-collected in another process.
        self.db = self.listener = self.waiter = None
        self._pid = os.getpid()

    def _sync_clock(self, db):
        # Measured after the reply arrives, so the estimate errs low (by at most one round trip):
        # once now() has passed a point, the server's clock has passed it too.
        server = db.execute("SELECT date_part('epoch', clock_timestamp())").fetchone()[0]
        self._offset = server - _local_clock()
        self._synced = time.monotonic()

    @contextlib.contextmanager
    def guard(self, what):
        """Turn psycopg's errors into BrokerError (connection trouble, missing schema...)."""
        try:
            yield
        except (pgerrors.UndefinedTable, pgerrors.UndefinedFunction, pgerrors.InvalidSchemaName) as exc:
            raise BrokerError(f"postgres broker schema {self.schema!r} is missing or outdated"
                              f" (run `tangguh db migrate`): {exc}") from exc
        except psycopg.Error as exc:
            kind = BrokerUnusable if _UNUSABLE.search(str(exc)) else BrokerError
            raise kind(f"postgres broker ({redact(self.url)}): {what} failed: {exc}") from exc

    def execute(self, query, params=None, row_factory=tuple_row):
        with self.guard("query"):
            for retries_left in range(DEADLOCK_RETRIES, -1, -1):
                db = self.main()
                try:
                    return db.cursor(row_factory=row_factory).execute(query, params)
                except pgerrors.DeadlockDetected as exc:
                    # Autocommit: the statement was its whole transaction (in a caller's
                    # transaction block, that block runs again: deadlock_retried).
                    if not retries_left or db.info.transaction_status != TransactionStatus.IDLE:
                        raise
                    log_retry("query", exc)

    def now(self):
        if (time.monotonic() - self._synced > _CLOCK_RESYNC and self.db is not None and not self.db.closed
                and self._pid == os.getpid()):
            try:
                self._sync_clock(self.db)
            except psycopg.Error:
                pass  # keep the last offset; the next real call reports the outage
        return _local_clock() + self._offset

    def close(self):
        if self._pid != os.getpid():
            self._forget_inherited()
            return
        for name in ("waiter", "listener", "db"):
            conn = getattr(self, name)
            setattr(self, name, None)
            if conn is not None:
                try:
                    conn.close()
                except psycopg.Error:
                    pass

    def cancel(self):
        """From another thread: ask the server to cancel what the main connection runs now."""
        db = self.db
        if db is not None and not db.closed and self._pid == os.getpid():
            with contextlib.suppress(psycopg.Error):
                # Bounded: the blocking cancel() waited forever for a frozen server to hang up.
                db.cancel_safe(timeout=min(self.socket_timeout, 2.0))

    # -- wake-ups (LISTEN/NOTIFY) -------------------------------------------
    def take_waiter(self, channel):
        """A connection LISTENing on ``channel`` for ``wait``: the one the last wait kept, else a
        new one (a caller waiting on job after job opens one connection, not one per wait)."""
        if self._pid != os.getpid():
            self._forget_inherited()
        conn, self.waiter = self.waiter, None
        if conn is not None and not conn.closed:
            try:
                conn.execute(f"LISTEN {quote(channel)}")
                return conn
            except psycopg.Error:  # it broke while kept (a server restart, an idle timeout)
                with contextlib.suppress(psycopg.Error):
                    conn.close()
        conn = self._connect()
        try:
            conn.execute(f"LISTEN {quote(channel)}")
        except BaseException:
            conn.close()
            raise
        return conn

    def keep_waiter(self, conn):
        """Keep a wait's connection for the next one, listening to nothing; False: close it."""
        if self.waiter is not None or self._pid != os.getpid() or conn.closed:
            return False
        try:
            conn.execute("UNLISTEN *")
        except psycopg.Error:
            return False
        self.waiter = conn
        return True

    def listen(self, channel):
        """The socket of a connection LISTENing on ``channel``, opened unless it is open."""
        if self._pid != os.getpid():
            self._forget_inherited()
        if self.listener is None or self.listener.closed:
            with self.guard("listen"):
                listener = self._connect()
                try:
                    listener.execute(f"LISTEN {quote(channel)}")
                except BaseException:
                    listener.close()
                    raise
                self.listener = listener
        return self.listener.fileno()

    def drain(self):
        """Consume pending notifications without blocking; returns the queues they named."""
        listener = self.listener
        if listener is None or self._pid != os.getpid():
            return set()
        queues = set()
        try:
            # A server that closed the connection first sends its goodbye, then EOF: the socket
            # stays readable after a pass, and the next pass reports the broken connection.
            for _ in range(3):
                queues.update(n.payload for n in listener.notifies(timeout=0))
                if not select.select([listener.fileno()], [], [], 0)[0]:
                    break
            return queues
        except (psycopg.Error, OSError, ValueError) as exc:
            self.listener = None
            with contextlib.suppress(psycopg.Error):
                listener.close()
            raise BrokerError(f"postgres broker ({redact(self.url)}): listening connection lost: {exc}") from exc
