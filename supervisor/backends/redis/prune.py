"""The Redis broker's prune: finished jobs past the retention leave, a batch at a time.

A mixin of ``RedisBroker``. ``prune.lua`` runs once per queue and call: it
deletes up to a batch of done, cancelled and expired jobs with their search
entries, trims the queue's ``enqueue_once`` records, and sweeps a batch of what
nothing else removes (search entries of hashes that expired, exclusive types'
resource fields of jobs no longer running). ``P:queues`` keeps every queue name
producers ever used, and the master prunes inside its loop, so the calls go
``CHUNK`` queues a round trip: 20,000 names took 3.0 s a prune one by one, and
take 0.8 s so (``python -m bench.prune_queues``). A queue whose batch was full
goes again. ``budget`` is shared out among a round trip's queues, so one call
deletes about that many jobs at most.
"""
from .connection import guard

BATCH = 1000  # jobs a queue's prune call deletes at most, and what each sweep reads
CHUNK = 64  # queues a round trip


class Pruning:
    @guard
    def prune(self, done_older_than, budget=None):
        age_us = max(0, int(done_older_than * 1e6))
        done_age_us = min(age_us, self.done_ttl * 1_000_000)  # at done_ttl at the latest, hash and all
        deleted = 0
        queues = sorted(self.r.smembers(self.keys.queues))
        if queues:  # enqueue_once records older than the horizon (each queue's own: its prune call)
            self._forget_once(int(self.now() * 1e6) - age_us)
        while queues:
            again = []
            for start in range(0, len(queues), CHUNK):
                chunk = queues[start:start + CHUNK]
                share = BATCH if budget is None else max(1, min(BATCH, (budget - deleted) // len(chunk)))
                rows = self._run_many([("prune", queue, [age_us, share, done_age_us, BATCH]) for queue in chunk])
                for queue, (jobs, found) in zip(chunk, rows):
                    deleted += jobs
                    if found >= share:  # a full batch: more behind it
                        again.append(queue)
                if budget is not None and deleted >= budget:
                    return deleted
            queues = again
        return deleted
