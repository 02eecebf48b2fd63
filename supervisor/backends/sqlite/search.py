"""The SQLite broker's search, count and bulk actions (a mixin ``SQLiteBroker`` inherits).

Every filter but two is served by an index of ``schema.SEARCH_INDEXES``, each
ending in the page's key ``(queued_at, id)``, so the first page is one index
range however many jobs the file holds. The two others:

* payload fields: SQLite cannot index an arbitrary JSON key (an expression
  index needs the key when the schema is made, and a generated column per
  key would be a migration per query). They are checked row by row in the
  index order of the other filters, on at most ``scan.SCAN_BOUND`` rows per
  call: narrow by type or queue first on a large file;
* error text (a substring: no B-tree serves it) is checked the same way
  among dead and retrying jobs, which ``jobs_search_state`` selects.

``count`` is exact up to ``exact_up_to``; past it, the number of index
entries (counted on the index alone, never the table) times the share of
checked rows that passed the row-by-row filters, marked ``exact=False``.
"""
import json
import sqlite3

from ...dependencies import parents_first
from .. import control, scan, sqlsearch
from . import rows as rows_module
from .database import errors

_REQUEUE_FROM = ("dead", "cancelled", "expired")
# Columns of later schema versions a requeue clears when the file has them.
_CLEARED_IF_PRESENT = ("cancel_request", "expires_at", "progress", "progress_note")


_INT64 = 2**63 - 1


def payload_check(pairs):
    """(SQL, params) of a column that is 1 when every payload pair matches, with JSON's types kept
    apart (true is not 1, "7" is not 7), or None where SQLite cannot compare a value (a huge int).

    Computed by SQLite's JSON functions row by row, so the payload is never sent to Python.
    """
    parts, params = [], []
    for key, value in pairs:
        path = "$." + ".".join(f'"{part}"' for part in key.split("."))
        if value is None:
            parts.append("json_type(payload, ?) = 'null'")
            params.append(path)
        elif isinstance(value, bool):
            parts.append("json_type(payload, ?) = ?")
            params += [path, "true" if value else "false"]
        elif isinstance(value, (int, float)):
            if isinstance(value, int) and abs(value) > _INT64:
                return None
            parts.append("(json_type(payload, ?) IN ('integer', 'real') AND json_extract(payload, ?) = ?)")
            params += [path, path, value]
        else:
            parts.append("(json_type(payload, ?) = 'text' AND json_extract(payload, ?) = ?)")
            params += [path, path, value]
    # A payload stored behind the API's back may not be JSON: it matches nothing (json_type would raise).
    return f"CASE WHEN json_valid(payload) THEN ({' AND '.join(parts)}) ELSE 0 END AS payload_ok", params


