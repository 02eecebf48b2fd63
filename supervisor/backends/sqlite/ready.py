"""Which of a queue's jobs a claim takes: the due ones, highest priority first, oldest first.

The ready index is ``(queue, priority DESC, run_at, id)``. A job scheduled for
later sorts behind the due jobs of its own priority but in front of every lower
priority's, and ``run_at <= now`` is no range on the index's third column: one
ordered scan walked every job scheduled for later (300,000 jobs due tomorrow
made every claim, idle polls too, take 40 ms). So the claim reads one priority
at a time, each an index range, and finds the next priority with one seek.
"""

# Past this many distinct priorities in one claim, the rest is one ordered scan again: producers
# that use thousands of priorities pay what every claim paid before, no more.
PRIORITY_PROBES = 16

_WAITING = "FROM jobs WHERE queue = ? AND state IN ('queued', 'retrying')"
# A job past its expires_at that the claim's bounded expiry has not ended yet: never leased.
_UNEXPIRED = "AND (expires_at IS NULL OR expires_at > ?)"


def due_ids(db, queue, now, limit):
    """Ids of ``queue``'s due jobs in claim order, at most ``limit``."""
    return [row[0] for row in due_rows(db, queue, now, limit)]


def due_rows(db, queue, now, limit, columns="id", where="", params=()):
    """``columns`` of ``queue``'s due jobs in claim order, at most ``limit``; ``where`` (an
    ``AND ...`` with ``params``) narrows them (the claim under per-type limits)."""
    rows = []
    priority = db.execute(f"SELECT max(priority) {_WAITING}", (queue,)).fetchone()[0]
    for _ in range(PRIORITY_PROBES):
        if priority is None or len(rows) >= limit:
            return rows
        rows += db.execute(
            f"SELECT {columns} {_WAITING} AND priority = ? AND run_at <= ? {_UNEXPIRED} {where}"
            " ORDER BY run_at, id LIMIT ?", (queue, priority, now, now, *params, limit - len(rows))).fetchall()
        priority = db.execute(f"SELECT max(priority) {_WAITING} AND priority < ?", (queue, priority)).fetchone()[0]
    if priority is not None and len(rows) < limit:
        rows += db.execute(
            f"SELECT {columns} {_WAITING} AND priority <= ? AND run_at <= ? {_UNEXPIRED} {where}"
            " ORDER BY priority DESC, run_at, id LIMIT ?", (queue, priority, now, now, *params, limit - len(rows))
        ).fetchall()
    return rows
