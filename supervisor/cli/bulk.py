"""Finding jobs and acting on many: ``jobs``, ``cancel``, ``retry``, ``discard``.

Every command takes the same filter options (``--state``, ``--queue``,
``--type``, ``--resource-id``, ``--idempotency-key``, ``--where
payload.KEY=VALUE``, ``--since``/``--until``, ``--error``), checked before
the broker is opened: a bad one is one line and exit 2, nothing changed.

The bulk actions take job ids or filters (not both); with neither they need
``--all``, so a forgotten filter never acts on every job. They walk the
selection page by page (keyset pages stay valid while jobs change state or
go), print one line per job (``ID OUTCOME``; ``--json``: one JSON object a
line, then a summary object) as each batch is done, and with ``--rate`` pace
themselves like ``dlq replay --rate``. A stop partway (broker gone, stdout
closed) is ``stopped after N of M: REASON``, exit 1 (``progress``).
``--dry-run`` prints how many jobs the selection holds and changes nothing; for
``retry`` that is an upper bound (``MAY_REFUSE``).
"""
import math
import re
import time

from ..backends.control import (ACTING_STATES, REQUEUE_REFUSALS, REQUEUE_REFUSED as REFUSED, cancel_request,
                                count_acting)
from ..errors import BadInput
from ..jobfilter import FILTER_STATES, JobFilter, check_page, decode_cursor, parse_wheres
from ..model import parse_rate
from .common import Failure, UsageError, job_id, open_client
from .output import one_line, print_json, say, table, when
from .progress import Progress

PAGE = 500
MIN_RATE = 1 / 3600  # jobs per second: the slowest "N/h" says
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhd]?)")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}

# What a retry (the broker's requeue) may answer for a job its dry run counted (see REQUEUE_REFUSALS).
MAY_REFUSE = {"retry": REQUEUE_REFUSALS}


def add_commands(commands, command, as_json):
    """The parsers of this module's commands (``command`` is the main parser's helper)."""
    p = command(commands, "jobs", cmd_jobs, "find jobs by state, queue, type, payload field...", as_json)
    _filters(p)
    p.add_argument("--limit", type=int, default=50, metavar="N", help="jobs per page (default 50, at most 1000)")
    p.add_argument("--cursor", metavar="C", help="the next page (printed under the previous one)")
    p.add_argument("--oldest", action="store_true", help="oldest first (default: newest first)")

    verbs = {"cancel": "cancel jobs: queued ones at once, running ones at their next heartbeat",
             "retry": "put dead, cancelled or expired jobs back on their queue (attempts reset, history kept)",
             "discard": "delete jobs that are not running, for good"}
    for verb, help in verbs.items():
        p = command(commands, verb, cmd_bulk, help, as_json)
        p.set_defaults(verb=verb)
        p.add_argument("job_ids", nargs="*", metavar="ID", type=job_id, help="the jobs (or select them with the filters)")
        _filters(p)
        p.add_argument("--all", action="store_true", help="with no ids and no filters: every job")
        p.add_argument("--dry-run", action="store_true", help="print how many jobs it would act on; change nothing")
        p.add_argument("--rate", metavar="N/s", help="at most N jobs per second (or N/m, N/h)")
        if verb == "cancel":
            p.add_argument("--by", metavar="NAME", help="who cancels (default: $USER)")
            p.add_argument("--reason", default="", metavar="TEXT", help="why, kept in the job's history")


def _filters(p):
    p.add_argument("--state", action="append", metavar="S",
                   help=f"{', '.join(FILTER_STATES)} (repeat or comma-separate for several; scheduled: queued or"
                   " retrying, due later)")
    p.add_argument("--queue", metavar="Q")
    p.add_argument("--type", metavar="T")
    p.add_argument("--resource-id", metavar="R")
    p.add_argument("--idempotency-key", metavar="K")
    p.add_argument("--where", action="append", metavar="payload.KEY=VALUE",
                   help="a payload field equals VALUE (JSON, else a string); dotted keys reach nested fields")
    p.add_argument("--since", metavar="DURATION", help="queued within the last DURATION (90s, 15m, 2h, 7d)")
    p.add_argument("--until", metavar="DURATION", help="queued more than DURATION ago")
    p.add_argument("--error", metavar="TEXT", help="dead or retrying with TEXT in the error (any case)")


