"""The PostgreSQL broker's job-control operations: cancel, renew, pause, expiry, wait, supervisor records.

A mixin of ``PostgresBroker`` (it uses its connections and statements).
Pauses live in ``<schema>.paused_queues`` and supervisor records in
``<schema>.supervisors``; the claim function (schema version 4,
``control_schema``) expires due jobs past ``expires_at`` and skips paused
queues. ``wait`` marks the job ``waited`` and LISTENs on
``tangguh_done_<schema>``, which the trigger notifies when a waited job
finishes; it re-reads the job at least every ``WAIT_FALLBACK`` seconds (a
notification is lost if the listening connection drops).
"""
import contextlib
import time

import psycopg
from psycopg.rows import dict_row

from ...dependencies import ON_SUCCESS, PARENT_FAILED
from ...errors import LeaseLost
from ...jsonvalues import info_json
from ...model import CANCELLED, EXPIRED, Job, Renewal, check_queue
from .. import control
from .deadlocks import deadlock_retried
from . import fanin
from .control_schema import done_channel
from .statements import NOT_STARTED, NOW, leased_batch

WAIT_FALLBACK = 1.0


def _distinct_queues(table):
    """The queue names of ``table``: a skip scan of the index led by ``queue`` (jobs_search_queue),
    one index probe per queue instead of reading every job."""
    return (f"WITH RECURSIVE q(queue) AS ((SELECT queue FROM {table} ORDER BY queue LIMIT 1) UNION ALL"
            f" SELECT (SELECT j.queue FROM {table} j WHERE j.queue > q.queue ORDER BY j.queue LIMIT 1)"
            " FROM q WHERE q.queue IS NOT NULL) SELECT queue FROM q WHERE queue IS NOT NULL")


