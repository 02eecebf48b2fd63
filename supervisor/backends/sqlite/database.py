"""The SQLite file: opening it, transactions, and SQLite's errors as BrokerError."""
import contextlib
import os
import sqlite3
import time
import urllib.parse

from ...errors import BrokerError, BrokerUnusable


BUSY_TIMEOUT = 30.0  # seconds a call waits for another process's write lock (URL option busy_timeout)
# The WAL file never shrank after a burst: SQLite reuses it from the start once checkpointed, and
# cuts it back to this size only when told to.
JOURNAL_SIZE_LIMIT = 64 * 2**20
# Free bytes under which an I/O error at open is taken for a full disk (the shared-memory file
# alone needs 32 KiB, the WAL more).
FULL_BELOW = 2**20


def read_url(url):
    """``(path, synchronous, busy_timeout)`` of ``sqlite:///path?synchronous=full|normal&busy_timeout=S``,
    or BrokerUnusable naming what is wrong: no wait can fix a URL, so `run` exits 2 on it."""
    parts = urllib.parse.urlsplit(url)
    path = urllib.parse.unquote(parts.path)
    if parts.netloc not in ("", "localhost"):
        raise BrokerUnusable(f"sqlite url {url!r}: use sqlite:///path (three slashes)")
    path = path[1:]  # sqlite:///rel.db is relative, sqlite:////abs.db absolute
    if not path:
        raise BrokerUnusable(f"sqlite url {url!r} names no file")
    options = dict(urllib.parse.parse_qsl(parts.query))
    synchronous = options.pop("synchronous", "full").upper()
    if synchronous not in ("FULL", "NORMAL"):
        raise BrokerUnusable(f"sqlite url {url!r}: synchronous must be full or normal")
    busy_timeout = options.pop("busy_timeout", None)
    try:
        busy_timeout = BUSY_TIMEOUT if busy_timeout is None else float(busy_timeout)
    except ValueError:
        busy_timeout = -1.0
    if not 0 < busy_timeout <= 3600:
        raise BrokerUnusable(f"sqlite url {url!r}: busy_timeout must be seconds, more than 0 and at most 3600")
    if options:
        raise BrokerUnusable(f"sqlite url {url!r}: unknown option(s) {', '.join(sorted(options))}")
    return path, synchronous, busy_timeout


def connect(path, synchronous, busy_timeout=BUSY_TIMEOUT):
    """A connection in WAL mode that waits up to ``busy_timeout`` s for another process's write lock.

    ``isolation_level=None``: the broker issues BEGIN itself (IMMEDIATE where it writes).
    Raises ``sqlite3.Error``; the caller names the file.
    """
    db = sqlite3.connect(path, timeout=busy_timeout, isolation_level=None, check_same_thread=False)
    db.row_factory = sqlite3.Row
    db.execute("PRAGMA journal_mode=WAL")
    db.execute(f"PRAGMA synchronous={synchronous}")
    db.execute(f"PRAGMA busy_timeout={int(busy_timeout * 1000)}")
    db.execute("PRAGMA recursive_triggers=ON")  # a workflow's cancellation cascades down the tree
    db.execute(f"PRAGMA journal_size_limit={JOURNAL_SIZE_LIMIT}")
    return db


def truncate_wal(db, busy_timeout):
    """Checkpoint and empty the WAL if nobody is using it now; never waits for anybody (the
    master's loop calls it): a reader or a writer in the way makes it a no-op until next time."""
    db.execute("PRAGMA busy_timeout=0")
    try:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
    finally:
        db.execute(f"PRAGMA busy_timeout={int(busy_timeout * 1000)}")


_INHERITED = []  # connections inherited inside a transaction: never used, closed nor collected


def let_go_inherited(db):
    """Let go of a connection this process inherited through fork(), once, before opening its own.

    SQLite forbids using a connection across fork(), and a fresh one is not enough while the
    inherited one stays open: SQLite keeps one record of locks per file and process, the child's
    copy says the parent's locks are held, so the child's connection took none. The parent's
    close, seeing no other process's lock, then checkpointed and deleted the WAL the child went on
    committing to (tests/test_sqlite_broker.py, "fork"). Closing the inherited connection drops
    that record. What a close writes to the file (a checkpoint, deleting the WAL) needs the
    exclusive lock, which no process gets while another has the file open. Closing one caught
    inside a transaction (another thread was using it at the fork) would roll its frames out of
    the shared WAL index: it stays open instead, referenced and unused.
    """
    if db.in_transaction:
        _INHERITED.append(db)
        return
    try:
        db.close()
    except sqlite3.Error:
        pass


@contextlib.contextmanager
def interrupted_after(db, seconds):
    """SQLite abandons the statements of the block past ``seconds`` (``sqlite3.OperationalError:
    interrupted``); None: no bound."""
    if seconds is None:
        yield
        return
    deadline = time.monotonic() + seconds
    db.set_progress_handler(lambda: time.monotonic() > deadline, 10_000)
    try:
        yield
    finally:
        db.set_progress_handler(None, 10_000)


class Transaction:
    """BEGIN ... COMMIT, or ROLLBACK when the block raises.

    SQLite's own errors (a full disk, a lock held past the busy timeout, an I/O
    error) leave as BrokerError naming the file, like every broker's failures.
    """

    def __init__(self, db, begin, path):
        self.db, self.begin, self.path = db, begin, path

    def __enter__(self):
        with errors(self.path):
            self.db.execute(self.begin)

    def __exit__(self, exc_type, exc, tb):
        with errors(self.path):
            if exc_type is None:
                try:
                    self.db.execute("COMMIT")
                except sqlite3.Error:
                    self._rollback()
                    raise
                return
            self._rollback()
            if isinstance(exc, sqlite3.Error):
                raise exc

    def _rollback(self):
        if self.db.in_transaction:  # SQLite may have rolled back by itself (a full disk does)
            self.db.execute("ROLLBACK")


@contextlib.contextmanager
def errors(path):
    try:
        yield
    except sqlite3.Error as exc:
        raise BrokerError(f"sqlite database {path}: {exc}") from None


def busy(exc):
    """True when ``exc`` is SQLite's "database is locked": another process held the lock too long."""
    return getattr(exc, "sqlite_errorname", "").startswith(("SQLITE_BUSY", "SQLITE_LOCKED"))


def disk_full(exc, folder):
    """True when ``exc`` comes of a full disk: SQLITE_FULL, or an I/O error (SQLite reports a
    shared-memory file it cannot grow as SQLITE_IOERR_SHMSIZE) while ``folder`` has no room."""
    name = getattr(exc, "sqlite_errorname", "")
    if name.startswith("SQLITE_FULL"):
        return True
    if not name.startswith("SQLITE_IOERR"):
        return False
    try:
        space = os.statvfs(folder)
    except OSError:
        return False
    return space.f_bavail * space.f_frsize < FULL_BELOW
