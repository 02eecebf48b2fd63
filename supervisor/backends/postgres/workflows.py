"""Workflows on PostgreSQL: dependency edges, and the triggers that release or cancel a waiting job.

``job_edges`` holds one row per (parent, child) with the edge's ``on`` and,
once the parent has finished, its final state and result (what the child's
``ctx.parents()`` reads, so a parent may be pruned before its child runs).
``jobs.pending`` counts a child's unfinished parents (NULL without
dependencies); ``jobs.kids`` marks a job some child depends on, so the
triggers never run for the others.

The release is a trigger on the parent's row, so it belongs to whichever
statement ends the parent (ack, ack_many, dead, the claim's lease
reclaim, cancel, expiry) and commits with it. Exactly once under concurrency:
each parent's end decrements the child's ``pending`` with an ``UPDATE ...
RETURNING``, which takes the child's row lock, so of two transactions
finishing the last two parents at once the second waits for the first and
sees ``pending`` drop to 0, the first sees 1. Children are locked in id order:
one parent's in ``flow_settle`` (and ``flow_reopen``), and all the children of
a write's parents before it ends, deletes or reopens any of them: a batch of
acks' in its statement (``statements.leased_batch``), a cancel's, a discard's
and a replay's in a statement of their own (``Workflows._lock_children``).
Two such writes over parents of the same children in opposite orders
deadlocked, each parent's end locking its children as the update met it. The
claim's lease reclaim and expiry (inside the claim function) still lock them
parent by parent, as does a cascade (a child cancelled, its own children).

A parent that runs again (replay, requeue) reopens its children: the trigger
locks those children's rows before it reads their edges, and every parent's
end locks all its children's rows (waiting or not) before it writes its
edges, so a parent ending at that moment is counted once it commits. Whether
another parent still failed a child is one probe of ``job_edges_failed``, so
replaying the N dead members of a fan-in reads the callback's N edges once,
when it reopens (schema version 11; version 7 locked every edge of the child
for each reopening parent). A child whose idempotency key another unfinished
job took stays cancelled (version 11, README "Workflows").

A deleted parent's edges stay for its children to read, marked ``parent_gone``: a new
job given its id (the caller chose it) neither settles nor reopens them (schema version 10).

An enqueue with dependencies takes the row lock of each stored parent (it sets
``kids``) before reading its state: a parent ending at the same moment either
ends first (the enqueue then sees it finished) or waits for the enqueue to
commit (its trigger then sees the new edge). Never neither.
"""
import dataclasses
import json

from psycopg import errors as pgerrors
from psycopg.rows import tuple_row

from ...dependencies import KEY_HELD_BY, ON_SUCCESS, PARENT_FAILED, merged, order, start
from ...errors import BrokerError
from ...model import first_token, id_taken
from .deadlocks import deadlock_retried
from .statements import FIRST_TOKEN, UNFINISHED

_FINISHED = "('done', 'dead', 'cancelled', 'expired')"
_FAILED_EDGE = f"on_ = '{ON_SUCCESS}' AND state IS NOT NULL AND state <> 'done'"  # what keeps a child cancelled


