"""The PostgreSQL broker: one table per schema, leases claimed with SKIP LOCKED.

URL: ``postgresql://user@host:5432/dbname?schema=tangguh`` (``postgres://``
works too). ``schema`` (default ``tangguh``) names the PostgreSQL schema that
holds the broker's tables; it is Tangguh's only option and is stripped before
connecting. Every other query parameter must be a libpq connection parameter
(``sslmode``, ``connect_timeout``, ``application_name``...) and is passed
through; anything else is a ``BrokerError``. Unless the URL says otherwise,
connections use ``connect_timeout=10``, TCP keepalives (30 s idle, 10 s x 3)
and ``fallback_application_name=tangguh``.

Connections are autocommit. Every psycopg error surfaces as ``BrokerError``
(the daemon reads it as "broker down"); the next call reconnects. After a
``fork()`` the child opens its own connections and never touches (nor closes)
the parent's.

Times are stored as ``double precision`` epoch seconds taken from the
server's clock (``now()``), so every supervisor measures leases against the
same clock; ``now()`` on the broker returns the server's time from an offset
measured when connecting (re-measured every minute).

* ``migrate()`` creates the schema under ``pg_advisory_xact_lock`` and records
  applied versions in ``<schema>.tangguh_schema_version``: idempotent, and safe
  when several processes migrate at once. A schema Tangguh made under the old
  name (``schema_version`` beside Tangguh's ``jobs``) is adopted; a schema
  holding tables of the same names that are not Tangguh's is refused
  (``ConfigError``), never written into.
* ``claim`` is one call of the SQL function ``<schema>.claim`` (one round
  trip, one transaction): it reclaims expired leases, then leases due jobs
  queue by queue with ``FOR UPDATE SKIP LOCKED`` in (priority desc, run_at, id)
  order, so concurrent supervisors never wait on each other.
* ``ack``/``retry``/``dead``/``release`` are one fenced ``UPDATE`` each
  (id + token + state running); ``extend`` is one ``UPDATE ... FROM unnest``
  for the whole batch; ``enqueue_many`` is one ``INSERT ... SELECT FROM
  unnest ... ON CONFLICT DO NOTHING``.
* Enqueue, release, replay and a retry that is due at once send
  ``NOTIFY tangguh_<schema>`` (payload: the queue); ``wakeup_fd()`` opens a
  second connection that LISTENs on it.
* Transactional outbox: ``enqueue(job, conn=producer_conn)`` inserts (and
  notifies) on the producer's own psycopg 3 connection, inside its current
  transaction: the job exists if and only if the producer commits.
"""
import contextlib
import hashlib
import json
import os
import re
import select
import time
import urllib.parse

import psycopg
from psycopg import errors as pgerrors
from psycopg.conninfo import make_conninfo
from psycopg.rows import dict_row, tuple_row
from psycopg.types.json import set_json_loads

from ..errors import BadInput, BrokerError, BrokerUnusable, ConfigError, LeaseLost, NotDead
from ..model import Job, QueueStats, load_json
from ..urls import redact
from .base import Broker
from .limits import Admission, active, refill

DEFAULT_SCHEMA = "tangguh"
_SCHEMA_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
_LIBPQ_PARAMS = frozenset(o.keyword.decode() for o in psycopg.pq.Conninfo.get_defaults())
_NOW = "date_part('epoch', now())"  # the server's clock, epoch seconds (double precision)
_UNFINISHED = "('queued', 'running', 'retrying')"
_CLOCK_RESYNC = 60.0
_VERSIONS = "tangguh_schema_version"  # a name of our own: "schema_version" is common in applications' schemas
_JOB_COLUMNS = {"id", "queue", "type", "payload", "state", "attempt", "token", "lease_until", "history"}


def _migrations(s):
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
            f" WHERE idempotency_key IS NOT NULL AND state IN {_UNFINISHED}",
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
    ]