def parse_duration(text, option):
    m = _DURATION.fullmatch(text.strip()) if isinstance(text, str) else None
    seconds = float(m.group(1)) * _UNITS[m.group(2)] if m else None
    if seconds is None or not math.isfinite(seconds):  # 400 digits are an infinite float
        raise BadInput(f"{option} expects a duration like 90s, 15m, 2h or 7d, got {text!r}")
    return seconds


def filter_of(args, default_states=()):
    """The ``JobFilter`` the options name (BadInput on a bad one); times are resolved at the broker later."""
    states = [s.strip() for item in args.state or () for s in item.split(",")]
    if "" in states:  # else `--state ''` (an unset variable) would quietly widen the selection to every state
        raise BadInput("--state needs a state name (repeat --state or comma-separate for several)")
    payload = parse_wheres(args.where or ())
    fields = dict(state=tuple(states) or tuple(default_states), queue=args.queue, type=args.type,
                  resource_id=args.resource_id, idempotency_key=args.idempotency_key, error=args.error,
                  payload=payload)
    since = parse_duration(args.since, "--since") if args.since is not None else None
    until = parse_duration(args.until, "--until") if args.until is not None else None
    f = JobFilter(**fields)  # checks everything now, before the broker is opened
    return f, since, until, bool(states) or any(v for k, v in fields.items() if k != "state") or \
        since is not None or until is not None


def _with_times(f, broker, since, until):
    if since is None and until is None:
        return f
    now = broker.now()
    d = f.to_dict()
    if since is not None:
        d["queued_after"] = now - since
    if until is not None:
        d["queued_before"] = now - until
    return JobFilter.from_dict(d)


def cmd_jobs(args):
    f, since, until, _ = filter_of(args)
    order = "oldest" if args.oldest else "newest"
    check_page(args.limit, order)
    if args.cursor is not None:
        decode_cursor(args.cursor, order)
    with open_client(args) as client:
        page = client.broker.search(_with_times(f, client.broker, since, until), cursor=args.cursor,
                                    limit=args.limit, order=order)
    if args.json:
        print_json({"jobs": [job.to_dict() for job in page.jobs], "next_cursor": page.next_cursor})
        return
    if page.jobs:
        rows = [[j.id, j.type, j.queue, j.state, f"{j.attempt}/{j.attempts_allowed}", when(j.queued_at),
                 one_line(((j.error or {}).get("class") or "") + ": " + ((j.error or {}).get("message") or ""), 40)
                 if j.error else "-"] for j in page.jobs]
        say(table(["ID", "TYPE", "QUEUE", "STATE", "ATTEMPTS", "QUEUED", "ERROR"], rows))
    else:
        print("no jobs on this page" if args.cursor or page.next_cursor else "no jobs")
    if page.next_cursor:
        print(f"next page: --cursor {page.next_cursor}")