def migration(s):
    """Version 5's statements (the states came with version 4): the columns, the edge table, the triggers."""
    return [
        f"ALTER TABLE {s}.jobs ADD COLUMN pending integer, ADD COLUMN level integer,"
        " ADD COLUMN kids boolean NOT NULL DEFAULT false",
        f"""CREATE TABLE {s}.job_edges (
            parent text NOT NULL,
            child text NOT NULL,
            on_ text NOT NULL,
            state text,
            result json,
            PRIMARY KEY (parent, child))""",
        f"CREATE INDEX job_edges_child ON {s}.job_edges (child)",
        # A waiting job holds its idempotency key: were it free, another job could take the key and
        # the release (inside a parent's ack) would then break the unique index.
        f"DROP INDEX {s}.jobs_idempotency",
        f"CREATE UNIQUE INDEX jobs_idempotency ON {s}.jobs (idempotency_key)"
        f" WHERE idempotency_key IS NOT NULL AND state IN {UNFINISHED}",
        settle_function(s, "CREATE FUNCTION", detached=False),
        f"""CREATE FUNCTION {s}.flow_finish() RETURNS trigger LANGUAGE plpgsql AS $body$
        DECLARE
            v_now double precision := coalesce(NEW.finished_at, date_part('epoch', now()));
        BEGIN
            PERFORM {s}.flow_settle(NEW.id, NEW.state, NEW.result, v_now, TG_TABLE_SCHEMA);
            RETURN NULL;
        END
        $body$""",
        reopen_function(s, "CREATE FUNCTION", lock=None),
        forget_function(s, "CREATE FUNCTION", detached=False),
        f"CREATE TRIGGER flow_finish AFTER UPDATE OF state ON {s}.jobs FOR EACH ROW"
        f" WHEN (NEW.kids AND NEW.state IN {_FINISHED} AND OLD.state NOT IN {_FINISHED})"
        f" EXECUTE FUNCTION {s}.flow_finish()",
        f"CREATE TRIGGER flow_reopen AFTER UPDATE OF state ON {s}.jobs FOR EACH ROW"
        f" WHEN (NEW.kids AND OLD.state IN {_FINISHED} AND NEW.state NOT IN {_FINISHED})"
        f" EXECUTE FUNCTION {s}.flow_reopen()",
        f"CREATE TRIGGER flow_forget AFTER DELETE ON {s}.jobs FOR EACH ROW WHEN (OLD.pending IS NOT NULL OR OLD.kids)"
        f" EXECUTE FUNCTION {s}.flow_forget()",
    ]


def reopen_migration(s):
    """Version 7: ``flow_reopen`` locks the edges of the children it reopens before it reads them.

    A parent ending at the same moment writes its edges first and its children after, in
    one transaction. Read from the reopen's snapshot, that parent's edge was still open
    and the child it had skipped (cancelled then) was counted as waiting for it: once its
    other parents finished, the child waited forever. Locked first, the edges are read
    after that parent's commit (a later statement, a later snapshot), so its end counts.
    """
    return [reopen_function(s, "CREATE OR REPLACE FUNCTION", lock="edges")]


