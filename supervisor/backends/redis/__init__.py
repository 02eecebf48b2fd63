"""The Redis broker: every state change is one Lua script on one queue's keys.

The package's parts: ``connection`` (the URL, the client, errors as
BrokerError), ``keys`` (the key layout), ``scripts`` (the Lua scripts in
``redis_lua/``), ``fields`` (jobs to and from the scripts' strings), ``locate``
(finding a job's queue from its id), ``claims`` (the claim, queue by queue),
``search`` (search, count, requeue, discard: the search index and its bounds);
the other operations are here.

Every state change (enqueue, claim, extend, ack, retry, dead, release, replay,
purge, prune) is one script that reads the clock with ``TIME`` and touches one
queue's slot only (see ``keys``), except that the enqueue scripts also add
the queue's name to ``P:queues``, given to them as one more key, so a queue is
known as soon as it holds a job (on a cluster, where ``P:queues`` lies outside
the queue's slot, a ``SADD`` round trip before the script does it: ``calls``).
Sentinel, Cluster and ``wait_replicas``: see ``connection`` and ``calls``.

Semantics beyond the shared contract:

* Idempotency keys dedup per queue (one hash per slot): the same key in two
  queues names two jobs. A finished job frees its key; dlq replay takes it back
  and raises ``BadInput`` if another unfinished job holds it by then.
* ``claim`` reclaims expired leases of the queues it claims from (bounded per
  call), those after a queue that filled it at most every second; a queue nobody
  claims from keeps its expired leases until someone does.
* ``claim`` with limits (``claim_limited.lua``) keeps the limit state in the
  queue's slot: a type enqueued to two queues is limited per queue. It looks
  at up to ``LIMITED_SCAN`` ready jobs per queue and call, so jobs behind more
  held-back ones than that wait until those move. A concurrency limit counts
  the jobs leased by limited claims, not those a claim without limits took.
  ``P:{Q}:excl:T`` gets a field per resource id leased; prune drops the
  fields of jobs no longer running, a batch a queue and prune (prune.py).
* ``dlq_replay``/``dlq_purge`` over several queues check every job first, then
  run one all-or-nothing script per queue.
* ``now()`` is the server clock: an offset to the local clock measured at first
  use and every 30 seconds, erring early (never ahead of the server).
"""
import json
import logging
import threading
import time

import redis
from redis.exceptions import RedisError

from ...errors import BadInput, BrokerError, LeaseLost
from ...jsonvalues import info_members, result_json
from ...model import QueueStats, chosen_ids, id_taken, one_per_id
from ..base import Broker
from . import scripts, workflows
from .calls import ScriptCalls
from .claims import Claims
from .connection import DONE_GRACE, connect, guard
from .control import ControlMixin
from .deadletters import DeadLetters
from .fields import ack_batches, enqueue_args, to_job
from .keys import Keys
from .locate import Locator
from .once import OnceRecords
from .prune import Pruning
from .search import SearchMixin

log = logging.getLogger("tangguh.broker")

BATCH = 1000  # jobs per enqueue script call: bounds one script's run time
ACK_ARGUMENT_BYTES = 32 * 1024 * 1024  # an ack_many call's one argument: far below Redis's 512 MB
CLOCK_REFRESH = 30.0
# The enqueue scripts' job list: one encoder for every call (json.dumps with options builds one each time).
_BATCH = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


