"""A dead-letter replay on PostgreSQL: every replayed job holds its idempotency key before any
child a replayed parent reopens, and reopens run in the order the other brokers run theirs.

The replay puts its jobs back in several statements (the plain jobs at once, then the parents,
then the workflow children a level at a time), and a parent's reopen runs after its own
statement: a child it reopened could take the key of a job a later statement puts back (its
holder still dead then), whose statement then failed. ``hold`` keeps those children out of
every reopen of the call, as Redis and SQLite do.
"""
from ...dependencies import KEY_HELD_BY, ON_SUCCESS, PARENT_FAILED
from .statements import UNFINISHED

_FAILED_EDGE = f"on_ = '{ON_SUCCESS}' AND state IS NOT NULL AND state <> 'done'"  # as workflows.py
HOLD = ""  # the parent of the edges ``hold`` adds: no job has this id


def hold(db, s, job_ids, call=()):
    """A cancelled child with the key of one of ``job_ids`` gets a failed edge of no job's, so no
    reopen reaches it (the replayed job takes its key); a job of ``call`` (a requeue's ids) goes
    back itself and is never held. Returns those a failed parent of their own kept cancelled
    (``release``)."""
    rows = db.execute(
        f"SELECT id, EXISTS (SELECT 1 FROM {s}.job_edges WHERE child = j.id AND {_FAILED_EDGE}) FROM {s}.jobs j"
        " WHERE state = 'cancelled' AND reason = %s AND idempotency_key IN"
        f" (SELECT idempotency_key FROM {s}.jobs WHERE id = ANY(%s::text[])) AND NOT id = ANY(%s::text[])"
        " ORDER BY id",  # two replays: one order
        (PARENT_FAILED, list(job_ids), list(call))).fetchall()
    if rows:
        db.execute(f"INSERT INTO {s}.job_edges (parent, child, on_, state) SELECT %s, c, %s, 'dead'"
                   " FROM unnest(%s::text[]) AS c", (HOLD, ON_SUCCESS, [row[0] for row in rows]))
    return [row[0] for row in rows if row[1]]


def release(db, s, held):
    """After the put-backs: ``hold``'s edges go, and a child no failed parent keeps cancelled now
    (its own were replayed) names its key's holder, as a reopen does."""
    db.execute(f"DELETE FROM {s}.job_edges WHERE parent = %s", (HOLD,))
    if held:
        db.execute(
            f"UPDATE {s}.jobs j SET cancel_request = j.cancel_request || jsonb_build_object(%s::text,"
            f" (SELECT h.id FROM {s}.jobs h WHERE h.idempotency_key = j.idempotency_key AND h.state IN {UNFINISHED}))"
            f" WHERE id = ANY(%s::text[]) AND NOT EXISTS (SELECT 1 FROM {s}.job_edges WHERE child = j.id AND {_FAILED_EDGE})",
            (KEY_HELD_BY, held))


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


def key_holders(db, s, job_ids, failed_parent):
    """Those of ``job_ids`` with a key that a requeue puts back (or that end unfinished some other
    way, reopened by a parent of the call): finished, no failed parent (``failed_parent``: the
    SQL of one for the job ``r``)."""
    return [row[0] for row in db.execute(
        f"SELECT r.id FROM {s}.jobs r WHERE r.id = ANY(%s::text[]) AND r.idempotency_key IS NOT NULL"
        f" AND r.state IN ('dead', 'cancelled', 'expired') AND NOT EXISTS ({failed_parent})",
        (list(job_ids),))]


def name_holders(db, s, held):
    """After a requeue: a child its holds kept cancelled that no failed parent keeps so now names
    its key's holder, as a reopen does (put back a job a transaction, the holder may come later)."""
    db.execute(
        f"UPDATE {s}.jobs j SET cancel_request = j.cancel_request || jsonb_build_object(%s::text, h.id)"
        f" FROM {s}.jobs h WHERE j.id = ANY(%s::text[]) AND h.idempotency_key = j.idempotency_key"
        f" AND h.state IN {UNFINISHED} AND j.state = 'cancelled'"
        f" AND NOT EXISTS (SELECT 1 FROM {s}.job_edges WHERE child = j.id AND {_FAILED_EDGE})",
        (KEY_HELD_BY, list(held)))