# libpq's and the server's words for a connection that can never work as configured.
# (A server starting up, full or shutting down is an outage, and so is a host
# that does not answer: those are waited out.)
_UNUSABLE = re.compile(r'invalid port number|invalid connection option|invalid (integer |sslmode )?value'
                       r'|missing "=" after|database "[^"]*" does not exist|role "[^"]*" does not exist'
                       r'|password authentication failed|no pg_hba\.conf entry|no password supplied')


def _quote(name):
    return '"' + name.replace('"', '""') + '"'


class PostgresBroker(Broker):
    prune_batch = 10_000  # rows deleted per statement by prune()

    def __init__(self, url):
        self.url = url
        parts = urllib.parse.urlsplit(url)
        if parts.scheme.lower() not in ("postgresql", "postgres"):
            raise BrokerUnusable(f"postgres url {redact(url)}: expected postgresql://...")
        options = urllib.parse.parse_qsl(url.partition("?")[2], keep_blank_values=True)
        schema = dict(options).get("schema", DEFAULT_SCHEMA)
        names = {key for key, _ in options if key != "schema"}
        unknown = names - _LIBPQ_PARAMS
        if unknown:
            raise BrokerUnusable(f"postgres url {redact(url)}: unknown option(s) {', '.join(sorted(set(unknown)))}"
                                 " (tangguh knows schema=; the rest must be libpq connection parameters)")
        if not _SCHEMA_NAME.match(schema):
            raise BrokerUnusable(f"postgres url {redact(url)}: schema {schema!r} must be a plain identifier"
                                 " (letters, digits, underscore; at most 63 characters)")
        defaults = {"connect_timeout": "10", "fallback_application_name": "tangguh"}
        if not names & {"keepalives", "keepalives_idle", "keepalives_interval", "keepalives_count"}:
            # Notice a silently dropped TCP connection (the idle LISTEN one above all) within ~a minute.
            defaults.update(keepalives_idle="30", keepalives_interval="10", keepalives_count="3")
        self.schema = schema
        try:
            self.conninfo, _ = libpq_conninfo(url, ("schema",), **defaults)
        except psycopg.Error:
            raise BrokerUnusable(f"postgres url {redact(url)}: not a connection URL libpq can read") from None
        self.channel = f"tangguh_{schema}"[:63]
        s = _quote(schema)
        self._s = s
        self._jobs = f"{s}.jobs"
        self._db = None
        self._listener = None
        self._pid = os.getpid()
        self._offset = 0.0
        self._synced = float("-inf")
        self._prepare_sql()
        with self._guard("connect"):
            self._conn()

    # -- plumbing ---------------------------------------------------------
    def _prepare_sql(self):
        t = self._jobs
        self._sql_enqueue = (
            f"INSERT INTO {t} (id, queue, type, payload, state, resource_id, idempotency_key,"
            " max_attempts, timeout, priority, run_at, queued_at, trace_id)"
            " SELECT i.id, i.queue, i.type, i.payload::json, 'queued', i.resource_id, i.idempotency_key,"
            "  i.max_attempts, i.timeout, i.priority, n.now + i.delay, n.now, i.trace_id"
            " FROM unnest(%s::text[], %s::text[], %s::text[], %s::text[], %s::text[], %s::text[],"
            "  %s::integer[], %s::float8[], %s::integer[], %s::float8[], %s::text[]) WITH ORDINALITY"
            "  AS i(id, queue, type, payload, resource_id, idempotency_key, max_attempts, timeout, priority,"
            "  delay, trace_id, ord),"
            f" (SELECT {_NOW} AS now) n"
            " ORDER BY i.ord"
            " ON CONFLICT DO NOTHING"
            " RETURNING id, CASE WHEN run_at <= queued_at THEN pg_notify(%s, queue) END"
        )
        self._sql_existing = (
            f"SELECT id, idempotency_key, state FROM {t}"
            f" WHERE (idempotency_key = ANY(%s::text[]) AND state IN {_UNFINISHED}) OR id = ANY(%s::text[])"
        )
        self._sql_claim = f"SELECT * FROM {self._s}.claim(%s::text[], %s::integer, %s::float8, %s::text)"
        self._sql_extend = (
            f"UPDATE {t} j SET lease_until = {_NOW} + %s::float8"
            " FROM unnest(%s::text[], %s::bigint[]) AS l(id, token)"
            " WHERE j.id = l.id AND j.token = l.token AND j.state = 'running'"
            " RETURNING j.id, j.token"
        )
        close = "history = jsonb_set(history, '{-1}', (history -> -1) || %(info)s::jsonb || jsonb_build_object("
        leased = "WHERE id = %(id)s AND token = %(token)s AND state = 'running'"
        self._sql_ack = (
            f"UPDATE {t} SET state = 'done', result = %(result)s::json, finished_at = {_NOW}, lease_until = NULL, "
            + close + f"'ended_at', {_NOW}, 'outcome', 'done')) " + leased
        )
        self._sql_ack_many = (
            f"UPDATE {t} j SET state = 'done', result = a.result::json, finished_at = {_NOW}, lease_until = NULL,"
            " history = jsonb_set(j.history, '{-1}', (j.history -> -1) || a.info::jsonb || jsonb_build_object("
            f"'ended_at', {_NOW}, 'outcome', 'done'))"
            " FROM unnest(%s::text[], %s::bigint[], %s::text[], %s::text[]) AS a(id, token, result, info)"
            " WHERE j.id = a.id AND j.token = a.token AND j.state = 'running'"
            " RETURNING j.id, j.token"
        )
        self._sql_retry = (
            f"UPDATE {t} SET state = 'retrying', run_at = %(run_at)s::float8, error = %(error)s::jsonb,"
            f" first_failure_at = coalesce(first_failure_at, {_NOW}), last_failure_at = {_NOW}, lease_until = NULL, "
            + close + f"'ended_at', {_NOW}, 'outcome', 'retry', 'error', %(error)s::jsonb)) " + leased
            + f" RETURNING CASE WHEN run_at <= {_NOW} THEN pg_notify(%(channel)s, queue) END"
        )
        self._sql_dead = (
            f"UPDATE {t} SET state = 'dead', reason = %(reason)s, error = %(error)s::jsonb, finished_at = {_NOW},"
            f" first_failure_at = coalesce(first_failure_at, {_NOW}), last_failure_at = {_NOW}, lease_until = NULL, "
            + close + f"'ended_at', {_NOW}, 'outcome', 'dead', 'error', %(error)s::jsonb)) " + leased
        )
        self._sql_release = (
            f"UPDATE {t} SET state = 'queued', attempt = attempt - 1, lease_until = NULL, owner = NULL,"
            f" run_at = {_NOW}, history = history - -1 " + leased
            + " RETURNING pg_notify(%(channel)s, queue)"
        )

    def _connect(self):
        conn = psycopg.connect(self.conninfo, autocommit=True)
        set_json_loads(load_json, conn)  # a value that does not decode must not fail the whole fetch
        return conn

    def _conn(self):
        """The main connection, reconnecting when the previous one broke (or belongs to our parent)."""
        if self._pid != os.getpid():
            self._forget_inherited()
        db = self._db
        if db is None or db.closed:
            self._db = db = self._connect()
            self._sync_clock(db)
        return db

    def _forget_inherited(self):
        # After a fork the sockets are the parent's sessions: never talk on them, never close
        # them (closing sends the server a Terminate that would end the parent's session).
        # psycopg skips that goodbye when a connection is garbage-collected in another process.
        self._db = self._listener = None
        self._pid = os.getpid()

    def _sync_clock(self, db):
        # Measured after the reply arrives, so the estimate errs low (by at most one round trip):
        # once now() has passed a point, the server's clock has passed it too.
        server = db.execute("SELECT date_part('epoch', clock_timestamp())").fetchone()[0]
        self._offset = server - time.time()
        self._synced = time.monotonic()

    @contextlib.contextmanager
    def _guard(self, what):
        """Turn psycopg's errors into BrokerError (connection trouble, missing schema...)."""
        try:
            yield
        except (pgerrors.UndefinedTable, pgerrors.UndefinedFunction, pgerrors.InvalidSchemaName) as exc:
            raise BrokerError(f"postgres broker schema {self.schema!r} is missing or outdated"
                              f" (run `tangguh db migrate`): {exc}") from exc
        except psycopg.Error as exc:
            kind = BrokerUnusable if _UNUSABLE.search(str(exc)) else BrokerError
            raise kind(f"postgres broker ({redact(self.url)}): {what} failed: {exc}") from exc

    def _execute(self, query, params=None, row_factory=tuple_row):
        with self._guard("query"):
            cur = self._conn().cursor(row_factory=row_factory)
            cur.execute(query, params)
            return cur

    def now(self):
        if (time.monotonic() - self._synced > _CLOCK_RESYNC and self._db is not None and not self._db.closed
                and self._pid == os.getpid()):
            try:
                self._sync_clock(self._db)
            except psycopg.Error:
                pass  # keep the last offset; the next real call reports the outage
        return time.time() + self._offset

    def migrate(self):
        key = int.from_bytes(hashlib.sha256(f"tangguh-migrate:{self.schema}".encode()).digest()[:8], "big",
                             signed=True)
        s = self._s
        with self._guard("migrate"):
            db = self._conn()
            with db.transaction():
                db.execute("SELECT pg_advisory_xact_lock(%s)", (key,))
                # CREATE SCHEMA IF NOT EXISTS needs the CREATE privilege even when the schema exists.
                if db.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", (self.schema,)).fetchone() is None:
                    db.execute(f"CREATE SCHEMA {s}")
                tables = {row[0] for row in db.execute("SELECT tablename FROM pg_tables WHERE schemaname = %s",
                                                       (self.schema,))}
                if _VERSIONS not in tables:
                    self._adopt(db, tables)
                db.execute(f"CREATE TABLE IF NOT EXISTS {s}.{_VERSIONS} ("
                           " version integer PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())")
                current = db.execute(f"SELECT coalesce(max(version), 0) FROM {s}.{_VERSIONS}").fetchone()[0]
                migrations = _migrations(s)
                if current > migrations[-1][0]:
                    raise BrokerError(f"postgres broker schema {self.schema!r} is at version {current}, newer than"
                                      f" this tangguh knows ({migrations[-1][0]}): upgrade tangguh")
                for version, statements in migrations:
                    if version <= current:
                        continue
                    for statement in statements:
                        db.execute(statement)
                    db.execute(f"INSERT INTO {s}.{_VERSIONS} (version) VALUES (%s)", (version,))

    def _adopt(self, db, tables):
        """Before its first migration here: a fresh schema, or one Tangguh made under the
        old version table name (renamed now). Anything else is someone else's schema."""
        ours = sorted(tables & {"schema_version", "jobs", "rate_buckets", "once_keys"})
        if not ours:
            return
        if "schema_version" in tables and "jobs" in tables:
            columns = {row[0] for row in db.execute(
                "SELECT column_name FROM information_schema.columns WHERE table_schema = %s AND table_name = 'jobs'",
                (self.schema,))}
            if _JOB_COLUMNS <= columns:
                db.execute(f"ALTER TABLE {self._s}.schema_version RENAME TO {_VERSIONS}")
                return
        raise ConfigError(f"postgres broker schema {self.schema!r} holds tables that are not Tangguh's"
                          f" ({', '.join(ours)}): name a schema of Tangguh's own in the broker url (?schema=...)")

    def close(self):
        if self._pid != os.getpid():
            self._forget_inherited()
            return
        for name in ("_listener", "_db"):
            conn = getattr(self, name, None)
            setattr(self, name, None)
            if conn is not None:
                try:
                    conn.close()
                except psycopg.Error:
                    pass

    # -- wake-ups -----------------------------------------------------------
    def wakeup_fd(self):
        """A LISTENing connection's socket: readable after an enqueue (or release, replay, due retry).

        After a BrokerError from ``drain_wakeups`` the descriptor is gone; call
        ``wakeup_fd()`` again for a new one.
        """
        if self._pid != os.getpid():
            self._forget_inherited()
        if self._listener is None or self._listener.closed:
            with self._guard("listen"):
                listener = self._connect()
                try:
                    listener.execute(f"LISTEN {_quote(self.channel)}")
                except BaseException:
                    listener.close()
                    raise
                self._listener = listener
        return self._listener.fileno()

    def drain_wakeups(self):
        """Consume pending notifications without blocking; returns the queues they named."""
        listener = self._listener
        if listener is None or self._pid != os.getpid():
            return set()
        queues = set()
        try:
            # A server that closed the connection first sends its goodbye, then EOF: the socket
            # stays readable after a pass, and the next pass reports the broken connection.
            for _ in range(3):
                queues.update(n.payload for n in listener.notifies(timeout=0))
                if not select.select([listener.fileno()], [], [], 0)[0]:
                    break
            return queues
        except (psycopg.Error, OSError, ValueError) as exc:
            self._listener = None
            with contextlib.suppress(psycopg.Error):
                listener.close()
            raise BrokerError(f"postgres broker ({redact(self.url)}): listening connection lost: {exc}") from exc

    # -- producing --------------------------------------------------------
    def enqueue(self, job, conn=None):
        return self.enqueue_many([job], conn=conn)[0]

    def enqueue_many(self, jobs, conn=None):
        """Store jobs in one statement; with ``conn`` (the producer's psycopg connection), inside
        its current transaction, so they exist if and only if the producer commits."""
        jobs = [job.validate() for job in jobs]
        if not jobs:
            return []
        ids = {}  # position -> id
        pending = list(range(len(jobs)))
        for _ in range(5):
            inserted = self._insert([jobs[i] for i in pending], conn)
            by_key = {}
            missing = []
            for i in pending:
                job = jobs[i]
                if job.id in inserted:
                    ids[i] = job.id
                    if job.idempotency_key is not None:
                        by_key.setdefault(job.idempotency_key, job.id)
                else:
                    missing.append(i)
            if not missing:
                break
            # Not inserted: an unfinished job holds its idempotency key (maybe one of this batch),
            # or a job with its id exists already (a producer retrying the same NewJob).
            keys = [jobs[i].idempotency_key for i in missing if jobs[i].idempotency_key is not None]
            rows = self._query(self._sql_existing, (keys, [jobs[i].id for i in missing]), conn)
            for row_id, key, state in rows:
                if key is not None and state in ("queued", "running", "retrying"):
                    by_key.setdefault(key, row_id)
            existing_ids = {row[0] for row in rows}
            pending = []
            for i in missing:
                job = jobs[i]
                if job.idempotency_key is not None and job.idempotency_key in by_key:
                    ids[i] = by_key[job.idempotency_key]
                elif job.id in existing_ids:
                    ids[i] = job.id
                else:
                    pending.append(i)  # the holder finished meanwhile: insert again
            if not pending:
                break
        else:
            raise BrokerError("enqueue: could not settle idempotency keys under concurrent updates; try again")
        return [ids[i] for i in range(len(jobs))]

    def _insert(self, jobs, conn):
        params = (
            [j.id for j in jobs], [j.queue for j in jobs], [j.type for j in jobs],
            [json.dumps(j.payload, allow_nan=False, separators=(",", ":")) for j in jobs],
            [j.resource_id for j in jobs], [j.idempotency_key for j in jobs],
            [j.max_attempts for j in jobs], [None if j.timeout is None else float(j.timeout) for j in jobs],
            [j.priority for j in jobs], [float(j.delay) for j in jobs], [j.trace_id for j in jobs],
            self.channel,
        )
        return {row[0] for row in self._query(self._sql_enqueue, params, conn)}

    def _query(self, query, params, conn):
        """Rows of a query, on the producer's connection when one is given."""
        if conn is None:
            return self._execute(query, params).fetchall()
        with self._guard("query on the producer's connection"):
            cur = conn.cursor(row_factory=tuple_row)
            cur.execute(query, params)
            return cur.fetchall()

    def enqueue_once(self, job):
        job.validate()
        if job.idempotency_key is None:
            raise BadInput("enqueue_once needs an idempotency_key")
        with self._guard("enqueue once"):
            db = self._conn()
            with db.transaction():
                # A second caller waits here on the first one's uncommitted key, then inserts nothing.
                if db.execute(f"INSERT INTO {self._s}.once_keys (key, created_at) VALUES (%s, {_NOW})"
                              " ON CONFLICT DO NOTHING RETURNING key", (job.idempotency_key,)).fetchone() is None:
                    return None
                return self.enqueue_many([job], conn=db)[0]

    # -- leasing ----------------------------------------------------------
    def claim(self, queues, n, lease_seconds, owner, limits=None):
        queues = list(queues)
        if n <= 0 or not queues:
            return []
        limits = active(limits)
        if limits:
            with self._guard("claim"):
                rows = self._claim_limited(queues, int(n), float(lease_seconds), owner, limits)
        else:
            rows = self._execute(self._sql_claim, (queues, int(n), float(lease_seconds), owner),
                                 row_factory=dict_row).fetchall()
        order = {}
        for i, q in enumerate(queues):
            order.setdefault(q, i)
        jobs = [Job.from_dict(r) for r in rows]
        jobs.sort(key=lambda j: (order[j.queue], -j.priority, j.run_at, j.id))
        return self._runnable(jobs)

    def _claim_limited(self, queues, n, lease_seconds, owner, limits):
        """The claim under per-type limits, one transaction of a few statements.

        Claimers with limits take a transaction-scoped advisory lock per limited
        type (sorted: no deadlock), so the counts below are exact until commit;
        claims without limits never wait on it. Expired leases are reclaimed by
        the plain claim function with n = 0 first.
        """
        t = self._jobs
        types = sorted(limits)
        db = self._conn()
        with db.transaction():
            db.execute(f"SELECT * FROM {self._s}.claim(%s::text[], 0, 0, '')", (queues,))
            db.execute("SELECT count(pg_advisory_xact_lock(hashtextextended(%s || l.t, 0)))"
                       " FROM (SELECT t FROM unnest(%s::text[]) AS t ORDER BY t) l",
                       (f"tangguh-limit:{self.schema}:", types))
            now = db.execute("SELECT date_part('epoch', clock_timestamp())").fetchone()[0]
            leased = db.execute(f"SELECT type, resource_id FROM {t} WHERE state = 'running'"
                                " AND type = ANY(%s::text[])", (types,)).fetchall()
            rated = [name for name in types if limits[name].rate is not None]
            buckets = {row[0]: row[1:] for row in db.execute(
                f"SELECT type, tokens, updated_at FROM {self._s}.rate_buckets WHERE type = ANY(%s::text[])",
                (rated,)).fetchall()} if rated else {}
            tokens = {name: refill(*buckets.get(name, (None, None)), now, *limits[name].rate) for name in rated}
            admission = Admission(limits, leased, tokens)
            rows = []
            for queue in queues:
                while len(rows) < n:
                    want = n - len(rows)
                    busy = sorted(admission.busy)
                    candidates = db.execute(
                        f"SELECT d.id, d.type, d.resource_id FROM {t} d WHERE d.queue = %s"
                        " AND d.state IN ('queued', 'retrying') AND d.run_at <= %s AND d.type <> ALL(%s::text[])"
                        " AND NOT (d.resource_id IS NOT NULL AND EXISTS ("
                        "  SELECT 1 FROM unnest(%s::text[], %s::text[]) AS b(type, resource_id)"
                        "  WHERE b.type = d.type AND b.resource_id = d.resource_id))"
                        " ORDER BY d.priority DESC, d.run_at, d.id LIMIT %s FOR UPDATE SKIP LOCKED",
                        (queue, now, admission.blocked(), [b[0] for b in busy], [b[1] for b in busy],
                         want)).fetchall()
                    ids = [row[0] for row in candidates if admission.admit(row[1], row[2])]
                    if ids:
                        cur = db.cursor(row_factory=dict_row)
                        cur.execute(
                            f"UPDATE {t} j SET state = 'running', attempt = j.attempt + 1, token = j.token + 1,"
                            " lease_until = c.now + %(lease)s::float8, owner = %(owner)s::text,"
                            " history = j.history || jsonb_build_array(jsonb_build_object("
                            "  'attempt', j.attempt + 1, 'started_at', c.now, 'owner', %(owner)s::text))"
                            # The wall clock, not the transaction's start: the lease starts after the lock wait.
                            " FROM (SELECT date_part('epoch', clock_timestamp()) AS now) c"
                            " WHERE j.id = ANY(%(ids)s::text[]) RETURNING j.*",
                            {"lease": lease_seconds, "owner": owner, "ids": ids})
                        rows.extend(cur.fetchall())
                    # A held-back row leaves the next query (its type is blocked or its resource busy now).
                    if len(candidates) < want:
                        break
            tokens = admission.tokens
            if tokens:
                db.execute(
                    f"INSERT INTO {self._s}.rate_buckets (type, tokens, updated_at)"
                    " SELECT * FROM unnest(%s::text[], %s::float8[], %s::float8[])"
                    " ON CONFLICT (type) DO UPDATE SET tokens = excluded.tokens, updated_at = excluded.updated_at",
                    (list(tokens), list(tokens.values()), [now] * len(tokens)))
        return rows

    def extend(self, leases, lease_seconds):
        leases = list(leases)
        if not leases:
            return []
        rows = self._execute(
            self._sql_extend,
            (float(lease_seconds), [lease.job_id for lease in leases], [lease.token for lease in leases]),
        ).fetchall()
        current = set(rows)
        return [lease for lease in leases if (lease.job_id, lease.token) not in current]

    def _finish(self, query, lease, params):
        cur = self._execute(query, dict(params, id=lease.job_id, token=lease.token))
        if cur.rowcount == 0:
            raise LeaseLost(lease.job_id, lease.token)

    def ack(self, lease, result=None, info=None):
        self._finish(self._sql_ack, lease, {"result": json.dumps(result), "info": json.dumps(info or {})})

    def ack_many(self, acks):
        """Every ack in one statement (one round trip, one commit)."""
        acks = list(acks)
        if not acks:
            return []
        rows = self._execute(self._sql_ack_many, (
            [lease.job_id for lease, _, _ in acks], [lease.token for lease, _, _ in acks],
            [json.dumps(result) for _, result, _ in acks], [json.dumps(info or {}) for _, _, info in acks],
        )).fetchall()
        done = set(rows)
        return [lease for lease, _, _ in acks if (lease.job_id, lease.token) not in done]

    def retry(self, lease, run_at, error, info=None):
        self._finish(self._sql_retry, lease, {"run_at": float(run_at), "error": json.dumps(error),
                                              "info": json.dumps(info or {}), "channel": self.channel})

    def dead(self, lease, reason, error, info=None):
        self._finish(self._sql_dead, lease, {"reason": reason, "error": json.dumps(error),
                                             "info": json.dumps(info or {})})

    def release(self, lease):
        self._finish(self._sql_release, lease, {"channel": self.channel})

    # -- reading ----------------------------------------------------------
    def get(self, job_id):
        row = self._execute(f"SELECT * FROM {self._jobs} WHERE id = %s", (job_id,), row_factory=dict_row).fetchone()
        return Job.from_dict(row) if row else None

    def stats(self, queues):
        queues = list(queues)
        out = {q: QueueStats(q) for q in queues}
        t = self._jobs
        rows = self._execute(
            f"WITH n AS (SELECT {_NOW} AS now)"
            f" SELECT queue, 'ready', count(*), max(n.now - run_at) FROM {t}, n"
            "  WHERE queue = ANY(%(q)s::text[]) AND state IN ('queued', 'retrying') AND run_at <= n.now GROUP BY queue"
            " UNION ALL"
            f" SELECT queue, 'scheduled', count(*), NULL FROM {t}, n"
            "  WHERE queue = ANY(%(q)s::text[]) AND state IN ('queued', 'retrying') AND run_at > n.now GROUP BY queue"
            " UNION ALL"
            f" SELECT queue, state, count(*), NULL FROM {t}"
            "  WHERE queue = ANY(%(q)s::text[]) AND state IN ('running', 'dead', 'done') GROUP BY queue, state",
            {"q": queues},
        ).fetchall()
        fields = {"ready": "ready", "scheduled": "scheduled", "running": "in_flight", "dead": "dead", "done": "done"}
        for queue, kind, count, age in rows:
            setattr(out[queue], fields[kind], count)
            if kind == "ready":
                out[queue].oldest_ready_age = max(0.0, age or 0.0)
        return out

    # -- dead letters -----------------------------------------------------
    def dlq_list(self, type=None, limit=100):
        sql = f"SELECT * FROM {self._jobs} WHERE state = 'dead'"
        params = []
        if type:
            sql += " AND type = %s"
            params.append(type)
        sql += " ORDER BY finished_at DESC, id DESC LIMIT %s"
        params.append(None if limit is None else int(limit))
        return [Job.from_dict(r) for r in self._execute(sql, params, row_factory=dict_row).fetchall()]

    def _require_dead(self, db, job_ids):
        states = dict(db.execute(f"SELECT id, state FROM {self._jobs} WHERE id = ANY(%s::text[])"
                                 " ORDER BY id FOR UPDATE",
                                 (list(job_ids),)).fetchall())
        for job_id in job_ids:
            state = states.get(job_id)
            if state != "dead":
                raise NotDead(f"job {job_id} is {'unknown' if state is None else state}, not dead")

    def dlq_replay(self, job_ids):
        job_ids = list(job_ids)
        with self._guard("dlq replay"):
            db = self._conn()
            try:
                with db.transaction():
                    self._require_dead(db, job_ids)
                    db.execute(
                        f"UPDATE {self._jobs} SET state = 'queued', attempt = 0, run_at = {_NOW}, reason = NULL,"
                        " finished_at = NULL, lease_until = NULL, owner = NULL WHERE id = ANY(%s::text[])"
                        " RETURNING pg_notify(%s, queue)",
                        (job_ids, self.channel),
                    )
            except pgerrors.UniqueViolation:
                raise BadInput("cannot replay: an idempotency key is held by an unfinished job") from None
        return job_ids

    def dlq_purge(self, job_ids):
        job_ids = list(job_ids)
        with self._guard("dlq purge"):
            db = self._conn()
            with db.transaction():
                self._require_dead(db, job_ids)
                db.execute(f"DELETE FROM {self._jobs} WHERE id = ANY(%s::text[])", (job_ids,))
        return len(job_ids)

    def prune(self, done_older_than):
        cutoff = self.now() - done_older_than
        batch = int(self.prune_batch)
        sql = (f"DELETE FROM {self._jobs} WHERE id IN (SELECT id FROM {self._jobs}"
               " WHERE state = 'done' AND finished_at < %s LIMIT %s)")
        total = 0
        self._execute(f"DELETE FROM {self._s}.once_keys WHERE created_at < %s", (cutoff,))
        while True:
            deleted = self._execute(sql, (cutoff, batch)).rowcount
            total += deleted
            if deleted < batch:
                return total


def libpq_conninfo(url, own=(), **defaults):
    """``(conninfo, {key: value})`` for a ``postgresql://`` URL whose query keys in ``own`` are Tangguh's.

    Those keys are taken out (libpq would refuse them) and returned; ``defaults``
    apply where the query does not set a key. psycopg builds the conninfo from the
    URL, so every libpq form works: no host (``postgresql:///db``, the Unix socket),
    host lists, ``?host=/socket/dir``, percent-encoded user and password. Raises
    ``psycopg.ProgrammingError`` for what libpq cannot read.
    """
    base, _, query = url.partition("?")
    params = dict(defaults)
    mine = {}
    for key, value in urllib.parse.parse_qsl(query, keep_blank_values=True):
        (mine if key in own else params)[key] = value
    return make_conninfo(base, **params), mine

