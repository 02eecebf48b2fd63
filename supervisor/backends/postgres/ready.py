"""Which of a queue's due jobs the claim under per-type limits reads: highest priority first.

The plain claim is the claim function (control_schema.claim_function), which reads one
priority at a time. The claim under limits runs its statements from Python, and read the
ready index (queue, priority DESC, run_at, id) in one ordered scan: a job scheduled for
later sorts in front of every lower priority's due jobs, so every such claim walked all of
them. It reads one priority at a time too, each an index range bounded by ``now``.
"""
from .control_schema import PRIORITY_PROBES

_WAITING = "FROM {t} d WHERE d.queue = %s AND d.state IN ('queued', 'retrying')"
# Past its expiry: never leased (the claim function ends 1,000 a call, the next the rest).
_UNEXPIRED = "AND (d.expires_at IS NULL OR d.expires_at > %s)"


def due_rows(db, table, queue, now, limit, columns, where, params):
    """``columns`` of ``queue``'s due jobs in claim order, at most ``limit``, locked (SKIP LOCKED);
    ``where`` (an ``AND ...`` with ``params``) narrows them."""
    waiting = _WAITING.format(t=table)
    rows = []
    priority = _highest(db, waiting, "", (queue,))
    for _ in range(PRIORITY_PROBES):
        if priority is None or len(rows) >= limit:
            return rows
        rows += db.execute(
            f"SELECT {columns} {waiting} AND d.priority = %s AND d.run_at <= %s {_UNEXPIRED} {where}"
            " ORDER BY d.run_at, d.id LIMIT %s FOR UPDATE SKIP LOCKED",
            (queue, priority, now, now, *params, limit - len(rows))).fetchall()
        priority = _highest(db, waiting, "AND d.priority < %s", (queue, priority))
    if priority is not None and len(rows) < limit:
        rows += db.execute(
            f"SELECT {columns} {waiting} AND d.priority <= %s AND d.run_at <= %s {_UNEXPIRED} {where}"
            " ORDER BY d.priority DESC, d.run_at, d.id LIMIT %s FOR UPDATE SKIP LOCKED",
            (queue, priority, now, now, *params, limit - len(rows))).fetchall()
    return rows


def _highest(db, waiting, where, params):
    # ORDER BY ... LIMIT 1, not max(): on a table not analysed yet (a burst of jobs scheduled
    # for later) the planner computed max() by reading every entry of the queue.
    row = db.execute(f"SELECT d.priority {waiting} {where} ORDER BY d.priority DESC LIMIT 1", params).fetchone()
    return None if row is None else row[0]
