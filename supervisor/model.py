"""The job model: ids, states, the record a broker stores, and input checks."""
import dataclasses
import math
import operator
import os
import re
import time
import typing

from .errors import BadInput
from .jsonvalues import (MAX_DEPTH, MAX_ERROR_CLASS, MAX_ERROR_MESSAGE, MAX_ERROR_TRACEBACK,  # noqa: F401 - the model's API
                         UNSTORABLE, check_json, clip_end, clip_start, is_storable, json_depth, load_json,
                         payload_problem, storable)
from .ids import (chosen_ids, first_token, first_token_at, id_made, id_taken,  # noqa: F401 - the model's API
                  job_id_from, new_job_id, new_trace_id, one_per_id, trace_id_from, trace_made)

QUEUED, RUNNING, RETRYING, DONE, DEAD = "queued", "running", "retrying", "done", "dead"
# Job control (cancel, expiry) and workflows (a job waiting on its parents).
CANCELLED, EXPIRED, WAITING = "cancelled", "expired", "waiting"
STATES = (WAITING, QUEUED, RUNNING, RETRYING, DONE, DEAD, CANCELLED, EXPIRED)
UNFINISHED = (QUEUED, RUNNING, RETRYING)
# Terminal: never claimed again, kept until pruned.
FINISHED = (DONE, DEAD, CANCELLED, EXPIRED)

# Reason codes of a dead-lettered job (and of a failed attempt).
REASONS = ("exception", "permanent", "timeout", "crashed", "lease_expired", "unknown_type", "bad_payload",
           "result_too_large")

# What the master stores when an attempt ends (``Outcome.op``). DEAD, the state,
# doubles as the op that leads to it; DROP stores nothing (the lease is gone).
ACK, RETRY, RELEASE, DROP = "ack", "retry", "release", "drop"


# What a producer may store. Each bound is checked at enqueue on every broker,
# so a job that one broker would refuse (or could not hand to a worker) is
# refused by all of them, before anything is written.
MAX_NAME = 255  # characters of a type, resource_id, idempotency_key or trace_id
MAX_DELAY = 10 * 365 * 86400.0  # seconds: ten years
MAX_INT = 2**31 - 1  # priority and max_attempts fit a 32-bit integer column
MAX_TIMEOUT = 365 * 86400.0  # seconds: a year
# Queue names become Redis keys ("{queue}" is the hash tag) and metric labels.
QUEUE_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
QUEUE_RULE = "1 to 64 letters, digits or _ . : -"


def check_queue(queue, what="queue"):
    if not isinstance(queue, str) or not QUEUE_NAME.fullmatch(queue):
        raise BadInput(f"{what} {queue!r} is not a valid queue name ({QUEUE_RULE})")
    return queue


def _check_text(value, name, required=False):
    if value is None and not required:
        return
    if not isinstance(value, str) or (required and not value.strip()):
        raise BadInput(f"{name} must be a {'non-empty ' if required else ''}string")
    if len(value) > MAX_NAME:
        raise BadInput(f"{name} is {len(value)} characters long, more than {MAX_NAME}")
    if UNSTORABLE.search(value):
        raise BadInput(f"{name} contains a NUL character or a lone surrogate")


def _check_int(value, name, low):
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_INT:
        what = "a positive integer" if low == 1 else f"an integer from {low}"
        raise BadInput(f"{name} must be {what} up to {MAX_INT}, got {value!r}")


