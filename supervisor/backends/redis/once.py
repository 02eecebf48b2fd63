"""The Redis broker's ``enqueue_once`` records: one per key, whatever the queue.

A key's record is two entries in a slot of its own (hash tag ``{~once}``; a
queue name cannot hold ``~``, so no queue's keys are there)::

    P:{~once}:queue   hash   key -> the queue its job went to (the first caller's)
    P:{~once}:at      zset   key -> first use (us): prune
    P:{~once}:ticks   hash   schedule name -> its newest tick key (never pruned)

``enqueue_once`` first claims the key there (``OWNER``: the queue already
recorded, or the caller's, recorded now), then runs the queue's
``enqueue_once`` script in *that* queue's slot, which keeps its own record
(``P:{Q}:once``) atomically with the job; with ``schedule=name`` it then moves
that name's tick record forward to the key (``TICK``). So a key is enqueued once across
queues (a type moved to another queue by a reload, or two supervisors with
different queue settings in a rolling deploy), each script stays within one
slot (Redis Cluster), and a caller that stops between the two steps leaves
nothing lost: the next caller with that key finds the queue recorded and
enqueues there, once. Records written before this layout (``P:{Q}:once``
only) are still honoured within their queue.
"""
import copy

from .connection import guard

OWNER = """
local q = redis.call('HGET', KEYS[1], ARGV[1])
if q then return q end
local t = redis.call('TIME')
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], tonumber(t[1]) * 1000000 + tonumber(t[2]), ARGV[1])
return ARGV[2]
"""
# A schedule's newest tick moves forward only once its job is stored (or found stored): moved
# before, a caller that stopped between the two left the tick recorded and never enqueued, and
# the scheduler, which looks back to the newest recorded tick only, never ran it.
TICK = """
local newest = redis.call('HGET', KEYS[1], ARGV[2])
if not newest or newest < ARGV[1] then redis.call('HSET', KEYS[1], ARGV[2], ARGV[1]) end
return 0
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


class OnceRecords:
    def _once_keys(self):
        return [f"{self.keys.prefix}:{{~once}}:{part}" for part in ("queue", "at", "ticks")]

    def _once_script(self, name, source):
        cache = self.__dict__.setdefault("_once_scripts", {})
        if name not in cache:
            cache[name] = self.r.register_script(source)  # redis-py resends it if the server lost it
        return cache[name]

    def _once_queue(self, job):
        """The job to enqueue: ``job``, or the same job on the queue its key was first recorded for."""
        args = [job.idempotency_key, job.queue]
        queue = self._once_script("owner", OWNER)(keys=self._once_keys(), args=args, client=self.r)
        if queue == job.queue:
            return job
        moved = copy.copy(job)  # not dataclasses.replace: a copy keeps the payload's JSON as checked
        moved.queue = queue
        return moved

    def _note_tick(self, key, schedule):
        """``schedule``'s newest tick is ``key`` now, unless a later one is recorded."""
        self._once_script("tick", TICK)(keys=self._once_keys()[2:], args=[key, schedule], client=self.r)

    def _stored_by_first_sending(self, job):
        """An ``enqueue_once`` sent twice (an answer lost) found its key taken: by this very job,
        stored by the first sending? Its trace id tells it from a job an earlier call stored under
        an id the caller chose again (each ``NewJob`` draws its own, unless the caller passes one)."""
        stored = self.get(job.id)
        return (stored is not None and stored.idempotency_key == job.idempotency_key
                and stored.trace_id == job.trace_id)

    def _forget_once(self, cutoff_us):
        while self._once_script("forget", FORGET)(keys=self._once_keys(), args=[cutoff_us, FORGET_BATCH],
                                                  client=self.r) >= FORGET_BATCH:
            pass

    @guard
    def last_tick_key(self, schedule):
        return self.r.hget(self._once_keys()[2], schedule)  # by exact name: one HGET, no scan
