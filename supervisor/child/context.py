"""What a handler receives as ``ctx``: the job's identity, a logger, the deadline, progress, cancel."""
import dataclasses
import logging
import math
import time

from .. import protocol
from ..logs import job_fields
from . import timeouts

# At most one progress message per this many seconds: a handler may call
# ``ctx.progress`` in its tightest loop; the values in between are dropped.
PROGRESS_EVERY = 0.25


@dataclasses.dataclass(frozen=True)
class JobInfo:
    id: str
    type: str
    queue: str
    attempt: int
    max_attempts: int
    resource_id: str | None
    idempotency_key: str | None
    trace_id: str | None
    token: int


_JOB_INFO = tuple(f.name for f in dataclasses.fields(JobInfo))  # once, not per job


class _JobLogger(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        kwargs["extra"] = dict(self.extra, **kwargs.get("extra", {}))
        return msg, kwargs


class Context:
    """``fn(ctx, payload)``: ``ctx.job`` (JobInfo), ``ctx.log``, ``ctx.deadline``, ``ctx.metrics``,
    ``ctx.progress(fraction, note)``, ``ctx.cancelled()``.

    ``ctx.deadline`` is the wall-clock time (``time.time()``) of the soft
    timeout, or None when the job has none. ``ctx.metrics`` is this job's
    counter deltas (``ctx.count("cache_hit")``); the child sends them to the
    master with the outcome, which adds them to its Prometheus counters
    (known keys: ``supervisor.metrics.CHILD_KEYS``; others are ignored).
    """

    def __init__(self, job, deadline=None):
        self._job = job
        self._info = None
        self._parents = job.get("parents") or {}
        self.deadline = deadline
        self._log = None
        self.metrics = {}
        self._progress_sent_at = None

    @property
    def job(self):
        """The job's ids (``JobInfo``), made on first use: a frozen dataclass costs more than
        the rest of a no-op job's context, and most handlers never read it."""
        if self._info is None:
            self._info = JobInfo(**{name: self._job.get(name) for name in _JOB_INFO})
        return self._info

    @property
    def log(self):
        """A logger whose records carry the job's ids (made on first use: most jobs never log)."""
        if self._log is None:
            self._log = _JobLogger(logging.getLogger(f"tangguh.job.{self.job.type}"), job_fields(self._job))
        return self._log

    def cancelled(self):
        """True once this job was cancelled (``tangguh cancel``): a long loop may stop on it.

        ``supervisor.Cancelled`` is raised in the handler anyway at the next
        safe point; this is for code that wants to wind down in its own way
        (inside ``critical()``, or after catching ``Cancelled``).
        """
        return timeouts.cancel_requested()

    def progress(self, fraction, note=""):
        """Report how far the job is (0 to 1) and what it is doing; shown by ``tangguh status`` and ``job``.

        Cheap to call often: at most one report every ``PROGRESS_EVERY``
        seconds leaves the child (the last one, 1.0, always does); the
        supervisor stores the latest with its next lease renewal.
        """
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not math.isfinite(fraction) \
                or not 0 <= fraction <= 1:
            raise ValueError(f"progress fraction must be a number from 0 to 1, got {fraction!r}")
        if not isinstance(note, str):
            raise ValueError(f"progress note must be a string, got {type(note).__name__}")
        now = time.monotonic()
        if fraction < 1 and self._progress_sent_at is not None and now - self._progress_sent_at < PROGRESS_EVERY:
            return
        self._progress_sent_at = now
        from .. import toolkit

        msg = {"op": protocol.PROGRESS, "job_id": self.job.id, "fraction": float(fraction),
               "note": note[:protocol.MAX_NOTE]}
        with timeouts.critical():  # a soft timeout or a cancel must not tear the frame
            toolkit.notify_master(msg)

    def parents(self):
        """``{parent job id: (state, result)}`` of the jobs this one depended on (``depends_on``).

        Carried by the job itself (the claim read them with it): no broker call.
        A chain step reads its previous step's result here; a group's callback,
        every member's. Empty for a job without dependencies.
        """
        return {job_id: tuple(ended) for job_id, ended in self._parents.items()}

    def parent_result(self):
        """The result of the only parent (a chain's previous step); BadInput-like ValueError otherwise."""
        if len(self._parents) != 1:
            raise ValueError(f"parent_result() needs exactly one parent, this job has {len(self._parents)}")
        return next(iter(self._parents.values()))[1]

    def count(self, name, amount=1):
        """Add ``amount`` to this job's counter ``name`` (e.g. ``duplicates_suppressed``)."""
        self.metrics[name] = self.metrics.get(name, 0) + amount

    # -- the handler toolkit (docs/safe-handlers.md); connections open on first use --
    def transaction(self):
        """``with ctx.transaction() as tx``: the handlers' database (``supervisor.toolkit.transaction``)."""
        from .. import toolkit
        from ..toolkit import transaction

        return transaction.transaction(toolkit.database())

    @property
    def idempotency(self):
        """``ctx.idempotency.begin(tx, key)`` (``supervisor.toolkit.idempotency``)."""
        from .. import toolkit
        from ..toolkit import idempotency

        return idempotency.Idempotency(self.job, self.metrics, toolkit.settings().idempotency_retention)

    def lock(self, name, ttl=30.0, wait=10.0):
        """``with ctx.lock(name, ttl, wait) as lock``: a Redis lock with ``lock.fence`` (``toolkit.locks``)."""
        from .. import toolkit
        from ..toolkit import locks

        client, prefix = toolkit.redis()
        return locks.Locks(client, prefix, self.metrics, toolkit.notify_master,
                           toolkit.settings().lock_floor).acquire(name, ttl, wait)

    def row_lock(self, tx, table, key, **options):
        """``SELECT ... FOR UPDATE`` of one row: ``supervisor.toolkit.locks.row_lock``."""
        from ..toolkit import locks

        return locks.row_lock(tx, table, key, **options)

    def advisory_lock(self, tx, key, timeout=None):
        """A transaction-scoped PostgreSQL advisory lock: ``supervisor.toolkit.locks.advisory_lock``."""
        from ..toolkit import locks

        return locks.advisory_lock(tx, key, timeout)

    @property
    def cache(self):
        """``ctx.cache.get_or_build(...)``, ``invalidate_after_commit(tx, ...)`` (``supervisor.toolkit.cache``)."""
        from .. import toolkit
        from ..toolkit import cache

        client, prefix = toolkit.redis()
        # A fill lease lives at least the job's lease (a lock's TTL is that lease): the heartbeat extends it once a beat.
        return cache.Cache(client, prefix, self.metrics, lease_ttl=max(10.0, toolkit.settings().lock_floor),
                           notify=toolkit.notify_master)
