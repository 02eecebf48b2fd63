"""The PostgreSQL broker: one table per schema, leases claimed with SKIP LOCKED.

URL: ``postgresql://user@host:5432/dbname?schema=tangguh``; the options, the
connections and the server's clock are in ``connection``. Times are stored as
``double precision`` epoch seconds taken from the server's clock (``now()``),
so every supervisor measures leases against the same clock.

The package's parts: ``connection`` (the URL, the sessions, the clock, errors
as BrokerError, LISTEN/NOTIFY), ``schema`` (the versions, ``migrate``, the
foreign-schema refusal), ``statements`` (the SQL of the hot paths),
``producing`` (enqueue), ``search`` (search, count, requeue, discard); the
other operations are here.

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
import json

from psycopg import errors as pgerrors
from psycopg.rows import dict_row, tuple_row

from ...errors import BadInput, LeaseLost, NotDead
from ...jsonvalues import info_json, is_storable, result_json
from ...model import Job, QueueStats, check_queue
from ..control import check_age, check_ids, check_limit, check_type
from ..base import Broker
from ..limits import Admission, active, refill
from . import replaykeys, schema, workflows
from .connection import Connections, libpq_conninfo, quote, read_url
from .deadlocks import deadlock_retried
from .control import ControlMixin
from .control_schema import LEASE_TOKEN
from .producing import ProducingMixin
from .ready import due_rows
from .schema import migrations as _migrations  # looked up at each migrate: a test stands in older versions
from .search import SearchMixin
from .statements import NOW, UNFINISHED, Statements, stats_query

__all__ = ["PostgresBroker", "libpq_conninfo"]


class PostgresBroker(ProducingMixin, workflows.Workflows, ControlMixin, SearchMixin, Broker):
    prune_batch = 10_000  # rows deleted per statement by prune()

    def __init__(self, url):
        self.url = url
        self.conninfo, self.schema, socket_timeout = read_url(url)
        self.channel = f"tangguh_{self.schema}"[:63]
        self._s = quote(self.schema)
        self._jobs = f"{self._s}.jobs"
        self._sql = Statements(self._s)
        self._connections = Connections(url, self.conninfo, self.schema, socket_timeout)
        with self._guard("connect"):
            self._conn()

    # -- plumbing ---------------------------------------------------------
    def _conn(self):
        return self._connections.main()

    def _guard(self, what):
        return self._connections.guard(what)

    def _execute(self, query, params=None, row_factory=tuple_row):
        return self._connections.execute(query, params, row_factory)

    @property
    def _listener(self):
        """The LISTENing connection, once ``wakeup_fd`` opened it."""
        return self._connections.listener

    def now(self):
        return self._connections.now()

    def migrate(self):
        # Not bounded by socket_timeout: a version may build an index on a big table.
        with self._guard("migrate"), self._connections.patient() as db:
            schema.migrate(db, self.schema, _migrations(self._s))

    def check_schema(self):
        """ConfigError if ``migrate`` would refuse the schema as not Tangguh's; writes nothing."""
        with self._guard("check"), self._connections.patient() as db, db.transaction():
            schema.check(db, self.schema)

    def close(self):
        self._connections.close()

    # -- wake-ups -----------------------------------------------------------
    def wakeup_fd(self):
        """A LISTENing connection's socket: readable after an enqueue (or release, replay, due retry).

        After a BrokerError from ``drain_wakeups`` the descriptor is gone; call
        ``wakeup_fd()`` again for a new one.
        """
        return self._connections.listen(self.channel)

    def drain_wakeups(self):
        """Consume pending notifications without blocking; returns the queues they named."""
        return self._connections.drain()

    # -- leasing ----------------------------------------------------------
    def claim(self, queues, n, lease_seconds, owner, limits=None):
        queues = list(queues)
        if n <= 0 or not queues:
            return []
        limits = active(limits)
        if limits:
            rows = self._claim_under_limits(queues, int(n), float(lease_seconds), owner, limits)
        else:
            rows = self._execute(self._sql.claim, (queues, int(n), float(lease_seconds), owner),
                                 row_factory=dict_row).fetchall()
        order = {}
        for i, q in enumerate(queues):
            order.setdefault(q, i)
        jobs = self._leasable(rows)  # the expired ones are recorded, not leased
        jobs.sort(key=lambda j: (order[j.queue], -j.priority, j.run_at, j.id))
        return self._runnable(self._with_parents(jobs))

    @deadlock_retried
    def _claim_under_limits(self, queues, n, lease_seconds, owner, limits):
        # Several statements in one transaction (the plain claim is one, run again by _execute):
        # PostgreSQL aborting it to break a deadlock (its reclaim's workflow triggers against a
        # cancel) is no outage; rolled back whole, it runs again.
        with self._guard("claim"):
            return self._claim_limited(queues, n, lease_seconds, owner, limits)

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
            cur = db.cursor(row_factory=dict_row)
            self._leasable(cur.execute(f"SELECT * FROM {self._s}.claim(%s::text[], 0, 0, '')", (queues,)).fetchall())
            db.execute("SELECT count(pg_advisory_xact_lock(hashtextextended(%s || l.t, 0)))"
                       " FROM (SELECT t FROM unnest(%s::text[]) AS t ORDER BY t) l",
                       (f"tangguh-limit:{self.schema}:", types))
            # After the wait for the lock: a pause that committed meanwhile holds for this claim.
            queues = self._unpaused(db, queues)
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
                    candidates = due_rows(
                        db, t, queue, now, want, "d.id, d.type, d.resource_id",
                        "AND d.type <> ALL(%s::text[]) AND NOT (d.resource_id IS NOT NULL AND EXISTS ("
                        " SELECT 1 FROM unnest(%s::text[], %s::text[]) AS b(type, resource_id)"
                        " WHERE b.type = d.type AND b.resource_id = d.resource_id))",
                        (admission.blocked(), [b[0] for b in busy], [b[1] for b in busy]))
                    ids = [row[0] for row in candidates if admission.admit(row[1], row[2])]
                    if ids:
                        cur = db.cursor(row_factory=dict_row)
                        cur.execute(
                            f"UPDATE {t} j SET state = 'running', attempt = j.attempt + 1,"
                            f" token = {LEASE_TOKEN.replace('v_now', 'c.now')},"
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
            self._sql.extend,
            ([lease.job_id for lease in leases], [lease.token for lease in leases], float(lease_seconds)),
        ).fetchall()
        current = set(rows)
        return [lease for lease in leases if (lease.job_id, lease.token) not in current]

    def _finish(self, query, lease, params):
        cur = self._execute(query, dict(params, id=lease.job_id, token=lease.token))
        if cur.rowcount == 0:
            raise LeaseLost(lease.job_id, lease.token)

    def ack(self, lease, result=None, info=None):
        self._finish(self._sql.ack, lease, {"result": result_json(result), "info": info_json(info)})

    def ack_many(self, acks):
        """Every ack in one statement (one round trip, one commit)."""
        acks = list(acks)
        if not acks:
            return []
        rows = self._execute(self._sql.ack_many, (
            [lease.job_id for lease, _, _ in acks], [lease.token for lease, _, _ in acks],
            [result_json(result) for _, result, _ in acks], [info_json(info) for _, _, info in acks],
        )).fetchall()
        done = set(rows)
        return [lease for lease, _, _ in acks if (lease.job_id, lease.token) not in done]

    def retry(self, lease, run_at, error, info=None):
        self._finish(self._sql.retry, lease, {"run_at": float(run_at), "error": json.dumps(error),
                                              "info": info_json(info), "channel": self.channel})

    def dead(self, lease, reason, error, info=None):
        self._finish(self._sql.dead, lease, {"reason": reason, "error": json.dumps(error),
                                             "info": info_json(info)})

    def release(self, lease):
        self._finish(self._sql.release, lease, {"channel": self.channel})

    # -- reading ----------------------------------------------------------
    def get(self, job_id):
        if not isinstance(job_id, str) or not is_storable(job_id):
            return None  # no job has it (PostgreSQL refuses a NUL: an error read as an outage)
        row = self._execute(f"SELECT * FROM {self._jobs} WHERE id = %s", (job_id,), row_factory=dict_row).fetchone()
        return self._with_parents([Job.from_dict(row)])[0] if row else None

    def stats(self, queues, within=None):
        queues = [check_queue(q) for q in queues]  # a name no queue can have: BadInput, as on Redis
        out = {q: QueueStats(q) for q in queues}
        rows = self._stats_rows(stats_query(self._jobs, self._s), {"q": queues}, within)
        for queue, kind, count, age in rows:
            setattr(out[queue], {"running": "in_flight"}.get(kind, kind), count if kind != "paused" else True)
            if kind == "ready":
                out[queue].oldest_ready_age = max(0.0, age or 0.0)
        return out

    # -- dead letters -----------------------------------------------------
    def dlq_list(self, type=None, limit=100):
        limit, type = check_limit(limit), check_type(type)
        sql = f"SELECT * FROM {self._jobs} WHERE state = 'dead'"
        params = []
        if type:
            sql += " AND type = %s"
            params.append(type)
        sql += " ORDER BY finished_at DESC, id DESC LIMIT %s"
        params.append(None if limit is None else int(limit))
        return [Job.from_dict(r) for r in self._execute(sql, params, row_factory=dict_row).fetchall()]

    def _require_dead(self, db, job_ids):
        """Lock the jobs in id order; NotDead unless every one is dead. Returns (those with workflow
        children, those that are workflow children)."""
        child = "pending IS NOT NULL" if "pending" in self._columns(db) else "false"
        rows = db.execute(f"SELECT id, state, kids, {child} FROM {self._jobs}"
                          " WHERE id = ANY(%s::text[]) ORDER BY id FOR UPDATE", (list(job_ids),)).fetchall()
        states = {row[0]: row[1] for row in rows}
        for job_id in job_ids:
            state = states.get(job_id)
            if state != "dead":
                raise NotDead(f"job {job_id} is {'unknown' if state is None else state}, not dead")
        return [row[0] for row in rows if row[2]], {row[0] for row in rows if row[3]}

    @deadlock_retried
    def dlq_replay(self, job_ids):
        job_ids = check_ids(job_ids, most=None)
        with self._guard("dlq replay"):
            db = self._conn()
            try:
                with db.transaction():
                    parents, children = self._require_dead(db, job_ids)
                    self._lock_children(db, parents)  # reopened: before any of them
                    kept = replaykeys.hold(db, self._s, job_ids) if parents or children else None

                    def update(ids):
                        return db.execute(
                            f"UPDATE {self._jobs} SET state = 'queued', attempt = 0, run_at = {NOW}, reason = NULL,"
                            " finished_at = NULL, lease_until = NULL, owner = NULL, cancel_request = NULL,"
                            " expires_at = NULL WHERE id = ANY(%s::text[])"
                            " RETURNING pg_notify(%s, queue)", (ids, self.channel))
                    cleared, kin = ("cancel_request", "expires_at"), set(parents)
                    if len(kin) > 1 and replaykeys.keyed_descendants(db, self._s, kin):
                        # A parent a statement, in the order the other brokers reopen theirs (the
                        # call's, parents first): one statement met the rows in the table's order,
                        # which then chose which of two cancelled children with one key reopened.
                        plain = [i for i in job_ids if i not in children and i not in kin]
                        update(plain)
                        for job_id in self._parents_first(db, [i for i in job_ids if i in kin or i in children]):
                            if job_id in children:
                                self._put_back_level(db, [job_id], cleared)
                            else:
                                update([job_id])
                    else:
                        plain = [i for i in job_ids if i not in children]
                        update(plain)
                        # Then the workflow children, as a requeue puts them back (search.py):
                        # parents first, each waiting for its parents not finished now.
                        if children:
                            self._put_back_children(db, [i for i in job_ids if i in children], cleared)
                    if kept is not None:
                        replaykeys.release(db, self._s, kept)
            except pgerrors.UniqueViolation:
                held = self._first_held_key(db, job_ids)
                raise BadInput(f"cannot replay {held}: its idempotency key is held by an unfinished job") from None
        return job_ids

    def _first_held_key(self, db, job_ids):
        """The first of ``job_ids`` (the other brokers' order) whose key an unfinished job, or one
        of the ids before it, holds: the job a refused replay names."""
        rows = dict(db.execute(f"SELECT id, idempotency_key FROM {self._jobs} WHERE id = ANY(%s::text[])"
                               " AND idempotency_key IS NOT NULL", (job_ids,)).fetchall())
        held = {key for (key,) in db.execute(
            f"SELECT idempotency_key FROM {self._jobs} WHERE idempotency_key = ANY(%s::text[])"
            f" AND state IN {UNFINISHED}", (list(rows.values()),)).fetchall()}
        for job_id in job_ids:
            key = rows.get(job_id)
            if key in held:
                return job_id
            if key is not None:
                held.add(key)
        return "one of these jobs"  # the holder ended meanwhile

    @deadlock_retried
    def dlq_purge(self, job_ids):
        job_ids = check_ids(job_ids, most=None)
        with self._guard("dlq purge"):
            db = self._conn()
            with db.transaction():
                self._require_dead(db, job_ids)
                db.execute(f"DELETE FROM {self._jobs} WHERE id = ANY(%s::text[])", (job_ids,))
        return len(job_ids)

    def prune(self, done_older_than, budget=None):
        cutoff = self.now() - check_age(done_older_than)
        batch = int(self.prune_batch) if budget is None else max(1, min(int(self.prune_batch), int(budget)))
        sql = (f"DELETE FROM {self._jobs} WHERE id IN (SELECT id FROM {self._jobs}"
               " WHERE state = 'done' AND finished_at < %s LIMIT %s)")
        total = 0
        self._execute(f"DELETE FROM {self._s}.once_keys WHERE created_at < %s", (cutoff,))
        total += self._prune_ended(cutoff, batch, budget)  # cancelled and expired jobs: kept like done ones
        while budget is None or total < budget:
            deleted = self._execute(sql, (cutoff, batch)).rowcount
            total += deleted
            if deleted < batch:
                break
        return total

