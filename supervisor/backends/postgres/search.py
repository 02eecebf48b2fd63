"""The PostgreSQL broker's search, count and bulk actions (a mixin ``PostgresBroker`` inherits).

Every filter is served by an index of schema version 3: a B-tree per column
ending in the page's key ``(queued_at, id)``, and for payload fields a GIN
index (``jsonb_path_ops``) on ``payload::jsonb`` that serves containment:
``payload.customer.id = 7`` becomes ``payload::jsonb @> '{"customer":{"id":7}}'``.
Error text (a substring) is checked row by row among dead and retrying jobs
(``jobs_search_state``), on at most ``scan.SCAN_BOUND`` rows per call.

``count`` is exact up to ``exact_up_to``; past it, the planner's row estimate
(``EXPLAIN``: nothing is scanned), marked ``exact=False``.
"""
import json

from psycopg import errors as pgerrors
from psycopg.rows import dict_row

from ...model import Job
from .. import scan, sqlsearch
from .statements import NOW

SERVED = sqlsearch.SERVED + ("payload",)
_REQUEUE_FROM = ["dead", "cancelled", "expired"]
_CLEARED_IF_PRESENT = ("cancel_request", "expires_at", "progress", "progress_note")


def containment(pairs):
    """``(("a.b", 7), ("c", "x"))`` -> ``{"a": {"b": 7}, "c": "x"}`` (what ``@>`` compares with)."""
    doc = {}
    for key, value in pairs:
        node = doc
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = node[part] = {}
            node = child
        node[parts[-1]] = value
    return doc


class SearchMixin:
    def _search_where(self, f):
        clauses, params = sqlsearch.where(f, "%s")
        if f.payload:
            clauses.append("(payload::jsonb) @> %s::jsonb")
            params.append(json.dumps(containment(f.payload)))
        return clauses, params

    def _page_sql(self, f, after, order, columns, n):
        """(SQL, params) of one batch of a search: what the plan tests EXPLAIN."""
        clauses, params = self._search_where(f)
        more, more_params, order_by = sqlsearch.keyset(after, order, "%s")
        return sqlsearch.select(self._jobs, columns, clauses + more, order_by, "%s"), (*params, *more_params, n)

    def _fetcher(self, f, order, columns):
        def fetch(after, n):
            sql, params = self._page_sql(f, after, order, columns, n)
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
        post = scan.post_names(f, SERVED)
        columns = sqlsearch.CANDIDATE if post else "id, queued_at"
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

        return scan.count_jobs(self._fetcher(f, "newest", sqlsearch.CANDIDATE), indexed_count, estimate, f,
                               exact_up_to, post)

    def _columns(self, db):
        if getattr(self, "_job_columns", None) is None:
            self._job_columns = {r[0] for r in db.execute(
                "SELECT column_name FROM information_schema.columns WHERE table_schema = %s AND table_name = 'jobs'",
                (self.schema,))}
        return self._job_columns

    def requeue(self, job_ids):
        job_ids = list(job_ids)
        out = {}
        with self._guard("requeue"):
            db = self._conn()
            cleared = "".join(f", {c} = NULL" for c in _CLEARED_IF_PRESENT if c in self._columns(db))
            for job_id in job_ids:
                try:
                    with db.transaction():
                        row = db.execute(f"SELECT state FROM {self._jobs} WHERE id = %s FOR UPDATE",
                                         (job_id,)).fetchone()
                        if row is None:
                            out[job_id] = "unknown"
                        elif row[0] == "done":
                            out[job_id] = "done"
                        elif row[0] not in _REQUEUE_FROM:
                            out[job_id] = "not_finished"
                        else:
                            db.execute(
                                f"UPDATE {self._jobs} SET state = 'queued', attempt = 0, run_at = {NOW},"
                                " reason = NULL, finished_at = NULL, lease_until = NULL, owner = NULL"
                                f"{cleared} WHERE id = %s RETURNING pg_notify(%s, queue)", (job_id, self.channel))
                            out[job_id] = "queued"
                except pgerrors.UniqueViolation:  # its idempotency key is held by an unfinished job
                    out[job_id] = "conflict"
        return out

    def discard(self, job_ids):
        job_ids = list(job_ids)
        with self._guard("discard"):
            db = self._conn()
            with db.transaction():
                states = dict(db.execute(f"SELECT id, state FROM {self._jobs} WHERE id = ANY(%s::text[])"
                                         " ORDER BY id FOR UPDATE", (job_ids,)).fetchall())
                gone = [i for i in job_ids if states.get(i) not in (None, "running")]
                db.execute(f"DELETE FROM {self._jobs} WHERE id = ANY(%s::text[])", (gone,))
        return {i: "unknown" if i not in states else "running" if states[i] == "running" else "discarded"
                for i in job_ids}
