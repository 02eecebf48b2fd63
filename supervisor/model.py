"""The job model: ids, states, the record a broker stores, and input checks."""
import dataclasses
import json
import math
import os
import time
import uuid

from .errors import BadInput

QUEUED, RUNNING, RETRYING, DONE, DEAD = "queued", "running", "retrying", "done", "dead"
STATES = (QUEUED, RUNNING, RETRYING, DONE, DEAD)
UNFINISHED = (QUEUED, RUNNING, RETRYING)

# Reason codes of a dead-lettered job (and of a failed attempt).
REASONS = ("exception", "permanent", "timeout", "crashed", "lease_expired", "unknown_type", "bad_payload",
           "result_too_large")

# What the master stores when an attempt ends (``Outcome.op``). DEAD, the state,
# doubles as the op that leads to it; DROP stores nothing (the lease is gone).
ACK, RETRY, RELEASE, DROP = "ack", "retry", "release", "drop"

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


def new_job_id(now=None):
    """A sortable id: ``job_`` + 48-bit milliseconds + 80 random bits, ULID-style.

    Sorting ids sorts jobs by creation time, which gives brokers a stable
    tie-breaker for "oldest first".
    """
    ms = int((time.time() if now is None else now) * 1000)
    n = (ms << 80) | int.from_bytes(os.urandom(10), "big")
    chars = []
    for _ in range(26):
        chars.append(_CROCKFORD[n & 31])
        n >>= 5
    return "job_" + "".join(reversed(chars))


def new_trace_id():
    return uuid.uuid4().hex


def check_json(value, what):
    """Return ``value`` serialised as JSON, or raise BadInput naming ``what``."""
    try:
        return json.dumps(value, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise BadInput(f"{what} must be JSON-serialisable: {exc}") from None


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

    def validate(self):
        """Raise BadInput on anything a broker must not store; fill defaults."""
        if not isinstance(self.type, str) or not self.type.strip():
            raise BadInput("job type must be a non-empty string")
        if not isinstance(self.queue, str) or not self.queue.strip():
            raise BadInput("queue must be a non-empty string")
        if not isinstance(self.payload, dict):
            raise BadInput(f"payload must be a JSON object, got {type(self.payload).__name__}")
        check_json(self.payload, "payload")
        for name in ("resource_id", "idempotency_key", "trace_id"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise BadInput(f"{name} must be a string")
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise BadInput(f"max_attempts must be a positive integer, got {self.max_attempts!r}")
        if self.timeout is not None and not _positive(self.timeout):
            raise BadInput(f"timeout must be a positive number of seconds, got {self.timeout!r}")
        if not _number(self.delay) or self.delay < 0:
            raise BadInput(f"delay must be a number of seconds >= 0, got {self.delay!r}")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise BadInput(f"priority must be an integer, got {self.priority!r}")
        if not self.id:
            self.id = new_job_id()
        if not self.trace_id:
            self.trace_id = new_trace_id()
        return self


def _number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _positive(x):
    return _number(x) and x > 0


RATE_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def parse_rate(text):
    """``"100/m"`` -> ``(100, 60.0)``: N jobs per second, minute or hour. ValueError otherwise."""
    count, _, unit = text.partition("/") if isinstance(text, str) else ("", "", "")
    if not count.strip().isdigit() or int(count) < 1 or unit.strip() not in RATE_UNITS:
        raise ValueError(f'expected "N/s", "N/m" or "N/h", got {text!r}')
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
            count, per = self.rate
            if isinstance(count, bool) or not isinstance(count, int) or count < 1 or not _positive(per):
                raise BadInput(f"rate must be (count >= 1, seconds > 0), got {self.rate!r}")
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

    @property
    def lease(self):
        return Lease(self.id, self.token)

    def to_dict(self):
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d):
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclasses.dataclass(frozen=True)
class Lease:
    """The right to finish one attempt of one job: (job id, fencing token)."""

    job_id: str
    token: int


@dataclasses.dataclass
class QueueStats:
    queue: str
    ready: int = 0  # due now
    scheduled: int = 0  # delayed or waiting for a retry backoff
    in_flight: int = 0  # leased
    dead: int = 0
    done: int = 0
    oldest_ready_age: float = 0.0  # seconds the oldest due job has waited

    def to_dict(self):
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What to store: ``op`` is ACK, RETRY, DEAD, RELEASE or DROP (store nothing: the lease is gone)."""

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
    """The error record stored with a failed attempt or a dead job."""
    return {"reason": reason, "class": exc_class, "message": message, "traceback": traceback}
