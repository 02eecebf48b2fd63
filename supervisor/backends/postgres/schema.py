"""The PostgreSQL broker's schema: its versions, migrating, and refusing a schema that is not Tangguh's.

``migrate`` creates the schema under ``pg_advisory_xact_lock`` and records
applied versions in ``<schema>.tangguh_schema_version``: idempotent, and safe
when several processes migrate at once. A schema Tangguh made under the old
name (``schema_version`` beside Tangguh's ``jobs``) is adopted; a schema
holding tables of the same names that are not Tangguh's is refused
(``ConfigError``), never written into.
"""
import hashlib
import logging

from psycopg import errors as pgerrors

from ...errors import ConfigError
from .connection import quote
from . import fanin, workflows
from .control_schema import claim_function, control_migration
from .statements import UNFINISHED

log = logging.getLogger("tangguh.broker")

VERSIONS = "tangguh_schema_version"  # a name of our own: "schema_version" is common in applications' schemas
# The columns that make a jobs table Tangguh's.
JOB_COLUMNS = {"id", "queue", "type", "payload", "state", "attempt", "token", "lease_until", "history"}


def migrations(s):
    """The schema's versions, oldest first: (version, [statements]). ``s`` is the quoted schema."""
    return [
        (1, [
            f"""CREATE TABLE {s}.jobs (
                id text PRIMARY KEY,
                queue text NOT NULL,
                type text NOT NULL,
                payload json NOT NULL,
                state text NOT NULL CHECK (state IN ('queued', 'running', 'retrying', 'done', 'dead')),
                resource_id text,
                idempotency_key text,
                attempt integer NOT NULL DEFAULT 0,
                max_attempts integer NOT NULL,
                timeout double precision,
                priority integer NOT NULL DEFAULT 0,
                run_at double precision NOT NULL,
                queued_at double precision NOT NULL,
                trace_id text,
                token bigint NOT NULL DEFAULT 0,
                lease_until double precision,
                owner text,
                result json,
                error jsonb,
                reason text,
                first_failure_at double precision,
                last_failure_at double precision,
                finished_at double precision,
                history jsonb NOT NULL DEFAULT '[]'
            ) WITH (autovacuum_vacuum_scale_factor = 0.02, autovacuum_analyze_scale_factor = 0.02)""",
            f"CREATE INDEX jobs_ready ON {s}.jobs (queue, priority DESC, run_at, id)"
            " WHERE state IN ('queued', 'retrying')",
            f"CREATE INDEX jobs_leased ON {s}.jobs (lease_until) WHERE state = 'running'",
            f"CREATE INDEX jobs_done ON {s}.jobs (finished_at) WHERE state = 'done'",
            f"CREATE INDEX jobs_dead ON {s}.jobs (finished_at DESC, id DESC) WHERE state = 'dead'",
            f"CREATE UNIQUE INDEX jobs_idempotency ON {s}.jobs (idempotency_key)"
            f" WHERE idempotency_key IS NOT NULL AND state IN {UNFINISHED}",
            # claim: reclaim expired leases, then lease due jobs queue by queue. One call, one
            # transaction; each statement sees the previous one's effects (fresh snapshot).
            f"""CREATE FUNCTION {s}.claim(p_queues text[], p_n integer, p_lease double precision, p_owner text)
            RETURNS SETOF {s}.jobs LANGUAGE plpgsql AS $body$
            DECLARE
                v_now double precision := date_part('epoch', now());
                v_queue text;
                v_left integer := p_n;
                v_got integer;
            BEGIN
                UPDATE {s}.jobs j SET
                    state = CASE WHEN j.attempt >= j.max_attempts THEN 'dead' ELSE 'retrying' END,
                    reason = CASE WHEN j.attempt >= j.max_attempts THEN 'lease_expired' END,
                    finished_at = CASE WHEN j.attempt >= j.max_attempts THEN v_now END,
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

                FOREACH v_queue IN ARRAY p_queues LOOP
                    EXIT WHEN v_left <= 0;
                    RETURN QUERY
                    UPDATE {s}.jobs j SET
                        state = 'running', attempt = j.attempt + 1, token = j.token + 1,
                        lease_until = v_now + p_lease, owner = p_owner,
                        history = j.history || jsonb_build_array(jsonb_build_object(
                            'attempt', j.attempt + 1, 'started_at', v_now, 'owner', p_owner))
                    FROM (SELECT d.id FROM {s}.jobs d
                          WHERE d.queue = v_queue AND d.state IN ('queued', 'retrying') AND d.run_at <= v_now
                          ORDER BY d.priority DESC, d.run_at, d.id
                          LIMIT v_left FOR UPDATE SKIP LOCKED) c
                    WHERE j.id = c.id
                    RETURNING j.*;
                    GET DIAGNOSTICS v_got = ROW_COUNT;
                    v_left := v_left - v_got;
                END LOOP;
            END
            $body$""",
        ]),
        # 2: per-type claim limits (see claim) and enqueue_once records.
        (2, [
            f"""CREATE TABLE {s}.rate_buckets (
                type text PRIMARY KEY,
                tokens double precision NOT NULL,
                updated_at double precision NOT NULL)""",
            f"""CREATE TABLE {s}.once_keys (
                key text PRIMARY KEY,
                created_at double precision NOT NULL)""",
            f"CREATE INDEX once_keys_created ON {s}.once_keys (created_at)",
        ]),
        # 3: job control's search (backends/postgres/search.py): each filter's index, keyed
        # by the page's order (queued_at, id); payload fields by containment (@>) on a GIN index.
        (3, [
            f"CREATE INDEX jobs_search_queued ON {s}.jobs (queued_at, id)",
            f"CREATE INDEX jobs_search_state ON {s}.jobs (state, queued_at, id)",
            f"CREATE INDEX jobs_search_queue ON {s}.jobs (queue, queued_at, id)",
            f"CREATE INDEX jobs_search_type ON {s}.jobs (type, queued_at, id)",
            f"CREATE INDEX jobs_search_resource ON {s}.jobs (resource_id, queued_at, id)"
            " WHERE resource_id IS NOT NULL",
            f"CREATE INDEX jobs_search_idempotency ON {s}.jobs (idempotency_key) WHERE idempotency_key IS NOT NULL",
            f"CREATE INDEX jobs_search_finished ON {s}.jobs (finished_at) WHERE finished_at IS NOT NULL",
            f"CREATE INDEX jobs_search_payload ON {s}.jobs USING gin ((payload::jsonb) jsonb_path_ops)",
        ]),
        # 4: job control (cancel, expiry, progress, pauses, supervisor records, wait's notification);
        # 3 is search's indexes.
        (4, control_migration(s)),
        # 5: workflows (dependency edges, see workflows.py).
        (5, workflows.migration(s)),
        # 6: stats() (issue 16): every count it takes is a range of this index, read by an index-only
        # scan, so a queue of a million ready jobs is not counted by a sequential scan of the table.
        # Built inside the migration's transaction (not CONCURRENTLY): writes wait for it, 1.4 s
        # for a million jobs (bench/README.md).
        (6, [f"CREATE INDEX jobs_stats ON {s}.jobs (queue, state, run_at)"]),
        # 7: a reopened workflow child counts a parent that ends at the same moment (workflows.py).
        (7, workflows.reopen_migration(s)),
        # 8: a claim ends at most EXPIRE_BATCH jobs expired (control_schema.claim_function).
        (8, [claim_function(s)]),
        # 9: a claim reads one priority at a time (control_schema.claim_function).
        (9, [claim_function(s)]),
        # 10: a deleted parent's edges are no longer matched by a new job of its id (workflows.py).
        (10, workflows.detach_migration(s)),
        # 11: a reopened workflow child never makes a second holder of its idempotency key, and its
        # reopen reads none of its other parents while one still failed it (workflows.py).
        (11, workflows.keys_migration(s)),
        # 12: each schedule's newest tick, by exact name (enqueue_once(job, schedule=...)); prune
        # leaves it: the scheduler's look-back after its once_keys were pruned.
        (12, [f"""CREATE TABLE {s}.schedule_ticks (
                name text PRIMARY KEY,
                key text NOT NULL)"""]),
        # 13: a lease's token is no lower than the server's clock (control_schema.LEASE_TOKEN).
        (13, [claim_function(s)]),
        # 14: parents one statement ends (a cancel) settle each child once, not once per parent (fanin.py).
        (14, fanin.migration(s)),
    ]