class SearchMixin:
    def _where(self, f, after, order):
        clauses, params = sqlsearch.where(f, "?", ("?", [self.now()]))
        more, more_params, order_by = sqlsearch.keyset(after, order, "?")
        return clauses + more, params + more_params, order_by

    def _page_sql(self, f, after, order, columns, n):
        """(SQL, params) of one batch of a search: what the plan tests EXPLAIN."""
        clauses, params, order_by = self._where(f, after, order)
        check = payload_check(f.payload) if f.payload and columns.endswith(", payload") else None
        if check is not None:
            columns = columns[:-len("payload")] + check[0]
            params = check[1] + params
        table = "jobs"
        if (f.finished_after is not None or f.finished_before is not None) and not any(
                (f.state, f.queue, f.type, f.resource_id, f.idempotency_key)):
            # A finished range is usually narrow ("the last hour"): SQLite, without range
            # statistics, would rather walk jobs_search_queued for its order and filter.
            table = "jobs INDEXED BY jobs_search_finished"
        return sqlsearch.select(table, columns, clauses, order_by, "?"), (*params, n)

    def _fetcher(self, f, order, columns):
        def fetch(after, n):
            sql, params = self._page_sql(f, after, order, columns, n)
            with errors(self.path):
                return [dict(r) for r in self.db.execute(sql, params).fetchall()]
        return fetch

    def _load(self, ids):
        if not ids:
            return []
        with errors(self.path):
            rows = self.db.execute(f"SELECT * FROM jobs WHERE id IN ({','.join('?' * len(ids))})", ids).fetchall()
        by_id = {r["id"]: rows_module.job(r) for r in rows}
        return [by_id[i] for i in ids if i in by_id]

    def search(self, filter, cursor=None, limit=50, order="newest"):
        f, after = scan.start(filter, cursor, limit, order)
        post = scan.post_names(f, sqlsearch.SERVED)
        with self._read():
            fetch = self._fetcher(f, order, sqlsearch.candidate_columns(post))
            return scan.search_jobs(fetch, self._load, f, after, limit, order, post)

    def count(self, filter, exact_up_to=10_000):
        f, _ = scan.start(filter, None, 1, "newest")
        post = scan.post_names(f, sqlsearch.SERVED)
        clauses, params = sqlsearch.where(f, "?", ("?", [self.now()]))

        def indexed_count(cap=None):
            inner = sqlsearch.select("jobs", "1", clauses, "", "?" if cap is not None else None)
            args = (*params, cap) if cap is not None else tuple(params)
            with errors(self.path):
                return self.db.execute(f"SELECT count(*) FROM ({inner})", args).fetchone()[0]

        with self._read():
            return scan.count_jobs(self._fetcher(f, "newest", sqlsearch.candidate_columns(post)), indexed_count,
                                   lambda: indexed_count(None), f, exact_up_to, post)

    def requeue(self, job_ids):
        given = control.check_ids(job_ids, most=None)
        out = {}
        now = self.now()
        with self._write():
            present = {row["name"] for row in self.db.execute("PRAGMA table_info(jobs)")}
            cleared = [c for c in _CLEARED_IF_PRESENT if c in present]
            # As in a dlq replay: each job the call puts back holds its key before any child
            # reopens, whatever the order of the ids (a parent first let its child take the key).
            held = self._hold_keys(self._key_holders(given), given) if "pending" in present else None
            for job_id in self._parents_first(given, present):
                row = self.db.execute("SELECT state FROM jobs WHERE id = ?", (job_id,)).fetchone()
                if row is None:
                    out[job_id] = "unknown"
                elif row["state"] == "done":
                    out[job_id] = "done"
                elif row["state"] not in _REQUEUE_FROM:
                    out[job_id] = "not_finished"
                elif "pending" in present and self.db.execute(
                        sqlsearch.failed_parent("jobs", "job_edges", "?"), (job_id,)).fetchone():
                    out[job_id] = "parent_failed"
                else:
                    try:
                        out[job_id] = self._put_back(job_id, now, present, cleared)
                    except sqlite3.IntegrityError:  # its idempotency key is held by an unfinished job
                        out[job_id] = "conflict"
            if held is not None:
                self._release_keys(held)
        return {job_id: out[job_id] for job_id in given}

    def _key_holders(self, job_ids):
        """Those of ``job_ids`` with a key that the requeue puts back (or that end unfinished
        some other way, reopened by a parent of the call): finished, no failed parent."""
        failed = sqlsearch.failed_parent("jobs", "job_edges", "r.id")
        return [row[0] for row in self.db.execute(
            "SELECT r.id FROM jobs r WHERE r.id IN (SELECT value FROM json_each(?)) AND r.idempotency_key IS NOT NULL"
            f" AND r.state IN {_REQUEUE_FROM} AND NOT EXISTS ({failed})", (json.dumps(job_ids),))]

    def _parents_first(self, job_ids, present):
        """``job_ids`` with a parent named with its child first, so that the child, put back after
        it, sees it unfinished and waits for it (``dependencies.parents_first``)."""
        if "pending" not in present or len(job_ids) < 2:
            return job_ids
        # By the child's index alone: with the parents' list too, SQLite probed every (parent, child)
        # pair of the two lists, a replay of 240 ids 57,600 probes. parents_first drops the others.
        edges = self.db.execute("SELECT parent, child FROM job_edges WHERE NOT parent_gone"
                                " AND child IN (SELECT value FROM json_each(?))", (json.dumps(job_ids),)).fetchall()
        return parents_first(job_ids, [tuple(edge) for edge in edges])

    def _put_back(self, job_id, now, present, cleared):
        """A finished job back (requeue, replay): ``queued``, attempt 0, or ``waiting`` for its
        parents not finished now, their ends recorded on its edges forgotten
        (``sqlsearch.requeue_waits``). Returns the state; IntegrityError when an unfinished job
        holds its idempotency key."""
        waits, forget = sqlsearch.requeue_waits("jobs", "job_edges", "?")
        pending = self.db.execute(waits, (job_id,)).fetchone()[0] if "pending" in present else 0
        state = "waiting" if pending else "queued"
        self.db.execute(
            "UPDATE jobs SET state = ?, pending = CASE WHEN pending IS NULL THEN NULL ELSE ? END, attempt = 0,"
            " run_at = ?, reason = NULL, finished_at = NULL, lease_until = NULL, owner = NULL"
            f"{''.join(f', {c} = NULL' for c in cleared)} WHERE id = ?", (state, pending, now, job_id))
        if pending:
            self.db.execute(forget, (job_id,))
        return state

    def discard(self, job_ids):
        job_ids = control.check_ids(job_ids, most=None)
        out = {}
        with self._write():
            for job_id in job_ids:
                row = self.db.execute("SELECT state FROM jobs WHERE id = ?", (job_id,)).fetchone()
                if row is None:
                    out[job_id] = "unknown"
                elif row["state"] == "running":
                    out[job_id] = "running"
                else:
                    self.db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))
                    out[job_id] = "discarded"
        return out
