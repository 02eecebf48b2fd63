"""The SQLite broker's job-control operations: cancel, renew, pause, expiry, wait, supervisor records.

A mixin of ``SQLiteBroker`` (it uses its ``db``, ``_write`` and ``_read``).
Pauses live in ``paused_queues`` and supervisor records in ``supervisors``;
a job's ``cancel_request``, ``progress``, ``progress_note`` and
``expires_at`` are columns of ``jobs``. ``wait`` is woken by an inotify watch
on the WAL file (every commit of any process writes it); it re-reads the job at
least every ``WAIT_FALLBACK`` seconds in case a notification was missed
(no inotify on this system), and briefly more often after a write (``SETTLE``).
"""
import json
import os
import select
import time

from ...errors import LeaseLost
from ...model import CANCELLED, DEAD, RETRYING, Renewal, check_queue, error_info
from .. import control
from . import wakeup

WAIT_FALLBACK = 1.0
# A commit writes the WAL before it is visible to readers (the fsync, then the WAL index in
# shared memory, which inotify does not see): after a write, re-read every SETTLE_STEP
# seconds for SETTLE seconds, so a commit seen early is read once it lands.
SETTLE, SETTLE_STEP = 1.0, 0.02
# The queues holding jobs: a skip scan of an index led by queue (jobs_search_queue or jobs_stats), one
# probe per queue instead of reading every job.
DISTINCT_QUEUES = ("WITH RECURSIVE q(queue) AS (SELECT min(queue) FROM jobs UNION ALL"
                   " SELECT (SELECT min(j.queue) FROM jobs j WHERE j.queue > q.queue) FROM q"
                   " WHERE q.queue IS NOT NULL) SELECT queue FROM q WHERE queue IS NOT NULL")
# Closing the open history entry: merge {ended_at, outcome, ...info} into the last element.
# With _LEASED (the lease still the job's), shared with the broker's outcome writes (__init__.py).
_CLOSE_ENTRY = "history = json_set(history, '$[#-1]', json_patch(json_extract(history, '$[#-1]'), json(:entry)))"
_LEASED = "id = :id AND token = :token AND state = 'running'"
EXPIRE_BATCH = 1000  # jobs one claim ends expired at most