def migrate(db, schema, versions):
    """Bring ``schema`` up to the last of ``versions`` (``migrations(quoted schema)``) in one transaction.

    A schema at the last version is only read: every supervisor migrates at start, and an
    application's role on a schema its owner migrated has no CREATE privilege.
    """
    key = int.from_bytes(hashlib.sha256(f"tangguh-migrate:{schema}".encode()).digest()[:8], "big", signed=True)
    s, latest = quote(schema), versions[-1][0]
    with db.transaction():
        db.execute("SELECT pg_advisory_xact_lock(%s)", (key,))
        try:
            current = _migrate(db, schema, s, versions)
        except pgerrors.InsufficientPrivilege as exc:
            raise ConfigError(f"postgres broker schema {schema!r} needs migrating to version {latest}, and this"
                              f" role may not ({str(exc).splitlines()[0]}): run `tangguh db migrate` as the"
                              " schema's owner") from None
        if current > latest:
            # A newer release migrated it (a rolling upgrade). Versions only add to a schema, so this
            # one goes on; refusing made every supervisor not upgraded yet stop at its next reconnect.
            log.warning("postgres broker schema %r is at version %d, newer than this tangguh knows (%d):"
                        " going on with it; upgrade this supervisor too", schema, current, latest,
                        extra={"event": "schema_newer"})


