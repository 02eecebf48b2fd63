"""The PostgreSQL broker's search, count and bulk actions (a mixin ``PostgresBroker`` inherits).

Every filter is served by an index of schema version 3: a B-tree per column
ending in the page's key ``(queued_at, id)``, and for payload fields a GIN
index (``jsonb_path_ops``) on ``payload::jsonb`` that serves containment:
``payload.customer.id = 7`` becomes ``payload::jsonb @> '{"customer":{"id":7}}'``.
Error text (a substring) is checked row by row among dead and retrying jobs
(``jobs_search_state``), on at most ``scan.SCAN_BOUND`` rows per call.

A search by payload fields does not leave the plan to the planner. Asked for
the newest matches, it would walk ``jobs_search_queued`` and filter whenever
it expects a match every few hundred rows, which it does on an unanalyzed
table (a default estimate) and for a value many jobs carried long ago and
none lately (statistics are not per period): 2 s at 1,000,000 jobs. So a
page is fetched in two ways:

* first every match past the page's key, from the GIN index alone (a
  MATERIALIZED CTE with no order, run with sequential and plain index scans
  priced out, so a bitmap scan is the only way in; an OFFSET 0 fence keeps
  the page's key a check on the rows it selected), at most ``GIN_BOUND`` of them, sorted by the key. While
  fewer match, that is the exact answer: one posting list and at most
  ``GIN_BOUND`` heap rows, a few ms for a hundred matches among 1,000,000;
* when ``GIN_BOUND`` match past the key (a common value: sorting them all
  would read them all), the rest of the call walks the key's order as before
  with the payload compared per row in SQL (``payload_ok``) and counted by
  ``scan`` against ``SCAN_BOUND``: the page may come back short, with a
  cursor, like SQLite's. That costs the probe (the posting list of a value
  every job has is ~50 ms at 1,000,000 jobs, and ``GIN_BOUND`` heap rows)
  plus at most ``SCAN_BOUND`` rows; with matches that dense a page is
  usually full long before.

Each call decides anew, so a later page whose older matches are few goes
back to the index.

``count`` is exact up to ``exact_up_to``; past it, the planner's row estimate
(``EXPLAIN``: nothing is scanned), marked ``exact=False``. Its count has no
order to walk: the planner picks the GIN index or a scan that stops at the
cap by itself.
"""
import json

from psycopg import errors as pgerrors
from psycopg.rows import dict_row

from ...dependencies import parents_first
from ...model import Job
from .. import control, scan, sqlsearch
from . import replaykeys
from .deadlocks import deadlock_retried, deadlock_retried_step
from .statements import NOT_STARTED, NOW

SERVED = sqlsearch.SERVED + ("payload",)
GIN_BOUND = scan.SCAN_BOUND  # matches past a page's key a payload search sorts itself
# The plan of the GIN probe: a bitmap scan, or nothing (cheaper to say than to hope for).
_BITMAP_ONLY = ("SELECT set_config('enable_seqscan', 'off', true), set_config('enable_indexscan', 'off', true),"
                " set_config('enable_indexonlyscan', 'off', true)")
_REQUEUE_FROM = ["dead", "cancelled", "expired"]
_CLEARED_IF_PRESENT = ("cancel_request", "expires_at", "progress", "progress_note")


def containment(pairs):
    """``(("a.b", 7), ("c", "x"))`` -> ``{"a": {"b": 7}, "c": "x"}`` (what ``@>`` compares with).

    None when two keys conflict (``a`` equal to a value and ``a.b`` to another: ``a`` cannot be
    both, so no payload matches, as on the other brokers). Merged, the later key overwrote the
    earlier one's value and the filter matched jobs it excludes; None dumps to JSON ``null``,
    which no payload (an object) contains.
    """
    doc = {}
    for key, value in pairs:
        node = doc
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                return None  # an earlier key set a value here
            node = child
        if isinstance(node.get(parts[-1]), dict):
            return None  # an earlier key went through here
        node[parts[-1]] = value
    return doc