def reopen_function(s, create, lock, detached=False, keys=False):
    """The trigger function run when a parent runs again (replay, requeue): its children's
    edges reopen, a waiting child waits for it again, a child cancelled for it waits again
    (with ``keys``: unless another unfinished job took its idempotency key meanwhile).

    ``lock``: what it locks before it reads the children's edges, so that a parent of theirs
    ending at the same moment is read once it committed: None (version 5), "edges" (versions 7
    and 10: every edge of every child, so each member of a fan-in of N replayed read and locked
    N edges), "children" (version 11: the children's rows, which every parent's end locks too).
    """
    live, e_live = (" AND NOT parent_gone", " AND NOT e.parent_gone") if detached else ("", "")
    lock = {None: "", "edges": f"""
            PERFORM 1 FROM {s}.job_edges
                WHERE child IN (SELECT child FROM {s}.job_edges WHERE parent = NEW.id{live})
                ORDER BY child, parent FOR UPDATE;""", "children": f"""
            PERFORM 1 FROM {s}.jobs WHERE id IN (SELECT child FROM {s}.job_edges WHERE parent = NEW.id{live})
                ORDER BY id FOR UPDATE;"""}[lock]

    def reopenable(j):
        return (f"{j}.state = 'cancelled' AND {j}.reason = '{PARENT_FAILED}'"
                f" AND {j}.id IN (SELECT child FROM {s}.job_edges WHERE parent = NEW.id{live})"
                + (f" AND NOT EXISTS (SELECT 1 FROM {s}.job_edges WHERE child = {j}.id AND {_FAILED_EDGE})" if keys else
                   f" AND NOT EXISTS (SELECT 1 FROM {s}.job_edges e WHERE e.child = {j}.id AND e.on_ = '{ON_SUCCESS}'"
                   " AND e.state IS NOT NULL AND e.state <> 'done')"))
    # Cancelled, the child gave up its key: a job that took it since carries that effect, so the
    # child stays cancelled and names the holder. Of two cancelled siblings with one key, the first.
    held = (f"""
                    AND NOT EXISTS (SELECT 1 FROM {s}.jobs h WHERE h.idempotency_key = j.idempotency_key
                                        AND h.state IN {UNFINISHED}
                                    UNION ALL
                                    SELECT 1 FROM {s}.jobs x WHERE x.idempotency_key = j.idempotency_key
                                        AND x.id < j.id AND {reopenable('x')})""" if keys else "")
    note = (f"""
            UPDATE {s}.jobs j SET cancel_request = j.cancel_request || jsonb_build_object('{KEY_HELD_BY}',
                    (SELECT h.id FROM {s}.jobs h WHERE h.idempotency_key = j.idempotency_key
                        AND h.state IN {UNFINISHED}))
                WHERE {reopenable('j')} AND j.idempotency_key IS NOT NULL;""" if keys else "")
    return f"""{create} {s}.flow_reopen() RETURNS trigger LANGUAGE plpgsql AS $body$
        BEGIN{lock}
            UPDATE {s}.job_edges e SET state = NULL, result = NULL FROM {s}.jobs c
                WHERE e.parent = NEW.id{e_live} AND c.id = e.child
                    AND (c.state = 'waiting' OR (c.state = 'cancelled' AND c.reason = '{PARENT_FAILED}'));
            UPDATE {s}.jobs SET pending = pending + 1
                WHERE state = 'waiting' AND id IN (SELECT child FROM {s}.job_edges WHERE parent = NEW.id{live});
            UPDATE {s}.jobs j SET state = 'waiting', reason = NULL, finished_at = NULL, cancel_request = NULL,
                    pending = (SELECT count(*) FROM {s}.job_edges e WHERE e.child = j.id AND e.state IS NULL)
                WHERE {reopenable('j')}{held};{note}
            RETURN NULL;
        END
        $body$"""


def detach_migration(s):
    """Version 10: a deleted parent's edges stay for its children to read, marked ``parent_gone``.

    The edges of a parent pruned, purged or discarded outlived it, and an id the caller
    chose may name a new job later: that job's end settled them (a child released
    though another parent never ran, reading the new job's result) and its replay
    reopened them. Marked, they are no longer any job's: ``flow_settle`` and
    ``flow_reopen`` skip them. Edges of parents already gone are marked here.
    """
    return [
        f"ALTER TABLE {s}.job_edges ADD COLUMN parent_gone boolean NOT NULL DEFAULT false",
        f"UPDATE {s}.job_edges e SET parent_gone = true"
        f" WHERE NOT EXISTS (SELECT 1 FROM {s}.jobs j WHERE j.id = e.parent)",
        settle_function(s, "CREATE OR REPLACE FUNCTION", detached=True),
        reopen_function(s, "CREATE OR REPLACE FUNCTION", lock="edges", detached=True),
        forget_function(s, "CREATE OR REPLACE FUNCTION", detached=True),
    ]


