"""The Redis broker's ``enqueue_once`` records: one per key, whatever the queue.

A key's record is two entries in a slot of its own (hash tag ``{~once}``; a
queue name cannot hold ``~``, so no queue's keys are there)::

    P:{~once}:queue   hash   key -> the queue its job went to (the first caller's)
    P:{~once}:at      zset   key -> first use (us): prune, last_once_key

``enqueue_once`` first claims the key there (``OWNER``: the queue already
recorded, or the caller's, recorded now), then runs the queue's
``enqueue_once`` script in *that* queue's slot, which keeps its own record
(``P:{Q}:once``) atomically with the job. So a key is enqueued once across
queues (a type moved to another queue by a reload, or two supervisors with
different queue settings in a rolling deploy), each script stays within one
slot (Redis Cluster), and a caller that stops between the two steps leaves
nothing lost: the next caller with that key finds the queue recorded and
enqueues there, once. Records written before this layout (``P:{Q}:once``
only) are still honoured within their queue.
"""
import dataclasses
import re

from .connection import guard

OWNER = """
local q = redis.call('HGET', KEYS[1], ARGV[1])
if q then return q end
local t = redis.call('TIME')
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], tonumber(t[1]) * 1000000 + tonumber(t[2]), ARGV[1])
return ARGV[2]
"""
FORGET = """
local old = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', '(' .. ARGV[1], 'LIMIT', 0, tonumber(ARGV[2]))
if #old > 0 then
  redis.call('HDEL', KEYS[1], unpack(old))
  redis.call('ZREM', KEYS[2], unpack(old))
end
return #old
"""
FORGET_BATCH = 1000


def _glob_literal(text):
    return re.sub(r"([\\*?\[\]])", r"\\\1", text)


class OnceRecords:
    def _once_keys(self):
        return [f"{self.keys.prefix}:{{~once}}:queue", f"{self.keys.prefix}:{{~once}}:at"]

    def _once_script(self, name, source):
        cache = self.__dict__.setdefault("_once_scripts", {})
        if name not in cache:
            cache[name] = self.r.register_script(source)  # redis-py resends it if the server lost it
        return cache[name]

    def _once_queue(self, job):
        """The job to enqueue: ``job``, or the same job on the queue its key was first recorded for."""
        queue = self._once_script("owner", OWNER)(keys=self._once_keys(), args=[job.idempotency_key, job.queue],
                                                  client=self.r)
        return job if queue == job.queue else dataclasses.replace(job, queue=queue)

    def _forget_once(self, cutoff_us):
        while self._once_script("forget", FORGET)(keys=self._once_keys(), args=[cutoff_us, FORGET_BATCH],
                                                  client=self.r) >= FORGET_BATCH:
            pass

    @guard
    def last_once_key(self, prefix):
        match = _glob_literal(prefix) + "*"
        names = [self._once_keys()[1]] + [self.keys.once(q) for q in sorted(self.r.smembers(self.keys.queues))]
        best = None
        for name in names:
            for key, _ in self.r.zscan_iter(name, match=match, count=1000):
                if key.startswith(prefix) and (best is None or key > best):
                    best = key
        return best