class SearchMixin:
    def _search_where(self, f):
        clauses, params = sqlsearch.where(f, "%s", (NOW, []))
        if f.payload:
            clauses.append("(payload::jsonb) @> %s::jsonb")
            params.append(json.dumps(containment(f.payload)))
        return clauses, params

    def _page_sql(self, f, after, order, columns, n):
        """(SQL, params) of one batch of a search: what the plan tests EXPLAIN.

        With payload fields, the GIN probe: every match past ``after`` (at most
        ``GIN_BOUND``, taken in no order) sorted here; ``matched`` says how many.
        With an idempotency key, that key's jobs, sorted.
        """
        clauses, params = self._search_where(f)
        more, more_params, order_by = sqlsearch.keyset(after, order, "%s")
        if f.idempotency_key is not None and not f.payload:
            # A key selects a few jobs (one unfinished at most): read them from its index and sort them.
            # Without statistics (a table just loaded, not analyzed yet) the planner guesses hundreds of
            # matches and walks jobs_search_queued for the first: 0.4 s at 1,000,000 jobs. OFFSET 0 leaves
            # it nothing to walk; the page's key is checked on the rows the key selected.
            inner = sqlsearch.select(self._jobs, columns, clauses, "", "")
            return (f"SELECT * FROM ({inner} OFFSET 0) k WHERE {' AND '.join(more) or 'true'} {order_by} LIMIT %s",
                    (*params, *more_params, n))
        if not f.payload:
            return sqlsearch.select(self._jobs, columns, clauses + more, order_by, "%s"), (*params, *more_params, n)
        # OFFSET 0 keeps the key out of the index choice: its estimate is off by every job sharing
        # the cursor's queued_at (one enqueue_many), and a wrong guess would trade the posting list
        # for a range of jobs_search_queued. The key is checked on the rows the filters selected.
        inner = sqlsearch.select(self._jobs, columns.removesuffix(", payload"), clauses, "", "")
        key = " AND ".join(more) or "true"
        return (f"WITH m AS MATERIALIZED (SELECT * FROM ({inner} OFFSET 0) g WHERE {key} LIMIT %s)"
                f" SELECT *, true AS payload_ok, (SELECT count(*) FROM m) AS matched FROM m {order_by} LIMIT %s",
                (*params, *more_params, GIN_BOUND, n))

    def _walk_sql(self, f, after, order, columns, n):
        """(SQL, params) of a batch of the walk in the key's order, the payload compared per row."""
        clauses, params = sqlsearch.where(f, "%s", (NOW, []))
        more, more_params, order_by = sqlsearch.keyset(after, order, "%s")
        columns = columns.removesuffix(", payload") + ", (payload::jsonb) @> %s::jsonb AS payload_ok"
        return (sqlsearch.select(self._jobs, columns, clauses + more, order_by, "%s"),
                (json.dumps(containment(f.payload)), *params, *more_params, n))

    def _probe(self, sql, params):
        """Rows of a GIN probe, planned with the bitmap scan as the only way in (for this statement)."""
        with self._guard("search"):
            db = self._conn()
            with db.transaction():
                db.execute(_BITMAP_ONLY)
                return db.cursor(row_factory=dict_row).execute(sql, params).fetchall()

    def _explain_page(self, f, after, order, columns, n):
        """The plan of a search's first statement, as the broker runs it (the plan tests read it)."""
        sql, params = self._page_sql(f, after, order, columns, n)
        rows = self._probe("EXPLAIN " + sql, params) if f.payload else self._execute("EXPLAIN " + sql, params,
                                                                                    row_factory=dict_row)
        return "\n".join(r["QUERY PLAN"] for r in rows)

    def _fetcher(self, f, order, columns):
        if f.payload:
            return self._payload_fetcher(f, order, columns)

        def fetch(after, n):
            sql, params = self._page_sql(f, after, order, columns, n)
            return self._execute(sql, params, row_factory=dict_row).fetchall()
        return fetch

    def _payload_fetcher(self, f, order, columns):
        """``fetch`` for payload filters: the GIN probe while fewer than ``GIN_BOUND`` match past the
        key, else (for the rest of this call) the walk. ``payload`` must be among ``scan``'s post
        filters: the walk's rows are candidates, each with its ``payload_ok``."""
        walking = False

        def fetch(after, n):
            nonlocal walking
            if not walking:
                rows = self._probe(*self._page_sql(f, after, order, columns, n))
                if not rows or rows[0]["matched"] < GIN_BOUND:
                    return rows
                walking = True
            sql, params = self._walk_sql(f, after, order, columns, n)
            return self._execute(sql, params, row_factory=dict_row).fetchall()
        return fetch

    def _load(self, ids):
        if not ids:
            return []
        rows = self._execute(f"SELECT * FROM {self._jobs} WHERE id = ANY(%s::text[])", (list(ids),),
                             row_factory=dict_row).fetchall()
        by_id = {r["id"]: Job.from_dict(r) for r in rows}
        return [by_id[i] for i in ids if i in by_id]

    def search(self, filter, cursor=None, limit=50, order="newest"):
        f, after = scan.start(filter, cursor, limit, order)
        # payload: compared in SQL either way, but the walk's rows are candidates (see _payload_fetcher)
        post = scan.post_names(f, sqlsearch.SERVED)
        columns = sqlsearch.candidate_columns(post)
        return scan.search_jobs(self._fetcher(f, order, columns), self._load, f, after, limit, order, post)

    def count(self, filter, exact_up_to=10_000):
        f, _ = scan.start(filter, None, 1, "newest")
        post = scan.post_names(f, SERVED)
        clauses, params = self._search_where(f)

        def indexed_count(cap):
            inner = sqlsearch.select(self._jobs, "1", clauses, "", "%s")
            return self._execute(f"SELECT count(*) FROM ({inner}) c", (*params, cap)).fetchone()[0]

        def estimate():
            sql = "EXPLAIN (FORMAT JSON) " + sqlsearch.select(self._jobs, "1", clauses)
            plan = self._execute(sql, params).fetchone()[0]
            plan = json.loads(plan) if isinstance(plan, str) else plan
            return plan[0]["Plan"]["Plan Rows"]

        # fetch serves only the error filter's row-by-row count (scan); payload fields alone are
        # indexed_count's. Next to an error filter they are compared as a search does.
        post = post + ["payload"] if post and f.payload else post
        fetch = self._fetcher(f, "newest", sqlsearch.candidate_columns(post))
        return scan.count_jobs(fetch, indexed_count, estimate, f, exact_up_to, post)

    def _columns(self, db):
        if getattr(self, "_job_columns", None) is None:
            self._job_columns = {r[0] for r in db.execute(
                "SELECT column_name FROM information_schema.columns WHERE table_schema = %s AND table_name = 'jobs'",
                (self.schema,))}
        return self._job_columns

    def requeue(self, job_ids):
        given = control.check_ids(job_ids, most=None)
        with self._guard("requeue"):
            db = self._conn()
            cleared = [c for c in _CLEARED_IF_PRESENT if c in self._columns(db)]
            # As in a dlq replay: each job the call puts back holds its key before any child
            # reopens, whatever the order of the ids (a parent first let its child take the key).
            failed = sqlsearch.failed_parent(self._jobs, f"{self._s}.job_edges", "r.id")
            holds = ({"holders": replaykeys.key_holders(db, self._s, given, failed), "call": given, "held": set()}
                     if "pending" in self._columns(db) else None)
            # A job a transaction: a deadlock's victim is that job's alone, run again alone.
            out = {job_id: deadlock_retried_step("requeue", lambda: self._requeue_one(db, job_id, cleared, holds))
                   for job_id in self._parents_first(db, given)}
            if holds and holds["held"]:
                with db.transaction():
                    replaykeys.name_holders(db, self._s, holds["held"])
        return {job_id: out[job_id] for job_id in given}

    def _requeue_one(self, db, job_id, cleared, holds=None):
        try:
            with db.transaction():
                row = db.execute(f"SELECT state FROM {self._jobs} WHERE id = %s FOR UPDATE", (job_id,)).fetchone()
                if row is None:
                    return "unknown"
                if row[0] == "done":
                    return "done"
                if row[0] not in _REQUEUE_FROM:
                    return "not_finished"
                if "pending" in self._columns(db) and db.execute(
                        sqlsearch.failed_parent(self._jobs, f"{self._s}.job_edges", "%s"), (job_id,)).fetchone():
                    return "parent_failed"
                if not holds or not holds["holders"]:
                    return self._put_back(db, job_id, cleared)
                # Held a transaction at a time: no other call meets the holds' edges.
                holds["held"].update(replaykeys.hold(db, self._s, holds["holders"], holds["call"]))
                state = self._put_back(db, job_id, cleared)
                replaykeys.release(db, self._s, [])
                return state
        except pgerrors.UniqueViolation:  # its idempotency key is held by an unfinished job
            return "conflict"

    def _parents_first(self, db, job_ids):
        """``job_ids`` with a parent named with its child first, so that the child, put back after
        it, sees it unfinished and waits for it (``dependencies.parents_first``)."""
        if "pending" not in self._columns(db) or len(job_ids) < 2:
            return job_ids
        return parents_first(job_ids, db.execute(f"SELECT parent, child FROM {self._s}.job_edges"
                                                 " WHERE NOT parent_gone AND child = ANY(%s::text[])",
                                                 (job_ids,)).fetchall())

    def _put_back(self, db, job_id, cleared):
        """A finished job back (requeue, replay): ``queued``, attempt 0, or ``waiting`` for its
        parents not finished now, their ends recorded on its edges forgotten
        (``sqlsearch.requeue_waits``). Returns the state; UniqueViolation when an unfinished job
        holds its idempotency key."""
        waits, forget = sqlsearch.requeue_waits(self._jobs, f"{self._s}.job_edges", "%s")
        pending = db.execute(waits, (job_id,)).fetchone()[0] if "pending" in self._columns(db) else 0
        state = "waiting" if pending else "queued"
        db.execute(f"UPDATE {self._jobs} SET state = %s, pending = CASE WHEN pending IS NULL THEN NULL ELSE %s END,"
                   f" attempt = 0, run_at = {NOW}, reason = NULL, finished_at = NULL, lease_until = NULL,"
                   f" owner = NULL{''.join(f', {c} = NULL' for c in cleared)} WHERE id = %s"
                   f"{'' if pending else ' RETURNING pg_notify(%s, queue)'}",
                   (state, pending, job_id) if pending else (state, pending, job_id, self.channel))
        if pending:
            db.execute(forget, (job_id,))
        return state

    def _put_back_children(self, db, children, cleared):
        """``_put_back`` for many workflow children (a replay), a statement or two a level: the
        children none of whose parents among them is still to go, then the next ones. One at a
        time, a replay of 10,000 children took 11 times as long as before the children waited."""
        edges = db.execute(f"SELECT parent, child FROM {self._s}.job_edges WHERE NOT parent_gone"
                           " AND child = ANY(%s::text[])", (children,)).fetchall()
        waits = {child: set() for child in children}
        for parent, child in edges:
            if parent in waits and parent != child:
                waits[child].add(parent)
        while waits:
            level = [child for child, parents in waits.items() if not parents & waits.keys()] or list(waits)
            self._put_back_level(db, level, cleared)
            for child in level:
                del waits[child]

    def _put_back_level(self, db, level, cleared):
        live = sqlsearch.live_parent(self._jobs, "e")
        db.execute(
            f"WITH w AS (SELECT c.id, (SELECT count(*) FROM {self._s}.job_edges e WHERE e.child = c.id"
            f" AND NOT e.parent_gone AND {live}) AS n FROM unnest(%s::text[]) AS c(id))"
            f" UPDATE {self._jobs} j SET state = CASE WHEN w.n > 0 THEN 'waiting' ELSE 'queued' END,"
            " pending = CASE WHEN j.pending IS NULL THEN NULL ELSE w.n END, attempt = 0,"
            f" run_at = {NOW}, reason = NULL, finished_at = NULL, lease_until = NULL, owner = NULL"
            f"{''.join(f', {c} = NULL' for c in cleared)} FROM w WHERE j.id = w.id"
            " RETURNING CASE WHEN w.n = 0 THEN pg_notify(%s, j.queue) END", (level, self.channel))
        db.execute(f"UPDATE {self._s}.job_edges e SET state = NULL, result = NULL"
                   f" WHERE e.child = ANY(%s::text[]) AND NOT e.parent_gone AND {live}", (level,))

    @deadlock_retried
    def discard(self, job_ids):
        job_ids = control.check_ids(job_ids, most=None)
        with self._guard("discard"):
            db = self._conn()
            with db.transaction():
                rows = db.execute(f"SELECT id, state, kids FROM {self._jobs} WHERE id = ANY(%s::text[])"
                                  " ORDER BY id FOR UPDATE", (job_ids,)).fetchall()
                states = {job_id: state for job_id, state, _ in rows}
                gone = [i for i in job_ids if states.get(i) not in (None, "running")]
                # An unfinished parent deleted ends for its children (flow_forget): all of them locked
                # first, at once, in id order (_lock_children).
                self._lock_children(db, [i for i, state, kids in rows if kids and state in NOT_STARTED])
                db.execute(f"DELETE FROM {self._jobs} WHERE id = ANY(%s::text[])", (gone,))
        return {i: "unknown" if i not in states else "running" if states[i] == "running" else "discarded"
                for i in job_ids}
