"""The Redis broker: every state change is one Lua script on one queue's keys.

URL: ``redis://[user:password@]host:port/db`` or ``rediss://...`` (TLS), with
options ``prefix=`` (key prefix, default ``tangguh``), ``done_ttl=`` (seconds a
done job is kept, default 7 days) and a few of redis-py's own
(``socket_timeout``, ``socket_connect_timeout``, ``health_check_interval``,
``client_name``, ``ssl_*``...). Any other option is an error.

Key layout (``P`` = prefix, ``Q`` = queue name; the braces are a hash tag, so
all of a queue's keys share one Redis Cluster slot)::

    P:{Q}:j:<id>   hash    one job: fields of ``Job``; payload, result, error and
                           history are JSON strings, the open attempt is "open"
    P:{Q}:ready    zset    due jobs: score -priority, member "<run_at us:016><id>",
                           so ZPOPMIN gives priority desc, run_at asc, id asc
    P:{Q}:delayed  zset    delayed and backing-off jobs by run_at (us); the claim
                           script promotes the due ones to ready
    P:{Q}:leased   zset    running jobs by lease deadline (us)
    P:{Q}:dead     zset    the dead-letter queue by failure time (us)
    P:{Q}:done     zset    retained done jobs by finish time (us); the job hashes
                           carry an EXPIRE of done_ttl, stale entries are trimmed
    P:{Q}:idem     hash    idempotency key -> id of the unfinished job holding it
    P:{Q}:once     zset    enqueue_once keys by first use (us); prune trims them
    P:{Q}:run:T    set     ids of type T leased under a concurrency limit
    P:{Q}:excl:T   hash    resource id -> the job of exclusive type T last leased on it
    P:{Q}:rate:T   hash    type T's token bucket: tokens, ts (us)
    P:queues       set     every queue name ever enqueued to (dlq_list, prune, get)
    P:wakeup       channel published when a job becomes due now

Every state change (enqueue, claim, extend, ack, retry, dead, release, replay,
purge, prune) is one script from ``redis_lua/`` that reads the clock with
``TIME`` and touches one queue's slot only. Scripts reach job hashes by names
built from a prefix argument rather than declared in KEYS; they are in the
declared keys' slot, which Redis Cluster serves (it checks slots, not names),
though a cluster proxy that routes strictly by KEYS would not. ``P:queues`` lives
outside the queue slots: enqueue adds the queue name to it in the same pipeline
as (and before) the enqueue script, so a queue is known before it holds a job.

Finding a job by id: there is no id -> queue index (it would cost a write per
job and could not be expired with the done TTL). The broker remembers the queue
of the jobs it claimed or looked up (bounded cache), and otherwise probes every
known queue in one pipelined round trip: ``get``, ``dlq_*``, and the first
``extend`` or finish call for leases another instance claimed (the heartbeat
thread's own broker) take that path. Queue names may not contain
braces (they would break the hash tag).

Semantics beyond the shared contract:

* Idempotency keys dedup per queue (one hash per slot): the same key in two
  queues names two jobs. A finished job frees its key; dlq replay takes it back
  and raises ``BadInput`` if another unfinished job holds it by then.
* ``claim`` reclaims expired leases of the queues it claims from (bounded per
  call); a queue nobody claims from keeps its expired leases until someone does.
* ``claim`` with limits (``claim_limited.lua``) keeps the limit state in the
  queue's slot: a type enqueued to two queues is limited per queue. It looks
  at up to ``LIMITED_SCAN`` ready jobs per queue and call, so jobs behind more
  held-back ones than that wait until those move. A concurrency limit counts
  the jobs leased by limited claims, not those a claim without limits took.
  ``P:{Q}:excl:T`` keeps one field per resource id ever leased (a few dozen
  bytes each); nothing trims it yet.
* ``dlq_replay``/``dlq_purge`` over several queues check every job first, then
  run one all-or-nothing script per queue.
* ``now()`` is the server clock: an offset to the local clock measured at first
  use and every 30 seconds, erring early (never ahead of the server).
"""
import functools
import json
import os
import time
import urllib.parse

import redis
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, RedisError
from redis.retry import Retry

