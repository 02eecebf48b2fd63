"""The handler toolkit's settings and connections, one set per child process.

The ``[toolkit]`` config section names the handlers' own database and Redis
(not the broker's)::

    [toolkit]
    database_url = "postgresql://app@db/app?schema=billing"   # or sqlite:///app.db
    redis_url = "redis://127.0.0.1:6379/0?prefix=billing:"
    # or, behind Sentinel: "redis+sentinel://h1:26379,h2:26379/mymaster/0?prefix=billing:"
    idempotency_retention = 604800.0

``?schema=`` (PostgreSQL) sets the ``search_path`` of every connection;
``?prefix=`` (Redis) is put in front of every key the toolkit writes. Both are
stripped before connecting.

Connections open lazily, on a handler's first use, in the process that uses
them: the master never opens one that a child could inherit (it forks). A
connection found to belong to another process (after a fork) is forgotten,
never closed (closing would end the parent's session), and a broken one is
replaced on the next use: one the server closed while it sat idle (a restart,
a failover, ``idle_session_timeout``) at the first statement of the next
transaction, which then runs on the new one (``transaction.Transaction``).

The child gets the settings through ``configure`` right after the fork; the
CLI (``tangguh db migrate``) and scripts call ``configure`` themselves. The
master imports the database's driver before it forks (``preload``), and only
that one, with the codec every connection by host name loads: it opens nothing,
so the children share their code.
"""
import importlib
import logging
import os
import re
import urllib.parse

from ..errors import ConfigError, TangguhError

DEFAULT_RETENTION = 7 * 86400.0
DRIVERS = {"sqlite": "sqlite3", "postgres": "psycopg"}  # database_kind -> the module preload imports

log = logging.getLogger("tangguh.toolkit")

_settings = None
_database = None
_redis = None
_notify = None


class Settings:
    def __init__(self, database_url="", redis_url="", idempotency_retention=DEFAULT_RETENTION, lock_floor=0.0):
        self.database_url = database_url
        self.redis_url = redis_url
        self.idempotency_retention = idempotency_retention
        self.lock_floor = lock_floor  # the shortest lock TTL (a worker's: its job's lease; locks.Locks)


def configure(cfg, lock_floor=0.0):
    """Use ``cfg`` (a ``config.ToolkitConfig`` or ``Settings``) from now on in this process."""
    global _settings, _database, _redis
    _settings = Settings(cfg.database_url, cfg.redis_url, cfg.idempotency_retention, lock_floor)
    _database = None
    _redis = None


def attach_master(send):
    """In a child: ``send(msg)`` delivers a message to the master (lock registration)."""
    global _notify
    _notify = send


def notify_master(msg):
    """Send ``msg`` to the master if this process is a child; a no-op elsewhere."""
    if _notify is not None:
        _notify(msg)


def settings():
    return _settings or Settings()


def database():
    """This process's ``Database`` for the handlers (opened on first use)."""
    global _database
    if _database is None or _database.url != settings().database_url:
        url = settings().database_url
        if not url:
            raise ConfigError("toolkit.database_url is not set: ctx.transaction() needs the handlers' database")
        _database = Database(url)
    return _database


def redis():
    """``(client, prefix)`` for this process's Redis (the client connects on first command)."""
    global _redis
    if _redis is None or _redis[2] != settings().redis_url or _redis[3] != os.getpid():
        url = settings().redis_url
        if not url:
            raise ConfigError("toolkit.redis_url is not set: ctx.lock() and ctx.cache need Redis")
        client, prefix = open_redis(url)
        _redis = (client, prefix, url, os.getpid())
    return _redis[0], _redis[1]


def preload(cfg):
    """In the master, before it forks: import the driver of the handlers' database
    (``cfg.database_url``), so that every child shares the master's copy of its code rather
    than importing its own at its first transaction (psycopg is about 20 MiB a process).
    A daemon whose handlers have no database loads neither driver for them.

    And the ``idna`` codec, which Python's ``socket.getaddrinfo`` loads at the first
    connection to a host given as text (``encodings.idna``, ``stringprep``,
    ``unicodedata``): a handler's Redis client, HTTP client or mailer loads it in each
    child otherwise, where the import copies the pages it writes: about 0.9 MiB of a
    child's own memory, against 85 KiB the master's copy adds (bench/README.md, "A
    twenty-sixth machine")."""
    importlib.import_module("encodings.idna")  # for the children
    if not cfg.database_url:
        return
    try:
        importlib.import_module(DRIVERS[database_kind(cfg.database_url)])
    except (ConfigError, ImportError):
        pass  # a child's first transaction reports it, where its handler sees it


# -- URLs ---------------------------------------------------------------------------

def split_query(url, own):
    """``(url without the keys in own, {key: value} of those keys)``."""
    parts = urllib.parse.urlsplit(url)
    pairs = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    mine = {k: v for k, v in pairs if k in own}
    rest = urllib.parse.urlencode([(k, v) for k, v in pairs if k not in own])
    return urllib.parse.urlunsplit(parts._replace(query=rest)), mine


def open_redis(url, **kw):
    """A redis-py client for ``url`` and the key prefix named by its ``?prefix=``."""
    import redis as redis_py

    bare, mine = split_query(url, ("prefix",))
    kw.setdefault("socket_connect_timeout", 5)
    kw.setdefault("socket_timeout", 10)
    if urllib.parse.urlsplit(bare).scheme.lower().endswith("+sentinel"):
        # Each new connection asks the Sentinels for the primary: locks and cache follow a failover.
        from ..backends.redis.connection import sentinel_master

        kw.setdefault("decode_responses", False)
        return sentinel_master(bare, **kw), mine.get("prefix", "")
    return redis_py.Redis.from_url(bare, **kw), mine.get("prefix", "")


