"""Job ids and trace ids, made at enqueue (the model's ``NewJob.validate`` makes one of each per job),
and what a broker asks of the ids of a batch: which the caller chose, one job per id, the first token."""
import os
import time
import uuid

from .errors import BadInput

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


def new_job_id(now=None):
    """A sortable id: ``job_`` + 48-bit milliseconds + 80 random bits, ULID-style.

    Sorting ids sorts jobs by creation time, which gives brokers a stable
    tie-breaker for "oldest first".
    """
    return job_id_from(time.time() if now is None else now, os.urandom(10))


def job_id_from(now, noise):
    """``new_job_id`` of a time (seconds) and 10 random bytes."""
    n = ((int(now * 1000) << 80) | int.from_bytes(noise, "big")) & _ID_BITS
    # 130 bits (48 + 80 used) are 26 digits, two per 10-bit table entry: the digit loop costs more
    # than the rest of an enqueue's checks.
    p = _PAIRS
    return ("job_" + p[n >> 120] + p[n >> 110 & 1023] + p[n >> 100 & 1023] + p[n >> 90 & 1023]
            + p[n >> 80 & 1023] + p[n >> 70 & 1023] + p[n >> 60 & 1023] + p[n >> 50 & 1023] + p[n >> 40 & 1023]
            + p[n >> 30 & 1023] + p[n >> 20 & 1023] + p[n >> 10 & 1023] + p[n & 1023])


_ID_BITS = (1 << 130) - 1
_PAIRS = tuple(a + b for a in _CROCKFORD for b in _CROCKFORD)  # 10 bits -> two Crockford digits


def new_trace_id():
    return uuid.uuid4().hex


def trace_id_from(noise):
    """``uuid.UUID(bytes=noise, version=4).hex`` (what ``new_trace_id`` makes) without the object."""
    b = bytearray(noise)
    b[6] = (b[6] & 0x0F) | 0x40
    b[8] = (b[8] & 0x3F) | 0x80
    return b.hex()


def id_made(job):
    """Whether ``job``'s id is the one ``validate`` made for it, for its queue: not one its caller
    chose (even one set on the job after a check had made another), nor a made one sent on to
    another queue (a job stored already may hold it there)."""
    return job.__dict__.get("_id_made") == (job.id, job.queue)


def trace_made(job):
    """Whether ``job``'s trace id is the one ``validate`` made for it (see ``id_made``)."""
    return job.__dict__.get("_trace_made") == job.trace_id


def one_per_id(jobs):
    """``(jobs, None)`` when every checked job of a batch has an id of its own, else ``(the jobs
    one per id, for each job the place of its id's job among them)``.

    An id twice in one batch names one job, as across batches: the later ones are resends of
    the first and get its answer, whatever they carry; for two queues it is bad input. Every
    broker stores the first of each id only, so no broker can answer two jobs of one id apart
    (one stored, one held to its idempotency key) or store them in two queues.
    """
    if len({job.id for job in jobs}) == len(jobs):
        return jobs, None
    unique, at, where = [], {}, []
    for job in jobs:
        i = at.get(job.id)
        if i is None:
            i = at[job.id] = len(unique)
            unique.append(job)
        elif unique[i].queue != job.queue:
            raise id_taken(job.id, unique[i].queue)
        where.append(i)
    return unique, where


def chosen_ids(jobs):
    """{id: queue} of the checked ``jobs`` whose id the caller chose (``NewJob(id=...)``).

    Such an id names one job: a resend to its queue returns it (the producer's reply was
    lost), and a job of another queue may not take it (``id_taken``). Ids ``validate`` made
    are unique by construction, so the usual enqueue pays nothing for this.
    """
    chosen = {}
    for job in jobs:
        if not id_made(job) and chosen.setdefault(job.id, job.queue) != job.queue:
            raise id_taken(job.id, chosen[job.id])  # twice in one batch, for two queues
    return chosen


def first_token(job):
    """The fencing token a new job starts from (its first claim's lease gets the next one).

    An id the caller chose can name a job again once the first was deleted
    (discarded, purged, pruned). Starting from the time of the enqueue in
    units of 2**-20 s (about a microsecond), the later of the producer's clock
    and the broker's (``first_token_at``; the Redis scripts and PostgreSQL
    statements take it on the server), the new job's tokens lie above every
    lease of the old one: the old job's token rose by one per claim, and every
    claim and the delete took a broker round trip (far more than a
    microsecond) between the two enqueues. So such a lease can never renew,
    ack or fail the new attempt, and a handler that fences its own writes with
    ``ctx.job.token`` still sees them rise. (Milliseconds times 1,024 on the
    producer's clock, the first scheme, gave the old lease's token again when
    the story fell within one millisecond, or when the second producer's clock
    was behind; 2**20 a second lies above that scheme's 1,024,000, so tokens
    stored under it stay below.)
    Below 2**53 until the year 2242: exact in Lua's doubles (Redis). An id
    ``validate`` made names nothing before it: 0.
    """
    return 0 if id_made(job) else int(time.time() * 1_048_576)


def first_token_at(job, now):
    """``first_token`` no lower than the broker's clock ``now`` says (Redis and PostgreSQL take
    the later of the two in their scripts and statements): a producer whose clock lags (another
    host, a clock stepped back) cannot give the new job a deleted one's lease tokens."""
    token = first_token(job)
    return token and max(token, int(now * 1_048_576))


def id_taken(job_id, queue):
    return BadInput(f"job id {job_id!r} is taken by a job of queue {queue!r}")
