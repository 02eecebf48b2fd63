"""Producing and reading jobs: ``enqueue``, ``job``, ``stats``, ``schedules``."""
import datetime
import json
import os
import time

from .. import schemas
from ..errors import BadInput
from ..model import MAX_DEPTH
from . import control
from .common import Failure, UsageError, import_handlers, load_config, open_client
from .flows import render_parents
from .output import duration, one_line, print_json, say, table, when

_JSON_TYPES = {dict: "object", list: "list", str: "string", int: "number", float: "number", bool: "boolean",
               type(None): "null"}


def _no_repeated_keys(pairs):
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen = set()
        key = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"key {key!r} given twice (only one of its values would be stored)")
    return obj


def parse_payload(text):
    try:
        payload = json.loads(text, object_pairs_hook=_no_repeated_keys)
    except ValueError as exc:
        raise BadInput(f"payload: malformed JSON: {exc}") from None
    except RecursionError:
        raise BadInput(f"payload: nested more than {MAX_DEPTH} levels deep") from None
    if not isinstance(payload, dict):
        raise BadInput(f"payload: expected a JSON object, got {_JSON_TYPES.get(type(payload), type(payload).__name__)}")
    return payload


def cmd_enqueue(args):
    if args.idempotency_key is not None and not args.idempotency_key.strip():
        # An unset variable (`--idempotency-key "$KEY"`): every job enqueued so would be the first one.
        raise BadInput("--idempotency-key needs a key (an empty one makes every job given it one job)")
    if args.queue is not None and not args.queue.strip():  # the same: the type's queue was taken instead
        raise BadInput("--queue needs a queue name (leave it out for the type's queue)")
    if args.resource_id is not None and not args.resource_id.strip():
        # The same: every job given it shared resource "" (one at a time for an exclusive type).
        raise BadInput("--resource-id needs an id (an empty one makes every job given it share one resource)")
    payload = parse_payload(args.payload)
    cfg = load_config(args)
    payload, handler_queue = schemas.check_cli_payload(lambda: import_handlers(cfg), args.type, payload)
    with open_client(args, cfg) as client:
        # The queue as .enqueue() picks it: the option, [jobs.types.<type>].queue, the decorator's queue=.
        queue = args.queue or cfg.job_type(args.type).queue or handler_queue
        # new_job checks everything before the broker is opened: a bad value stores nothing.
        options = dict(queue=queue, resource_id=args.resource_id, idempotency_key=args.idempotency_key,
                       delay=args.delay, max_attempts=args.max_attempts, timeout=args.timeout,
                       trace_id=args.trace_id, priority=args.priority, expires_in=args.expires_in,
                       depends_on=[tuple(d.rsplit(":", 1)) if d.endswith((":complete", ":success")) else d
                                   for d in args.depends_on])
        client.new_job(args.type, payload, **options)
        print(client.enqueue(args.type, payload, **options))


def get_job(broker, job_id):
    job = broker.get(job_id)
    if job is None:
        raise Failure(f"job {job_id} not found")
    return job


def cmd_job(args):
    code = 0
    # Else `job ID --timeout 60` printed the job at once and exited 0, as if it had finished.
    if getattr(args, "timeout", None) is not None and not getattr(args, "wait", False):
        raise UsageError("job: --timeout only goes with --wait")
    with open_client(args) as client:
        if getattr(args, "wait", False):
            job = control.wait_job(client, args.job_id, args.timeout)
            code = control.exit_code(job, args.job_id, args.timeout)
            job = job or get_job(client.broker, args.job_id)
        else:
            job = get_job(client.broker, args.job_id)
    if args.json:  # attempts_allowed as the console's API gives it: what runs, not the producer's default
        print_json(dict(job.to_dict(), attempts_allowed=job.attempts_allowed))
    else:
        say(render_job(job))
    return code


def render_job(job):
    """A job, every field and its history, for reading."""
    state = job.state + (f" ({job.reason})" if job.reason else "")
    fields = [
        ("id", job.id), ("type", job.type), ("queue", job.queue), ("state", state),
        ("attempt", f"{job.attempt} of {job.attempts_allowed}"), ("priority", job.priority),
        ("payload", json.dumps(job.payload, sort_keys=True)), ("resource_id", job.resource_id),
        ("idempotency_key", job.idempotency_key), ("trace_id", job.trace_id),
        ("timeout", duration(job.timeout) if job.timeout else "-"),
        ("queued_at", when(job.queued_at)), ("run_at", when(job.run_at)),
        ("lease", f"token {job.token}, owner {job.owner or '-'}, until {when(job.lease_until)}"),
        ("first_failure_at", when(job.first_failure_at)), ("last_failure_at", when(job.last_failure_at)),
        ("finished_at", when(job.finished_at)), ("expires_at", when(job.expires_at)),
        ("progress", progress(job)), ("cancel_request", cancel_text(job.cancel_request)),
        ("result", "-" if job.result is None else json.dumps(job.result, sort_keys=True)),
    ]
    lines = [f"{k + ':':<17} {'-' if v is None else v}" for k, v in fields]
    return "\n".join(lines + render_parents(job) + render_error(job.error, "error:") + render_history(job.history))


