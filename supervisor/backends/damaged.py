"""A claimed job whose stored record no worker can be given: why, in one line.

Every broker stores what ``NewJob.validate`` let through, but a record can be
written behind the producer API's back (a hand-edited row, a hash set from
``redis-cli``, an older version's data). The claim leases such a job like any
other; the supervisor would then compute with its fields (its attempts, its
priority, its hard timeout), and a field holding no value of its type raised
in the master's loop: the master ended, and every restart claimed the same job
again. A job with such a field is dead-lettered at claim instead, with reason
``bad_payload`` as for a payload that does not decode, and the jobs behind it
run (``Broker._runnable``).

The claim itself repairs ``attempt`` and ``token`` on SQLite and Redis (it
counts them up from a number, 0 for text that is none) and PostgreSQL's
columns are typed, so what is left to look at is ``max_attempts``,
``priority``, ``timeout`` and ``history``.
"""
from ..model import payload_problem

_SHOWN = 60  # characters of a damaged value in the message


def problem(job):
    """Why ``job`` (just claimed) cannot be handed to a worker, or None."""
    found = payload_problem(job.payload)
    if found is not None:
        return found
    if (type(job.max_attempts) is int and type(job.priority) is int and type(job.history) is list
            and (job.timeout is None or (type(job.timeout) in (int, float) and 0 < job.timeout < float("inf")))):
        return None  # every record the API wrote: one test
    for name in ("max_attempts", "priority"):
        if type(getattr(job, name)) is not int:
            return f"the stored {name} is not an integer: {_shown(getattr(job, name))}"
    if type(job.history) is not list:
        return f"the stored history is not a JSON array: {_shown(job.history)}"
    return f"the stored timeout is not a number of seconds > 0: {_shown(job.timeout)}"


def _shown(value):
    text = repr(value)
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."