@dataclasses.dataclass
class NewJob:
    """What a producer asks for; brokers turn it into a stored ``Job``."""

    type: str
    payload: dict
    queue: str = "default"
    resource_id: str | None = None
    idempotency_key: str | None = None
    max_attempts: int = 5
    timeout: float | None = None
    delay: float = 0.0
    trace_id: str | None = None
    priority: int = 0
    id: str = ""
    expires_in: float | None = None  # not started by then -> ``expired`` instead of running
    # Workflows: parent job ids, or ``(id, on)`` with on = "success" (default) or "complete";
    # the job stays ``waiting`` until every parent is finished (``supervisor.dependencies``).
    depends_on: list = dataclasses.field(default_factory=list)

    def validate(self):
        """Raise BadInput on anything a broker must not store; fill defaults.

        A job checked already, whose fields are still the objects it was checked
        with (and its depends_on list the same edges), is not checked again: the
        client validates, then the broker it hands the job to, which must for
        callers that skip the client."""
        checked = self.__dict__.get("_checked")
        if (checked is not None and all(map(operator.is_, checked, self._values()))
                and self._edges == tuple(self.depends_on)):  # a list changed in place is normalised again
            return self
        _check_text(self.type, "job type", required=True)
        check_queue(self.queue)
        if not isinstance(self.payload, dict):
            raise BadInput(f"payload must be a JSON object, got {type(self.payload).__name__}")
        text = check_json(self.payload, "payload")
        for name, value in (("resource_id", self.resource_id), ("idempotency_key", self.idempotency_key),
                            ("trace_id", self.trace_id)):
            if value is not None:
                _check_text(value, name)
        _check_int(self.max_attempts, "max_attempts", 1)
        _check_int(self.priority, "priority", -MAX_INT)
        if self.timeout is not None and not (_positive(self.timeout) and self.timeout <= MAX_TIMEOUT):
            raise BadInput(f"timeout must be a positive number of seconds up to {MAX_TIMEOUT:.0f} (a year),"
                           f" got {self.timeout!r}")
        if not _number(self.delay) or not 0 <= self.delay <= MAX_DELAY:
            raise BadInput(f"delay must be a number of seconds >= 0 and up to {MAX_DELAY:.0f} (ten years),"
                           f" got {self.delay!r}")
        if self.expires_in is not None and not (_positive(self.expires_in) and self.expires_in <= MAX_DELAY):
            raise BadInput(f"expires_in must be a positive number of seconds up to {MAX_DELAY:.0f} (ten years),"
                           f" got {self.expires_in!r}")
        noise = os.urandom(26) if not (self.id and self.trace_id) else None  # one read for both ids
        if not self.id:
            self.id = job_id_from(time.time(), noise[:10])
            # Not the caller's: unique by construction (a broker may skip checking it). The id and
            # queue, not a flag: a caller who sets another id on this checked job chose that one,
            # and one who sends this job to another queue after storing it names a stored job.
            self._id_made = (self.id, self.queue)
        elif not id_made(self):
            _check_text(self.id, "job id", required=True)
        if self.depends_on is None or (type(self.depends_on) in (list, tuple) and not self.depends_on):
            self.depends_on = []  # what normalise makes of no edges, without the call
        else:
            from .dependencies import normalise  # here, not at the top: dependencies imports this module

            self.depends_on = normalise(self.depends_on, self.id)
        if not self.trace_id:
            self.trace_id = trace_id_from(noise[10:])
            self._trace_made = self.trace_id  # not the caller's (as _id_made): Client.store may put the producer's traceparent here
        # The payload's JSON is what brokers store (``payload_json``): encoded once, here, so what
        # is stored is what was checked even if the caller changes the dict in place afterwards.
        self._payload_json = text
        self._edges = tuple(self.depends_on)
        self._checked = self._values()
        return self

    def _values(self):
        return (self.type, self.queue, self.payload, self.resource_id, self.idempotency_key, self.max_attempts,
                self.timeout, self.delay, self.trace_id, self.priority, self.id, self.expires_in, self.depends_on)

    @property
    def payload_json(self):
        """The payload as the JSON text to store (compact; the one ``validate`` checked)."""
        checked = self.__dict__.get("_checked")
        if checked is None or checked[2] is not self.payload:
            self.validate()
        return self._payload_json


def _number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _positive(x):
    return _number(x) and x > 0


RATE_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


# The most tokens a rate may name: past any real limit, and a number every broker's bucket holds
# (above about 1.8e308 the SQL brokers' float() failed every claim of every type).
MAX_RATE_COUNT = 10**9


