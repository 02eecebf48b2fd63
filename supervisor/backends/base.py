"""The broker contract: one abstract class every backend implements.

Semantics every backend must honour (the conformance suite in
``tests/test_broker_conformance.py`` checks each of them, unchanged, on every
backend):

* ``enqueue`` stores a job ``queued`` (``run_at = now + delay``) once
  ``NewJob.validate`` passes (the same limits on every backend; BadInput and
  nothing stored otherwise). If its ``idempotency_key`` matches a job that is
  not finished (queued, running, retrying) it stores nothing and returns that
  job's id.
* ``claim`` is atomic. It first reclaims expired leases (``running`` and
  ``lease_until < now``): the lost attempt is recorded (history outcome
  ``lease_expired``); a job with attempts left becomes due again at once, one
  without goes ``dead`` with reason ``lease_expired``. Then it leases up to
  ``n`` due jobs (``queued`` or ``retrying`` with ``run_at <= now``): queues in
  the order given, within a queue highest ``priority`` first, then oldest
  ``run_at``, then id. Each leased job gets ``state = running``,
  ``attempt += 1``, ``token += 1`` (the fencing token: strictly increasing per
  job), ``lease_until = now + lease_seconds``, ``owner``, and a new history
  entry ``{"attempt", "started_at", "owner"}``. A leased job whose stored
  payload does not decode as a JSON object within ``model.MAX_DEPTH`` levels,
  or whose record holds a field of the wrong type (``damaged``), is
  dead-lettered at once with reason ``bad_payload`` and not returned.
* ``claim(..., limits={type: TypeLimits})`` also enforces per-type controls,
  for every claimer that passes the same limits (each supervisor passes the
  ones of its config): a job that a limit holds back stays ``queued`` or
  ``retrying`` untouched (no attempt, no token, no history) and later jobs are
  considered in its place. ``max_concurrency``: the type's leased (``running``)
  jobs never exceed it. ``exclusive``: never two leased jobs of the type with
  the same ``resource_id`` (jobs without one are not held back). ``rate``
  ``(count, per)``: a token bucket of ``count`` tokens refilled at ``count /
  per`` a second, stored in the broker and shared by every claimer; a lease
  takes one token. Types not in ``limits`` are unlimited; ``limits=None`` (or
  empty) is the plain claim, with no extra cost. Redis keeps the limit state in
  each queue's slot, so there a type served from two queues is limited per
  queue (see its module docstring).
* ``enqueue_once(job)`` enqueues like ``enqueue`` unless any job was ever
  enqueued through it with the same ``idempotency_key``, on any queue (done ones included,
  until ``prune`` forgets records older than its horizon): it returns the new
  job's id, or None. Atomic across processes; the scheduler's exactly-once
  periodic ticks rest on it. ``enqueue_once(job, schedule=name)`` also records
  ``name -> job.idempotency_key`` in the same atomic step, whether or not the
  key was new, unless the name's record is greater already (code point order:
  it only moves forward; the scheduler's keys of one schedule,
  ``cron:<name>:<UTC time>``, are fixed-width). ``prune`` never removes these
  records. ``last_tick_key(name)`` reads that record by exact name (one lookup,
  no scan), or None: the scheduler's newest tick of a schedule.
* ``ack``/``retry``/``dead``/``release`` take the ``Lease`` (job id, token)
  and raise ``LeaseLost`` unless the job is ``running`` with that token. They
  close the last history entry with ``ended_at``, ``outcome`` (``done``,
  ``retry``, ``dead``) and the caller's ``info`` (pid, host, duration...).
  ``release`` gives the attempt back: ``attempt -= 1``, the open history entry
  is dropped, the job is ``queued`` and due now.
* ``ack_many`` is ``ack`` for several leases at once: the current ones are
  acked, the stale ones are returned (not raised).
* ``extend`` pushes ``lease_until`` to ``now + lease_seconds`` for every lease
  still current, in one round trip, and returns the leases that are not.
* Job control (the operator's operations; see each method): ``search`` and
  ``count`` by a ``JobFilter``; ``cancel``; ``renew`` (the heartbeat's
  ``extend`` that also stores progress and answers with cancel requests);
  ``cancelled`` (the fenced write that ends a running job ``cancelled``);
  ``pause``/``resume``/``paused`` (``claim`` never leases from a paused
  queue); expiry (``claim`` ends a due job past ``expires_at`` ``expired``
  instead of leasing it); ``requeue`` and ``discard`` (bulk retry and delete);
  ``wait`` (woken by the broker's notification, never a busy poll); the
  supervisors' records (``write_supervisor``, ``supervisors``,
  ``remove_supervisor``).
* Dead jobs keep everything (payload, history, error, reason, failure times);
  ``dlq_replay`` puts them back ``queued`` with ``attempt = 0`` and the history
  kept; replaying or purging a job that is not dead raises ``NotDead``.
"""
import abc
import time
import re

