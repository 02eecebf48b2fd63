"""SQLite rows of the jobs table into ``Job`` objects.

A claim turns every leased row into a ``Job`` in the master: by position, from a plan made
once per SELECT layout, not through ``dict(row)`` (a ``sqlite3.Row`` looks each column up by
name) and ``Job.from_dict``, which took four times as long.
"""
from ...model import JOB_DEFAULTS, Job, load_json

_JSON_COLUMNS = frozenset(("payload", "result", "error", "history", "cancel_request"))
# A row's column names -> how to build a Job from it positionally: per Job field, the column's
# index and whether it holds JSON, or (for a field the query does not select) its default. One
# entry per SELECT layout in the broker's statements (SELECT * or RETURNING *), a handful.
_PLANS = {}


def _plan(names):
    plan = []
    for name, factory, default in JOB_DEFAULTS:
        if name in names:
            plan.append((names.index(name), name in _JSON_COLUMNS, None))
        else:
            plan.append((None, False, factory or (lambda default=default: default)))
    return tuple(plan)


def job(row):
    """A ``Job`` from a ``sqlite3.Row`` of the jobs table."""
    names = tuple(row.keys())
    plan = _PLANS.get(names)
    if plan is None:
        plan = _PLANS[names] = _plan(names)
    args = []
    for index, is_json, default in plan:
        if index is None:
            args.append(default())
            continue
        value = row[index]
        args.append(load_json(value) if is_json and value is not None else value)
    return Job(*args)


def claim_order(job):
    """Where a claimed job goes among its queue's: highest priority first, then oldest run_at,
    then id. A priority a hand-edited row holds as text sorts as 0 instead of raising in the
    claim's transaction, which would roll back that claim and every one after it; the job is
    dead-lettered after the claim (``backends.damaged``)."""
    priority = job.priority if isinstance(job.priority, (int, float)) else 0
    return -priority, job.run_at, job.id