def parse_rate(text):
    """``"100/m"`` -> ``(100, 60.0)``: N jobs per second, minute or hour. ValueError otherwise."""
    count, _, unit = text.partition("/") if isinstance(text, str) else ("", "", "")
    if not count.strip().isdigit() or int(count) < 1 or unit.strip() not in RATE_UNITS:
        raise ValueError(f'expected "N/s", "N/m" or "N/h", got {text!r}')
    if int(count) > MAX_RATE_COUNT:
        raise ValueError(f"a rate of at most {MAX_RATE_COUNT} a unit, got {text!r}")
    return int(count), RATE_UNITS[unit.strip()]


@dataclasses.dataclass(frozen=True)
class TypeLimits:
    """What the broker enforces at claim time for one job type (see ``Broker.claim``).

    ``max_concurrency``: at most this many jobs of the type leased at once.
    ``rate``: ``(count, per_seconds)``, a token bucket of ``count`` tokens
    refilled at ``count / per_seconds`` a second. ``exclusive``: never two
    leased jobs of the type with the same ``resource_id``.
    """

    max_concurrency: int | None = None
    rate: tuple | None = None
    exclusive: bool = False

    def __bool__(self):
        return self.max_concurrency is not None or self.rate is not None or self.exclusive

    def validate(self):
        if self.max_concurrency is not None and (
                isinstance(self.max_concurrency, bool) or not isinstance(self.max_concurrency, int)
                or self.max_concurrency < 0):
            raise BadInput(f"max_concurrency must be an integer >= 0, got {self.max_concurrency!r}")
        if self.rate is not None:
            count, per = self.rate if isinstance(self.rate, (tuple, list)) and len(self.rate) == 2 else (None, None)
            if (isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_RATE_COUNT
                    or not _positive(per)):
                raise BadInput(f"rate must be (count from 1 to {MAX_RATE_COUNT}, seconds > 0), got {self.rate!r}")
        if not isinstance(self.exclusive, bool):
            raise BadInput(f"exclusive must be True or False, got {self.exclusive!r}")
        return self


@dataclasses.dataclass
class Job:
    """A job as a broker stores it. ``token`` is the current lease's fencing token."""

    id: str
    type: str
    queue: str
    payload: dict
    state: str = QUEUED
    resource_id: str | None = None
    idempotency_key: str | None = None
    attempt: int = 0
    max_attempts: int = 5
    timeout: float | None = None
    priority: int = 0
    run_at: float = 0.0
    queued_at: float = 0.0
    trace_id: str | None = None
    token: int = 0
    lease_until: float | None = None
    owner: str | None = None
    result: object = None
    error: dict | None = None  # last error: class, message, traceback, reason
    reason: str | None = None  # why it is dead
    first_failure_at: float | None = None
    last_failure_at: float | None = None
    finished_at: float | None = None
    history: list = dataclasses.field(default_factory=list)
    expires_at: float | None = None  # broker clock; a job not started by then ends ``expired``
    progress: float | None = None  # 0..1, reported by the handler (``ctx.progress``), stored at renewal
    progress_note: str | None = None
    cancel_request: dict | None = None  # {"by", "reason", "at"}: asked while it ran, or why it was cancelled
    # Workflows: how many parents are not finished yet (None: the job has no depends_on), and
    # {parent id: (state, result)} of each parent (state None until it finished), filled in by claim and get.
    pending: int | None = None
    parents: dict | None = None

    @property
    def lease(self):
        return Lease(self.id, self.token)

    @property
    def attempts_allowed(self):
        """The attempts the supervisor allows this job (see ``allowed_attempts``)."""
        return allowed_attempts(self.history, self.max_attempts)

    def to_dict(self):
        # Field by field, not dataclasses.asdict: that copies payload and result recursively.
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, d):
        """A job from a mapping of its fields (a broker's row); other keys are ignored.

        Positionally, field by field: the filtered ``**kwargs`` call took 1.6 times as long, and
        PostgreSQL's claim builds every claimed job here."""
        args = []
        for name, factory, default in JOB_DEFAULTS:
            value = d.get(name, _ABSENT)
            if value is _ABSENT:
                if factory is not None:
                    value = factory()
                elif default is dataclasses.MISSING:
                    raise TypeError(f"Job.from_dict: no {name!r} field")
                else:
                    value = default
            args.append(value)
        return cls(*args)


