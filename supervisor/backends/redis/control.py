"""The Redis broker's job-control operations: cancel, renew, pause, expiry, wait, supervisor records.

A mixin of ``RedisBroker``. The state changes are scripts of ``redis_lua/``
(``cancel``, ``renew``, ``cancelled``; expiry and pauses inside ``claim``),
with their keys in each queue's slot (see ``_control.lua``):
``P:{Q}:paused`` (the pause), ``P:{Q}:expiring``, ``P:{Q}:cancelled`` and
``P:{Q}:expired``. Outside the slots, ``P:supervisors`` is a hash of the
supervisor records (id -> JSON).

``wait`` subscribes to ``P:wakeup:done``, marks the job ``waited``, and
re-reads the job on each message and at least every ``WAIT_FALLBACK`` seconds
(a pub/sub message is lost if the subscription's connection drops).
"""
import json
import os
import time

from redis.exceptions import RedisError

from ...errors import LeaseLost
from ...jsonvalues import info_members
from ...model import EXPIRED, Renewal, check_queue
from .. import control
from .connection import guard
from .fields import from_claim

WAIT_FALLBACK = 1.0
# Ids in one cancel script: Redis answers no other client while a script runs, and a cancel of
# 10,000 ids (a big batch's members, cancel_batch) held it for half a second; each id is its own
# change, so the calls, sent in one round trip, let other clients in between them.
CANCEL_SCRIPT_IDS = 1000


