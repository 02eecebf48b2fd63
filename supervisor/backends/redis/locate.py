"""Finding a job's queue from its id.

There is no id -> queue index in Redis (it would cost a write per job and
could not be expired with the done TTL). The broker remembers the queue of the
jobs it claimed or looked up (a bounded cache), and otherwise probes every
known queue in one pipelined round trip: ``get``, ``dlq_*``, and the first
``extend`` or finish call for leases another instance claimed (the heartbeat
thread's own broker) take that path.
"""
import itertools

WHERE_MAX = 100_000  # job id -> queue cache bound


class Locator:
    def __init__(self, client, keys):
        self.client, self.keys = client, keys
        self.known = {}  # job id -> queue, for jobs this instance claimed or looked up
        self.renewed = set()  # the ids the last ``renew`` held

    def remember(self, job_id, queue):
        if len(self.known) >= WHERE_MAX:
            # The oldest quarter goes (a dict keeps insertion order), not all: emptied, every
            # lease held would cost a probe of every queue ever named at its next renewal.
            for old in list(itertools.islice(self.known, WHERE_MAX // 4)):
                del self.known[old]
        self.known[job_id] = queue

    def renewing(self, job_ids):
        """``renew`` holds these now. An id the previous renewal held and this one does not has
        finished elsewhere (the heartbeat's instance never sees the ack): its entry goes, so a
        renewing instance keeps entries for what it holds, not for every job it ever renewed."""
        job_ids = set(job_ids)
        for gone in self.renewed - job_ids:
            self.known.pop(gone, None)
        self.renewed = job_ids

    def forget(self, job_id):
        self.known.pop(job_id, None)

    def find(self, job_ids, fetch=True, first=None):
        """{id: (queue, fields)} for the ids that exist, probing every known queue at once.

        With ``fetch=False`` the fields are not read (``{}``): only the queue is wanted.
        ``first``: queues to probe before the others, which are probed only for the ids
        not found there: a probe costs a command per id and queue, and a producer may
        have named thousands of queues.
        """
        job_ids = list(dict.fromkeys(job_ids))
        if first and job_ids:
            found = self._probe(job_ids, sorted(set(first)), fetch)
            rest = [job_id for job_id in job_ids if job_id not in found]
            if rest:
                others = self.client.smembers(self.keys.queues) - set(first)
                found.update(self._probe(rest, sorted(others), fetch))
            return found
        queues = sorted(self.client.smembers(self.keys.queues)) if job_ids else []
        return self._probe(job_ids, queues, fetch)

    def _probe(self, job_ids, queues, fetch):
        if not queues or not job_ids:
            return {}
        pipe = self.client.pipeline(transaction=False)
        pairs = [(job_id, q) for job_id in job_ids for q in queues]
        for job_id, q in pairs:
            key = self.keys.job(q, job_id)
            pipe.hgetall(key) if fetch else pipe.exists(key)
        found = {}
        for (job_id, q), fields in zip(pairs, pipe.execute()):
            if fields:
                found[job_id] = (q, fields if fetch else {})
        return found

    def queues_of(self, job_ids, first=None):
        """{id: queue} for the ids that exist: from the cache, else a probe for all the rest (``find``)."""
        out = {job_id: self.known[job_id] for job_id in job_ids if job_id in self.known}
        missing = [job_id for job_id in job_ids if job_id not in out]
        for job_id, (queue, _) in self.find(missing, fetch=False, first=first).items():
            self.remember(job_id, queue)
            out[job_id] = queue
        return out
