"""The embedded broker: one SQLite file, WAL mode, safe across processes.

Claims run in ``BEGIN IMMEDIATE`` transactions, so two processes never lease
the same job; partial indexes keep the claim query O(log n) however many jobs
are queued. URL: ``sqlite:////absolute/path.db`` or ``sqlite:///relative.db``
(relative to the working directory; config files resolve it against their
own folder). ``?synchronous=normal`` trades durability on power loss (not on a
process crash) for speed; the default is ``full``.
"""
import contextlib
import ctypes
import json
import os
import sqlite3
import urllib.parse

from ..errors import BadInput, BrokerError, ConfigError, LeaseLost, NotDead
from ..model import DEAD, DONE, RETRYING, Job, QueueStats, error_info, load_json
from .base import Broker
from .limits import Admission, active, refill

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    queue TEXT NOT NULL,
    type TEXT NOT NULL,
    payload TEXT NOT NULL,
    state TEXT NOT NULL,
    resource_id TEXT,
    idempotency_key TEXT,
    attempt INTEGER NOT NULL DEFAULT 0,
    max_attempts INTEGER NOT NULL,
    timeout REAL,
    priority INTEGER NOT NULL DEFAULT 0,
    run_at REAL NOT NULL,
    queued_at REAL NOT NULL,
    trace_id TEXT,
    token INTEGER NOT NULL DEFAULT 0,
    lease_until REAL,
    owner TEXT,
    result TEXT,
    error TEXT,
    reason TEXT,
    first_failure_at REAL,
    last_failure_at REAL,
    finished_at REAL,
    history TEXT NOT NULL DEFAULT '[]'
);
CREATE INDEX IF NOT EXISTS jobs_ready ON jobs (queue, priority DESC, run_at, id)
    WHERE state IN ('queued', 'retrying');
CREATE INDEX IF NOT EXISTS jobs_leased ON jobs (lease_until) WHERE state = 'running';
CREATE INDEX IF NOT EXISTS jobs_finished ON jobs (state, finished_at) WHERE state IN ('done', 'dead');
CREATE UNIQUE INDEX IF NOT EXISTS jobs_idempotency ON jobs (idempotency_key)
    WHERE idempotency_key IS NOT NULL AND state IN ('queued', 'running', 'retrying');