from .. import urls
from . import damaged
from ..errors import BrokerError, BrokerUnusable, LeaseLost, RolledBack
from ..model import Job, Lease, NewJob, QueueStats, error_info, payload_problem  # noqa: F401  (re-exported)


class Broker(abc.ABC):
    """A durable job store with leases. Not thread-safe: one instance per thread."""

    url: str
    # Calls the driver sent a second time after a connection error took the first one's answer
    # (Redis: redis-py's one retry). The first sending may have run on the server: a claim among
    # them may have leased jobs its caller never saw (the supervisor looks for them: orphans).
    # A Redis claim that returns the jobs of some queues while another queue's call lost its
    # answer counts here too: that call may have leased jobs as well.
    calls_resent = 0

    def now(self):
        """The clock leases are measured against (backends with a server use its clock)."""
        return time.time()

    def migrate(self):
        """Create or upgrade the broker's storage. Idempotent."""

    @abc.abstractmethod
    def enqueue(self, job: NewJob) -> str: ...

    def enqueue_many(self, jobs) -> list:
        """Enqueue several jobs; backends override this with one round trip."""
        return [self.enqueue(job) for job in jobs]

    @abc.abstractmethod
    def claim(self, queues, n, lease_seconds, owner, limits=None) -> list: ...

    def _runnable(self, jobs):
        """The claimed jobs a worker can be given; the others are dead-lettered ``bad_payload`` now.

        A payload that does not decode, or is nested past the enqueue limit, or a field
        the supervisor computes with that holds no value of its type (stored behind the
        producer API's back, or before it had the limit: ``damaged``), would fail every
        attempt or break the claimer itself; it must not hold up the jobs behind it.
        """
        runnable = []
        for job in jobs:
            problem = damaged.problem(job)
            if problem is None:
                runnable.append(job)
                continue
            try:
                self.dead(job.lease, "bad_payload", error_info("bad_payload", "BadPayload", problem))
            except LeaseLost:
                pass  # someone else's now: their claim dead-letters it
        return runnable

    @abc.abstractmethod
    def enqueue_once(self, job: NewJob, schedule: str | None = None) -> str | None: ...

    @abc.abstractmethod
    def last_tick_key(self, schedule: str) -> str | None: ...

    @abc.abstractmethod
    def extend(self, leases, lease_seconds) -> list: ...

    @abc.abstractmethod
    def ack(self, lease, result=None, info=None) -> None: ...

    def ack_many(self, acks) -> list:
        """Ack several jobs, ``acks`` being ``(lease, result, info)`` triples.

        Each ack is fenced exactly as ``ack``; a stale one changes nothing and
        its lease is returned (no exception), in the order given. Backends
        override this with one round trip (one commit on SQLite): the
        supervisor acks every result that arrived in a loop turn at once.
        """
        lost = []
        for lease, result, info in acks:
            try:
                self.ack(lease, result, info)
            except LeaseLost:
                lost.append(lease)
        return lost

    @abc.abstractmethod
    def retry(self, lease, run_at, error, info=None) -> None: ...

    @abc.abstractmethod
    def dead(self, lease, reason, error, info=None) -> None: ...

    @abc.abstractmethod
    def release(self, lease) -> None: ...

    @abc.abstractmethod
    def get(self, job_id) -> Job | None: ...

    @abc.abstractmethod
    def stats(self, queues, within=None) -> dict:
        """``{queue: QueueStats}``. ``within``: seconds the counts may take, BrokerError past them
        (they read every job of each state; the heartbeat's sample must not hold up the renewals)."""

    @abc.abstractmethod
    def dlq_list(self, type=None, limit=100) -> list:
        """Dead jobs, most recently failed first; ``limit=None`` lists all."""

    def dlq_get(self, job_id):
        job = self.get(job_id)
        return job if job is not None and job.state == "dead" else None

    @abc.abstractmethod
    def dlq_replay(self, job_ids) -> list: ...

    @abc.abstractmethod
    def dlq_purge(self, job_ids) -> int: ...

    @abc.abstractmethod
    def prune(self, done_older_than, budget=None) -> int:
        """Delete ``done``, ``cancelled`` and ``expired`` jobs finished more than ``done_older_than``
        seconds ago (and ``enqueue_once`` records older than that). Dead jobs stay. Returns how
        many jobs went. With ``budget``, stop once at least that many went (a batch may overshoot
        it): a caller that gets ``budget`` or more back calls again for the rest."""

    # -- job control ----------------------------------------------------------

    def search(self, filter, cursor=None, limit=50, order="newest"):
        """A ``jobfilter.Page`` of the jobs ``filter`` selects, by ``queued_at`` then id.

        Keyset pagination: ``cursor`` is the ``next_cursor`` of the previous
        page, so a page is stable while jobs are added. BadInput on a bad
        filter, cursor, limit or order.
        """
        raise NotImplementedError

    def count(self, filter, exact_up_to=10_000):
        """A ``jobfilter.Count``: exact up to ``exact_up_to`` jobs, an estimate (``exact=False``) past it."""
        raise NotImplementedError

    def cancel(self, job_ids, by, reason):
        """Cancel each job; returns ``{job_id: what happened}`` in the order given.

        ``"cancelled"``: it was queued, scheduled or retrying and is now
        ``cancelled`` (terminal; a history entry ``{"outcome": "cancelled",
        "by", "reason", "at"}``). ``"requested"``: it is running; the request
        is stored in ``cancel_request`` and the lease holder learns of it at
        its next ``renew``. ``"already_<state>"`` for a finished job (a second
        cancel of a running one is ``"requested"`` again, harmless);
        ``"unknown"`` for an id the broker does not hold. Never raises for one id.
        """
        raise NotImplementedError

    def renew(self, leases, lease_seconds, progress=None, queues=None):
        """``extend`` that also stores progress and reports cancel requests, in the same round trip.

        ``progress``: ``{job_id: (fraction, note)}`` stored on current leases
        only. ``queues``: where the leases' jobs most likely are (the
        supervisor's own); a broker that looks a job's queue up looks there
        first. Returns a ``Renewal``: ``lost`` (leases no longer current, as
        ``extend`` returns) and ``cancel`` (``{job_id: cancel_request}`` for
        current leases whose job has a cancel request).
        """
        raise NotImplementedError

    def cancelled(self, lease, info=None):
        """End a running job ``cancelled`` (the master's write once its handler stopped); fenced like ``dead``.

        Closes the open history entry with outcome ``cancelled`` plus the
        stored request's ``by`` and ``reason``. LeaseLost unless current.
        """
        raise NotImplementedError

    def pause(self, queue, by=None):
        """Stop every claimer leasing from ``queue`` (stored in the broker); idempotent."""
        raise NotImplementedError

    def resume(self, queue):
        """Undo ``pause``; idempotent."""
        raise NotImplementedError

    def paused(self, queues=None):
        """``{queue: {"by", "at"}}`` for every paused queue, or for those of ``queues`` (what a
        supervisor serves: its heartbeat asks every beat, and producers may name many queues)."""
        raise NotImplementedError

    def queues(self):
        """Every queue the broker knows: holding jobs, paused, or served by a live supervisor record."""
        raise NotImplementedError

    def take_expired(self):
        """``[(job_id, type)]`` this instance's claims ended ``expired`` since the last call (for metrics)."""
        return []

    def requeue(self, job_ids):
        """Put finished jobs back (dead, cancelled or expired -> ``queued``, attempt 0, history kept).

        Returns ``{job_id: "queued" | "waiting" | "not_finished" | "done" | "unknown" | "conflict"
        | "parent_failed"}``; ``"waiting"``: a workflow child whose parents have not all finished
        waits for them again (its ``pending`` counts them); ``"conflict"``: an unfinished job holds
        its idempotency key, it stays as it was; ``"parent_failed"``: an ``on="success"`` parent
        lies dead, cancelled or expired (still stored), it stays as it was (the parent's replay or
        requeue reopens it).
        """
        raise NotImplementedError

    def discard(self, job_ids):
        """Delete jobs that are not running; returns ``{job_id: "discarded" | "running" | "unknown"}``."""
        raise NotImplementedError

    def wait(self, job_id, timeout):
        """The job once it is finished (``model.FINISHED``), or None when ``timeout`` seconds pass first.

        Woken by the broker's own notification, never a busy poll. BadInput
        for an id the broker does not hold, or no job can have (``control.check_id``).
        """
        raise NotImplementedError

    def write_supervisor(self, record, ttl):
        """Store (replace) one supervisor's record, keyed by ``record["id"]``; written every heartbeat.

        The broker stamps ``last_heartbeat`` with its clock. A record not
        written for ``ttl`` seconds shows as gone; one gone for an hour is removed.
        """
        raise NotImplementedError

    def supervisors(self):
        """Every supervisor record, each with ``last_heartbeat`` and ``gone`` (True past its ttl)."""
        raise NotImplementedError

    def remove_supervisor(self, supervisor_id):
        """Forget one record (a supervisor stopping cleanly); BadInput for an id no record can have."""
        raise NotImplementedError

    def wakeup_fd(self):
        """A file descriptor that turns readable when a job may have become due, or None.

        The supervisor's main loop adds it to its selector, so an enqueue wakes
        an idle supervisor at once (PostgreSQL LISTEN/NOTIFY, a Redis pub/sub
        socket). Brokers without one are polled.
        """
        return None

    def drain_wakeups(self):
        """Consume whatever made ``wakeup_fd`` readable."""

    def interrupt(self):
        """From another thread: make the statement this broker runs now give up (BrokerError in
        its thread), e.g. the heartbeat's queue sample when the master must fork. Best effort; a
        no-op when nothing runs (Redis: its calls are short)."""

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