def _migrate(db, schema, s, versions):
    """The migrations ``schema`` lacks, applied; returns the version it was at."""
    # IF NOT EXISTS still asks for the CREATE privilege: look first.
    if db.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", (schema,)).fetchone() is None:
        db.execute(f"CREATE SCHEMA {s}")
    tables = {row[0] for row in db.execute("SELECT tablename FROM pg_tables WHERE schemaname = %s", (schema,))}
    if VERSIONS not in tables:
        _adopt(db, schema, tables)
        db.execute(f"CREATE TABLE IF NOT EXISTS {s}.{VERSIONS} ("
                   " version integer PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())")
    current = db.execute(f"SELECT coalesce(max(version), 0) FROM {s}.{VERSIONS}").fetchone()[0]
    if current > versions[-1][0]:
        return current  # newer than this code: the caller warns and goes on
    for version, statements in versions:
        if version <= current:
            continue
        for statement in statements:
            db.execute(statement)
        db.execute(f"INSERT INTO {s}.{VERSIONS} (version) VALUES (%s)", (version,))
    return current


def check(db, schema):
    """What ``migrate`` would refuse as someone else's schema, found without writing a thing
    (``tangguh config check``: a config it passes must also start)."""
    tables = {row[0] for row in db.execute("SELECT tablename FROM pg_tables WHERE schemaname = %s", (schema,))}
    if VERSIONS not in tables:
        _foreign(db, schema, tables)


def _adopt(db, schema, tables):
    """Before its first migration here: a fresh schema, or one Tangguh made under the
    old version table name (renamed now). Anything else is someone else's schema."""
    if _foreign(db, schema, tables):
        db.execute(f"ALTER TABLE {quote(schema)}.schema_version RENAME TO {VERSIONS}")


def _foreign(db, schema, tables):
    """ConfigError if ``tables`` (a schema without Tangguh's version table) hold Tangguh's names
    and are not Tangguh's; True for a schema Tangguh made under the old version table name."""
    ours = sorted(tables & {"schema_version", "jobs", "rate_buckets", "once_keys", "paused_queues", "supervisors",
                            "job_edges", "schedule_ticks"})
    if not ours:
        return False
    if "schema_version" in tables and "jobs" in tables:
        columns = {row[0] for row in db.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_schema = %s AND table_name = 'jobs'",
            (schema,))}
        if JOB_COLUMNS <= columns:
            return True
    raise ConfigError(f"postgres broker schema {schema!r} holds tables that are not Tangguh's"
                      f" ({', '.join(ours)}): name a schema of Tangguh's own in the broker url (?schema=...)")