class ControlMixin(control.ExpiredLog):
    # -- cancel --------------------------------------------------------------
    def cancel(self, job_ids, by, reason):
        job_ids = control.check_ids(job_ids)
        out = {}
        with self._write():
            request = control.cancel_request(by, reason, self.now())
            for job_id in job_ids:
                row = self.db.execute("SELECT state FROM jobs WHERE id = ?", (job_id,)).fetchone()
                if row is None:
                    out[job_id] = "unknown"
                elif row["state"] in ("queued", "retrying", "waiting"):
                    self.db.execute(
                        "UPDATE jobs SET state = 'cancelled', finished_at = :at, cancel_request = :req,"
                        " history = json_insert(history, '$[#]', json(:entry)) WHERE id = :id",
                        {"at": request["at"], "req": json.dumps(request),
                         "entry": json.dumps(control.cancel_entry(request)), "id": job_id})
                    out[job_id] = CANCELLED
                else:
                    if row["state"] == "running":  # the first request stands: a second is harmless
                        self.db.execute("UPDATE jobs SET cancel_request = coalesce(cancel_request, ?) WHERE id = ?",
                                        (json.dumps(request), job_id))
                    out[job_id] = control.answer_for(row["state"])
        return out

    def renew(self, leases, lease_seconds, progress=None, queues=None):
        progress = progress or {}
        renewal = Renewal()
        with self._write():
            now = self.now()  # once the write lock is ours: a wait for it must not eat the lease
            for lease in leases:
                fraction, note = control.progress_value(progress[lease.job_id]) if lease.job_id in progress \
                    else (None, None)
                row = self.db.execute(
                    "UPDATE jobs SET lease_until = :until, progress = coalesce(:fraction, progress),"
                    " progress_note = CASE WHEN :fraction IS NULL THEN progress_note ELSE :note END"
                    " WHERE " + _LEASED + " RETURNING cancel_request",
                    {"until": now + lease_seconds, "id": lease.job_id, "token": lease.token,
                     "fraction": fraction, "note": note}).fetchone()
                if row is None:
                    renewal.lost.append(lease)
                elif row["cancel_request"] is not None:
                    renewal.cancel[lease.job_id] = json.loads(row["cancel_request"])
        return renewal

    def cancelled(self, lease, info=None):
        now = self.now()
        with self._write():
            row = self.db.execute("SELECT cancel_request FROM jobs WHERE " + _LEASED,
                                  {"id": lease.job_id, "token": lease.token}).fetchone()
            if row is None:
                raise LeaseLost(lease.job_id, lease.token)
            request = json.loads(row["cancel_request"]) if row["cancel_request"] else {}
            entry = dict(info or {}, ended_at=now, outcome=CANCELLED, by=request.get("by"),
                         reason=request.get("reason"))
            self.db.execute(
                "UPDATE jobs SET state = 'cancelled', finished_at = :now, lease_until = NULL, " + _CLOSE_ENTRY
                + " WHERE " + _LEASED,
                {"now": now, "entry": json.dumps(entry), "id": lease.job_id, "token": lease.token})

    # -- pause -----------------------------------------------------------------
    def pause(self, queue, by=None):
        check_queue(queue)
        request = control.cancel_request(by, None, self.now())
        with self._write():
            self.db.execute("INSERT OR IGNORE INTO paused_queues (queue, paused_by, paused_at) VALUES (?, ?, ?)",
                            (queue, request["by"], request["at"]))

    def resume(self, queue):
        check_queue(queue)
        with self._write():
            self.db.execute("DELETE FROM paused_queues WHERE queue = ?", (queue,))

    def paused(self, queues=None):
        sql, params = "SELECT queue, paused_by, paused_at FROM paused_queues", ()
        if queues is not None:
            queues = [check_queue(q) for q in queues]
            sql, params = sql + f" WHERE queue IN ({', '.join('?' * len(queues))})", queues
        with self._read():
            rows = self.db.execute(sql + " ORDER BY queue", params).fetchall()
        return {r["queue"]: {"by": r["paused_by"], "at": r["paused_at"]} for r in rows}

    def queues(self):
        with self._read():
            names = {r[0] for r in self.db.execute(DISTINCT_QUEUES)}
            names |= {r[0] for r in self.db.execute("SELECT queue FROM paused_queues")}
        return sorted(names | control.record_queues(self.supervisors()))

    # -- inside claim's transaction: lost leases, expiry, pauses ------------------
    def _reclaim_expired(self, now):
        # Through jobs_leased, a range of the expired leases only: the planner took jobs_search_state
        # (state = 'running') and read every running job's row on every claim.
        expired = self.db.execute(
            "SELECT id, attempt, max_attempts, owner, cancel_request FROM jobs INDEXED BY jobs_leased"
            " WHERE state = 'running' AND lease_until < ?", (now,)
        ).fetchall()
        for row in expired:
            error = error_info("lease_expired", message=f"lease of owner {row['owner']} expired")
            entry = {"ended_at": now, "outcome": "lease_expired", "error": error}
            exhausted = row["attempt"] >= row["max_attempts"]
            # A cancel asked of the lost attempt ends the job: it never starts again.
            state = CANCELLED if row["cancel_request"] else DEAD if exhausted else RETRYING
            self.db.execute(
                "UPDATE jobs SET state = :state, run_at = :now, lease_until = NULL, owner = NULL,"
                " error = :error, reason = :reason, finished_at = :finished,"
                " first_failure_at = coalesce(first_failure_at, :now), last_failure_at = :now, "
                + _CLOSE_ENTRY + " WHERE id = :id",
                {"state": state, "now": now, "error": json.dumps(error),
                 "reason": "lease_expired" if state == DEAD else None, "finished": None if state == RETRYING else now,
                 "entry": json.dumps(entry), "id": row["id"]},
            )

    def _claimable(self, queues, now):
        """End at most ``EXPIRE_BATCH`` due jobs of ``queues`` past their ``expires_at``; the queues
        not paused. A backlog of them costs each claim a bounded time under the write lock, like
        on Redis and PostgreSQL; the claim's lease skips the ones left for the next claims."""
        left = EXPIRE_BATCH
        for queue in queues:
            if left <= 0:
                break
            rows = self.db.execute(
                "UPDATE jobs SET state = 'expired', finished_at = :now, lease_until = NULL,"
                " history = json_insert(history, '$[#]', json_object('outcome', 'expired', 'at', :now,"
                "   'expires_at', expires_at))"
                " WHERE rowid IN (SELECT rowid FROM jobs WHERE queue = :queue AND expires_at IS NOT NULL"
                "   AND expires_at <= :now AND state IN ('queued', 'retrying') AND run_at <= :now LIMIT :left)"
                " RETURNING id, type",
                {"now": now, "queue": queue, "left": left}).fetchall()
            left -= len(rows)
            self._expired_log.extend((r["id"], r["type"]) for r in rows)
        paused = {r[0] for r in self.db.execute("SELECT queue FROM paused_queues")}
        return [q for q in queues if q not in paused]

    # -- wait ------------------------------------------------------------------
    def wait(self, job_id, timeout):
        control.check_id(job_id)
        control.check_timeout(timeout)
        fd = wakeup.watch_modifications([os.path.abspath(self.path) + "-wal"])
        settle_until = [0.0]
        try:
            def block(seconds):
                if time.monotonic() < settle_until[0]:
                    seconds = min(seconds, SETTLE_STEP)
                if fd is None:
                    select.select([], [], [], seconds)
                elif select.select([fd], [], [], seconds)[0]:
                    wakeup.drain(fd)
                    settle_until[0] = time.monotonic() + SETTLE
            return control.wait_finished(job_id, lambda: self.get(job_id), block, timeout, WAIT_FALLBACK)
        finally:
            if fd is not None:
                os.close(fd)

    # -- supervisor records --------------------------------------------------------
    def write_supervisor(self, record, ttl):
        sid, text = control.check_record(record, ttl)
        with self._write():
            now = self.now()
            self.db.execute("INSERT OR REPLACE INTO supervisors (id, record, last_heartbeat, ttl) VALUES (?, ?, ?, ?)",
                            (sid, text, now, ttl))
            self.db.execute("DELETE FROM supervisors WHERE last_heartbeat + ttl + ? < ?", (control.GONE_FOR, now))

    def supervisors(self):
        now = self.now()
        with self._read():
            rows = self.db.execute("SELECT record, last_heartbeat, ttl FROM supervisors WHERE last_heartbeat + ttl + ? >= ?"
                                   " ORDER BY id", (control.GONE_FOR, now)).fetchall()
        return [control.shown_record(r["record"], r["last_heartbeat"], r["ttl"], now) for r in rows]

    def remove_supervisor(self, supervisor_id):
        control.check_id(supervisor_id, "supervisor")
        with self._write():
            self.db.execute("DELETE FROM supervisors WHERE id = ?", (supervisor_id,))