def check_urls(cfg):
    """ConfigError naming a ``[toolkit]`` URL its driver can never use (an option it does not
    know, a value it cannot read): said at start, at a reload and by ``config check``, not at
    each handler's first use, job after job. Nothing is connected to."""
    if cfg.redis_url:
        try:
            client, _ = open_redis(cfg.redis_url)
            client.connection_pool.make_connection()  # builds one, unconnected: its options are read here
        except (TypeError, ValueError) as exc:
            said = re.search(r"unexpected keyword argument '([^']*)'", str(exc))
            raise ConfigError(f"toolkit.redis_url: {'unknown option ' + said[1] if said else exc}") from None
    if cfg.database_url and database_kind(cfg.database_url) == "postgres":
        import psycopg

        from ..backends.postgres import libpq_conninfo

        try:
            libpq_conninfo(cfg.database_url, ("schema",))
        except psycopg.ProgrammingError as exc:
            raise ConfigError(f"toolkit.database_url: {str(exc).strip()}") from None


def database_kind(url):
    scheme = urllib.parse.urlsplit(url).scheme
    if scheme in ("postgresql", "postgres"):
        return "postgres"
    if scheme == "sqlite":
        return "sqlite"
    raise ConfigError(f"toolkit.database_url: expected postgresql://... or sqlite:///file, got scheme {scheme!r}")


class Database:
    """The handlers' database: one lazily opened connection per process.

    ``connection()`` returns ``(conn, kind)``. PostgreSQL connections are
    psycopg 3, not autocommit (the first statement begins a transaction);
    SQLite connections are in autocommit mode and ``transaction`` issues
    ``BEGIN IMMEDIATE`` itself.
    """

    def __init__(self, url):
        self.url = url
        self.kind = database_kind(url)
        self.schema = None
        self._conn = None
        self._pid = None

    def connect(self):
        if self.kind == "sqlite":
            import sqlite3  # the master imported it before the forks when this is the handlers' database (preload)

            path = urllib.parse.unquote(urllib.parse.urlsplit(self.url).path)[1:]
            conn = sqlite3.connect(path, timeout=5, isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA busy_timeout=5000")
            return conn
        import psycopg

        from ..backends.postgres import libpq_conninfo

        conninfo, mine = libpq_conninfo(self.url, ("schema",), connect_timeout="10")
        self.schema = mine.get("schema")
        if self.schema is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.schema):
            raise ConfigError(f"toolkit.database_url: schema {self.schema!r} must be a plain identifier")
        kw = {"options": f"-c search_path={self.schema}"} if self.schema else {}
        return psycopg.connect(conninfo, autocommit=False, **kw)

    def connection(self):
        if self._conn is None or self._pid != os.getpid():
            self._conn = self.connect()  # a parent's connection is forgotten, not closed
            self._pid = os.getpid()
        return self._conn, self.kind

    def reconnect(self, conn):
        """A new connection in place of ``conn``, found broken (the first statement of a transaction)."""
        if conn is self._conn:
            self._conn = None
        return self.connection()[0]

    def check(self, conn):
        """Forget ``conn`` if it broke (the next transaction reconnects)."""
        if conn is not self._conn or self.kind == "sqlite":
            return
        if conn.closed or conn.broken:
            self._conn = None

    def discard(self, conn):
        """Close and forget ``conn`` (its state is unknown); the next transaction reconnects."""
        if conn is self._conn:
            self.close()

    def close(self):
        if self._conn is not None and self._pid == os.getpid():
            self._conn.close()
        self._conn = None

    def end_job(self):
        """After each job: roll back a transaction it left open; True when there was one.

        A JobTimeout or Cancelled that lands as a ``ctx.transaction()`` block's ``__exit__``
        starts (before its ``critical()``) leaves the block neither committed nor rolled back,
        and still marked busy: every later block on this child was refused ("do not nest
        them") while the idle child held its locks (SQLite's write lock: every other child's
        blocks failed too), and on PostgreSQL the next COMMIT would have committed it. So
        would a statement the job ran on ``tx.conn`` and never committed.
        """
        left, self.busy = getattr(self, "busy", False), False
        conn = self._conn
        if conn is None or self._pid != os.getpid():
            return left
        try:
            if self.kind == "sqlite":
                left = left or conn.in_transaction
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
            else:
                from psycopg.pq import TransactionStatus

                if conn.info.transaction_status != TransactionStatus.IDLE:
                    left = True
                    conn.rollback()
        except Exception:  # noqa: BLE001 - its state is unknown: the next block connects anew
            left = True
            self.discard(conn)
        if left:
            log.warning("a job left a transaction of the handlers' database open: rolled back",
                        extra={"event": "transaction_left_open"})
        return left


def end_job():
    """The child calls it after each job (``Database.end_job``); nothing to do where no block ran."""
    if _database is not None:
        _database.end_job()


def migrate(url):
    """Create the toolkit's tables (``idempotency_records``) in the database at ``url``."""
    import sqlite3

    from . import idempotency

    db = Database(url)
    try:
        conn, kind = db.connection()
        if kind == "postgres" and db.schema:
            conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{db.schema}"')
        idempotency.create_table(conn, kind)
        if kind == "postgres":
            conn.commit()
    except (OSError, sqlite3.Error, ImportError) as exc:
        raise TangguhError(f"toolkit.database_url: cannot migrate: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - psycopg's errors: one line for the operator
        if type(exc).__module__.startswith("psycopg"):
            raise TangguhError(f"toolkit.database_url: cannot migrate: {exc}") from None
        raise
    finally:
        db.close()