from ..errors import BadInput, BrokerError, BrokerUnusable, LeaseLost, NotDead
from ..model import Job, QueueStats, check_queue, load_json
from ..urls import redact
from .base import Broker
from .limits import active

DEFAULT_PREFIX = "tangguh"
DEFAULT_DONE_TTL = 7 * 24 * 3600
# Options handed through to redis-py (parsed by redis.connection.parse_url).
REDIS_OPTIONS = {
    "db", "socket_timeout", "socket_connect_timeout", "socket_keepalive", "health_check_interval",
    "client_name", "max_connections", "retry_on_timeout", "protocol",
    "ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_check_hostname",
}
SCRIPTS = ("enqueue", "claim", "extend", "ack", "retry", "dead", "release", "replay", "purge", "stats", "prune",
           "claim_limited", "enqueue_once", "ack_many")
# A script made of several files, run in order (the first may return early).
COMPOSED = {"enqueue_once": ("enqueue_once", "enqueue")}
LIMITED_SCAN = 1000  # ready entries one limited claim looks at per queue (held-back jobs included)
LUA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "redis_lua")
BATCH = 1000  # jobs per enqueue script call and per prune step: bounds one script's run time
CLOCK_REFRESH = 30.0
WHERE_MAX = 100_000  # job id -> queue cache bound

_INTS = ("attempt", "max_attempts", "priority", "token")
_FLOATS = ("timeout", "run_at", "queued_at", "lease_until", "first_failure_at", "last_failure_at", "finished_at")
_JSON = ("payload", "result", "error")


def _guard(method):
    """Turn redis-py failures into BrokerError, so the daemon sees "broker down"."""

    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except RedisError as exc:
            if _unusable(exc):
                raise BrokerUnusable(f"redis broker {self.where} refused the URL's settings: {exc}") from None
            kind = "unreachable" if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)) else "error"
            raise BrokerError(f"redis broker {self.where} {kind}: {exc}") from None

    return guarded


def _unusable(exc):
    """Whether the server's answer says the URL can never work (a login it refuses, no such db number)."""
    return (isinstance(exc, (redis.exceptions.AuthenticationError, redis.exceptions.AuthorizationError))
            or (isinstance(exc, redis.ResponseError) and "DB index is out of range" in str(exc)))


def _load_lua():
    with open(os.path.join(LUA_DIR, "_common.lua"), encoding="utf-8") as f:
        common = f.read()
    out = {}
    for name in SCRIPTS:
        parts = [common]
        for part in COMPOSED.get(name, (name,)):
            with open(os.path.join(LUA_DIR, f"{part}.lua"), encoding="utf-8") as f:
                parts.append(f.read())
        out[name] = "\n".join(parts)
    return out