class ControlMixin(control.ExpiredLog):
    # -- cancel --------------------------------------------------------------
    @deadlock_retried
    def cancel(self, job_ids, by, reason):
        job_ids = control.check_ids(job_ids)
        request = control.cancel_request(by, reason, None)
        t = self._jobs
        with self._guard("cancel"):
            db = self._conn()
            with db.transaction():
                # Locked in id order (SKIP LOCKED claimers pass them by): the answer is what was stored.
                rows = db.execute(f"SELECT id, state, kids, pending IS NOT NULL FROM {t} WHERE id = ANY(%s::text[])"
                                  " ORDER BY id FOR UPDATE", (job_ids,)).fetchall()
                states = {job_id: state for job_id, state, _, _ in rows}
                parents = {job_id for job_id, _, kids, _ in rows if kids}
                children = {job_id for job_id, _, _, child in rows if child}
                todo = [i for i in job_ids if states.get(i) in NOT_STARTED]
                # Their children next, all at once, in id order, before any of them ends (_lock_children).
                self._lock_children(db, [i for i in todo if i in parents])
                running = [i for i in job_ids if states.get(i) == "running"]
                req = f"jsonb_build_object('by', %(by)s::text, 'reason', %(reason)s::text, 'at', {NOW})"
                params = {"by": request["by"], "reason": request["reason"]}
                ending = []
                while todo:
                    # In the order given, as the other brokers: a parent's end may cancel or release
                    # children named later in the call, which are then read again. One statement up to
                    # and including the next parent followed by a job with parents (only those change);
                    # a fan-in's members, all parents of none of the others, end in one.
                    last = max((n for n, i in enumerate(todo) if i in children), default=0)
                    cut = next((n for n, i in enumerate(todo[:last]) if i in parents), len(todo) - 1) + 1
                    now, todo = todo[:cut], todo[cut:]
                    ended = [i for i in now if i in parents]
                    if ended:  # their children settled once each, after the statement (fanin.py)
                        db.execute(fanin.begin_statement())
                    db.execute(f"UPDATE {t} SET state = 'cancelled', finished_at = {NOW}, cancel_request = {req},"
                               f" history = history || jsonb_build_array({req} || '{{\"outcome\": \"cancelled\"}}'::jsonb)"
                               " WHERE id = ANY(%(ids)s::text[])", dict(params, ids=now))
                    if ended:
                        db.execute(fanin.settle_many(self._s), (ended, self.channel))
                    ending += now
                    if todo and now[-1] in parents:
                        states.update(db.execute(f"SELECT id, state FROM {t} WHERE id = ANY(%s::text[])",
                                                 (todo,)).fetchall())
                        todo = [i for i in todo if states[i] in NOT_STARTED]
                if running:  # the first request stands: a second is harmless
                    db.execute(f"UPDATE {t} SET cancel_request = coalesce(cancel_request, {req})"
                               " WHERE id = ANY(%(ids)s::text[])", dict(params, ids=running))
        out, ending = {}, set(ending)
        for job_id in job_ids:
            state = states.get(job_id)
            out[job_id] = "unknown" if state is None else CANCELLED if job_id in ending else control.answer_for(state)
        return out

    def renew(self, leases, lease_seconds, progress=None, queues=None):
        leases = list(leases)
        progress = progress or {}
        renewal = Renewal()
        if not leases:
            return renewal
        values = [control.progress_value(progress[lease.job_id]) if lease.job_id in progress else (None, None)
                  for lease in leases]
        rows = self._execute(
            leased_batch(self._jobs, "unnest(%b::text[], %b::bigint[], %b::float8[], %b::text[])"
                                     " AS b(id, token, fraction, note)",
                         f"lease_until = {NOW} + %s::float8, progress = coalesce(l.fraction, j.progress),"
                         " progress_note = CASE WHEN l.fraction IS NULL THEN j.progress_note ELSE l.note END",
                         "j.id, j.token, j.cancel_request"),
            ([lease.job_id for lease in leases], [lease.token for lease in leases], [v[0] for v in values],
             [v[1] for v in values], float(lease_seconds))).fetchall()
        current = {(job_id, token) for job_id, token, _ in rows}
        renewal.lost = [lease for lease in leases if (lease.job_id, lease.token) not in current]
        renewal.cancel = {job_id: request for job_id, _, request in rows if request is not None}
        return renewal

    def cancelled(self, lease, info=None):
        cur = self._execute(
            f"UPDATE {self._jobs} SET state = 'cancelled', finished_at = {NOW}, lease_until = NULL,"
            " history = jsonb_set(history, '{-1}', (history -> -1) || %(info)s::jsonb || jsonb_build_object("
            f"'ended_at', {NOW}, 'outcome', 'cancelled', 'by', cancel_request -> 'by',"
            " 'reason', cancel_request -> 'reason'))"
            " WHERE id = %(id)s AND token = %(token)s AND state = 'running'",
            {"info": info_json(info), "id": lease.job_id, "token": lease.token})
        if cur.rowcount == 0:
            raise LeaseLost(lease.job_id, lease.token)

    # -- pause -----------------------------------------------------------------
    def pause(self, queue, by=None):
        check_queue(queue)
        request = control.cancel_request(by, None, None)
        self._execute(f"INSERT INTO {self._s}.paused_queues (queue, paused_by, paused_at) VALUES (%s, %s, {NOW})"
                      " ON CONFLICT DO NOTHING", (queue, request["by"]))

    def resume(self, queue):
        check_queue(queue)
        self._execute(f"DELETE FROM {self._s}.paused_queues WHERE queue = %s", (queue,))

    def paused(self, queues=None):
        sql, params = f"SELECT queue, paused_by, paused_at FROM {self._s}.paused_queues", ()
        if queues is not None:
            sql, params = sql + " WHERE queue = ANY(%s::text[])", ([check_queue(q) for q in queues],)
        rows = self._execute(sql + " ORDER BY queue", params)
        return {queue: {"by": by, "at": at} for queue, by, at in rows.fetchall()}

    def queues(self):
        rows = self._execute(_distinct_queues(self._jobs) + f" UNION SELECT queue FROM {self._s}.paused_queues"
                             ).fetchall()
        return sorted({r[0] for r in rows} | control.record_queues(self.supervisors()))

    # -- expiry (what claim returned) ----------------------------------------------
    def _record_tick(self, db, schedule, key):
        """``enqueue_once(job, schedule=...)``'s record, in its transaction: only forward ("C": code
        point order whatever the database's collation); prune leaves it."""
        if schedule is not None:
            db.execute(f"INSERT INTO {self._s}.schedule_ticks AS t (name, key) VALUES (%s, %s) ON CONFLICT (name)"
                       ' DO UPDATE SET key = excluded.key WHERE excluded.key COLLATE "C" > t.key COLLATE "C"',
                       (schedule, key))

    def last_tick_key(self, schedule):
        """(Not job control: the scheduler's look-back, here for the size of ``__init__``.) One
        primary-key lookup by the schedule's exact name."""
        row = self._execute(f"SELECT key FROM {self._s}.schedule_ticks WHERE name = %s", (schedule,)).fetchone()
        return None if row is None else row[0]

    def _leasable(self, rows):
        """The claim function's rows as jobs, minus the ones it ended ``expired`` (recorded here)."""
        jobs = []
        for row in rows:
            job = Job.from_dict(row)
            if job.state == EXPIRED:
                self._expired_log.append((job.id, job.type))
            else:
                jobs.append(job)
        return jobs

    def _prune_ended(self, cutoff, batch, budget=None):
        """Delete cancelled and expired jobs finished before ``cutoff``, ``batch`` rows per statement
        (until ``budget`` went, if given)."""
        # A workflow child cancelled by an on="success" parent that lies dead stays: replaying that
        # parent reopens it, and so on down the tree (README "Workflows"); so does one whose parent is
        # itself cancelled parent_failed (the subtree under a dead job, one look per child, no walk).
        # Read through its own edges (job_edges_child). coalesce: a job cancelled by an operator (no
        # reason) made the test NULL, and NOT NULL kept it for as long as its parent lay dead.
        sql = (f"DELETE FROM {self._jobs} WHERE id IN (SELECT id FROM {self._jobs} j"
               " WHERE state IN ('cancelled', 'expired') AND finished_at < %s"
               f" AND NOT (coalesce(j.reason, '') = '{PARENT_FAILED}' AND j.pending IS NOT NULL AND EXISTS ("
               f"SELECT 1 FROM {self._s}.job_edges e JOIN {self._jobs} p ON p.id = e.parent WHERE e.child = j.id"
               f" AND e.on_ = '{ON_SUCCESS}' AND NOT e.parent_gone AND (p.state = 'dead'"
               f" OR (p.state = 'cancelled' AND p.reason = '{PARENT_FAILED}')))) LIMIT %s)")
        total = 0
        while budget is None or total < budget:
            deleted = self._execute(sql, (cutoff, batch)).rowcount
            total += deleted
            if deleted < batch:
                break
        return total

    def _unpaused(self, db, queues):
        paused = {r[0] for r in db.execute(f"SELECT queue FROM {self._s}.paused_queues WHERE queue = ANY(%s)",
                                           (list(queues),)).fetchall()}
        return [q for q in queues if q not in paused]

    # -- wait ------------------------------------------------------------------
    def wait(self, job_id, timeout):
        control.check_id(job_id)
        control.check_timeout(timeout)
        with self._guard("wait"):
            listener = self._connections.take_waiter(done_channel(self.schema))
        kept = False
        try:
            # Listening first, then marked: a finish after the mark is always notified.
            self._execute(f"UPDATE {self._jobs} SET waited = true WHERE id = %s AND NOT waited", (job_id,))

            def block(seconds):
                try:
                    for note in listener.notifies(timeout=seconds):
                        if note.payload == job_id:
                            return
                except psycopg.Error:
                    # The listening connection broke (a server restart, an idle reaper): the fallback
                    # re-read carries on at its pace, not in a loop of queries as fast as they return.
                    time.sleep(seconds)
            job = control.wait_finished(job_id, lambda: self.get(job_id), block, timeout, WAIT_FALLBACK)
            kept = self._connections.keep_waiter(listener)
            return job
        finally:
            if not kept:
                with contextlib.suppress(psycopg.Error):
                    listener.close()

    def interrupt(self):
        self._connections.cancel()

    def _stats_rows(self, query, params, within):
        """``stats``' rows (here for the size of ``__init__``); past ``within`` seconds the server
        cancels the counts (BrokerError)."""
        if within is None:
            return self._execute(query, params).fetchall()
        # The server cancels the counts past ``within``: only a frozen one is silent longer than that.
        patience = within + self._connections.socket_timeout
        with self._guard("stats"), self._connections.patient(patience) as db, db.transaction():
            db.execute("SELECT set_config('statement_timeout', %s, true)", (str(max(1, int(within * 1000))),))
            return db.execute(query, params).fetchall()

    # -- supervisor records --------------------------------------------------------
    def write_supervisor(self, record, ttl):
        sid, text = control.check_record(record, ttl)
        table = f"{self._s}.supervisors"
        self._execute(
            f"WITH gone AS (DELETE FROM {table} WHERE last_heartbeat + ttl + %s < {NOW})"
            f" INSERT INTO {table} (id, record, last_heartbeat, ttl) VALUES (%s, %s::jsonb, {NOW}, %s)"
            " ON CONFLICT (id) DO UPDATE SET record = excluded.record, last_heartbeat = excluded.last_heartbeat,"
            " ttl = excluded.ttl", (control.GONE_FOR, sid, text, float(ttl)))

    def supervisors(self):
        rows = self._execute(f"SELECT record, last_heartbeat, ttl, {NOW} AS now FROM {self._s}.supervisors"
                             f" WHERE last_heartbeat + ttl + %s >= {NOW} ORDER BY id",
                             (control.GONE_FOR,), row_factory=dict_row).fetchall()
        return [control.shown_record(r["record"], r["last_heartbeat"], r["ttl"], r["now"]) for r in rows]

    def remove_supervisor(self, supervisor_id):
        control.check_id(supervisor_id, "supervisor")
        self._execute(f"DELETE FROM {self._s}.supervisors WHERE id = %s", (supervisor_id,))
