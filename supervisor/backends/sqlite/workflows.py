"""Workflows on SQLite: dependency edges, and the triggers that release or cancel a waiting job.

``job_edges`` holds one row per (parent, child) with the edge's ``on`` and,
once the parent has finished, its final state and result: the child reads its
parents' results from there (``ctx.parents()``), so a parent may be pruned
before its child runs. ``jobs.pending`` counts a child's parents not finished
yet (NULL for a job without dependencies).

Triggers do the release, so it is part of whichever write ends the parent
(ack, ack_many, dead, a lease expiring into dead, cancel, expiry) without any
of those writes knowing about workflows: the child becomes ``queued`` in the
same transaction as its last parent's end, exactly once. ``BEGIN IMMEDIATE``
serialises writers, so two processes finishing the last two parents at once
cannot both see ``pending = 0``.

* ``flow_finish``: a job enters a finished state. Its edges take its state and
  result, each waiting child's ``pending`` drops by one; an ``on='success'``
  child of a parent that did not end ``done`` is cancelled (``parent_failed``),
  which fires the trigger again for its own children (recursive triggers are
  on); a child with nothing pending becomes ``queued``.
* ``flow_reopen``: a finished job goes back (dlq replay, requeue). Its edges
  forget the end they recorded; waiting children wait on it again; children
  it cancelled come back ``waiting`` unless another parent's failure still
  cancels them (one probe of ``job_edges_failed``), or another unfinished job
  took their idempotency key meanwhile (they stay cancelled, naming it), and
  so on down the tree.
* ``flow_forget``: a deleted child takes its edges with it; a deleted parent's
  edges stay (its children read its end from them) marked ``parent_gone``, which
  no trigger reads: an id the caller chose may name a new job later, whose end or
  replay is not that parent's. ``flow_discard``: a parent deleted unfinished
  (``discard``) ends for its children as if cancelled.
"""
import json

from ...dependencies import KEY_HELD_BY, ON_SUCCESS, PARENT_FAILED, cancelled_by_workflow, level_of, merged
from ...errors import BadInput
from ...model import FINISHED, first_token_at

_FINISHED = "('done', 'dead', 'cancelled', 'expired')"
_UNFINISHED = "('queued', 'running', 'retrying', 'waiting')"
_NOW = "(julianday('now') - 2440587.5) * 86400.0"


_FAILED_EDGE = f"on_ = '{ON_SUCCESS}' AND state IS NOT NULL AND state <> 'done'"
HOLD = ""  # the parent of the edges a replay holds keys with (``_hold_keys``): no job has this id


def _reopenable(j):
    """``j`` is a child the reopening parent cancelled and no other on='success' parent still fails."""
    return (f"{j}.state = 'cancelled' AND {j}.reason = '{PARENT_FAILED}'"
            f" AND {j}.id IN (SELECT child FROM job_edges WHERE parent = NEW.id AND NOT parent_gone)"
            f" AND NOT EXISTS (SELECT 1 FROM job_edges WHERE child = {j}.id AND {_FAILED_EDGE})")