class RedisBroker(Broker):
    _lua = None  # script sources, read once per process

    def __init__(self, url):
        self.url = url
        parts = urllib.parse.urlsplit(url)
        if parts.scheme.lower() not in ("redis", "rediss"):
            raise BrokerUnusable(f"redis url {redact(url)!r}: scheme must be redis:// or rediss://")
        options = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
        ours = {k: v for k, v in options if k in ("prefix", "done_ttl")}
        unknown = sorted({k for k, _ in options if k not in REDIS_OPTIONS and k not in ours})
        if unknown:
            raise BrokerUnusable(f"redis url {redact(url)!r}: unknown option(s) {', '.join(unknown)}")
        self.prefix = ours.get("prefix", DEFAULT_PREFIX)
        if not self.prefix or "{" in self.prefix or "}" in self.prefix:
            raise BrokerUnusable(f"redis url {redact(url)!r}: prefix must be non-empty and without braces")
        try:
            self.done_ttl = int(ours.get("done_ttl", DEFAULT_DONE_TTL))
            if self.done_ttl < 1:
                raise ValueError
        except ValueError:
            raise BrokerUnusable(f"redis url {redact(url)!r}: done_ttl must be a positive number of seconds") from None
        rest = urllib.parse.urlencode([(k, v) for k, v in options if k in REDIS_OPTIONS])
        try:
            self.where = f"{parts.hostname or 'localhost'}:{parts.port or 6379}"
            self.r = redis.Redis.from_url(
                urllib.parse.urlunsplit(parts._replace(query=rest)),
                decode_responses=True,
                socket_connect_timeout=5.0,
                socket_timeout=30.0,
                # One immediate retry heals a pooled connection the server closed;
                # anything longer is the daemon's backoff to decide.
                retry=Retry(NoBackoff(), 1),
            )
        except (ValueError, TypeError, RedisError) as exc:
            raise BrokerUnusable(f"redis url {redact(url)!r}: {exc}") from None
        if RedisBroker._lua is None:
            RedisBroker._lua = _load_lua()
        self.scripts = {name: self.r.register_script(src) for name, src in RedisBroker._lua.items()}
        self.queues_key = f"{self.prefix}:queues"
        self.channel = f"{self.prefix}:wakeup"
        self._keys = {}  # queue -> (keys, argv head)
        self._where = {}  # job id -> queue, for jobs this instance claimed or looked up
        self._offset = None
        self._synced = 0.0
        self._pubsub = None
        self._wakeup_sock = None

    # -- plumbing ---------------------------------------------------------
    def _queue_keys(self, queue):
        got = self._keys.get(queue)
        if got is None:
            check_queue(queue)  # no braces above all: they would move the keys out of the hash tag
            base = f"{self.prefix}:{{{queue}}}:"
            keys = [base + k for k in ("ready", "delayed", "leased", "dead", "done", "idem")]
            got = self._keys[queue] = (keys, [base + "j:", self.channel])
        return got

    def _run(self, name, queue, args):
        keys, head = self._queue_keys(queue)
        return self.scripts[name](keys=keys, args=head + list(args), client=self.r)

    def _run_many(self, calls, before=()):
        """Several script calls (and plain commands first) in one round trip."""
        for attempt in (1, 2):
            pipe = self.r.pipeline(transaction=False)
            for command, *args in before:
                getattr(pipe, command)(*args)
            for name, queue, args in calls:
                keys, head = self._queue_keys(queue)
                pipe.evalsha(self.scripts[name].sha, len(keys), *keys, *head, *args)
            results = pipe.execute(raise_on_error=False)[len(before):]
            if attempt == 1 and any(isinstance(r, NoScriptError) for r in results):
                self._load_scripts()  # the server lost its script cache; every script here is safe to resend
                continue
            for r in results:
                if isinstance(r, Exception):
                    raise r
            return results

    def _load_scripts(self):
        for name, script in self.scripts.items():
            script.sha = self.r.script_load(RedisBroker._lua[name])

    def _remember(self, job_id, queue):
        if len(self._where) >= WHERE_MAX:
            self._where.clear()
        self._where[job_id] = queue

    def _locate(self, job_ids, fetch=True):
        """{id: (queue, fields)} for the ids that exist, probing every known queue at once.

        With ``fetch=False`` the fields are not read (``{}``): only the queue is wanted.
        """
        job_ids = list(dict.fromkeys(job_ids))
        queues = sorted(self.r.smembers(self.queues_key)) if job_ids else []
        if not queues:
            return {}
        pipe = self.r.pipeline(transaction=False)
        pairs = [(job_id, q) for job_id in job_ids for q in queues]
        for job_id, q in pairs:
            key = f"{self.prefix}:{{{q}}}:j:{job_id}"
            pipe.hgetall(key) if fetch else pipe.exists(key)
        found = {}
        for (job_id, q), fields in zip(pairs, pipe.execute()):
            if fields:
                found[job_id] = (q, fields if fetch else {})
        return found

    def _queues_of(self, job_ids):
        """{id: queue} for the ids that exist: from the cache, else one probe for all the rest."""
        out = {job_id: self._where[job_id] for job_id in job_ids if job_id in self._where}
        missing = [job_id for job_id in job_ids if job_id not in out]
        for job_id, (queue, _) in self._locate(missing, fetch=False).items():
            self._remember(job_id, queue)
            out[job_id] = queue
        return out

    @_guard
    def migrate(self):
        """Nothing to create; loads the scripts, which also proves the server is there."""
        self._load_scripts()

    @_guard
    @_guard
    def now(self):
        mono = time.monotonic()
        if self._offset is None or mono - self._synced > CLOCK_REFRESH:
            seconds, micros = self.r.time()
            # The server read its clock before we got the reply: measuring against
            # the local time after the reply errs early, never ahead of the server.
            self._offset = seconds + micros / 1e6 - time.time()
            self._synced = mono
        return time.time() + self._offset

    def close(self):
        if self._pubsub is not None:
            self._drop_pubsub()
        try:
            self.r.close()
        except RedisError:
            pass

    # -- producing --------------------------------------------------------
    def enqueue(self, job):
        return self.enqueue_many([job])[0]

    @_guard
    def enqueue_many(self, jobs):
        jobs = [job.validate() for job in jobs]
        by_queue = {}
        for index, job in enumerate(jobs):
            self._queue_keys(job.queue)  # rejects bad names before anything is stored
            by_queue.setdefault(job.queue, []).append(index)
        calls, slots = [], []
        for queue, indexes in by_queue.items():
            for start in range(0, len(indexes), BATCH):
                chunk = indexes[start:start + BATCH]
                batch = json.dumps([_enqueue_args(jobs[i]) for i in chunk], separators=(",", ":"), ensure_ascii=False)
                calls.append(("enqueue", queue, [batch]))
                slots.append(chunk)
        if not calls:
            return []
        # The queue joins P:queues before its first job exists (see module docstring).
        results = self._run_many(calls, before=[("sadd", self.queues_key, *by_queue)])
        ids = [None] * len(jobs)
        for chunk, got in zip(slots, results):
            for i, job_id in zip(chunk, got):
                ids[i] = job_id
        return ids

    @_guard
    def enqueue_once(self, job):
        job.validate()
        if job.idempotency_key is None:
            raise BadInput("enqueue_once needs an idempotency_key")
        self._queue_keys(job.queue)
        batch = json.dumps([_enqueue_args(job)], separators=(",", ":"), ensure_ascii=False)
        got = self._run_many([("enqueue_once", job.queue, [batch])], before=[("sadd", self.queues_key, job.queue)])
        return got[0][0] if got[0] else None

    # -- leasing ----------------------------------------------------------
    @_guard
    def claim(self, queues, n, lease_seconds, owner, limits=None):
        lease_us = max(1, int(lease_seconds * 1e6))
        owner_json = json.dumps(owner)
        for queue in queues:
            self._queue_keys(queue)  # a bad name fails the claim before any queue's jobs are leased
        limits = active(limits)
        if limits:
            return self._runnable(self._claim_limited(queues, n, lease_us, owner, owner_json, limits))
        claimed = []
        for queue in queues:
            if len(claimed) >= n:
                break
            for fields in self._run("claim", queue, [n - len(claimed), lease_us, owner, owner_json]):
                job = _job(json.loads(fields))
                self._remember(job.id, queue)
                claimed.append(job)
        return self._runnable(claimed)

    def _claim_limited(self, queues, n, lease_us, owner, owner_json, limits):
        """Per queue, one round trip: claim.lua with n = 0 (reclaim, promote), then claim_limited.lua."""
        spec = json.dumps({t: [-1 if lim.max_concurrency is None else lim.max_concurrency, int(lim.exclusive),
                               lim.rate[0] if lim.rate else 0, int(lim.rate[1] * 1e6) if lim.rate else 0]
                           for t, lim in limits.items()}, separators=(",", ":"))
        claimed = []
        for queue in queues:
            if len(claimed) >= n:
                break
            calls = [("claim", queue, [0, lease_us, owner, owner_json]),
                     ("claim_limited", queue, [n - len(claimed), lease_us, owner, owner_json, spec, LIMITED_SCAN])]
            for fields in self._run_many(calls)[1]:
                job = _job(json.loads(fields))
                self._remember(job.id, queue)
                claimed.append(job)
        return claimed

    @_guard
    def extend(self, leases, lease_seconds):
        lease_us = max(1, int(lease_seconds * 1e6))
        lost, groups = [], {}
        where = self._queues_of([lease.job_id for lease in leases])
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
        queue = self._queues_of([lease.job_id]).get(lease.job_id)
        if queue is None or not self._run(name, queue, [lease.job_id, lease.token, *args]):
            raise LeaseLost(lease.job_id, lease.token)

    @_guard
    def ack(self, lease, result=None, info=None):
        self._finish("ack", lease, [json.dumps(result), _body(info), self.done_ttl])
        self._where.pop(lease.job_id, None)

    @_guard
    def ack_many(self, acks):
        """One ack_many.lua call per queue (and per BATCH jobs), all in one pipelined round trip."""
        acks = list(acks)
        if not acks:
            return []
        where = self._queues_of([lease.job_id for lease, _, _ in acks])
        groups, lost = {}, []
        for lease, result, info in acks:
            queue = where.get(lease.job_id)
            if queue is None:
                lost.append(lease)
            else:
                groups.setdefault(queue, []).append((lease, result, info))
        calls, chunks = [], []
        for queue, items in groups.items():
            for i in range(0, len(items), BATCH):
                chunk = items[i:i + BATCH]
                args = [self.done_ttl]
                for lease, result, info in chunk:
                    args += [lease.job_id, lease.token, json.dumps(result), _body(info)]
                calls.append(("ack_many", queue, args))
                chunks.append(chunk)
        for chunk, flags in zip(chunks, self._run_many(calls) if calls else ()):
            for (lease, _, _), ok in zip(chunk, flags):
                if ok:
                    self._where.pop(lease.job_id, None)
                else:
                    lost.append(lease)
        order = {id(lease): i for i, (lease, _, _) in enumerate(acks)}
        return sorted(lost, key=lambda lease: order[id(lease)])

    @_guard
    def retry(self, lease, run_at, error, info=None):
        self._finish("retry", lease, [int(run_at * 1e6), json.dumps(error), _body(info)])

    @_guard
    def dead(self, lease, reason, error, info=None):
        self._finish("dead", lease, [reason, json.dumps(error), _body(info)])
        self._where.pop(lease.job_id, None)

    @_guard
    def release(self, lease):
        self._finish("release", lease, [])

    # -- reading ----------------------------------------------------------
    @_guard
    def get(self, job_id):
        queue = self._where.get(job_id)
        if queue is not None:
            fields = self.r.hgetall(f"{self.prefix}:{{{queue}}}:j:{job_id}")
            if fields:
                return _job(fields)
        found = self._locate([job_id])
        return _job(found[job_id][1]) if job_id in found else None

    @_guard
    def stats(self, queues):
        queues = list(queues)
        out = {}
        for queue, row in zip(queues, self._run_many([("stats", q, [self.done_ttl]) for q in queues])):
            ready, scheduled, in_flight, dead, done, age = row
            out[queue] = QueueStats(queue, ready=ready, scheduled=scheduled, in_flight=in_flight, dead=dead,
                                    done=done, oldest_ready_age=int(age) / 1e6)
        return out

    # -- dead letters -----------------------------------------------------
    @_guard
    def dlq_list(self, type=None, limit=100):
        picked = []
        for queue in sorted(self.r.smembers(self.queues_key)):
            picked.extend(self._dead_in(queue, type, limit))
        picked.sort(reverse=True)  # failure time desc, then id desc
        if limit is not None:
            picked = picked[:limit]
        if not picked:
            return []
        pipe = self.r.pipeline(transaction=False)
        for _, job_id, queue in picked:
            pipe.hgetall(f"{self.prefix}:{{{queue}}}:j:{job_id}")
        return [_job(fields) for fields in pipe.execute() if fields]

    def _dead_in(self, queue, type, limit):
        """(score, id, queue) of the newest dead jobs of one queue, at most ``limit``."""
        key = self._queue_keys(queue)[0][3]
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
                    pipe.hget(f"{self.prefix}:{{{queue}}}:j:{job_id}", "type")
                rows = [row for row, t in zip(rows, pipe.execute()) if t == type]
            out.extend((score, job_id, queue) for job_id, score in rows)
        return out if limit is None else out[:limit]

    def _group_dead(self, job_ids):
        """Check every id is dead (NotDead otherwise); group them by queue."""
        found = self._locate(job_ids)
        groups = {}
        for job_id in job_ids:
            if job_id not in found or found[job_id][1].get("state") != "dead":
                state = found[job_id][1].get("state") if job_id in found else "unknown"
                raise NotDead(f"job {job_id} is {state}, not dead")
            groups.setdefault(found[job_id][0], []).append(job_id)
        return groups

    @_guard
    def dlq_replay(self, job_ids):
        for queue, ids in self._group_dead(job_ids).items():
            _check_script_reply(self._run("replay", queue, ids))
        return list(job_ids)

    @_guard
    def dlq_purge(self, job_ids):
        count = 0
        for queue, ids in self._group_dead(job_ids).items():
            count += int(_check_script_reply(self._run("purge", queue, ids))[1])
        return count

    @_guard
    def prune(self, done_older_than):
        age_us = max(0, int(done_older_than * 1e6))
        deleted = 0
        queues = sorted(self.r.smembers(self.queues_key))
        if queues:  # enqueue_once records older than the horizon
            cutoff = int(self.now() * 1e6) - age_us
            pipe = self.r.pipeline(transaction=False)
            for queue in queues:
                pipe.zremrangebyscore(f"{self.prefix}:{{{queue}}}:once", "-inf", f"({cutoff}")
            pipe.execute()
        for queue in queues:
            while True:
                jobs, entries = self._run("prune", queue, [age_us, BATCH])
                deleted += jobs
                if entries < BATCH:
                    break
        return deleted

    # -- wake-ups ---------------------------------------------------------
    @_guard
    def wakeup_fd(self):
        """The socket of a pub/sub connection subscribed to ``P:wakeup``.

        When ``drain_wakeups`` raises BrokerError that connection is gone (or
        redis-py replaced its socket): call this again for the new descriptor.
        """
        if self._pubsub is None:
            pubsub = self.r.pubsub()
            try:
                pubsub.subscribe(self.channel)
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
            raise BrokerError(f"redis broker {self.where} wake-ups lost, call wakeup_fd() again: {exc}") from None

    def _drop_pubsub(self):
        pubsub, self._pubsub, self._wakeup_sock = self._pubsub, None, None
        try:
            pubsub.close()
        except (RedisError, OSError):
            pass


