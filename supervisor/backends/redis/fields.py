"""Jobs to and from the strings the Redis broker's scripts take and return."""
import json

from ...errors import BadInput, NotDead
from ...model import Job, load_json

_INTS = ("attempt", "max_attempts", "priority", "token", "level")
_FLOATS = ("timeout", "run_at", "queued_at", "lease_until", "first_failure_at", "last_failure_at", "finished_at",
           "expires_at", "progress")
_JSON = ("payload", "result", "error", "cancel_request")


def enqueue_args(job):
    """One job for enqueue.lua: [id, priority, delay_us, [field, value, ...], idempotency_key?, expires_in_us?]."""
    fields = ["id", job.id, "type", job.type, "queue", job.queue,
              "payload", job.payload_json,
              "max_attempts", str(job.max_attempts), "priority", str(job.priority), "trace_id", job.trace_id]
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


def body(info):
    """The caller's info dict as the inside of a JSON object ('' when empty)."""
    return json.dumps(info, separators=(",", ":"))[1:-1] if info else ""


def check_script_reply(reply):
    """A replay or purge script's reply, or the error it reports."""
    if reply[0] == "notdead":
        raise NotDead(f"job {reply[1]} is {reply[2]}, not dead")
    if reply[0] == "conflict":
        raise BadInput(f"cannot replay {reply[1]}: its idempotency key is held by an unfinished job")
    return reply


def to_job(fields):
    """A ``Job`` from a job hash (a dict, or the flat [field, value, ...] list a script returns)."""
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
    if "pending" in d:  # a workflow's child: its finished parents are the "p:<id>" fields
        d["pending"] = int(d["pending"])
        d["parents"] = {}
    for name in sorted(name for name in d if name[1:2] == ":" and name[0] in "pdk"):
        value = d.pop(name)  # sorted: a parent's "d:" (its edge) comes before its "p:" (its end)
        if name[0] == "d":
            d["parents"][name[2:]] = (None, None)
        elif name[0] == "p":
            state, result = json.loads(value)
            d["parents"][name[2:]] = (state, result)
    history = json.loads(d.pop("history", "[]"))
    open_entry = d.pop("open", None)
    if open_entry:
        history.append(json.loads(open_entry))
    d["history"] = history
    return Job.from_dict(d)