def settle_function(s, create, detached, lock_children=False):
    """One parent's end, for each of its waiting children: the edge records it, the child's
    count drops under its row lock (RETURNING), and the child is cancelled (its parent
    failed an on="success" edge) or released (its last parent). ``flow_finish`` and ``flow_forget`` call it.

    With ``lock_children`` (version 11) every child's row is locked first, waiting or not:
    a reopen (another parent's replay) locks the child before it reads the child's edges,
    so it reads them after this end commits (``reopen_function``).
    """
    live = " AND NOT parent_gone" if detached else ""
    lock = (f"""
            PERFORM 1 FROM {s}.jobs WHERE id IN (SELECT child FROM {s}.job_edges WHERE parent = p_parent{live})
                ORDER BY id FOR UPDATE;""" if lock_children else "")
    return f"""{create} {s}.flow_settle(p_parent text, p_state text, p_result json, p_now double precision,
                                           p_schema text) RETURNS void LANGUAGE plpgsql AS $body$
        DECLARE
            v_pending integer;
            v_queue text;
            e record;
        BEGIN{lock}
            FOR e IN WITH u AS (UPDATE {s}.job_edges SET state = p_state, result = p_result
                                WHERE parent = p_parent{live} RETURNING child, on_)
                     SELECT child, on_ FROM u ORDER BY child LOOP
                UPDATE {s}.jobs SET pending = pending - 1 WHERE id = e.child AND state = 'waiting'
                    RETURNING pending INTO v_pending;
                CONTINUE WHEN NOT FOUND;
                IF p_state <> 'done' AND e.on_ = '{ON_SUCCESS}' THEN
                    UPDATE {s}.jobs SET state = 'cancelled', reason = '{PARENT_FAILED}', finished_at = p_now,
                            cancel_request = jsonb_build_object('by', 'workflow', 'reason', '{PARENT_FAILED}',
                                                                'at', p_now)
                        WHERE id = e.child;
                ELSIF v_pending = 0 THEN
                    UPDATE {s}.jobs SET state = 'queued', run_at = greatest(run_at, p_now) WHERE id = e.child
                        RETURNING queue INTO v_queue;
                    PERFORM pg_notify(left('tangguh_' || p_schema, 63), v_queue);
                END IF;
            END LOOP;
        END
        $body$"""


def forget_function(s, create, detached):
    """A deleted child takes its edges with it; a parent deleted unfinished (discard) ends for its
    children as if cancelled. A deleted parent's edges stay until those children go (they read
    its end there); from version 10 (``detached``) marked ``parent_gone``."""
    detach = f"""
            IF OLD.kids THEN
                UPDATE {s}.job_edges SET parent_gone = true WHERE parent = OLD.id;
            END IF;""" if detached else ""
    return f"""{create} {s}.flow_forget() RETURNS trigger LANGUAGE plpgsql AS $body$
        DECLARE
            v_now double precision := date_part('epoch', now());
        BEGIN
            IF OLD.pending IS NOT NULL THEN
                DELETE FROM {s}.job_edges WHERE child = OLD.id;
            END IF;
            IF OLD.kids AND OLD.state NOT IN {_FINISHED} THEN
                PERFORM {s}.flow_settle(OLD.id, 'cancelled', NULL, v_now, TG_TABLE_SCHEMA);
            END IF;{detach}
            RETURN NULL;
        END
        $body$"""


def keys_migration(s):
    """Version 11: a reopened child whose idempotency key another unfinished job took stays
    cancelled (reopened, it held the key a second time: the unique index aborted the whole
    replay, its parent stuck dead), and a reopen costs the same whatever the child's parents.

    Each member of a big fan-in replayed locked and read every edge of the callback (a
    fan-in of 3,000: 18 s in one transaction). Now it locks the callback's row (every
    parent's end does too), and whether another parent still failed it is one probe of
    ``job_edges_failed``; the callback's open parents are counted once, when it reopens.
    """
    return [f"CREATE INDEX job_edges_failed ON {s}.job_edges (child) WHERE {_FAILED_EDGE}",
            settle_function(s, "CREATE OR REPLACE FUNCTION", detached=True, lock_children=True),
            reopen_function(s, "CREATE OR REPLACE FUNCTION", lock="children", detached=True, keys=True)]


