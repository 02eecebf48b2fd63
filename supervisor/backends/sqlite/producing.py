"""The SQLite broker's producing side: enqueue in one short write transaction.

A batch is one ``executemany`` of its plain jobs; a job with parents, an
idempotency key or an id the caller chose takes a look at what is stored
first (workflows.py stores the edges).
"""
import contextlib

from ...dependencies import order
from ...errors import BadInput
from ...model import chosen_ids, first_token_at, id_taken, one_per_id


class ProducingMixin:
    def enqueue(self, job):
        return self.enqueue_many([job])[0]

    def enqueue_many(self, jobs, _in_tx=False):
        jobs = [job.validate() for job in jobs]
        unique, where = one_per_id(jobs)
        if where is not None:  # an id twice: its first job is stored, the others get its answer
            ids = self.enqueue_many(unique, _in_tx)
            return [ids[i] for i in where]
        now = self.now()
        stored = {}  # NewJob id -> the id it is stored under
        rows = []
        chosen = chosen_ids(jobs)
        with contextlib.nullcontext() if _in_tx else self._write():
            # id -> queue of the ids stored already: every id, not only the chosen ones (about
            # 0.3 us a job), so that the same NewJob sent again (an id made for it, a producer's
            # retry) is answered as a resend, as on the other brokers, not as a UNIQUE failure.
            taken = self._queues_of(job.id for job in jobs)
            for job in order(jobs):  # parents first; BadInput on a cycle
                if job.id in taken:
                    if taken[job.id] != job.queue:
                        raise id_taken(job.id, taken[job.id])
                    stored[job.id] = job.id  # a resend of a job it named: stored once
                    continue
                if job.id in chosen:
                    taken[job.id] = job.queue  # the same id again later in this batch is the same job
                if job.idempotency_key is not None:
                    row = self.db.execute(
                        "SELECT id FROM jobs WHERE idempotency_key = ?"
                        " AND state IN ('queued','running','retrying','waiting')",
                        (job.idempotency_key,),
                    ).fetchone()
                    if row:
                        stored[job.id] = row["id"]
                        continue
                if job.depends_on:
                    self._insert(rows)  # its parents first
                    rows = []
                    stored[job.id] = self._insert_child(job, now, stored)
                    continue
                rows.append((job.id, job.queue, job.type, job.payload_json, job.resource_id,
                             job.idempotency_key, job.max_attempts, job.timeout, job.priority, now + job.delay, now,
                             job.trace_id, None if job.expires_in is None else now + job.expires_in,
                             first_token_at(job, now)))
                stored[job.id] = job.id
                if job.idempotency_key is not None:
                    self._insert(rows)  # now: a later job of this batch with the same key must see it
                    rows = []
            self._insert(rows)  # the others in one statement
        return [stored[job.id] for job in jobs]

    def _queues_of(self, ids):
        found = {}
        ids = list(ids)
        for start in range(0, len(ids), 500):  # under SQLite's limit of bound parameters
            chunk = ids[start:start + 500]
            found.update(self.db.execute(f"SELECT id, queue FROM jobs WHERE id IN ({','.join('?' * len(chunk))})",
                                         chunk).fetchall())
        return found

    def _insert(self, rows):
        if rows:
            self.db.executemany(
                "INSERT INTO jobs (id, queue, type, payload, state, resource_id, idempotency_key,"
                " max_attempts, timeout, priority, run_at, queued_at, trace_id, expires_at, token)"
                " VALUES (?, ?, ?, ?, 'queued', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)

    def enqueue_once(self, job, schedule=None):
        job.validate()
        if job.idempotency_key is None:
            raise BadInput("enqueue_once needs an idempotency_key")
        with self._write():
            if schedule is not None:  # the schedule's newest tick, only forward; prune never deletes it
                self.db.execute("INSERT INTO schedule_ticks (name, key) VALUES (?, ?) ON CONFLICT (name)"
                                " DO UPDATE SET key = excluded.key WHERE excluded.key > schedule_ticks.key",
                                (schedule, job.idempotency_key))
            chosen = chosen_ids([job])  # the id before the key, as on every way in
            for job_id, queue in self._queues_of(chosen).items():
                if queue != chosen[job_id]:
                    raise id_taken(job_id, queue)
            inserted = self.db.execute("INSERT OR IGNORE INTO once_keys (key, created_at) VALUES (?, ?)",
                                       (job.idempotency_key, self.now())).rowcount
            if not inserted:
                return None
            return self.enqueue_many([job], _in_tx=True)[0]

    def last_tick_key(self, schedule):
        row = self._connection().execute("SELECT key FROM schedule_ticks WHERE name = ?", (schedule,)).fetchone()
        return None if row is None else row[0]