class RedisBroker(workflows.Workflows, Claims, ScriptCalls, ControlMixin, SearchMixin, DeadLetters, OnceRecords,
                  Pruning, Broker):
    def __init__(self, url):
        self.url = url
        conn = connect(url)
        self.r, self.prefix, self.done_ttl, self.where = conn.client, conn.prefix, conn.done_ttl, conn.where
        self._done_expiry = self.done_ttl + min(DONE_GRACE, self.done_ttl)  # a done hash's TTL (DONE_GRACE)
        self.cluster, self.replica_wait = conn.cluster, conn.wait
        self._kept_lock = threading.Lock() if conn.keep else None  # calls.py, _checkout
        self.scripts = scripts.register(self.r)
        self.keys = Keys(self.prefix)
        self._locator = Locator(self.r, self.keys)
        self._offset = None
        self._synced = 0.0
        self._pubsub = None
        self._wakeup_sock = None
        self._wakeups_lost = False
        self._partial_warned = {}  # queue -> when its failed part of a claim was last logged
        self._tidy_due = {}  # queue -> when a claim full before it next tidies it (_queue_by_queue)

    @guard
    def migrate(self):
        """Loads the scripts, which also proves the server is there; indexes jobs stored before search."""
        scripts.load(self.r, self.scripts)
        self._backfill_search()

    @guard
    def now(self):
        mono = time.monotonic()
        if self._offset is None or mono - self._synced > CLOCK_REFRESH:
            seconds, micros = self.r.time()
            # The server read its clock before we got the reply: measuring against
            # the local time after the reply errs early, never ahead of the server.
            # Against the monotonic clock, not the wall clock: a wall clock stepped
            # forward after this read (it was behind: a VM restored from a snapshot)
            # took now() that far past the server's until the next read, and the
            # schedules enqueued ticks early (docs/scheduling.md).
            self._offset = seconds + micros / 1e6 - time.monotonic()
            self._synced = mono
        return time.monotonic() + self._offset

    def close(self):
        if self._pubsub is not None:
            self._drop_pubsub()
        self._close_wait_subscription()
        try:
            self.r.close()
        except RedisError:
            pass

    # -- producing --------------------------------------------------------
    @guard
    def enqueue(self, job):
        # enqueue_many([job])[0] without its grouping by queue and chunking: one job, one script call.
        job.validate()
        self._check_chosen_ids([job])
        if job.depends_on:
            return self._enqueue_flow([job])[0]
        self.keys.for_scripts(job.queue)  # rejects a bad name before anything is stored
        (got,) = self._run_enqueues([("enqueue", job.queue, [_BATCH.encode([enqueue_args(job)])])])
        return got[0]

    @guard
    def enqueue_many(self, jobs):
        jobs = [job.validate() for job in jobs]
        unique, where = one_per_id(jobs)
        if where is not None:  # an id twice: its first job is stored, the others get its answer
            ids = self.enqueue_many(unique)
            return [ids[i] for i in where]
        self._check_chosen_ids(jobs)
        if any(job.depends_on for job in jobs):
            return self._enqueue_flow(jobs)
        by_queue = {}
        for index, job in enumerate(jobs):
            self.keys.for_scripts(job.queue)  # rejects bad names before anything is stored
            by_queue.setdefault(job.queue, []).append(index)
        calls, slots = [], []
        for queue, indexes in by_queue.items():
            for start in range(0, len(indexes), BATCH):
                chunk = indexes[start:start + BATCH]
                batch = _BATCH.encode([enqueue_args(jobs[i]) for i in chunk])
                calls.append(("enqueue", queue, [batch]))
                slots.append(chunk)
        if not calls:
            return []
        results = self._run_enqueues(calls)
        ids = [None] * len(jobs)
        for chunk, got in zip(slots, results):
            for i, job_id in zip(chunk, got):
                ids[i] = job_id
        return ids

    @guard
    def enqueue_once(self, job, schedule=None):
        job.validate()
        if job.idempotency_key is None:
            raise BadInput("enqueue_once needs an idempotency_key")
        self._check_chosen_ids([job])
        self.keys.for_scripts(job.queue)
        job = self._once_queue(job)  # the key's record across queues (once.py)
        resent = self.calls_resent
        if job.depends_on:  # the workflow's script, which takes the key once the parents are checked
            job_id = self._enqueue_flow([job], once=job.idempotency_key)[0]
        else:
            got = self._run_enqueues([("enqueue_once", job.queue, [_BATCH.encode([enqueue_args(job)])])])
            job_id = got[0][0] if got[0] else None
        if schedule is not None:  # its job is stored, by this call or an earlier one
            self._note_tick(job.idempotency_key, schedule)
        if job_id is not None:
            return job_id
        return job.id if self.calls_resent != resent and self._stored_by_first_sending(job) else None

    def _check_chosen_ids(self, jobs):
        """An id the caller chose may not name a job of another queue. Each queue's keys stand
        apart (a hash slot each), so the second job would be stored beside the first, and a
        lease of one, found by its id, could renew or ack the other. (The SQL brokers make the
        same check.) Ids ``validate`` made are unique by construction."""
        chosen = chosen_ids(jobs)
        for job_id, (queue, _) in self._locator.find(list(chosen), fetch=False).items():
            if queue != chosen[job_id]:
                raise id_taken(job_id, queue)

    # -- leasing: claims.py ---------------------------------------------
    @guard
    def extend(self, leases, lease_seconds):
        lease_us = max(1, int(lease_seconds * 1e6))
        lost, groups = [], {}
        where = self._locator.queues_of([lease.job_id for lease in leases])
        for lease in leases:
            queue = where.get(lease.job_id)
            if queue is None:
                lost.append(lease)
            else:
                groups.setdefault(queue, []).append(lease)
        if groups:
            calls = [("extend", q, [lease_us] + [x for lease in group for x in (lease.job_id, lease.token)])
                     for q, group in groups.items()]
            for group, positions in zip(groups.values(), self._run_many(calls)):
                lost.extend(group[p - 1] for p in positions)
        order = {id(lease): i for i, lease in enumerate(leases)}
        return sorted(lost, key=lambda lease: order[id(lease)])

    def _finish(self, name, lease, args):
        queue = self._locator.queues_of([lease.job_id]).get(lease.job_id)
        if queue is None or not self._run(name, queue, [lease.job_id, lease.token, *args], confirm=True):
            raise LeaseLost(lease.job_id, lease.token)

    @guard
    def ack(self, lease, result=None, info=None):
        self._finish("ack", lease, [result_json(result), info_members(info), self._done_expiry])
        self._locator.forget(lease.job_id)

    @guard
    def ack_many(self, acks):
        """One ack_many.lua call per queue (and per BATCH jobs), all in one pipelined round trip."""
        acks = list(acks)
        if not acks:
            return []
        where = self._locator.queues_of([lease.job_id for lease, _, _ in acks])
        groups, lost = {}, []
        for lease, result, info in acks:
            queue = where.get(lease.job_id)
            if queue is None:
                lost.append(lease)
            else:
                groups.setdefault(queue, []).append((lease, result, info))
        calls, chunks = [], []
        for queue, items in groups.items():
            for lease, result, info in [item for item in items if "\0" in item[0].job_id]:
                try:  # an id stored before ids were checked for NUL: the single ack's arguments
                    self._finish("ack", lease, [result_json(result), info_members(info), self._done_expiry])
                    self._locator.forget(lease.job_id)
                except LeaseLost:
                    lost.append(lease)
            for chunk, argument in ack_batches([item for item in items if "\0" not in item[0].job_id], BATCH,
                                               ACK_ARGUMENT_BYTES):
                calls.append(("ack_many", queue, [self._done_expiry, argument]))
                chunks.append(chunk)
        for chunk, flags in zip(chunks, self._run_many(calls, confirm=True) if calls else ()):
            for lease, flag in zip(chunk, flags):
                if flag == "1":
                    self._locator.forget(lease.job_id)
                else:
                    lost.append(lease)
        order = {id(lease): i for i, (lease, _, _) in enumerate(acks)}
        return sorted(lost, key=lambda lease: order[id(lease)])

    @guard
    def retry(self, lease, run_at, error, info=None):
        self._finish("retry", lease, [int(run_at * 1e6), json.dumps(error), info_members(info)])

    @guard
    def dead(self, lease, reason, error, info=None):
        self._finish("dead", lease, [reason, json.dumps(error), info_members(info)])
        self._locator.forget(lease.job_id)

    @guard
    def release(self, lease):
        self._finish("release", lease, [])

    # -- reading ----------------------------------------------------------
    @guard
    def get(self, job_id):
        queue = self._locator.known.get(job_id)
        if queue is not None:
            fields = self.r.hgetall(self.keys.job(queue, job_id))
            if fields:
                return to_job(fields)
        found = self._locator.find([job_id])
        return to_job(found[job_id][1]) if job_id in found else None

    @guard
    def stats(self, queues, within=None):  # a few ZCARDs a queue: no count to bound
        queues = list(queues)
        out = {}
        for queue, row in zip(queues, self._run_many([("stats", q, [self.done_ttl]) for q in queues])):
            ready, scheduled, in_flight, dead, done, age, cancelled, expired, paused, waiting = row
            out[queue] = QueueStats(queue, ready, scheduled, in_flight, dead, done, int(age) / 1e6, waiting=waiting,
                                    cancelled=cancelled, expired=expired, paused=bool(paused))
        return out

    # -- wake-ups ---------------------------------------------------------
    @guard
    def wakeup_fd(self):
        """The socket of a pub/sub connection subscribed to ``P:wakeup``.

        When ``drain_wakeups`` raises BrokerError that connection is gone (or
        redis-py replaced its socket): call this again for the new descriptor.
        """
        if self._pubsub is None:
            if self.cluster and self._wakeups_lost:
                # The subscription's node failed: its slots may have moved, and only a command of the
                # main client would make redis-py read the slot map again. Read it now.
                self.r.nodes_manager.initialize()
            self._wakeups_lost = False
            pubsub = self.r.pubsub()
            try:
                pubsub.subscribe(self.keys.channel)
            except BaseException:
                pubsub.close()
                raise
            self._pubsub, self._wakeup_sock = pubsub, pubsub.connection._sock
        return self._wakeup_sock.fileno()

    def drain_wakeups(self):
        if self._pubsub is None:
            return
        try:
            while self._pubsub.get_message(timeout=0.0) is not None:
                pass
            connection = self._pubsub.connection
            if connection is None or connection._sock is not self._wakeup_sock:
                raise redis.ConnectionError("the wake-up connection was re-established")
        except RedisError as exc:
            self._drop_pubsub()
            self._wakeups_lost = True
            raise BrokerError(f"redis broker {self.where} wake-ups lost, call wakeup_fd() again: {exc}") from None

    def _drop_pubsub(self):
        pubsub, self._pubsub, self._wakeup_sock = self._pubsub, None, None
        try:
            pubsub.close()
        except (RedisError, OSError):
            pass