def _enqueue_args(job):
    """One job for enqueue.lua: [id, priority, delay_us, [field, value, ...], idempotency_key?]."""
    fields = ["id", job.id, "type", job.type, "queue", job.queue,
              "payload", json.dumps(job.payload, separators=(",", ":")),
              "max_attempts", str(job.max_attempts), "priority", str(job.priority), "trace_id", job.trace_id]
    if job.resource_id is not None:
        fields += ["resource_id", job.resource_id]
    if job.idempotency_key is not None:
        fields += ["idempotency_key", job.idempotency_key]
    if job.timeout is not None:
        fields += ["timeout", repr(float(job.timeout))]
    args = [job.id, job.priority, int(job.delay * 1e6), fields]
    if job.idempotency_key is not None:
        args.append(job.idempotency_key)
    return args


def _body(info):
    """The caller's info dict as the inside of a JSON object ('' when empty)."""
    return json.dumps(info, separators=(",", ":"))[1:-1] if info else ""


def _check_script_reply(reply):
    if reply[0] == "notdead":
        raise NotDead(f"job {reply[1]} is {reply[2]}, not dead")
    if reply[0] == "conflict":
        raise BadInput(f"cannot replay {reply[1]}: its idempotency key is held by an unfinished job")
    return reply


def _job(fields):
    if isinstance(fields, list):
        fields = dict(zip(fields[::2], fields[1::2]))
    d = dict(fields)
    for key in _INTS:
        if key in d:
            d[key] = int(d[key])
    for key in _FLOATS:
        if key in d:
            d[key] = float(d[key])
    for key in _JSON:
        if key in d:
            d[key] = load_json(d[key])
    history = json.loads(d.pop("history", "[]"))
    open_entry = d.pop("open", None)
    if open_entry:
        history.append(json.loads(open_entry))
    d["history"] = history
    return Job.from_dict(d)
