"""Schema version 4 of the PostgreSQL broker: job control.

New columns on ``jobs`` (``expires_at``, ``progress``, ``progress_note``,
``cancel_request``, ``waited``), the new states, the ``paused_queues`` and
``supervisors`` tables, the claim function that also expires jobs and skips
paused queues, and the trigger that wakes ``wait``: a job someone waits on
(``waited``) sends ``NOTIFY tangguh_done_<schema>`` (payload: its id) when it
finishes. Jobs nobody waits on send nothing, so acks cost what they did.
"""
from ...model import STATES

DONE_CHANNEL_PREFIX = "tangguh_done_"
EXPIRE_BATCH = 1000  # jobs one claim ends expired at most
PRIORITY_PROBES = 16  # priorities one claim reads one by one (claim_function); the rest in one scan


def done_channel(schema):
    return f"{DONE_CHANNEL_PREFIX}{schema}"[:63]


def control_migration(s):
    """The statements of version 4; ``s`` is the quoted schema."""
    states = ", ".join(f"'{state}'" for state in STATES)
    return [
        f"ALTER TABLE {s}.jobs DROP CONSTRAINT IF EXISTS jobs_state_check",
        f"ALTER TABLE {s}.jobs ADD CONSTRAINT jobs_state_check CHECK (state IN ({states}))",
        f"ALTER TABLE {s}.jobs ADD COLUMN expires_at double precision, ADD COLUMN progress double precision,"
        " ADD COLUMN progress_note text, ADD COLUMN cancel_request jsonb,"
        " ADD COLUMN waited boolean NOT NULL DEFAULT false",
        f"CREATE INDEX jobs_expiring ON {s}.jobs (queue, expires_at)"
        " WHERE expires_at IS NOT NULL AND state IN ('queued', 'retrying')",
        f"CREATE INDEX jobs_ended ON {s}.jobs (finished_at) WHERE state IN ('cancelled', 'expired')",
        f"""CREATE TABLE {s}.paused_queues (
            queue text PRIMARY KEY,
            paused_by text,
            paused_at double precision NOT NULL)""",
        f"""CREATE TABLE {s}.supervisors (
            id text PRIMARY KEY,
            record jsonb NOT NULL,
            last_heartbeat double precision NOT NULL,
            ttl double precision NOT NULL)""",
        f"""CREATE FUNCTION {s}.notify_done() RETURNS trigger LANGUAGE plpgsql AS $body$
        BEGIN
            PERFORM pg_notify(left('{DONE_CHANNEL_PREFIX}' || TG_TABLE_SCHEMA, 63), NEW.id);
            RETURN NULL;
        END
        $body$""",
        f"""CREATE TRIGGER jobs_done_wakes_waiters AFTER UPDATE OF state ON {s}.jobs FOR EACH ROW
            WHEN (NEW.waited AND NEW.state IN ('done', 'dead', 'cancelled', 'expired'))
            EXECUTE FUNCTION {s}.notify_done()""",
        claim_function(s),
    ]