SCHEMA = ["""CREATE TABLE IF NOT EXISTS job_edges (
    parent TEXT NOT NULL,
    child TEXT NOT NULL,
    on_ TEXT NOT NULL,
    state TEXT,
    result TEXT,
    parent_gone INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (parent, child)
) WITHOUT ROWID""",
    "CREATE INDEX IF NOT EXISTS job_edges_child ON job_edges (child)",
    # A reopen asks whether a child still has a failed on='success' parent: one probe here, not a
    # walk of the child's edges (each member of a big fan-in replayed walked the callback's).
    f"CREATE INDEX IF NOT EXISTS job_edges_failed ON job_edges (child) WHERE {_FAILED_EDGE}",
    f"""CREATE TRIGGER IF NOT EXISTS flow_finish AFTER UPDATE OF state ON jobs
WHEN NEW.state IN {_FINISHED} AND OLD.state NOT IN {_FINISHED}
    AND EXISTS (SELECT 1 FROM job_edges WHERE parent = NEW.id AND NOT parent_gone)
BEGIN
    UPDATE job_edges SET state = NEW.state, result = NEW.result WHERE parent = NEW.id AND NOT parent_gone;
    UPDATE jobs SET pending = pending - 1
        WHERE state = 'waiting' AND id IN (SELECT child FROM job_edges WHERE parent = NEW.id AND NOT parent_gone);
    UPDATE jobs SET state = 'cancelled', reason = '{PARENT_FAILED}',
            finished_at = coalesce(NEW.finished_at, {_NOW}),
            cancel_request = json_object('by', 'workflow', 'reason', '{PARENT_FAILED}',
                                         'at', coalesce(NEW.finished_at, {_NOW}))
        WHERE NEW.state <> 'done' AND state = 'waiting'
            AND id IN (SELECT child FROM job_edges WHERE parent = NEW.id AND NOT parent_gone AND on_ = '{ON_SUCCESS}');
    UPDATE jobs SET state = 'queued', run_at = max(run_at, coalesce(NEW.finished_at, {_NOW}))
        WHERE state = 'waiting' AND pending = 0
            AND id IN (SELECT child FROM job_edges WHERE parent = NEW.id AND NOT parent_gone);
END""",
    f"""CREATE TRIGGER IF NOT EXISTS flow_reopen AFTER UPDATE OF state ON jobs
WHEN OLD.state IN {_FINISHED} AND NEW.state NOT IN {_FINISHED}
    AND EXISTS (SELECT 1 FROM job_edges WHERE parent = NEW.id AND NOT parent_gone)
BEGIN
    UPDATE job_edges SET state = NULL, result = NULL WHERE parent = NEW.id AND NOT parent_gone AND EXISTS (
        SELECT 1 FROM jobs c WHERE c.id = job_edges.child
            AND (c.state = 'waiting' OR (c.state = 'cancelled' AND c.reason = '{PARENT_FAILED}')));
    UPDATE jobs SET pending = pending + 1
        WHERE state = 'waiting' AND id IN (SELECT child FROM job_edges WHERE parent = NEW.id AND NOT parent_gone);
    UPDATE jobs SET state = 'waiting', reason = NULL, finished_at = NULL, cancel_request = NULL,
            pending = (SELECT count(*) FROM job_edges e WHERE e.child = jobs.id AND e.state IS NULL)
        WHERE {_reopenable('jobs')} AND NOT EXISTS (
            SELECT 1 FROM jobs h WHERE h.idempotency_key = jobs.idempotency_key AND h.state IN {_UNFINISHED}
            UNION ALL
            SELECT 1 FROM jobs s WHERE s.idempotency_key = jobs.idempotency_key AND s.id < jobs.id
                AND {_reopenable('s')});
    UPDATE jobs SET cancel_request = json_set(cancel_request, '$.{KEY_HELD_BY}', (SELECT h.id FROM jobs h
            WHERE h.idempotency_key = jobs.idempotency_key AND h.state IN {_UNFINISHED}))
        WHERE {_reopenable('jobs')} AND idempotency_key IS NOT NULL;
END""",
    f"""CREATE TRIGGER IF NOT EXISTS flow_forget AFTER DELETE ON jobs
BEGIN
    DELETE FROM job_edges WHERE child = OLD.id;
    UPDATE job_edges SET parent_gone = 1 WHERE parent = OLD.id AND OLD.state IN {_FINISHED};
END""",
    # A parent deleted unfinished (discard) ends for its children as if cancelled.
    f"""CREATE TRIGGER IF NOT EXISTS flow_discard AFTER DELETE ON jobs
WHEN OLD.state NOT IN {_FINISHED} AND EXISTS (SELECT 1 FROM job_edges WHERE parent = OLD.id AND NOT parent_gone)
BEGIN
    UPDATE job_edges SET state = 'cancelled', result = NULL WHERE parent = OLD.id AND NOT parent_gone;
    UPDATE jobs SET pending = pending - 1
        WHERE state = 'waiting' AND id IN (SELECT child FROM job_edges WHERE parent = OLD.id AND NOT parent_gone);
    UPDATE jobs SET state = 'cancelled', reason = '{PARENT_FAILED}', finished_at = {_NOW},
            cancel_request = json_object('by', 'workflow', 'reason', '{PARENT_FAILED}', 'at', {_NOW})
        WHERE state = 'waiting'
            AND id IN (SELECT child FROM job_edges WHERE parent = OLD.id AND NOT parent_gone AND on_ = '{ON_SUCCESS}');
    UPDATE jobs SET state = 'queued', run_at = max(run_at, {_NOW})
        WHERE state = 'waiting' AND pending = 0
            AND id IN (SELECT child FROM job_edges WHERE parent = OLD.id AND NOT parent_gone);
    UPDATE job_edges SET parent_gone = 1 WHERE parent = OLD.id;
END""",
]

