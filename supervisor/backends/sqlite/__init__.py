"""The embedded broker: one SQLite file, WAL mode, safe across processes.

Claims run in ``BEGIN IMMEDIATE`` transactions, so two processes never lease
the same job; partial indexes keep the claim query O(log n) however many jobs
are queued. URL: ``sqlite:////absolute/path.db`` or ``sqlite:///relative.db``
(relative to the working directory; config files resolve it against their
own folder). ``?synchronous=normal`` trades durability on power loss (not on a
process crash) for speed; the default is ``full``.

The package's parts: ``schema`` (the tables, the foreign-table refusal),
``producing`` (enqueue), ``database`` (opening the file, transactions, errors), ``wakeup`` (inotify on
the WAL), ``search`` (search, count, requeue, discard); the other operations
are here.
"""
import json
import os
import sqlite3

from ...errors import BadInput, BrokerBusy, BrokerError, ConfigError, LeaseLost, NotDead, RolledBack
from ...jsonvalues import entry_json, result_json
from ...model import DEAD, DONE, QueueStats, check_queue
from ..control import check_age, check_ids, check_limit, check_type
from ..base import Broker
from ..limits import Admission, active, refill
from . import schema, wakeup, workflows
from .control import _CLOSE_ENTRY, _LEASED, ControlMixin  # the statements' shared parts
from .producing import ProducingMixin
from .rows import claim_order as _claim_order, job as _job
from .database import (Transaction, busy, connect, disk_full, errors, interrupted_after, let_go_inherited,
                       read_url, truncate_wal)
from .ready import due_ids, due_rows
from .search import SearchMixin

# A job asked to cancel while it ran ends cancelled where it would run again (retry, release).
_UNLESS_CANCELLED = ("state = CASE WHEN cancel_request IS NULL THEN {state} ELSE 'cancelled' END,"
                     " finished_at = CASE WHEN cancel_request IS NULL THEN finished_at ELSE :now END")

PRUNE_BATCH = 5000  # rows one write transaction of prune deletes


