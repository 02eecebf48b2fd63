"""The Redis broker's prune: finished jobs past the retention leave, a batch at a time.

A mixin of ``RedisBroker``. ``prune.lua`` runs once per queue and call: it
deletes up to a batch of done, cancelled and expired jobs (the three together)
with their search entries, trims the queue's ``enqueue_once`` records, sweeps a
batch of what nothing else removes (search entries of hashes that expired,
exclusive types' resource fields of jobs no longer running), and takes the name
of a queue with nothing left out of ``P:queues``. The master prunes inside its
loop and ``P:queues`` names every queue producers use, so the calls go ``CHUNK``
queues a round trip: over 20,000 queues of one job each a prune took 3.2 s one
by one and takes 1.1 s so (bench/README.md, "A twenty-seventh machine"). A
queue whose call read a whole batch and took some of it out goes again.
``budget`` is shared out among a round trip's queues, so one call deletes at
most the budget plus ``CHUNK``.
"""
from .. import control
from .connection import guard

BATCH = 1000  # jobs a queue's prune call deletes at most, and what each sweep reads
CHUNK = 64  # queues a round trip


class Pruning:
    @guard
    def prune(self, done_older_than, budget=None):
        age_us = max(0, int(control.check_age(done_older_than) * 1e6))
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
                calls = [("prune", queue, [age_us, share, done_age_us, BATCH]) for queue in chunk]
                for queue, (jobs, more, nothing_left) in zip(chunk, self._run_many(
                        calls, more_keys=(self.keys.queues,))):
                    deleted += jobs
                    if more:
                        again.append(queue)
                    elif nothing_left and self.cluster:
                        self._forget_queue(queue)
                if budget is not None and deleted >= budget:
                    return deleted
            queues = again
        return deleted

    def _forget_queue(self, queue):
        """On a cluster, take the name of a queue its prune call found empty out of ``P:queues``
        (in another slot than the queue's: not in its script), then ask the queue again and put
        the name back if an enqueue filled it meanwhile, or if the question fails. An enqueue
        adds its queue's name after its script too (calls.py): whichever comes last, a queue
        with jobs keeps its name."""
        self.r.srem(self.keys.queues, queue)
        filled = True
        try:
            filled = not self._run("queue_empty", queue, [])
        finally:
            if filled:
                self.r.sadd(self.keys.queues, queue)
