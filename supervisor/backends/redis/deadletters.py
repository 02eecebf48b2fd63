"""The Redis broker's dead-letter queue: list, replay and purge across queues.

A mixin of ``RedisBroker``. Each queue keeps its dead jobs in ``P:{Q}:dead``
(a zset by failure time); the list merges the queues' newest. Replay and purge
check every id first (``NotDead``), then run one all-or-nothing script per queue.
"""
from ...errors import NotDead
from .. import control
from .connection import guard
from .fields import check_script_reply, to_job


class DeadLetters:
    @guard
    def dlq_list(self, type=None, limit=100):
        limit, type = control.check_limit(limit), control.check_type(type)
        picked = []
        for queue in sorted(self.r.smembers(self.keys.queues)):
            picked.extend(self._dead_in(queue, type, limit))
        picked.sort(reverse=True)  # failure time desc, then id desc
        if limit is not None:
            picked = picked[:limit]
        if not picked:
            return []
        pipe = self.r.pipeline(transaction=False)
        for _, job_id, queue in picked:
            pipe.hgetall(self.keys.job(queue, job_id))
        return [to_job(fields) for fields in pipe.execute() if fields]

    def _dead_in(self, queue, type, limit):
        """(score, id, queue) of the newest dead jobs of one queue, at most ``limit``."""
        key = self.keys.dead(queue)
        page = max(1, min(limit, 500)) if limit is not None and type is None else 500
        out, start = [], 0
        while limit is None or len(out) < limit:
            rows = self.r.zrevrange(key, start, start + page - 1, withscores=True)
            if not rows:
                break
            start += len(rows)
            if type is not None:
                pipe = self.r.pipeline(transaction=False)
                for job_id, _ in rows:
                    pipe.hget(self.keys.job(queue, job_id), "type")
                rows = [row for row, t in zip(rows, pipe.execute()) if t == type]
            out.extend((score, job_id, queue) for job_id, score in rows)
        return out if limit is None else out[:limit]

    def _group_dead(self, job_ids):
        """Check every id is dead (NotDead otherwise); group them by queue."""
        found = self._locator.find(job_ids)
        groups = {}
        for job_id in job_ids:
            if job_id not in found or found[job_id][1].get("state") != "dead":
                state = found[job_id][1].get("state") if job_id in found else "unknown"
                raise NotDead(f"job {job_id} is {state}, not dead")
            groups.setdefault(found[job_id][0], []).append(job_id)
        return groups

    @guard
    def dlq_replay(self, job_ids):
        job_ids = control.check_ids(job_ids, most=None)
        groups = self._group_dead(job_ids)
        if len(groups) > 1:
            self._refuse_held_keys(groups)
        for queue, ids in groups.items():
            self._run_dead("replay", queue, ids)
        return list(job_ids)

    def _refuse_held_keys(self, groups):
        """BadInput before the first queue's script when a job of any queue has an idempotency key
        an unfinished job holds. Each script is all or nothing within its queue only: a conflict
        found by a later queue's script left the queues before it replayed (the SQL brokers'
        replay is one transaction). What another producer takes between this look and the
        scripts is still found by its script."""
        asks = [(queue, job_id) for queue, ids in groups.items() for job_id in ids]
        keys = self._each(lambda pipe, queue, job_id: pipe.hget(self.keys.job(queue, job_id), "idempotency_key"), asks)
        asks = [(queue, job_id, key) for (queue, job_id), key in zip(asks, keys) if key]
        holders = self._each(lambda pipe, queue, _, key: pipe.hget(self.keys.for_scripts(queue)[0][5], key), asks)
        held = [(queue, job_id, holder) for (queue, job_id, _), holder in zip(asks, holders) if holder not in (None, job_id)]
        states = self._each(lambda pipe, queue, _, holder: pipe.hget(self.keys.job(queue, holder), "state"), held)
        for (_, job_id, _), state in zip(held, states):
            if state in ("queued", "running", "retrying", "waiting"):
                check_script_reply(["conflict", job_id])

    def _each(self, ask, rows):
        """One round trip of plain commands (a pipeline, on a cluster too): ``ask(pipe, *row)`` a row."""
        if not rows:
            return []
        pipe = self.r.pipeline(transaction=False)
        for row in rows:
            ask(pipe, *row)
        return pipe.execute()

    @guard
    def dlq_purge(self, job_ids):
        job_ids = control.check_ids(job_ids, most=None)
        count = 0
        for queue, ids in self._group_dead(job_ids).items():
            reply = self._run_dead("purge", queue, ids)
            count += len(ids) if reply is None else int(reply[1])
        return count

    def _run_dead(self, name, queue, ids):
        """The replay or purge script's checked reply; None when it was sent twice (an answer lost)
        and its second sending found a job no longer dead, while every job now is what the call
        asked for (replayed: there and not dead; purged: gone). Every id was dead a moment ago
        (``_group_dead``) and the script is all or nothing, so the first sending did it all, or
        another operator did the same to every one in between: the jobs are as asked either way
        (a purge then counts them as its own). Any other state: the "not dead" answer stands."""
        resent = self.calls_resent
        reply = self._run(name, queue, ids)
        if reply[0] == "notdead" and self.calls_resent != resent:
            found = self._locator.find(ids)
            if name == "purge":
                done = not any(job_id in found for job_id in ids)
            else:
                done = all(job_id in found and found[job_id][1].get("state") != "dead" for job_id in ids)
            if done:
                return None
        return check_script_reply(reply)
