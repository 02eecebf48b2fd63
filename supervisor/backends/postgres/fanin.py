"""Schema version 14: parents ended by one statement settle their children once per child.

``flow_finish`` settles a parent as its row ends, one row at a time: a cancel of
the N members of a fan-in decremented the callback's ``pending`` N times, N
versions of its row in one transaction, each found by walking the ones before
it (O(N²); 5,000 members: about a minute), every other writer of the callback
waiting on its lock all along. A statement that ends many parents at once (the
cancel: ``control.cancel``) now turns ``flow_finish`` off for its own rows
(``begin_statement``) and settles them right after with ``flow_settle_many``:
each edge records its parent's end, and each waiting child is written once,
by all of its parents there, under its row lock (taken in id order, as every
parent's end does), exactly as the parents one after another would leave it:
cancelled if one of them failed an on="success" edge, released if they were
its last, else its count lowered by as many.
"""
from ...dependencies import ON_SUCCESS, PARENT_FAILED

# Transaction-local, set for one statement: ``flow_settle_many`` clears it first.
FLAG = "tangguh.settle_by_statement"


def begin_statement():
    """The SQL run just before a statement whose ended parents ``flow_settle_many`` will settle."""
    return f"SELECT set_config('{FLAG}', 'on', true)"


def settle_many(s):
    """The SQL settling the parents ``%s`` (text[]) the previous statement ended; ``%s``: the NOTIFY channel."""
    return f"SELECT {s}.flow_settle_many(%s::text[], %s)"


def migration(s):
    return [
        f"""CREATE OR REPLACE FUNCTION {s}.flow_finish() RETURNS trigger LANGUAGE plpgsql AS $body$
        DECLARE
            v_now double precision := coalesce(NEW.finished_at, date_part('epoch', now()));
        BEGIN
            IF current_setting('{FLAG}', true) = 'on' THEN
                RETURN NULL;  -- the statement's own writer settles its parents at once
            END IF;
            PERFORM {s}.flow_settle(NEW.id, NEW.state, NEW.result, v_now, TG_TABLE_SCHEMA);
            RETURN NULL;
        END
        $body$""",
        f"""CREATE FUNCTION {s}.flow_settle_many(p_parents text[], p_channel text) RETURNS void
        LANGUAGE plpgsql AS $body$
        DECLARE
            v_now double precision := date_part('epoch', now());
            v_released integer;
        BEGIN
            -- Off before any child ends: a child's own end (its trigger) settles its children.
            PERFORM set_config('{FLAG}', '', true);
            PERFORM 1 FROM {s}.jobs WHERE id IN (SELECT child FROM {s}.job_edges
                                                 WHERE parent = ANY(p_parents) AND NOT parent_gone)
                ORDER BY id FOR UPDATE;
            WITH ended AS (
                UPDATE {s}.job_edges e SET state = p.state, result = p.result FROM {s}.jobs p
                    WHERE e.parent = ANY(p_parents) AND NOT e.parent_gone AND p.id = e.parent
                    RETURNING e.child, e.on_, p.state, coalesce(p.finished_at, v_now) AS at),
            per_child AS (
                SELECT child, count(*) AS n, bool_or(state <> 'done' AND on_ = '{ON_SUCCESS}') AS failed,
                       max(at) AS at
                FROM ended GROUP BY child),
            settled AS (
                UPDATE {s}.jobs c SET
                    pending = c.pending - k.n,
                    state = CASE WHEN k.failed THEN 'cancelled' WHEN c.pending = k.n THEN 'queued' ELSE c.state END,
                    reason = CASE WHEN k.failed THEN '{PARENT_FAILED}' ELSE c.reason END,
                    finished_at = CASE WHEN k.failed THEN k.at ELSE c.finished_at END,
                    cancel_request = CASE WHEN k.failed THEN jsonb_build_object(
                        'by', 'workflow', 'reason', '{PARENT_FAILED}', 'at', k.at) ELSE c.cancel_request END,
                    run_at = CASE WHEN NOT k.failed AND c.pending = k.n THEN greatest(c.run_at, k.at)
                             ELSE c.run_at END
                FROM per_child k WHERE c.id = k.child AND c.state = 'waiting'
                RETURNING c.state, c.queue)
            SELECT count(pg_notify(p_channel, queue)) INTO v_released
                FROM settled WHERE state = 'queued';
        END
        $body$""",
    ]
