"""What every broker's job-control operations share: their input checks and the records they store.

Each check raises BadInput naming what is wrong before anything is written, so
cancel, pause, renew and the supervisor records refuse the same input on every
backend.
"""
import collections
import dataclasses
import json
import math
import time

from ..errors import BadInput
from ..jobfilter import FILTER_STATES, SCHEDULED
from ..model import FINISHED, MAX_NAME, RUNNING, STATES, check_json, is_storable, storable

MAX_NOTE = 200  # characters of a progress note kept (a handler may send anything)
MAX_IDS = 10_000  # job ids in one cancel call
GONE_FOR = 3600.0  # seconds a gone supervisor record is still shown before it is removed
MAX_RECORD = 256 * 1024  # bytes of one supervisor record (a few hundred workers)
EXPIRED_KEPT = 10_000  # expired (id, type) pairs an instance keeps for take_expired between calls
# What a requeue may answer for a job in a state it acts on: an on="success" parent lies dead,
# cancelled or expired; an unfinished job holds its idempotency key. A dry run (a count) cannot
# tell them apart: a job's record gives its parents' ends but not each edge's on= (an
# on="complete" child of a dead parent goes back), nor who holds a key.
REQUEUE_REFUSALS = ("parent_failed", "conflict")
REQUEUE_REFUSED = ('the retry refuses any whose on="success" parent lies dead, cancelled or expired (parent_failed)'
                   " or whose idempotency key an unfinished job holds (conflict)")


# The states a bulk action changes a job in (a running job's discard is refused): a filter's other
# states are not looked at, so a dry run counts only what would change, and a capped run is not
# spent answering "already_done" to finished jobs while the ones to act on wait past the cap.
ACTING_STATES = {
    "cancel": ("waiting", "queued", "running", "retrying", SCHEDULED),
    "retry": ("dead", "cancelled", "expired"),
    "discard": tuple(s for s in FILTER_STATES if s != RUNNING),
}


def acting(action, flt):
    """The ``JobFilter`` ``flt`` narrowed to the states ``action`` changes; None if it leaves none."""
    states = tuple(s for s in (flt.state or STATES) if s in ACTING_STATES[action])
    return dataclasses.replace(flt, state=states) if states else None


def count_acting(broker, action, flt):
    """(how many, exact) of the jobs ``flt`` selects that ``action`` would change: what a dry run
    (the CLI's ``--dry-run``, the console's confirmation) says."""
    flt = acting(action, flt)
    if flt is None:
        return 0, True
    count = broker.count(flt)
    return count.n, count.exact


def check_ids(job_ids, most=MAX_IDS):
    """A list of job ids (strings), each once, or BadInput. ``most=None``: any number (the dead
    letters' calls take a whole selection: the console replays a group of any size)."""
    job_ids = listed(job_ids, "job ids")
    if most is not None and len(job_ids) > most:
        raise BadInput(f"at most {MAX_IDS} job ids at once, got {len(job_ids)}")
    for job_id in job_ids:
        check_id(job_id)
    return list(dict.fromkeys(job_ids))


def listed(values, what):
    """``values`` as a list: one string is itself (an id, not its letters), and what is no list
    at all (``cancel(5)``, ``requeue(None)``) BadInput, not a TypeError from deep inside."""
    if isinstance(values, str):
        return [values]
    try:
        return list(values)
    except TypeError:
        raise BadInput(f"{what} must be a list (or one string), got {type(values).__name__}") from None


def check_id(job_id, what="job"):
    """One id a job (``what="supervisor"``: a supervisor record) can have, else BadInput: SQLite
    raised UnicodeEncodeError on a lone surrogate, PostgreSQL failed on a NUL as an outage."""
    if not isinstance(job_id, str) or not job_id or len(job_id) > MAX_NAME or not is_storable(job_id):
        raise BadInput(f"{what} id must be a string of 1 to {MAX_NAME} characters (no NUL or lone surrogate),"
                       f" got {job_id!r}")
    return job_id


def check_limit(limit):
    """A listing's ``limit``: None (no limit) or a whole number >= 0, else BadInput. (SQLite read
    -1 as no limit, Redis as all but the last, PostgreSQL failed.)"""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise BadInput(f"limit must be a whole number >= 0 or None, got {limit!r}")
    return limit


def check_type(type):
    """``dlq_list``'s ``type``: None (or "") for every type, else text a job's type can be, or
    BadInput as a search's type filter. (A NUL or a lone surrogate, which ``dlq list --type``
    passes for a byte that is no UTF-8: Redis listed nothing, SQLite raised UnicodeEncodeError,
    PostgreSQL failed as an outage.)"""
    if type is None or type == "":
        return None
    if not isinstance(type, str) or len(type) > MAX_NAME or not is_storable(type):
        raise BadInput(f"type filter must be 1 to {MAX_NAME} characters, no NUL or lone surrogate, got {type!r}")
    return type