CREATE TABLE IF NOT EXISTS rate_buckets (type TEXT PRIMARY KEY, tokens REAL NOT NULL, updated_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS once_keys (key TEXT PRIMARY KEY, created_at REAL NOT NULL);
"""

# Closing the open history entry: merge {ended_at, outcome, ...info} into the last element.
_CLOSE_ENTRY = "history = json_set(history, '$[#-1]', json_patch(json_extract(history, '$[#-1]'), json(:entry)))"
_LEASED = "id = :id AND token = :token AND state = 'running'"
_JOB_COLUMNS = {"id", "queue", "type", "payload", "state", "attempt", "token", "lease_until", "history"}


class SQLiteBroker(Broker):
    def __init__(self, url):
        self.url = url
        parts = urllib.parse.urlsplit(url)
        path = urllib.parse.unquote(parts.path)
        if parts.netloc not in ("", "localhost"):
            raise BrokerError(f"sqlite url {url!r}: use sqlite:///path (three slashes)")
        path = path[1:]  # sqlite:///rel.db is relative, sqlite:////abs.db absolute
        if not path:
            raise BrokerError(f"sqlite url {url!r} names no file")
        options = dict(urllib.parse.parse_qsl(parts.query))
        synchronous = options.pop("synchronous", "full").upper()
        if synchronous not in ("FULL", "NORMAL"):
            raise BrokerError(f"sqlite url {url!r}: synchronous must be full or normal")
        if options:
            raise BrokerError(f"sqlite url {url!r}: unknown option(s) {', '.join(sorted(options))}")
        self.path = path
        self._inotify = None  # wake-up fd, opened on first wakeup_fd()
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise BrokerError(f"sqlite database folder {folder} does not exist")
        try:
            # isolation_level=None: we issue BEGIN ourselves (IMMEDIATE where we write).
            self.db = sqlite3.connect(path, timeout=30.0, isolation_level=None, check_same_thread=False)
            self.db.row_factory = sqlite3.Row
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute(f"PRAGMA synchronous={synchronous}")
            self.db.execute("PRAGMA busy_timeout=30000")
            self.migrate()
        except ConfigError:
            self.db.close()
            raise
        except sqlite3.Error as exc:
            raise BrokerError(f"cannot open sqlite database {path}: {exc}") from None

    # -- plumbing ---------------------------------------------------------
    def migrate(self):
        with self._write():
            columns = {row["name"] for row in self.db.execute("PRAGMA table_info(jobs)")}
            if columns and not _JOB_COLUMNS <= columns:
                # CREATE TABLE IF NOT EXISTS would keep it and write our jobs into it.
                raise ConfigError(f"sqlite database {self.path} has a jobs table that is not Tangguh's:"
                                  " give the broker a database file of its own")
            for statement in SCHEMA.split(";"):
                if statement.strip():
                    self.db.execute(statement)

    def _write(self):
        return _Tx(self.db, "BEGIN IMMEDIATE", self.path)

    def _read(self):
        return _Tx(self.db, "BEGIN", self.path)

    def close(self):
        if self._inotify is not None:
            os.close(self._inotify)
            self._inotify = None
        try:
            self.db.close()
        except sqlite3.Error:
            pass

    def wakeup_fd(self):
        """An inotify descriptor on the database's WAL file (Linux), or None.

        Every commit, by any process, writes the WAL, so an enqueue wakes an idle
        supervisor at once instead of at its next poll. Commits that change
        nothing (an empty claim) write no WAL, so an idle supervisor does not
        wake itself. Elsewhere (no inotify) the supervisor polls.
        """
        if self._inotify is None:
            self._inotify = _watch_modifications([os.path.abspath(self.path) + "-wal"])
        return self._inotify

    def drain_wakeups(self):
        if self._inotify is None:
            return
        try:
            while os.read(self._inotify, 65536):
                pass
        except BlockingIOError:
            pass

    # -- producing --------------------------------------------------------
    def enqueue(self, job):
        return self.enqueue_many([job])[0]

    def enqueue_many(self, jobs, _in_tx=False):
        jobs = [job.validate() for job in jobs]
        now = self.now()
        ids = []
        with contextlib.nullcontext() if _in_tx else self._write():
            for job in jobs:
                if job.idempotency_key is not None:
                    row = self.db.execute(
                        "SELECT id FROM jobs WHERE idempotency_key = ? AND state IN ('queued','running','retrying')",
                        (job.idempotency_key,),
                    ).fetchone()
                    if row:
                        ids.append(row["id"])
                        continue
                self.db.execute(
                    "INSERT INTO jobs (id, queue, type, payload, state, resource_id, idempotency_key,"
                    " max_attempts, timeout, priority, run_at, queued_at, trace_id)"
                    " VALUES (?, ?, ?, ?, 'queued', ?, ?, ?, ?, ?, ?, ?, ?)",
                    (job.id, job.queue, job.type, json.dumps(job.payload), job.resource_id, job.idempotency_key,
                     job.max_attempts, job.timeout, job.priority, now + job.delay, now, job.trace_id),
                )
                ids.append(job.id)
        return ids

    def enqueue_once(self, job):
        job.validate()
        if job.idempotency_key is None:
            raise BadInput("enqueue_once needs an idempotency_key")
        with self._write():
            inserted = self.db.execute("INSERT OR IGNORE INTO once_keys (key, created_at) VALUES (?, ?)",
                                       (job.idempotency_key, self.now())).rowcount
            if not inserted:
                return None
            return self.enqueue_many([job], _in_tx=True)[0]

    # -- leasing ----------------------------------------------------------
    def claim(self, queues, n, lease_seconds, owner, limits=None):
        return self._runnable(self._claim(queues, n, lease_seconds, owner, limits))

    def _claim(self, queues, n, lease_seconds, owner, limits):
        limits = active(limits)
        claimed = []
        with self._write():
            now = self.now()  # after BEGIN IMMEDIATE: the lease starts once the write lock is ours
            self._reclaim_expired(now)
            if limits:
                return self._claim_limited(queues, n, lease_seconds, owner, limits, now)
            for queue in queues:
                if len(claimed) >= n:
                    break
                rows = self.db.execute(
                    "UPDATE jobs SET state = 'running', attempt = attempt + 1, token = token + 1,"
                    " lease_until = :lease_until, owner = :owner,"
                    " history = json_insert(history, '$[#]', json_object("
                    "   'attempt', attempt + 1, 'started_at', :now, 'owner', :owner))"
                    " WHERE id IN (SELECT id FROM jobs WHERE queue = :queue AND state IN ('queued', 'retrying')"
                    "   AND run_at <= :now ORDER BY priority DESC, run_at, id LIMIT :limit)"
                    " RETURNING *",
                    {"lease_until": now + lease_seconds, "owner": owner, "now": now, "queue": queue,
                     "limit": n - len(claimed)},
                ).fetchall()
                claimed.extend(sorted((_job(r) for r in rows), key=lambda j: (-j.priority, j.run_at, j.id)))
        return claimed

    def _claim_limited(self, queues, n, lease_seconds, owner, limits, now):
        """The claim under per-type limits: BEGIN IMMEDIATE makes the counts exact."""
        types = sorted(limits)
        marks = ",".join("?" * len(types))
        leased = self.db.execute(f"SELECT type, resource_id FROM jobs WHERE state = 'running' AND type IN ({marks})",
                                 types).fetchall()
        tokens = {}
        for t, lim in limits.items():
            if lim.rate is not None:
                row = self.db.execute("SELECT tokens, updated_at FROM rate_buckets WHERE type = ?", (t,)).fetchone()
                tokens[t] = refill(row and row[0], row and row[1], now, *lim.rate)
        admission = Admission(limits, leased, tokens)
        claimed = []
        for queue in queues:
            while len(claimed) < n:
                want = n - len(claimed)
                blocked = admission.blocked()
                sql = ("SELECT id, type, resource_id FROM jobs WHERE queue = ? AND state IN ('queued', 'retrying')"
                       " AND run_at <= ?")
                params = [queue, now]
                if blocked:
                    sql += f" AND type NOT IN ({','.join('?' * len(blocked))})"
                    params += blocked
                if admission.busy:
                    sql += (" AND NOT (resource_id IS NOT NULL AND (type, resource_id) IN (VALUES "
                            + ",".join(["(?, ?)"] * len(admission.busy)) + "))")
                    params += [x for pair in sorted(admission.busy) for x in pair]
                rows = self.db.execute(sql + " ORDER BY priority DESC, run_at, id LIMIT ?", params + [want]).fetchall()
                ids = [r["id"] for r in rows if admission.admit(r["type"], r["resource_id"])]
                if ids:
                    leased = self.db.execute(
                        "UPDATE jobs SET state = 'running', attempt = attempt + 1, token = token + 1,"
                        " lease_until = ?, owner = ?,"
                        " history = json_insert(history, '$[#]', json_object("
                        "   'attempt', attempt + 1, 'started_at', ?, 'owner', ?))"
                        f" WHERE id IN ({','.join('?' * len(ids))}) RETURNING *",
                        [now + lease_seconds, owner, now, owner, *ids],
                    ).fetchall()
                    claimed.extend(sorted((_job(r) for r in leased), key=lambda j: (-j.priority, j.run_at, j.id)))
                # A held-back row leaves the next query (its type is blocked or its resource busy now).
                if len(rows) < want:
                    break
        for t, left in admission.tokens.items():
            self.db.execute("INSERT OR REPLACE INTO rate_buckets (type, tokens, updated_at) VALUES (?, ?, ?)",
                            (t, left, now))
        return claimed

    def _reclaim_expired(self, now):
        expired = self.db.execute(
            "SELECT id, attempt, max_attempts, owner FROM jobs WHERE state = 'running' AND lease_until < ?", (now,)
        ).fetchall()
        for row in expired:
            error = error_info("lease_expired", message=f"lease of owner {row['owner']} expired")
            entry = {"ended_at": now, "outcome": "lease_expired", "error": error}
            exhausted = row["attempt"] >= row["max_attempts"]
            self.db.execute(
                "UPDATE jobs SET state = :state, run_at = :now, lease_until = NULL, owner = NULL,"
                " error = :error, reason = :reason, finished_at = :finished,"
                " first_failure_at = coalesce(first_failure_at, :now), last_failure_at = :now, "
                + _CLOSE_ENTRY + " WHERE id = :id",
                {"state": DEAD if exhausted else RETRYING, "now": now, "error": json.dumps(error),
                 "reason": "lease_expired" if exhausted else None, "finished": now if exhausted else None,
                 "entry": json.dumps(entry), "id": row["id"]},
            )

    def extend(self, leases, lease_seconds):
        now = self.now()
        lost = []
        with self._write():
            for lease in leases:
                cur = self.db.execute(
                    "UPDATE jobs SET lease_until = :until WHERE " + _LEASED,
                    {"until": now + lease_seconds, "id": lease.job_id, "token": lease.token},
                )
                if cur.rowcount == 0:
                    lost.append(lease)
        return lost

    def _finish(self, lease, sets, params, outcome, info):
        now = self.now()
        entry = dict(info or {}, ended_at=now, outcome=outcome)
        if "error" in params:
            entry["error"] = params["error"]
            params = dict(params, error=json.dumps(params["error"]))
        with self._write():
            cur = self.db.execute(
                f"UPDATE jobs SET {sets}, lease_until = NULL, {_CLOSE_ENTRY} WHERE {_LEASED}",
                dict(params, now=now, entry=json.dumps(entry), id=lease.job_id, token=lease.token),
            )
            if cur.rowcount == 0:
                raise LeaseLost(lease.job_id, lease.token)

    def ack(self, lease, result=None, info=None):
        self._finish(lease, "state = 'done', result = :result, finished_at = :now",
                     {"result": json.dumps(result)}, DONE, info)

    def ack_many(self, acks):
        """Every ack in one transaction: one commit (one fsync) for all of them."""
        now = self.now()
        lost = []
        with self._write():
            for lease, result, info in acks:
                entry = dict(info or {}, ended_at=now, outcome=DONE)
                cur = self.db.execute(
                    f"UPDATE jobs SET state = 'done', result = :result, finished_at = :now, lease_until = NULL,"
                    f" {_CLOSE_ENTRY} WHERE {_LEASED}",
                    {"result": json.dumps(result), "now": now, "entry": json.dumps(entry), "id": lease.job_id,
                     "token": lease.token})
                if cur.rowcount == 0:
                    lost.append(lease)
        return lost

    def retry(self, lease, run_at, error, info=None):
        self._finish(
            lease,
            "state = 'retrying', run_at = :run_at, error = :error,"
            " first_failure_at = coalesce(first_failure_at, :now), last_failure_at = :now",
            {"run_at": run_at, "error": error}, "retry", info,
        )

    def dead(self, lease, reason, error, info=None):
        self._finish(
            lease,
            "state = 'dead', reason = :reason, error = :error, finished_at = :now,"
            " first_failure_at = coalesce(first_failure_at, :now), last_failure_at = :now",
            {"reason": reason, "error": error}, DEAD, info,
        )

    def release(self, lease):
        with self._write():
            cur = self.db.execute(
                "UPDATE jobs SET state = 'queued', attempt = attempt - 1, lease_until = NULL, owner = NULL,"
                " run_at = :now, history = json_remove(history, '$[#-1]') WHERE " + _LEASED,
                {"now": self.now(), "id": lease.job_id, "token": lease.token},
            )
            if cur.rowcount == 0:
                raise LeaseLost(lease.job_id, lease.token)

    # -- reading ----------------------------------------------------------
    def get(self, job_id):
        with _errors(self.path):
            row = self.db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return _job(row) if row else None

    def stats(self, queues):
        now = self.now()
        out = {q: QueueStats(q) for q in queues}
        marks = ",".join("?" * len(queues))
        with self._read():
            for row in self.db.execute(
                "SELECT queue, count(*) AS n, min(run_at) AS oldest FROM jobs"
                f" WHERE state IN ('queued', 'retrying') AND run_at <= ? AND queue IN ({marks}) GROUP BY queue",
                (now, *queues),
            ):
                out[row["queue"]].ready = row["n"]
                out[row["queue"]].oldest_ready_age = max(0.0, now - row["oldest"])
            for row in self.db.execute(
                "SELECT queue, count(*) AS n FROM jobs"
                f" WHERE state IN ('queued', 'retrying') AND run_at > ? AND queue IN ({marks}) GROUP BY queue",
                (now, *queues),
            ):
                out[row["queue"]].scheduled = row["n"]
            for row in self.db.execute(
                f"SELECT queue, state, count(*) AS n FROM jobs WHERE state IN ('running', 'dead', 'done')"
                f" AND queue IN ({marks}) GROUP BY queue, state",
                tuple(queues),
            ):
                field = {"running": "in_flight", "dead": "dead", "done": "done"}[row["state"]]
                setattr(out[row["queue"]], field, row["n"])
        return out

    # -- dead letters -----------------------------------------------------
    def dlq_list(self, type=None, limit=100):
        sql = "SELECT * FROM jobs WHERE state = 'dead'"
        params = []
        if type:
            sql += " AND type = ?"
            params.append(type)
        sql += " ORDER BY finished_at DESC, id DESC"
        if limit is not None:
            sql += " LIMIT ?"
            params.append(int(limit))
        with _errors(self.path):
            return [_job(r) for r in self.db.execute(sql, params).fetchall()]

    def dlq_replay(self, job_ids):
        now = self.now()
        with self._write():
            self._require_dead(job_ids)
            for job_id in job_ids:
                try:
                    self.db.execute(
                        "UPDATE jobs SET state = 'queued', attempt = 0, run_at = ?, reason = NULL,"
                        " finished_at = NULL, lease_until = NULL, owner = NULL WHERE id = ?",
                        (now, job_id),
                    )
                except sqlite3.IntegrityError:
                    raise BadInput(f"cannot replay {job_id}: its idempotency key is held by an unfinished job") from None
        return list(job_ids)

    def dlq_purge(self, job_ids):
        with self._write():
            self._require_dead(job_ids)
            for job_id in job_ids:
                self.db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))
        return len(job_ids)

    def _require_dead(self, job_ids):
        for job_id in job_ids:
            row = self.db.execute("SELECT state FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if row is None or row["state"] != DEAD:
                raise NotDead(f"job {job_id} is {'unknown' if row is None else row['state']}, not dead")

    def prune(self, done_older_than):
        with self._write():
            cutoff = self.now() - done_older_than
            cur = self.db.execute("DELETE FROM jobs WHERE state = 'done' AND finished_at < ?", (cutoff,))
            self.db.execute("DELETE FROM once_keys WHERE created_at < ?", (cutoff,))
        return cur.rowcount


class _Tx:
    """BEGIN ... COMMIT, or ROLLBACK when the block raises.

    SQLite's own errors (a full disk, a lock held past the busy timeout, an I/O
    error) leave as BrokerError naming the file, like every broker's failures.
    """

    def __init__(self, db, begin, path):
        self.db, self.begin, self.path = db, begin, path

    def __enter__(self):
        with _errors(self.path):
            self.db.execute(self.begin)

    def __exit__(self, exc_type, exc, tb):
        with _errors(self.path):
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
def _errors(path):
    try:
        yield
    except sqlite3.Error as exc:
        raise BrokerError(f"sqlite database {path}: {exc}") from None


_IN_MODIFY = 0x00000002


def _watch_modifications(paths):
    """A non-blocking inotify fd reporting writes to ``paths``; None without inotify."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, AttributeError):
        return None
    if fd < 0:
        return None
    for path in paths:
        if libc.inotify_add_watch(fd, os.fsencode(path), _IN_MODIFY) < 0:
            os.close(fd)
            return None
    return fd


def _job(row):
    d = dict(row)
    for key in ("payload", "result", "error", "history"):
        if d.get(key) is not None:
            d[key] = load_json(d[key])
    return Job.from_dict(d)