_REOPEN = next(statement for statement in SCHEMA if "TRIGGER IF NOT EXISTS flow_reopen" in statement)

# A child cancelled by an on="success" parent that lies dead is kept by prune: replaying that parent
# reopens it, and so on down the tree (README "Workflows"). So is one whose on="success" parent is
# itself cancelled ``parent_failed``: the whole cancelled subtree under a dead job stays, each child
# decided by one look at its parents (no walk up the tree); once the dead job is gone the subtree
# goes a level per prune. Read through the child's own edges (``job_edges_child``).
# coalesce: a job an operator cancelled (no reason) would make the test NULL, and NOT NULL keeps it.
REPLAYABLE = (f"coalesce(reason, '') = '{PARENT_FAILED}' AND EXISTS (SELECT 1 FROM job_edges e JOIN jobs p ON p.id = e.parent"
              f" WHERE e.child = jobs.id AND e.on_ = '{ON_SUCCESS}' AND NOT e.parent_gone AND (p.state = 'dead'"
              f" OR (p.state = 'cancelled' AND p.reason = '{PARENT_FAILED}')))")


# A waiting job holds its idempotency key like any unfinished one: were it free, another job could
# take the key and the release (inside a parent's ack) would then break the unique index.
IDEMPOTENCY_INDEX = ("CREATE UNIQUE INDEX jobs_idempotency ON jobs (idempotency_key) WHERE idempotency_key IS NOT NULL"
                     " AND state IN ('queued', 'running', 'retrying', 'waiting')")


def migrate(db):
    """Add the workflow columns, table, triggers and index; inside the caller's write transaction."""
    edge_columns = {row["name"] for row in db.execute("PRAGMA table_info(job_edges)")}
    if edge_columns and "parent_gone" not in edge_columns:
        # The triggers read the new column: the old ones go, SCHEMA creates them again. Parents
        # already deleted are marked; one whose id a new job took since cannot be told apart.
        db.execute("ALTER TABLE job_edges ADD COLUMN parent_gone INTEGER NOT NULL DEFAULT 0")
        db.execute("UPDATE job_edges SET parent_gone = 1 WHERE parent NOT IN (SELECT id FROM jobs)")
        for trigger in ("flow_finish", "flow_reopen", "flow_forget", "flow_discard"):
            db.execute(f"DROP TRIGGER IF EXISTS {trigger}")
    columns = {row["name"] for row in db.execute("PRAGMA table_info(jobs)")}
    if "pending" not in columns:
        db.execute("ALTER TABLE jobs ADD COLUMN pending INTEGER")
    if "level" not in columns:
        db.execute("ALTER TABLE jobs ADD COLUMN level INTEGER")
    row = db.execute("SELECT sql FROM sqlite_master WHERE type = 'trigger' AND name = 'flow_reopen'").fetchone()
    if row is not None and row["sql"] != _REOPEN.replace(" IF NOT EXISTS", "", 1):
        # An older version's: it reopened a child whose key another job took, and walked the
        # child's edges for each reopening parent.
        db.execute("DROP TRIGGER flow_reopen")
    for statement in SCHEMA:
        db.execute(statement)
    row = db.execute("SELECT sql FROM sqlite_master WHERE type = 'index' AND name = 'jobs_idempotency'").fetchone()
    if row is None or "'waiting'" not in row["sql"]:
        db.execute("DROP INDEX IF EXISTS jobs_idempotency")
        db.execute(IDEMPOTENCY_INDEX)