def progress(job):
    if job.progress is None:
        return "-"
    return f"{job.progress:.0%}" + (f" {one_line(job.progress_note, 100)}" if job.progress_note else "")


def cancel_text(request):
    if not isinstance(request, dict):
        return "-"
    return (f"by {request.get('by') or '-'} at {when(request.get('at'))}"
            + (f": {one_line(request.get('reason'), 100)}" if request.get("reason") else ""))


def render_history(history):
    # A record written behind the API's back may hold anything here: shown, never a traceback.
    if not isinstance(history, list):
        return [f"history:          not a list: {one_line(repr(history), 100)}"]
    lines = [f"history:          {len(history)} attempt(s)"]
    for entry in history:
        if not isinstance(entry, dict):
            lines.append(f"  not an attempt: {one_line(repr(entry), 100)}")
            continue
        lines.append("  " + render_attempt(entry))
        err = entry.get("error")
        if isinstance(err, dict):
            lines.append(f"      {err.get('class') or err.get('reason') or 'error'}: {one_line(err.get('message'), 100)}")
    return lines


def render_error(error, label):
    if not error:
        return [f"{label:<17} -"]
    if not isinstance(error, dict):
        return [f"{label:<17} {one_line(repr(error), 100)}"]
    lines = [f"{label:<17} {error.get('class') or '-'}: {error.get('message') or ''}".rstrip(),
             f"  reason:         {error.get('reason') or '-'}"]
    if error.get("traceback"):
        lines.append("  traceback:")
        lines += ["    " + line for line in str(error["traceback"]).rstrip().splitlines()]
    return lines


def render_attempt(entry):
    started, ended = entry.get("started_at"), entry.get("ended_at")
    took = duration(ended - started) if isinstance(started, (int, float)) and isinstance(ended, (int, float)) else "-"
    text = (f"#{entry.get('attempt', '?')} {entry.get('outcome') or 'running'} started {when(started)}"
            f" ended {when(ended)} ({took}) owner {entry.get('owner') or '-'}")
    known = {"attempt", "outcome", "started_at", "ended_at", "owner", "error"}
    extra = {k: v for k, v in entry.items() if k not in known}
    if extra:
        text += " " + " ".join(f"{k}={v}" for k, v in sorted(extra.items()))
    return text


def cmd_stats(args):
    with open_client(args) as client:
        stats = client.stats()
    if args.json:
        print_json({q: s.to_dict() for q, s in stats.items()})
        return
    # WAITING: callbacks whose parents have not all finished; without it a queue of them looked empty.
    headers = ["QUEUE", "READY", "SCHEDULED", "WAITING", "IN_FLIGHT", "DEAD", "DONE", "OLDEST_READY", "PAUSED"]
    rows = [[q, s.ready, s.scheduled, s.waiting, s.in_flight, s.dead, s.done,
             duration(s.oldest_ready_age) if s.ready else "-",
             "paused" if s.paused else "-"] for q, s in stats.items()]
    say(table(headers, rows))


def cmd_schedules(args):
    """``[schedules.*]`` plus the handlers' ``cron=``; next runs by this host's clock."""
    from .. import scheduler

    cfg = load_config(args)
    # As `run` imports them: a trial first, what a module prints to stderr (--json is stdout's).
    handlers = import_handlers(cfg) if os.path.isdir(cfg.supervisor.handlers) else {}
    listing = scheduler.Scheduler(scheduler.schedules_from(cfg, handlers), None).listing(time.time())
    for item in listing:
        item["next_run_iso"] = datetime.datetime.fromtimestamp(item["next_run"], datetime.timezone.utc).isoformat()
    if args.json:
        print_json(listing)
        return
    if not listing:
        print("no schedules")
        return
    rows = [[i["name"], i["cron"], i["timezone"], i["type"], i["queue"] or "-", i["next_run_iso"]] for i in listing]
    say(table(["NAME", "CRON", "TIMEZONE", "TYPE", "QUEUE", "NEXT_RUN (UTC)"], rows))