class SQLiteBroker(ProducingMixin, workflows.Workflows, ControlMixin, SearchMixin, Broker):
    def __init__(self, url):
        self.url = url
        path, synchronous, busy_timeout = read_url(url)
        self.path, self._options = path, (synchronous, busy_timeout)
        self._inotify = None  # wake-up fd, opened on first wakeup_fd()
        self._pid = os.getpid()  # the process self.db belongs to (_connection)
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise BrokerError(f"sqlite database folder {folder} does not exist")
        try:
            self.db = connect(path, synchronous, busy_timeout)
            self.migrate()
        except ConfigError:
            self.db.close()
            raise
        except (sqlite3.Error, BrokerError) as exc:
            if getattr(self, "db", None) is not None:
                self.db.close()
            cause = exc if isinstance(exc, sqlite3.Error) else exc.__context__
            if busy(cause):
                # Another process held the write lock past the busy timeout: an outage to wait out.
                raise BrokerBusy(f"sqlite database {path}: locked by another process for more than"
                                 f" {busy_timeout:g}s") from None
            if disk_full(cause, folder):
                # Also an outage: the daemon exited 1 on it ("disk I/O error"), and systemd gave
                # up after five restarts, so it stayed down once space came back.
                raise BrokerBusy(f"sqlite database {path}: the disk is full ({cause})") from None
            if isinstance(exc, BrokerError):
                raise
            raise BrokerError(f"cannot open sqlite database {path}: {exc}") from None

    # -- plumbing ---------------------------------------------------------
    def migrate(self):
        with self._write():
            schema.migrate(self.db, self.path)
            workflows.migrate(self.db)

    def _write(self):
        return Transaction(self._connection(), "BEGIN IMMEDIATE", self.path)

    def _read(self):
        return Transaction(self._connection(), "BEGIN", self.path)

    def _connection(self):
        """This process's connection: every operation starts here (one getpid per call)."""
        if self._pid != os.getpid():
            self._forget_inherited()
            with errors(self.path):
                self.db = connect(self.path, *self._options)
            self._pid = os.getpid()
        return self.db

    def _forget_inherited(self):
        if self.db is not None:
            let_go_inherited(self.db)
        # The parent's inotify watch: reading it here would take the parent's wake-ups, and closing
        # it could close whatever a child that closed its inherited fds opened since.
        self.db = self._inotify = None

    def close(self):
        if self._pid != os.getpid():
            self._forget_inherited()
            return
        if self._inotify is not None:
            os.close(self._inotify)
            self._inotify = None
        try:
            self.db.close()
        except sqlite3.Error:
            pass

    def wakeup_fd(self):
        """An inotify descriptor on the database's WAL file (Linux), or None (see ``wakeup``)."""
        self._connection()  # not the parent's watch
        if self._inotify is None:
            self._inotify = wakeup.watch_modifications([os.path.abspath(self.path) + "-wal"])
        return self._inotify

    def interrupt(self):
        db = self.db
        if db is not None and self._pid == os.getpid():
            db.interrupt()  # SQLite's own, made to be called from another thread

    def drain_wakeups(self):
        if self._inotify is not None:
            wakeup.drain(self._inotify)

    # -- leasing ----------------------------------------------------------
    def claim(self, queues, n, lease_seconds, owner, limits=None):
        try:
            claimed = self._claim(queues, n, lease_seconds, owner, limits)
        except BrokerError as exc:  # from its one transaction, rolled back (a lock held past the busy timeout)
            raise RolledBack(str(exc)) from None
        return self._runnable(self._with_parents(claimed))  # reads after the commit: a failure here is no RolledBack

    def _claim(self, queues, n, lease_seconds, owner, limits):
        limits = active(limits)
        claimed = []
        with self._write():
            now = self.now()  # after BEGIN IMMEDIATE: the lease starts once the write lock is ours
            self._reclaim_expired(now)
            queues = self._claimable(queues, now)  # expiry and pauses: control.py
            if limits:
                return self._claim_limited(queues, n, lease_seconds, owner, limits, now)
            for queue in queues:
                if len(claimed) >= n:
                    break
                ids = due_ids(self.db, queue, now, n - len(claimed))
                if not ids:
                    continue
                rows = self.db.execute(
                    "UPDATE jobs SET state = 'running', attempt = attempt + 1, token = token + 1,"
                    " lease_until = :lease_until, owner = :owner,"
                    " history = json_insert(history, '$[#]', json_object("
                    "   'attempt', attempt + 1, 'started_at', :now, 'owner', :owner))"
                    " WHERE id IN (SELECT value FROM json_each(:ids)) RETURNING *",
                    {"lease_until": now + lease_seconds, "owner": owner, "now": now, "ids": json.dumps(ids)},
                ).fetchall()
                claimed.extend(sorted((_job(r) for r in rows), key=_claim_order))
        return claimed

    def _claim_limited(self, queues, n, lease_seconds, owner, limits, now):
        """The claim under per-type limits: BEGIN IMMEDIATE makes the counts exact."""
        types = sorted(limits)
        marks = ",".join("?" * len(types))
        # Through jobs_leased (the running jobs only): the planner otherwise scanned the whole table.
        leased = self.db.execute(f"SELECT type, resource_id FROM jobs INDEXED BY jobs_leased WHERE state = 'running'"
                                 f" AND type IN ({marks})", types).fetchall()
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
                where, params = "", []
                if blocked:
                    where += f" AND type NOT IN ({','.join('?' * len(blocked))})"
                    params += blocked
                if admission.busy:
                    where += (" AND NOT (resource_id IS NOT NULL AND (type, resource_id) IN (VALUES "
                              + ",".join(["(?, ?)"] * len(admission.busy)) + "))")
                    params += [x for pair in sorted(admission.busy) for x in pair]
                rows = due_rows(self.db, queue, now, want, "id, type, resource_id", where, params)
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
                    claimed.extend(sorted((_job(r) for r in leased), key=_claim_order))
                # A held-back row leaves the next query (its type is blocked or its resource busy now).
                if len(rows) < want:
                    break
        for t, left in admission.tokens.items():
            self.db.execute("INSERT OR REPLACE INTO rate_buckets (type, tokens, updated_at) VALUES (?, ?, ?)",
                            (t, left, now))
        return claimed

    def extend(self, leases, lease_seconds):
        lost = []
        with self._write():
            now = self.now()  # once the write lock is ours: a wait for it must not eat the lease
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
                     {"result": result_json(result)}, DONE, info)

    def ack_many(self, acks):
        """Every ack in one transaction: one commit (one fsync) for all of them."""
        now = self.now()
        lost = []
        with self._write():
            for lease, result, info in acks:
                cur = self.db.execute(
                    f"UPDATE jobs SET state = 'done', result = :result, finished_at = :now, lease_until = NULL,"
                    f" {_CLOSE_ENTRY} WHERE {_LEASED}",
                    {"result": result_json(result), "now": now, "entry": entry_json(info, now, DONE),
                     "id": lease.job_id, "token": lease.token})
                if cur.rowcount == 0:
                    lost.append(lease)
        return lost

    def retry(self, lease, run_at, error, info=None):
        self._finish(
            lease,
            _UNLESS_CANCELLED.format(state="'retrying'") + ", run_at = :run_at, error = :error,"
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
                "UPDATE jobs SET " + _UNLESS_CANCELLED.format(state="'queued'") + ","
                " attempt = attempt - 1, lease_until = NULL, owner = NULL,"
                " run_at = :now, history = json_remove(history, '$[#-1]') WHERE " + _LEASED,
                {"now": self.now(), "id": lease.job_id, "token": lease.token},
            )
            if cur.rowcount == 0:
                raise LeaseLost(lease.job_id, lease.token)
            # Nor was a rate spent: the token goes back (the next claim's refill caps the bucket).
            self.db.execute("UPDATE rate_buckets SET tokens = tokens + 1 WHERE type = (SELECT type FROM jobs"
                            " WHERE id = ?)", (lease.job_id,))

    # -- reading ----------------------------------------------------------
    def get(self, job_id):
        db = self._connection()
        with errors(self.path):
            row = db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
            return self._with_parents([_job(row)])[0] if row else None

    def stats(self, queues, within=None):
        queues = [check_queue(q) for q in queues]  # a name no queue can have: BadInput, as on Redis
        now = self.now()
        out = {q: QueueStats(q) for q in queues}
        marks = ",".join("?" * len(queues))
        # Each count is a range of jobs_stats (queue, state, run_at) read without the table
        # (schema.STATS_INDEX; tests/test_stats_plans.py holds the planner to it). Without it,
        # SQLite walked another index that starts with queue and looked up every row's state.
        with self._read(), interrupted_after(self.db, within):
            for row in self.db.execute(
                "SELECT queue, count(*) AS n, min(run_at) AS oldest FROM jobs"
                f" WHERE queue IN ({marks}) AND state IN ('queued', 'retrying') AND run_at <= ? GROUP BY queue",
                (*queues, now),
            ):
                out[row["queue"]].ready = row["n"]
                out[row["queue"]].oldest_ready_age = max(0.0, now - row["oldest"])
            for row in self.db.execute(
                "SELECT queue, count(*) AS n FROM jobs"
                f" WHERE queue IN ({marks}) AND state IN ('queued', 'retrying') AND run_at > ? GROUP BY queue",
                (*queues, now),
            ):
                out[row["queue"]].scheduled = row["n"]
            for row in self.db.execute(
                f"SELECT queue, state, count(*) AS n FROM jobs WHERE queue IN ({marks})"
                " AND state IN ('running', 'dead', 'done', 'cancelled', 'expired', 'waiting') GROUP BY queue, state",
                tuple(queues),
            ):
                field = {"running": "in_flight"}.get(row["state"], row["state"])
                setattr(out[row["queue"]], field, row["n"])
            for row in self.db.execute(f"SELECT queue FROM paused_queues WHERE queue IN ({marks})", tuple(queues)):
                out[row["queue"]].paused = True
        return out

    # -- dead letters -----------------------------------------------------
    def dlq_list(self, type=None, limit=100):
        limit, type = check_limit(limit), check_type(type)
        sql = "SELECT * FROM jobs WHERE state = 'dead'"
        params = []
        if type:
            sql += " AND type = ?"
            params.append(type)
        sql += " ORDER BY finished_at DESC, id DESC"
        if limit is not None:
            sql += " LIMIT ?"
            params.append(int(limit))
        db = self._connection()
        with errors(self.path):
            return [_job(r) for r in db.execute(sql, params).fetchall()]

    def dlq_replay(self, job_ids):
        job_ids = check_ids(job_ids, most=None)
        now = self.now()
        with self._write():
            self._require_dead(job_ids)
            present = {row["name"] for row in self.db.execute("PRAGMA table_info(jobs)")}
            held = self._hold_keys(job_ids) if "pending" in present else None
            for job_id in self._parents_first(job_ids, present):  # as a requeue (search.py)
                try:
                    self._put_back(job_id, now, present, ("cancel_request", "expires_at"))
                except sqlite3.IntegrityError:
                    raise BadInput(f"cannot replay {job_id}: its idempotency key is held by an unfinished job") from None
            if held is not None:
                self._release_keys(held)
        return list(job_ids)

    def dlq_purge(self, job_ids):
        job_ids = check_ids(job_ids, most=None)
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

    def prune(self, done_older_than, budget=None):
        """Done, cancelled and expired jobs finished before the cutoff, ``PRUNE_BATCH`` rows per
        write transaction: another process's claim waits for one batch, never for a backlog
        (millions of rows in one transaction held the write lock past the busy timeout).
        A workflow child cancelled by a parent still dead stays, and its cancelled subtree
        (``workflows.REPLAYABLE``)."""
        cutoff = self.now() - check_age(done_older_than)
        total = 0
        for states, keep in (("'done'", "0"), ("'cancelled', 'expired'", workflows.REPLAYABLE)):
            while budget is None or total < budget:
                with self._write():
                    n = self.db.execute(f"DELETE FROM jobs WHERE rowid IN (SELECT rowid FROM jobs WHERE state IN"
                                        f" ({states}) AND finished_at < ? AND NOT ({keep}) LIMIT {PRUNE_BATCH})",
                                        (cutoff,)).rowcount
                total += n
                if n < PRUNE_BATCH:
                    break
        with self._write():
            self.db.execute("DELETE FROM once_keys WHERE created_at < ?", (cutoff,))
        with errors(self.path):
            truncate_wal(self.db, self._options[1])
        return total

