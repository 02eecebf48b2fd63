"""The PostgreSQL broker's producing side: ``enqueue``, ``enqueue_many``, ``enqueue_once``.

A batch of plain jobs is one ``INSERT ... SELECT FROM unnest ... ON CONFLICT DO
NOTHING`` (statements.py); a job not inserted (its idempotency key held, its id
stored already) is looked up and answered, and the rest inserted again. A batch
with parents goes to workflows.py. With ``conn`` (the producer's psycopg
connection) it all runs inside the producer's transaction.
"""
from psycopg.rows import tuple_row

from ...errors import BadInput, BrokerError
from ...model import chosen_ids, first_token, id_taken, one_per_id
from .statements import NOW


class ProducingMixin:
    def enqueue(self, job, conn=None):
        return self.enqueue_many([job], conn=conn)[0]

    def enqueue_many(self, jobs, conn=None):
        """Store jobs in one statement; with ``conn`` (the producer's psycopg connection), inside
        its current transaction, so they exist if and only if the producer commits."""
        jobs = [job.validate() for job in jobs]
        if not jobs:
            return []
        unique, where = one_per_id(jobs)
        if where is not None:  # an id twice: its first job is stored, the others get its answer
            ids = self.enqueue_many(unique, conn=conn)
            return [ids[i] for i in where]
        if any(job.depends_on for job in jobs):
            return self._enqueue_flow(jobs, conn=conn)
        self._refuse_taken_ids(jobs, conn)  # before anything is stored
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
            rows = self._query(self._sql.existing, (keys, [jobs[i].id for i in missing]), conn)
            for row_id, key, state, _ in rows:
                if key is not None and state in ("queued", "running", "retrying", "waiting"):
                    by_key.setdefault(key, row_id)
            existing_ids = {row[0]: row[3] for row in rows}
            pending = []
            for i in missing:
                job = jobs[i]
                if job.id in existing_ids:  # before the key: a resend gets its own job, whoever took its key
                    if existing_ids[job.id] != job.queue:  # stored meanwhile by another producer
                        raise id_taken(job.id, existing_ids[job.id])
                    ids[i] = job.id
                elif job.idempotency_key is not None and job.idempotency_key in by_key:
                    ids[i] = by_key[job.idempotency_key]
                else:
                    pending.append(i)  # the holder finished meanwhile: insert again
            if not pending:
                break
        else:
            raise BrokerError("enqueue: could not settle idempotency keys under concurrent updates; try again")
        return [ids[i] for i in range(len(jobs))]

    def _refuse_taken_ids(self, jobs, conn):
        """BadInput for an id the caller chose that names a stored job of another queue."""
        chosen = chosen_ids(jobs)
        if chosen:
            for job_id, queue in self._query(self._sql.queues_of, (list(chosen),), conn):
                if queue != chosen[job_id]:
                    raise id_taken(job_id, queue)

    def _insert(self, jobs, conn):
        params = (
            [j.id for j in jobs], [j.queue for j in jobs], [j.type for j in jobs],
            [j.payload_json for j in jobs],
            [j.resource_id for j in jobs], [j.idempotency_key for j in jobs],
            [j.max_attempts for j in jobs], [None if j.timeout is None else float(j.timeout) for j in jobs],
            [j.priority for j in jobs], [float(j.delay) for j in jobs], [j.trace_id for j in jobs],
            [None if j.expires_in is None else float(j.expires_in) for j in jobs],
            [first_token(j) for j in jobs], self.channel,
        )
        return {row[0] for row in self._query(self._sql.enqueue, params, conn)}

    def _query(self, query, params, conn):
        """Rows of a query, on the producer's connection when one is given."""
        if conn is None:
            return self._execute(query, params).fetchall()
        with self._guard("query on the producer's connection"):
            cur = conn.cursor(row_factory=tuple_row)
            cur.execute(query, params)
            return cur.fetchall()

    def enqueue_once(self, job, schedule=None):
        job.validate()
        if job.idempotency_key is None:
            raise BadInput("enqueue_once needs an idempotency_key")
        with self._guard("enqueue once"):
            db = self._conn()
            with db.transaction():
                self._record_tick(db, schedule, job.idempotency_key)  # the schedule's newest tick, if one
                self._refuse_taken_ids([job], db)  # the id before the key, as on every way in
                # A second caller waits here on the first one's uncommitted key, then inserts nothing.
                if db.execute(f"INSERT INTO {self._s}.once_keys (key, created_at) VALUES (%s, {NOW})"
                              " ON CONFLICT DO NOTHING RETURNING key", (job.idempotency_key,)).fetchone() is None:
                    return None
                return self.enqueue_many([job], conn=db)[0]
