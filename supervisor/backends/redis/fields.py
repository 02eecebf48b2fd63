"""Jobs to and from the strings the Redis broker's scripts take and return."""
import json

from ...errors import BadInput, NotDead
from ...jsonvalues import info_members, result_json
from ...model import JOB_FIELDS, JOB_ORDER, Job, first_token, load_json

_INTS = ("attempt", "max_attempts", "priority", "token", "level")
_FLOATS = ("timeout", "run_at", "queued_at", "lease_until", "first_failure_at", "last_failure_at", "finished_at",
           "expires_at", "progress")
_JSON = ("payload", "result", "error", "cancel_request")
# The Job fields stored as text, with what decodes them (other fields are the hash's own: "level", "open").
_CONVERT = {name: convert for name, convert in {**dict.fromkeys(_INTS, int), **dict.fromkeys(_FLOATS, float),
                                                **dict.fromkeys(_JSON, load_json), "pending": int}.items()
            if name in JOB_FIELDS}


# claimed_row's fields (_common.lua), in its order: the Job's positional fields up to
# ``pending``, then the open attempt.
ROW_FIELDS = JOB_ORDER[:JOB_ORDER.index("pending") + 1] + ("open",)
_ROW_CONVERT = tuple(_CONVERT.get(name) for name in ROW_FIELDS[:-1])
_HISTORY = ROW_FIELDS.index("history")


def from_claim(row):
    """A ``Job`` from one element of a claim's reply (a JSON array): a ``claimed_row``
    ([0, value, ...]), or a whole hash's [field, value, ...] (a workflow child, an expired job)."""
    if row[0] != 0:
        return to_job(row)
    # Positional: the row holds the Job's fields in their order (false: not set).
    try:
        args = [None if v is False else v if convert is None else convert(v)
                for convert, v in zip(_ROW_CONVERT, row[1:-1])]
    except ValueError:
        # A number a hand-edited hash holds as other text: kept as it is, so that the claim
        # dead-letters this job (backends/damaged.py) and hands over the rest of its jobs.
        args = [None if v is False else v if convert is None else _converted(convert, v)
                for convert, v in zip(_ROW_CONVERT, row[1:-1])]
    stored, open_entry = args[_HISTORY], row[-1]  # the open attempt: an object, decoded with the row
    history = [] if stored is None or stored == "[]" else load_json(stored)  # not JSON: the text, as above
    if open_entry and type(history) is list:
        history.append(open_entry)
    args[_HISTORY] = history
    return Job(*args)


def _converted(convert, value):
    try:
        return convert(value)
    except ValueError:
        return value


def enqueue_args(job):
    """One job for enqueue.lua: [id, priority, delay_us, [field, value, ...], idempotency_key?, expires_in_us?]."""
    fields = ["id", job.id, "type", job.type, "queue", job.queue,
              "payload", job.payload_json,
              "max_attempts", str(job.max_attempts), "priority", str(job.priority), "trace_id", job.trace_id,
              "token", str(first_token(job))]
    if job.resource_id is not None:
        fields += ["resource_id", job.resource_id]
    if job.idempotency_key is not None:
        fields += ["idempotency_key", job.idempotency_key]
    if job.timeout is not None:
        fields += ["timeout", repr(float(job.timeout))]
    args = [job.id, job.priority, int(job.delay * 1e6), fields]
    if job.idempotency_key is not None or job.expires_in is not None:
        args.append(job.idempotency_key or False)  # JSON false: Lua's nil would end the list
    if job.expires_in is not None:
        args.append(max(1, int(job.expires_in * 1e6)))
    return args


def ack_batches(acks, most, size):
    """(leases, argument) for each ack_many.lua call of one queue's ``acks`` ((lease, result,
    info) ...): at most ``most`` jobs a call, a call closing at its first job past ``size``
    characters. The argument holds each job's id, token, result JSON and info body, every value
    ended by a NUL byte (the ids must hold none)."""
    leases, texts, length = [], [], 0
    for lease, result, info in acks:
        text = f"{lease.job_id}\0{lease.token}\0{result_json(result)}\0{info_members(info)}\0"
        leases.append(lease)
        texts.append(text)
        length += len(text)
        if len(leases) == most or length >= size:
            yield leases, "".join(texts)
            leases, texts, length = [], [], 0
    if leases:
        yield leases, "".join(texts)


def check_script_reply(reply):
    """A replay or purge script's reply, or the error it reports."""
    if reply[0] == "notdead":
        raise NotDead(f"job {reply[1]} is {reply[2]}, not dead")
    if reply[0] == "conflict":
        raise BadInput(f"cannot replay {reply[1]}: its idempotency key is held by an unfinished job")
    return reply


def to_job(fields):
    """A ``Job`` from a job hash (a dict, or the flat [field, value, ...] list a script returns).

    One pass over the fields: a claim decodes every job it leases, and this was
    the largest part of the master's CPU per claimed job.
    """
    if isinstance(fields, list):
        pairs = iter(fields)
        fields = dict(zip(pairs, pairs))
    d, edges, ends = {}, [], {}
    open_entry = None
    for key, value in fields.items():
        convert = _CONVERT.get(key)
        if convert is not None:
            d[key] = _converted(convert, value)  # a hand-edited number stays text: damaged.py names it
        elif key in JOB_FIELDS:
            d[key] = value
        elif key == "open":
            open_entry = value
        elif key[1:2] == ":":  # a workflow child's parents: "d:<id>" an edge, "p:<id>" that parent's end
            if key[0] == "d":
                edges.append(key[2:])
            elif key[0] == "p":
                ends[key[2:]] = tuple(json.loads(value))
    if "pending" in d:
        d["parents"] = {**dict.fromkeys(sorted(edges), (None, None)), **{p: ends[p] for p in sorted(ends)}}
    stored = d.pop("history", "[]")
    history = [] if stored == "[]" else load_json(stored)  # "[]": a job's first attempt, the usual case
    if open_entry and type(history) is list:
        history.append(load_json(open_entry))
    d["history"] = history
    return Job(**d)