def check_age(seconds):
    """``prune``'s ``done_older_than``: a finite number of seconds (below 0: a cutoff ahead of now,
    everything finished so far), else BadInput rather than a cutoff no row can pass."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds):
        raise BadInput(f"done_older_than must be a finite number of seconds, got {seconds!r}")
    return seconds


def cancel_request(by, reason, at):
    """The ``{"by", "reason", "at"}`` stored with a cancel; ``by``/``reason`` optional text."""
    for name, value in (("by", by), ("reason", reason)):
        if value is not None and not isinstance(value, str):
            raise BadInput(f"cancel {name} must be a string, got {type(value).__name__}")
        if value is not None and len(value) > 1000:
            raise BadInput(f"cancel {name} is {len(value)} characters long, more than 1000")
    return {"by": storable(by), "reason": storable(reason), "at": at}


def cancel_entry(request):
    """The history entry of a job cancelled before it ran."""
    return {"outcome": "cancelled", "by": request["by"], "reason": request["reason"], "at": request["at"]}


def answer_for(state):
    """What ``cancel`` reports for a job in ``state`` that it did not change."""
    return f"already_{state}" if state in FINISHED else "requested"


def progress_value(value):
    """``(fraction, note)`` as stored: fraction a float clamped to 0..1 (None if not a number), note text.

    The value comes from a handler through the master: anything odd is made
    harmless here, never refused, so a renewal is never refused for it.
    """
    try:
        fraction, note = value
    except (TypeError, ValueError):
        fraction, note = value, None
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not math.isfinite(fraction):
        fraction = None
    else:
        fraction = min(1.0, max(0.0, float(fraction)))
    note = storable(note[:MAX_NOTE]) if isinstance(note, str) and note else None
    return fraction, note


def expired_entry(now, expires_at):
    return {"outcome": "expired", "at": now, "expires_at": expires_at}


def check_record(record, ttl):
    """``(id, record as JSON text)`` of a supervisor record, or BadInput."""
    if not isinstance(record, dict):
        raise BadInput("a supervisor record must be a JSON object")
    sid = check_id(record.get("id"), "supervisor")
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not math.isfinite(ttl) or ttl <= 0:
        raise BadInput(f"ttl must be a positive number of seconds, got {ttl!r}")
    text = check_json(record, "supervisor record")
    if len(text) > MAX_RECORD:
        raise BadInput(f"supervisor record is {len(text)} bytes, more than {MAX_RECORD}")
    return sid, text


def shown_record(text, last_heartbeat, ttl, now):
    """A stored record as ``supervisors()`` returns it: with ``last_heartbeat`` and ``gone``."""
    record = json.loads(text) if isinstance(text, (str, bytes)) else dict(text)
    record["last_heartbeat"] = last_heartbeat
    record["gone"] = now > last_heartbeat + ttl
    return record


def record_queues(records):
    """The queues the live supervisor records serve."""
    names = set()
    for record in records:
        if not record["gone"]:
            names.update(q for q in record.get("queues") or () if isinstance(q, str))
    return names


def check_timeout(timeout):
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) \
            or timeout < 0:
        raise BadInput(f"timeout must be a number of seconds >= 0, got {timeout!r}")
    return float(timeout)


def wait_finished(job_id, get, block, timeout, fallback):
    """The loop every broker's ``wait`` runs: ``get()`` the job, ``block(seconds)`` until notified.

    The caller starts listening before calling this, so a job finishing
    between the first read and the first block still wakes it. ``fallback``
    bounds each block: a notification missed (a reconnect, a recycled
    watch) costs at most that long, never the whole timeout.
    """
    deadline = time.monotonic() + check_timeout(timeout)
    while True:
        job = get()
        if job is None:
            raise BadInput(f"unknown job {job_id}")
        if job.state in FINISHED:
            return job
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        block(min(left, fallback))


class ExpiredLog:
    """A broker's record of the jobs its claims ended ``expired``, for ``take_expired``.

    Per instance and bounded: the supervisor that claimed takes them once per loop
    turn to count and log them; an instance nobody asks keeps only the newest.
    """

    @property
    def _expired_log(self):
        if "_expired" not in self.__dict__:
            self._expired = collections.deque(maxlen=EXPIRED_KEPT)
        return self._expired

    def take_expired(self):
        taken = list(self._expired_log)
        self._expired_log.clear()
        return taken