def cmd_bulk(args):
    verb = args.verb
    # Without --state, a bulk action looks at the states it can act on.
    f, since, until, filtered = filter_of(args, ACTING_STATES[verb] if not args.state else ())
    if args.job_ids and filtered:
        raise UsageError(f"{verb}: give job ids or filters, not both")
    if args.job_ids and args.all:
        raise UsageError(f"{verb}: give job ids or --all, not both")
    if not args.job_ids and not filtered and not args.all:
        raise UsageError(f"{verb}: give job ids or filters (--state, --type, --where...), or --all for every job")
    rate = _rate(args.rate) if args.rate is not None else None
    by = getattr(args, "by", None)
    if verb == "cancel":  # a --by or --reason the broker refuses: before anything (--dry-run too)
        cancel_request(by or _user(), args.reason, None)
    with open_client(args) as client:
        broker = client.broker
        if args.job_ids:
            batches, selected, exact = iter([list(dict.fromkeys(args.job_ids))]), len(set(args.job_ids)), True
        else:
            f = _with_times(f, broker, since, until)
            count = broker.count(f)
            batches, selected, exact = pages(broker, f), count.n, count.exact
        if args.dry_run and not args.job_ids and args.state:
            # --state says where to look, not what the action changes: only those are counted.
            selected, exact = count_acting(broker, verb, f)
        if args.dry_run:
            unknown, named = [], {}
            if args.job_ids:  # named ones: those in a state the action changes, not every id given
                selected, unknown = _would_act(broker, verb, list(dict.fromkeys(args.job_ids)))
                named = {"unknown": len(unknown)}
            if verb in MAY_REFUSE:
                named["may_refuse"] = list(MAY_REFUSE[verb])
            if args.json:
                print_json({"verb": verb, "count": selected, "exact": exact, "dry_run": True, **named})
            else:
                unknown_note = f"; {len(unknown)} id(s) name no job" if unknown else ""
                refused_note = f", or fewer: {REFUSED}" if verb in MAY_REFUSE else ""
                print(f"would {verb} {'' if exact else 'about '}{selected} job(s){refused_note}{unknown_note}")
            _not_found(verb, unknown, args.job_ids)
            return
        act = _action(broker, verb, by or _user(), getattr(args, "reason", ""))
        progress = Progress(verb, args.json, selected, exact)
        unknown = []
        began = time.monotonic()
        with progress.running():
            for batch in batches:
                step = 1 if rate else PAGE
                for start in range(0, len(batch), step):
                    chunk = batch[start:start + step]
                    if rate:
                        pause = began + progress.done / rate - time.monotonic()
                        if pause > 0:
                            time.sleep(pause)  # pacing, so a bulk retry does not flood the workers
                    got = act(chunk)
                    got = {job_id: got.get(job_id, "unknown") for job_id in chunk}
                    if args.job_ids:
                        unknown += [job_id for job_id, outcome in got.items() if outcome == "unknown"]
                    progress.report(got)
    summary = ", ".join(f"{n} {outcome}" for outcome, n in sorted(progress.outcomes.items()))
    progress.finish(f"{verb}: {summary or 'no jobs matched'}")
    _not_found(verb, unknown, args.job_ids)


def _not_found(verb, unknown, ids):
    """Exit 1 once the known ids were acted on, when any named id is no job: the outcome line
    alone left a script (and an on-call engineer reading `$?`) unable to tell."""
    if unknown:
        shown = " ".join(unknown[:10]) + (f" (and {len(unknown) - 10} more)" if len(unknown) > 10 else "")
        raise Failure(f"{verb}: {len(unknown)} of {len(set(ids))} id(s) name no job: {shown}")


def _would_act(broker, verb, ids):
    """Of ``ids``: how many jobs the action would change (in a state it acts on; discard: any but
    running), and the ids that name no job."""
    acts, unknown = 0, []
    for one in ids:
        job = broker.get(one)
        if job is None:
            unknown.append(one)
        elif job.state != "running" if verb == "discard" else job.state in ACTING_STATES[verb]:
            acts += 1
    return acts, unknown


def pages(broker, f):
    """The ids ``f`` selects, oldest first, a page at a time: memory holds a page however many match."""
    cursor = None
    while True:
        page = broker.search(f, cursor=cursor, limit=PAGE, order="oldest")
        if page.jobs:
            yield [job.id for job in page.jobs]
        cursor = page.next_cursor
        if cursor is None:
            return


def _action(broker, verb, by, reason):
    if verb == "cancel":
        return lambda ids: broker.cancel(ids, by, reason)
    return broker.requeue if verb == "retry" else broker.discard


def _rate(text):
    try:
        if re.fullmatch(r"\d+(\.\d+)?", text.strip()):
            per_second = float(text)
        else:
            count, per = parse_rate(text)
            per_second = count / per
    except ValueError as exc:
        raise BadInput(f"--rate: {exc}") from None
    if not per_second > 0:
        raise BadInput(f"--rate must be more than 0, got {text!r}")
    if per_second < MIN_RATE:  # 1e-13 acted on one job, then its pause overflowed the clock
        raise BadInput(f"--rate must be at least 1/h (a bare number is per second), got {text!r}")
    return per_second


def _user():
    import getpass

    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "cli"
