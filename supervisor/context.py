"""What a handler receives as ``ctx``: the job's identity, a logger, the deadline."""
import dataclasses
import logging

from .logs import job_fields


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


class _JobLogger(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        kwargs["extra"] = dict(self.extra, **kwargs.get("extra", {}))
        return msg, kwargs


class Context:
    """``fn(ctx, payload)``: ``ctx.job`` (JobInfo), ``ctx.log``, ``ctx.deadline``, ``ctx.metrics``.

    ``ctx.deadline`` is the wall-clock time (``time.time()``) of the soft
    timeout, or None when the job has none. ``ctx.metrics`` is this job's
    counter deltas (``ctx.count("cache_hit")``); the child sends them to the
    master with the outcome, which adds them to its Prometheus counters
    (known keys: ``supervisor.metrics.CHILD_KEYS``; others are ignored).
    """

    def __init__(self, job, deadline=None):
        self.job = JobInfo(**{f.name: job.get(f.name) for f in dataclasses.fields(JobInfo)})
        self.deadline = deadline
        self.log = _JobLogger(logging.getLogger(f"tangguh.job.{self.job.type}"), job_fields(job))
        self.metrics = {}

    def count(self, name, amount=1):
        """Add ``amount`` to this job's counter ``name`` (e.g. ``duplicates_suppressed``)."""
        self.metrics[name] = self.metrics.get(name, 0) + amount