class Workflows:
    """The PostgreSQL broker's workflow operations (a mixin of ``PostgresBroker``)."""

    @deadlock_retried
    def _enqueue_flow(self, jobs, conn=None):
        """Store validated jobs of which some have ``depends_on``: one transaction, up to six statements.

        Idempotency keys held by unfinished jobs are resolved first (a child of
        such a job depends on the holder); then the stored jobs it may name are
        locked and read, each job's initial state is planned in order
        (``dependencies.start``), and every job and edge is inserted at once.
        All or nothing.
        """
        t = self._jobs
        with self._guard("enqueue"):
            db = conn if conn is not None else self._conn()
            for _ in range(5):
                try:
                    with db.transaction():  # a savepoint inside the caller's transaction (conn=)
                        return self._store_flow(db, t, jobs)
                except pgerrors.UniqueViolation:
                    # Another producer's job took one of these keys (or ids) after we read the holders:
                    # its insert made ours wait until it committed, so reading again finds it and
                    # this workflow gets its id, as a plain enqueue does (and SQLite, Redis).
                    continue
            raise BrokerError("enqueue: a job of this workflow was stored concurrently"
                              " (same id or idempotency key) again and again; try again")

    def _store_flow(self, db, t, jobs):
        cur = db.cursor(row_factory=tuple_row)
        keys = sorted({job.idempotency_key for job in jobs if job.idempotency_key is not None})
        holders = dict(cur.execute(
            f"SELECT idempotency_key, id FROM {t} WHERE idempotency_key = ANY(%s::text[])"
            f" AND state IN {UNFINISHED} FOR UPDATE", (keys,)).fetchall()) if keys else {}
        # Every id, made ones too: a resent batch (its answer lost) gets its own jobs back, not a key's holder.
        taken = dict(cur.execute(f"SELECT id, queue FROM {t} WHERE id = ANY(%s::text[]) FOR UPDATE",
                                 ([job.id for job in jobs],)).fetchall())
        # Read before the copies below lose what ``validate`` kept: ``_id_made``, and the payload's
        # JSON as checked (the caller may have changed the dict in place since).
        tokens = {job.id: first_token(job) for job in jobs}
        payloads = {job.id: job.payload_json for job in jobs}
        # The stored jobs this enqueue may make parents (named outside it, holding one of its keys,
        # resent), locked and read before any job is planned: a job stored cancelled (a parent
        # failed) holds no key, so a later job with its key is stored, as two calls would.
        inside = {job.id for job in jobs}
        around = sorted({parent for job in jobs for parent, _ in job.depends_on if parent not in inside}
                        | set(holders.values()) | set(taken))
        rows = cur.execute(f"SELECT id, state, result, level, kids FROM {t} WHERE id = ANY(%s::text[])"
                           " ORDER BY id FOR UPDATE", (around,)).fetchall() if around else []
        now = {row[0]: row[1:4] for row in rows}
        marked = {row[0] for row in rows if row[4]}
        stored, planned = {}, []
        for job in order(jobs):
            if job.id in taken:
                if taken[job.id] != job.queue:
                    raise id_taken(job.id, taken[job.id])
                stored[job.id] = job.id  # a resend of a job it named: stored once
                continue
            key = job.idempotency_key
            if key is not None and key in holders:
                stored[job.id] = holders[key]
                continue
            stored[job.id] = job.id
            job = dataclasses.replace(
                job, depends_on=merged((stored.get(parent, parent), on) for parent, on in job.depends_on))
            state, pending, edges, level = start(job, now)
            if key is not None and state != "cancelled":
                holders[key] = job.id
            planned.append((job, state, pending, edges, level))
        if not planned:  # every job's idempotency key is held: nothing to store
            return [stored[job.id] for job in jobs]
        fresh = {job.id for job, *_ in planned}
        unmarked = sorted({parent for job, *_ in planned for parent, _ in job.depends_on} - fresh - marked)
        if unmarked:  # a stored job's first child
            cur.execute(f"UPDATE {t} SET kids = true WHERE id = ANY(%s::text[])", (unmarked,))
        parents = {parent for _, _, _, edges, _ in planned for parent, _, _, _ in edges}
        cols = list(zip(*[
            (j.id, j.queue, j.type, payloads[j.id], state,
             j.resource_id, j.idempotency_key, j.max_attempts, None if j.timeout is None else float(j.timeout),
             j.priority, float(j.delay), j.trace_id, None if j.expires_in is None else float(j.expires_in),
             pending, level or None, j.id in parents, tokens[j.id])
            for j, state, pending, _, level in planned]))
        # Arrays in binary (%b), as the plain enqueue's: their text form is quoted element by element in Python.
        cur.execute(
            f"INSERT INTO {t} (id, queue, type, payload, state, resource_id, idempotency_key, max_attempts,"
            " timeout, priority, run_at, queued_at, trace_id, expires_at, pending, level, kids, reason, finished_at,"
            " cancel_request, token)"
            " SELECT i.id, i.queue, i.type, i.payload::json, i.state, i.resource_id, i.idempotency_key,"
            "  i.max_attempts, i.timeout, i.priority, n.now + i.delay, n.now, i.trace_id, n.now + i.expires_in,"
            f"  i.pending, i.level, i.kids, CASE WHEN i.state = 'cancelled' THEN '{PARENT_FAILED}' END,"
            "  CASE WHEN i.state = 'cancelled' THEN n.now END,"
            "  CASE WHEN i.state = 'cancelled' THEN jsonb_build_object('by', 'workflow', 'reason',"
            f"   '{PARENT_FAILED}', 'at', n.now) END, {FIRST_TOKEN}"
            " FROM unnest(%b::text[], %b::text[], %b::text[], %b::text[], %b::text[], %b::text[], %b::text[],"
            "  %b::integer[], %b::float8[], %b::integer[], %b::float8[], %b::text[], %b::float8[], %b::integer[],"
            "  %b::integer[], %b::boolean[], %b::bigint[])"
            "  WITH ORDINALITY AS i(id, queue, type, payload, state, resource_id, idempotency_key, max_attempts,"
            "  timeout, priority, delay, trace_id, expires_in, pending, level, kids, token, ord),"
            f" (SELECT date_part('epoch', now()) AS now) n ORDER BY i.ord"
            " RETURNING CASE WHEN state = 'queued' AND run_at <= queued_at THEN pg_notify(%s, queue) END",
            [list(c) for c in cols] + [self.channel])
        edges = [(parent, job.id, on, state, None if state is None else json.dumps(result))
                 for job, _, _, job_edges, _ in planned for parent, on, state, result in job_edges]
        if edges:
            cur.execute(
                f"INSERT INTO {self._s}.job_edges (parent, child, on_, state, result)"
                " SELECT e.parent, e.child, e.on_, e.state, e.result::json"
                " FROM unnest(%b::text[], %b::text[], %b::text[], %b::text[], %b::text[])"
                " AS e(parent, child, on_, state, result)",
                [list(c) for c in zip(*edges)])
        return [stored[job.id] for job in jobs]

    def _lock_children(self, db, parents):
        """Lock the workflow children of ``parents`` (jobs with ``kids`` whose rows this transaction
        locked, in id order, and is about to end, reopen or delete) all at once, in id order.

        Each parent's end (``flow_settle``) and reopen (``flow_reopen``) locks its children, one
        parent after another as the statement meets them: two writes ending or reopening
        parents of the same children crosswise (p_A then p_B, q_B then q_A) each held a child
        the other wanted, and PostgreSQL aborted one after deadlock_timeout. Locked here first,
        the children are the trigger's already. (``ack_many`` does the same inside its
        statement: ``statements.leased_batch``.)
        """
        if parents:
            db.execute(f"SELECT id FROM {self._jobs} WHERE id IN (SELECT child FROM {self._s}.job_edges"
                       " WHERE parent = ANY(%s::text[]) AND NOT parent_gone) ORDER BY id FOR UPDATE", (list(parents),))

    def _with_parents(self, jobs):
        """Fill ``parents`` of the jobs that have dependencies (state None: not finished): one query for all."""
        children = {job.id: job for job in jobs if job.pending is not None}
        if not children:
            return jobs
        for job in children.values():
            job.parents = {}
        rows = self._execute(f"SELECT child, parent, state, result FROM {self._s}.job_edges"
                             " WHERE child = ANY(%s::text[])", (list(children),)).fetchall()
        for child, parent, state, result in rows:
            children[child].parents[parent] = (state, result)
        return jobs