class Workflows:
    """The SQLite broker's workflow operations (a mixin of ``SQLiteBroker``; ``self.db`` is its connection)."""

    def _insert_child(self, job, now, stored):
        """Store a job with ``depends_on`` inside the enqueue's transaction.

        ``stored`` maps the ids of this enqueue's earlier jobs to the ids they
        were stored under (an idempotency key may have named an existing job).
        Its state follows its parents as they are now: ``queued`` when all are
        finished, ``cancelled`` when an ``on='success'`` parent failed,
        ``waiting`` otherwise. BadInput (the caller rolls back) on an unknown parent.
        """
        edges = merged((stored.get(parent, parent), on) for parent, on in job.depends_on)
        found = {row["id"]: row for row in self.db.execute(
            "SELECT id, state, result, level FROM jobs WHERE id IN (SELECT value FROM json_each(?))",
            (json.dumps([parent for parent, _ in edges]),))}
        pending, failed, rows = 0, False, []
        for parent, on in edges:
            row = found.get(parent)
            if row is None:
                raise BadInput(f"job {job.id} depends on unknown job {parent}")
            if row["state"] in FINISHED:
                failed = failed or (on == ON_SUCCESS and row["state"] != "done")
                rows.append((parent, job.id, on, row["state"], row["result"]))
            else:
                pending += 1
                rows.append((parent, job.id, on, None, None))
        state = "cancelled" if failed else "waiting" if pending else "queued"
        level = level_of(job.id, [found[parent]["level"] for parent, _ in edges])
        self.db.execute(
            "INSERT INTO jobs (id, queue, type, payload, state, resource_id, idempotency_key,"
            " max_attempts, timeout, priority, run_at, queued_at, trace_id, expires_at, pending, reason, finished_at,"
            " cancel_request, level, token) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (job.id, job.queue, job.type, job.payload_json, state, job.resource_id, job.idempotency_key,
             job.max_attempts, job.timeout, job.priority, now + job.delay, now, job.trace_id,
             None if job.expires_in is None else now + job.expires_in, pending,
             PARENT_FAILED if failed else None, now if failed else None,
             json.dumps(cancelled_by_workflow(now)) if failed else None, level, first_token_at(job, now)),
        )
        self.db.executemany("INSERT INTO job_edges (parent, child, on_, state, result) VALUES (?, ?, ?, ?, ?)",
                            rows)
        return job.id

    def _with_parents(self, jobs):
        """Fill ``parents`` of the jobs that have dependencies (state None: not finished): one query for all."""
        children = [job for job in jobs if job.pending is not None]
        if not children:
            return jobs
        by_id = {job.id: job for job in children}
        for job in children:
            job.parents = {}
        for row in self.db.execute(
                "SELECT child, parent, state, result FROM job_edges"
                " WHERE child IN (SELECT value FROM json_each(?))",
                (json.dumps(list(by_id)),)):
            result = json.loads(row["result"]) if row["result"] is not None else None
            by_id[row["child"]].parents[row["parent"]] = (row["state"], result)
        return jobs

    def _hold_keys(self, job_ids, call=()):
        """Before a replay of ``job_ids`` puts any back: a cancelled child with the key of one of
        them gets a failed edge of no job's, so no reopen in the call reaches it. Reopened by a
        parent put back before the key's holder (still dead), it took the key, and the holder's
        put-back then failed: every replayed job holds its key before any child reopens, as on
        Redis and PostgreSQL. A job of ``call`` (a requeue's ids) is never held: it goes back
        itself. Returns those a failed parent of their own kept cancelled."""
        # Through the key's index (+: not jobs_search_state, every cancelled job).
        rows = self.db.execute(
            f"SELECT DISTINCT c.id, EXISTS (SELECT 1 FROM job_edges WHERE child = c.id AND {_FAILED_EDGE}) AS failed"
            " FROM jobs r JOIN jobs c ON c.idempotency_key = r.idempotency_key WHERE r.id IN"
            f" (SELECT value FROM json_each(?)) AND +c.state = 'cancelled' AND +c.reason = '{PARENT_FAILED}'"
            " AND c.id NOT IN (SELECT value FROM json_each(?))",
            (json.dumps(job_ids), json.dumps(list(call)))).fetchall()
        self.db.executemany(f"INSERT INTO job_edges (parent, child, on_, state) VALUES ('{HOLD}', ?, '{ON_SUCCESS}', 'dead')",
                            [(row["id"],) for row in rows])
        return [row["id"] for row in rows if row["failed"]]

    def _release_keys(self, held):
        """After the put-backs: the edges ``_hold_keys`` added go, and a child no failed parent
        keeps cancelled now (its own were replayed) names its key's holder, as a reopen does."""
        self.db.execute(f"DELETE FROM job_edges WHERE parent = '{HOLD}'")
        self.db.execute(
            f"UPDATE jobs SET cancel_request = json_set(cancel_request, '$.{KEY_HELD_BY}', (SELECT h.id FROM jobs h"
            f" WHERE h.idempotency_key = jobs.idempotency_key AND h.state IN {_UNFINISHED}))"
            " WHERE id IN (SELECT value FROM json_each(?))"
            f" AND NOT EXISTS (SELECT 1 FROM job_edges WHERE child = jobs.id AND {_FAILED_EDGE})", (json.dumps(held),))