class ControlMixin(control.ExpiredLog):
    def _done_channel(self):
        return self.keys.channel + ":done"

    def _paused_key(self, queue):
        return f"{self.prefix}:{{{check_queue(queue)}}}:paused"

    # -- cancel --------------------------------------------------------------
    @guard
    def cancel(self, job_ids, by, reason):
        job_ids = control.check_ids(job_ids)
        request = control.cancel_request(by, reason, None)
        found = self._locator.find(job_ids, fetch=False)
        groups = {}
        for job_id in job_ids:
            if job_id in found:
                groups.setdefault(found[job_id][0], []).append(job_id)
        answers = {}
        head = [json.dumps(request["by"]), json.dumps(request["reason"])]
        chunks = [(queue, ids[i:i + CANCEL_SCRIPT_IDS]) for queue, ids in groups.items()
                  for i in range(0, len(ids), CANCEL_SCRIPT_IDS)]
        calls = [("cancel", queue, head + ids) for queue, ids in chunks]
        for (_, ids), got in zip(chunks, self._run_many(calls) if calls else ()):
            answers.update(zip(ids, got))
        return {job_id: answers.get(job_id, "unknown") for job_id in job_ids}

    @guard
    def renew(self, leases, lease_seconds, progress=None, queues=None):
        leases = list(leases)
        progress = progress or {}
        renewal = Renewal()
        lease_us = max(1, int(lease_seconds * 1e6))
        self._locator.renewing(lease.job_id for lease in leases)
        # The heartbeat's own broker never claimed these: their queues are looked up, the served ones
        # first (every queue ever named holds them otherwise: P:queues only grows).
        where = self._locator.queues_of([lease.job_id for lease in leases], first=queues)
        groups = {}
        for lease in leases:
            queue = where.get(lease.job_id)
            if queue is None:
                renewal.lost.append(lease)
            else:
                groups.setdefault(queue, []).append(lease)
        calls = []
        for queue, group in groups.items():
            args = [lease_us]
            for lease in group:
                fraction, note = control.progress_value(progress[lease.job_id]) if lease.job_id in progress \
                    else (None, None)
                args += [lease.job_id, lease.token, "" if fraction is None else repr(fraction), note or ""]
            calls.append(("renew", queue, args))
        for group, (lost, cancel) in zip(groups.values(), self._run_many(calls) if calls else ()):
            renewal.lost.extend(group[p - 1] for p in lost)
            for job_id, request in zip(cancel[::2], cancel[1::2]):
                renewal.cancel[job_id] = json.loads(request)
        order = {id(lease): i for i, lease in enumerate(leases)}
        renewal.lost.sort(key=lambda lease: order[id(lease)])
        return renewal

    @guard
    def cancelled(self, lease, info=None):
        queue = self._locator.queues_of([lease.job_id]).get(lease.job_id)
        if queue is None or not self._run("cancelled", queue, [lease.job_id, lease.token, info_members(info)],
                                          confirm=True):
            raise LeaseLost(lease.job_id, lease.token)
        self._locator.forget(lease.job_id)

    # -- pause -----------------------------------------------------------------
    @guard
    def pause(self, queue, by=None):
        key = self._paused_key(queue)
        request = control.cancel_request(by, None, self.now())
        # The pause first, then the name, one after the other (on a cluster they lie on two nodes): a
        # prune in between sees the pause and keeps the queue's name (prune.lua).
        self.r.set(key, json.dumps({"by": request["by"], "at": request["at"]}), nx=True)
        self.r.sadd(self.keys.queues, queue)

    @guard
    def resume(self, queue):
        # An empty queue's name goes with its pause (resume.lua), as the SQL brokers list it no more.
        if not self.cluster:
            self._run_many([("resume", queue, [])], more_keys=(self.keys.queues,))
        elif self._run("resume", queue, []):
            self._forget_queue(queue)  # the set lies in another slot: as prune does (prune.py)

    @guard
    def paused(self, queues=None):
        # Not every queue ever named when the caller says which: producers may name thousands.
        queues = sorted(self.r.smembers(self.keys.queues)) if queues is None else sorted(set(queues))
        if not queues:
            return {}
        pipe = self.r.pipeline(transaction=False)  # one slot per queue: no cross-slot MGET
        for q in queues:
            pipe.get(self._paused_key(q))
        values = pipe.execute()
        return {q: json.loads(v) for q, v in zip(queues, values) if v is not None}

    @guard
    def queues(self):
        return sorted(set(self.r.smembers(self.keys.queues)) | control.record_queues(self.supervisors()))

    # -- expiry (what claim returned) ----------------------------------------------
    def _leased(self, queue, reply):
        """The claim script's reply (a JSON array of rows) as jobs, minus the ones it ended
        ``expired`` (recorded here)."""
        jobs = []
        for row in json.loads(reply):
            job = from_claim(row)
            if job.state == EXPIRED:
                self._expired_log.append((job.id, job.type))
            else:
                self._locator.remember(job.id, queue)
                jobs.append(job)
        return jobs

    # -- wait ------------------------------------------------------------------
    @guard
    def wait(self, job_id, timeout):
        control.check_id(job_id)
        control.check_timeout(timeout)
        channel = self._done_channel()
        pubsub, kept = self._wait_subscription(channel), False
        try:
            # Subscribed (confirmed) first, then marked: no finish is missed.
            _until_subscribed(pubsub, channel, time.monotonic() + 5.0)
            queue = self._locator.queues_of([job_id]).get(job_id)
            if queue is not None:
                self._run("mark_waited", queue, [job_id])

            def block(seconds):
                deadline = time.monotonic() + seconds
                try:
                    while time.monotonic() < deadline:
                        message = pubsub.get_message(timeout=deadline - time.monotonic())
                        if message is not None and message["type"] == "message":
                            return
                except RedisError:
                    pass  # the subscription broke: the fallback re-read carries on
            job = control.wait_finished(job_id, lambda: self.get(job_id), block, timeout, WAIT_FALLBACK)
            kept = self._keep_wait_subscription(pubsub, channel)
            return job
        finally:
            if not kept:
                _close_quietly(pubsub)

    def _wait_subscription(self, channel):
        """A pub/sub connection subscribing to ``channel``: the one the last wait kept, else a new
        one (a caller waiting on job after job opens one connection, not one per wait). A kept one
        the server closed meanwhile is reconnected by the client's one immediate retry."""
        kept = self.__dict__.pop("_kept_pubsub", None)
        # An inherited one is the parent's socket: dropped, never used.
        pubsub = kept[1] if kept is not None and kept[0] == os.getpid() else self.r.pubsub()
        try:
            pubsub.subscribe(channel)
        except BaseException:
            _close_quietly(pubsub)
            raise
        return pubsub

    def _keep_wait_subscription(self, pubsub, channel):
        if "_kept_pubsub" in self.__dict__:
            return False
        try:
            pubsub.unsubscribe(channel)
        except (RedisError, OSError):
            return False
        self._kept_pubsub = (os.getpid(), pubsub)
        return True

    def _close_wait_subscription(self):
        kept = self.__dict__.pop("_kept_pubsub", None)
        if kept is not None and kept[0] == os.getpid():
            _close_quietly(kept[1])

    # -- supervisor records --------------------------------------------------------
    @property
    def _records_key(self):
        return f"{self.prefix}:supervisors"

    @guard
    def write_supervisor(self, record, ttl):
        sid, text = control.check_record(record, ttl)
        now = self.now()
        self.r.hset(self._records_key, sid, json.dumps({"record": text, "at": now, "ttl": ttl}))
        self._records(now, forget=True)

    def _records(self, now, forget=False):
        """The stored records still shown; with ``forget``, the others are deleted."""
        shown, old = [], []
        for sid, raw in sorted(self.r.hgetall(self._records_key).items()):
            try:
                stored = json.loads(raw)
                if stored["at"] + stored["ttl"] + control.GONE_FOR < now:
                    old.append(sid)
                else:
                    shown.append(control.shown_record(stored["record"], stored["at"], stored["ttl"], now))
            except (ValueError, KeyError, TypeError):
                old.append(sid)  # not a record this code wrote
        if forget and old:
            self.r.hdel(self._records_key, *old)
        return shown

    @guard
    def supervisors(self):
        return self._records(self.now())

    @guard
    def remove_supervisor(self, supervisor_id):
        control.check_id(supervisor_id, "supervisor")
        self.r.hdel(self._records_key, supervisor_id)


def _until_subscribed(pubsub, channel, deadline):
    """Read up to the confirmation of this subscription: what a kept connection's earlier
    wait left unread (its unsubscribe's reply, a late message) is skipped."""
    while time.monotonic() < deadline:
        message = pubsub.get_message(timeout=deadline - time.monotonic())
        if message is not None and message["type"] == "subscribe" and message["channel"] == channel:
            return


def _close_quietly(pubsub):
    try:
        pubsub.close()
    except (RedisError, OSError):
        pass