SCHEMES = {
    "sqlite": ("supervisor.backends.sqlite", "SQLiteBroker"),
    "redis": ("supervisor.backends.redis", "RedisBroker"),
    "rediss": ("supervisor.backends.redis", "RedisBroker"),
    "redis+sentinel": ("supervisor.backends.redis", "RedisBroker"),
    "rediss+sentinel": ("supervisor.backends.redis", "RedisBroker"),
    "redis+cluster": ("supervisor.backends.redis", "RedisBroker"),
    "rediss+cluster": ("supervisor.backends.redis", "RedisBroker"),
    "postgresql": ("supervisor.backends.postgres", "PostgresBroker"),
    "postgres": ("supervisor.backends.postgres", "PostgresBroker"),
}


def scheme_of(url):
    """The broker URL's scheme, or BrokerError naming what is wrong with it."""
    if not isinstance(url, str) or not re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", url):
        # Never the text itself: a mistyped URL still holds its password.
        raise BrokerError("broker url is not a URL (expected sqlite:///path, redis://..., postgresql://...)")
    scheme = url.partition("://")[0].lower()
    if scheme not in SCHEMES:
        raise BrokerError(f"unknown broker scheme {scheme!r} (expected sqlite, redis, rediss, redis+sentinel,"
                          " redis+cluster or postgresql)")
    return scheme


def open_broker(url) -> Broker:
    """Open the broker a URL names: ``sqlite:///path``, ``redis://``, ``postgresql://``."""
    import importlib

    module_name, class_name = SCHEMES[scheme_of(url)]
    if urls.problem(url):
        raise BrokerUnusable(f"broker URL {urls.redact(url)}: {urls.problem(url)}")
    return getattr(importlib.import_module(module_name), class_name)(url)


class Sendings:
    """``fn(broker)``, noting whether the driver sent it twice (``twice``): its first sending may
    have run on the server, its answer lost (``Broker.calls_resent``). ``reached`` is False when
    the call changed nothing: it failed before ``fn`` was given a broker (the broker could not be
    opened, the link deferring to its next try), or the broker says so (``RolledBack``)."""

    def __init__(self, fn):
        self.fn, self.twice, self.reached = fn, False, False

    def __call__(self, broker):
        self.reached = True
        before = broker.calls_resent
        try:
            return self.fn(broker)
        except RolledBack:
            self.reached = False
            raise
        finally:
            self.twice = broker.calls_resent != before
