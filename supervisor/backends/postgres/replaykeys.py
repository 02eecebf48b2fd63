"""A dead-letter replay on PostgreSQL: every replayed job holds its idempotency key before any
child a replayed parent reopens, whatever the order of the ids and of its statements.

The replay puts its jobs back in several statements (the plain jobs at once, then each parent,
then the workflow children a level at a time), and a parent's reopen runs after its own
statement. A child one of them reopened may so hold the key of a job a later statement puts
back (its holder was still dead): that statement's unique violation undoes it alone (a
savepoint), the child goes back to how it was, cancelled, naming the job, and the statement
runs again, as Redis and SQLite do. Any other holder refuses the replay.
"""
import json

from psycopg import errors as pgerrors

from ...dependencies import KEY_HELD_BY, PARENT_FAILED, cancelled_by_workflow
from .statements import UNFINISHED


def candidates(db, jobs, job_ids):
    """The cancelled children a replay of ``job_ids`` may reopen with one of their keys:
    ``{id: (finished_at, cancel_request)}`` as they are before it."""
    return {row[0]: (row[1], row[2]) for row in db.execute(
        f"SELECT id, finished_at, cancel_request FROM {jobs} WHERE state = 'cancelled' AND reason = %s"
        f" AND idempotency_key IN (SELECT idempotency_key FROM {jobs} WHERE id = ANY(%s::text[]))",
        (PARENT_FAILED, list(job_ids))).fetchall()}


def put_back(db, jobs, reopened, ids, run):
    """``run()`` (the statement putting ``ids`` back), again after each child of ``reopened``
    holding one of their keys is cancelled again; UniqueViolation for any other holder."""
    while True:
        try:
            with db.transaction():
                return run()
        except pgerrors.UniqueViolation:
            if not _take_keys_back(db, jobs, reopened, ids):
                raise


def _take_keys_back(db, jobs, reopened, ids):
    rows = db.execute(f"SELECT j.id, h.id FROM {jobs} j JOIN {jobs} h ON h.idempotency_key = j.idempotency_key"
                      f" AND h.state IN {UNFINISHED} WHERE j.id = ANY(%s::text[])", (list(ids),)).fetchall()
    taken = [(job_id, holder) for job_id, holder in rows if holder in reopened]
    for job_id, holder in taken:
        finished_at, request = reopened[holder]
        # Its end settles what its reopening reopened below it (flow_finish).
        db.execute(f"UPDATE {jobs} SET state = 'cancelled', reason = %s, finished_at = %s,"
                   " cancel_request = %s::jsonb || jsonb_build_object(%s::text, %s::text) WHERE id = %s",
                   (PARENT_FAILED, finished_at, json.dumps(request or cancelled_by_workflow(finished_at)),
                    KEY_HELD_BY, job_id, holder))
        db.execute(f"UPDATE {jobs} SET cancel_request = cancel_request || jsonb_build_object(%s::text, %s::text)"
                   " WHERE state = 'cancelled' AND cancel_request ->> %s = %s"
                   f" AND idempotency_key = (SELECT idempotency_key FROM {jobs} WHERE id = %s)",
                   (KEY_HELD_BY, job_id, KEY_HELD_BY, holder, job_id))
    return bool(taken)


def keyed_descendants(db, s, parents):
    """Whether a job the reopens of ``parents`` may reach (their cancelled children, theirs, and
    so on) has an idempotency key, which another reopened job may share: the replay then
    reopens them one parent after another, in the call's order."""
    return db.execute(
        f"WITH RECURSIVE d(id) AS (SELECT unnest(%s::text[]) UNION SELECT e.child FROM d"
        f" JOIN {s}.job_edges e ON e.parent = d.id AND NOT e.parent_gone JOIN {s}.jobs c ON c.id = e.child"
        " AND c.state = 'cancelled' AND c.reason = %s)"
        f" SELECT 1 FROM d JOIN {s}.jobs j ON j.id = d.id WHERE j.state = 'cancelled'"
        " AND j.idempotency_key IS NOT NULL LIMIT 1", (list(parents), PARENT_FAILED)).fetchone() is not None