def claim_function(s):
    """The claim function (version 4; version 8 bounds what one call expires; version 9 reads one
    priority at a time, so the jobs scheduled for later cost a claim nothing).

    It reclaims expired leases (a lost attempt asked to cancel ends cancelled), ends the due
    jobs past their expires_at (returned with state 'expired': the caller records them and
    leases nothing of them; at most ``EXPIRE_BATCH`` per call, so a backlog of them costs one
    claim a bounded time and memory, the next claims the rest), then leases due jobs queue by
    queue, skipping paused queues and the jobs past their expires_at left for a later call.
    """
    return f"""CREATE OR REPLACE FUNCTION {s}.claim(p_queues text[], p_n integer, p_lease double precision,
                                                 p_owner text)
        RETURNS SETOF {s}.jobs LANGUAGE plpgsql AS $body$
        DECLARE
            v_now double precision := date_part('epoch', now());
            v_queue text;
            v_left integer := p_n;
            v_got integer;
            v_priority integer;
            v_probes integer;
        BEGIN
            UPDATE {s}.jobs j SET
                state = CASE WHEN j.cancel_request IS NOT NULL THEN 'cancelled'
                             WHEN j.attempt >= j.max_attempts THEN 'dead' ELSE 'retrying' END,
                reason = CASE WHEN j.cancel_request IS NULL AND j.attempt >= j.max_attempts
                              THEN 'lease_expired' END,
                finished_at = CASE WHEN j.cancel_request IS NOT NULL OR j.attempt >= j.max_attempts
                                   THEN v_now END,
                run_at = v_now, lease_until = NULL, owner = NULL,
                error = x.error,
                first_failure_at = coalesce(j.first_failure_at, v_now), last_failure_at = v_now,
                history = jsonb_set(j.history, '{{-1}}', (j.history -> -1) || jsonb_build_object(
                    'ended_at', v_now, 'outcome', 'lease_expired', 'error', x.error))
            FROM (SELECT e.id, jsonb_build_object('reason', 'lease_expired', 'class', '',
                         'message', 'lease of owner ' || coalesce(e.owner, '') || ' expired',
                         'traceback', '') AS error
                  FROM {s}.jobs e WHERE e.state = 'running' AND e.lease_until < v_now
                  FOR UPDATE SKIP LOCKED) x
            WHERE j.id = x.id;

            RETURN QUERY
            UPDATE {s}.jobs j SET state = 'expired', finished_at = v_now,
                history = j.history || jsonb_build_array(jsonb_build_object(
                    'outcome', 'expired', 'at', v_now, 'expires_at', j.expires_at))
            FROM (SELECT e.id FROM {s}.jobs e
                  WHERE e.queue = ANY(p_queues) AND e.expires_at IS NOT NULL AND e.expires_at <= v_now
                    AND e.state IN ('queued', 'retrying') AND e.run_at <= v_now
                  LIMIT {EXPIRE_BATCH} FOR UPDATE SKIP LOCKED) x
            WHERE j.id = x.id
            RETURNING j.*;

            FOREACH v_queue IN ARRAY p_queues LOOP
                EXIT WHEN v_left <= 0;
                CONTINUE WHEN EXISTS (SELECT 1 FROM {s}.paused_queues p WHERE p.queue = v_queue);
                -- One priority at a time, each a range of jobs_ready: in one ordered scan, the jobs
                -- scheduled for later (behind their priority's due ones, in front of every lower
                -- priority's) were all read by every claim. Past {PRIORITY_PROBES} priorities, the rest
                -- in one ordered scan again.
                v_priority := (SELECT max(d.priority) FROM {s}.jobs d
                               WHERE d.queue = v_queue AND d.state IN ('queued', 'retrying'));
                v_probes := 0;
                WHILE v_priority IS NOT NULL AND v_left > 0 LOOP
                    v_probes := v_probes + 1;
                    IF v_probes <= {PRIORITY_PROBES} THEN
                        RETURN QUERY {_lease(s, "d.priority = v_priority")};
                    ELSE
                        RETURN QUERY {_lease(s, "d.priority <= v_priority")};
                    END IF;
                    GET DIAGNOSTICS v_got = ROW_COUNT;
                    v_left := v_left - v_got;
                    EXIT WHEN v_probes > {PRIORITY_PROBES};
                    v_priority := (SELECT max(d.priority) FROM {s}.jobs d
                                   WHERE d.queue = v_queue AND d.state IN ('queued', 'retrying')
                                     AND d.priority < v_priority);
                END LOOP;
            END LOOP;
        END
        $body$"""


# A lease's fencing token: one above the last, and no lower than the server's clock in units of
# 2^-20 s (model.first_token's). Streaming replication is asynchronous: a claim the old primary
# made may be missing on the promoted standby, whose next claim of the job would hand out the
# lost claim's token again, and the first owner's renewals and outcome would pass as the second's.
LEASE_TOKEN = "GREATEST(j.token + 1, floor(v_now * 1048576)::bigint)"


def _lease(s, which):
    """The claim function's lease of ``v_queue``'s due jobs of the priorities ``which`` names.
    An equality on the priority keeps ``run_at <= v_now`` a bound of the index range."""
    return f"""UPDATE {s}.jobs j SET
                        state = 'running', attempt = j.attempt + 1, token = {LEASE_TOKEN},
                        lease_until = v_now + p_lease, owner = p_owner,
                        history = j.history || jsonb_build_array(jsonb_build_object(
                            'attempt', j.attempt + 1, 'started_at', v_now, 'owner', p_owner))
                    FROM (SELECT d.id FROM {s}.jobs d
                          WHERE d.queue = v_queue AND d.state IN ('queued', 'retrying') AND d.run_at <= v_now
                            AND {which} AND (d.expires_at IS NULL OR d.expires_at > v_now)
                          ORDER BY d.priority DESC, d.run_at, d.id
                          LIMIT v_left FOR UPDATE SKIP LOCKED) c
                    WHERE j.id = c.id
                    RETURNING j.*"""
