"""The SQL brokers' search statements: a ``JobFilter`` as WHERE clauses their indexes serve.

Shared by SQLite and PostgreSQL (``mark`` is their placeholder, ``?`` or
``%s``). The page's order is ``(queued_at, id)``, the key of every search
index, so a page is one range of one index and keyset pagination is a row
comparison. Which index serves which filter is in docs/brokers.md.
"""
from ..dependencies import ON_SUCCESS
from ..jobfilter import DUE_LATER, SCHEDULED
from .scan import ERROR_STATES

# Filters an SQL broker always serves in SQL (by an index: see the schemas).
SERVED = ("state", "queue", "type", "resource_id", "idempotency_key",
          "queued_after", "queued_before", "finished_after", "finished_before")


_RANGES = (("queued_after", "queued_at >="), ("queued_before", "queued_at <"),
           ("finished_after", "finished_at >="), ("finished_before", "finished_at <"))


def where(f, mark, now):
    """(clauses, params) of the filters in ``SERVED``; the error filter also narrows to its states.
    ``now``: (SQL, params) of the broker's clock, which ``scheduled`` compares run_at with."""
    clauses, params = [], []
    states = f.state
    if f.error is not None:
        states = tuple(s for s in (states or ERROR_STATES) if s in ERROR_STATES or s == SCHEDULED) or ("-none-",)
    if states:
        named = [s for s in states if s != SCHEDULED]
        arms = [f"state IN ({', '.join([mark] * len(named))})"] if named else []
        params += named
        if SCHEDULED in states:
            arms.append(f"(state IN {DUE_LATER!r} AND run_at > {now[0]})")
            params += now[1]
        clauses.append(arms[0] if len(arms) == 1 else f"({' OR '.join(arms)})")
    for name in ("queue", "type", "resource_id", "idempotency_key"):
        value = getattr(f, name)
        if value is not None:
            clauses.append(f"{name} = {mark}")
            params.append(value)
    for name, test in _RANGES:
        value = getattr(f, name)
        if value is not None:
            clauses.append(f"{test} {mark}")
            params.append(value)
    return clauses, params


def keyset(after, order, mark):
    """(clauses, params, ORDER BY) of the page's key range past ``after``."""
    desc = order == "newest"
    clauses, params = [], []
    if after is not None:
        clauses.append(f"(queued_at, id) {'<' if desc else '>'} ({mark}, {mark})")
        params += list(after)
    direction = "DESC" if desc else "ASC"
    return clauses, params, f"ORDER BY queued_at {direction}, id {direction}"


def candidate_columns(post):
    """What one batch of a search reads: the key, and what the row-by-row checks need (payload last)."""
    return "id, queued_at" + (", state, error" if "error" in post else "") + (", payload" if "payload" in post else "")


def select(table, columns, clauses, order_by="", limit_mark=None):
    sql = f"SELECT {columns} FROM {table}"
    if clauses:
        sql += " WHERE " + " AND ".join(clauses)
    if order_by:
        sql += " " + order_by
    if limit_mark:
        sql += f" LIMIT {limit_mark}"
    return sql


def live_parent(jobs, edge):
    """SQL: the parent of the ``job_edges`` row ``edge`` has not finished (it holds its children).

    Looked up by its id (EXISTS): "parent IN (SELECT id ... WHERE state IN ...)" was read as a
    list of every unfinished job, built anew for each id of a replay."""
    return (f"EXISTS (SELECT 1 FROM {jobs} p WHERE p.id = {edge}.parent"
            " AND p.state IN ('queued', 'running', 'retrying', 'waiting'))")


def requeue_waits(jobs, edges, mark):
    """``requeue``'s two statements for a child (``mark``: its id): how many of its parents have
    not finished now (it goes back ``waiting`` for them, not ``queued`` to run before them), and
    the one that forgets the ends its edges recorded for those parents (a replay of a parent
    leaves a child an operator cancelled as it was). A deleted parent (``parent_gone``) ended."""
    which = f"child = {mark} AND NOT parent_gone AND {live_parent(jobs, edges)}"
    return f"SELECT count(*) FROM {edges} WHERE {which}", f"UPDATE {edges} SET state = NULL, result = NULL WHERE {which}"


def failed_parent(jobs, edges, mark):
    """SQL: one row when the job ``mark`` has an ``on="success"`` parent that ended dead, cancelled
    or expired and is still stored. A requeue refuses it (``parent_failed``): run now, it would run
    without that parent ever succeeding; waiting, it would wait for a job that runs only when
    replayed or requeued, and that reopens it anyway."""
    return (f"SELECT 1 FROM {edges} e JOIN {jobs} p ON p.id = e.parent WHERE e.child = {mark}"
            f" AND e.on_ = '{ON_SUCCESS}' AND NOT e.parent_gone AND p.state IN ('dead', 'cancelled', 'expired')"
            " LIMIT 1")