def allowed_attempts(history, max_attempts):
    """The attempts a job is allowed: the limit a supervisor last ended an attempt of it under
    (the type's ``max_attempts``, kept in that history entry; an entry the broker closed itself,
    a lease expired, has none), else ``max_attempts`` as stored. A producer that does not know
    the type stores its default, which the supervisor overrides."""
    for entry in reversed(history or ()):
        limit = entry.get("max_attempts") if isinstance(entry, dict) else None
        if isinstance(limit, int) and not isinstance(limit, bool) and limit >= 1:
            return limit
    return max_attempts


# Computed once: dataclasses.fields() walks every field on each call (a claim decodes every job).
JOB_ORDER = tuple(f.name for f in dataclasses.fields(Job))
JOB_FIELDS = frozenset(JOB_ORDER)
_ABSENT = object()
# Per field, in order: (name, its default factory or None, its default or dataclasses.MISSING).
JOB_DEFAULTS = tuple((f.name, None if f.default_factory is dataclasses.MISSING else f.default_factory, f.default)
                  for f in dataclasses.fields(Job))


class Lease(typing.NamedTuple):
    """The right to finish one attempt of one job: (job id, fencing token).

    A named tuple, not a frozen dataclass: one is made for every job claimed,
    held and acked, and a frozen dataclass costs several times more to build.
    """

    job_id: str
    token: int


@dataclasses.dataclass
class Renewal:
    """What one lease renewal answers: the leases lost, and the cancel requests of the current ones."""

    lost: list = dataclasses.field(default_factory=list)
    cancel: dict = dataclasses.field(default_factory=dict)  # job_id -> {"by", "reason", "at"}


@dataclasses.dataclass
class QueueStats:
    queue: str
    ready: int = 0  # due now
    scheduled: int = 0  # delayed or waiting for a retry backoff
    in_flight: int = 0  # leased
    dead: int = 0
    done: int = 0
    oldest_ready_age: float = 0.0  # seconds the oldest due job has waited
    waiting: int = 0  # workflows: waiting on parents
    cancelled: int = 0
    expired: int = 0
    paused: bool = False

    def to_dict(self):
        return dataclasses.asdict(self)


class Outcome(typing.NamedTuple):
    """What to store: ``op`` is ACK, RETRY, DEAD, RELEASE or DROP (store nothing: the lease is gone).

    Immutable, and a tuple rather than a frozen dataclass: one is built for every job, and a
    frozen dataclass's ``__init__`` costs twice as much (an ``object.__setattr__`` a field)."""

    op: str
    reason: str | None = None  # why the attempt failed (RETRY, DEAD)
    error_class: str = ""
    message: str = ""
    traceback: str = ""
    delay: float | None = None  # RETRY: seconds until the job is due again
    result: object = None  # ACK
    kind: str | None = None  # the failure as reported (``retry_later`` is stored as ``exception``)

    @property
    def failed(self):
        return self.op in (RETRY, DEAD)

    @property
    def hard_timeout(self):
        return self.kind == "timeout" and self.error_class == "HardTimeout"


def error_info(reason, exc_class="", message="", traceback=""):
    """The error record stored with a failed attempt or a dead job.

    Its text comes from handlers: anything a database cannot store is replaced
    here, once for every broker, so the write is never refused and the error
    is never lost. The child already cut long text; the cut here holds for
    every other way an error reaches a broker.
    """
    return {"reason": reason, "class": storable(clip_start(exc_class, MAX_ERROR_CLASS)),
            "message": storable(clip_start(message, MAX_ERROR_MESSAGE)),
            "traceback": storable(clip_end(traceback, MAX_ERROR_TRACEBACK))}
