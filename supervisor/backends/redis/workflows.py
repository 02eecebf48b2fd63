"""Workflows on Redis: a workflow's jobs share one queue, so every release is one script in one slot.

The choice: a job and its parents are in the same queue (the same hash slot,
``{queue}``). Then the script that ends a parent (ack, ack_many, dead, a
lease expiring into dead) also records the end on each child and releases
the child whose last parent it was (``redis_lua/_flows.lua``): one atomic
script, on a single node or a Cluster, so no crash and no race can release a
child twice or never. A parent in another queue is refused at enqueue like an
unknown one; a workflow spanning queues needs a broker with transactions
across them (SQLite, PostgreSQL).

A whole workflow is one ``enqueue_flow.lua`` call: every job of it is stored
or none (the script checks every parent before writing anything).
"""
import json

from ...dependencies import MAX_LEVELS, level_of, order
from ...errors import BadInput
from .fields import enqueue_args


class Workflows:
    """The Redis broker's workflow operations (a mixin of ``RedisBroker``)."""

    def _enqueue_flow(self, jobs, once=None):
        """The ids of a workflow's jobs, stored in one script call; with ``once`` (enqueue_once's
        key, for a job with parents) ``[None]`` when that key was used already."""
        queues = sorted({job.queue for job in jobs})
        if len(queues) > 1:
            raise BadInput(f"on redis, an enqueue with depends_on keeps every job in one queue"
                           f" (one hash slot), got {', '.join(queues)}")
        queue = queues[0]
        self.keys.for_scripts(queue)  # rejects a bad name before anything is stored
        payload = []
        for job in order(jobs):
            args = enqueue_args(job)  # [id, priority, delay, fields] + [ikey or false[, expires_in_us]]
            args += [False] * (6 - len(args))
            args.append([[parent, on] for parent, on in job.depends_on])
            payload.append(args)
        batch = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
        (reply,) = self._run_enqueues([("enqueue_flow", queue, [batch, MAX_LEVELS] + ([once] if once else []))])
        if reply[0] == "once":
            return [None] * len(jobs)
        if reply[0] == "deep":
            level_of(reply[1], [int(reply[2]) - 1])  # raises BadInput, the same words as every broker
        if reply[0] == "unknown":
            raise BadInput(f"job {reply[1]} depends on unknown job {reply[2]}"
                           f" (on redis a job's parents are in its queue, {queue!r})")
        stored = dict(zip((args[0] for args in payload), reply[1:]))
        return [stored[job.id] for job in jobs]
